"""Oracle parity at mixer level: our reference mixers against transformers' own mixers.

transformers' MambaMixer, FalconMambaMixer and Mamba2Mixer (their slow torch path, on CPU) get random
weights; our reference mixer gets the same weights. Both prefill a batch of equal-length sequences
(transformers batches them, we pack them with cu_seqlens) and then decode a few tokens step by step
with their caches. Outputs and states must agree.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import Tolerance, compare, tolerance_for
from reference.loader import detect_config
from reference.mixers import make_mixer, reference_ops

from models_hf_oracle import (HF_UNGROUPED_NORM, Dims, hf_mamba2_gated_norm, hf_mamba2_norm_is_grouped, hf_mixer,
                              hf_mixer_call, mamba2_group_choices, spread, widened)

# transformers' "float64" mixers still run some pieces in float32 (D.float(), the gated RMSNorm and
# Falcon's B/C/dt norms upcast to float32 only), so an fp64 comparison can only be this tight:
HF_FP64_TOL = Tolerance(atol=1e-5, rtol=1e-5, ratio=1e-6)


@st.composite
def mixer_dims(draw, family):
    d_model = draw(st.sampled_from([8, 16, 24]))
    expand = draw(st.sampled_from([1, 2]))
    kw = dict(family=family, d_model=d_model, expand=expand, n_layer=1, vocab=32,
              d_state=draw(st.sampled_from([2, 4, 8])), d_conv=draw(st.integers(2, 4)),
              bias=draw(st.booleans()), conv_bias=draw(st.booleans()))
    if family == "falcon_mamba":
        kw["mixer_rms_eps"] = draw(st.sampled_from([1e-6, 1e-3, 0.1]))
    if family in ("mamba1", "falcon_mamba"):
        kw["dt_rank"] = draw(st.sampled_from([None, 1, 3]))
    if family == "mamba2":
        d_inner = expand * d_model
        head_dim = draw(st.sampled_from([p for p in (2, 4, 8) if d_inner % p == 0]))
        heads = d_inner // head_dim
        kw.update(head_dim=head_dim, n_groups=draw(st.sampled_from(mamba2_group_choices(heads))),
                  chunk_size=draw(st.integers(2, 6)),
                  time_step_limit=draw(st.sampled_from([(0.0, float("inf")), (0.0, float("inf")), (0.05, 0.4)])))
    return Dims(**kw)


def _hf_run(d: Dims, seed: int, dtype, h, news):
    """transformers' mixer in `dtype` over the prefill `h`, then each decode input of `news`: per call its output
    and the cache's ssm and conv states after it."""
    from transformers.cache_utils import DynamicCache
    mixer, hc = hf_mixer(d, seed, dtype=dtype)
    cache, K1, got = DynamicCache(config=hc), d.d_conv - 1, []
    with torch.no_grad():
        for x in [h] + list(news):
            y = hf_mixer_call(mixer, x.to(dtype), cache)
            layer = cache.layers[0]
            got.append((y, layer.recurrent_states[0].clone(), layer.conv_states[0][..., -K1:].clone()))
    return mixer, hc, got


