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
or in ``linear_attn_config``; parameter names as in the checkpoints: one conv weight per q, k and v
(``q_conv1d`` ...), the forget gate's ``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log`` beside them; transformers'
module concatenates the convs into ``conv1d`` and moves the gate under ``forget_gate.`` at load, and back when
it saves).

Whole model (Kimi Linear; decoder layers as ``reference.families._delta`` says, plain-weight RMSNorms). The
full-attention layer is multi-head latent attention without positional encoding (H heads; query/key heads
of qk_nope_head_dim + qk_rope_head_dim channels, the last qk_rope_head_dim of the key shared by all heads,
no rotary embedding applied; value heads of v_head_dim)::

    q              = q_proj(h)                                      (H heads of nope + rope)
    latent, k_rot  = split(kv_a_proj_with_mqa(h), [kv_lora_rank, qk_rope_head_dim])
    k_nope, v      = split per head(kv_b_proj(rms_norm(latent, kv_a_layernorm, eps 1e-6)), [nope, v_head_dim])
    k              = cat(k_nope, k_rot for every head)
    out            = o_proj(causal_attention(q, k, v, scale (nope + rope) ** -0.5))

``q_lora_rank`` must be null (q_proj unfactored) and num_key_value_heads == num_attention_heads (keys and
values are expanded per head). MLP layers are dense (``mlp_layer_types`` "dense"; default: the first
``first_k_dense_replace`` layers) or mixtures of experts (``reference.families._delta``: a sigmoid router
with ``e_score_correction_bias`` over ``num_experts`` experts of ``moe_intermediate_size`` in
``num_expert_group`` groups, ``topk_group`` of them eligible, ``num_experts_per_token`` chosen per token,
renormalised when ``moe_renormalize``, times ``routed_scaling_factor``; ``num_shared_experts`` *
``moe_intermediate_size`` channels of shared expert, ungated; transformers' own spellings of these keys,
``num_local_experts``, ``n_group`` ..., are read too). Checkpoint keys of an MoE layer (under
``block_sparse_moe.``, or ``mlp.``): ``gate.weight``, ``gate.e_score_correction_bias``,
``experts.{e}.w1.weight`` (gate), ``experts.{e}.w3.weight`` (up), ``experts.{e}.w2.weight`` (down),
``shared_experts.{gate,up,down}_proj.weight``. This mixer and attention are independent of the engine's
(``harness/engine/families/kda.py``) on purpose.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import delta_rule
from reference.attention import Attention
from reference.cache import KDASpec, KVSpec
from reference.config import (MAX_CHUNK, MAX_CONV, MAX_INNER, MAX_STATE, ModelConfig, err, get_bool, get_float,
                              get_int, get_str, hf_common_dict, short)
from reference.families import common_fields, register
from reference.families._delta import (PROJ, HybridFamily, MoESpec, build_mlp_types, get_alias,
                                       get_intermediate_size, get_layer_types, get_mlp_layer_types, hf_delta_common,
                                       hf_delta_dict)
from reference.mixers import Mixer, cast, linear
from reference.validate import fail


@dataclass(frozen=True)
class KDAFields:
    """KDA's own config fields (HF: linear_num_heads, linear_head_dim, layer_types) and those of Kimi
    Linear's other layers (num_attention_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim, attention_bias, intermediate_size, and per layer "dense" or "sparse" (MoE) MLPs; `moe`: the
    MoE layers' MoESpec, None when there are none)."""
    num_heads: int
    head_dim: int
    layer_types: tuple = ()
    attn_heads: int = 32
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attn_bias: bool = False
    intermediate_size: int = 9216
    mlp_layer_types: tuple = ()
    moe: MoESpec | None = None

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


# (checkpoint spelling, transformers' attribute) of Kimi Linear's MoE keys
KIMI_MOE_KEYS = {"experts": ("num_experts", "num_local_experts"),
                 "top_k": ("num_experts_per_token", "num_experts_per_tok"),
                 "shared": ("num_shared_experts", "n_shared_experts"), "norm": ("moe_renormalize", "norm_topk_prob"),
                 "n_group": ("num_expert_group", "n_group")}


