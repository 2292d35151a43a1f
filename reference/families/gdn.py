"""Gated DeltaNet (family ``gdn``), the linear-attention mixer of Qwen3-Next.

Reference mixer (as transformers' Qwen3NextGatedDeltaNet; Hk key heads of K, Hv value heads of V,
r = Hv / Hk)::

    qkvz   = in_proj_qkvz(h)   per key head j: [q_j (K), k_j (K), v (r*V), z (r*V)]  (value heads j*r ..)
    ba     = in_proj_ba(h)     per key head j: [b (r), a (r)]
    q,k,v  = split(silu(conv1d(cat(q, k, v))), [Hk*K, Hk*K, Hv*V])        (depthwise, no bias)
    g      = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)      (per value head)
    o      = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)        (reference.delta_rule)
    y      = rms_norm(o per value head) * norm.weight * silu(z)             (norm before the gate, eps rms_norm_eps)
    out    = out_proj(y)

Recurrent state (S, Hv, V, K), value-major; conv state (S, 2*Hk*K + Hv*V, K_conv - 1). Config source: HF
``model_type`` ``qwen3_next``; its ``layer_types`` are recorded, only the linear-attention mixer is
modelled (parameter names as in transformers' ``linear_attn`` module). This mixer is independent of the
engine's (``harness/engine/families/gdn.py``) on purpose: the oracle shares no code with what it checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import delta_rule
from reference.cache import GDNSpec
from reference.config import MAX_CHUNK, MAX_STATE, ModelConfig, err, get_int, hf_common_dict
from reference.families import Family, common_fields, register
from reference.families._delta import get_layer_types, hf_delta_common, hf_delta_dict
from reference.mixers import Mixer, cast, linear
from reference.validate import fail


@dataclass(frozen=True)
class GDNFields:
    """Gated DeltaNet's own config fields (HF: linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim, layer_types)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    layer_types: tuple = ()

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


