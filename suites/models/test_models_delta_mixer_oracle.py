"""Oracle parity of the delta-rule mixers: transformers' Qwen3NextGatedDeltaNet (family ``gdn``) and
KimiLinearDeltaAttention (family ``kda``) against our reference mixers and the engine's mixers.

transformers' modules (their own torch code: `models_hf_oracle.hf_torch_path_only` swaps out any
causal-conv1d / flash-linear-attention kernel they bound at import) get random weights from a tiny random
config; the config is parsed by our loader from transformers' own JSON. Both sides prefill a batch of
equal-length prompts (transformers batched, ours packed with cu_seqlens, the engine as one prefill chunk
in pool slots) and then decode token by token with the cache carried. transformers computes these mixers
in float32 whatever the module dtype (the delta rule, the gate and the norm upcast to float32 only), so
the oracle is float32: our float64 runs are compared with it at float32 tolerance.
"""
from __future__ import annotations

import json

import pytest
import torch

from harness.testing.checks import tolerance_for
from harness.engine.backend import make_backend
from harness.engine.metadata import build_metadata
from harness.engine.scheduler import BatchEntry
from harness.scenarios import engine_impl, skip_reason
from reference.loader import detect_config
from reference.mixers import make_mixer

from models_hf_oracle import hf_foreign_functions, hf_mixer_call, kda_checkpoint_names, quiet_transformers, randomize_

# (family, hidden, key heads, value heads, key head dim, value head dim, conv width); KDA uses the key sizes
CASES = [
    ("gdn", 16, 2, 4, 8, 4, 4),   # Hv > Hk: value heads 0, 1 read key head 0
    ("gdn", 16, 2, 2, 4, 8, 3),
    ("gdn", 24, 1, 3, 8, 8, 2),
    ("kda", 16, 2, 2, 8, 8, 4),
    ("kda", 24, 3, 3, 4, 4, 3),
]
IDS = [f"{c[0]}-d{c[1]}-hk{c[2]}-hv{c[3]}-k{c[4]}-v{c[5]}-conv{c[6]}" for c in CASES]


def hf_delta_mixer(case, seed: int):
    """transformers' mixer of `case` (layer 0 of a one-layer all-linear-attention model), random weights,
    float32, and its config."""
    quiet_transformers()
    family, d, hk, hv, kd, vd, conv = case
    common = dict(hidden_size=d, num_hidden_layers=1, vocab_size=32, layer_types=["linear_attention"],
                  linear_conv_kernel_dim=conv, rms_norm_eps=1e-6)
    if family == "gdn":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
        hc = Qwen3NextConfig(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=kd,
                             linear_value_head_dim=vd, **common)
        cls = Qwen3NextGatedDeltaNet
    else:
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
        hc = KimiLinearConfig(linear_num_heads=hk, linear_head_dim=kd, **common)
        cls = KimiLinearDeltaAttention
    torch.manual_seed(seed)
    mixer = cls(hc, 0)
    randomize_(mixer, seed)
    return mixer.float().eval(), hc


def _oracle(case, seed, batch, T, steps):
    """(our config, weights, prompts (B, T, d), decode inputs (steps, B, 1, d), transformers' outputs:
    prefill (B, T, d) with its recurrent (value-major) and conv states, then per decode step the same)."""
    from transformers.cache_utils import DynamicCache
    mixer, hc = hf_delta_mixer(case, seed)
    cfg = detect_config(json.loads(hc.to_json_string()))
    g = torch.Generator().manual_seed(seed + 1)
    h = torch.randn(batch, T, case[1], generator=g)
    news = torch.randn(steps, batch, 1, case[1], generator=g)
    cache = DynamicCache(config=hc)
    K1 = cfg.d_conv - 1
    record = []
    with torch.no_grad():
        for x in [h] + list(news):
            y = hf_mixer_call(mixer, x, cache)
            layer = cache.layers[0]
            record.append((y, layer.recurrent_states[0].transpose(-1, -2).clone(),
                           layer.conv_states[0][..., -K1:].clone()))
    sd = dict(mixer.state_dict())
    return cfg, (kda_checkpoint_names(sd) if case[0] == "kda" else sd), h, news, record


