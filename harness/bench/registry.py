"""Declaring benchmarks, tritonbench-style: decorators, no central table.

Three decorators:

* `@register_inputs(op, shapes={...}, tokens=..., dtypes={...})` on `make(shape, dtype, device, gen) -> dict`:
  how to build one input set of an op (keyword arguments of the op contract, harness.ops) for a shape.
  `shapes` maps a device kind ("cpu", "cuda", "xpu"; "gpu" = cuda and xpu) to a list of shape dicts.
* `@register_benchmark(op=..., impl=..., shapes=None, devices=..., peer=False)` on
  `fn(inputs: dict) -> callable`: a backend. It returns the zero-argument callable that is timed.
  Every implementation in the impl registry (harness.impls.registry) that provides the op gets a
  backend automatically (calling `impl.ops[op](**inputs)`); a decorated backend with the same
  (op, impl) name replaces the automatic one. Adding a backend = one decorated function.
* `@register_metric(name)` on `fn(case, ms_p50, ctx) -> float | None`: a column of every timing
  record (tok_s, gb_s, pct_copy_bw are registered this way in harness.bench.metrics).

Byte counts (for GB/s) live in harness.bench.bytes, one function per op. The peers' own kernels are
decorated backends too (harness.bench.peers, `<peer>.native`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# Implementations that are ours; every other registered implementation is a "peer".
OURS = ("reference", "torch", "triton")
# Implementations not timed on a device kind unless asked for by name (--impl): Triton runs through an
# interpreter on the CPU; the reference's per-token loops take seconds per call at the GPU shapes.
NOT_BY_DEFAULT = {"cpu": ("triton",), "cuda": ("reference",), "xpu": ("reference",)}


@dataclass
class OpInputs:
    op: str
    make: Callable                      # (shape, dtype, device, gen) -> dict of op kwargs
    tokens: Callable                    # shape -> tokens processed per call (None: not a token op)
    shapes: dict                        # device kind -> list[shape dict]
    dtypes: dict                        # device kind -> tuple of dtypes
    level: str = "kernel"               # "kernel" or "model"
    requires: tuple = ()                # model level: the ops an implementation needs for `compose`
    compose: Callable | None = None     # model level: (impl.ops) -> backend (inputs -> callable)
    positional: tuple = ()              # the contract's positional parameters, in order; the rest are keywords

    def call(self, fn: Callable, inputs: dict):
        """Call an implementation's op with an input set, positionally as the contract orders it."""
        args = [inputs[n] for n in self.positional]
        kwargs = {k: v for k, v in inputs.items() if k not in self.positional}
        return fn(*args, **kwargs)

    def shapes_for(self, device: str) -> list[dict]:
        kind = device.split(":")[0]
        return list(self.shapes.get(kind) or (self.shapes.get("gpu") if kind in ("cuda", "xpu") else None) or [])

    def dtypes_for(self, device: str) -> tuple:
        kind = device.split(":")[0]
        return tuple(self.dtypes.get(kind) or (self.dtypes.get("gpu") if kind in ("cuda", "xpu") else None)
                     or (torch.float32,))


@dataclass
class Benchmark:
    op: str
    impl: str
    fn: Callable                        # inputs -> zero-arg callable
    devices: tuple = ("cpu", "cuda", "xpu")
    shapes: dict | None = None          # overrides the op's shapes (same layout)
    peer: bool = False
    available: Callable = field(default=lambda: None)  # -> None | reason
    auto: bool = False                  # derived from the impl registry
    by_default: bool = True             # False: timed only when its implementation is asked for by name (--impl)

    @property
    def id(self) -> str:
        return f"{self.op}/{self.impl}"

    def runs_on(self, device: str) -> bool:
        return device.split(":")[0] in self.devices


@dataclass
class Metric:
    name: str
    fn: Callable                        # (case, ms_p50, ctx) -> float | None
    unit: str = ""


OP_INPUTS: dict[str, OpInputs] = {}
BENCHMARKS: dict[str, Benchmark] = {}
METRICS: dict[str, Metric] = {}


def register_inputs(op: str, *, shapes: dict, tokens: Callable, dtypes: dict | None = None, level: str = "kernel",
                    requires: tuple = (), compose: Callable | None = None, positional: tuple = ()):
    """Declare how to build an op's inputs. Model-level entries name the ops they `require` and a
    `compose(ops) -> backend` that builds the model step from one implementation's ops."""
    if not isinstance(shapes, dict):
        raise ValueError(f"shapes: expected a dict device kind -> list of shape dicts, got {type(shapes).__name__}")

    def deco(make):
        OP_INPUTS[op] = OpInputs(op=op, make=make, tokens=tokens, shapes=shapes,
                                 dtypes=dtypes or {"cpu": (torch.float32,), "gpu": (torch.bfloat16,)}, level=level,
                                 requires=tuple(requires), compose=compose, positional=tuple(positional))
        return make
    return deco


