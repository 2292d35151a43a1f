"""Op contract: a pad request's output rows are exactly 0 (harness.ops; reference.pads). Engines pad
CUDA-graph batches with pad requests and hand their rows on to the next layer's projections and all-reduce,
so a kernel that leaves them unwritten -- a reused buffer's stale values, NaN -- corrupts later layers while
every live request's result stays right.

For every op with slot ids (harness.ops.SPECS: each spec's `inputs` builder on its contract shapes, with and
without the optional inputs) and every implementation, the first, the last, or every request of the batch is
made a pad, and `run_pool_case` calls the op into a NaN-filled `out=`: live rows and slots match the float64
oracle, pads' and unnamed slots stay bitwise unchanged, and the pad rows must be 0. A planted bug that leaves
the pad rows unwritten (`harness.selftest.unwritten_pad_rows`, also the selftest variant `pad_rows_unwritten`)
passes every other check and is caught only by the pad-row check."""
import pytest
import torch

from harness.impls import registry
from harness.impls.reference_impl import oracle
from harness.ops import PAD_SLOT_ID, SPECS
from harness.testing import pad_rows
from harness.testing.checks import assert_bitwise_equal
from harness.testing.optest import contract_variants, require, run_pool_case

DTYPES = (torch.float32, torch.bfloat16)
WHICH = ("first", "last", "all")


def _cases():
    """case id -> (spec, shape): the contract shapes of every op that takes slot ids."""
    return {f"{name}/{tag}": (sp, v) for name, sp in SPECS.items() if sp.index for tag, v in contract_variants(sp)}


CASES = _cases()


def _padded(sp, shape, dtype, device, which):
    """The op's inputs (by name) with the `which` request(s) made pads: a decode row's or a varlen request's
    slot id, a multi-token decode row's whole slot table row, set to the pad id."""
    kw = sp.inputs(shape, dtype, device, torch.Generator().manual_seed(0))
    idx = kw[sp.index]
    rows = {"first": [0], "last": [idx.shape[0] - 1], "all": list(range(idx.shape[0]))}[which]
    for r in rows:
        idx[r] = PAD_SLOT_ID
    return kw


def _live_slots(sp, kw):
    """The slots the call writes (those run_pool_case compares with the oracle's pool)."""
    idx = kw[sp.index]
    if idx.dim() == 1:
        return [s for s in idx.tolist() if s != PAD_SLOT_ID]
    from reference.spec_decode import spec_rows, written_slots
    qsl = kw["query_start_loc"]
    rows = spec_rows(qsl, idx, kw["num_accepted_tokens"], int(qsl[-1]), kw[sp.pool].shape[0], PAD_SLOT_ID)
    return written_slots(rows, PAD_SLOT_ID)


def _run(check, impl, sp, kw, dtype):
    pos, opt = sp.split(kw)
    y_ref, _ = oracle(sp.name, *pos, **opt)
    act = kw["v"] if "v" in kw else kw.get("x", kw.get("u"))
    pads = pad_rows(sp.name, pos, opt)
    assert pads is not None and bool(pads.any()), f"{sp.name}: the case has no pad row"
    return run_pool_case(check, impl, sp.name, pos, opt, pool_pos=sp.args.index(sp.pool), live_slots=_live_slots(sp, kw),
                         y_mask=~pads, dtype=dtype, out_like=torch.empty(y_ref.shape, dtype=act.dtype, device=act.device))


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pad_rows_are_zero(impl, device, check, case, dtype, which):
    """Every op of every implementation stores 0 over its pad requests' rows of a NaN-filled `out=`, and
    computes the live ones as the oracle does."""
    sp, shape = CASES[case]
    require(impl, sp.name, dtype, device)
    _run(check, impl, sp, _padded(sp, shape, dtype, device, which), dtype)


# ----------------------------------------------------------------------------- the planted bug

@pytest.mark.parametrize("case", ["selective_state_update/mamba2-full", "causal_conv1d_varlen/0-full",
                                  "kda_update/0-full", "selective_state_update_spec/mamba1-full"])
def test_unwritten_pad_rows_are_caught_only_by_the_pad_row_check(check, case):
    """The planted ops that leave pad rows unwritten give live rows, live slots and every other slot bit for
    bit what the unbroken torch ops give (the oracle, slot and input checks alone let them through); the
    pad-row check of `run_pool_case` names the output, a pad row and its NaN."""
    from harness.selftest import unwritten_pad_rows
    sp, shape = CASES[case]
    torch_impl = registry.get("torch")
    broken = unwritten_pad_rows(torch_impl)
    runs = []
    for fn in (torch_impl.op(sp.name), broken.op(sp.name)):
        kw = _padded(sp, shape, torch.float32, "cpu", "first")
        pos, opt = sp.split(kw)
        y = fn(*pos, **opt)
        runs.append((y, kw[sp.pool], ~pad_rows(sp.name, pos, opt)))
    (y0, p0, live), (y1, p1, _) = runs
    assert_bitwise_equal(f"{sp.name}: live rows of the planted op", y1[live], y0[live])
    assert_bitwise_equal(f"{sp.name}: pool after the planted op", p1, p0)
    assert bool(y1[~live].isnan().all()), "the planted op must leave NaN in the pad rows"
    _run(check, torch_impl, sp, _padded(sp, shape, torch.float32, "cpu", "first"), torch.float32)
    with pytest.raises(AssertionError, match=rf"{sp.name}: pad rows of y must be zero: row \d+ has nan"):
        _run(check, broken, sp, _padded(sp, shape, torch.float32, "cpu", "first"), torch.float32)