def kimi_moe(raw: dict, where, mlp_types: tuple):
    """The MoESpec of a Kimi Linear config with MoE layers (None without); transformers' defaults."""
    if "sparse" not in mlp_types:
        return None
    get_str(raw, "moe_router_activation_func", where, "sigmoid", ("sigmoid",))
    key = {k: get_alias(raw, names) for k, names in KIMI_MOE_KEYS.items()}
    experts = get_int(raw, key["experts"], where, 256, hi=1 << 20)
    n_group = get_int(raw, key["n_group"], where, 1, hi=experts)
    topk_group = get_int(raw, "topk_group", where, 1, hi=n_group)
    if experts % n_group or (n_group > 1 and experts // n_group < 2):
        raise err(where, f"{key['n_group']}: expected a divisor of {key['experts']} = {experts} giving groups of >= 2 "
                         f"experts, got {n_group}")
    eligible = experts if n_group == 1 else topk_group * (experts // n_group)
    inter = get_int(raw, "moe_intermediate_size", where, 1024, hi=MAX_INNER)
    return MoESpec(num_experts=experts, top_k=get_int(raw, key["top_k"], where, 8, hi=eligible), inter=inter,
                   router="sigmoid", norm_topk_prob=get_bool(raw, key["norm"], where, True),
                   scaling=get_float(raw, "routed_scaling_factor", where, 2.446, hi=1e6), n_group=n_group,
                   topk_group=topk_group,
                   shared_inter=get_int(raw, key["shared"], where, 1, lo=0, hi=MAX_INNER) * inter)


class KDAFamily(HybridFamily):
    name = "kda"
    fields = KDAFields
    hf_model_types = ("kimi_linear",)
    hf_architectures = ("KimiLinearForCausalLM", "KimiLinearModel")
    hf_tie_default = False
    mixer_parameter_names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                             "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log",
                             "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight")
    typical_vocab_size = 163840
    build_fields = ("num_heads", "kda_head_dim")
    mixer_module = "self_attn"
    # transformers renames the checkpoints' `block_sparse_moe.` to `mlp.` at load (and back when it saves)
    mlp_modules = ("mlp", "block_sparse_moe")
    attention_parameter_names = ("q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias",
                                 "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "o_proj.bias")

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
        attn_heads = get_int(raw, "num_attention_heads", where, 32)
        kv_heads = get_int(raw, "num_key_value_heads", where, attn_heads)
        if kv_heads != attn_heads:
            raise err(where, f"num_key_value_heads: expected num_attention_heads = {attn_heads} (latent attention "
                             f"expands keys and values per head), got {kv_heads}")
        if raw.get("q_lora_rank") is not None:
            raise err(where, f"q_lora_rank: expected null (a factored query projection is not modelled), got "
                             f"{short(raw['q_lora_rank'])}")
        dense = get_int(raw, "first_k_dense_replace", where, 1, lo=0, hi=n)
        mlp_types = get_mlp_layer_types(raw, where, n, ("dense" if i < dense else "sparse" for i in range(n)))
        fields = KDAFields(
            num_heads=heads, head_dim=hd, layer_types=layer_types, attn_heads=attn_heads,
            kv_lora_rank=get_int(raw, "kv_lora_rank", where, 512, hi=MAX_STATE),
            qk_nope_head_dim=get_int(raw, "qk_nope_head_dim", where, 128, hi=MAX_STATE),
            qk_rope_head_dim=get_int(raw, "qk_rope_head_dim", where, 64, hi=MAX_STATE),
            v_head_dim=get_int(raw, "v_head_dim", where, 128, hi=MAX_STATE),
            attn_bias=get_bool(raw, "attention_bias", where, False),
            intermediate_size=get_intermediate_size(raw, where, 9216),
            mlp_layer_types=mlp_types, moe=kimi_moe(raw, where, mlp_types))
        return ModelConfig(family=self.name, mixer=fields, chunk_size=chunk_size, **common)

    def from_state_spaces(self, raw, ssm, common, where):
        raise err(where, "ssm_cfg.layer: Kimi Delta Attention has no state-spaces config")

    def to_hf(self, cfg) -> dict:
        return dict(model_type=self.hf_model_types[0], architectures=[self.hf_architectures[0]], **hf_common_dict(cfg),
                    **hf_delta_dict(cfg), linear_num_heads=cfg.num_heads, linear_head_dim=cfg.head_dim,
                    num_attention_heads=cfg.attn_heads, num_key_value_heads=cfg.attn_heads,
                    kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                    qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=None,
                    attention_bias=cfg.attn_bias, intermediate_size=cfg.intermediate_size,
                    mlp_layer_types=list(cfg.mlp_layer_types), **self._hf_moe(cfg))

    @staticmethod
    def _hf_moe(cfg) -> dict:
        m = cfg.moe
        if m is None:
            return {}
        if m.router != "sigmoid" or m.shared_gate or m.shared_inter % m.inter:
            fail("cfg.moe", "Kimi Linear's MoE (sigmoid router, ungated shared experts of moe_intermediate_size "
                            "each)", m)
        return dict(num_experts=m.num_experts, num_experts_per_token=m.top_k, moe_intermediate_size=m.inter,
                    num_shared_experts=m.shared_inter // m.inter, moe_renormalize=m.norm_topk_prob,
                    routed_scaling_factor=m.scaling, num_expert_group=m.n_group, topk_group=m.topk_group,
                    moe_router_activation_func="sigmoid")

    def moe_names(self, cfg) -> dict:
        if cfg.moe is None:
            return {}
        names = {}
        for m in self.mlp_modules:
            names.update({f"{m}.gate.weight": "mlp.router.weight",
                          f"{m}.gate.e_score_correction_bias": "mlp.router.bias"})
            names.update({f"{m}.shared_experts.{p}.weight": f"mlp.shared.{p}.weight" for p in PROJ})
            for e in range(cfg.moe.num_experts):
                names.update({f"{m}.experts.{e}.{w}.weight": f"mlp.experts.{e}.{p}.weight"
                              for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))})
        return names

    def build_config(self, *, d_model, n_layer, vocab, d_conv=4, expand=2, chunk_size=64, pad_vocab_size_multiple=1,
                     tie_embeddings=False, num_heads=32, kda_head_dim=128, layer_types=None, attn_heads=32,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     intermediate_size=None, moe=None, mlp_layer_types=None):
        """`kda_head_dim` is the head size of q, k and v (the config field `head_dim`). Dense MLPs of
        `intermediate_size` (default 2 * d_model), or with `moe` (a MoESpec) MoE MLPs in the layers
        `mlp_layer_types` says "sparse" (default: all); `layer_types` default: linear attention only."""
        common = common_fields(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv,
                               pad_vocab_size_multiple=pad_vocab_size_multiple, tie_embeddings=tie_embeddings,
                               chunk_size=chunk_size, conv_bias=False, norm_eps=1e-6)
        types = tuple(layer_types) if layer_types is not None else ("linear_attention",) * n_layer
        return ModelConfig(family=self.name, mixer=KDAFields(
            num_heads=num_heads, head_dim=kda_head_dim, layer_types=types, attn_heads=attn_heads,
            kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim, intermediate_size=intermediate_size or 2 * d_model,
            mlp_layer_types=build_mlp_types(n_layer, moe, mlp_layer_types), moe=moe), **common)

    def tiny_config(self, *, d_model=16, n_layer=2, vocab=60, d_state=None, d_conv=4, chunk_size=8):
        """Layers alternate linear and full attention (the last one full when n_layer > 1)."""
        types = tuple("full_attention" if n_layer > 1 and i % 2 else "linear_attention" for i in range(n_layer))
        return self.build_config(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv, chunk_size=chunk_size,
                                 pad_vocab_size_multiple=8, num_heads=2, kda_head_dim=d_state or 8, layer_types=types,
                                 attn_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)

    def summary(self, cfg) -> dict:
        return dict(num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                    linear_layers=cfg.layer_types.count("linear_attention"), attn_heads=cfg.attn_heads,
                    kv_lora_rank=cfg.kv_lora_rank)

    # parameters and state ----------------------------------------------------------------------
    def parameter_shapes(self, cfg) -> dict:
        H, D, d = cfg.num_heads, cfg.head_dim, cfg.d_model
        HD = H * D
        return {"q_proj.weight": (HD, d), "k_proj.weight": (HD, d), "v_proj.weight": (HD, d),
                "q_conv1d.weight": (HD, 1, cfg.d_conv), "k_conv1d.weight": (HD, 1, cfg.d_conv),
                "v_conv1d.weight": (HD, 1, cfg.d_conv), "f_a_proj.weight": (D, d), "f_b_proj.weight": (HD, D),
                "dt_bias": (HD,), "A_log": (1, 1, H, 1), "b_proj.weight": (H, d), "g_a_proj.weight": (D, d),
                "g_b_proj.weight": (HD, D), "o_norm.weight": (D,), "o_proj.weight": (d, HD)}

    def state_spec(self, cfg, *, conv_dtype, recurrent_dtype, tp_size=1):
        return KDASpec(num_heads=cfg.num_heads, head_dim=cfg.head_dim, conv_kernel=cfg.d_conv, tp_size=tp_size,
                       conv_dtype=conv_dtype, recurrent_dtype=recurrent_dtype)

    def make_mixer(self, cfg, params, *, dtype=torch.float64, ops=None, device=None):
        return KDAMixer(cfg, params, dtype=dtype, ops=ops, device=device)

    # the full-attention layers -------------------------------------------------------------------
    def attention_shapes(self, cfg) -> dict:
        H, d, r = cfg.attn_heads, cfg.d_model, cfg.kv_lora_rank
        nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        shapes = {"q_proj.weight": (H * (nope + rope), d), "kv_a_proj_with_mqa.weight": (r + rope, d),
                  "kv_a_layernorm.weight": (r,), "kv_b_proj.weight": (H * (nope + vd), r), "o_proj.weight": (d, H * vd)}
        if cfg.attn_bias:
            shapes.update({"kv_a_proj_with_mqa.bias": (r + rope,), "o_proj.bias": (d,)})
        return shapes

    def kv_spec(self, cfg, dtype):
        return KVSpec(num_kv_heads=cfg.attn_heads, k_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                      v_head_dim=cfg.v_head_dim, dtype=dtype)

    def make_attention(self, cfg, params, *, dtype=torch.float64, ops=None, device=None):
        return LatentAttention(cfg, params, self.attention_shapes(cfg), dtype=dtype, ops=ops, device=device)


