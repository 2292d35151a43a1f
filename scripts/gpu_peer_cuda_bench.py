"""Side-by-side timing of our Triton ops against the peers' compiled CUDA kernels (mamba_ssm's
selective_scan_fn, causal-conv1d's causal_conv1d_fn / causal_conv1d_update) on the docs/targets.md shapes,
in one run on one GPU, next to a device-to-device copy measured in the same run.

    python3 scripts/gpu_peer_cuda_bench.py OUT.jsonl        (after scripts/peers_setup.sh built the peers)

Each case: triton.testing.do_bench quantiles p20/p50/p80 (ms); GB/s from the fewest bytes the op must move.
Our ops run inside harness.ops.no_index_checks() (the host-side index checks would add a sync per call).
A peer that is not importable is recorded with its reason instead of a time.
"""
import json
import sys

import torch
import triton

from harness.env import environment
from harness.impls.registry import get
from harness.ops import no_index_checks

out_path = sys.argv[1]
dev = "cuda"
bf = torch.bfloat16
T = get("triton")
recs = []


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])


def bench_graph(fn):
    """GPU time only: replays of a CUDA graph of the call (no Python or launch overhead on either side)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, quantiles=[0.2, 0.5, 0.8])


def both(op, shape, impl, nbytes, fn, peer=False):
    """Eager (do_bench, host launch cost included) and CUDA-graph timings of one case."""
    emit(op, shape, impl, nbytes, bench(fn), peer=peer)
    try:
        emit(op, shape, impl + "-graph", nbytes, bench_graph(fn), peer=peer)
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured still has its eager figure
        emit(op, shape, impl + "-graph", nbytes, error=f"{type(e).__name__}: {e}"[:200], peer=peer)


def emit(op, shape, impl, nbytes, q=None, error=None, peer=False):
    r = dict(op=op, shape=shape, impl=impl, peer=peer, bytes=nbytes)
    if q is not None:
        r.update(ms_p20=q[0], ms_p50=q[1], ms_p80=q[2], gb_s=nbytes / q[1] / 1e6, pct_copy_bw=None)
    if error:
        r["error"] = error
    recs.append(r)
    print(f"{op:24s} {str(shape):40s} {impl:22s} " + (f"{q[1]:.4f} ms {nbytes / q[1] / 1e6:8.1f} GB/s" if q else f"ERROR {error}"), flush=True)


# roofline: device-to-device copy
src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
dst = torch.empty_like(src)
q = bench(lambda: dst.copy_(src))
copy_gbs = 2 * src.numel() / q[1] / 1e6
emit("copy", {"bytes": src.numel()}, "torch", 2 * src.numel(), q)
del src, dst

try:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    import selective_scan_cuda
    if getattr(selective_scan_cuda, "__harness_placeholder__", False):
        raise ImportError("selective_scan_cuda is a placeholder (CUDA extension not built)")
    ss_err = None
except Exception as e:  # noqa: BLE001
    selective_scan_fn, ss_err = None, f"{type(e).__name__}: {e}"
try:
    import causal_conv1d as cc
    cc_err = None
except Exception as e:  # noqa: BLE001
    cc, cc_err = None, f"{type(e).__name__}: {e}"

import os
ONLY = os.environ.get("PEER_OPS", "scan,conv,conv_update").split(",")  # which ops to time
g = torch.Generator(device=dev).manual_seed(0)
Dm, N = 8192, 16
for L in ((1024, 4096, 16384) if "scan" in ONLY else ()):
    u = torch.randn(L, Dm, device=dev, generator=g).to(bf)
    delta = (torch.randn(L, Dm, device=dev, generator=g) - 4).to(bf)
    z = torch.randn(L, Dm, device=dev, generator=g).to(bf)
    A = -torch.rand(Dm, N, device=dev, generator=g).exp()
    B = torch.randn(L, 1, N, device=dev, generator=g).to(bf)
    C = torch.randn(L, 1, N, device=dev, generator=g).to(bf)
    Dv = torch.randn(Dm, device=dev, generator=g)
    db = torch.randn(Dm, device=dev, generator=g) * 0.1
    pool = torch.zeros(2, Dm, N, device=dev)
    qsl = torch.tensor([0, L], dtype=torch.int32, device=dev)
    ci = torch.tensor([1], dtype=torch.int32, device=dev)
    hi = torch.zeros(1, dtype=torch.bool, device=dev)
    out = torch.empty_like(u)
    nbytes = 3 * L * Dm * 2 + 2 * L * N * 2 + L * Dm * 2 + Dm * N * 4 * 2 + Dm * 8
    shape = {"D": Dm, "N": N, "L": L}
    f = T.ops["selective_scan_varlen"]
    with no_index_checks():
        both("selective_scan_varlen", shape, "triton", nbytes,
             lambda: f(u, delta, A, B, C, Dv, z, db, pool, qsl, ci, hi, delta_softplus=True, out=out))
    if selective_scan_fn is None:
        emit("selective_scan_varlen", shape, "mamba_ssm_cuda", nbytes, error=ss_err, peer=True)
    else:
        u3, d3, z3 = (t.t().contiguous().unsqueeze(0) for t in (u, delta, z))
        B3, C3 = (t[:, 0].t().contiguous().unsqueeze(0) for t in (B, C))
        both("selective_scan_varlen", shape, "mamba_ssm_cuda", nbytes,
             lambda: selective_scan_fn(u3, d3, A, B3, C3, Dv, z3, db, True, True), peer=True)
    del u, delta, z, B, C, out

D, K = 10240, 4
w = torch.randn(D, K, device=dev, generator=g).to(bf)
bias = torch.randn(D, device=dev, generator=g).to(bf)
for L in ((4096, 16384) if "conv" in ONLY else ()):
    x = torch.randn(L, D, device=dev, generator=g).to(bf)
    cs = torch.zeros(2, D, K - 1, device=dev, dtype=bf)
    qsl = torch.tensor([0, L], dtype=torch.int32, device=dev)
    ci = torch.tensor([1], dtype=torch.int32, device=dev)
    hi = torch.zeros(1, dtype=torch.bool, device=dev)
    out = torch.empty_like(x)
    nbytes = 2 * L * D * 2 + D * K * 2
    shape = {"D": D, "K": K, "L": L}
    f = T.ops["causal_conv1d_varlen"]
    with no_index_checks():
        both("causal_conv1d_varlen", shape, "triton", nbytes,
             lambda: f(x, w, bias, cs, qsl, ci, hi, activation="silu", out=out))
    if cc is None:
        emit("causal_conv1d_varlen", shape, "causal_conv1d_cuda", nbytes, error=cc_err, peer=True)
    else:
        x3 = x.t().contiguous().unsqueeze(0)
        both("causal_conv1d_varlen", shape, "causal_conv1d_cuda", nbytes,
             lambda: cc.causal_conv1d_fn(x3, w, bias, activation="silu"), peer=True)
    del x, out

if "conv_update" in ONLY:
    Bsz = 256
    x = torch.randn(Bsz, D, device=dev, generator=g).to(bf)
    pool = torch.randn(Bsz + 1, D, K - 1, device=dev, generator=g).to(bf)
    idx = torch.arange(1, Bsz + 1, dtype=torch.int32, device=dev)
    out = torch.empty_like(x)
    nbytes = 2 * Bsz * D * 2 + 2 * Bsz * D * (K - 1) * 2 + D * K * 2
    shape = {"D": D, "K": K, "batch": Bsz}
    f = T.ops["causal_conv1d_update"]
    with no_index_checks():
        both("causal_conv1d_update", shape, "triton", nbytes, lambda: f(x, pool, w, bias, idx, activation="silu", out=out))
    if cc is None:
        emit("causal_conv1d_update", shape, "causal_conv1d_cuda", nbytes, error=cc_err, peer=True)
    else:
        st = pool[1:].clone()
        both("causal_conv1d_update", shape, "causal_conv1d_cuda", nbytes,
             lambda: cc.causal_conv1d_update(x, st, w, bias, "silu"), peer=True)

env = environment("cuda")
with open(out_path, "w") as fh:
    fh.write(json.dumps({"kind": "env", "env": env}) + "\n")
    for r in recs:
        if "ms_p50" in r:
            r["pct_copy_bw"] = 100.0 * r["gb_s"] / copy_gbs
        fh.write(json.dumps(r) + "\n")
print("copy GB/s", round(copy_gbs, 1))
