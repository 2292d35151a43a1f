"""Op suite: long decode. Hundreds of decode steps of every decode op (selective_state_update in both
layouts, gated_delta_rule_update, kda_update, causal_conv1d_update) against the float64 oracle run step
by step on the same inputs, for every implementation.

One decode step cannot show an error that only accumulates: a state kept in bf16 between steps is off
by one bf16 rounding after a step -- inside the one-step suites' tolerance for bf16 activations, which
judge the state at the activations' precision -- and drifts further with every step. Here each step
feeds fresh tokens to the same slots (a batch of 3 rows: two live requests, one pad; two slots the
batch never names) and compares every step's output and, at checkpoints, the live slots.

Error budget after n steps, for activations of dtype `act` and a state of precision `P` (the pool's
dtype or the fp32 accumulation, whichever is coarser -- fp32 for the fp32 pools used here):
* state: `tolerance_for(P, sqrt(n))`. Each step adds at most one rounding of the state at precision P;
  those errors are independent and the decay (< 1) keeps earlier ones from growing, so they add up like
  a random walk: sqrt(n) times one step's.
* y: the state's budget plus `tolerance_for(act)`: y is rounded once to `act` and never fed back (the
  next step reads the state, not y), so its own rounding does not accumulate.
The one-step suites judge a state against the coarser of the activations' and the pool's precision
(bf16 for bf16 activations), so a state rounded to bf16 between steps passes them. Here the fp32 state
is judged at fp32's: a correct implementation stays near 1e-7 (error ratio) over all 200 steps, far
inside the budget (2e-4 at step 1, 2.8e-3 at step 200); a state kept in bf16 is off by 1.5e-3 to 3e-3
from the first step on and fails the first checkpoint. (The decays of these inputs keep the error from
growing without bound; with decays near 1 it grows like sqrt(n), as the budget does.)
Slots the batch does not name and pads' stay bitwise unchanged over the whole run.

CPU time: the reference and torch implementations run 200 steps; Triton under the interpreter runs 40
(the interpreter costs milliseconds per program per step), on shapes of a few dozen state elements.
"""
import math

import pytest
import torch

from harness.impls import registry
from harness.impls.reference_impl import oracle
from harness.ops import PAD_SLOT_ID, SPECS
from harness.testing import make_pool
from harness.testing.checks import Tolerance, assert_bitwise_equal, tolerance_for
from harness.testing.optest import coarser, interp_small, require, run_pool_case
from harness.testing.planted import activation, state_in_activation_dtype
from reference.testing import gen

STEPS = 200
STEPS_INTERPRETED = 40
CHECKPOINTS = (1, 2, 5, 10, 25, 50, 100, 200)
DTYPES = (torch.float32, torch.bfloat16)
SLOTS = [3, PAD_SLOT_ID, 1]  # row 1 is a pad; slots 0, 2 and 4 are never named
NUM_SLOTS = 5

# case -> (op, shape for the spec's input builder, the per-token inputs redrawn every step)
CASES = {
    "selective_state_update/mamba1": ("selective_state_update",
                                      dict(layout="mamba1", B=3, Dm=6, N=4, G=2, pool_dtype=torch.float32),
                                      ("x", "dt", "B", "C", "z")),
    "selective_state_update/mamba2": ("selective_state_update",
                                      dict(layout="mamba2", B=3, H=4, P=3, N=4, G=2, pool_dtype=torch.float32),
                                      ("x", "dt", "B", "C", "z")),
    "gated_delta_rule_update": ("gated_delta_rule_update", dict(B=3, Hk=1, Hv=2, K=4, V=3),
                                ("q", "k", "v", "g", "beta")),
    "kda_update": ("kda_update", dict(B=3, H=2, K=4, V=3), ("q", "k", "v", "g", "beta")),
    "causal_conv1d_update": ("causal_conv1d_update", dict(B=3, D=6, K=4), ("x",)),
}


def budget(n: int, act: torch.dtype, state: torch.dtype) -> tuple[Tolerance, Tolerance]:
    """(state tolerance, y tolerance) after `n` steps (see the module docstring)."""
    s = tolerance_for(state, math.sqrt(n))
    a = tolerance_for(act)
    return s, Tolerance(s.atol + a.atol, s.rtol + a.rtol, s.ratio + a.ratio)


