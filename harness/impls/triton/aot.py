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


def _drive_ops(dtype, ops):
    """Every op of the contract at each of its spec's "aot" shapes (with and without optional inputs, the
    pool dtypes the engine uses; small shapes, the GPU launch configs)."""
    from harness.ops import SPECS
    gen = torch.Generator().manual_seed(0)
    for name, sp in SPECS.items():
        if name not in ops:
            continue
        for shape in sp.shapes.get("aot", ()):
            sp.call(ops[name], sp.inputs(shape, dtype, "cpu", gen))


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

    from harness.impls.triton._common import refresh_env
    refresh_env()  # the launchers read the variable at import

    import importlib
    import pkgutil

    from harness.impls.registry import provided
    pkg = importlib.import_module("harness.impls.triton")
    ops = provided("triton", "harness.impls.triton")
    seen: dict = {}
    for m in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"harness.impls.triton.{m.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                _intercept(obj, seen, target)
    for dn in dtype_names:
        dtype = getattr(torch, dn)
        try:
            _drive_ops(dtype, ops)
        except Exception as e:  # noqa: BLE001 - report the first compile error
            print(f"compile error ({dn}): {type(e).__name__}: {e}")
            return 1
    print("ok", len(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bfloat16"]))
