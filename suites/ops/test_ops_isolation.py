"""Op suite: request isolation, every implementation.

A batch packs independent requests; a non-finite value (NaN, +inf, -inf) in one request's inputs or
state - an engine's bad row, a pad row holding garbage, a slot nobody may read - must never change another
request's output rows or final state. Padded or masked formulations break this silently when they read
another request's (or a pad's) values and cancel them by multiplying with a zero mask: 0 * NaN = NaN.

Each test draws a small batch (2-4 requests, some pads, some starting from zeros), a victim request (live
or pad) and which of its inputs hold the non-finite value (per-token inputs, one token or all, and its own
initial state), and plants the same value in every slot the call must not read (slots not named by the
batch, slots of requests without an initial state). The poisoned call must give the other live requests
the outputs and final states of the same call with the victim clean, and leave unnamed slots bitwise
unchanged. Varlen prefill: causal_conv1d_varlen, selective_scan_varlen, ssd_varlen; decode (one row per
request, pad rows included): causal_conv1d_update, selective_state_update (both layouts).
"""
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness.testing.optest import NONFINITE, poisoned, rand, randn, require, run_isolation_case
from reference.testing import cu_seqlens_from, gen

NAN, INF = math.nan, math.inf
DTYPES = (torch.float32, torch.bfloat16)
DT_IDS = ["float32", "bfloat16"]


@dataclass(frozen=True)
class Iso:
    """One isolation case.

    lengths: tokens per request (decode ops: 1 each); slots: the pool slot of each request (-1: a pad);
    init: has_initial_state per request (varlen ops); victim: the request whose inputs are poisoned;
    fields: its poisoned inputs (per-token tensor names, and "state": its own initial state); value: the
    non-finite value; token: the victim's poisoned token (offset into its tokens, -1: all); extra: pool
    slots beyond the requests; dims: the op's sizes; seed: the inputs' seed."""
    lengths: tuple
    slots: tuple
    init: tuple
    victim: int
    fields: tuple
    value: float
    token: int = -1
    extra: int = 1
    dims: tuple = ()
    seed: int = 0


@st.composite
def iso_cases(draw, fields, dims, decode=False, max_len=9):
    if decode:
        lengths = (1,) * draw(st.integers(2, 4), label="rows")
    else:
        lens = st.lists(st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7]), st.integers(0, max_len)), min_size=2,
                        max_size=4)
        lengths = tuple(draw(lens.filter(lambda ls: any(ls)), label="lengths"))
    S = len(lengths)
    extra = draw(st.integers(0, 2), label="extra")
    perm = draw(st.permutations(range(S + extra)), label="slot_order")
    pads = draw(st.lists(st.booleans(), min_size=S, max_size=S), label="pads")
    slots = tuple(-1 if p else s for s, p in zip(perm[:S], pads))
    init = tuple(draw(st.lists(st.booleans(), min_size=S, max_size=S), label="init"))
    victim = draw(st.sampled_from([i for i, n in enumerate(lengths) if n]), label="victim")
    chosen = draw(st.lists(st.sampled_from(tuple(fields) + ("state",)), min_size=1, unique=True), label="fields")
    token = draw(st.one_of(st.just(-1), st.integers(0, lengths[victim] - 1)), label="token")
    return Iso(lengths=lengths, slots=slots, init=init, victim=victim, fields=tuple(sorted(chosen)),
               value=draw(st.sampled_from(NONFINITE), label="value"), token=token, extra=extra,
               dims=draw(dims, label="dims"), seed=draw(st.integers(0, 2**16), label="seed"))


def _indices(case, device):
    return torch.tensor(case.slots, dtype=torch.int32, device=device)


