"""Engine mixer of Kimi Delta Attention (family ``kda``, Kimi Linear's linear attention).

==========================  ===================================  =================================
part                        prefill tokens                       decode rows
==========================  ===================================  =================================
conv (q, k, v)              ``causal_conv1d_varlen``             ``causal_conv1d_update``
delta rule                  ``kda_varlen``                       ``kda_update``
output norm                 ``gated_rms_norm`` without a gate (group_size = head_dim), then the sigmoid
                            output gate as an elementwise product
==========================  ===================================  =================================

The q/k/v projections and their three conv weights are fused into one weight each at load.

Tensor parallelism (as vLLM's Kimi Linear; H heads of Dh, T ranks dividing H): every rank holds H / T heads.
q/k/v_proj, their conv weights, f_b_proj, g_b_proj and dt_bias dim 0 [H*Dh]; b_proj dim 0 [H]; A_log
(1, 1, H, 1) dim 2; the low-rank f_a_proj, g_a_proj and the per-head o_norm weight replicated; o_proj dim 1
[H*Dh] (row parallel, summed over the ranks).

Kimi Linear's full-attention layers (:class:`LatentAttention`): multi-head latent attention without positional
encoding. kv_a_proj_with_mqa gives the latent (normalised by kv_a_layernorm, eps 1e-6, via
``gated_rms_norm``) and the key part shared by every head; kv_b_proj expands the latent into per-head key
and value parts; the expanded keys and values go into the paged KV pool (``paged_attention``).
Under tensor parallelism q_proj and kv_b_proj are cut by heads, the latent projection
(kv_a_proj_with_mqa, its norm) is replicated, o_proj cut by columns (row parallel; its bias added once after
the sum), and each rank's paged KV pool holds the expanded keys and values of its heads.
Written independently of the reference (``reference/families/kda.py``): the oracle shares no code with what
it checks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.engine.families import EngineFamily, EngineMixer, linear, register
from harness.engine.families._delta import AttentionLayer, check_tp as check_hybrid_tp, delta_step
from harness.engine.spec import SpecConvMixin

OPS = ("causal_conv1d_varlen", "causal_conv1d_update", "kda_varlen", "kda_update", "gated_rms_norm")


class KDAMixer(SpecConvMixin, EngineMixer):
    SPEC_OPS = ("causal_conv1d_update_spec", "kda_update_spec")

    def conv_weight(self):
        return torch.cat([self.weight(f"{n}_conv1d.weight")[:, 0, :] for n in "qkv"]).contiguous()

    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        self.H = H = self.local(cfg.num_heads)  # this rank's heads
        D = cfg.head_dim
        self.qkv_w = torch.cat([self.weight(f"{n}_proj.weight") for n in "qkv"]).contiguous()
        self.fa_w, self.fb_w = self.weight("f_a_proj.weight"), self.weight("f_b_proj.weight")
        self.ga_w, self.gb_w = self.weight("g_a_proj.weight"), self.weight("g_b_proj.weight")
        self.b_w = self.weight("b_proj.weight")
        self.A = -torch.exp(self.state_param("A_log").reshape(H, 1))
        self.dt_bias = self.state_param("dt_bias").reshape(H, D)
        self.norm_w = self.weight("o_norm.weight").repeat(H).contiguous()
        self.out_w, self.out_b = self.weight("o_proj.weight"), None

    def forward(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        T, H, D = h.shape[0], self.H, cfg.head_dim
        qkv = self.conv(linear(h, self.qkv_w).contiguous(), md, conv_states)
        q, k, v = (x.reshape(T, H, D) for x in torch.split(qkv, [H * D] * 3, dim=-1))  # views
        # g in float32 (float64 for a float64 engine), as engines keep it; the gate's low-rank output is read as
        # it is by the add (promotion), beta's sigmoid computes in float32 and rounds once (see gdn.py)
        f = linear(linear(h, self.fa_w), self.fb_w).reshape(T, H, D)
        g = self.A * F.softplus(f + self.dt_bias)
        beta = torch.sigmoid(linear(h, self.b_w))
        o = delta_step(self.ops, "kda_varlen", "kda_update", md, q, k, v, g, beta, ssm_states)
        y = self.ops["gated_rms_norm"](o.reshape(T, H * D).to(self.dtype).contiguous(), self.norm_w, None,
                                       eps=float(cfg.norm_eps), group_size=D)
        gate = torch.sigmoid(linear(linear(h, self.ga_w), self.gb_w))
        return self.out_proj(y.to(self.dtype) * gate)


class LatentAttention(AttentionLayer):
    LATENT_EPS = 1e-6  # transformers builds kv_a_layernorm with its default eps, not rms_norm_eps

    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        H = cfg.attn_heads
        self.H = self.local(H)  # this rank's heads
        self.q_w = self.heads("q_proj.weight", H)
        self.a_w, self.a_b = self.weight("kv_a_proj_with_mqa.weight"), self.weight("kv_a_proj_with_mqa.bias")
        self.latent_norm = self.weight("kv_a_layernorm.weight")
        self.b_w = self.heads("kv_b_proj.weight", H)
        self.o_w, self.o_b = self.heads("o_proj.weight", H, dim=1), self.weight("o_proj.bias")

    def forward(self, h, md, kv, layer):
        cfg = self.cfg
        T, H, r = h.shape[0], self.H, cfg.kv_lora_rank
        nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = self.project(h, self.q_w).reshape(T, H, nope + rope)
        a = self.project(h, self.a_w, self.a_b)
        latent = self.head_norm(a[:, None, :r], self.latent_norm, self.LATENT_EPS)[:, 0]
        kvb = self.project(latent, self.b_w).reshape(T, H, nope + vd)
        k = torch.cat([kvb[..., :nope], a[:, None, r:].expand(T, H, rope)], dim=-1)
        o = self.attend(kv, layer, md, q, k, kvb[..., nope:], (nope + rope) ** -0.5)
        return self.out(o.reshape(T, H * vd), self.o_w, self.o_b)


def shard_sections(cfg, p: str):
    """The cut of each mixer parameter (heads split across ranks; see the module doc)."""
    HD, H = cfg.num_heads * cfg.head_dim, cfg.num_heads
    if p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "f_b_proj.weight", "g_b_proj.weight",
             "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias"):
        return 0, ((HD, True),)
    if p == "A_log":
        return 2, ((H, True),)
    if p == "b_proj.weight":
        return 0, ((H, True),)
    if p in ("f_a_proj.weight", "g_a_proj.weight", "o_norm.weight"):
        return None, ()
    if p == "o_proj.weight":
        return 1, ((HD, True),)
    return None


def check_tp(cfg, tp_size: int) -> None:
    """KDA heads, the MLPs (dense ones and every expert of the MoE ones) and, with full-attention layers, the
    attention heads (as many key/value heads as query heads) split evenly."""
    divisible = {"num_heads": cfg.num_heads}
    if "dense" in cfg.mlp_layer_types:
        divisible["intermediate_size"] = cfg.intermediate_size
    if "sparse" in cfg.mlp_layer_types:  # every expert's and the shared expert's channels split
        divisible.update({"moe.inter": cfg.moe.inter, "moe.shared_inter": cfg.moe.shared_inter})
    if "full_attention" in cfg.layer_types:
        divisible["attn_heads"] = cfg.attn_heads
    check_hybrid_tp("kda", tp_size, divisible)


def tp_cases(cfg, tp_size: int):
    """`cfg` with (at least) `tp_size` KDA heads and attention heads; the MLP of every layer after the first a
    mixture of experts (Kimi Linear's: top-2 of 4 in two groups, one eligible, a shared expert; widths
    4 * `tp_size`)."""
    from dataclasses import replace
    from reference.config import MoESpec
    n = max(cfg.num_heads, tp_size) // tp_size * tp_size
    a = max(cfg.attn_heads, tp_size) // tp_size * tp_size
    moe = MoESpec(num_experts=4, top_k=2, inter=4 * tp_size, router="sigmoid", scaling=2.446, n_group=2,
                  topk_group=1, shared_inter=4 * tp_size)
    mlp_types = tuple("dense" if i == 0 else "sparse" for i in range(cfg.n_layer))
    return ((cfg.family, replace(cfg, mixer=replace(cfg.mixer, num_heads=n, attn_heads=a, moe=moe,
                                                    mlp_layer_types=mlp_types))),)


register(EngineFamily("kda", KDAMixer, OPS, check_tp, shard_sections, attention=LatentAttention, tp_cases=tp_cases))
