"""Speculative decoding through the engine (harness.engine.spec): draft tokens, greedy verification and
rollback through the slot table give exactly plain greedy decoding.

The property: a scenario (tiny model of a family with speculative decode ops -- Gated DeltaNet's and KDA's are
hybrids, their full-attention layers' keys and values paged in the slot group's first slot -- requests in waves,
chunked
prefill, prefix cache in mode align or all, decode padding, both pool layouts) run with plain decoding and
run again with k draft tokens per step (random drafts, or the plain run's tokens proposed with probability p,
so that acceptance ranges over 0..k) gives the same tokens, the same logits and the same states: the final
states, the state after every position both runs record, and every prefix-cache snapshot (taken mid-step from
a position's own slot). A follow-up request extending the first request's output is seeded from a snapshot
taken during speculative decoding. Float64 on the CPU; the reference implementation is held to 1e-12.
Planted faults (a step that starts from the first slot of the group, one that keeps the last draft's state)
must break the property.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, currently_in_test_context, event, example, given, strategies as st

from harness.engine import PAD_SLOT_ID, BatchEntry, Request, Scheduler, StatePool, build_metadata
from harness.engine.runner import EngineRunner
from harness.engine import families as engine_families
from harness.engine.spec import NoDrafts, OracleProposer, RandomProposer, SpecDecodeMixin, spec_ops, verify_greedy
from harness.scenarios import (Mismatch, RunnerFactory, Scenario, check_state, factory_for, reference_run, scenarios,
                               skip_reason, tiny_model)
from harness.testing.checks import Tolerance, compare
from reference.cache import Mamba2Spec

SPEC_FAMILIES = ("mamba1", "falcon_mamba", "mamba2", "gdn", "kda")
SPEC_OPS = SpecDecodeMixin.SPEC_OPS


def family_spec_ops(family: str) -> tuple:
    """The speculative decode ops of `family`'s engine mixer."""
    return spec_ops(engine_families.get(family).mixer)
EXACT = Tolerance(atol=1e-12, rtol=0.0, ratio=1e-12)  # the float64 reference against itself


@dataclasses.dataclass(frozen=True)
class SpecCase:
    scenario: Scenario
    num_spec: int
    proposer: str  # "oracle" | "random" | "none"
    p: float = 0.7
    seed: int = 0
    follow: bool = True  # run the follow-up request (see follow_up)

    def __str__(self) -> str:
        return f"SpecCase({self.scenario}, num_spec={self.num_spec}, proposer={self.proposer!r}, p={self.p}, " \
               f"seed={self.seed}, follow={self.follow})"


@st.composite
def spec_cases(draw):
    """Request sets of the scenario strategy (families with speculative decode ops, modes align and all),
    with outputs long enough for several speculative steps; k in 1..4; mostly the oracle proposer with p
    making partial acceptance common, sometimes p 0 or 1 and random drafts."""
    scen = draw(scenarios(families=SPEC_FAMILIES, modes=("align", "all"), max_requests=3, max_prompt=24,
                          max_waves=2, budgets=(4, 24), max_slots=3))
    scen = replace(scen, max_new=tuple(draw(st.integers(2, 10)) for _ in scen.prompts))
    kind = draw(st.sampled_from(("oracle",) * 5 + ("random",)))
    p = draw(st.sampled_from((0.5, 0.6, 0.7, 0.8, 0.9, 0.0, 1.0)))
    return SpecCase(scen, num_spec=draw(st.sampled_from((2, 3, 4, 1))), proposer=kind, p=p,
                    seed=draw(st.integers(0, 100)))


def make_proposer(case: SpecCase, plain: dict, vocab: int):
    if case.proposer == "oracle":
        return OracleProposer.from_results(plain, vocab, case.p, seed=case.seed)
    if case.proposer == "random":
        return RandomProposer(vocab, seed=case.seed)
    return NoDrafts()


def follow_up(plain: dict):
    """A request whose prompt is request 0's whole stream (prompt and outputs): with request 0 tracked, the
    prefix cache holds snapshots of its decode positions, which speculative steps take from their slots."""
    r = plain[0]
    return Request("follow", tuple(r.prompt) + tuple(r.tokens), 4)


