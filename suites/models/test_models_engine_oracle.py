"""Oracle parity of the ENGINE with every implementation: checkpoints saved by transformers itself, loaded
by the fast harness loader onto the device, run through the engine (scheduler, chunked prefill, state
pool, the implementation's kernels through the op contract) as one mixed batch, generate the same greedy
tokens as transformers' `generate` (tie-aware) with per-step logits within tolerance.

This is the requirement "greedy tokens match transformers for every implementation registered for the
device"; the reference-only parity (fp32/fp64, every checkpoint format) is test_models_oracle.py.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import given, strategies as st

from harness.engine.scheduler import Request
from harness.loader import load_weights
from harness.scenarios import factory_for, skip_reason

from models_hf_oracle import Dims, check_engine_greedy, hf_greedy, hf_model, mamba2_group_choices, quiet_transformers

N_NEW = 32
MARGIN = 1e-3


@st.composite
def engine_dims(draw, family):
    d_model = draw(st.sampled_from([16, 32]))
    kw = dict(family=family, d_model=d_model, n_layer=2, vocab=draw(st.integers(40, 90)),
              d_state=draw(st.sampled_from([4, 8, 16])), d_conv=draw(st.integers(2, 4)), tie=draw(st.booleans()))
    if family == "mamba2":
        kw.update(head_dim=8, n_groups=draw(st.sampled_from(mamba2_group_choices(2 * d_model // 8, (1, 2)))),
                  chunk_size=draw(st.sampled_from([4, 8])))
    return Dims(**kw)


@pytest.mark.parametrize("family", ["mamba1", "falcon_mamba", "mamba2"])
@given(data=st.data())
def test_models_engine_greedy_matches_transformers(family, data, impl, device, check):
    """Property: for a tiny random checkpoint saved by transformers, the engine running implementation
    `impl` on `device` (three requests of 1, a few and many prompt tokens in one batch, a token budget
    that splits prefills at arbitrary points) generates transformers' 32 greedy tokens per request
    (a mismatch counts only where transformers' top-2 margin is <= 1e-3 relative), and the logits that
    chose each token match transformers' within the implementation dtype's tolerance (x4 for depth)."""
    why = skip_reason(impl, device, family)
    if why:
        pytest.skip(why)
    d = data.draw(engine_dims(family), label="dims")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    budget = data.draw(st.integers(5, 24), label="token budget")
    g = torch.Generator().manual_seed(seed)
    long_len = 2 * d.chunk_size + 3 if family == "mamba2" else 12
    prompts = [torch.randint(0, d.vocab, (n,), generator=g).tolist()
               for n in (1, data.draw(st.integers(2, 6), label="short"), long_len)]
    quiet_transformers()
    model = hf_model(d, seed)
    oracle = [hf_greedy(model, p, N_NEW) for p in prompts]
    factory = factory_for(impl, device)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        w = load_weights(tmp, device=device)
    runner = factory((w.config, w.params), num_slots=4, token_budget=budget)
    results = runner.run([Request(f"r{i}", p, max_new_tokens=N_NEW) for i, p in enumerate(prompts)])
    check_engine_greedy(check, family, factory, prompts, oracle, results, seed=seed, margin=MARGIN, model=model,
                        context=f"oracle: transformers generate (fp32); token budget {budget}")
