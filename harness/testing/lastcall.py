"""The last op call of this process, noted before the op runs.

A kernel fault that loses the CUDA context (an illegal memory access) leaves nothing to reproduce the case
from: every later CUDA call fails, so hypothesis can neither replay nor print the failing example, and the
comparison records are only written after a call that returned. What was noted here before the call still
names it: the pytest plugin reports it with the test that lost the context (harness.testing.plugin, "A lost
CUDA context").

* `describe_call(op, fn, args, kwargs)`: a JSON-serialisable description of the call `fn(*args, **kwargs)`
  of op `op`: the op, the implementation function's qualified name and every argument (named by the op's
  spec): a tensor by its shape, dtype, stride and device (and its storage offset, where not 0), and a small
  integer or bool tensor (at most
  SMALL elements: lengths, offsets, slot indices) by its values too; a Python scalar, None or str as is.
* `note_case(**fields)`: the test's own context of the calls that follow (a hypothesis example's drawn
  `shapes` and `seed`); `note_call(desc)` keeps `desc` with the case noted last as the last call;
  `last_call()` returns it (None before any); `clear()` forgets both (the plugin does, before each test).
* `summary(desc)`: one line: "<op> by <impl fn> with <the tensors' shapes, the small tensors' values, the
  case's seed>".
"""
from __future__ import annotations

import inspect

SMALL = 64  # integer/bool tensors of at most this many elements are described by their values too
_STATE: dict = {}


def arg_names(op: str, n: int) -> list:
    """The names of the first `n` positional arguments of `op` (its spec's; `args[i]` past them)."""
    from harness.ops import SPECS
    names = list(SPECS[op].args) if op in SPECS else []
    return [names[i] if i < len(names) else f"args[{i}]" for i in range(n)]


def describe(v):
    """`v` as plain data (see the module doc); a value of another type by its repr, cut to 80 characters."""
    import torch
    if isinstance(v, torch.Tensor):
        d = {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "stride": list(v.stride()),
             "device": str(v.device)}
        if v.storage_offset():
            d["offset"] = v.storage_offset()  # a view starting inside its storage (a pool slice, z of x|z)
        if not (v.is_floating_point() or v.is_complex()) and v.numel() <= SMALL:
            d["values"] = v.tolist()
        return d
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (list, tuple)):
        return [describe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): describe(x) for k, x in v.items()}
    return repr(v)[:80]


def _qualname(fn) -> str:
    f = inspect.unwrap(fn)
    return f"{getattr(f, '__module__', None) or ''}.{getattr(f, '__qualname__', None) or repr(f)}".lstrip(".")


def describe_call(op: str, fn, args, kwargs: dict) -> dict:
    named = dict(zip(arg_names(op, len(args)), args))
    named.update(kwargs)
    return {"op": op, "fn": _qualname(fn), "args": {k: describe(v) for k, v in named.items()}}


def note_case(**fields) -> None:
    _STATE["case"] = describe(fields)


def note_call(desc: dict) -> None:
    _STATE["call"] = dict(desc, case=_STATE["case"]) if _STATE.get("case") else desc


def last_call() -> dict | None:
    return _STATE.get("call")


def clear() -> None:
    _STATE.clear()


def _short(name: str, d) -> str | None:
    if isinstance(d, dict) and "values" in d:
        return f"{name}={d['values']}"
    if isinstance(d, dict) and "shape" in d:
        return f"{name}{d['shape']} {d['dtype']}"
    return None


def summary(desc: dict, limit: int = 240) -> str:
    """One line naming the call `desc` (see the module doc), cut to `limit` characters."""
    args = desc.get("args", {})
    tensors = [_short(k, d) for k, d in args.items() if isinstance(d, dict) and "shape" in d and "values" not in d]
    small = [_short(k, d) for k, d in args.items() if isinstance(d, dict) and "values" in d]
    case = desc.get("case") or {}
    lengths = (case.get("shapes") or {}).get("lengths") if isinstance(case.get("shapes"), dict) else None
    parts = tensors[:1] + small + ([f"lengths={lengths}"] if lengths is not None else []) + \
        ([f"seed={case['seed']}"] if case.get("seed") is not None else [])
    s = f"{desc.get('op')} by {desc.get('fn')}" + (f" with {', '.join(parts)}" if parts else "")
    return s if len(s) <= limit else s[:limit - 3] + "..."