def run_both(case: SpecCase, make_runner):
    """The scenario's waves and the follow-up request, with plain decoding, then with speculative decoding
    (the proposer knowing the plain run's tokens). Returns (plain results, spec results, plain runner,
    spec runner)."""
    scen = case.scenario
    model = tiny_model(scen.family, scen.model_seed)
    vocab = model[0].vocab_size_unpadded

    def waves(runner, extra):
        out = {}
        for wave in scen.waves:
            out.update(runner.run(scen.requests(wave)))
        if case.follow:
            out.update(runner.run([extra(out)]))
        return out

    plain_runner = make_runner(model, **scen.runner_kwargs(record_states=True))
    plain = waves(plain_runner, follow_up)
    spec_runner = make_runner(model, **scen.runner_kwargs(record_states=True, num_spec=case.num_spec,
                                                          proposer=make_proposer(case, plain, vocab)))
    spec = waves(spec_runner, lambda _: follow_up(plain))
    return plain, spec, plain_runner, spec_runner


def _close(name, actual, expected, tol, where, check, make_runner):
    if check is not None:
        check.close(name, actual, expected, op="engine", impl=make_runner.impl, dtype=make_runner.dtype, tol=tol,
                    context=where)
        return
    c = compare(name, actual, expected, tol)
    if not c.passed:
        raise Mismatch(c.message(where))


def prop_spec_matches_plain(case: SpecCase, make_runner, check=None, tol: Tolerance | None = None):
    """Speculative decoding == plain decoding: tokens exactly; step logits, final states, states at every
    position both runs recorded, and prefix-cache snapshots within `tol` (default: the runner factory's)."""
    tol = tol or make_runner.tol
    scen = case.scenario
    plain, spec, _, spec_runner = run_both(case, make_runner)
    accepted = [a for r in spec.values() for _, _, a in r.accepted]
    drafted = [k for r in spec.values() for _, k, _ in r.accepted]
    if currently_in_test_context():
        event(f"speculative steps accepting all drafts: {any(a == k > 0 for a, k in zip(accepted, drafted))}")
        event(f"speculative steps accepting some but not all: {any(0 < a < k for a, k in zip(accepted, drafted))}")
    for rid, p in plain.items():
        s = spec[rid]
        where = f"request {rid!r} (prompt {len(p.prompt)} tokens; accepted {s.accepted}); case: {case}"
        if s.tokens != p.tokens:
            j = next((i for i, (x, y) in enumerate(zip(s.tokens, p.tokens)) if x != y), None)
            if j is not None and currently_in_test_context():
                lg = p.step_logits[j]
                # a near-tie in low precision: both choices are greedy within rounding, the runs diverge there
                margin = abs(float(lg[s.tokens[j]] - lg[p.tokens[j]]))
                assume(margin > 2 * (tol.atol + tol.rtol * float(lg.abs().max())))
            raise Mismatch(f"speculative decoding: request {rid!r} tokens {s.tokens}, plain decoding {p.tokens}; "
                           f"{where}")
        decoded = sum(n for _, _, n, d in s.steps if d)
        if sum(a + 1 for _, _, a in s.accepted) != len(s.tokens) - 1 or decoded < len(s.tokens) - 1:
            raise Mismatch(f"speculative decoding: request {rid!r} emitted {len(s.tokens) - 1} decode tokens over "
                           f"steps accepting {s.accepted}; {where}")
        _close(f"speculative decoding request {rid!r} step logits", s.step_logits, p.step_logits, tol, where, check,
               make_runner)
        for k in p.final_state:
            _close(f"speculative decoding request {rid!r} final {k}", s.final_state[k], p.final_state[k], tol, where,
                   check, make_runner)
        common = sorted(set(s.states) & set(p.states))
        if not set(range(len(p.prompt) + 1, len(p.fed_tokens) + 1)) <= set(common):
            raise Mismatch(f"speculative decoding: request {rid!r} recorded positions {sorted(s.states)}, plain "
                           f"{sorted(p.states)}: a decode position is missing; {where}")
        for pos in common:
            for k in p.states[pos]:
                _close(f"speculative decoding request {rid!r} {k} after {pos} tokens", s.states[pos][k],
                       p.states[pos][k], tol, where, check, make_runner)
    for rid, prefix, snap in spec_runner.snapshot_log:
        where = f"prefix-cache snapshot of request {rid!r} at {len(prefix)} tokens; case: {case}"
        p = plain[rid]
        if tuple(prefix) != (tuple(p.prompt) + tuple(p.tokens))[:len(prefix)]:
            raise Mismatch(f"speculative decoding: snapshot key {prefix} is not the request's stream; {where}")
        if len(prefix) in p.states:
            for k in snap:
                _close(f"speculative decoding snapshot {k}", snap[k], p.states[len(prefix)][k], tol, where, check,
                       make_runner)
        else:  # a prefill chunk end of the speculative run only: the oracle's state
            _, ref = reference_run(scen.family, scen.model_seed, tuple(prefix))
            check_state("speculative decoding snapshot", snap, ref, make_runner.state_tol, where, check, make_runner)
    if case.follow and scen.cache_mode == "all" and spec["follow"].num_cached != plain["follow"].num_cached:
        raise Mismatch(f"speculative decoding: the follow-up request was seeded with {spec['follow'].num_cached} "
                       f"tokens, {plain['follow'].num_cached} with plain decoding (mode all snapshots every block "
                       f"the accepted tokens reach); case: {case}")