def register_benchmark(op: str, impl: str | None = None, *, shapes: dict | None = None,
                       devices: tuple = ("cpu", "cuda", "xpu"), peer: bool | None = None,
                       available: Callable | None = None, by_default: bool = True):
    """Declare a backend of `op` named `impl` (default: the function's name)."""
    def deco(fn):
        name = impl or fn.__name__
        BENCHMARKS[f"{op}/{name}"] = Benchmark(op=op, impl=name, fn=fn, devices=tuple(devices), shapes=shapes,
                                               peer=(name not in OURS) if peer is None else peer,
                                               available=available or (lambda: None), by_default=by_default)
        return fn
    return deco


def register_metric(name: str, unit: str = ""):
    def deco(fn):
        METRICS[name] = Metric(name=name, fn=fn, unit=unit)
        return fn
    return deco


def _impl_call(impl, op):
    fn = impl.ops[op]
    spec = OP_INPUTS[op]

    def backend(inputs):
        return lambda: spec.call(fn, inputs)
    return backend


def benchmarks_for(device: str, impls: list | None = None, ops: list | None = None,
                   include_interpreted: bool = False) -> tuple[list[Benchmark], list[str]]:
    """Every backend runnable on `device`: decorated ones plus one per (registry impl, op).

    Returns (benchmarks, skipped) where `skipped` are human-readable reasons.
    `impls`: restrict to these implementation names; `ops`: restrict to these ops.
    """
    from harness.bench import ops as _, peers as _p, variants as _v  # noqa: F401 - the built-in inputs and backends
    from harness.impls.registry import all_impls

    out: dict[str, Benchmark] = {}
    skipped: list[str] = []
    kind = device.split(":")[0]
    for name, impl in all_impls().items():
        if impls and name not in impls:
            continue
        why = impl.why_unavailable(device)
        if why:
            skipped.append(f"{name}: {why}")
            continue
        if name in NOT_BY_DEFAULT.get(kind, ()) and not (impls and name in impls) and not include_interpreted:
            why = "runs through an interpreter on the CPU" if kind == "cpu" else "per-token loops, slow at these shapes"
            skipped.append(f"{name}: not timed on {kind} by default ({why}; ask for it with --impl {name})")
            continue
        for op, spec in OP_INPUTS.items():
            if spec.compose is not None and spec.requires and all(r in impl.ops for r in spec.requires):
                fn = spec.compose(impl.ops)
            elif op in impl.ops:
                fn = _impl_call(impl, op)
            else:
                continue
            b = Benchmark(op=op, impl=name, fn=fn, peer=name not in OURS, auto=True)
            out[b.id] = b
    for bid, b in BENCHMARKS.items():
        if impls and b.impl not in impls:
            continue
        if not b.runs_on(device):
            skipped.append(f"{bid}: runs on {', '.join(b.devices)} only")
            continue
        if not b.by_default and not (impls and b.impl in impls):
            skipped.append(f"{bid}: timed only when asked for (--impl {b.impl})")
            continue
        why = b.available()
        if why:
            skipped.append(f"{bid}: {why}")
            continue
        out[bid] = b  # a decorated backend replaces the automatic one of the same name
    res = [b for b in out.values() if (not ops or b.op in ops) and (b.op in OP_INPUTS)]
    res.sort(key=lambda b: (list(OP_INPUTS).index(b.op), b.peer, b.impl))
    return res, skipped


class UnknownName(ValueError):
    """A filter named an op or implementation that does not exist (a usage error: exit 4)."""


def known_names() -> tuple[list[str], list[str]]:
    """(op names, implementation names) the benchmarks know: every declared input set, every registered
    implementation and every decorated backend."""
    from harness.bench import ops as _, peers as _p, variants as _v  # noqa: F401
    from harness.impls.registry import all_impls
    return list(OP_INPUTS), sorted(set(all_impls()) | {b.impl for b in BENCHMARKS.values()})


def split_names(values) -> list[str] | None:
    """Repeatable, comma-separated CLI values -> a list of names (None when none was given)."""
    if not values:
        return None
    out = [v.strip() for item in values for v in str(item).split(",") if v.strip()]
    return out or None


def check_names(option: str, names: list[str] | None, valid: list[str]) -> list[str] | None:
    """`names` if each is in `valid`, else UnknownName listing the valid names."""
    bad = [n for n in names or () if n not in valid]
    if bad:
        raise UnknownName(f"{option}: expected names from {', '.join(valid)}; got unknown {', '.join(bad)}")
    return names
