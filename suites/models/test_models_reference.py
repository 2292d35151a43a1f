"""The reference LMs themselves (float64, no transformers): split invariance of prefill, batch
invariance, decode = prefill of one more token, and swappable mixer ops."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import tolerance_for
from reference.loader import detect_config, expected_parameters
from reference.mixers import reference_ops
from reference.models import ModelState, ReferenceLM
from reference.testing import split_points

F64 = torch.float64


@st.composite
def tiny_configs(draw):
    family = draw(st.sampled_from(["mamba1", "falcon_mamba", "mamba2"]))
    d_model = draw(st.sampled_from([8, 16]))
    common = {"hidden_size": d_model, "num_hidden_layers": 2, "vocab_size": draw(st.integers(20, 40)),
              "state_size": draw(st.sampled_from([2, 4])), "conv_kernel": draw(st.integers(2, 4)),
              "use_bias": draw(st.booleans()), "use_conv_bias": draw(st.booleans())}
    if family == "mamba2":
        heads = 2 * d_model // 4
        common.update(model_type="mamba2", head_dim=4, num_heads=heads,
                      n_groups=draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0])),
                      chunk_size=draw(st.integers(2, 5)),
                      time_step_limit=draw(st.sampled_from([[0.0, math.inf], [0.01, 0.5]])))
    else:
        common.update(model_type="mamba" if family == "mamba1" else "falcon_mamba")
    return detect_config(common)


def random_params(cfg, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_parameters(cfg).items():
        t = torch.randn(shape, generator=g, dtype=F64)
        if name.endswith("A_log"):
            t = torch.log(torch.rand(shape, generator=g, dtype=F64) * 4 + 0.5)
        elif name.endswith("norm.weight") or name == "norm_f.weight":
            t = 1 + 0.2 * t
        elif len(shape) >= 2:
            t = t / math.sqrt(shape[-1] if len(shape) == 2 else shape[0])
        else:
            t = 0.3 * t
        out[name] = t
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embedding.weight"]
    return out


def _prompt(data, vocab, lo=1, hi=14):
    n = data.draw(st.integers(lo, hi), label="prompt length")
    return data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n), label="prompt")


@given(data=st.data())
def test_models_reference_prefill_split_invariance(data, check):
    """Property: prefilling a prompt in pieces (cut anywhere, empty pieces allowed, each piece
    continuing from the state of the previous one) gives the same logits and final state as one
    prefill, and the next decode step agrees too."""
    cfg = data.draw(tiny_configs(), label="config")
    model = ReferenceLM(cfg, random_params(cfg, data.draw(st.integers(0, 999), label="seed")), dtype=F64)
    prompt = _prompt(data, cfg.vocab_size)
    cuts = data.draw(split_points(len(prompt)), label="cuts")
    full, state_full = model.prefill([prompt])
    bounds = [0] + cuts + [len(prompt)]
    pieces, state = [], None
    for a, b in zip(bounds[:-1], bounds[1:]):
        if state is None and a == b:
            continue
        lg, state = model.prefill([prompt[a:b]], state)
        pieces.append(lg[0])
    kw = dict(op="model_prefill", impl="reference-split", dtype=F64, tol=tolerance_for(F64, scale=10))
    check.close("split prefill logits", torch.cat(pieces), full[0], **kw)
    for i in range(cfg.n_layer):
        check.close(f"layer {i} ssm state", state.ssm[i], state_full.ssm[i], **kw)
        check.close(f"layer {i} conv state", state.conv[i], state_full.conv[i], **kw)
    nxt = data.draw(st.integers(0, cfg.vocab_size - 1), label="next token")
    dec, _ = model.decode([nxt], state)
    one_more, _ = model.prefill([prompt + [nxt]])
    check.close("decode == prefill of one more token", dec[0], one_more[0][-1], **kw)


@given(data=st.data())
def test_models_reference_batch_invariance(data, check):
    """Property: prefilling and decoding several requests together (packed, varlen) gives each
    request exactly what it gets alone, whatever the other requests are."""
    cfg = data.draw(tiny_configs(), label="config")
    model = ReferenceLM(cfg, random_params(cfg, data.draw(st.integers(0, 999), label="seed")), dtype=F64)
    prompts = [_prompt(data, cfg.vocab_size, 1, 10) for _ in range(data.draw(st.integers(2, 3), label="batch"))]
    logits, state = model.prefill(prompts)
    nxt = [data.draw(st.integers(0, cfg.vocab_size - 1)) for _ in prompts]
    dec, _ = model.decode(nxt, state)
    kw = dict(op="model_prefill", impl="reference-batched", dtype=F64, tol=tolerance_for(F64, scale=10))
    for j, p in enumerate(prompts):
        alone, st_alone = model.prefill([p])
        check.close(f"request {j} prefill logits", logits[j], alone[0], **kw)
        sel = state.select([j])
        for i in range(cfg.n_layer):
            check.close(f"request {j} layer {i} ssm state", sel.ssm[i], st_alone.ssm[i], **kw)
        d_alone, _ = model.decode([nxt[j]], st_alone)
        check.close(f"request {j} decode logits", dec[j], d_alone[0], **kw)


@given(data=st.data())
def test_models_reference_ops_are_swappable(data, check):
    """Property: a model built with other mixer ops (here the chunked SSD formulation instead of the
    token loop) computes the same generation: the ops object is the only thing a kernel runner swaps."""
    cfg = data.draw(tiny_configs().filter(lambda c: c.family == "mamba2"), label="config")
    params = random_params(cfg, data.draw(st.integers(0, 999), label="seed"))
    scan = ReferenceLM(cfg, params, dtype=F64, ops=reference_ops("scan"))
    chunked = ReferenceLM(cfg, params, dtype=F64, ops=reference_ops("chunked"))
    prompt = _prompt(data, cfg.vocab_size, 1, 16)
    a = scan.greedy_generate(prompt, 6)
    b = chunked.greedy_generate(prompt, 6, forced=a.tokens)
    check.close("chunked-SSD model logits", b.logits, a.logits, op="greedy_generate", impl="reference[chunked]",
                dtype=F64, tol=tolerance_for(F64, scale=100))


def test_models_reference_bad_inputs():
    """Bad input: out-of-vocabulary tokens, a state of the wrong batch, missing parameters each fail
    with a ValueError naming the argument."""
    cfg = detect_config({"model_type": "mamba", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 10})
    params = random_params(cfg, 0)
    model = ReferenceLM(cfg, params)
    with pytest.raises(ValueError, match=r"tokens_list\[0\]: expected token ids in \[0, 10\)"):
        model.prefill([[1, 10]])
    _, state = model.prefill([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"next_tokens|state: expected states of 1 requests"):
        model.decode([1], state)
    bad = dict(params)
    bad.pop("layers.0.mixer.D")
    with pytest.raises(ValueError, match=r"params: .*missing \['layers\.0\.mixer\.D'\]"):
        ReferenceLM(cfg, bad)
    assert isinstance(state, ModelState) and state.batch == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_models_reference_dt_limit_prefill_and_decode_agree(seed, check):
    """Property: Mamba-2's time_step_limit is applied identically by prefill and decode (decode of a
    token == prefill of one more token), and the limit binds (a model without it differs), so a path
    that drops the clamp on either side fails here. (transformers and mamba_ssm clamp only in prefill.)"""
    cfg = detect_config({"model_type": "mamba2", "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 30,
                         "state_size": 4, "conv_kernel": 3, "head_dim": 4, "num_heads": 8, "n_groups": 2,
                         "chunk_size": 3, "time_step_limit": [0.05, 0.4]})
    params = random_params(cfg, seed)
    model = ReferenceLM(cfg, params, dtype=F64)
    prompt = torch.randint(0, 30, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    head, state = model.prefill([prompt[:-1]])
    dec, _ = model.decode([prompt[-1]], state)
    full, _ = model.prefill([prompt])
    kw = dict(op="model_decode", impl="reference", dtype=F64, tol=tolerance_for(F64, scale=10))
    check.close("decode with dt limit == prefill with dt limit", dec[0], full[0][-1], **kw)
    unlimited = ReferenceLM(cfg.replace(time_step_limit=(0.0, math.inf)), params, dtype=F64)
    free, _ = unlimited.prefill([prompt])
    from harness.testing.checks import compare
    assert not compare("limit binds", free[0], full[0], tolerance_for(F64)).passed, "time_step_limit never binds"