# fixed cases: several drafts, partial acceptance, chunked prefill, snapshots inside speculative steps
BASE = Scenario(family="mamba2", model_seed=0, prompts=(tuple(range(3, 14)), tuple(range(3, 10)) + (40,), (5,)),
                max_new=(9, 7, 5), track=(True, True, False), waves=((0, 1), (2,)), token_budget=12, block_size=8,
                cache_mode="all", chunk_seed=3, num_slots=2, decode_pad=4)
PARTIAL = SpecCase(BASE, num_spec=3, proposer="oracle", p=0.7, seed=1)
ALIGN_M1 = SpecCase(replace(BASE, family="mamba1", cache_mode="align", layout="page_major", waves=((0, 1, 2),)),
                    num_spec=2, proposer="oracle", p=0.5, seed=4)
RANDOM_FALCON = SpecCase(replace(BASE, family="falcon_mamba"), num_spec=4, proposer="random", seed=2)
PARTIAL_GDN = SpecCase(replace(BASE, family="gdn"), num_spec=3, proposer="oracle", p=0.7, seed=1)
ALIGN_KDA = SpecCase(replace(BASE, family="kda", cache_mode="align", layout="page_major", waves=((0, 1, 2),)),
                     num_spec=2, proposer="oracle", p=0.5, seed=4)
# every implementation, Triton under the CPU interpreter too: one request, a few tokens
TINY = Scenario(family="mamba2", model_seed=0, prompts=((3, 4, 5, 6, 7, 8),), max_new=(5,), track=(True,),
                waves=((0,),), token_budget=8, block_size=8, cache_mode="all", chunk_seed=1, num_slots=1)


PLAIN_DECODE_OPS = {"gdn": ("causal_conv1d_update", "gated_delta_rule_update"),
                    "kda": ("causal_conv1d_update", "kda_update")}


def _interpreted(impl, device) -> bool:
    return impl.name == "triton" and device.startswith("cpu")


def _factory(impl, device, families=SPEC_FAMILIES):
    """A runner factory of `impl` for speculative runs of `families` (skips when it lacks their ops)."""
    need = tuple(dict.fromkeys(o for f in families for o in family_spec_ops(f)))
    lacking = [o for o in need if o not in impl.ops]
    if lacking:
        pytest.skip(f"implementation {impl.name!r} lacks the speculative decode ops {lacking}")
    if _interpreted(impl, device):
        # the interpreter takes about a second per prefill kernel call: the decode ops (plain and
        # speculative, the ones compared here) are Triton's, prefill and norms torch's
        from harness.impls import registry
        plain = [o for f in families for o in PLAIN_DECODE_OPS.get(f, ("causal_conv1d_update",
                                                                        "selective_state_update"))]
        ops = {**registry.get("torch").ops, **{o: impl.ops[o] for o in need + tuple(plain)}}
        return factory_for(dataclasses.replace(impl, name="triton-decode+torch", ops=ops), device)
    why = skip_reason(impl, device, families[0])
    if why:
        pytest.skip(why)
    return factory_for(impl, device)


def _tol(make_runner):
    return EXACT if make_runner.impl.name == "reference" and make_runner.dtype == torch.float64 else None


