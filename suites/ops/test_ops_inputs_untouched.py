"""Op contract: inputs are read-only. An op writes only its state pool and `out=` (harness.ops, "Inputs are
read-only"); every other tensor argument -- activations, dt, A, dt_bias, weights, slot indices, offsets,
flags -- is bit-for-bit what the caller passed, after the call.

For every op (harness.ops.SPECS: each spec's `inputs` builder on its contract shapes, with and without the
optional inputs) and every implementation, the test snapshots each tensor argument but the pool and `out=`,
calls the op and compares. A planted in-place bug (a decode op that applies dt_bias and softplus to the
caller's `dt` and then runs with them switched off: outputs and states stay right) passes every
output and state check and is caught only here."""

import pytest
import torch

from harness.impls import registry
from harness.impls.reference_impl import oracle
from harness.ops import SPECS
from harness.testing.checks import poison_
from harness.testing.optest import (assert_inputs_unchanged, contract_variants, require, run_pool_case,
                                    snapshot_inputs)
from harness.testing.planted import dt_in_place

DTYPES = (torch.float32, torch.bfloat16)


def _cases():
    """case id -> (spec, shape): each contract shape as declared, and with every optional input present
    (dt_bias, D, z, bias, the activation, dt softplus) where the declared one leaves them out."""
    return {f"{name}/{tag}": (sp, v) for name, sp in SPECS.items() for tag, v in contract_variants(sp)}


CASES = _cases()


def _call(sp, fn, kwargs):
    """Call `fn` (op `sp`) without `out=` and then with a NaN-poisoned `out=` shaped like the first result,
    checking after each call that every input but the pool and `out=` is bitwise unchanged."""
    pos, opt = sp.split(dict(kwargs))
    snap = snapshot_inputs(sp.name, pos, opt, skip=(sp.pool,) if sp.pool else ())
    assert snap, f"{sp.name}: no tensor inputs to check"
    y = fn(*pos, **opt)
    assert_inputs_unchanged(sp.name, snap, "(called without out=)")
    if "out" in sp.options:
        fn(*pos, **opt, out=poison_(torch.empty_like(y)))
        assert_inputs_unchanged(sp.name, snap, "(called with out=)")


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
@pytest.mark.parametrize("case", sorted(CASES))
def test_op_leaves_its_inputs_unchanged(impl, device, case, dtype):
    """Every op of every implementation writes no tensor argument but its pool and `out=`."""
    sp, shape = CASES[case]
    require(impl, sp.name, dtype, device)
    kwargs = sp.inputs(shape, dtype, device, torch.Generator().manual_seed(0))
    _call(sp, impl.op(sp.name), kwargs)


# ----------------------------------------------------------------------------- the planted bug

@pytest.mark.parametrize("layout", ["mamba1", "mamba2"])
def test_in_place_dt_is_caught_only_by_the_input_check(check, layout):
    """The planted decode op that rewrites the caller's dt in place: its y and state match the float64
    oracle (the output and state checks alone let it through), the input check names `dt`, and so does
    `run_pool_case`, which every pool-op suite calls."""
    sp, shape = CASES[f"selective_state_update/{layout}-full"]
    broken = dt_in_place(registry.get("torch"))
    kw = sp.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(0))
    pos, opt = sp.split(kw)
    y_ref, pool_ref = oracle(sp.name, *pos, **opt)
    pool = pos[0]
    y = broken.op(sp.name)(*pos, **opt)
    live = pos[-1].long()
    check.close("y of the in-place op", y, y_ref, op=sp.name, impl=broken.name, dtype=torch.float32)
    check.close("state of the in-place op", pool[live], pool_ref[live], op=sp.name, impl=broken.name,
                dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"input `dt` was written"):
        _call(sp, broken.op(sp.name), sp.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(0)))
    kw = sp.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(0))
    pos, opt = sp.split(kw)
    with pytest.raises(AssertionError, match=r"input `dt` was written"):
        run_pool_case(check, broken, sp.name, pos, opt, pool_pos=0, live_slots=pos[-1].tolist(), y_mask=None,
                      dtype=torch.float32)
    # the unbroken op passes the same check
    _call(sp, registry.get("torch").op(sp.name), sp.inputs(shape, torch.float32, "cpu",
                                                           torch.Generator().manual_seed(0)))
