"""Oracle parity at model level: greedy generation of our reference LMs against transformers' `generate`.

transformers builds and saves tiny random checkpoints itself (MambaForCausalLM, FalconMambaForCausalLM,
Mamba2ForCausalLM; save_pretrained into a temp folder); we also write raw state-spaces twins of the
same weights (config.json with d_model / n_layer / ssm_cfg, `backbone.embedding.*` names, .bin or
safetensors, vocabulary padded in the file or left for the loader to pad). Each checkpoint is loaded
with our reference loader and generates greedily, in float32 and float64.

Agreement is tie-aware: a token mismatch counts only where transformers' top-2 logit margin is clear
(> 1e-3 relative); per-step logits are compared teacher-forced on transformers' tokens, so the logits
of all steps are checked even after a tie.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import tolerance_for
from reference.models import ReferenceLM

from models_hf_oracle import (Dims, mamba2_group_choices, first_clear_mismatch, hf_greedy, hf_model, quiet_transformers, top2_margin,
                              write_state_spaces)

N_NEW = 32
MARGIN = 1e-3


@st.composite
def model_dims(draw, family, deep=False):
    d_model = draw(st.sampled_from([16, 24, 32] if not deep else [32, 48, 64]))
    kw = dict(family=family, d_model=d_model, n_layer=draw(st.integers(1, 2)) if not deep else 4,
              vocab=draw(st.integers(40, 100)), d_state=draw(st.sampled_from([2, 4, 8, 16])),
              d_conv=draw(st.integers(2, 4)), expand=2, tie=draw(st.booleans()),
              bias=draw(st.booleans()), conv_bias=draw(st.booleans()))
    if family == "falcon_mamba":
        kw["mixer_rms_eps"] = draw(st.sampled_from([1e-6, 1e-3]))
    if family == "mamba2":
        d_inner = 2 * d_model
        head_dim = draw(st.sampled_from([p for p in (4, 8, 16) if d_inner % p == 0]))
        heads = d_inner // head_dim
        kw.update(head_dim=head_dim, n_groups=draw(st.sampled_from(mamba2_group_choices(heads))),
                  chunk_size=draw(st.integers(3, 8)))
    return Dims(**kw)


def _compare_generation(ref: ReferenceLM, prompt, hf_tokens, hf_logits, check, label, dtype, seed,
                        free_run: bool):
    """Teacher-forced on transformers' tokens: every step's logits within tolerance and every step's
    argmax equal to transformers' token unless transformers' top-2 margin is a tie. Up to the first
    tie this is exactly free-running greedy agreement; `free_run` also runs our own greedy loop."""
    V = hf_logits.shape[-1]
    ctx = dict(op="greedy_generate", impl="reference", dtype=dtype,
               tol=tolerance_for(torch.float32, scale=2.0), seed=seed,
               shapes={"prompt": [len(prompt)], "logits": list(hf_logits.shape)},
               context=f"oracle: transformers generate; {label}, reference in {dtype}")
    forced = ref.greedy_generate(prompt, N_NEW, forced=hf_tokens)
    # actual = ours (any dtype), expected = the oracle's logits
    check.close(f"{label}: step logits (teacher-forced)", forced.logits[:, :V], hf_logits, **ctx)
    for i, (a, b) in enumerate(zip(forced.tokens, hf_tokens)):
        if a != b:
            m = top2_margin(hf_logits[i])
            assert m <= MARGIN, (f"{label} ({dtype}): teacher-forced step {i}: ours {a}, transformers {b}, "
                                 f"oracle top-2 margin {m:.3e} > {MARGIN} (prompt {prompt})")
    if free_run:
        free = ref.greedy_generate(prompt, N_NEW)
        bad = first_clear_mismatch(free.tokens, hf_tokens, hf_logits, MARGIN)
        assert bad is None, (f"{label} ({dtype}): greedy generation differs from transformers at step {bad[0]}: "
                             f"ours {bad[1]}, transformers {bad[2]} (margin {bad[3]:.3e}); prompt {prompt}\n"
                             f"ours {free.tokens}\ntransformers {hf_tokens}")


def _run_model(d: Dims, seed: int, prompts, raw_fmt: str, pad_in_file: bool, check):
    """The HF checkpoint is checked on every prompt in fp32 and fp64; its state-spaces twin (same
    weights, other names/format/padding) on the longest prompt."""
    quiet_transformers()
    model = hf_model(d, seed)
    oracle = [hf_greedy(model, p, N_NEW) for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(f"{tmp}/hf")
        runs = [("hf", f"{tmp}/hf", list(range(len(prompts))))]
        if d.family != "falcon_mamba":
            raw = write_state_spaces(model, d, f"{tmp}/raw", fmt=raw_fmt, pad_in_file=pad_in_file)
            runs.append((f"state-spaces/{raw_fmt}/pad_in_file={pad_in_file}", str(raw), [len(prompts) - 1]))
        for label, folder, which in runs:
            for dtype in (torch.float32, torch.float64):
                ref = ReferenceLM.from_pretrained(folder, dtype=dtype)
                if label != "hf":
                    assert ref.cfg.vocab_size % 8 == 0 and ref.cfg.vocab_size_unpadded == d.vocab
                for j in which:
                    toks, logits = oracle[j]
                    _compare_generation(ref, prompts[j], toks, logits, check, f"{d.family} {label}", dtype, seed,
                                        free_run=(label == "hf" and dtype == torch.float64 and j == 0))


def _prompts(data, vocab, min_long):
    lengths = [1, data.draw(st.integers(2, 7), label="short prompt"),
               data.draw(st.integers(min_long, min_long + 12), label="long prompt")]
    g = data.draw(st.integers(0, 2**16), label="prompt seed")
    gen = torch.Generator().manual_seed(g)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["mamba1", "falcon_mamba", "mamba2"])
@given(data=st.data())
def test_models_greedy_matches_transformers(family, data, check):
    """Property: for tiny random checkpoints saved by transformers (and their raw state-spaces twins),
    our reference LM loaded by our loader generates the same 32 greedy tokens as transformers'
    generate from prompts of 1, a few and many tokens (Mamba-2: longer than several chunks), in
    float32 and float64 (tie-aware), and its teacher-forced per-step logits match transformers'."""
    d = data.draw(model_dims(family), label="dims")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    raw_fmt = data.draw(st.sampled_from(["bin", "safetensors"]), label="raw format")
    pad_in_file = data.draw(st.booleans(), label="vocab padded in file")
    prompts = _prompts(data, d.vocab, 2 * d.chunk_size + 1 if family == "mamba2" else 8)
    _run_model(d, seed, prompts, raw_fmt, pad_in_file, check)


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("family", ["mamba1", "falcon_mamba", "mamba2"])
@given(data=st.data())
def test_models_greedy_matches_transformers_deep(family, data, check, nightly_only):
    """Property (nightly depth): as test_models_greedy_matches_transformers, for wider 4-layer models
    and prompts of 40+ tokens."""
    d = data.draw(model_dims(family, deep=True), label="dims")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    prompts = _prompts(data, d.vocab, 40)
    _run_model(d, seed, prompts, data.draw(st.sampled_from(["bin", "safetensors"])), data.draw(st.booleans()), check)


def test_models_greedy_detects_a_wrong_model(check):
    """Property (the comparison can fail): a reference built on a checkpoint with one perturbed
    weight (layer 0's A_log) disagrees with transformers' logits."""
    quiet_transformers()
    d = Dims(family="mamba2", d_model=16, n_layer=2, vocab=50, d_state=4, head_dim=4, n_groups=2, chunk_size=4)
    model = hf_model(d, 5)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    toks, logits = hf_greedy(model, prompt, 8)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        from reference.loader import load_checkpoint
        ck = load_checkpoint(tmp)
        ck.params["layers.0.mixer.A_log"] = ck.params["layers.0.mixer.A_log"] + 0.5
        ref = ReferenceLM(ck.config, ck.params, dtype=torch.float64)
    out = ref.greedy_generate(prompt, 8, forced=toks)
    from harness.testing.checks import compare
    c = compare("perturbed", out.logits, logits, tolerance_for(torch.float32))
    assert not c.passed, c.message()