@given(case=spec_cases())
@example(case=PARTIAL)
@example(case=ALIGN_M1)
@example(case=RANDOM_FALCON)
@example(case=PARTIAL_GDN)
@example(case=ALIGN_KDA)
def test_engine_spec_matches_plain(impl, device, check, case):
    """Random drafts and random acceptance (0..k drafts per step), prefix cache and chunked prefill on:
    exactly the tokens, logits and states of plain decoding."""
    if _interpreted(impl, device):
        pytest.skip("Triton under the CPU interpreter takes seconds per engine run: test_engine_spec_tiny runs its "
                    "decode ops on one tiny case per family; the property runs it on GPU")
    fams = tuple(f for f in SPEC_FAMILIES if all(o in impl.ops for o in family_spec_ops(f)))
    if not fams:
        pytest.skip(f"implementation {impl.name!r} has the speculative decode ops of no family")
    assume(case.scenario.family in fams)
    event(f"family {case.scenario.family}")
    f = _factory(impl, device, (case.scenario.family,))
    prop_spec_matches_plain(case, f, check=check, tol=_tol(f))


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_engine_spec_tiny(impl, device, check, family):
    """One request, 5 tokens, 2 drafts per step with partial acceptance, a snapshot inside a speculative
    step: every implementation with the speculative ops (under the CPU interpreter, Triton's decode ops with
    torch's prefill, one prefill chunk and no follow-up request)."""
    f = _factory(impl, device, (family,))
    case = SpecCase(replace(TINY, family=family), num_spec=2, proposer="oracle", p=0.5, seed=7)
    if _interpreted(impl, device):
        case = replace(case, scenario=replace(case.scenario, chunk_seed=None), follow=False)
    prop_spec_matches_plain(case, f, check=check, tol=_tol(f))


def test_fixed_cases_accept_partially_and_snapshot_mid_step():
    """The fixed cases are not vacuous: steps accepting none, some and all drafts; prefix-cache snapshots
    inside a speculative step (from a slot other than the group's first); the follow-up request seeded
    from a decode-time snapshot; pad rows in speculative steps."""
    f = RunnerFactory("reference")
    plain, spec, _, runner = run_both(PARTIAL, f)
    acc = {(k, a) for r in spec.values() for _, k, a in r.accepted}
    assert any(a == 0 < k for k, a in acc) and any(0 < a < k for k, a in acc) and any(a == k > 0 for k, a in acc)
    p0 = len(spec[0].prompt)
    decode_snaps = [len(pfx) for rid, pfx, _ in runner.snapshot_log if rid == 0 and len(pfx) > p0]
    assert decode_snaps == [16]
    assert spec["follow"].num_cached == 16
    spec_steps = [(s, n) for s, _, n, d in spec[0].steps if d]
    assert any(n > 1 for _, n in spec_steps)


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_tiny_case_is_not_vacuous(family):
    """The tiny case's first speculative step accepts one of two drafts, the snapshot at 8 tokens comes from
    that step's second slot, and the next step starts from it."""
    plain, spec, _, runner = run_both(SpecCase(replace(TINY, family=family), num_spec=2, proposer="oracle", p=0.5,
                                               seed=7), RunnerFactory("reference"))
    assert [(k, a) for _, k, a in spec[0].accepted] == [(2, 1), (1, 1)]
    assert [len(pfx) for rid, pfx, _ in runner.snapshot_log if rid == 0] == [8]


# ==================================================================== planted faults

def _wrapped(name, **ops):
    from harness.impls import registry
    base = registry.get("reference")
    return RunnerFactory(dataclasses.replace(base, name=name, ops={**base.ops, **ops}))


def _from_first_slot(op):
    """The op with num_accepted_tokens replaced by ones: every step starts from the group's first slot."""
    def run(*a, **k):
        a = list(a)
        a[-1] = torch.ones_like(a[-1])
        return op(*a, **k)
    return run


def _keep_last_draft(op):
    """The state update, then every slot the row wrote holds its LAST position's state: the next step starts
    from the last draft's state instead of the last accepted one's."""
    def run(state, *a, **k):
        y = op(state, *a, **k)
        qsl, table = a[-3].tolist(), a[-2]
        for b in range(table.shape[0]):
            n = qsl[b + 1] - qsl[b]
            if n and int(table[b, 0]) != PAD_SLOT_ID:
                last = state[int(table[b, n - 1])].clone()
                for j in range(n):
                    state[int(table[b, j])] = last
        return y
    return run


