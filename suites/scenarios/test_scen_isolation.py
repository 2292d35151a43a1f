"""Engine scenario property: request isolation, for every selected implementation on the device.

A drawn scenario (tiny models, 1-3 requests, waves, chunked prefill, prefix cache, decode padding) gets
one more request, the victim, whose prompt holds a poison token: a padding-vocabulary token id (never
drawn, never sampled: greedy choice runs over the unpadded vocabulary) whose embedding row is NaN, +inf
or -inf, so every hidden state of the victim from that token on is non-finite, in every layer and every
op (conv windows, SSM states, decode steps). Decode pad rows (pad requests) carry the same value. The
other requests must still equal the float64 oracle run on each alone (step logits, tie-aware tokens,
final states, the prefix-cache snapshots) and the same engine run with the victim clean and pads
untouched. The victim may share a prefix with another request (so it may be seeded from, or seed, the
prefix cache with its clean part) and may be tracked.
"""
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness.engine.pool import PAD_SLOT_ID
from harness.engine.runner import EngineRunner
from harness.engine.scheduler import Request
from harness.testing.optest import NONFINITE
from harness.scenarios import (Scenario, check_against_reference, check_same_results, factory_for, scenarios,
                               skip_reason, tiny_model)

VICTIM = "victim"


class PoisonedPadRunner(EngineRunner):
    """An EngineRunner whose decode pad rows enter the first layer as `pad_value` (instead of token 0's
    embedding): every op sees non-finite inputs in the pad rows."""

    def __init__(self, model, impl, *, pad_value: float, **kw):
        super().__init__(model, impl, **kw)
        self._pad_row = self.embedding.shape[0]
        self.embedding = torch.cat([self.embedding, torch.full_like(self.embedding[:1], pad_value)])

    def forward(self, tokens, md):
        slots = md.state_indices.tolist()
        q = md.query_start_loc.tolist()
        tokens = tokens.clone()
        for i, s in enumerate(slots):
            if s == PAD_SLOT_ID:
                tokens[q[i]:q[i + 1]] = self._pad_row
        return super().forward(tokens, md)


def poisoned_model(family: str, seed: int, token: int, value: float):
    """The scenario's tiny model with embedding row `token` set to `value` (a copy: the cached model stays)."""
    cfg, params = tiny_model(family, seed)
    emb = params["embedding.weight"].clone()
    emb[token] = value
    return cfg, {**params, "embedding.weight": emb}


def run_waves(runner, case: Scenario, victim: Request, wave: int, index: int) -> dict:
    """The scenario's waves with `victim` inserted at position `index` of wave `wave`."""
    results = {}
    for k, w in enumerate(case.waves):
        reqs = case.requests(list(w))
        if k == wave:
            reqs.insert(min(index, len(reqs)), victim)
        results.update(runner.run(reqs))
    return results


def prop_request_isolation(case: Scenario, make_runner, *, victim_prompt: tuple, victim_new: int,
                           victim_track: bool, wave: int, index: int, value: float, check=None):
    """The scenario's requests with a poisoned victim (see the module doc) equal the oracle and the same
    engine with the victim clean (its poison token replaced by token 1) and no pad poisoning."""
    cfg = tiny_model(case.family, case.model_seed)[0]
    poison = cfg.vocab_size - 1  # a padding-vocabulary row: never sampled, never in a drawn prompt
    assert poison >= cfg.vocab_size_unpadded, "the tiny model's vocabulary has no padding rows"
    prompt = tuple(poison if t is None else t for t in victim_prompt)
    victim = Request(VICTIM, prompt, victim_new, victim_track)
    model = poisoned_model(case.family, case.model_seed, poison, value)
    fac = make_runner
    runner = PoisonedPadRunner(model, fac.impl, pad_value=value, dtype=fac.dtype, device=fac.device,
                               **case.runner_kwargs())
    poisoned = run_waves(runner, case, victim, wave, index)
    others = {rid: r for rid, r in poisoned.items() if rid != VICTIM}
    # the victim's snapshots up to its poison token are clean states and must match the oracle too
    snaps = [(rid, p, s) for rid, p, s in runner.snapshot_log if poison not in tuple(p)]
    where = (f"poison {value} (token {poison}) in request {VICTIM!r} prompt {prompt}, wave {wave} position "
             f"{index}, pad rows too")
    check_against_reference(case, others, fac, snapshot_log=snaps, check=check, label=f"with {where}")
    clean_victim = replace(victim, prompt=tuple(1 if t is None else t for t in victim_prompt))
    clean_runner = fac(tiny_model(case.family, case.model_seed), **case.runner_kwargs())
    clean = run_waves(clean_runner, case, clean_victim, wave, index)
    check_same_results(clean, poisoned, case, fac, f"clean victim vs {where}", ids=list(others))


