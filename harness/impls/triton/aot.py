"""Compile our Triton kernels for sm_90 on a machine without a GPU (ahead of time).

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels on CPU) accepts programs the compiler
rejects (e.g. a loop-carried variable changing type), and it never takes the NVIDIA-only paths (inline
PTX for the MUFU approximations). So CI also drives every op of the `triton` implementation with small
CPU tensors, intercepts each kernel launch and compiles that variant for sm_90 instead of running it
(HARNESS_AOT_NVIDIA=1 makes the launchers pick their CUDA paths for CPU tensors):

    python -m harness.impls.triton.aot [bfloat16 float16 float32 float64] [--shapes aot|gpu] [--op NAME]
                                        [--resources] [--digest]

Prints one line per compiled kernel variant and "ok N"; exits 2 when Triton here has no CUDA backend
able to compile (reason printed), 1 on a compile error. Must run without TRITON_INTERPRET. Nothing runs:
outputs of the intercepted launches stay uninitialised.

`--shapes gpu` drives the ops at their spec's "gpu" shapes (the benchmark sizes: the launch configurations
the H200 runs) instead of the small "aot" ones; `--op` keeps only those ops; `--resources` adds to each line
what the sm_90 binary needs per thread and block (registers, local memory -- spills and stack --, static and
dynamic shared memory), read with the cuobjdump Triton ships, and the count of each kind of tensor-core
instruction in the PTX (`mma_kinds`): a kernel engineer's first look at occupancy, spills and MMA shapes without a
GPU; `--digest` a hash of each variant's PTX without its debug information (`code_digest`):
the same hashes before and after a change of the Triton source show that the change left the compiled code
as it was, which a refactor of a kernel tested on the H200 needs to show without one. Each launch is
specialised as Triton's JIT specialises it on a GPU (its own binder and argument packing): pointers 16-byte
aligned and integers divisible by 16 carry `tt.divisibility`, integers equal to 1 become constants. Without
those facts loads do not vectorise and the figures are those of scalar loads (far more registers and stack);
on a Triton without those internals the tool compiles from the argument types alone and the figures are that
pessimistic.
"""
from __future__ import annotations

import os
import sys

import torch


def resources(compiled) -> dict:
    """Per-thread registers, local memory (spills and stack) and shared memory of a compiled sm_90 kernel,
    from `cuobjdump --dump-resource-usage` on its cubin (the binary Triton ships), plus Triton's dynamic
    shared memory and warps."""
    import re
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = {"warps": compiled.metadata.num_warps, "dyn_shared": compiled.metadata.shared}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", text)
        if m:
            out[key.lower()] = int(m.group(1))
    out.update(mma_kinds(compiled))
    return out


def mma_kinds(compiled) -> dict:
    """The tensor-core instructions of a compiled sm_90 kernel's PTX: Hopper's warpgroup MMAs (`wgmma`) and the
    older warp-level `mma.sync`. A product Triton cannot give the warpgroup form (an M dimension below 64 rows,
    say) falls back to mma.sync; in a latency-bound loop that is the first thing to look at."""
    ptx = compiled.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")}


def code_digest(compiled) -> str:
    """A short hash of a compiled kernel's PTX without its debug information (`.loc` lines, `$L__tmp`
    labels, the `.file` and `.debug_*` sections that follow the code): equal digests before and after a
    change of the Triton source mean the change left the compiled code as it was (moved lines, shared jit
    helpers that inline back to the same instructions)."""
    import hashlib
    import re
    code = compiled.asm["ptx"].split("\n\t.file", 1)[0]
    kept = [line for line in code.splitlines()
            if not re.match(r"\s*(\.loc\b|\$L__tmp\d+:|//)", line)]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:12]


def _jit_specialisation(kernel, backend):
    """A function (args, kw) -> (signature, constexprs, attrs, options) that specialises a launch as Triton's
    JIT does on a GPU (Triton's own binder and argument packing): pointer arguments 16-byte aligned and integer
    arguments divisible by 16 carry `tt.divisibility` (what lets the compiler vectorise loads), integers equal
    to 1 become constants. None where this Triton lacks those internals (then only the argument types count)."""
    try:
        from triton.runtime.jit import create_function_from_signature
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        pack = kernel._pack_args
    except (ImportError, AttributeError, TypeError):
        return None

    def specialise(args, kw):
        kw = {"debug": False, **kw}
        bound, spec, options = binder(*args, **kw)
        options, signature, constexprs, attrs = pack(backend, kw, bound, spec, options)
        return signature, constexprs, attrs, options.__dict__
    return specialise


