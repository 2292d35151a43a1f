"""GPU timing of our Triton op kernels on the shapes of docs/targets.md, next to mamba_ssm's Triton ops.

python3 scripts/gpu_ops_bench.py OUT_DIR [--sweep] [--graph-sweep] [--budget SECONDS]
Phase A times every anchor with the current launch configs; phase B (--sweep) tries other configs
per kernel, most important first, until the budget is spent; phase C re-times every anchor with the
best configs, which are written to OUT_DIR/ops-best-config.json (usable via HARNESS_TRITON_CONFIG).
Each figure is the median of triton.testing.do_bench ("triton": eager calls, Python validation and
launch included) and of do_bench_cudagraph ("triton-graph": graph replays, GPU time only); GB/s counts the fewest bytes the op must move
(inputs read once, outputs written once, a state read and written once). Index checks are off
(`no_index_checks`, as under CUDA-graph capture) so no host sync is timed.
"""
import importlib
import json
import os
import sys
import time

import torch
import triton

from harness.ops import no_index_checks

OUTD = sys.argv[1]
SWEEP = "--sweep" in sys.argv
BUDGET = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 80.0
GRAPH_SWEEP = "--graph-sweep" in sys.argv  # rank configs by CUDA-graph time (no launch overhead)
T0 = time.time()
dev = "cuda"
JSONL = os.path.join(OUTD, "ops-bench.jsonl")
tconv, tscan, tssu, tnorm = (importlib.import_module("harness.impls.triton." + m)
                             for m in ("conv1d", "selective_scan", "selective_state_update", "gated_rms_norm"))
MODS = {"conv1d": tconv, "selective_scan": tscan, "selective_state_update": tssu}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def bench_graph(fn):
    """GPU time without the Python launch/validation overhead (what a CUDA-graph replay costs)."""
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def record(phase, op, shape, impl, ms, nbytes, config=None):
    r = dict(kind="timing", phase=phase, op=op, shape=shape, impl=impl, ms=round(ms, 5),
             gbps=round(nbytes / ms / 1e6, 1), config=config)
    print(f"[{phase}] {op:26s} {shape:32s} {impl:16s} {ms:8.4f} ms {r['gbps']:8.1f} GB/s {config or ''}", flush=True)
    with open(JSONL, "a") as f:
        f.write(json.dumps(r) + "\n")


