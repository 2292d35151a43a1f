"""Timing of ssd_varlen (triton) next to mamba_ssm's Triton mamba_chunk_scan_combined (GPU).

python3 scripts/bench_ssd.py OUT.jsonl [--sweep] [--lengths 4096,16384]
Shape: H=128, P=64, G=8, N=128, chunk 256, batch 1, bf16, z, D, dt_bias, final state. Each figure is the
median of triton.testing.do_bench. With --sweep, launch parameters of each stage are swept first and the
best set is used for the end-to-end timing (printed as TUNING=...).
"""
import json
import sys
import time

import torch
import triton
from triton.testing import do_bench

from harness import ops as C_
import harness.impls.triton.ssd as ssd

import os

TINY = os.environ.get("BENCH_TINY") == "1"  # CPU smoke test of this script (TRITON_INTERPRET=1)
H, P, G, N, CS = (4, 16, 2, 16, 16) if TINY else (128, 64, 8, 128, 256)
dev = "cpu" if TINY else "cuda"
dtype = torch.float32 if TINY else torch.bfloat16
args = sys.argv[1:]
out_path = args[0]
SWEEP = "--sweep" in args
LENGTHS = [40] if TINY else [4096, 16384]
for a in args:
    if a.startswith("--lengths="):
        LENGTHS = [int(v) for v in a.split("=")[1].split(",")]
recs = []


def rec(**kw):
    print(json.dumps(kw), flush=True)
    recs.append(kw)
    with open(out_path, "a") as f:  # incremental: a run stopped by its timeout keeps what it measured
        f.write(json.dumps(kw) + "\n")