def _isolated(check, impl, op, case, args, kw, *, tokens, pool_pos, dtype, decode=False):
    """Poison `case.victim` (its `tokens` inputs, name -> argument position, and its own state if asked),
    fill every slot the call must not read with the value, and check the other live requests."""
    S = len(case.lengths)
    starts = [sum(case.lengths[:i]) for i in range(S)]
    rows_of = [list(range(starts[i], starts[i] + case.lengths[i])) for i in range(S)]
    v = case.victim
    rows = rows_of[v] if case.token < 0 else [rows_of[v][case.token]]
    clean = list(args)
    poison = list(args)
    for name, pos in tokens.items():
        if name in case.fields:
            poison[pos] = poisoned(args[pos], rows, case.value)
    pool = args[pool_pos]
    num_slots = pool.shape[0]
    named = {s for s in case.slots if s >= 0}
    read = {s for s, i in zip(case.slots, case.init) if s >= 0 and (decode or i)}
    unread = [s for s in range(num_slots) if s not in read]
    if "state" in case.fields and case.slots[v] >= 0 and case.slots[v] in read:
        unread.append(case.slots[v])
    clean[pool_pos] = pool.clone()
    poison[pool_pos] = poisoned(pool, unread, case.value)
    keep = [i for i in range(S) if i != v and case.slots[i] >= 0]
    keep_rows = torch.zeros(sum(case.lengths), dtype=torch.bool)
    for i in keep:
        keep_rows[rows_of[i]] = True
    what = (f"{case.value} in request {v}'s {', '.join(case.fields)} "
            f"({'all its tokens' if case.token < 0 else f'token {case.token}'}; "
            f"{'a pad' if case.slots[v] < 0 else f'slot {case.slots[v]}'}) and in the unread slots {sorted(unread)}")
    run_isolation_case(check, impl, op, clean, poison, kw, pool_pos=pool_pos, keep_rows=keep_rows,
                       keep_slots=[case.slots[i] for i in keep],
                       untouched_slots=[s for s in range(num_slots) if s not in named], dtype=dtype,
                       seed=case.seed, shapes={"case": str(case)}, what=what)


# ----------------------------------------------------------------------------------------- varlen prefill

CONV_DIMS = st.tuples(st.sampled_from([3, 8]), st.sampled_from([2, 3, 4]), st.booleans())  # D, K, silu


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@given(case=iso_cases(("x",), CONV_DIMS))
@example(case=Iso(lengths=(0, 1), slots=(0, 1), init=(False, False), victim=1, fields=("x",), value=NAN,
                  extra=0, dims=(3, 2, False)))  # SGLang 0.5.23: an empty request's slot is left holding what it held
def test_isolation_causal_conv1d_varlen(impl, device, check, dtype, case):
    """causal_conv1d_varlen: a non-finite x row of one request (the taps of the next request's first K-1
    tokens reach back into it) or pad, or in an unread slot, never reaches another request."""
    op = "causal_conv1d_varlen"
    require(impl, op, dtype)
    D, K, silu = case.dims
    g = gen(case.seed)
    T, S = sum(case.lengths), len(case.lengths)
    x = randn(g, (T, D), dtype, device)
    pool = randn(g, (S + case.extra, D, K - 1), dtype, device)
    args = [x, randn(g, (D, K), dtype, device, scale=0.5), randn(g, (D,), dtype, device), pool,
            cu_seqlens_from(case.lengths, device, dtype=torch.int32), _indices(case, device),
            torch.tensor(case.init, dtype=torch.bool, device=device)]
    _isolated(check, impl, op, case, args, dict(activation="silu" if silu else None), tokens={"x": 0}, pool_pos=3,
              dtype=dtype)


SCAN_DIMS = st.sampled_from([(2, 3, 1), (4, 4, 2), (3, 5, 3)])  # Dm, N, G


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@given(case=iso_cases(("u", "delta", "B", "C", "z"), SCAN_DIMS))
@example(case=Iso(lengths=(2, 0), slots=(0, 1), init=(False, False), victim=0, fields=("u",), value=NAN,
                  extra=0, dims=(2, 3, 1)))
def test_isolation_selective_scan_varlen(impl, device, check, dtype, case):
    """selective_scan_varlen: a non-finite u / delta / B / C / z of one request or pad, its own initial
    state, or an unread slot, never reaches another request."""
    op = "selective_scan_varlen"
    require(impl, op, dtype)
    Dm, N, G = case.dims
    g = gen(case.seed)
    T, S = sum(case.lengths), len(case.lengths)
    A = -torch.exp(rand(g, (Dm, N), torch.float32, device))
    u, delta = randn(g, (T, Dm), dtype, device), randn(g, (T, Dm), dtype, device, shift=-2.0)
    B, C = randn(g, (T, G, N), dtype, device), randn(g, (T, G, N), dtype, device)
    D, z, bias = randn(g, (Dm,), torch.float32, device), randn(g, (T, Dm), dtype, device), \
        randn(g, (Dm,), torch.float32, device, scale=0.5)
    pool = randn(g, (S + case.extra, Dm, N), torch.float32, device)
    args = [u, delta, A, B, C, D, z, bias, pool, cu_seqlens_from(case.lengths, device, dtype=torch.int32), _indices(case, device),
            torch.tensor(case.init, dtype=torch.bool, device=device)]
    _isolated(check, impl, op, case, args, dict(delta_softplus=True),
              tokens={"u": 0, "delta": 1, "B": 3, "C": 4, "z": 6}, pool_pos=8, dtype=dtype)


