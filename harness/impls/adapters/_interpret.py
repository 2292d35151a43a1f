"""What a peer's Triton kernels need to run under Triton's interpreter (TRITON_INTERPRET=1, on the CPU) that their
GPU path does not. `interpretable(prefix)` applies both shims below to every loaded module of the peer's package
(named by `prefix`, e.g. "fla."), once per module:

- each `@triton.autotune` kernel keeps its first config: the interpreter's autotuner would time every config
  and asks for a GPU driver to do so (our own kernels do the same through `_common.autotune_configs`);
- inside an interpreted kernel a loop over Python's `range` gives interpreter tensors, as compiled Triton's loop
  variables are: fla-core's chunked GDN state kernel calls `i_t.to(tl.int64)` on its chunk index, which a
  Python int lacks. The module's `range` is Python's everywhere else (host code, and every kernel of a module
  while no kernel runs), told apart by whether the interpreter has replaced `tl.range` for the running kernel.

`cpu_device_guards()` makes `torch.cuda.device(None)` (or of a CPU device) a no-op while a peer op runs: mamba_ssm
launches its kernels inside `with torch.cuda.device(x.device.index)`, and a CPU tensor's index is None, which
torch's rejects.
`interpreted(prefix, fn)` wraps a peer op in both (the shims applied at each call, to the modules loaded by then:
a kernel module the peer imports only inside the op would run unpatched in that first call; fla's and mamba_ssm's
entry modules, which the adapters import to decide availability, import their kernel modules at the top).
`unavailable_here(kernels, package, *modules)` is the availability check of a peer whose Triton kernels run on a
CUDA device or under the interpreter (vLLM's, fla-core's, mamba_ssm's).

Nothing here changes what the kernels compute; on a GPU none of it is applied.
"""
from __future__ import annotations

import builtins
import contextlib
import inspect
import sys

_DONE: set[str] = set()


def _in_interpreted_kernel() -> bool:
    import triton.language as tl
    # the interpreter swaps tl.range (a class) for a function of its own while it runs a kernel
    return not isinstance(tl.range, type)


def _range(*args):
    """Python's range; inside an interpreted kernel its values as int32 interpreter scalars."""
    if not _in_interpreted_kernel():
        yield from builtins.range(*args)
        return
    import triton.language as tl
    for i in builtins.range(*(int(getattr(a, "value", a)) for a in args)):  # constexprs hold theirs in .value
        yield tl.full((), i, tl.int32)


def _first_configs(obj) -> None:
    """Along a kernel's wrappers (heuristics, autotune, jit: each holds the next as `.fn`), every autotuner
    keeps its first config."""
    from triton.runtime.autotuner import Autotuner
    seen = 0
    while obj is not None and seen < 8:
        if isinstance(obj, Autotuner) and len(obj.configs) > 1:
            obj.configs = obj.configs[:1]
        obj, seen = getattr(obj, "fn", None), seen + 1


def interpretable(prefix: str) -> None:
    """Apply the shims to the loaded modules whose names start with `prefix` (call after importing the peer's
    entry points, again after importing more of it: each module is patched once)."""
    from triton.runtime.jit import KernelInterface
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or name in _DONE or mod is None:
            continue
        _DONE.add(name)
        kernels = [v for v in vars(mod).values() if isinstance(v, KernelInterface)]
        if not kernels:
            continue
        for k in kernels:
            _first_configs(k)
        mod.range = _range


@contextlib.contextmanager
def cpu_device_guards():
    """While inside, `torch.cuda.device(None)` (a CPU tensor's device index) or of a CPU device is a no-op."""
    import torch
    real = torch.cuda.device

    def device(index):
        cpu = index is None or getattr(index, "type", None) == "cpu"  # an index, or a torch.device
        return contextlib.nullcontext() if cpu else real(index)
    torch.cuda.device = device
    try:
        yield
    finally:
        torch.cuda.device = real


def interpreted(prefix: str, fn):
    """`fn` (a peer op of the package `prefix`) with the shims: the package's kernels made interpretable at the
    call, and `cpu_device_guards` around it."""
    def call(*args, **kwargs):
        interpretable(prefix)
        with cpu_device_guards():
            return fn(*args, **kwargs)
    # fn's name, doc and signature, but no __wrapped__: the contract tests unwrap an op to what was registered
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(call, attr, getattr(fn, attr, None))
    call.__signature__ = inspect.signature(fn)
    return call


def unavailable_here(kernels: str, package: str, *modules: str) -> str | None:
    """Why a peer's Triton kernels (`kernels`, e.g. "fla-core's") cannot run here, None when they can: they need
    a CUDA device or Triton's interpreter, and `modules` importable (`package` names what to install)."""
    from harness.impls.adapters import unavailable_reason
    from harness.impls.triton._common import has_gpu, interpreting
    if not (interpreting() or has_gpu()):
        return (f"{kernels} Triton kernels need a CUDA device, or TRITON_INTERPRET=1 to run on CPU through "
                "Triton's interpreter (pytest --device cpu sets it)")
    return unavailable_reason(package, *modules)
