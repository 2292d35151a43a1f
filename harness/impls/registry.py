"""Registry of named implementations.

An implementation is an `Impl`: a name, the devices it runs on, and a dict from op name (as
documented in `harness.ops`) to a callable that follows that op's contract. Ops an
implementation lacks are simply absent: suites skip them with a reason.

Three ways in:
* built-in modules: `BUILTIN_MODULES` and every module of `harness.impls.adapters` (each calls `register` at import);
* the entry-point group `ssm_harness.impls` (each entry point names an `Impl` object or a
  zero-argument callable returning one);
* `--impl module:object` on the pytest or harness command line (`load_spec`).

Example of an outside implementation (a file `my_kernels.py` on the Python path)::

    from harness.impls import Impl
    def my_conv(x, weight, bias=None, **kw): ...
    IMPL = Impl(name="mine", devices=("cuda",), ops={"causal_conv1d_varlen": my_conv})

    pytest suites/ --device cuda --impl my_kernels:IMPL
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import torch

ENTRY_POINT_GROUP = "ssm_harness.impls"

# Our own implementations, in listing order; then every module of harness.impls.adapters (an adapter for a
# third-party kernel library is a new file there, nothing else changes).
BUILTIN_MODULES = [
    "harness.impls.reference_impl",
    "harness.impls.torch",
    "harness.impls.triton",
]
ADAPTER_PACKAGE = "harness.impls.adapters"


def builtin_modules() -> list[str]:
    """Our implementations' modules and the adapters' (modules of ADAPTER_PACKAGE not starting with _)."""
    pkg = importlib.import_module(ADAPTER_PACKAGE)
    return BUILTIN_MODULES + [f"{ADAPTER_PACKAGE}.{m.name}" for m in sorted(pkgutil.iter_modules(pkg.__path__),
                                                                         key=lambda m: m.name)
                              if not m.name.startswith("_")]

DEVICE_KINDS = ("cpu", "cuda", "xpu")


@dataclass
class Impl:
    name: str
    ops: dict[str, Callable]
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    deterministic: bool = True
    description: str = ""
    # How the implementation multiplies fp32 inputs on the GPU: "ieee", or "tf32" (10-bit mantissa, like
    # fp16's): the checks then judge its fp32 results at the fp16 tolerance and say so.
    fp32_matmul: str = "ieee"
    # True where the implementation reads slot ids or values on the host to decline what it cannot run (the
    # peers' adapters: `harness.impls.adapters.host_reads_ok`). The engine then keeps every op call's host-side
    # index checks; for the others it checks the step's slot ids once on the host and runs the layers inside
    # `harness.ops.no_index_checks()` (no device-to-host read per op call).
    reads_host: bool = False
    # Returns None when usable, else the reason it is not (e.g. "package mamba_ssm not importable").
    unavailable: Callable[[], str | None] = field(default=lambda: None)
    # Internal token tiles per op: op name -> the token lengths across which the implementation carries
    # state from one piece of a sequence to the next (chunk sizes of a chunked scan, block lengths of a
    # kernel's token loop, a peer's fixed chunk). Suites draw lengths and split points on both sides of
    # every multiple of them (`harness.testing.optest.tiled_seqlens`). Ops whose tile is an argument
    # (ssd_varlen's `chunk_size`) need no entry: the suites add the argument.
    tiles: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def supports(self, device: str) -> bool:
        return device.split(":")[0] in self.devices

    def why_unavailable(self, device: str | None = None) -> str | None:
        reason = self.unavailable()
        if reason:
            return reason
        if device is not None and not self.supports(device):
            return f"implementation {self.name!r} runs on {list(self.devices)}, not on {device.split(':')[0]}"
        return None

    def op(self, name: str) -> Callable:
        if name not in self.ops:
            raise KeyError(f"op: implementation {self.name!r} provides {sorted(self.ops)}, not {name!r}")
        return self.ops[name]


_REGISTRY: dict[str, Impl] = {}
_loaded = False


_PROVIDED: dict[str, dict[str, Callable]] = {}


def provides(impl_name: str, op: str):
    """Decorator: the function implements op `op` of the contract (a spec of `harness.ops`) for the
    implementation `impl_name`, which collects its ops with `provided(impl_name)`."""
    from harness.ops import spec
    spec(op)  # an op name that is no spec fails here, at import

    def deco(fn: Callable) -> Callable:
        _PROVIDED.setdefault(impl_name, {})[op] = fn
        return fn
    return deco


def provided(impl_name: str, package: str | None = None) -> dict[str, Callable]:
    """The ops registered with `@provides(impl_name, ...)`, after importing every module of `package`
    (so an op's new module is picked up without editing a table)."""
    if package is not None:
        import pkgutil
        pkg = importlib.import_module(package)
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            if not m.name.startswith("_"):
                importlib.import_module(f"{package}.{m.name}")
    return dict(_PROVIDED.get(impl_name, {}))


def register(impl: Impl, replace: bool = False) -> Impl:
    if not isinstance(impl, Impl):
        raise ValueError(f"impl: expected a harness.impls.Impl, got {type(impl).__name__}")
    from harness.ops import SPECS
    unknown = sorted(set(impl.ops) - set(SPECS))
    if unknown:
        raise ValueError(f"impl.ops: expected op names of harness.ops {sorted(SPECS)}, got {unknown} "
                         f"(implementation {impl.name!r})")
    bad = [d for d in impl.devices if d not in DEVICE_KINDS]
    if bad:
        raise ValueError(f"impl.devices: expected entries of {DEVICE_KINDS}, got {bad}")
    bad_tiles = {op: t for op, t in impl.tiles.items()
                 if op not in impl.ops or not t or not all(isinstance(n, int) and n >= 1 for n in t)}
    if bad_tiles:
        raise ValueError(f"impl.tiles: expected op -> a non-empty tuple of positive ints, for ops the "
                         f"implementation provides, got {bad_tiles} (implementation {impl.name!r})")
    if impl.name in _REGISTRY and not replace and _REGISTRY[impl.name] is not impl:
        raise ValueError(f"impl.name: expected a name not yet registered, got {impl.name!r} (already registered)")
    _REGISTRY[impl.name] = impl
    return impl


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in builtin_modules():
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            # Only a module of ours that does not exist (yet) is skipped; a missing third-party
            # package inside an adapter is handled by the adapter itself (Impl.unavailable).
            if e.name != mod and not mod.startswith(str(e.name) + "."):
                raise
    try:
        from importlib.metadata import entry_points
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            obj = ep.load()
            register(obj() if callable(obj) and not isinstance(obj, Impl) else obj, replace=True)
    except Exception as e:  # noqa: BLE001 - report which entry point broke
        raise RuntimeError(f"entry point group {ENTRY_POINT_GROUP}: failed to load: {e}") from e


def load_spec(spec: str) -> Impl:
    """Load `module:object` (an Impl or a callable returning one) and register it."""
    if ":" not in spec:
        raise ValueError(f"--impl: expected a registered name or 'module:object', got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--impl {spec}: expected an importable module {mod_name!r}, got {e}") from None
    if not hasattr(mod, attr):
        raise ValueError(f"--impl {spec}: expected module {mod_name!r} to define {attr!r}, got no such name")
    obj = getattr(mod, attr)
    impl = obj() if callable(obj) and not isinstance(obj, Impl) else obj
    return register(impl, replace=True)


def all_impls() -> dict[str, Impl]:
    _load_builtins()
    return dict(_REGISTRY)


def get(name: str) -> Impl:
    if ":" in name:
        return load_spec(name)
    impls = all_impls()
    if name not in impls:
        raise ValueError(f"--impl: expected one of {sorted(impls)} or 'module:object', got {name!r}")
    return impls[name]


def implementations_for(device: str) -> list[Impl]:
    """Registered implementations that run on `device` and are usable on this machine."""
    return [i for i in all_impls().values() if i.why_unavailable(device) is None]
