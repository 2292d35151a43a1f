"""Compile the SSD Triton kernels for a GPU target on a machine without one (ahead of time).

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels on CPU) accepts programs the compiler
rejects (e.g. a loop-carried variable changing type), so CI also compiles every kernel variant that
`ssd_varlen` launches for the given dtypes, for sm_90, without running anything:

    python -m harness.impls.triton.ssd_aot [bfloat16 float16 float32 float64]

Prints one line per compiled kernel variant and "ok N"; exits 2 when Triton here has no CUDA backend
able to compile (reason printed), 1 on a compile error. Must run without TRITON_INTERPRET.
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
    import harness.impls.triton.ssd as ssd
    from harness.impls.triton import ssd_bmm, ssd_chunk_cumsum, ssd_chunk_scan, ssd_chunk_state, ssd_state_passing
    seen: dict = {}
    for mod, name in ((ssd_chunk_cumsum, "_chunk_cumsum_kernel"), (ssd_chunk_state, "_chunk_state_kernel"),
                      (ssd_state_passing, "_state_passing_kernel"), (ssd_bmm, "_bmm_kernel"),
                      (ssd_chunk_scan, "_chunk_scan_kernel")):
        _intercept(getattr(mod, name), seen, target)
    H, P, G, N, CS, L = 8, 64, 2, 128, 256, 600
    for dn in dtype_names:
        dtype = getattr(torch, dn)
        for variant in ("full", "bare"):
            full = variant == "full"
            x = torch.randn(L, H, P).to(dtype)
            B = torch.randn(L, G, N).to(dtype)
            try:
                ssd.ssd_varlen(x, torch.randn(L, H).to(dtype), -torch.rand(H), B, B.clone(), CS,
                               torch.randn(H, P) if full else None, torch.randn(L, H, P).to(dtype) if full else None,
                               torch.randn(H) if full else None,
                               torch.zeros(3, H, P, N, dtype=torch.float32 if full else dtype),
                               torch.tensor([0, 100, L], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                               torch.tensor([True, False]), dt_limit=(0.001, 0.1))
            except Exception as e:  # noqa: BLE001 - report the first compile error
                print(f"compile error ({dn}, {variant}): {type(e).__name__}: {e}")
                return 1
    print("ok", len(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bfloat16"]))