def _ctx(case, impl, dtype, seed):
    return dict(op=f"mixer_{case[0]}", impl=impl, context="oracle: transformers (float32)", dtype=dtype,
                tol=tolerance_for(torch.float32), seed=seed, shapes={"case": list(case[1:])})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_models_delta_reference_mixer_matches_transformers(case, dtype, check):
    """Our reference mixer (packed prefill, then step-by-step decode with explicit states) equals
    transformers' mixer (batched prefill, decode with its cache) in outputs, recurrent states and conv
    states; float32 and float64 (against the float32 oracle)."""
    seed, batch, T, steps = 7 + len(IDS[CASES.index(case)]), 2, 9, 3
    cfg, params, h, news, record = _oracle(case, seed, batch, T, steps)
    ours = make_mixer(cfg, params, dtype=dtype)
    ctx = _ctx(case, "reference", dtype, seed)
    d = case[1]
    out, conv, ssm = ours.forward(h.reshape(batch * T, d).to(dtype), torch.arange(batch + 1) * T)
    y, ssm_hf, conv_hf = record[0]
    check.close("prefill out", out, y.reshape(batch * T, d), **ctx)
    check.close("prefill recurrent state", ssm, ssm_hf, **ctx)
    check.close("prefill conv state", conv, conv_hf, **ctx)
    for s in range(steps):
        out, conv, ssm = ours.step(news[s][:, 0].to(dtype), conv, ssm)
        y, ssm_hf, conv_hf = record[s + 1]
        check.close(f"decode {s} out", out, y[:, 0], **ctx)
        check.close(f"decode {s} recurrent state", ssm, ssm_hf, **ctx)
        check.close(f"decode {s} conv state", conv, conv_hf, **ctx)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_models_delta_engine_mixer_matches_transformers(case, impl, device, check):
    """The engine's mixer with `impl`'s ops (the prompts as one prefill chunk into pool slots out of
    order, then decode steps reading and writing those slots) equals transformers' mixer in outputs and
    in the pools' states; float64 where the implementation has it, float32 otherwise."""
    why = skip_reason(impl, device, case[0])
    if why:
        pytest.skip(why)
    run = engine_impl(impl)
    seed, batch, T, steps = 11 + len(IDS[CASES.index(case)]), 2, 9, 3
    cfg, params, h, news, record = _oracle(case, seed, batch, T, steps)
    dtypes = [dt for dt in (torch.float32, torch.float64) if dt in run.dtypes and (device == "cpu" or dt != torch.float64)]
    if not dtypes:
        pytest.skip(f"implementation {impl.name!r} runs neither float32 nor float64")
    d = case[1]
    for dtype in dtypes:
        be = make_backend(cfg, params, run, dtype=dtype, device=device)
        spec = families_spec(cfg, dtype)
        slots = [2, 0]
        conv_pool = torch.full((3, *spec.conv_shape), float("nan"), dtype=dtype, device=device)
        ssm_pool = torch.full((3, *spec.recurrent_shape), float("nan"), dtype=dtype, device=device)
        ctx = _ctx(case, run, dtype, seed)
        md = build_metadata([BatchEntry(i, slots[i], 0, T, False, (0,) * T) for i in range(batch)], device=device)
        out, conv_pool, ssm_pool = be(h.reshape(batch * T, d).to(device, dtype), md, conv_pool, ssm_pool)
        y, ssm_hf, conv_hf = record[0]
        check.close("prefill out", out.cpu(), y.reshape(batch * T, d), **ctx)
        check.close("prefill recurrent state", ssm_pool[slots].cpu(), ssm_hf, **ctx)
        check.close("prefill conv state", conv_pool[slots].cpu(), conv_hf, **ctx)
        for s in range(steps):
            md = build_metadata([BatchEntry(i, slots[i], T + s, 1, True, (0,)) for i in range(batch)], device=device)
            out, conv_pool, ssm_pool = be(news[s][:, 0].to(device, dtype), md, conv_pool, ssm_pool)
            y, ssm_hf, conv_hf = record[s + 1]
            check.close(f"decode {s} out", out.cpu(), y[:, 0], **ctx)
            check.close(f"decode {s} recurrent state", ssm_pool[slots].cpu(), ssm_hf, **ctx)
            check.close(f"decode {s} conv state", conv_pool[slots].cpu(), conv_hf, **ctx)


def families_spec(cfg, dtype):
    """The pool shapes of one layer (the family's state spec; KDA's spec keeps float32 recurrent states,
    the shapes are what matters here)."""
    from reference import families
    return families.get(cfg.family).state_spec(cfg, conv_dtype=dtype, recurrent_dtype=torch.float32)


def test_models_delta_oracle_is_transformers_torch_code():
    """The oracle's precondition: transformers' Qwen3-Next and Kimi Linear modules run their own torch code
    here, no kernel wrapper left that could call causal-conv1d's or flash-linear-attention's kernels."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk
    from transformers.models.qwen3_next import modeling_qwen3_next as mq
    assert not [f for f in hf_foreign_functions() if "qwen3_next" in f or "kimi_linear" in f]
    for mod, names in ((mq, ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                             "torch_recurrent_gated_delta_rule")),
                       (mk, ("causal_conv1d_fn", "causal_conv1d_update", "chunk_kimi_delta_attention",
                             "recurrent_kimi_delta_attention"))):
        for n in names:
            assert getattr(mod, n).__code__.co_filename == mod.__file__, f"{mod.__name__}.{n}"


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_models_delta_oracle_can_fail(case):
    """Property (the test can fail): a mixer whose weights differ from transformers' in one place (the
    output gate's projection) disagrees with transformers' output."""
    from harness.testing.checks import compare
    cfg, params, h, news, record = _oracle(case, 5, 1, 6, 0)
    name = "in_proj_qkvz.weight" if case[0] == "gdn" else "g_b_proj.weight"
    params = dict(params)
    params[name] = params[name].clone()
    params[name][-1] += 1.0  # a z / gate row
    out, _, _ = make_mixer(cfg, params, dtype=torch.float64).forward(h[0].double())
    c = compare("mixer with one gate row changed", out, record[0][0][0], tolerance_for(torch.float32))
    assert not c.passed, c.message()