LATENT_NORM_EPS = 1e-6  # kv_a_layernorm's eps: transformers builds it with the default, not rms_norm_eps


class LatentAttention(Attention):
    """Kimi Linear's multi-head latent attention without positional encoding (see the module doc)."""

    def __init__(self, cfg, params, shapes, **kw):
        super().__init__(cfg, params, shapes, **kw)
        self.scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5

    def project(self, h, positions):
        cfg, p = self.cfg, self.p
        n, H, nope, rope = h.shape[0], cfg.attn_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = linear(h, p["q_proj.weight"], None).reshape(n, H, nope + rope)
        latent, k_rot = torch.split(linear(h, p["kv_a_proj_with_mqa.weight"], p.get("kv_a_proj_with_mqa.bias")),
                                    [cfg.kv_lora_rank, rope], dim=-1)
        latent = self.ops.rms_norm(latent, p["kv_a_layernorm.weight"], LATENT_NORM_EPS)
        k_nope, v = torch.split(linear(latent, p["kv_b_proj.weight"], None).reshape(n, H, nope + cfg.v_head_dim),
                                [nope, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(n, H, rope)], dim=-1)
        return q, k, v, None

    def output(self, o, extra):
        return linear(o.reshape(o.shape[0], -1), self.p["o_proj.weight"], self.p.get("o_proj.bias"))


class KDAMixer(Mixer):
    """Kimi Delta Attention mixer: per-channel forget gate, the plain KDA recurrence of
    reference.delta_rule, RMSNorm per head with a sigmoid output gate."""

    def conv_weight(self):
        return torch.cat([self.p[f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"])

    def ssm_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.num_heads, self.cfg.head_dim, self.cfg.head_dim)

    def _qkv(self, h):
        p = self.p
        return torch.cat([linear(h, p[f"{n}_proj.weight"], None) for n in "qkv"], dim=-1)

    def _heads(self, h, qkv):
        cfg, p = self.cfg, self.p
        n, H, D = h.shape[0], cfg.num_heads, cfg.head_dim
        q, k, v = (x.reshape(n, H, D) for x in torch.split(qkv, [cfg.qkv_dim] * 3, dim=-1))
        f = linear(linear(h, p["f_a_proj.weight"], None), p["f_b_proj.weight"], None)
        A = -torch.exp(p["A_log"].reshape(H, 1))
        g = A * torch.nn.functional.softplus((f + p["dt_bias"]).reshape(n, H, D))
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
