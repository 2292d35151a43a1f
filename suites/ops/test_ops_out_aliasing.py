"""Op contract, `out=` and memory shared with the inputs: an output that overlaps an argument would be read
after it is written (another program's rows, a later chunk's window, the state pool), so every op rejects it
with a ValueError naming `out` before anything runs -- but for the ops engines run in place (the spec's
`in_place`: vLLM's and SGLang's conv update write into x unless given an output), where `out` may be that
argument itself and the result must be the one written elsewhere, bit for bit.

Each op's tiny contract cases (float32), for every implementation that provides the op: `out` carved from the
state pool's memory; `out` sharing the first activation's memory one element off, and exactly (the in-place
call, where not admitted); the in-place call where admitted. Rejected calls leave the pool and the inputs
unchanged. Views that interleave without sharing an element (x and z of one projection) are not overlap.
"""
import pytest
import torch

from harness.ops import SPECS
from harness.testing import strict_op
from harness.testing.checks import assert_bitwise_equal
from harness.testing.optest import require

OURS = ("reference", "torch", "triton")
CASES = {name: sp for name, sp in SPECS.items()}


def _inputs(sp):
    return sp.inputs(sp.shapes["contract"][0], torch.float32, "cpu", torch.Generator().manual_seed(0))


def _on(kw, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _clone(kw):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _first_activation(sp):
    return sp.args[0] if sp.pool != sp.args[0] else sp.args[1]


def _result(impl, sp, kw):
    """The op's output on a copy of `kw` (its shape and dtype are what `out=` must have); a peer that declines
    the case skips the test with its reason."""
    try:
        return sp.call(strict_op(impl, sp.name), _clone(kw))
    except NotImplementedError as e:
        if impl.name in OURS:
            raise
        pytest.skip(f"{impl.name} declines the contract case of {sp.name}: {e}")


def _rejected(impl, sp, kw, out, watch):
    """The call with `out` raises ValueError naming `out`, and the tensors named in `watch` are unchanged."""
    before = {n: kw[n].clone() for n in watch}
    with pytest.raises(ValueError) as ei:
        sp.call(strict_op(impl, sp.name), dict(kw, out=out))
    assert "out" in str(ei.value), f"{sp.name}: expected the error to name 'out', got: {ei.value}"
    for n in watch:
        assert_bitwise_equal(f"{sp.name}: {n} after the rejected call", kw[n], before[n])


@pytest.mark.parametrize("op", list(CASES))
def test_out_in_the_pool_is_rejected(impl, device, op):
    """`out` made of the state pool's first elements (the pool's memory reinterpreted in the output's dtype)."""
    sp = CASES[op]
    require(impl, op)
    if sp.pool is None:
        pytest.skip(f"{op} has no state pool")
    kw = _on(_inputs(sp), device)
    y = _result(impl, sp, kw)
    pool = kw[sp.pool]
    if pool.untyped_storage().nbytes() < y.numel() * y.element_size():
        pytest.skip(f"{op}: the contract case's pool is smaller than its output")
    out = torch.empty(0, dtype=y.dtype, device=pool.device).set_(pool.untyped_storage(), 0, y.shape)
    _rejected(impl, sp, kw, out, [sp.pool])


@pytest.mark.parametrize("how", ["one element off", "exactly"])
@pytest.mark.parametrize("op", list(CASES))
def test_out_overlapping_an_activation_is_rejected(impl, device, op, how):
    """`out` sharing the first activation's memory: shifted by one element (never admitted), or that very
    tensor (admitted only as the spec's in-place argument)."""
    sp = CASES[op]
    require(impl, op)
    kw = _on(_inputs(sp), device)
    y = _result(impl, sp, kw)
    a = _first_activation(sp)
    if how == "exactly" and sp.in_place == a:
        pytest.skip(f"{op} runs in place on {a} (test_in_place_matches_out_of_place)")
    x = kw[a]
    if x.dtype != y.dtype:
        pytest.skip(f"{op}: the output's dtype is not {a}'s")
    buf = torch.zeros(max(x.numel(), y.numel()) + 1, dtype=x.dtype, device=x.device)
    kw[a] = buf[:x.numel()].view(x.shape).copy_(x)
    if how == "exactly":
        if x.shape != y.shape:
            pytest.skip(f"{op}: the output's shape is not {a}'s")
        out = kw[a]
    else:
        out = buf[1:1 + y.numel()].view(y.shape)
    _rejected(impl, sp, kw, out, [a] + ([sp.pool] if sp.pool else []))


@pytest.mark.parametrize("op", [n for n, sp in CASES.items() if sp.in_place])
def test_in_place_matches_out_of_place(impl, device, op):
    """`out` = the in-place argument itself: the op returns it holding the result the out-of-place call
    returns, and leaves the same pool, bit for bit (a kernel that reads the input after another program
    wrote over it differs)."""
    sp = CASES[op]
    require(impl, op)
    kw = _on(_inputs(sp), device)
    ref_kw = _clone(kw)
    y = _result(impl, sp, ref_kw)
    ref_pool = None
    if sp.pool:
        ref_pool = _clone(kw)[sp.pool]
        sp.call(strict_op(impl, op), dict(_clone(kw), **{sp.pool: ref_pool}))
    run = _clone(kw)
    target = run[sp.in_place]
    got = sp.call(strict_op(impl, op), dict(run, out=target))
    assert got.data_ptr() == target.data_ptr(), f"{op}: the in-place call must return its out= ({sp.in_place})"
    assert_bitwise_equal(f"{op}: in place vs out of place", got, y)
    if sp.pool:
        assert_bitwise_equal(f"{op}: {sp.pool} after the in-place call", run[sp.pool], ref_pool)


def test_interleaved_views_are_not_overlap():
    """x and z as the two halves of one (T, 2D) projection share no element though their address ranges
    interleave: z may be the conv update's out while x is its input; one column further they overlap."""
    from harness.ops._checks import shares_memory
    xz = torch.zeros(5, 16)
    x, z = xz[:, :8], xz[:, 8:]
    assert not shares_memory(x, z) and not shares_memory(z, x)
    assert shares_memory(x, xz[:, 7:15]) and shares_memory(xz[:, 7:15], z)
    assert not shares_memory(xz.t()[:8], xz.t()[8:])  # the transposed buffer's halves
    assert not shares_memory(xz[:0], xz) and not shares_memory(x, torch.zeros(5, 8))