def _planted():
    from harness.impls import registry
    ref = registry.get("reference").ops
    return {
        "state update from the first slot": _wrapped("first-slot-ssm", selective_state_update_spec=_from_first_slot(
            ref["selective_state_update_spec"])),
        "conv from the first slot": _wrapped("first-slot-conv", causal_conv1d_update_spec=_from_first_slot(
            ref["causal_conv1d_update_spec"])),
        "state of the last draft kept": _wrapped("last-draft", selective_state_update_spec=_keep_last_draft(
            ref["selective_state_update_spec"])),
        "delta rule from the first slot": _wrapped("first-slot-gdn", gated_delta_rule_update_spec=_from_first_slot(
            ref["gated_delta_rule_update_spec"]), kda_update_spec=_from_first_slot(ref["kda_update_spec"])),
    }


@pytest.mark.parametrize("fault", ["state update from the first slot", "conv from the first slot",
                                   "state of the last draft kept"])
@pytest.mark.parametrize("case", [PARTIAL, ALIGN_M1], ids=["mamba2", "mamba1"])
def test_planted_faults_break_the_property(fault, case):
    """A step that starts from the first slot of the group (state update or conv), or that leaves the
    last draft's state where the last accepted one's belongs, fails the property."""
    with pytest.raises(Mismatch):
        prop_spec_matches_plain(case, _planted()[fault], tol=EXACT)


@pytest.mark.parametrize("fault", ["delta rule from the first slot", "conv from the first slot"])
@pytest.mark.parametrize("case", [PARTIAL_GDN, ALIGN_KDA], ids=["gdn", "kda"])
def test_planted_faults_break_the_property_of_the_delta_families(fault, case):
    """The delta rule's (or the conv's) speculative step starting from the group's first slot fails the
    property for Gated DeltaNet and KDA."""
    with pytest.raises(Mismatch):
        prop_spec_matches_plain(case, _planted()[fault], tol=EXACT)


def test_the_unbroken_wrapper_passes():
    """The planted faults' wrapping itself (a renamed reference implementation) passes."""
    prop_spec_matches_plain(PARTIAL, _wrapped("wrapped"), tol=EXACT)


# ==================================================================== units

def test_verify_greedy():
    assert verify_greedy([], [7]) == 0
    assert verify_greedy([1, 2, 3], [1, 2, 3, 4]) == 3
    assert verify_greedy([1, 2, 3], [1, 5, 3, 4]) == 1
    assert verify_greedy([1, 2, 3], [0, 2, 3, 4]) == 0
    with pytest.raises(ValueError, match=r"^choices: expected 3 argmax tokens"):
        verify_greedy([1, 2], [1, 2])


def test_oracle_proposer_acceptance_spans_0_to_k():
    """p = 1 proposes the plain stream, p = 0 never its token; in between both happen; deterministic."""
    stream = tuple(range(10, 30))
    right = OracleProposer({"r": stream}, 60, 1.0).propose("r", stream[:5], 3)
    assert list(right) == list(stream[5:8])
    wrong = OracleProposer({"r": stream}, 60, 0.0).propose("r", stream[:5], 3)
    assert all(w != t for w, t in zip(wrong, stream[5:8])) and all(0 <= w < 60 for w in wrong)
    mixed = OracleProposer({"r": stream}, 60, 0.5, seed=3)
    hits = [d == stream[n] for n in range(1, 19) for d in mixed.propose("r", stream[:n], 1)]
    assert any(hits) and not all(hits)
    assert mixed.propose("r", stream[:4], 3) == mixed.propose("r", stream[:4], 3)
    assert len(OracleProposer({"r": stream}, 60, 1.0).propose("r", stream, 2)) == 2  # past the stream: random
    with pytest.raises(ValueError, match=r"^p: expected a probability"):
        OracleProposer({}, 60, 1.5)


def test_random_proposer_is_seeded():
    a, b = RandomProposer(60, seed=1), RandomProposer(60, seed=2)
    assert a.propose("x", (1, 2), 4) == RandomProposer(60, seed=1).propose("x", (1, 2), 4)
    assert a.propose("x", (1, 2), 4) != b.propose("x", (1, 2), 4)
    assert all(0 <= t < 60 for t in a.propose("x", (1, 2, 3), 50))


