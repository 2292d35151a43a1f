"""The scenario searches meet the rare engine events that serving bugs hide behind.

A property holds vacuously where its search never goes: a seeding bug that needs a hit of two blocks, or a
chunk that crosses a block boundary, escapes a search that never draws one. The scenario runner reports
what each engine run actually did (``harness.scenarios.engine_events``: the prefix cache's contents and
hit lengths at admission, the scheduler's chunks, the pad rows of the steps, the conv pool's layout); this
suite runs the seeding and split-invariance searches with a fixed derandomized budget and requires every
event below.
"""
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import harness.scenarios as sc
from harness.impls import registry

# the budget (derandomized: the same examples every run); about 22 s on two CPU cores
SEEDING_EXAMPLES = 120
SPLIT_EXAMPLES = 20
SEARCH = settings(derandomize=True, database=None, deadline=None, phases=[Phase.generate, Phase.target],
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.filter_too_much], print_blob=True)


def required_events() -> list[str]:
    """Every family; a multi-block hit in every caching mode and block size the seeding search draws
    (those are all the modes and block sizes any scenario search draws); a whole-prompt hit, a prefill
    chunk crossing a block boundary, a seeded request then chunk-prefilled, a decode step with pad rows, conv
    slots stored channels-last."""
    kw = sc.SEEDING_SEARCH
    return ([sc.EVENT_FAMILY.format(family=f) for f in sc.FAMILIES]
            + [sc.EVENT_MULTI_BLOCK_HIT.format(mode=m, block=b) for m in sorted(set(kw["modes"]) - {"none"})
               for b in sorted(set(kw["block_sizes"]))]
            + [sc.EVENT_WHOLE_PROMPT_HIT, sc.EVENT_CHUNK_CROSSES_BLOCK, sc.EVENT_SEEDED_THEN_CHUNKED,
               sc.EVENT_DECODE_PADS, sc.EVENT_CHANNELS_LAST_CONV])


def search_events() -> Counter:
    """The events met by the seeding and split-invariance property searches (the reference engine; the
    events are the scheduler's and the cache's, the same for every implementation)."""
    make = sc.factory_for(registry.get("reference"), "cpu")

    @settings(SEARCH, max_examples=SEEDING_EXAMPLES)
    @given(case=sc.seeding_scenarios())
    def seeding(case):
        sc.prop_seeding_equivalence(case, make)

    @settings(SEARCH, max_examples=SPLIT_EXAMPLES)
    @given(case=sc.split_scenarios())
    def split(case):
        sc.prop_split_invariance(case, make)

    with sc.recording_events() as seen:
        seeding()
        split()
    return seen


def check_coverage(seen: Counter) -> None:
    missing = [e for e in required_events() if not seen[e]]
    if missing:
        hit = "; ".join(f"{e} ({n} runs)" for e, n in sorted(seen.items()))
        raise AssertionError(f"the scenario searches never met {missing}; they met: {hit}")


def test_scen_searches_meet_every_rare_engine_event():
    """With the fixed budget, the seeding and split-invariance searches meet every required event."""
    check_coverage(search_events())


def test_scen_coverage_fails_without_shared_prefixes(monkeypatch):
    """The requirement bites: a strategy whose prompts never share a prefix (each request's first token
    is its own) meets no prefix-cache hit, and the coverage check fails naming the hits it missed."""
    original = sc.scenarios

    def unshared(**kw):
        def own_first_token(case):
            return replace(case, prompts=tuple((i,) + p[1:] for i, p in enumerate(case.prompts)))
        return original(**kw).map(own_first_token)

    monkeypatch.setattr(sc, "scenarios", unshared)
    seen = search_events()
    assert not any(e in seen for e in (sc.EVENT_WHOLE_PROMPT_HIT, sc.EVENT_SEEDED_THEN_CHUNKED))
    with pytest.raises(AssertionError, match="never met") as err:
        check_coverage(seen)
    assert sc.EVENT_WHOLE_PROMPT_HIT in str(err.value) and "multi-block prefix-cache hit" in str(err.value)
    assert sc.EVENT_FAMILY.format(family="mamba1") in str(err.value).split("they met:")[1]