def run_long_decode(check, impl, case: str, dtype: torch.dtype, device: str, steps: int, seed: int = 0) -> None:
    """Run `steps` decode steps of `case` with `impl` and with the float64 oracle from the same pool, checking
    y every step, the live slots at the checkpoints and the other slots at the end (see the module docstring)."""
    op, shape, step_keys = CASES[case]
    sp = SPECS[op]
    kw = sp.inputs(shape, dtype, device, gen(seed))
    first = kw[sp.pool]
    pool = make_pool(NUM_SLOTS, tuple(first.shape[1:]), first.dtype, device, seed=seed)
    start = pool.clone()
    ref_pool = pool.detach().to(torch.float64).clone()
    kw[sp.pool] = pool
    kw[sp.index] = torch.tensor(SLOTS, dtype=torch.int32, device=device)
    live = torch.tensor([s for s in SLOTS if s != PAD_SLOT_ID], device=device)
    rows = torch.tensor([s != PAD_SLOT_ID for s in SLOTS], device=device)
    state_prec = coarser(torch.float64 if dtype == torch.float64 else torch.float32, pool.dtype)
    fn = impl.op(op)
    for n in range(1, steps + 1):
        if n > 1:
            fresh = sp.inputs(shape, dtype, device, gen(seed * 100_003 + n))
            kw.update({k: fresh[k] for k in step_keys})
        pos, opt = sp.split(kw)
        ref_pos = [ref_pool if a == sp.pool else p for a, p in zip(sp.args, pos)]
        y_ref, ref_pool = oracle(op, *ref_pos, **opt)
        y = fn(*pos, **opt)
        tol_s, tol_y = budget(n, activation(sp, kw).dtype, state_prec)
        info = dict(op=op, impl=impl, dtype=dtype, shapes=dict(case=case, step=n, steps=steps), seed=seed,
                    context=f"decode step {n} of {steps}; budget: state {tol_s.ratio:.2e}, y {tol_y.ratio:.2e}")
        check.close(f"{op}.y at step {n}", y[rows], y_ref[rows.to(y_ref.device)], tol=tol_y, **info)
        if n in CHECKPOINTS or n == steps:
            check.close(f"{op}.state[live slots] after step {n}", pool[live], ref_pool[live.to(ref_pool.device)],
                        tol=tol_s, **info)
    for s in range(NUM_SLOTS):
        if s not in SLOTS:
            assert_bitwise_equal(f"{op}: pool[{s}] after {steps} steps (never named by the batch)", pool[s], start[s])


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
@pytest.mark.parametrize("case", sorted(CASES))
def test_long_decode_matches_oracle_step_by_step(impl, device, check, case, dtype):
    """Every decode op of every implementation stays within the step-dependent error budget of the float64
    oracle over 200 decode steps (40 under the Triton interpreter)."""
    require(impl, CASES[case][0], dtype, device)
    run_long_decode(check, impl, case, dtype, device, STEPS_INTERPRETED if interp_small(device, impl) else STEPS)


# ----------------------------------------------------------------------------- the planted bug

@pytest.mark.parametrize("case", ["selective_state_update/mamba1", "selective_state_update/mamba2",
                                  "gated_delta_rule_update", "kda_update"])
def test_state_kept_in_bf16_passes_one_step_and_is_caught_over_many(check, case):
    """The planted decode op that keeps its state in bf16 between steps passes the one-step check the op
    suites make (`run_pool_case`, bf16 activations, fp32 pool: the state judged at bf16's precision) and
    fails the long decode; the unbroken op passes both."""
    torch_impl = registry.get("torch")
    broken = state_in_activation_dtype(torch_impl)
    op, shape, _ = CASES[case]
    sp = SPECS[op]
    kw = sp.inputs(shape, torch.bfloat16, "cpu", gen(1))
    pos, opt = sp.split(kw)
    run_pool_case(check, broken, op, pos, opt, pool_pos=sp.args.index(sp.pool),
                  live_slots=kw[sp.index].tolist(), y_mask=None, dtype=torch.bfloat16, out_like=activation(sp, kw))
    with pytest.raises(AssertionError, match=r"state\[live slots\] after step"):
        run_long_decode(check, broken, case, torch.bfloat16, "cpu", STEPS)
    run_long_decode(check, torch_impl, case, torch.bfloat16, "cpu", STEPS)