SPEC = Mamba2Spec(num_heads=2, head_dim=3, state_size=4, n_groups=1, conv_kernel=3, conv_dtype=torch.float32)


def test_pool_group_alloc_is_all_or_nothing():
    pool = StatePool(SPEC, 1, 5)
    assert pool.alloc_group(3) == [0, 1, 2]
    from harness.engine import PoolExhausted
    with pytest.raises(PoolExhausted):
        pool.alloc_group(3)
    assert sorted(pool.allocated) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"^slots\[1\]: expected an allocated slot id"):
        pool.free_group([0, 4])
    with pytest.raises(ValueError, match=r"^slots: expected distinct slot ids"):
        pool.free_group([0, 0])
    assert sorted(pool.allocated) == [0, 1, 2]
    pool.free_group([2, 0])
    assert pool.alloc_group(2) == [0, 2]


def _spec_sched(num_spec=2, slots=6, budget=16, drafts=lambda rid, toks, k: [toks[-1]] * k):
    return Scheduler(StatePool(SPEC, 1, slots), budget, num_spec=num_spec, draft_fn=drafts)


def test_scheduler_slot_groups_drafts_and_acceptance():
    """Each request gets 1 + num_spec slots; a decode entry carries the drafts (at most the request's remaining
    output minus one, and what the budget leaves) and its group; update advances by the emitted tokens and the
    next entry starts from the slot of the last accepted position."""
    s = _spec_sched()
    s.add(Request("a", (1, 2, 3), 4))
    s.add(Request("b", (4, 5), 2))
    b = s.schedule()
    assert [(e.request_id, e.slot, e.spec_slots) for e in b] == [("a", 0, ()), ("b", 3, ())]
    assert s.state("a").slots == (0, 1, 2) and s.state("b").slots == (3, 4, 5)
    s.update(b, {"a": 9, "b": 8})
    b = s.schedule()
    ea, eb = b.entries
    assert (ea.tokens, ea.spec_slots, ea.num_accepted, ea.slot) == ((9, 9, 9), (0, 1, 2), 1, 0)
    assert (eb.tokens, eb.num_tokens) == ((8,), 1)  # b may emit one more token only: no drafts
    fin = s.update(b, {"a": [9, 7], "b": [6]})
    assert fin == ["b"] and s.finished["b"] == [8, 6] and sorted(s.pool.allocated) == [0, 1, 2]
    st_a = s.state("a")
    assert (st_a.num_computed, st_a.output, st_a.num_accepted, st_a.slot) == (5, [9, 9, 7], 2, 1)
    b = s.schedule()
    (ea,) = b.entries
    assert (ea.start, ea.tokens, ea.num_accepted, ea.slot) == (5, (7,), 2, 1)  # one token left to emit
    s.update(b, {"a": 3})
    assert s.finished["a"] == [9, 9, 7, 3] and not s.pool.allocated


def test_scheduler_rejects_emitted_tokens_that_are_not_accepted_drafts():
    s = _spec_sched()
    s.add(Request("a", (1, 2), 5))
    s.update(s.schedule(), {"a": 4})
    b = s.schedule()
    assert b.entries[0].drafts == (4, 4)
    for bad, match in (([5, 1], r"^sampled\['a'\]: expected the accepted drafts"),
                       ([4, 4, 4, 4], r"^sampled\['a'\]: expected 1\.\.3 tokens"),
                       ([], r"^sampled\['a'\]: expected 1\.\.3 tokens"), (["x"], r"^sampled\['a'\]\[0\]")):
        with pytest.raises(ValueError, match=match):
            s.update(b, {"a": bad})
        assert s.state("a").num_computed == 2 and s.state("a").output == [4]
    s.update(b, {"a": [4, 4, 1]})
    assert s.state("a").num_accepted == 3 and s.state("a").slot == 2