@st.composite
def victims(draw, case: Scenario):
    """(prompt with None at the poison token, max_new, track, wave, position in the wave): the prompt may
    start with a prefix of another request's prompt."""
    src = draw(st.sampled_from(case.prompts), label="shares_prefix_of")
    share = draw(st.integers(0, len(src)), label="shared_len")
    tail = draw(st.lists(st.integers(0, 59), max_size=6), label="tail")
    at = draw(st.integers(0, len(tail)), label="poison_at")
    prompt = tuple(src[:share]) + tuple(tail[:at]) + (None,) + tuple(tail[at:])
    wave = draw(st.integers(0, len(case.waves) - 1), label="wave")
    return (prompt, draw(st.integers(1, 3), label="victim_new"), draw(st.booleans(), label="victim_track"), wave,
            draw(st.integers(0, len(case.waves[wave])), label="position"))


@st.composite
def isolation_cases(draw):
    case = draw(scenarios(max_requests=3, max_prompt=24, max_waves=2), label="case")
    return case, draw(victims(case), label="victim"), draw(st.sampled_from(NONFINITE), label="value")


# Mamba-2, one wave: the victim first in the packed prefill, its poison token the stream's first token
# (where a padded chunk grid reads for its pad positions), next to a request whose chunk is shorter than
# the longest one (first step: 3, 5 and 8 tokens); decode rows padded to 4
PACKED_M2 = (Scenario(family="mamba2", model_seed=0, prompts=(tuple(range(1, 6)), tuple(range(10, 21))),
                      max_new=(2, 3), track=(False, False), waves=((0, 1),), token_budget=16, block_size=8,
                      cache_mode="none", chunk_seed=None, num_slots=3, decode_pad=4),
             ((None, 7, 8), 2, False, 0, 0), math.nan)
# Mamba-1, prefix cache in mode all, the victim tracked, second in its wave and sharing a 9-token prefix,
# two waves
SEEDED_M1 = (Scenario(family="mamba1", model_seed=1, prompts=(tuple(range(3, 20)), (4, 5, 6)), max_new=(2, 2),
                      track=(True, False), waves=((0,), (1,)), token_budget=7, block_size=8, cache_mode="all",
                      chunk_seed=None, num_slots=3, decode_pad=4),
             (tuple(range(3, 12)) + (None, 30), 2, True, 0, 1), math.inf)


@given(c=isolation_cases())
@example(c=PACKED_M2)
@example(c=SEEDED_M1)
def test_scen_request_isolation(impl, device, check, c):
    """A request whose prompt holds a non-finite embedding (and decode pad rows holding the same value)
    changes nothing for the other requests: they equal the float64 oracle and the engine run with the
    victim clean."""
    why = skip_reason(impl, device)
    if why:
        pytest.skip(why)
    case, (prompt, new, track, wave, index), value = c
    prop_request_isolation(case, factory_for(impl, device), victim_prompt=prompt, victim_new=new,
                           victim_track=track, wave=wave, index=index, value=value, check=check)
