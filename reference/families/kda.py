"""Kimi Delta Attention (family ``kda``), the linear-attention mixer of Kimi Linear.

Reference mixer (as transformers' KimiLinearDeltaAttention; H heads of D for q, k and v)::

    q,k,v  = split(silu(conv1d(cat(q_proj(h), k_proj(h), v_proj(h)))), [H*D] * 3)   (depthwise, no bias)
    g      = -exp(A_log[head]) * softplus(f_b_proj(f_a_proj(h)) + dt_bias)       (T, H, D): per key channel
    beta   = sigmoid(b_proj(h))                                                  (T, H)
    o      = kda(q, k, v, g, beta, use_qk_l2norm=True)                            (reference.delta_rule)
    y      = rms_norm(o per head) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(h)))  (eps rms_norm_eps)
    out    = o_proj(y)

Note the output gate is a sigmoid (Qwen3-Next's is a SiLU). Recurrent state (S, H, D, D), value-major;
conv state (S, 3*H*D, K_conv - 1). Config source: HF ``model_type`` ``kimi_linear`` (the head sizes top-level
or in ``linear_attn_config``); its ``layer_types`` are recorded, only the linear-attention mixer is modelled
(parameter names as in transformers' module, the forget gate's under ``forget_gate.``). This mixer is
independent of the engine's (``harness/engine/families/kda.py``) on purpose.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import delta_rule
from reference.cache import KDASpec
from reference.config import MAX_CHUNK, MAX_CONV, MAX_STATE, ModelConfig, err, get_int, hf_common_dict, short
from reference.families import Family, common_fields, register
from reference.families._delta import get_layer_types, hf_delta_common, hf_delta_dict
from reference.mixers import Mixer, cast, linear


@dataclass(frozen=True)
class KDAFields:
    """KDA's own config fields (HF: linear_num_heads, linear_head_dim, layer_types)."""
    num_heads: int
    head_dim: int
    layer_types: tuple = ()

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v."""
        return 3 * self.qkv_dim


def kimi_layer_types(raw: dict, where, n_layer: int, lac: dict) -> tuple:
    """transformers' default layer types of a Kimi Linear config without `layer_types`: from the
    1-based `kda_layers` / `full_attn_layers` of `linear_attn_config`, else every 4th layer (0-based,
    layer 0 excepted) is full attention."""
    full, lin = lac.get("full_attn_layers"), lac.get("kda_layers")
    if full is None or lin is None:
        return tuple("full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layer))
    types = [None] * n_layer
    for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
        layers = lac[key]
        if not isinstance(layers, list) or any(not isinstance(i, int) or not 1 <= i <= n_layer for i in layers):
            raise err(where, f"linear_attn_config.{key}: expected 1-based layer numbers <= {n_layer}, "
                             f"got {short(layers)}")
        for i in layers:
            types[i - 1] = kind
    if None in types:
        raise err(where, f"linear_attn_config: layer {types.index(None) + 1} is in neither kda_layers nor "
                         "full_attn_layers")
    return tuple(types)


class KDAFamily(Family):
    name = "kda"
    # The mixer is modelled; whole hybrid models (full-attention layers between) are not yet.
    whole_models = False
    fields = KDAFields
    hf_model_types = ("kimi_linear",)
    hf_architectures = ("KimiLinearForCausalLM", "KimiLinearModel")
    hf_tie_default = False
    mixer_parameter_names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "conv1d.weight",
                             "forget_gate.f_a_proj.weight", "forget_gate.f_b_proj.weight", "forget_gate.dt_bias",
                             "forget_gate.A_log", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight",
                             "o_norm.weight", "o_proj.weight")
    typical_vocab_size = 163840
    build_fields = ("num_heads", "kda_head_dim")

    # config ----------------------------------------------------------------------------------
    def from_hf(self, raw, common, where):
        lac = raw.get("linear_attn_config") or {}
        if not isinstance(lac, dict):
            raise err(where, f"linear_attn_config: expected an object, got {short(lac)}")
        common = hf_delta_common(raw, common, where)
        if "short_conv_kernel_size" in lac and raw.get("linear_conv_kernel_dim") is None:
            common["d_conv"] = get_int(lac, "short_conv_kernel_size", where, lo=2, hi=MAX_CONV,
                                       prefix="linear_attn_config.")
        heads = (get_int(lac, "num_heads", where, prefix="linear_attn_config.") if raw.get("linear_num_heads") is None
                 and "num_heads" in lac else get_int(raw, "linear_num_heads", where, 32))
        hd = (get_int(lac, "head_dim", where, hi=MAX_STATE, prefix="linear_attn_config.")
              if raw.get("linear_head_dim") is None and "head_dim" in lac
              else get_int(raw, "linear_head_dim", where, 128, hi=MAX_STATE))
        n = common["n_layer"]
        layer_types = get_layer_types(raw, where, n, kimi_layer_types(raw, where, n, lac))
        chunk_size = get_int(raw, "chunk_size", where, 64, hi=MAX_CHUNK)
        return ModelConfig(family=self.name, mixer=KDAFields(num_heads=heads, head_dim=hd, layer_types=layer_types),
                           chunk_size=chunk_size, **common)

    def from_state_spaces(self, raw, ssm, common, where):
        raise err(where, "ssm_cfg.layer: Kimi Delta Attention has no state-spaces config")

    def to_hf(self, cfg) -> dict:
        return dict(model_type=self.hf_model_types[0], architectures=[self.hf_architectures[0]], **hf_common_dict(cfg),
                    **hf_delta_dict(cfg), linear_num_heads=cfg.num_heads, linear_head_dim=cfg.head_dim)

    def build_config(self, *, d_model, n_layer, vocab, d_conv=4, expand=2, chunk_size=64, pad_vocab_size_multiple=1,
                     tie_embeddings=False, num_heads=32, kda_head_dim=128, layer_types=None):
        """`kda_head_dim` is the head size of q, k and v (the config field `head_dim`)."""
        common = common_fields(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv,
                               pad_vocab_size_multiple=pad_vocab_size_multiple, tie_embeddings=tie_embeddings,
                               chunk_size=chunk_size, conv_bias=False, norm_eps=1e-6)
        types = tuple(layer_types) if layer_types is not None else ("linear_attention",) * n_layer
        return ModelConfig(family=self.name, mixer=KDAFields(num_heads=num_heads, head_dim=kda_head_dim,
                                                             layer_types=types), **common)

    def tiny_config(self, *, d_model=16, n_layer=2, vocab=60, d_state=None, d_conv=4, chunk_size=8):
        return self.build_config(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv, chunk_size=chunk_size,
                                 pad_vocab_size_multiple=8, num_heads=2, kda_head_dim=d_state or 8)

    def summary(self, cfg) -> dict:
        return dict(num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                    linear_layers=cfg.layer_types.count("linear_attention"))

    # parameters and state ----------------------------------------------------------------------
    def parameter_shapes(self, cfg) -> dict:
        H, D, d = cfg.num_heads, cfg.head_dim, cfg.d_model
        HD = H * D
        return {"q_proj.weight": (HD, d), "k_proj.weight": (HD, d), "v_proj.weight": (HD, d),
                "conv1d.weight": (cfg.conv_dim, 1, cfg.d_conv), "forget_gate.f_a_proj.weight": (D, d),
                "forget_gate.f_b_proj.weight": (HD, D), "forget_gate.dt_bias": (HD,),
                "forget_gate.A_log": (1, 1, H, 1), "b_proj.weight": (H, d), "g_a_proj.weight": (D, d),
                "g_b_proj.weight": (HD, D), "o_norm.weight": (D,), "o_proj.weight": (d, HD)}

    def state_spec(self, cfg, *, conv_dtype, recurrent_dtype, tp_size=1):
        return KDASpec(num_heads=cfg.num_heads, head_dim=cfg.head_dim, conv_kernel=cfg.d_conv, tp_size=tp_size,
                       conv_dtype=conv_dtype, recurrent_dtype=recurrent_dtype)

    def make_mixer(self, cfg, params, *, dtype=torch.float64, ops=None, device=None):
        return KDAMixer(cfg, params, dtype=dtype, ops=ops, device=device)


class KDAMixer(Mixer):
    """Kimi Delta Attention mixer: per-channel forget gate, the plain KDA recurrence of
    reference.delta_rule, RMSNorm per head with a sigmoid output gate."""

    def ssm_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.num_heads, self.cfg.head_dim, self.cfg.head_dim)

    def _qkv(self, h):
        p = self.p
        return torch.cat([linear(h, p[f"{n}_proj.weight"], None) for n in "qkv"], dim=-1)

    def _heads(self, h, qkv):
        cfg, p = self.cfg, self.p
        n, H, D = h.shape[0], cfg.num_heads, cfg.head_dim
        q, k, v = (x.reshape(n, H, D) for x in torch.split(qkv, [cfg.qkv_dim] * 3, dim=-1))
        f = linear(linear(h, p["forget_gate.f_a_proj.weight"], None), p["forget_gate.f_b_proj.weight"], None)
        A = -torch.exp(p["forget_gate.A_log"].reshape(H, 1))
        g = A * torch.nn.functional.softplus((f + p["forget_gate.dt_bias"]).reshape(n, H, D))
        beta = torch.sigmoid(linear(h, p["b_proj.weight"], None))
        return q, k, v, g, beta

    def _out(self, h, o):
        cfg, p = self.cfg, self.p
        n = h.shape[0]
        gate = linear(linear(h, p["g_a_proj.weight"], None), p["g_b_proj.weight"], None)
        y = self.ops.rms_norm(o, p["o_norm.weight"], eps=cfg.norm_eps).reshape(n, cfg.qkv_dim)
        return linear(y * torch.sigmoid(gate), p["o_proj.weight"], None)

    def forward(self, hidden, cu_seqlens=None, conv_states_in=None, ssm_states_in=None):
        h = self._check_hidden(hidden)
        qkv, conv_out = self.ops.causal_conv1d(self._qkv(h), self.conv_w, self.conv_b, activation="silu",
                                               cu_seqlens=cu_seqlens, initial_states=cast(conv_states_in, self.dtype))
        q, k, v, g, beta = self._heads(h, qkv)
        o, ssm_out = delta_rule.kda(q, k, v, g, beta, use_qk_l2norm=True, cu_seqlens=cu_seqlens,
                                    initial_states=cast(ssm_states_in, self.dtype))
        return self._out(h, o), conv_out, ssm_out

    def step(self, hidden, conv_state, ssm_state):
        h = self._check_hidden(hidden)
        qkv, new_conv = self.ops.causal_conv1d_update(self._qkv(h), cast(conv_state, self.dtype), self.conv_w,
                                                      self.conv_b, activation="silu")
        q, k, v, g, beta = self._heads(h, qkv)
        o, new_ssm = delta_rule.kda_update(q, k, v, g, beta, cast(ssm_state, self.dtype), use_qk_l2norm=True)
        return self._out(h, o), new_conv, new_ssm


register(KDAFamily())
