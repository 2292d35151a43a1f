"""Helpers the op suites share: state pools (contiguous, page-major or channels-last strided views),
slot choice, the untouched-slot check and the pad-row check.

A page-major pool mimics an engine that keeps all of a slot's layers in one page: the pool is a view
into a larger buffer whose slot stride exceeds the slot's numel, so kernels that ignore strides fail.
A channels-last pool mimics vLLM's conv state: each slot is stored as (K-1, conv_dim) in memory and
handed to kernels as the transposed view (conv_dim, K-1) with strides (page, 1, conv_dim), so kernels
that assume a row-major slot (`.view` on a slot, pointer offsets `d * (K-1) + k`) fail.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import random

import torch

from harness.testing.checks import assert_bitwise_equal
from harness.ops import PAD_SLOT_ID

# The layouts every pool suite draws; conv-state suites draw CONV_LAYOUTS (vLLM's channels-last slots too).
LAYOUTS = ("contiguous", "page_major")
CONV_LAYOUTS = LAYOUTS + ("channels_last",)
ALL_LAYOUTS = CONV_LAYOUTS


def make_pool(num_slots: int, slot_shape: tuple, dtype: torch.dtype, device, layout: str = "contiguous",
              seed: int = 0, extra: int = 7) -> torch.Tensor:
    """A pool of `num_slots` random slots of `slot_shape`. `page_major` returns a strided view whose
    slot stride is numel(slot) + `extra` (another "layer" living in the same page). `channels_last`
    stores each slot with its last two dims swapped (a conv slot (D, K-1) as (K-1, D), as vLLM does) in a
    page of numel(slot) + `extra` elements and returns the transposed view: slot strides
    (page, ..., 1, slot_shape[-2])."""
    if layout not in ALL_LAYOUTS:
        raise ValueError(f"layout: expected one of {ALL_LAYOUTS}, got {layout!r}")
    if layout == "channels_last" and len(slot_shape) < 2:
        raise ValueError(f"slot_shape: expected at least 2 dims for layout 'channels_last', got {tuple(slot_shape)}")
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in slot_shape:
        numel *= s
    if layout == "contiguous":
        return torch.randn((num_slots,) + tuple(slot_shape), generator=g, dtype=torch.float32).to(device, dtype)
    page = numel + extra
    buf = torch.randn(num_slots * page, generator=g, dtype=torch.float32).to(device, dtype)
    if layout == "page_major":
        return buf.as_strided((num_slots,) + tuple(slot_shape),
                              (page,) + tuple(torch.empty(slot_shape).stride()))
    stored = tuple(slot_shape[:-2]) + (slot_shape[-1], slot_shape[-2])
    return buf.as_strided((num_slots,) + stored, (page,) + tuple(torch.empty(stored).stride())).transpose(-1, -2)


def choose_slots(num_requests: int, num_slots: int, rng: random.Random, pad_prob: float = 0.0) -> list[int]:
    """Distinct slots for the live requests; some requests become pads with probability `pad_prob`."""
    if num_requests > num_slots:
        raise ValueError(f"num_requests: expected at most num_slots={num_slots}, got {num_requests}")
    slots = rng.sample(range(num_slots), num_requests)
    return [PAD_SLOT_ID if rng.random() < pad_prob else s for s in slots]


def assert_untouched(pool_before: torch.Tensor, pool_after: torch.Tensor, live_slots, name="pool") -> None:
    """Every slot not in `live_slots` is bit-for-bit unchanged (pad slots included)."""
    live = set(int(s) for s in live_slots if s != PAD_SLOT_ID)
    for s in range(pool_before.shape[0]):
        if s not in live:
            assert_bitwise_equal(f"{name}[{s}] (slot not named by the batch)", pool_after[s], pool_before[s])


def pad_rows(op: str, args, kwargs: dict) -> torch.Tensor | None:
    """For a call `op(*args, **kwargs)` of an op of `harness.ops` with slot ids, the output rows that pad
    requests own (a bool mask on the host, one entry per output row; `reference.pads`): a decode op's rows
    whose slot id is the pad id, a varlen op's tokens of pad requests, a multi-token decode's tokens of its
    padding rows. None when the op takes no slot ids or the call has no pad row."""
    from harness.ops import SPECS
    from reference.pads import pad_row_mask
    sp = SPECS.get(op)
    if sp is None or sp.index is None:
        return None
    a = dict(zip(sp.args, args))
    a.update(kwargs)
    pad = a.get("pad_slot_id", PAD_SLOT_ID)
    idx = a[sp.index].detach().cpu()
    if idx.dim() == 2:  # a multi-token decode: rows over query_start_loc, a slot table per row
        from reference.spec_decode import spec_rows
        qsl = a["query_start_loc"].detach().cpu()
        T = int(qsl[-1])
        rows = spec_rows(qsl, idx, a["num_accepted_tokens"].detach().cpu(), T, a[sp.pool].shape[0], pad, sp.index)
        mask = [False] * T
        for start, end, init, _ in rows:
            if init == pad:
                mask[start:end] = [True] * (end - start)
    elif "query_start_loc" in a:
        qsl = a["query_start_loc"].detach().to("cpu", torch.int64)
        mask = pad_row_mask(idx, pad, qsl, int(qsl[-1]))
    else:
        mask = pad_row_mask(idx, pad)
    if not any(mask):
        return None
    return torch.tensor(mask, dtype=torch.bool)


def assert_pad_rows_zero(op: str, y: torch.Tensor, mask: torch.Tensor | None, name: str = "y",
                         context: str = "") -> None:
    """The rows of `y` in `mask` (see `pad_rows`) are exactly zero (the op contract: a pad request's output
    rows are 0, not left unwritten); a NaN there fails too."""
    if mask is None or not bool(mask.any()):
        return
    rows = mask.nonzero().flatten().tolist()
    got = y.detach()[torch.tensor(rows, device=y.device)].cpu().reshape(len(rows), -1)
    bad = (got != 0).any(dim=1)  # NaN != 0
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        row = got[k]
        value = float(row[(row != 0).nonzero()[0]])
        n = int(bad.sum())
        raise AssertionError(f"{op}: pad rows of {name} must be zero: row {rows[k]} has {value!r}"
                             + (f" ({n} of the {len(rows)} pad rows are not)" if n > 1 else "")
                             + (f". {context}" if context else ""))


# Reasons of the examples an implementation declined in the running test (set by the plugin per test call).
UNSUPPORTED: contextvars.ContextVar = contextvars.ContextVar("harness_unsupported", default=None)


@contextlib.contextmanager
def unsupported_skips(impl):
    """An adapter that raises NotImplementedError for a case (e.g. mamba_ssm: one initial state per batch
    row, no initial state for its CUDA scan) does not fail the test.

    Inside a hypothesis test the example is rejected and the search goes on with others, so the cases the
    implementation does support are still explored (skipping the whole test at the first unsupported example
    hid a mamba_ssm state bug from the SSD suite); when no example at all was supported, the plugin turns
    hypothesis' Unsatisfiable into a skip that gives the implementation's reason. Outside hypothesis the
    test skips with the reason."""
    import pytest
    try:
        yield
    except NotImplementedError as e:
        reason = f"{getattr(impl, 'name', impl)}: {e}"
        import hypothesis
        if hypothesis.currently_in_test_context():
            seen = UNSUPPORTED.get()
            if seen is not None:
                seen.append(reason)
            hypothesis.reject()
        pytest.skip(reason)


def declining(impl):
    """`impl` with every op run inside `unsupported_skips`: the `impl` the pytest plugin hands to tests, so
    a case an implementation declines is dropped wherever its op is called (op suites, engine, scenarios)."""
    def wrap(fn):
        @functools.wraps(fn)
        def op(*args, **kwargs):
            with unsupported_skips(impl):
                return fn(*args, **kwargs)
        return op
    return dataclasses.replace(impl, ops={name: wrap(fn) for name, fn in impl.ops.items()})


def strict_op(impl, name: str):
    """`impl`'s op `name` as the implementation registered it, without `declining`'s wrapper: for the
    contract tests (bad input must raise ValueError, the valid base cases must run), where a
    NotImplementedError is a failure, not a declined case."""
    return inspect.unwrap(impl.op(name))
