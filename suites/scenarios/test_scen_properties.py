"""Engine scenario properties (harness/scenarios.py) for every selected implementation on the device.

Each test draws request sets on tiny models (1-6 requests, prompts up to 40 tokens (48 when seeding)
sharing prefixes, tracked and untracked, one to three waves, token budgets 1-64, block sizes 8/16, chunk
boundaries anywhere, decode padding, layer-major and page-major pools) and asserts one property; the oracle is
the float64 reference model run one request at a time. On the CPU, implementations run in float64.
"""
from dataclasses import replace

import pytest
from hypothesis import example, given

from harness.scenarios import (Scenario, factory_for, lacking_ops, prop_batch_invariance, prop_determinism,
                               prop_matches_reference, prop_seeding_equivalence, prop_split_invariance, scenarios,
                               seeding_scenarios, skip_reason, split_scenarios)
from harness.testing import unsupported_skips

BASE = tuple(range(3, 23))  # 20 tokens shared by the seeding examples
# wave 1 fills the cache (tracked); wave 2 mixes seeded tracked, seeded untracked and unseeded requests
SEEDED = Scenario(family="mamba2", model_seed=1, prompts=(BASE, BASE[:17] + (50, 51), BASE[:9], (7, 8, 9, 10)),
                  max_new=(2, 3, 2, 2), track=(True, True, False, False), waves=((0,), (1, 2, 3)), token_budget=7,
                  block_size=8, cache_mode="all", chunk_seed=5, num_slots=3, decode_pad=4)
SEEDED_ALIGN = Scenario(family="falcon_mamba", model_seed=2, prompts=(BASE, BASE[:16] + (1,), BASE[:12] + (2, 3)),
                        max_new=(2, 2, 3), track=(True, False, True), waves=((0,), (1, 2)), token_budget=11,
                        block_size=8, cache_mode="align", chunk_seed=None, num_slots=2, layout="page_major")
# one request, chunks of 1-2 tokens (shorter than the conv width 4), Mamba-1 and Mamba-2 (mid-chunk starts)
SPLIT_SMALL = Scenario(family="mamba1", model_seed=0, prompts=(tuple(range(1, 12)),), max_new=(3,), track=(False,),
                       waves=((0,),), token_budget=2, block_size=8, cache_mode="none", chunk_seed=3, num_slots=1)
PACKED_M2 = Scenario(family="mamba2", model_seed=0, prompts=(tuple(range(1, 6)), tuple(range(10, 21)), (30, 31, 32)),
                     max_new=(2, 2, 2), track=(False, False, False), waves=((0, 1, 2),), token_budget=13,
                     block_size=8, cache_mode="none", chunk_seed=7, num_slots=3, decode_pad=4)
# hybrid models (a linear-attention and a full-attention layer): prefix-cache snapshots carry the attention
# layer's keys and values besides the mixer's states; chunks of 1-2 tokens through both kinds of layer
SEEDED_GDN = replace(SEEDED, family="gdn")
SPLIT_KDA = replace(SPLIT_SMALL, family="kda", decode_pad=4)


def _factory(impl, device, family):
    """The runner factory of `impl` for a scenario of `family`. An implementation lacking an op of that
    family only declines the example (other families' scenarios still run); one that can run no family
    here skips the test."""
    why = skip_reason(impl, device)
    if why:
        pytest.skip(why)
    lacking = lacking_ops(impl, family)
    if lacking:
        with unsupported_skips(impl):
            raise NotImplementedError(f"no {family} engine ops {lacking}")
    return factory_for(impl, device)


@given(case=scenarios(max_requests=5))
def test_scen_engine_matches_reference(impl, device, check, case):
    """Every request of a scenario (waves, chunks, cache seeding, padding) equals the float64 oracle run
    alone: step logits, tie-aware greedy tokens, final states, and every prefix-cache snapshot."""
    prop_matches_reference(case, _factory(impl, device, case.family), check=check)


@given(case=split_scenarios())
@example(case=SPLIT_SMALL)
@example(case=PACKED_M2)
@example(case=SPLIT_KDA)
def test_scen_split_invariance(impl, device, check, case):
    """Chunked prefill with boundaries anywhere (incl. chunks shorter than the conv width and single
    requests) and the prefill->decode switch: the state after every step equals the oracle's, and the
    results equal the same engine with whole prefills."""
    prop_split_invariance(case, _factory(impl, device, case.family), check=check)


@given(case=seeding_scenarios())
@example(case=SEEDED)
@example(case=SEEDED_ALIGN)
@example(case=SEEDED_GDN)
def test_scen_prefix_seeding(impl, device, check, case):
    """Seeding from prefix-cache snapshots equals computing from scratch, in every cache mode, in batches
    mixing seeded, unseeded, tracked and untracked requests (earlier waves fill the cache)."""
    prop_seeding_equivalence(case, _factory(impl, device, case.family), check=check)


@given(case=scenarios(max_requests=4, max_prompt=24, max_waves=1))
@example(case=PACKED_M2)
def test_scen_batch_invariance(impl, device, check, case):
    """Adding, removing or permuting other requests changes nothing for a request; packed equals
    one-by-one."""
    prop_batch_invariance(case, _factory(impl, device, case.family), check=check)


@given(case=scenarios(max_requests=4, max_prompt=24))
def test_scen_determinism(impl, device, case):
    """The same scenario twice is bitwise equal (tokens, step logits, final states) for an implementation
    that claims determinism."""
    if not impl.deterministic:
        pytest.skip(f"implementation {impl.name!r} does not claim determinism")
    assert prop_determinism(case, _factory(impl, device, case.family)) is True


def test_scen_seeding_examples_really_seed():
    """The explicit seeding examples are not vacuous: in SEEDED, requests 1 (tracked) and 2 (untracked)
    start from cached snapshots (16 and 8 tokens) in the same batch as an unseeded request; in
    SEEDED_ALIGN (mode align) the later requests are seeded too."""
    from harness.scenarios import RunnerFactory, run_case
    res, runner = run_case(SEEDED, RunnerFactory("reference"))
    assert [res[i].num_cached for i in range(4)] == [0, 16, 8, 0]
    second_wave_steps = {s[0] for i in (1, 2, 3) for s in res[i].steps}
    assert any(all(any(s[0] == k for s in res[i].steps) for i in (1, 2, 3)) for k in second_wave_steps)
    res, _ = run_case(SEEDED_ALIGN, RunnerFactory("reference"))
    assert res[1].num_cached == 16 and res[2].num_cached == 8
    res, runner = run_case(SEEDED_GDN, RunnerFactory("reference"))
    assert [res[i].num_cached for i in range(4)] == [0, 16, 8, 0]
    assert all(snap["kv.0.k"].shape[0] == len(prefix) for _, prefix, snap in runner.snapshot_log)