def _run(d: Dims, seed: int, batch: int, T: int, steps: int, hf_dtype, ssd: str, check):
    g = torch.Generator().manual_seed(seed + 1)
    h = torch.randn(batch, T, d.d_model, generator=g, dtype=torch.float64).to(hf_dtype)
    news = torch.randn(steps, batch, 1, d.d_model, generator=g, dtype=torch.float64).to(hf_dtype)
    mixer, hc, hf = _hf_run(d, seed, hf_dtype, h, news)
    cfg = detect_config(json.loads(hc.to_json_string()))
    ours = make_mixer(cfg, {k: v for k, v in mixer.state_dict().items()}, dtype=hf_dtype,
                      ops=reference_ops(ssd))
    tol = tolerance_for(torch.float32) if hf_dtype == torch.float32 else HF_FP64_TOL
    # float64: each comparison also allows what fp32 moves transformers' value at that call (its fp32 pieces)
    hf32 = _hf_run(d, seed, torch.float32, h, news)[2] if hf_dtype == torch.float64 else None
    ctx = dict(op=f"mixer_{d.family}", impl="reference", context=f"oracle: transformers; ssd={ssd}",
               dtype=hf_dtype, seed=seed, shapes={"hidden": [batch, T, d.d_model]})

    def close(name, actual, call, part, expected):
        t = tol if hf32 is None else widened(tol, spread(hf32[call][part].reshape(expected.shape), expected))
        check.close(name, actual, expected, tol=t, **ctx)

    cu = torch.arange(batch + 1, dtype=torch.int64) * T
    out, conv, ssm = ours.forward(h.reshape(batch * T, d.d_model), cu)
    # The oracle is transformers here: `actual` = ours, `expected` = transformers.
    close("prefill out", out, 0, 0, hf[0][0].reshape(batch * T, -1))
    close("prefill ssm state", ssm, 0, 1, hf[0][1])
    close("prefill conv state", conv, 0, 2, hf[0][2])
    for s in range(steps):
        y, conv, ssm = ours.step(news[s][:, 0], conv, ssm)
        close(f"decode step {s} out", y, s + 1, 0, hf[s + 1][0][:, 0])
        close(f"decode step {s} ssm state", ssm, s + 1, 1, hf[s + 1][1])
        close(f"decode step {s} conv state", conv, s + 1, 2, hf[s + 1][2])


def test_models_mixer_fp32_pieces_of_the_float64_oracle(check):
    """The property's failing case under the nightly profile: a Falcon-Mamba mixer whose second decode step's
    output (norm 0.24) is 1.015e-6 (error ratio) from transformers' "float64", against HF_FP64_TOL's 1e-6, where
    transformers' fp32 is 1.14e-6 from it: within the tolerance widened by that fp32 distance."""
    d = Dims(family="falcon_mamba", d_model=8, n_layer=1, vocab=32, d_state=8, d_conv=4, expand=1, bias=False,
             conv_bias=False, mixer_rms_eps=1e-6, dt_rank=3, tie=True)
    _run(d, 5064, 1, 1, 2, torch.float64, "scan", check)


@pytest.mark.parametrize("family", ["mamba1", "falcon_mamba", "mamba2"])
@given(data=st.data())
def test_models_mixer_matches_transformers(family, data, check):
    """Property: for random tiny configs and weights, our reference mixer (prefill over packed
    sequences, then step-by-step decode with explicit states) equals transformers' mixer (batched
    prefill, then decode with its cache) in outputs, SSM states and conv states, in float32 and in
    float64. Mamba-2 draws n_groups > 1, prefills longer than chunk_size (several chunks) and a binding
    time_step_limit (prefill only: transformers' decode ignores it), and is checked with both the
    token-loop and the chunked reference SSD."""
    d = data.draw(mixer_dims(family), label="dims")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    batch = data.draw(st.integers(1, 2), label="batch")
    min_T = 2 * d.chunk_size + 1 if family == "mamba2" else 1
    T = data.draw(st.integers(min_T, min_T + 10), label="T")
    # transformers' Mamba-2 decode step ignores time_step_limit (only its chunked prefill clamps dt), so
    # with a non-default limit only the prefill is compared with it; our decode's clamp is checked in
    # test_models_reference_dt_limit_prefill_and_decode_agree.
    limited = tuple(d.time_step_limit) != (0.0, float("inf"))
    steps = 0 if limited else data.draw(st.integers(1, 3), label="decode steps")
    hf_dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    ssd = data.draw(st.sampled_from(["scan", "chunked"]), label="ssd") if family == "mamba2" else "scan"
    _run(d, seed, batch, T, steps, hf_dtype, ssd, check)


def test_models_mixer_falcon_norms_matter():
    """Property (the test can fail): Falcon-Mamba's B/C/dt norms change the output, so a mixer that
    skips them (plain Mamba-1 on Falcon weights) disagrees with transformers' FalconMambaMixer."""
    from transformers.cache_utils import DynamicCache
    d = Dims(family="falcon_mamba", d_model=16, n_layer=1, vocab=32, d_state=4, d_conv=3, mixer_rms_eps=1e-6)
    mixer, hc = hf_mixer(d, 3)
    cfg = detect_config(json.loads(hc.to_json_string()))
    plain = make_mixer(cfg.replace(family="mamba1", mixer_rms_eps=None), dict(mixer.state_dict()),
                       dtype=torch.float32)
    h = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_mixer_call(mixer, h, DynamicCache(config=hc))
    out, _, _ = plain.forward(h[0])
    c = compare("plain mamba1 on falcon weights", out, expected[0], tolerance_for(torch.float32))
    assert not c.passed, c.message()


