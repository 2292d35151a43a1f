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
``model_type`` ``qwen3_next`` (parameter names as in transformers' ``linear_attn`` module).

Whole model (Qwen3-Next; decoder layers as ``reference.families._delta`` says): the block norms, the final
norm and the attention's q/k norms scale by (1 + weight) (their weights are stored centred on 0; the
mixer's gated norm is a plain weight). The full-attention layer (H heads, H_kv key/value heads of D)::

    q, gate = split per head(q_proj(h), [D, D])          (q_proj has 2*H*D rows: q and the output gate)
    q, k    = rms_norm(q, 1 + q_norm), rms_norm(k_proj(h), 1 + k_norm)     (per head; eps rms_norm_eps)
    q, k    = rotary(q), rotary(k)    on the first int(D * partial_rotary_factor) channels, rope_theta
    o       = causal_attention(q, k, v_proj(h), scale D ** -0.5)
    out     = o_proj(o * sigmoid(gate))

The MLP is dense (``num_experts`` 0 or the layer in ``mlp_only_layers``) or a mixture of experts
(``reference.families._delta``: softmax router over ``num_experts`` experts of ``moe_intermediate_size``,
``num_experts_per_tok`` per token, renormalised when ``norm_topk_prob``; a shared expert of
``shared_expert_intermediate_size`` scaled by sigmoid(shared_expert_gate(x))). Checkpoint keys of an MoE
layer: ``mlp.gate.weight`` (router), ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
``mlp.shared_expert.{gate,up,down}_proj.weight``, ``mlp.shared_expert_gate.weight``.
This mixer and attention are independent of the engine's (``harness/engine/families/gdn.py``) on purpose:
the oracle shares no code with what it checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import delta_rule
from reference.attention import Attention, rotary
from reference.cache import GDNSpec, KVSpec
from reference.config import (MAX_CHUNK, MAX_INNER, MAX_STATE, ModelConfig, err, get_bool, get_float, get_int,
                              hf_common_dict, short)
from reference.families import common_fields, register
from reference.families._delta import (PROJ, HybridFamily, MoESpec, build_mlp_types, get_intermediate_size,
                                       get_layer_types, hf_delta_common, hf_delta_dict)
from reference.mixers import Mixer, cast, linear
from reference.validate import fail


@dataclass(frozen=True)
class GDNFields:
    """Gated DeltaNet's own config fields (HF: linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim, layer_types) and those of Qwen3-Next's other layers
    (num_attention_heads, num_key_value_heads, head_dim, the rotary channels and theta, attention_bias,
    intermediate_size, and per layer "dense" or "sparse" (MoE) MLPs)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    layer_types: tuple = ()
    attn_heads: int = 16
    attn_kv_heads: int = 2
    attn_head_dim: int = 256
    rotary_dim: int = 64
    rope_theta: float = 10000.0
    attn_bias: bool = False
    intermediate_size: int = 5632
    mlp_layer_types: tuple = ()
    moe: MoESpec | None = None

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


def qwen3_next_rope(raw: dict, where, head_dim: int) -> tuple[int, float]:
    """(rotary channels, theta) of a Qwen3-Next config: ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` / ``partial_rotary_factor``; only the default (unscaled) rotary embedding."""
    rp = raw.get("rope_parameters")
    if rp is None:
        rp = {}
    if not isinstance(rp, dict):
        raise err(where, f"rope_parameters: expected an object, got {short(rp)}")
    scaling = raw.get("rope_scaling")
    kind = rp.get("rope_type", "default")
    if kind != "default" or scaling not in (None, {}):
        raise err(where, f"rope_parameters.rope_type: expected 'default' (no rope scaling), got "
                         f"{short(kind if kind != 'default' else scaling)}")
    src = (lambda k: rp if k in rp else raw)  # noqa: E731
    theta = get_float(src("rope_theta"), "rope_theta", where, 10000.0, hi=1e12)
    factor = get_float(src("partial_rotary_factor"), "partial_rotary_factor", where, 0.25)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2:
        raise err(where, f"partial_rotary_factor: expected an even number of rotary channels of head_dim "
                         f"{head_dim}, got {factor} ({rotary_dim} channels)")
    return rotary_dim, theta


def qwen3_next_mlp_types(raw: dict, where, n_layer: int) -> tuple:
    """Per layer "dense" or "sparse" as transformers builds Qwen3-Next: MoE where num_experts > 0, the layer
    is not in mlp_only_layers and (layer + 1) is a multiple of decoder_sparse_step."""
    experts = get_int(raw, "num_experts", where, 512, lo=0, hi=1 << 20)
    step = get_int(raw, "decoder_sparse_step", where, 1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise err(where, f"mlp_only_layers: expected a list of layer indices, got {short(only)}")
    return tuple("sparse" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense"
                 for i in range(n_layer))


def qwen3_next_moe(raw: dict, where, mlp_types: tuple):
    """The MoESpec of a Qwen3-Next config with MoE layers (None without): num_experts, num_experts_per_tok,
    moe_intermediate_size, shared_expert_intermediate_size, norm_topk_prob (transformers' defaults)."""
    if "sparse" not in mlp_types:
        return None
    experts = get_int(raw, "num_experts", where, 512, hi=1 << 20)
    return MoESpec(num_experts=experts, top_k=get_int(raw, "num_experts_per_tok", where, 10, hi=experts),
                   inter=get_int(raw, "moe_intermediate_size", where, 512, hi=MAX_INNER), router="softmax",
                   norm_topk_prob=get_bool(raw, "norm_topk_prob", where, True),
                   shared_inter=get_int(raw, "shared_expert_intermediate_size", where, 512, hi=MAX_INNER),
                   shared_gate=True)


class GDNFamily(HybridFamily):
    name = "gdn"
    fields = GDNFields
    hf_model_types = ("qwen3_next",)
    hf_architectures = ("Qwen3NextForCausalLM", "Qwen3NextModel")
    hf_tie_default = False
    mixer_parameter_names = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
                             "norm.weight", "out_proj.weight")
    typical_vocab_size = 151936
    build_fields = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    norm_offset = 1.0
    mixer_module = "linear_attn"
    attention_parameter_names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
                                 "k_norm.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")
    ignored_patterns = (r"mtp\.[A-Za-z0-9_.]+",)  # the multi-token-prediction head of the checkpoints

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
        heads = get_int(raw, "num_attention_heads", where, 16)
        kv_heads = get_int(raw, "num_key_value_heads", where, 2)
        if heads % kv_heads:
            raise err(where, f"num_key_value_heads: expected a divisor of num_attention_heads = {heads}, got {kv_heads}")
        head_dim = get_int(raw, "head_dim", where, 256, hi=MAX_STATE)
        rotary_dim, theta = qwen3_next_rope(raw, where, head_dim)
        mlp_types = qwen3_next_mlp_types(raw, where, common["n_layer"])
        fields = GDNFields(num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd, layer_types=layer_types,
                           attn_heads=heads, attn_kv_heads=kv_heads, attn_head_dim=head_dim, rotary_dim=rotary_dim,
                           rope_theta=theta, attn_bias=get_bool(raw, "attention_bias", where, False),
                           intermediate_size=get_intermediate_size(raw, where, 5632),
                           mlp_layer_types=mlp_types, moe=qwen3_next_moe(raw, where, mlp_types))
        return ModelConfig(family=self.name, mixer=fields, chunk_size=chunk_size, **common)

    def from_state_spaces(self, raw, ssm, common, where):
        raise err(where, "ssm_cfg.layer: Gated DeltaNet has no state-spaces config")

    def to_hf(self, cfg) -> dict:
        return dict(model_type=self.hf_model_types[0], architectures=[self.hf_architectures[0]], **hf_common_dict(cfg),
                    **hf_delta_dict(cfg), linear_num_key_heads=cfg.num_k_heads,
                    linear_num_value_heads=cfg.num_v_heads, linear_key_head_dim=cfg.head_k_dim,
                    linear_value_head_dim=cfg.head_v_dim, num_attention_heads=cfg.attn_heads,
                    num_key_value_heads=cfg.attn_kv_heads, head_dim=cfg.attn_head_dim,
                    rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta,
                                         partial_rotary_factor=cfg.rotary_dim / cfg.attn_head_dim),
                    attention_bias=cfg.attn_bias, intermediate_size=cfg.intermediate_size,
                    **self._hf_mlp(cfg))

    @staticmethod
    def _hf_mlp(cfg) -> dict:
        """The MLP keys: num_experts 0 for a dense model; else the MoE fields with the dense layers in
        mlp_only_layers (decoder_sparse_step 1), which gives back cfg.mlp_layer_types."""
        if cfg.moe is None:
            return dict(num_experts=0, mlp_only_layers=[])
        m = cfg.moe
        if m.router != "softmax" or m.scaling != 1.0 or not m.shared_inter or not m.shared_gate:
            fail("cfg.moe", "Qwen3-Next's MoE (softmax router, unscaled, a gated shared expert)", m)
        return dict(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.inter,
                    shared_expert_intermediate_size=m.shared_inter, norm_topk_prob=m.norm_topk_prob,
                    decoder_sparse_step=1, mlp_only_layers=[i for i, t in enumerate(cfg.mlp_layer_types)
                                                            if t == "dense"])

    def moe_names(self, cfg) -> dict:
        if cfg.moe is None:
            return {}
        names = {"mlp.gate.weight": "mlp.router.weight", "mlp.shared_expert_gate.weight": "mlp.shared_gate.weight"}
        names.update({f"mlp.shared_expert.{p}.weight": f"mlp.shared.{p}.weight" for p in PROJ})
        names.update({f"mlp.experts.{e}.{p}.weight": f"mlp.experts.{e}.{p}.weight"
                      for e in range(cfg.moe.num_experts) for p in PROJ})
        return names

    def build_config(self, *, d_model, n_layer, vocab, d_conv=4, expand=2, chunk_size=64, pad_vocab_size_multiple=1,
                     tie_embeddings=False, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                     layer_types=None, attn_heads=16, attn_kv_heads=2, attn_head_dim=256, rotary_dim=64,
                     intermediate_size=None, moe=None, mlp_layer_types=None):
        """Dense MLPs of `intermediate_size` (default 2 * d_model), or with `moe` (a MoESpec) MoE MLPs in the
        layers `mlp_layer_types` says "sparse" (default: all); `layer_types` default: linear attention only."""
        if num_v_heads % num_k_heads:
            fail("num_v_heads", f"a multiple of num_k_heads = {num_k_heads}", num_v_heads)
        common = common_fields(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv,
                               pad_vocab_size_multiple=pad_vocab_size_multiple, tie_embeddings=tie_embeddings,
                               chunk_size=chunk_size, conv_bias=False, norm_eps=1e-6)
        types = tuple(layer_types) if layer_types is not None else ("linear_attention",) * n_layer
        return ModelConfig(family=self.name, mixer=GDNFields(
            num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
            layer_types=types, attn_heads=attn_heads, attn_kv_heads=attn_kv_heads, attn_head_dim=attn_head_dim,
            rotary_dim=rotary_dim, intermediate_size=intermediate_size or 2 * d_model,
            mlp_layer_types=build_mlp_types(n_layer, moe, mlp_layer_types), moe=moe), **common)

    def tiny_config(self, *, d_model=16, n_layer=2, vocab=60, d_state=None, d_conv=4, chunk_size=8):
        """Layers alternate linear and full attention (the last one full when n_layer > 1)."""
        types = tuple("full_attention" if n_layer > 1 and i % 2 else "linear_attention" for i in range(n_layer))
        return self.build_config(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv, chunk_size=chunk_size,
                                 pad_vocab_size_multiple=8, num_k_heads=2, num_v_heads=4, head_k_dim=d_state or 8,
                                 head_v_dim=4, layer_types=types, attn_heads=2, attn_kv_heads=1, attn_head_dim=8,
                                 rotary_dim=4)

    def summary(self, cfg) -> dict:
        return dict(num_k_heads=cfg.num_k_heads, num_v_heads=cfg.num_v_heads, head_k_dim=cfg.head_k_dim,
                    head_v_dim=cfg.head_v_dim, linear_layers=cfg.layer_types.count("linear_attention"),
                    attn_heads=cfg.attn_heads, attn_kv_heads=cfg.attn_kv_heads, attn_head_dim=cfg.attn_head_dim)

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

    # the full-attention layers -------------------------------------------------------------------
    def attention_shapes(self, cfg) -> dict:
        H, Hkv, D, d = cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim, cfg.d_model
        shapes = {"q_proj.weight": (2 * H * D, d), "k_proj.weight": (Hkv * D, d), "v_proj.weight": (Hkv * D, d),
                  "o_proj.weight": (d, H * D), "q_norm.weight": (D,), "k_norm.weight": (D,)}
        if cfg.attn_bias:
            shapes.update({"q_proj.bias": (2 * H * D,), "k_proj.bias": (Hkv * D,), "v_proj.bias": (Hkv * D,),
                           "o_proj.bias": (d,)})
        return shapes

    def kv_spec(self, cfg, dtype):
        return KVSpec(num_kv_heads=cfg.attn_kv_heads, k_head_dim=cfg.attn_head_dim, v_head_dim=cfg.attn_head_dim,
                      dtype=dtype)

    def make_attention(self, cfg, params, *, dtype=torch.float64, ops=None, device=None):
        return GatedAttention(cfg, params, self.attention_shapes(cfg), dtype=dtype, ops=ops, device=device)


class GatedAttention(Attention):
    """Qwen3-Next's full attention: q/k RMSNorms (1 + weight), partial rotary embedding, sigmoid output gate."""

    def __init__(self, cfg, params, shapes, **kw):
        super().__init__(cfg, params, shapes, **kw)
        self.scale = cfg.attn_head_dim ** -0.5
        self.q_norm = 1 + self.p["q_norm.weight"]
        self.k_norm = 1 + self.p["k_norm.weight"]

    def project(self, h, positions):
        cfg, p = self.cfg, self.p
        n, H, Hkv, D = h.shape[0], cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim
        q, gate = torch.split(linear(h, p["q_proj.weight"], p.get("q_proj.bias")).reshape(n, H, 2 * D), [D, D], dim=-1)
        k = linear(h, p["k_proj.weight"], p.get("k_proj.bias")).reshape(n, Hkv, D)
        v = linear(h, p["v_proj.weight"], p.get("v_proj.bias")).reshape(n, Hkv, D)
        q = self.ops.rms_norm(q, self.q_norm, cfg.norm_eps)
        k = self.ops.rms_norm(k, self.k_norm, cfg.norm_eps)
        q = rotary(q, positions, cfg.rotary_dim, cfg.rope_theta)
        k = rotary(k, positions, cfg.rotary_dim, cfg.rope_theta)
        return q, k, v, gate.reshape(n, H * D)

    def output(self, o, gate):
        n = o.shape[0]
        return linear(o.reshape(n, -1) * torch.sigmoid(gate), self.p["o_proj.weight"], self.p.get("o_proj.bias"))


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
