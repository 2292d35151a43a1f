"""Op suite: decays of either sign, every implementation against the float64 oracle.

The contract takes A and dt as they come: it does not promise dt * A <= 0. A > 0, or dt < 0 where
dt_limit has a negative low end, makes the recurrence grow (exp(dt * A) > 1); A = -inf wipes the state at
every token (exp(-inf) = 0). A kernel that assumes a decaying system (clamping an exponent at 0, or
forming -inf - (-inf)) is silently wrong there. These properties draw such inputs, kept where the
float64 recurrence stays finite and moderate (growth of at most ~e^0.6 a token over <= 20 tokens), for
ssd_varlen and selective_state_update (both layouts).
"""
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness.testing.optest import randn, require, run_pool_case, token_mask
from reference.testing import cu_seqlens_from, gen
from harness.testing import make_pool

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
DT_IDS = ["float32", "float64", "bfloat16"]


@dataclass(frozen=True)
class Signed:
    """A: one value per head / channel row (cycled; -inf allowed); softplus: dt_softplus; dt_limit: the
    clamp; dt_scale / dt_shift: the raw dt is randn * scale + shift; lengths: tokens per request (decode: 1
    each); dims: the op's sizes; seed: the inputs' seed."""
    A: tuple
    softplus: bool
    dt_limit: tuple
    dt_scale: float = 1.0
    dt_shift: float = -2.0
    lengths: tuple = (1,)
    dims: tuple = ()
    seed: int = 0


@st.composite
def signed_cases(draw, dims, decode=False):
    A = tuple(draw(st.lists(st.one_of(st.floats(-1.0, 0.3), st.sampled_from([0.0, 0.3, -math.inf])),
                            min_size=1, max_size=4), label="A"))
    wipes = any(math.isinf(a) for a in A)
    # dt * -inf is finite only for dt > 0: softplus then (its output is positive whatever the clamp's low end)
    softplus = True if wipes else draw(st.booleans(), label="dt_softplus")
    lo = draw(st.sampled_from([0.0, -0.05, -0.3]), label="dt_limit_lo")
    hi = draw(st.sampled_from([math.inf, 0.5]), label="dt_limit_hi")
    if softplus:
        scale, shift = 1.0, -2.0  # softplus(randn - 2): 0.01 .. ~1.5
    else:
        scale, shift = 0.3, 0.0  # either sign, clamped to [lo, hi]
    if decode:
        lengths = (1,) * draw(st.integers(1, 3), label="rows")
    else:
        lengths = tuple(draw(st.lists(st.integers(0, 20), min_size=1, max_size=3).filter(lambda ls: sum(ls) <= 30),
                             label="lengths"))
    return Signed(A=A, softplus=softplus, dt_limit=(lo, hi), dt_scale=scale, dt_shift=shift, lengths=lengths,
                  dims=draw(dims, label="dims"), seed=draw(st.integers(0, 2**16), label="seed"))


def _cycled(values, n, dtype, device):
    return torch.tensor([values[i % len(values)] for i in range(n)], dtype=dtype, device=device)


