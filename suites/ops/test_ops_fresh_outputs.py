"""Op contract: without `out=`, an op returns a new tensor (harness.ops, "`out=`"). A result the caller holds
must not change when the op runs again: an implementation that returns a view of one workspace it reuses
from call to call (a preallocated output buffer, a cached scratch tensor) hands every caller the same
memory, and the second call overwrites the first caller's result -- the per-call checks of the op suites,
which compare each result right after its call (or pass `out=`), cannot see it.

For every op (harness.ops.SPECS: each spec's `inputs` builder on its contract shapes, with and without the
optional inputs, and on its first `cpu` benchmark shape) and every implementation, the test calls the op
several times in a row without `out=` on different inputs (its own pool each), keeps every result alive,
and compares each result with its own float64 oracle only after the last call."""

import pytest
import torch

from harness.impls import registry
from harness.impls.reference_impl import oracle
from harness.ops import SPECS
from harness.testing.checker import Checker
from harness.testing.optest import interp_small, require, spec_cases
from harness.testing.planted import shared_workspace

DTYPES = (torch.float32, torch.bfloat16)
CALLS = 3  # calls in a row, each on its own inputs


CASES = spec_cases()


def run_fresh_outputs(check, impl, sp, shape, dtype, device, calls: int = CALLS):
    """Call `impl`'s op `sp.name` `calls` times without `out=`, on inputs drawn with seeds 0..calls-1, keep
    every result, then compare each with the float64 oracle of its own inputs (oracles evaluated before
    the calls, on copies)."""
    fn = impl.op(sp.name)
    runs = []
    for seed in range(calls):
        kwargs = sp.inputs(shape, dtype, device, torch.Generator().manual_seed(seed))
        pos, opt = sp.split(kwargs)
        opt.pop("out", None)
        y_ref, _ = oracle(sp.name, *pos, **opt)
        runs.append((pos, opt, y_ref))
    results = [fn(*pos, **opt) for pos, opt, _ in runs]
    for i, (y, (_, _, y_ref)) in enumerate(zip(results, runs)):
        assert isinstance(y, torch.Tensor), f"{sp.name}: expected a tensor result, got {type(y).__name__}"
        check.close(f"{sp.name}.y of call #{i + 1} of {calls}, compared after the last call", y,
                    y_ref.to(y.device), op=sp.name, impl=impl, dtype=dtype, shapes=dict(shape, call=i + 1),
                    seed=i, context="results kept alive across calls without out=")
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
@pytest.mark.parametrize("case", sorted(CASES))
def test_results_stay_valid_across_calls(impl, device, check, case, dtype):
    """Every op of every implementation returns, without `out=`, a result that later calls do not
    overwrite: each of several results kept alive equals its own oracle after all calls."""
    sp, shape, where = CASES[case]
    require(impl, sp.name, dtype, device)
    if where == "cpu" and interp_small(device, impl):
        pytest.skip("the cpu benchmark shape is too long for the Triton interpreter (minutes); the contract "
                    "shapes cover this implementation there")
    run_fresh_outputs(check, impl, sp, shape, dtype, device)


# ----------------------------------------------------------------------------- the planted bug

@pytest.mark.parametrize("op", sorted(SPECS))
def test_shared_workspace_is_caught(op):
    """The planted implementation returning views of one reused buffer: every single result matches the
    oracle when compared right after its call (what the op suites do, besides passing `out=`), and the
    results kept across calls fail the fresh-output check. The unbroken implementation passes it."""
    base = registry.get("torch")
    sp = SPECS[op]
    shape = sp.shapes["contract"][0]
    broken = shared_workspace(base)
    check = Checker("planted", "cpu")
    for seed in range(CALLS):  # one call at a time: right
        pos, opt = sp.split(sp.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(seed)))
        y_ref, _ = oracle(op, *pos, **opt)
        check.close(f"{op}.y", broken.op(op)(*pos, **opt), y_ref, op=op, impl=broken.name, dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"compared after the last call"):
        run_fresh_outputs(check, broken, sp, shape, torch.float32, "cpu")
    run_fresh_outputs(check, base, sp, shape, torch.float32, "cpu")
