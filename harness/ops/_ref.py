"""Plumbing shared by the specs' `reference` functions: pool slots in and out, output dtype.

The reference ops of `reference/` take per-sequence initial states and return final states; these
helpers gather the named slots (zeros where a request has no initial state or is padding), scatter the
final states back (pads untouched), zero the output rows of pad requests, and emit the output into `out=`
or in the activations' dtype (float64 while the oracle evaluates).
"""
from __future__ import annotations

import contextlib

import torch

from harness.ops._checks import PAD_SLOT_ID

_ORACLE = [False]  # a stack: True while the float64 oracle evaluates (keeps float64 outputs)


@contextlib.contextmanager
def oracle_mode():
    _ORACLE.append(True)
    try:
        yield
    finally:
        _ORACLE.pop()


def up(t, dtype):
    return None if t is None else t.detach().to(dtype)


def slot_list(indices, pad_slot_id):
    """Host list of slot ids with the caller's pad id normalised to PAD_SLOT_ID."""
    return [PAD_SLOT_ID if s == pad_slot_id else s for s in indices.tolist()]


def gather(pool, idx, has_init, dtype):
    """Initial states for each request: the slot if has_initial_state and not pad, else zeros."""
    shape = (len(idx),) + tuple(pool.shape[1:])
    init = torch.zeros(shape, dtype=dtype, device=pool.device)
    for i, (s, h) in enumerate(zip(idx, has_init)):
        if s != PAD_SLOT_ID and h:
            init[i] = pool[s].to(dtype)
    return init


def scatter(pool, idx, final):
    for i, s in enumerate(idx):
        if s != PAD_SLOT_ID:
            pool[s] = final[i].to(pool.dtype)


def zero_pads(y, idx, query_start_loc=None):
    """`y` with the rows pad requests own set to zero, in place (`idx` from `slot_list`; with
    `query_start_loc` a varlen op's request i owns its tokens, else a decode op's request b owns row b):
    the pad-row contract of `harness.ops`, defined by `reference.pads`."""
    from reference.pads import pad_row_mask, zero_pad_rows
    if PAD_SLOT_ID not in idx:
        return y
    cu = None if query_start_loc is None else query_start_loc.detach().to("cpu", torch.int64)
    return zero_pad_rows(y, pad_row_mask(idx, PAD_SLOT_ID, cu, y.shape[0]))


def emit(y, like, out):
    """Write `y` into `out` if given; else return it in the activations' dtype (the `reference` impl) or
    as computed (float64, while the oracle evaluates)."""
    if out is not None:
        out.copy_(y.to(out.dtype))
        return out
    return y if _ORACLE[-1] else y.to(like.dtype)