def _type_signature(kernel, args, kw):
    """(signature, constexprs): the arguments' types alone (no alignment or divisibility facts)."""
    import torch as _torch
    from triton.runtime.jit import mangle_type
    names = kernel.arg_names
    values = list(args) + [kw[n] for n in names[len(args):]]
    sig, const = {}, {}
    for i, (n, a) in enumerate(zip(names, values)):
        if kernel.params[i].is_constexpr:
            sig[n], const[n] = "constexpr", a
        elif isinstance(a, _torch.Tensor):
            sig[n] = mangle_type(a)
        elif isinstance(a, bool):
            sig[n] = "i1"
        elif isinstance(a, int):
            sig[n] = "i64" if abs(a) >= 2**31 else "i32"
        elif isinstance(a, float):
            sig[n] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {n} of type {type(a).__name__}")
    return sig, const


def _intercept(kernel, seen, target, show_resources: bool = False, show_digest: bool = False):
    import triton
    from triton.compiler import ASTSource, make_backend

    specialise = _jit_specialisation(kernel, make_backend(target))

    def getitem(_self, grid):
        def launch(*args, **kw):
            opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
            if specialise is not None:
                sig, const, attrs, options = specialise(args, {**kw, **opts})
            else:
                (sig, const), attrs, options = _type_signature(kernel, args, kw), None, opts
            # the constexprs by name (the JIT's packing keys them by argument position)
            shown = {n: const.get((i,), const.get(n)) for i, n in enumerate(kernel.arg_names)
                     if kernel.params[i].is_constexpr}
            key = (kernel.__name__, repr(sig), repr(sorted(map(repr, const.items()))), repr(attrs), repr(opts))
            if key not in seen:
                compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=target, options=options)
                seen[key] = True
                extra = f" {resources(compiled)}" if show_resources else ""
                extra += f" ptx {code_digest(compiled)}" if show_digest else ""
                print("compiled", kernel.__name__, {k: str(v) for k, v in shown.items()}, opts, extra, flush=True)
        return launch

    kernel.__class__ = type("AOT" + type(kernel).__name__, (type(kernel),), {"__getitem__": getitem})


def _drive_ops(dtype, ops, shapes: str = "aot", only=None):
    """Every op of the contract (or those in `only`) at each of its spec's `shapes` shapes ("aot": small
    shapes with and without optional inputs, the pool dtypes the engine uses, the GPU launch configs;
    "gpu": the benchmark sizes)."""
    from harness.ops import SPECS
    gen = torch.Generator().manual_seed(0)
    for name, sp in SPECS.items():
        if name not in ops or (only and name not in only):
            continue
        for shape in sp.shapes.get(shapes, ()):
            sp.call(ops[name], sp.inputs(shape, dtype, "cpu", gen))


def main(argv) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m harness.impls.triton.aot",
                                description="compile every Triton kernel variant the ops launch, for sm_90")
    p.add_argument("dtypes", nargs="*", default=["bfloat16"], help="activation dtypes (default bfloat16)")
    p.add_argument("--shapes", choices=("aot", "gpu"), default="aot", help="the spec shapes to drive the ops at")
    p.add_argument("--op", action="append", default=None, help="only these ops (comma-separated, repeatable)")
    p.add_argument("--resources", action="store_true", help="registers, local and shared memory per variant")
    p.add_argument("--digest", action="store_true",
                   help="a hash of each variant's PTX without debug information (code_digest)")
    args = p.parse_args(argv)
    from harness.ops import SPECS
    only = [o for v in args.op or () for o in v.split(",") if o]
    for name in only:
        if name not in SPECS:
            p.error(f"--op: expected op names of harness.ops {sorted(SPECS)}, got {name!r}")
    for dn in args.dtypes:
        if not isinstance(getattr(torch, dn, None), torch.dtype):
            p.error(f"dtypes: expected torch dtype names (bfloat16, float16, float32, float64), got {dn!r}")
    return _compile_all(args.dtypes, args.shapes, only or None, args.resources, args.digest)


def _compile_all(dtype_names, shapes: str, only, show_resources: bool, show_digest: bool = False) -> int:
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

    from harness.impls.triton._common import kernel_modules, refresh_env
    refresh_env()  # the launchers read the variable at import

    from harness.impls.registry import provided
    ops = provided("triton", "harness.impls.triton")
    seen: dict = {}
    for mod in kernel_modules():
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                _intercept(obj, seen, target, show_resources, show_digest)
    for dn in dtype_names:
        dtype = getattr(torch, dn)
        try:
            _drive_ops(dtype, ops, shapes, only)
        except Exception as e:  # noqa: BLE001 - report the first compile error
            print(f"compile error ({dn}): {type(e).__name__}: {e}")
            return 1
    print("ok", len(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