SSD_DIMS = st.sampled_from([(2, 3, 4, 1, 4), (4, 2, 5, 2, 4), (2, 3, 4, 2, 8)])  # H, P, N, G, chunk


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@given(case=iso_cases(("x", "dt", "B", "C", "z"), SSD_DIMS))
@example(case=Iso(lengths=(1, 5), slots=(0, 1), init=(False, False), victim=0, fields=("x",), value=NAN,
                  extra=0, dims=(2, 3, 4, 1, 4)))
def test_isolation_ssd_varlen(impl, device, check, dtype, case):
    """ssd_varlen: a non-finite x / dt / B / C / z of one request or pad (sequences share chunks of the
    packed stream), its own initial state, or an unread slot, never reaches another request."""
    op = "ssd_varlen"
    require(impl, op, dtype)
    H, P, N, G, chunk = case.dims
    g = gen(case.seed)
    T, S = sum(case.lengths), len(case.lengths)
    A = -torch.exp(rand(g, (H,), torch.float32, device))
    x, dt = randn(g, (T, H, P), dtype, device), randn(g, (T, H), dtype, device, shift=-2.0)
    B, C = randn(g, (T, G, N), dtype, device), randn(g, (T, G, N), dtype, device)
    D, z, bias = randn(g, (H,), torch.float32, device), randn(g, (T, H, P), dtype, device), \
        randn(g, (H,), torch.float32, device, scale=0.5)
    pool = randn(g, (S + case.extra, H, P, N), torch.float32, device)
    args = [x, dt, A, B, C, chunk, D, z, bias, pool, cu_seqlens_from(case.lengths, device, dtype=torch.int32), _indices(case, device),
            torch.tensor(case.init, dtype=torch.bool, device=device)]
    _isolated(check, impl, op, case, args, dict(dt_softplus=True),
              tokens={"x": 0, "dt": 1, "B": 3, "C": 4, "z": 7}, pool_pos=9, dtype=dtype)


# ----------------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@given(case=iso_cases(("x",), CONV_DIMS, decode=True))
def test_isolation_causal_conv1d_update(impl, device, check, dtype, case):
    """causal_conv1d_update: a non-finite x row (a live row or a pad row), a live row's own window, or an
    unnamed slot never reaches another row."""
    op = "causal_conv1d_update"
    require(impl, op, dtype)
    D, K, silu = case.dims
    g = gen(case.seed)
    Bsz = len(case.lengths)
    args = [randn(g, (Bsz, D), dtype, device), randn(g, (Bsz + case.extra, D, K - 1), dtype, device),
            randn(g, (D, K), dtype, device, scale=0.5), randn(g, (D,), dtype, device), _indices(case, device)]
    _isolated(check, impl, op, case, args, dict(activation="silu" if silu else None), tokens={"x": 0}, pool_pos=1,
              dtype=dtype, decode=True)


SSU_DIMS = st.sampled_from([("mamba1", 3, 4, 1), ("mamba1", 4, 3, 2), ("mamba2", 2, 3, 4, 1),
                            ("mamba2", 4, 2, 5, 2)])  # (layout, Dm, N, G) / (layout, H, P, N, G)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@given(case=iso_cases(("x", "dt", "B", "C", "z"), SSU_DIMS, decode=True))
def test_isolation_selective_state_update(impl, device, check, dtype, case):
    """selective_state_update (Mamba-1 and Mamba-2 layouts): a non-finite x / dt / B / C / z of a live or a
    pad row, a live row's own state, or an unnamed slot never reaches another row."""
    op = "selective_state_update"
    require(impl, op, dtype)
    g = gen(case.seed)
    Bsz = len(case.lengths)
    if case.dims[0] == "mamba1":
        _, Dm, N, G = case.dims
        slot, xs, dts, As, Ds = (Dm, N), (Bsz, Dm), (Bsz, Dm), (Dm, N), (Dm,)
    else:
        _, H, P, N, G = case.dims
        slot, xs, dts, As, Ds = (H, P, N), (Bsz, H, P), (Bsz, H), (H,), (H,)
    A = -torch.exp(rand(g, As, torch.float32, device))
    args = [randn(g, (Bsz + case.extra,) + slot, torch.float32, device), randn(g, xs, dtype, device),
            randn(g, dts, dtype, device, shift=-2.0), A, randn(g, (Bsz, G, N), dtype, device),
            randn(g, (Bsz, G, N), dtype, device), randn(g, Ds, torch.float32, device), randn(g, xs, dtype, device),
            randn(g, (dts[1:]), torch.float32, device, scale=0.5), _indices(case, device)]
    _isolated(check, impl, op, case, args, dict(dt_softplus=True),
              tokens={"x": 1, "dt": 2, "B": 4, "C": 5, "z": 7}, pool_pos=0, dtype=dtype, decode=True)
