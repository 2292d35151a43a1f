"""Compile our Triton kernels for sm_90 on a machine without a GPU (ahead of time).

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels on CPU) accepts programs the compiler
rejects (e.g. a loop-carried variable changing type), and it never takes the NVIDIA-only paths (inline
PTX for the MUFU approximations). So CI also drives every op of the `triton` implementation with small
CPU tensors, intercepts each kernel launch and compiles that variant for sm_90 instead of running it
(HARNESS_AOT_NVIDIA=1 makes the launchers pick their CUDA paths for CPU tensors):

    python -m harness.impls.triton.aot [bfloat16 float16 float32 float64]

Prints one line per compiled kernel variant and "ok N"; exits 2 when Triton here has no CUDA backend
able to compile (reason printed), 1 on a compile error. Must run without TRITON_INTERPRET. Nothing runs:
outputs of the intercepted launches stay uninitialised.
"""
from __future__ import annotations

import os
import sys

import torch


def _intercept(kernel, seen, target):
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    def getitem(_self, grid):
        def launch(*args, **kw):
            opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
            names = kernel.arg_names
            values = list(args) + [kw[n] for n in names[len(args):]]
            sig, const = {}, {}
            for i, (n, a) in enumerate(zip(names, values)):
                if kernel.params[i].is_constexpr:
                    sig[n], const[n] = "constexpr", a
                elif isinstance(a, torch.Tensor):
                    sig[n] = mangle_type(a)
                elif isinstance(a, bool):
                    sig[n] = "i1"
                elif isinstance(a, int):
                    sig[n] = "i64" if abs(a) >= 2**31 else "i32"
                elif isinstance(a, float):
                    sig[n] = "fp32"
                else:
                    raise TypeError(f"{kernel.__name__}: argument {n} of type {type(a).__name__}")
            key = (kernel.__name__, repr(sig), repr(const), repr(opts))
            if key not in seen:
                triton.compile(ASTSource(kernel, sig, const), target=target, options=opts)
                seen[key] = True
                print("compiled", kernel.__name__, {k: str(v) for k, v in const.items()}, opts, flush=True)
        return launch

    kernel.__class__ = type("AOT" + type(kernel).__name__, (type(kernel),), {"__getitem__": getitem})


def _drive_ops(dtype, ssd, conv1d, gated_rms_norm, selective_scan, selective_state_update):
    """Every op with and without its optional inputs, small shapes (the launch configs are the GPU ones)."""
    r = lambda *s, dt=dtype: torch.randn(*s).to(dt)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    qsl, idx, hi = i32([0, 100, 600]), i32([0, 2]), torch.tensor([True, False])
    for full in (True, False):
        # conv1d: prefill and decode
        D, K = 96, 4
        conv1d.causal_conv1d_varlen(r(600, D), r(D, K), r(D) if full else None, r(3, D, K - 1), qsl, idx, hi,
                                    activation="silu" if full else None)
        conv1d.causal_conv1d_update(r(5, D), r(6, D, K - 1), r(D, K), r(D) if full else None, i32([0, 1, 2, 3, 5]),
                                    activation="silu" if full else None)
        # Mamba-1 scan (one piece and several pieces) and both state-update layouts
        Dm, N = 64, 16
        for T in (200, 600):
            q = i32([0, T // 3, T])
            selective_scan.selective_scan_varlen(
                r(T, Dm), r(T, Dm), -torch.rand(Dm, N), r(T, 1, N), r(T, 1, N), torch.randn(Dm) if full else None,
                r(T, Dm) if full else None, torch.randn(Dm) if full else None, torch.zeros(3, Dm, N), q, idx, hi,
                delta_softplus=full)
        selective_state_update.selective_state_update(
            r(6, Dm, N), r(5, Dm), r(5, Dm), -torch.rand(Dm, N), r(5, 1, N), r(5, 1, N),
            torch.randn(Dm) if full else None, r(5, Dm) if full else None, torch.randn(Dm) if full else None,
            i32([0, 1, 2, 3, 5]), dt_softplus=full)
        H, P, G, Nm2 = 8, 16, 2, 32
        selective_state_update.selective_state_update(
            r(6, H, P, Nm2), r(5, H, P), r(5, H), -torch.rand(H), r(5, G, Nm2), r(5, G, Nm2),
            torch.randn(H) if full else None, r(5, H, P) if full else None, torch.randn(H) if full else None,
            i32([0, 1, 2, 3, 5]), dt_softplus=full)
        gated_rms_norm.gated_rms_norm(r(40, 128), r(128), r(40, 128) if full else None, group_size=64)
        # SSD: the pipeline ssd_varlen launches
        H, P, G, N, CS, L = 8, 64, 2, 128, 256, 600
        x = r(L, H, P)
        B = r(L, G, N)
        ssd.ssd_varlen(x, r(L, H), -torch.rand(H), B, B.clone(), CS,
                       torch.randn(H, P) if full else None, r(L, H, P) if full else None,
                       torch.randn(H) if full else None,
                       torch.zeros(3, H, P, N, dtype=torch.float32 if full else dtype),
                       qsl, idx, hi, dt_limit=(0.001, 0.1))


def main(dtype_names) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1 is set: kernels are interpreted, nothing to compile")
        return 2
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        target = GPUTarget("cuda", 90, 32)
    except Exception as e:  # noqa: BLE001 - no CUDA backend in this Triton build
        print(f"no CUDA backend to compile with: {e!r}")
        return 2
    os.environ["HARNESS_AOT_NVIDIA"] = "1"
    import triton

    import importlib
    # modules by name: the package re-exports op functions under some of the same names
    (ssd, conv1d, gated_rms_norm, selective_scan, selective_state_update, ssd_bmm, ssd_chunk_cumsum,
     ssd_chunk_scan, ssd_chunk_state, ssd_state_passing) = (
        importlib.import_module("harness.impls.triton." + m) for m in (
            "ssd", "conv1d", "gated_rms_norm", "selective_scan", "selective_state_update", "ssd_bmm",
            "ssd_chunk_cumsum", "ssd_chunk_scan", "ssd_chunk_state", "ssd_state_passing"))
    seen: dict = {}
    for mod in (conv1d, gated_rms_norm, selective_scan, selective_state_update, ssd_bmm, ssd_chunk_cumsum,
                ssd_chunk_scan, ssd_chunk_state, ssd_state_passing):
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                _intercept(obj, seen, target)
    for dn in dtype_names:
        dtype = getattr(torch, dn)
        try:
            _drive_ops(dtype, ssd, conv1d, gated_rms_norm, selective_scan, selective_state_update)
        except Exception as e:  # noqa: BLE001 - report the first compile error
            print(f"compile error ({dn}): {type(e).__name__}: {e}")
            return 1
    print("ok", len(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bfloat16"]))