def test_scheduler_checks_drafts_and_budget():
    s = _spec_sched(drafts=lambda rid, toks, k: [1] * (k + 1))
    s.add(Request("a", (1, 2), 5))
    s.update(s.schedule(), {"a": 4})
    with pytest.raises(ValueError, match=r"^draft_fn: expected at most 2 draft tokens"):
        s.schedule()
    s = _spec_sched(budget=2)
    s.add(Request("a", (1, 2), 5))
    s.update(s.schedule(), {"a": 4})
    assert s.schedule().entries[0].tokens == (4, 4)  # the budget leaves room for one draft
    with pytest.raises(ValueError, match=r"^pool: expected at least 1 \+ num_spec = 4 slots"):
        Scheduler(StatePool(SPEC, 1, 3), 8, num_spec=3)


def test_metadata_of_a_speculative_step():
    entries = [BatchEntry("p", 6, 0, 5, False, tuple(range(5)), sample=True, spec_slots=()),
               BatchEntry("a", 1, 9, 3, True, (1, 2, 3), sample=True, spec_slots=(0, 1, 2), num_accepted=2),
               BatchEntry("b", 3, 4, 1, True, (5,), sample=True, spec_slots=(3, 4, 5), num_accepted=1),
               BatchEntry(("pad", 0), PAD_SLOT_ID, 0, 1, True, (0,))]
    md = build_metadata(entries, mode="all", block_size=8, num_spec=2)
    assert md.spec_query_start_loc.tolist() == [0, 3, 4, 5]
    assert md.spec_state_indices.tolist() == [[0, 1, 2], [3, 4, 5], [-1, -1, -1]]
    assert md.num_accepted_tokens.tolist() == [2, 1, 1]
    assert md.num_decode_tokens == 5 and md.snapshot_positions[1] == ()  # taken after verification
    with pytest.raises(ValueError, match=r"^batch\[0\]\.slot: expected spec_slots\[num_accepted - 1\] = 1"):
        build_metadata([replace(entries[1], slot=2)], num_spec=2)
    with pytest.raises(ValueError, match=r"^batch\[0\]\.num_tokens: expected 1\.\.num_spec \+ 1 = 3"):
        build_metadata([replace(entries[1], num_tokens=4, tokens=(1, 2, 3, 4))], num_spec=2)
    with pytest.raises(ValueError, match=r"^batch\[0\]\.spec_slots: expected num_spec \+ 1 = 3 slot ids"):
        build_metadata([replace(entries[1], spec_slots=(0, 1))], num_spec=2)
    with pytest.raises(ValueError, match=r"^batch\[0\]\.spec_slots: expected none \(num_spec is 0\)"):
        build_metadata([replace(entries[2])])
    assert build_metadata(entries[:1]).spec_state_indices is None


def test_runner_refuses_what_it_cannot_run():
    """An
    implementation without the speculative ops, a missing proposer, a proposer without speculative decoding,
    and a proposer's out-of-vocabulary draft are ValueErrors."""
    from harness.impls import registry
    model = tiny_model("mamba2", 0)
    ref = registry.get("reference")
    lacking = dataclasses.replace(ref, name="plain-only", ops={k: v for k, v in ref.ops.items() if k not in SPEC_OPS})
    with pytest.raises(ValueError, match=r"^impl: expected an implementation providing .*'plain-only' lacks"):
        EngineRunner(model, lacking, num_spec=1, proposer=NoDrafts())
    with pytest.raises(ValueError, match=r"^proposer: expected a draft proposer"):
        EngineRunner(model, ref, num_spec=1)
    with pytest.raises(ValueError, match=r"^proposer: expected None without speculative decoding"):
        EngineRunner(model, ref, proposer=NoDrafts())
    with pytest.raises(ValueError, match=r"^num_spec: expected an int >= 0"):
        EngineRunner(model, ref, num_spec=-1)

    class Bad:
        def propose(self, rid, tokens, k):
            return [model[0].vocab_size] * k
    r = EngineRunner(model, ref, num_spec=2, proposer=Bad(), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^proposer: expected draft token ids in \[0, 64\)"):
        r.run([Request("a", (1, 2, 3), 4)])


def test_no_drafts_is_plain_decoding_through_the_spec_ops():
    """num_spec > 0 with a proposer that proposes nothing: one-token steps through the speculative ops, the
    state staying in the group's first slot; same tokens and states as plain decoding."""
    prop_spec_matches_plain(SpecCase(BASE, num_spec=2, proposer="none"), RunnerFactory("reference"), tol=EXACT)