def test_models_hf_mamba2_norm_is_grouped():
    """The oracle's own precondition for n_groups > 1: transformers' Mamba-2 gated RMSNorm normalizes
    per group. Where it does not, the oracle suites draw n_groups = 1 only, and this test says so."""
    if not hf_mamba2_norm_is_grouped():
        pytest.skip(HF_UNGROUPED_NORM)
    norm = hf_mamba2_gated_norm()(8, group_size=4).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    x[:, 4:] *= 100.0  # groups of very different scale: a whole-row norm mixes them
    y = norm(x, torch.zeros_like(x) + 30.0)  # gate = silu(30) ~ 1 (the norm computes in float32)
    per_group = torch.cat([g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                           for g in x.split(4, dim=-1)], dim=-1)
    assert torch.allclose(y, per_group, rtol=1e-4, atol=1e-5), (y - per_group).abs().max()


def test_models_oracle_is_transformers_torch_code():
    """The oracle's precondition: transformers' Mamba modules run their own torch code here, with no
    kernel wrapper left that could call a peer's kernel (see models_hf_oracle.hf_torch_path_only)."""
    from models_hf_oracle import hf_foreign_functions
    assert hf_foreign_functions() == []


def test_models_oracle_ignores_importable_peer_kernels(tmp_path):
    """Regression (H200 box, transformers 5.17, mamba_ssm and causal-conv1d importable for their adapters):
    transformers bound the peers' CUDA kernels at import time and the CPU oracle failed with "Expected
    x.is_cuda() to be true". With fake peer packages whose kernels raise (fla's delta-rule kernels too), no
    wrapper is left in transformers' modules (functions, or the `kernels` package's module objects) and the
    oracle mixers still run."""
    import os
    import subprocess
    import sys
    import textwrap
    for pkg in ("causal_conv1d", "mamba_ssm"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(textwrap.dedent("""
            def _cuda_only(*a, **k):
                raise RuntimeError("Expected x.is_cuda() to be true, but got false.")
            causal_conv1d_fn = causal_conv1d_update = selective_scan_fn = mamba_inner_fn = _cuda_only
            selective_state_update = mamba_chunk_scan_combined = mamba_split_conv1d_scan_combined = _cuda_only
        """))
    # flash-linear-attention's delta-rule kernels, where transformers looks for them (fla.ops.<op family>)
    for sub, names in (("gated_delta_rule", "chunk_gated_delta_rule = fused_recurrent_gated_delta_rule"),
                       ("kda", "chunk_kda = fused_recurrent_kda")):
        (tmp_path / "fla" / "ops" / sub).mkdir(parents=True)
        (tmp_path / "fla" / "ops" / sub / "__init__.py").write_text(
            "def _cuda_only(*a, **k):\n    raise RuntimeError('a CUDA kernel')\n" + f"{names} = _cuda_only\n")
    for d in ("fla", "fla/ops"):
        (tmp_path / d / "__init__.py").write_text("")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    script = textwrap.dedent("""
        import torch, transformers.models.mamba.modeling_mamba as mm
        # a wrapper function from elsewhere, or (transformers >= 5.25 with `kernels`) an nn.Module object
        f = mm.causal_conv1d_fn
        assert not hasattr(f, "__code__") or f.__code__.co_filename != mm.__file__, "precondition: the fake is bound"
        from models_hf_oracle import Dims, hf_mixer, hf_mixer_call, hf_foreign_functions
        from transformers.cache_utils import DynamicCache
        assert hf_foreign_functions() == [], hf_foreign_functions()
        for fam in ("mamba1", "falcon_mamba", "mamba2"):
            d = Dims(family=fam, d_model=8, n_layer=1, vocab=32, d_state=4, d_conv=3, head_dim=4, chunk_size=4)
            mixer, hc = hf_mixer(d, 0)
            with torch.no_grad():
                hf_mixer_call(mixer, torch.randn(1, 5, 8), DynamicCache(config=hc))
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), here, root]), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
