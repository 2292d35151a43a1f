"""End-to-end ssd_varlen timings (GPU) of a few TUNING variants next to mamba_ssm's mamba_chunk_scan_combined,
with each variant's output checked against the default's. The stage-by-stage sweep of scripts/bench_ssd.py
times ssd_chunk_scan on its CB-reading path; ssd_varlen's default forms CB in place, so the end-to-end
figure decides.

    python3 scripts/ssd_variants.py OUT.jsonl
"""
import copy
import json
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

import harness.impls.triton.ssd as ssd
from harness.ops import no_index_checks

H, P, G, N, CS = 128, 64, 8, 128, 256
dev, dt_ = "cuda", torch.bfloat16
VARIANTS = {
    "default": {},
    "cb_via_bmm": {"fused_cb": False},
    "separate_cumsum": {"fuse_front": False},
    "scan_64x64_4w": {"chunk_scan": {"block_m": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}},
    "scan_128x64_4w3s": {"chunk_scan": {"block_m": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}},
    "state_1head": {"chunk_state": {"heads": 1}},
}
out = open(sys.argv[1], "a")


def rec(**kw):
    print(json.dumps(kw), flush=True)
    out.write(json.dumps(kw) + "\n")
    out.flush()


def inputs(L):
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=dev)
    x, z = r(L, H, P).to(dt_), r(L, H, P).to(dt_)
    dt = (r(L, H) - 4).to(dt_)
    A = -torch.exp(torch.rand(H, generator=g, device=dev))
    B, C = r(L, G, N).to(dt_), r(L, G, N).to(dt_)
    D, dtb = r(H), r(H) * 0.5
    qsl = torch.tensor([0, L], dtype=torch.int32, device=dev)
    idx = torch.tensor([0], dtype=torch.int32, device=dev)
    hi = torch.tensor([False], device=dev)
    return x, dt, A, B, C, D, z, dtb, qsl, idx, hi


base = copy.deepcopy(ssd.TUNING)
for L in (4096, 16384):
    x, dt, A, B, C, D, z, dtb, qsl, idx, hi = inputs(L)
    pool = torch.zeros(2, H, P, N, device=dev)
    y = torch.empty_like(x)
    ref = None
    for name, tun in VARIANTS.items():
        ssd.TUNING.clear()
        ssd.TUNING.update(copy.deepcopy(base))
        for k, v in tun.items():
            if isinstance(v, dict):
                ssd.TUNING[k] = {**ssd.TUNING.get(k, {}), **v}
            else:
                ssd.TUNING[k] = v
        fn = lambda: ssd.ssd_varlen(x, dt, A, B, C, CS, D, z, dtb, pool, qsl, idx, hi, out=y)
        try:
            with no_index_checks():
                fn()
                torch.cuda.synchronize()
                yy, st = y.float().clone(), pool[0].clone()
                if ref is None:
                    ref = (yy, st)
                err = float((yy - ref[0]).abs().max()) / float(ref[0].abs().max())
                serr = float((st - ref[1]).abs().max()) / float(ref[1].abs().max())
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                msg = do_bench_cudagraph(fn, rep=100, return_mode="median")
            rec(kind="variant", L=L, variant=name, tuning=tun, ms=round(ms, 4), ms_graph=round(msg, 4),
                rel_err_vs_default=err, state_rel_err_vs_default=serr)
        except Exception as e:  # noqa: BLE001
            rec(kind="variant", L=L, variant=name, tuning=tun, error=f"{type(e).__name__}: {e}"[:300])
    ssd.TUNING.clear()
    ssd.TUNING.update(copy.deepcopy(base))
    try:
        from harness.impls.adapters import import_peer
        mcs = import_peer("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
        fm = lambda: mcs(x[None], dt[None], A, B[None], C[None], CS, D=D, z=z[None], dt_bias=dtb, dt_softplus=True,
                         return_final_states=True)
        ym, fs = fm()
        rec(kind="peer", L=L, impl="mamba_ssm", ms=round(do_bench(fm, warmup=25, rep=100, return_mode="median"), 4),
            ms_graph=round(do_bench_cudagraph(fm, rep=100, return_mode="median"), 4),
            rel_err_vs_ours=float((ym[0].float() - ref[0]).abs().max()) / float(ref[0].abs().max()))
    except Exception as e:  # noqa: BLE001
        rec(kind="peer", L=L, impl="mamba_ssm", error=f"{type(e).__name__}: {e}"[:300])
    del x, dt, B, C, z, y, pool
    torch.cuda.empty_cache()