def bench(fn):
    fn()
    if TINY:
        t = time.time()
        fn()
        return (time.time() - t) * 1e3
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def inputs(L, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    if TINY:
        SWEEPS.update({k: v[:1] for k, v in SWEEPS.items()})
    r = lambda *s: torch.randn(*s, generator=g, device=dev)
    x = r(L, H, P).to(dtype)
    z = r(L, H, P).to(dtype)
    dt = (r(L, H) - 4).to(dtype)
    A = -torch.exp(torch.rand(H, generator=g, device=dev))
    B = r(L, G, N).to(dtype)
    Cm = r(L, G, N).to(dtype)
    D = r(H)
    dt_bias = r(H) * 0.5
    pool = torch.zeros(2, H, P, N, device=dev, dtype=torch.float32)
    qsl = torch.tensor([0, L], dtype=torch.int32, device=dev)
    idx = torch.tensor([0], dtype=torch.int32, device=dev)
    hi = torch.tensor([False], device=dev)
    return x, dt, A, B, Cm, D, z, dt_bias, pool, qsl, idx, hi


def bytes_moved(L):
    # fewest bytes: x, z, B, C, dt read once, y written once, final state (fp32) written once
    return L * H * P * 2 * 3 + 2 * L * G * N * 2 + L * H * 2 + H * P * N * 4


def ours(L, inp):
    x, dt, A, B, Cm, D, z, dt_bias, pool, qsl, idx, hi = inp
    return lambda: ssd.ssd_varlen(x, dt, A, B, Cm, CS, D, z, dt_bias, pool, qsl, idx, hi)


def mamba_fn(inp):
    from harness.impls.adapters import import_peer
    mcs = import_peer("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
    x, dt, A, B, Cm, D, z, dt_bias, pool, qsl, idx, hi = inp
    return lambda: mcs(x[None], dt[None], A, B[None], Cm[None], CS, D=D, z=z[None], dt_bias=dt_bias,
                       dt_softplus=True, return_final_states=True)


def stage_fns(L, inp):
    x, dt, A, B, Cm, D, z, dt_bias, pool, qsl, idx, hi = inp
    cd = torch.float32
    NC = L // CS + 1
    dt_out, dA, _, st, ln, first = ssd.ssd_chunk_cumsum(dt, A, dt_bias, qsl, CS, compute_dtype=cd, num_chunks=NC)
    states = ssd.ssd_chunk_state(x, B, dt_out, dA, st, ln, compute_dtype=cd)
    prev = ssd.ssd_state_passing(states, dA, ln, first, qsl, pool, idx, hi, CS, prev_dtype=dtype)
    cb = ssd.ssd_bmm(Cm, B, st, ln, CS, compute_dtype=cd)
    y = torch.empty_like(x)
    return {
        "cumsum": lambda **k: ssd.ssd_chunk_cumsum(dt, A, dt_bias, qsl, CS, compute_dtype=cd, num_chunks=NC, **k),
        "chunk_state": lambda **k: ssd.ssd_chunk_state(x, B, dt_out, dA, st, ln, compute_dtype=cd, **k),
        "state_passing": lambda **k: ssd.ssd_state_passing(states, dA, ln, first, qsl, pool, idx, hi, CS,
                                                           prev_dtype=dtype, **k),
        "bmm": lambda **k: ssd.ssd_bmm(Cm, B, st, ln, CS, compute_dtype=cd, **k),
        "chunk_scan": lambda **k: ssd.ssd_chunk_scan(x, z, Cm, D, cb, dt_out, dA, prev, st, ln, y,
                                                     compute_dtype=cd, **k),
    }


SWEEPS = {
    # chunk_scan is timed here on the CB-reading path (stage_fns passes ssd_bmm's cb); ssd_varlen with
    # TUNING["fused_cb"] (the default for half types) runs the same kernel forming CB in place.
    "chunk_scan": [dict(block_m=m, block_p=64, block_k=k, block_n=64, heads=hb, num_warps=w, num_stages=s, maxnreg=r,
                        early_epilogue=e)
                   for (m, k, hb, w, s, r, e) in ((128, 64, 1, 8, 2, 128, False), (128, 64, 1, 8, 2, None, False),
                                                  (128, 32, 1, 8, 3, 128, False), (128, 64, 1, 8, 3, 128, False),
                                                  (128, 64, 1, 8, 2, 128, True), (64, 64, 1, 4, 2, None, False),
                                                  (64, 32, 1, 4, 2, 128, False), (64, 64, 1, 8, 2, 128, False),
                                                  (128, 64, 2, 8, 2, None, False), (64, 64, 2, 4, 2, None, False))],
    "chunk_state": [dict(block_p=bp, block_n=bn, block_k=bk, heads=hb, num_warps=w, num_stages=s, maxnreg=r)
                    for (bp, bn, bk, hb, w, s, r) in ((64, 128, 64, 2, 8, 2, 128), (64, 128, 64, 1, 8, 2, None),
                                                      (64, 128, 32, 2, 8, 3, 128), (64, 128, 64, 2, 8, 3, 128),
                                                      (64, 128, 64, 4, 8, 2, None), (64, 128, 32, 4, 8, 2, None),
                                                      (64, 64, 64, 2, 4, 2, None), (64, 128, 64, 1, 4, 2, None))],
    "state_passing": [dict(block=b, block_c=bc, num_warps=w)
                      for (b, bc, w) in ((1024, 8, 4), (512, 8, 2), (2048, 8, 8), (1024, 16, 4), (512, 16, 2),
                                         (1024, 4, 4), (256, 8, 1))],
    "bmm": [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s)
            for (m, n, k, w, s) in ((128, 128, 32, 8, 3), (128, 64, 64, 4, 3), (64, 64, 128, 4, 2))],
    "cumsum": [dict(block_h=bh, num_warps=w) for (bh, w) in ((8, 4), (16, 4), (32, 8), (4, 2))],
}


def timing(tag, with_mamba):
    for L in LENGTHS:
        inp = inputs(L)
        f_ours = ours(L, inp)
        t_m = None
        y = f_ours()  # ours first: its errors are ours, not the peer's
        if with_mamba:
            try:
                fm = mamba_fn(inp)
                ym, fstate = fm()
            except Exception as e:  # noqa: BLE001 - the peer may be absent or broken
                rec(kind="error", what="mamba_ssm", error=repr(e)[:300])
            else:
                err = float((y.float() - ym[0].float()).abs().max())
                serr = float((inp[8][0] - fstate[0].float()).abs().max())
                rec(kind="agree", L=L, max_abs_y_vs_mamba=err, max_abs_state_vs_mamba=serr,
                    y_scale=float(ym.float().abs().max()))
                t_m = bench(fm)
        t_o = bench(f_ours)
        with C_.no_index_checks():
            t_o_nc = bench(f_ours)
        out = torch.empty_like(inp[0])
        t_o_out = bench(lambda: ssd.ssd_varlen(*inp[:5], CS, *inp[5:], out=out))
        gb = bytes_moved(L) / 1e9
        rec(kind="timing", tag=tag, L=L, ours_ms=round(t_o, 4), ours_no_index_checks_ms=round(t_o_nc, 4),
            ours_out_ms=round(t_o_out, 4), mamba_ssm_ms=None if t_m is None else round(t_m, 4),
            ours_GBps=round(gb / t_o * 1e3, 1), floor_bytes_GB=round(gb, 4))
        fns = stage_fns(L, inp)
        for stage, fn in fns.items():
            rec(kind="stage", tag=tag, L=L, stage=stage, ms=round(bench(lambda: fn(**ssd.TUNING[stage])), 4))
        del inp, fns
        if not TINY:
            torch.cuda.empty_cache()


def main():
    rec(kind="env", device="cpu" if TINY else torch.cuda.get_device_name(), torch=torch.__version__,
        triton=triton.__version__)
    timing("defaults", with_mamba=True)
    if not SWEEP:
        return
    Lmax = max(LENGTHS)
    t0 = time.time()
    inp = inputs(Lmax)
    fns = stage_fns(Lmax, inp)
    best = {}
    for stage, cfgs in SWEEPS.items():
        res = []
        for cfg in cfgs:
            try:
                ms = bench(lambda: fns[stage](**cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                rec(kind="sweep", stage=stage, cfg=cfg, error=repr(e)[:200])
                continue
            res.append((ms, cfg))
            rec(kind="sweep", stage=stage, cfg=cfg, L=Lmax, ms=round(ms, 4))
        if res:
            ms, cfg = min(res, key=lambda r: r[0])
            best[stage] = cfg
            rec(kind="sweep_best", stage=stage, cfg=cfg, ms=round(ms, 4), elapsed_s=round(time.time() - t0, 1))
    ssd.TUNING.update(best)
    print("TUNING=" + json.dumps(ssd.TUNING), flush=True)
    del inp, fns
    timing("tuned", with_mamba=False)


if __name__ == "__main__":
    main()
