"""Kernel suite: the Triton Mamba-1 selective scan (harness/impls/triton/selective_scan.py) in both of its
modes, "loop" (token by token) and "assoc" (blocks of BT tokens through an associative scan), against the
float64 oracle through the op contract: several sequences with a one-token and an empty one among them,
lengths that are not a multiple of BT or of the piece length, a pad request, has_initial_state mixed, one
B/C group for the whole channel block and one per channel, a partial last channel block, a single pass
and the three-launch piece path, fp32 and fp64, a contiguous and a page-major pool.

Runs where the `triton` implementation does (CPU through the interpreter: fp32 / fp64, tiny shapes; there
pieces are 8 tokens, channel blocks 16 channels and BT at most 4).
"""
from unittest import mock

import pytest
import torch

from harness.testing import make_pool
from harness.testing.checks import assert_bitwise_equal
from harness.testing.optest import other_layout_pool, rand, randn, require, run_pool_case, token_mask
from reference.testing import cu_seqlens_from, gen

OP = "selective_scan_varlen"
PAD = -1
# (mode, BT, bc_full): BT and bc_full are "assoc" parameters, the loop mode runs once
MODES = [("loop", 4, False), ("assoc", 2, False), ("assoc", 4, False), ("assoc", 4, True)]
DTYPES = [torch.float32, torch.float64]
DT_IDS = ["float32", "float64"]


def _kernel(impl, dtype):
    """The kernel module (skipped unless the implementation under test is `triton`)."""
    if impl.name != "triton":
        pytest.skip(f"kernel-specific cases of the triton implementation (this run tests {impl.name!r})")
    require(impl, OP, dtype)
    from harness.impls.triton import selective_scan
    return selective_scan


def _case(lengths, slots, init, device, dtype, *, Dm, N, G, seed=0, layout="contiguous", optional=True):
    """Positional args of the op. dt = softplus(N(-2, 1) + bias), A = -exp(U(0, 1)); with `optional` D, z and
    delta_bias are given."""
    g = gen(seed)
    T = sum(lengths)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    u = randn(g, (T, Dm), dtype, device)
    delta = randn(g, (T, Dm), dtype, device, shift=-2.0)
    A = -torch.exp(rand(g, (Dm, N), torch.float32, device))
    B = randn(g, (T, G, N), dtype, device)
    Cm = randn(g, (T, G, N), dtype, device)
    D = randn(g, (Dm,), torch.float32, device) if optional else None
    z = randn(g, (T, Dm), dtype, device) if optional else None
    db = randn(g, (Dm,), torch.float32, device, scale=0.5) if optional else None
    pool = make_pool(max(slots + [0]) + 2, (Dm, N), acc, device, layout=layout, seed=seed)
    return [u, delta, A, B, Cm, D, z, db, pool, cu_seqlens_from(lengths, device, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32, device=device), torch.tensor(init, dtype=torch.bool, device=device)]


# (id, lengths, slots, has_initial_state, (Dm, N, G)); under the interpreter pieces are 8 tokens
CASES = [
    ("pieces, one group per block", (1, 11, 0, 6, 19), (2, 5, 1, PAD, 0), (True, False, True, True, True),
     (32, 3, 2)),
    ("pieces, group per channel, partial channel block", (7, 1, 13), (3, PAD, 1), (False, True, True),
     (20, 4, 20)),
    ("single pass", (1, 5, 2), (0, 2, PAD), (True, False, True), (5, 3, 1)),
]


@pytest.mark.parametrize("mode,bt,bc_full", MODES, ids=[f"{m}-bt{b}" + "-bc_full" * f for m, b, f in MODES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_modes_match_oracle(impl, device, check, case, dtype, mode, bt, bc_full):
    """Each mode (for "assoc" BT 2 / 4, and B/C rows of one group loaded as they are or broadcast over the
    channel block) on packed requests: y of live tokens and the live slots match the oracle, a pad request's
    y is 0 and its slot (and every unnamed slot) bitwise unchanged; run again on the pool in the other
    layout."""
    M = _kernel(impl, dtype)
    _, lengths, slots, init, (Dm, N, G) = case
    args = _case(list(lengths), list(slots), list(init), device, dtype, Dm=Dm, N=N, G=G, seed=bt + 7 * len(lengths))
    alt = other_layout_pool(args[8], "contiguous")
    with mock.patch.dict(M.CONFIG, {"mode": mode, "bt": bt, "bc_full": bc_full}):
        run_pool_case(check, impl, OP, args, dict(pad_slot_id=PAD), pool_pos=8, live_slots=list(slots),
                      y_mask=token_mask(lengths, slots, PAD), dtype=dtype, seed=0, alt_pools=(alt,),
                      shapes=dict(lengths=list(lengths), Dm=Dm, N=N, G=G, mode=mode, bt=bt, bc_full=bc_full))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_assoc_without_optional_inputs(impl, device, check, dtype):
    """"assoc" with D, z and delta_bias absent and no softplus, over pieces and blocks that do not divide
    the lengths."""
    M = _kernel(impl, dtype)
    lengths, slots, init = [9, 3, 14], [1, 0, 2], [True, False, True]
    args = _case(lengths, slots, init, device, dtype, Dm=16, N=2, G=1, seed=3, optional=False)
    args[1] = torch.nn.functional.softplus(args[1].double()).to(dtype)  # dt > 0 without the softplus
    with mock.patch.dict(M.CONFIG, {"mode": "assoc", "bt": 4}):
        run_pool_case(check, impl, OP, args, dict(delta_softplus=False, pad_slot_id=PAD), pool_pos=8,
                      live_slots=slots, y_mask=token_mask(lengths, slots, PAD), dtype=dtype, seed=0,
                      shapes=dict(lengths=lengths, optional=False))


@pytest.mark.parametrize("key,value", [("mode", "tree"), ("bt", 6), ("bt", 0)])
def test_bad_config_raises_before_writing(impl, device, key, value):
    """A launch configuration naming an unknown mode, or a BT that is not a power of 2, raises ValueError
    naming the parameter before the pool or `out=` is written."""
    M = _kernel(impl, torch.float32)
    lengths, slots, init = [3, 2], [0, 1], [True, True]
    args = _case(lengths, slots, init, device, torch.float32, Dm=5, N=2, G=1)
    pool = args[8].clone()
    out = torch.full_like(args[0], 7.0)
    with mock.patch.dict(M.CONFIG, {key: value}), pytest.raises(ValueError, match=f"CONFIG\\['{key}'\\]"):
        M.selective_scan_varlen(*args, out=out)
    assert_bitwise_equal("pool after a rejected configuration", args[8], pool)
    assert_bitwise_equal("out= after a rejected configuration", out, torch.full_like(out, 7.0))