def nb(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def bf(*shape):
    return torch.randn(*shape, device=dev, dtype=torch.bfloat16)


try:
    from harness.impls.adapters import import_peer
    ms_ssu = import_peer("mamba_ssm.ops.triton.selective_state_update").selective_state_update
    ms_norm = import_peer("mamba_ssm.ops.triton.layernorm_gated").rmsnorm_fn
except Exception as e:  # noqa: BLE001
    ms_ssu = ms_norm = None
    print("mamba_ssm not importable:", e, flush=True)

torch.manual_seed(0)


def conv_prefill(L):
    D, K = 10240, 4
    x, w, b = bf(L, D), bf(D, K), bf(D)
    pool = torch.zeros(1, D, K - 1, device=dev, dtype=torch.bfloat16)
    q = torch.tensor([0, L], device=dev, dtype=torch.int32)
    idx = torch.tensor([0], device=dev, dtype=torch.int32)
    hi = torch.tensor([False], device=dev)
    y = torch.empty_like(x)
    return ("causal_conv1d_varlen", f"D={D} K={K} L={L}", "conv1d",
            lambda: tconv.causal_conv1d_varlen(x, w, b, pool, q, idx, hi, activation="silu", out=y), nb(x, y), None)


def conv_update():
    Bsz, D, K = 256, 10240, 4
    x, w, b = bf(Bsz, D), bf(D, K), bf(D)
    pool = bf(Bsz, D, K - 1)
    idx = torch.arange(Bsz, device=dev, dtype=torch.int32)
    y = torch.empty_like(x)
    return ("causal_conv1d_update", f"D={D} K={K} batch={Bsz}", "conv1d",
            lambda: tconv.causal_conv1d_update(x, pool, w, b, idx, activation="silu", out=y),
            nb(x, y) + 2 * nb(pool), None)


def ssu_m2(Bsz):
    H, P, N, G = 128, 64, 128, 8
    st, x, dt = bf(Bsz, H, P, N), bf(Bsz, H, P), bf(Bsz, H)
    A, Dp, dtb = -torch.rand(H, device=dev), torch.randn(H, device=dev), torch.randn(H, device=dev)
    Bm, Cm, z = bf(Bsz, G, N), bf(Bsz, G, N), bf(Bsz, H, P)
    idx = torch.arange(Bsz, device=dev, dtype=torch.int32)
    y = torch.empty_like(x)
    peer = None
    if ms_ssu is not None:
        A3, dt3 = A[:, None, None].expand(H, P, N), dt[:, :, None].expand(Bsz, H, P)
        D3, db3 = Dp[:, None].expand(H, P), dtb[:, None].expand(H, P)
        peer = lambda: ms_ssu(st, x, dt3, A3, Bm, Cm, D3, z, db3, dt_softplus=True, state_batch_indices=idx)
    return ("selective_state_update/m2", f"H={H} P={P} N={N} G={G} batch={Bsz}", "selective_state_update",
            lambda: tssu.selective_state_update(st, x, dt, A, Bm, Cm, Dp, z, dtb, idx, dt_softplus=True, out=y),
            2 * nb(st) + nb(x, z, y, dt, Bm, Cm), peer)


def ssu_m1():
    Bsz, Dm, N = 256, 8192, 16
    st, x, dt, z = bf(Bsz, Dm, N), bf(Bsz, Dm), bf(Bsz, Dm), bf(Bsz, Dm)
    A, Dp, dtb = -torch.rand(Dm, N, device=dev), torch.randn(Dm, device=dev), torch.randn(Dm, device=dev)
    Bm, Cm = bf(Bsz, 1, N), bf(Bsz, 1, N)
    idx = torch.arange(Bsz, device=dev, dtype=torch.int32)
    y = torch.empty_like(x)
    peer = None
    if ms_ssu is not None:
        peer = lambda: ms_ssu(st, x, dt, A, Bm[:, 0], Cm[:, 0], Dp, z, dtb, dt_softplus=True, state_batch_indices=idx)
    return ("selective_state_update/m1", f"D={Dm} N={N} batch={Bsz}", "selective_state_update",
            lambda: tssu.selective_state_update(st, x, dt, A, Bm, Cm, Dp, z, dtb, idx, dt_softplus=True, out=y),
            2 * nb(st) + nb(x, z, y, dt, Bm, Cm), peer)


def scan(L):
    Dm, N = 8192, 16
    u, z = bf(L, Dm), bf(L, Dm)
    delta = (torch.randn(L, Dm, device=dev) - 4).to(torch.bfloat16)
    A = -torch.exp(torch.rand(Dm, N, device=dev))
    Bm, Cm = bf(L, 1, N), bf(L, 1, N)
    Dp, db = torch.randn(Dm, device=dev), torch.randn(Dm, device=dev) * 0.1
    pool = torch.zeros(1, Dm, N, device=dev)
    q = torch.tensor([0, L], device=dev, dtype=torch.int32)
    idx = torch.tensor([0], device=dev, dtype=torch.int32)
    hi = torch.tensor([False], device=dev)
    y = torch.empty_like(u)
    return ("selective_scan_varlen", f"D={Dm} N={N} L={L}", "selective_scan",
            lambda: tscan.selective_scan_varlen(u, delta, A, Bm, Cm, Dp, z, db, pool, q, idx, hi, out=y),
            nb(u, delta, z, y, Bm, Cm) + 2 * nb(pool), None)


def norm():
    T, D, gs = 4096, 8192, 1024
    x, z, w = bf(T, D), bf(T, D), bf(D)
    y = torch.empty_like(x)
    peer = None
    if ms_norm is not None:
        peer = lambda: ms_norm(x, w, None, z=z, eps=1e-6, group_size=gs, norm_before_gate=False)
    return ("gated_rms_norm", f"T={T} D={D} group={gs}", None,
            lambda: tnorm.gated_rms_norm(x, w, z, group_size=gs, norm_before_gate=False, out=y), nb(x, z, y), peer)


SWEEPS = [  # (anchor, module, configs), most important first
    ("scan4096", "selective_scan", [dict(bd=bd, warps=wp, chunk=ch, deep=dp, dfirst=df) for dp in (True, False)
                                    for df in (True, False) for bd in (32, 64) for wp in (1, 2)
                                    for ch in (128, 256)]),
    ("m1", "selective_state_update", [dict(m1_bd=bd, m1_warps=wp, m1_rows=r) for bd in (32, 64, 128) for wp in (4, 8)
                                      for r in (1, 4, 8)]),
    ("m2_256", "selective_state_update", [dict(m2_bp=bp, m2_warps=wp) for bp in (4, 8, 16, 32) for wp in (2, 4, 8)]),
    ("conv_upd", "conv1d", [dict(upd_bd=bd, upd_warps=wp, upd_rows=r) for bd in (256, 512, 1024) for wp in (4, 8)
                            for r in (1, 4, 8)]),
    ("conv4096", "conv1d", [dict(bt=bt, bd=bd, warps=wp, dfirst=df) for df in (True, False) for bt in (8, 16, 32, 64)
                            for bd in (64, 128, 256) for wp in (4, 8) if 1024 <= bt * bd <= 8192]),
]

# scripts/sweeps/<anchor>.json ({"module": ..., "configs": [...]}) replaces or adds that anchor's sweep
_SWD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sweeps")
if os.path.isdir(_SWD):
    for _fn in sorted(os.listdir(_SWD)):
        if _fn.endswith(".json"):
            with open(os.path.join(_SWD, _fn)) as _f:
                _spec = json.load(_f)
            _name = _fn[:-5]
            SWEEPS = [s for s in SWEEPS if s[0] != _name] + [(_name, _spec["module"], _spec["configs"])]
ONLY = os.environ.get("SWEEP_ONLY")  # comma-separated anchors: sweep just these
if ONLY:
    SWEEPS = [s for s in SWEEPS if s[0] in ONLY.split(",")]

with no_index_checks():
    a = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    b2 = torch.empty_like(a)
    record("A", "copy", "256 MiB d2d", "torch", bench(lambda: b2.copy_(a)), 2 * a.numel())
    del a, b2
    builders = {"conv4096": lambda: conv_prefill(4096), "conv16384": lambda: conv_prefill(16384),
                "conv_upd": conv_update, "m2_64": lambda: ssu_m2(64), "m2_256": lambda: ssu_m2(256), "m1": ssu_m1,
                "scan1024": lambda: scan(1024), "scan4096": lambda: scan(4096), "scan16384": lambda: scan(16384),
                "norm": norm}

    def run_anchor(name, phase, peers=True):
        op, shape, mod, fn, nbytes, peer = builders[name]()
        try:
            fn(); torch.cuda.synchronize()
            cfg = dict(MODS[mod].CONFIG) if mod else None
            record(phase, op, shape, "triton", bench(fn), nbytes, cfg)
            if phase != "B":
                record(phase, op, shape, "triton-graph", bench_graph(fn), nbytes, cfg)
        except Exception as e:  # noqa: BLE001
            print(f"[{phase}] {name}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        if peers and peer is not None:
            try:
                peer(); torch.cuda.synchronize()
                record(phase, op, shape, "mamba_ssm-triton", bench(peer), nbytes)
                record(phase, op, shape, "mamba_ssm-triton-graph", bench_graph(peer), nbytes)
            except Exception as e:  # noqa: BLE001
                print(f"[{phase}] {name} peer: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()

    for name in builders:
        run_anchor(name, "A")
    if SWEEP:
        for name, mod, cfgs in SWEEPS:
            m = MODS[mod]
            op, shape, _, fn, nbytes, _ = builders[name]()
            base = dict(m.CONFIG)
            best = None
            for cfg in cfgs:
                if time.time() - T0 > BUDGET:
                    print(f"[B] budget spent; {name} sweep stopped", flush=True)
                    break
                m.CONFIG.update(cfg)
                try:
                    fn(); torch.cuda.synchronize()
                    ms = bench_graph(fn) if GRAPH_SWEEP else bench(fn)
                    record("B", op, shape, "triton", ms, nbytes, dict(m.CONFIG))
                    if best is None or ms < best[0]:
                        best = (ms, dict(m.CONFIG))
                except Exception as e:  # noqa: BLE001
                    print(f"[B] {name} {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                m.CONFIG.clear(); m.CONFIG.update(base)
            if best is not None:
                m.CONFIG.update(best[1])
            del fn
            torch.cuda.empty_cache()
        for name in builders:
            run_anchor(name, "C", peers=False)
with open(os.path.join(OUTD, "ops-best-config.json"), "w") as f:
    json.dump({k: v.CONFIG for k, v in MODS.items()}, f, indent=1)
print("configs:", json.dumps({k: v.CONFIG for k, v in MODS.items()}), f"elapsed {time.time() - T0:.0f}s", flush=True)
