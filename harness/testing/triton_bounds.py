"""Out-of-bounds checks for Triton kernels run by Triton's interpreter (TRITON_INTERPRET=1).

On a GPU, a load or store past the memory a kernel was given either faults (an illegal memory access that
loses the process's CUDA context) or, more often, silently reads or overwrites whatever lies next to the
tensor in the allocator's pool. Under the interpreter (CPU tensors, the CI's Triton path) the same access
reads host memory and usually goes unnoticed. With `install()`, every masked load and store of an
interpreted kernel checks the addresses its mask lets through: each element must lie inside the storage of
one of the kernel's tensor arguments (a view's whole storage counts: writing another pool slot is the
suites' business, not this check's). An address outside all of them raises `OutOfBounds` naming the kernel,
load or store, how many addresses, the first ones and the argument storages, before the access is made.

The check hooks two private parts of `triton.runtime.interpreter` (`GridExecutor._init_args_hst`, where a
launch's arguments are copied to the host, and `InterpreterBuilder.create_masked_load` / `_store`); with a
Triton that lacks them, `install()` changes nothing and returns the reason. The pytest plugin installs it
for CPU runs unless HARNESS_TRITON_BOUNDS=0.
"""
from __future__ import annotations

_STATE: dict = {"installed": False, "kernel": None, "ranges": ()}


class OutOfBounds(RuntimeError):
    """A Triton kernel under the interpreter addressed memory outside every tensor argument's storage."""


def _storage_ranges(args) -> list:
    """[(start, end, name)] of the storages of the tensors among `args` (tuples searched too)."""
    out = []

    def add(x, name):
        if isinstance(x, tuple):
            for i, y in enumerate(x):
                add(y, f"{name}[{i}]")
            return
        if hasattr(x, "untyped_storage"):
            st = x.untyped_storage()
            out.append((st.data_ptr(), st.data_ptr() + st.nbytes(), name))

    for name, x in args:
        add(x, name)
    return out


def check(addresses, itemsize: int, what: str) -> None:
    """Raise OutOfBounds if any of `addresses` (a numpy array of byte addresses, each of an `itemsize`-byte
    element) is not inside one storage of the running kernel's arguments."""
    import numpy as np
    ranges = _STATE["ranges"]
    if _STATE["kernel"] is None or addresses.size == 0:
        return
    a = addresses.astype(np.uint64, copy=False).reshape(-1)
    ok = np.zeros(a.shape, dtype=bool)
    for lo, hi, _ in ranges:
        ok |= (a >= lo) & (a + itemsize <= hi)
    if ok.all():
        return
    bad = a[~ok]
    where = ", ".join(f"{name} [{lo:#x}, +{hi - lo} B)" for lo, hi, name in ranges) or "no tensor arguments"
    raise OutOfBounds(f"{_STATE['kernel']}: {what} of {bad.size} element(s) outside every tensor argument's "
                      f"storage, first at {', '.join(f'{int(x):#x}' for x in bad[:4])} ({itemsize}-byte "
                      f"elements); the arguments' storages: {where}")


def install() -> str | None:
    """Hook the interpreter (see the module doc). None once installed, else why it could not be."""
    if _STATE["installed"]:
        return None
    try:
        import numpy as np
        from triton.runtime import interpreter as I
        executor, builder, np_dtype = I.GridExecutor, I.InterpreterBuilder, I._get_np_dtype
        init, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store
    except (ImportError, AttributeError) as e:
        return f"this Triton's interpreter has no hooks for bounds checks ({type(e).__name__}: {e})"

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        names = list(getattr(self, "arg_names", ()))
        named = [(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args_hst)]
        _STATE["ranges"] = _storage_ranges(named + list(kwargs_hst.items()))
        _STATE["kernel"] = getattr(self.fn, "__name__", repr(self.fn))
        return args_hst, kwargs_hst

    def addresses(ptrs, mask):
        p = np.asarray(ptrs.data)
        return p[np.broadcast_to(np.asarray(mask.data, dtype=bool), p.shape)]

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        check(addresses(ptrs, mask), np.dtype(np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        check(addresses(ptrs, mask), np.dtype(np_dtype(ptrs.get_element_ty())).itemsize, "store")
        return store(self, ptrs, value, mask, cache_policy)

    executor._init_args_hst = init_args
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    _STATE["installed"] = True
    return None