def qwen3_next_layer_types(n_layer: int, interval: int) -> tuple:
    """transformers' default for a Qwen3-Next config without layer_types: every `interval`-th layer
    (1-based) is full attention."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer))


class GDNFamily(Family):
    name = "gdn"
    # The mixer is modelled; whole hybrid models (full-attention layers between) are not yet.
    whole_models = False
    fields = GDNFields
    hf_model_types = ("qwen3_next",)
    hf_architectures = ("Qwen3NextForCausalLM", "Qwen3NextModel")
    hf_tie_default = False
    mixer_parameter_names = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
                             "norm.weight", "out_proj.weight")
    typical_vocab_size = 151936
    build_fields = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")

    # config ----------------------------------------------------------------------------------
    def from_hf(self, raw, common, where):
        common = hf_delta_common(raw, common, where)
        hk = get_int(raw, "linear_num_key_heads", where, 16)
        hv = get_int(raw, "linear_num_value_heads", where, 32)
        kd = get_int(raw, "linear_key_head_dim", where, 128, hi=MAX_STATE)
        vd = get_int(raw, "linear_value_head_dim", where, 128, hi=MAX_STATE)
        if hv % hk:
            raise err(where, f"linear_num_value_heads: expected a multiple of linear_num_key_heads = {hk}, got {hv}")
        interval = get_int(raw, "full_attention_interval", where, 4)
        layer_types = get_layer_types(raw, where, common["n_layer"], qwen3_next_layer_types(common["n_layer"], interval))
        chunk_size = get_int(raw, "chunk_size", where, 64, hi=MAX_CHUNK)
        return ModelConfig(family=self.name, mixer=GDNFields(num_k_heads=hk, num_v_heads=hv, head_k_dim=kd,
                                                             head_v_dim=vd, layer_types=layer_types),
                           chunk_size=chunk_size, **common)

    def from_state_spaces(self, raw, ssm, common, where):
        raise err(where, "ssm_cfg.layer: Gated DeltaNet has no state-spaces config")

    def to_hf(self, cfg) -> dict:
        return dict(model_type=self.hf_model_types[0], architectures=[self.hf_architectures[0]], **hf_common_dict(cfg),
                    **hf_delta_dict(cfg), linear_num_key_heads=cfg.num_k_heads,
                    linear_num_value_heads=cfg.num_v_heads, linear_key_head_dim=cfg.head_k_dim,
                    linear_value_head_dim=cfg.head_v_dim)

    def build_config(self, *, d_model, n_layer, vocab, d_conv=4, expand=2, chunk_size=64, pad_vocab_size_multiple=1,
                     tie_embeddings=False, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                     layer_types=None):
        if num_v_heads % num_k_heads:
            fail("num_v_heads", f"a multiple of num_k_heads = {num_k_heads}", num_v_heads)
        common = common_fields(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv,
                               pad_vocab_size_multiple=pad_vocab_size_multiple, tie_embeddings=tie_embeddings,
                               chunk_size=chunk_size, conv_bias=False, norm_eps=1e-6)
        types = tuple(layer_types) if layer_types is not None else ("linear_attention",) * n_layer
        return ModelConfig(family=self.name, mixer=GDNFields(num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                                                             head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                                                             layer_types=types), **common)

    def tiny_config(self, *, d_model=16, n_layer=2, vocab=60, d_state=None, d_conv=4, chunk_size=8):
        return self.build_config(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv, chunk_size=chunk_size,
                                 pad_vocab_size_multiple=8, num_k_heads=2, num_v_heads=4, head_k_dim=d_state or 8,
                                 head_v_dim=4)

    def summary(self, cfg) -> dict:
        return dict(num_k_heads=cfg.num_k_heads, num_v_heads=cfg.num_v_heads, head_k_dim=cfg.head_k_dim,
                    head_v_dim=cfg.head_v_dim, linear_layers=cfg.layer_types.count("linear_attention"))

    # parameters and state ----------------------------------------------------------------------
    def parameter_shapes(self, cfg) -> dict:
        Hv = cfg.num_v_heads
        return {"in_proj_qkvz.weight": (2 * cfg.key_dim + 2 * cfg.value_dim, cfg.d_model),
                "in_proj_ba.weight": (2 * Hv, cfg.d_model), "conv1d.weight": (cfg.conv_dim, 1, cfg.d_conv),
                "dt_bias": (Hv,), "A_log": (Hv,), "norm.weight": (cfg.head_v_dim,),
                "out_proj.weight": (cfg.d_model, cfg.value_dim)}

    def state_spec(self, cfg, *, conv_dtype, recurrent_dtype, tp_size=1):
        return GDNSpec(num_k_heads=cfg.num_k_heads, num_v_heads=cfg.num_v_heads, head_k_dim=cfg.head_k_dim,
                       head_v_dim=cfg.head_v_dim, conv_kernel=cfg.d_conv, tp_size=tp_size, conv_dtype=conv_dtype,
                       recurrent_dtype=recurrent_dtype)

    def make_mixer(self, cfg, params, *, dtype=torch.float64, ops=None, device=None):
        return GDNMixer(cfg, params, dtype=dtype, ops=ops, device=device)


class GDNMixer(Mixer):
    """Gated DeltaNet mixer: the head-interleaved projections unpacked per key head, the plain delta-rule
    recurrence of reference.delta_rule, the gated RMSNorm per value head."""

    def ssm_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.num_v_heads, self.cfg.head_v_dim, self.cfg.head_k_dim)

    def _project(self, h):
        """(qkv (n, conv_dim), z (n, Hv, V), b (n, Hv), a (n, Hv)) of hidden rows h."""
        cfg = self.cfg
        n, Hk, K, V = h.shape[0], cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
        r = cfg.num_v_heads // Hk
        qkvz = linear(h, self.p["in_proj_qkvz.weight"], None).reshape(n, Hk, 2 * K + 2 * r * V)
        q, k, v, z = torch.split(qkvz, [K, K, r * V, r * V], dim=-1)
        b, a = torch.split(linear(h, self.p["in_proj_ba.weight"], None).reshape(n, Hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return qkv, z.reshape(n, cfg.num_v_heads, V), b.reshape(n, -1), a.reshape(n, -1)

    def _heads(self, qkv, b, a):
        cfg = self.cfg
        n = qkv.shape[0]
        q, k, v = torch.split(qkv, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        g = self.A * torch.nn.functional.softplus(a + self.p["dt_bias"])
        return (q.reshape(n, cfg.num_k_heads, cfg.head_k_dim), k.reshape(n, cfg.num_k_heads, cfg.head_k_dim),
                v.reshape(n, cfg.num_v_heads, cfg.head_v_dim), g, torch.sigmoid(b))

    def _out(self, o, z):
        cfg = self.cfg
        n = o.shape[0]
        y = self.ops.gated_rms_norm(o.reshape(n, cfg.value_dim), self.p["norm.weight"].repeat(cfg.num_v_heads),
                                    z.reshape(n, cfg.value_dim), eps=cfg.norm_eps, group_size=cfg.head_v_dim,
                                    norm_before_gate=True)
        return linear(y, self.p["out_proj.weight"], None)

    def forward(self, hidden, cu_seqlens=None, conv_states_in=None, ssm_states_in=None):
        h = self._check_hidden(hidden)
        qkv, z, b, a = self._project(h)
        qkv, conv_out = self.ops.causal_conv1d(qkv, self.conv_w, self.conv_b, activation="silu",
                                               cu_seqlens=cu_seqlens, initial_states=cast(conv_states_in, self.dtype))
        q, k, v, g, beta = self._heads(qkv, b, a)
        o, ssm_out = delta_rule.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, cu_seqlens=cu_seqlens,
                                                 initial_states=cast(ssm_states_in, self.dtype))
        return self._out(o, z), conv_out, ssm_out

    def step(self, hidden, conv_state, ssm_state):
        h = self._check_hidden(hidden)
        qkv, z, b, a = self._project(h)
        qkv, new_conv = self.ops.causal_conv1d_update(qkv, cast(conv_state, self.dtype), self.conv_w, self.conv_b,
                                                      activation="silu")
        q, k, v, g, beta = self._heads(qkv, b, a)
        o, new_ssm = delta_rule.gated_delta_rule_update(q, k, v, g, beta, cast(ssm_state, self.dtype),
                                                        use_qk_l2norm=True)
        return self._out(o, z), new_conv, new_ssm


register(GDNFamily())