def _wide(dtype):
    """Parameters and pools: float32, float64 for float64 runs (the `reference` implementation computes in
    its first float argument's dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


SSD_DIMS = st.sampled_from([(2, 3, 4, 1, 8), (4, 2, 5, 2, 4), (2, 5, 7, 2, 16)])  # H, P, N, G, chunk


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@given(case=signed_cases(SSD_DIMS))
@example(case=Signed(A=(0.05,), softplus=True, dt_limit=(0.0, math.inf), lengths=(5, 13, 3), dims=(2, 3, 4, 1, 8)))
@example(case=Signed(A=(-0.5,), softplus=False, dt_limit=(-0.3, math.inf), dt_scale=0.3, dt_shift=0.0,
                     lengths=(5, 13, 3), dims=(2, 3, 4, 1, 8)))
@example(case=Signed(A=(-math.inf, -0.5), softplus=True, dt_limit=(0.0, math.inf), lengths=(5, 13, 3),
                     dims=(2, 3, 4, 1, 8)))
def test_ssd_varlen_decay_of_either_sign(impl, device, check, dtype, case):
    """ssd_varlen with A of either sign (and -inf), dt of either sign under a dt_limit with a negative low
    end, several requests (mid-chunk starts, some from a state), matches the float64 oracle on every token
    and final state."""
    op = "ssd_varlen"
    require(impl, op, dtype)
    H, P, N, G, chunk = case.dims
    g = gen(case.seed)
    T, S = sum(case.lengths), len(case.lengths)
    x, B, C = randn(g, (T, H, P), dtype, device), randn(g, (T, G, N), dtype, device), \
        randn(g, (T, G, N), dtype, device)
    dt = randn(g, (T, H), dtype, device, scale=case.dt_scale, shift=case.dt_shift)
    pool = make_pool(S + 1, (H, P, N), _wide(dtype), device, seed=case.seed)
    slots = list(range(1, S + 1))
    hi = torch.tensor([i % 2 == 0 for i in range(S)], device=device)
    A, D = _cycled(case.A, H, _wide(dtype), device), randn(g, (H,), _wide(dtype), device)
    args = [x, dt, A, B, C, chunk, D, None, None, pool, cu_seqlens_from(case.lengths, device, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32, device=device), hi]
    run_pool_case(check, impl, op, args, dict(dt_softplus=case.softplus, dt_limit=case.dt_limit), pool_pos=9,
                  live_slots=slots, y_mask=token_mask(case.lengths, slots), dtype=dtype, seed=case.seed,
                  shapes={"case": str(case)})


SSU_DIMS = st.sampled_from([("mamba1", 3, 4, 1), ("mamba1", 4, 3, 2), ("mamba2", 2, 3, 4, 1),
                            ("mamba2", 4, 2, 5, 2)])  # (layout, Dm, N, G) / (layout, H, P, N, G)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@given(case=signed_cases(SSU_DIMS, decode=True))
@example(case=Signed(A=(0.3,), softplus=False, dt_limit=(-0.3, 0.5), dt_scale=0.3, dt_shift=0.0,
                     lengths=(1, 1), dims=("mamba2", 2, 3, 4, 1)))
@example(case=Signed(A=(-math.inf, 0.3), softplus=True, dt_limit=(-0.05, math.inf), lengths=(1, 1),
                     dims=("mamba1", 3, 4, 1)))
def test_state_update_decay_of_either_sign(impl, device, check, dtype, case):
    """selective_state_update (Mamba-1 and Mamba-2 layouts) with A of either sign (and -inf) and dt of either
    sign under a dt_limit with a negative low end matches the float64 oracle (y and the new states)."""
    op = "selective_state_update"
    require(impl, op, dtype)
    g = gen(case.seed)
    Bsz = len(case.lengths)
    if case.dims[0] == "mamba1":
        _, Dm, N, G = case.dims
        slot, xs, dts = (Dm, N), (Bsz, Dm), (Bsz, Dm)
        A = _cycled(case.A, Dm * N, _wide(dtype), device).reshape(Dm, N)
    else:
        _, H, P, N, G = case.dims
        slot, xs, dts = (H, P, N), (Bsz, H, P), (Bsz, H)
        A = _cycled(case.A, H, _wide(dtype), device)
    pool = make_pool(Bsz + 1, slot, _wide(dtype), device, seed=case.seed)
    slots = list(range(1, Bsz + 1))
    args = [pool, randn(g, xs, dtype, device), randn(g, dts, dtype, device, scale=case.dt_scale, shift=case.dt_shift),
            A, randn(g, (Bsz, G, N), dtype, device), randn(g, (Bsz, G, N), dtype, device),
            randn(g, (dts[1],), _wide(dtype), device), None, None,
            torch.tensor(slots, dtype=torch.int32, device=device)]
    run_pool_case(check, impl, op, args, dict(dt_softplus=case.softplus, dt_limit=case.dt_limit), pool_pos=0,
                  live_slots=slots, y_mask=None, dtype=dtype, seed=case.seed, shapes={"case": str(case)})
