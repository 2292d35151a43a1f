"""The reference run through the op contract (`--impl reference`), and the float64 oracle.

Both come from the op specs (`harness.ops.SPECS`): each spec's `reference` evaluates the op with the
plain-loop ops of `reference/`.

`oracle(op_name, *args, **kwargs)` evaluates an op in float64 on copies of its inputs and returns
`(y, pool)`: the float64 output and the float64 pool after the op (pad and unnamed slots unchanged).
Suites compare implementations against it.

The `reference` implementation does the same in the inputs' precision (fp32 for half types) and
writes into the real pool and `out`, so the suites exercise their own plumbing on any machine.
"""
from __future__ import annotations

import inspect

import torch

from harness.impls.registry import Impl, register
from harness.ops import SPECS, spec
from harness.ops._ref import oracle_mode


def _compute_dtype(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return torch.float64 if a.dtype == torch.float64 else torch.float32
    return torch.float32


def _bind(s):
    takes = set(inspect.signature(s.validate).parameters)  # the options the validator checks

    def op(*args, **kwargs):
        # the contract's checks as every implementation makes them (out= included), then the reference's own
        s.validate(*args, **{k: v for k, v in kwargs.items() if k in takes})
        return s.reference(_compute_dtype(args, kwargs), *args, **kwargs)
    op.__name__ = f"reference_{s.name}"
    op.__doc__ = f"The reference for `{s.name}` (see harness.ops), in the inputs' precision (fp32 for half types)."
    return op


def oracle(name: str, *args, **kwargs):
    """Float64 evaluation of op `name` on copies of the inputs. Returns (y, pool_after or None)."""
    s = spec(name)
    args = list(args)
    pool = None
    if s.pool is not None:
        p = s.args.index(s.pool)
        if p < len(args):
            pool = args[p].detach().to(torch.float64).clone()
            args[p] = pool
        else:
            pool = kwargs[s.pool].detach().to(torch.float64).clone()
            kwargs = {**kwargs, s.pool: pool}
    kwargs = dict(kwargs)
    kwargs.pop("out", None)
    with oracle_mode():
        y = s.reference(torch.float64, *args, **kwargs)
    return y, pool


register(Impl(name="reference", ops={n: _bind(s) for n, s in SPECS.items()}, devices=("cpu", "cuda", "xpu"),
              description="reference/ plain loops run through the op contract (fp32 for half inputs)"))
