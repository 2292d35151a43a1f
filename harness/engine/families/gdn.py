"""Engine mixer of Gated DeltaNet (family ``gdn``, Qwen3-Next's linear attention).

==========================  ===================================  =================================
part                        prefill tokens                       decode rows
==========================  ===================================  =================================
conv (q, k, v)              ``causal_conv1d_varlen``             ``causal_conv1d_update``
delta rule                  ``gated_delta_rule_varlen``          ``gated_delta_rule_update``
gated norm                  ``gated_rms_norm`` (group_size = head_v_dim, norm before the SiLU gate)
==========================  ===================================  =================================

The checkpoint's head-interleaved ``in_proj_qkvz`` (per key head: q, k, its value heads' v, z) and
``in_proj_ba`` (per key head: b, a) are permuted once at load into contiguous [q | k | v | z] and
[b | a] row blocks, so a step needs no per-token reshuffle.

Tensor parallelism (as vLLM's and SGLang's Qwen3-Next; Hk key heads, Hv = r * Hk value heads, T ranks,
T dividing Hk): every rank holds Hk / T key heads and their Hv / T value heads. Because the checkpoint
interleaves per key head, ``in_proj_qkvz`` and ``in_proj_ba`` are cut as ONE contiguous row section each
(rank t: the key-head groups t*Hk/T ..), and the rank permutes its own groups into [q | k | v | z] and
[b | a]; cutting them as q, k, v, z sections would mix up heads. conv1d dim 0 [q: Hk*K, k: Hk*K, v: Hv*V]
(the spec's conv segments); dt_bias, A_log dim 0 [Hv]; norm.weight (one head's) replicated; out_proj dim 1
[Hv*V] (row parallel, summed over the ranks).

Qwen3-Next's full-attention layers (:class:`GatedAttention`): q_proj gives per head the query and the output
gate; q and k go through per-head RMSNorms (weights 1 + stored weight, as the block norms:
``norm_offset`` 1) via ``gated_rms_norm``, then the rotary embedding on the first ``rotary_dim`` channels of
each head; ``paged_attention`` over the paged KV pool; the output times sigmoid(gate) through o_proj.
Under tensor parallelism q_proj's rows are cut by query heads (each head's query and gate together), k_proj
and v_proj (and their biases) by key/value heads, replicated when there are fewer than the ranks (rank t:
head t * H_kv // T, the one its query heads read), o_proj by columns (row parallel; its bias added once
after the sum); the q/k norm weights (one head's) are replicated.
Written independently of the reference (``reference/families/gdn.py``): the oracle shares no code with what
it checks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.engine.families import EngineFamily, EngineMixer, linear, register
from harness.engine.families._delta import AttentionLayer, check_tp as check_hybrid_tp, delta_step
from harness.engine.spec import SpecConvMixin

OPS = ("causal_conv1d_varlen", "causal_conv1d_update", "gated_delta_rule_varlen", "gated_delta_rule_update",
       "gated_rms_norm")


def _block_rows(groups: int, sizes: list[int]) -> list[torch.Tensor]:
    """Row indices of each part of a weight laid out as `groups` repeats of parts of `sizes` rows:
    part i's rows of every group, group-major."""
    width = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [torch.cat([torch.arange(s, s + n) + j * width for j in range(groups)]) for s, n in zip(starts, sizes)]


class GDNMixer(SpecConvMixin, EngineMixer):
    SPEC_OPS = ("causal_conv1d_update_spec", "gated_delta_rule_update_spec")

    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        # this rank's heads (all of them with one rank)
        self.Hk, self.Hv = self.local(cfg.num_k_heads), self.local(cfg.num_v_heads)
        K, V = cfg.head_k_dim, cfg.head_v_dim
        r = cfg.num_v_heads // cfg.num_k_heads
        qkvz = self.weight("in_proj_qkvz.weight")
        self.qkvz_w = qkvz[torch.cat(_block_rows(self.Hk, [K, K, r * V, r * V])).to(qkvz.device)].contiguous()
        ba = self.weight("in_proj_ba.weight")
        self.ba_w = ba[torch.cat(_block_rows(self.Hk, [r, r])).to(ba.device)].contiguous()
        self.A = -torch.exp(self.state_param("A_log"))
        self.dt_bias = self.state_param("dt_bias")
        self.norm_w = self.weight("norm.weight").repeat(self.Hv).contiguous()

    def forward(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        T = h.shape[0]
        Hk, Hv, K, V = self.Hk, self.Hv, cfg.head_k_dim, cfg.head_v_dim
        qkv, z = torch.split(linear(h, self.qkvz_w), [2 * Hk * K + Hv * V, Hv * V], dim=-1)
        b, a = torch.split(linear(h, self.ba_w), [Hv, Hv], dim=-1)
        qkv = self.conv(qkv, md, conv_states)  # qkv, z, then q, k, v: views (the ops take strided inputs)
        q, k, v = torch.split(qkv, [Hk * K, Hk * K, Hv * V], dim=-1)
        # g in float32 (float64 for a float64 engine), as engines keep it (the ops take it so); a + dt_bias reads
        # a as it is (promotion: the sums of casting it first, without the cast's launch); sigmoid in the
        # activation dtype computes in float32 and rounds once, as a cast of the float32 sigmoid would
        g = self.A * F.softplus(a + self.dt_bias)
        beta = torch.sigmoid(b)
        o = delta_step(self.ops, "gated_delta_rule_varlen", "gated_delta_rule_update", md,
                       q.reshape(T, Hk, K), k.reshape(T, Hk, K), v.reshape(T, Hv, V), g, beta, ssm_states)
        y = self.ops["gated_rms_norm"](o.reshape(T, Hv * V).to(self.dtype).contiguous(), self.norm_w,
                                       z, eps=float(cfg.norm_eps), group_size=V, norm_before_gate=True)
        return self.out_proj(y)


class GatedAttention(AttentionLayer):
    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        H, Hkv = cfg.attn_heads, cfg.attn_kv_heads
        self.H, self.Hkv = self.local(H), self.local(Hkv, kv=True)  # this rank's heads
        self.q_w, self.q_b = self.heads("q_proj.weight", H), self.heads("q_proj.bias", H)
        self.k_w, self.k_b = self.heads("k_proj.weight", Hkv, kv=True), self.heads("k_proj.bias", Hkv, kv=True)
        self.v_w, self.v_b = self.heads("v_proj.weight", Hkv, kv=True), self.heads("v_proj.bias", Hkv, kv=True)
        self.o_w, self.o_b = self.heads("o_proj.weight", H, dim=1), self.weight("o_proj.bias")
        self.q_norm = (1 + self.weight("q_norm.weight")).repeat(self.H).contiguous()
        self.k_norm = (1 + self.weight("k_norm.weight")).repeat(self.Hkv).contiguous()
        rd = cfg.rotary_dim
        pdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=pdt, device=self.device) / rd))

    def rope(self, x, pos):
        """Rotary embedding on the first rotary_dim channels of x (T, heads, D): pairs (i, i + rotary_dim / 2)."""
        half = self.inv_freq.numel()
        if half == 0:
            return x
        ang = pos.to(self.inv_freq.dtype)[:, None, None] * self.inv_freq  # (T, 1, half)
        cos, sin = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[..., :half].to(ang.dtype), x[..., half:2 * half].to(ang.dtype)
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([rot, x[..., 2 * half:]], dim=-1)

    def forward(self, h, md, kv, layer):
        cfg = self.cfg
        T, H, Hkv, D = h.shape[0], self.H, self.Hkv, cfg.attn_head_dim
        qg = self.project(h, self.q_w, self.q_b).reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        q = self.head_norm(q, self.q_norm, cfg.norm_eps)
        k = self.head_norm(self.project(h, self.k_w, self.k_b).reshape(T, Hkv, D), self.k_norm, cfg.norm_eps)
        v = self.project(h, self.v_w, self.v_b).reshape(T, Hkv, D)
        pos = self.positions(md)
        o = self.attend(kv, layer, md, self.rope(q, pos), self.rope(k, pos), v, D ** -0.5)
        return self.out(o.reshape(T, H * D) * torch.sigmoid(gate), self.o_w, self.o_b)


def shard_sections(cfg, p: str):
    """The cut of each mixer parameter (heads split across ranks; see the module doc)."""
    Hv = cfg.num_v_heads
    if p == "in_proj_qkvz.weight":  # per key head [q, k, v, z]: whole key-head groups per rank
        return 0, ((2 * cfg.key_dim + 2 * cfg.value_dim, True),)
    if p == "in_proj_ba.weight":  # per key head [b, a]
        return 0, ((2 * Hv, True),)
    if p == "conv1d.weight":
        return 0, ((cfg.key_dim, True), (cfg.key_dim, True), (cfg.value_dim, True))
    if p in ("dt_bias", "A_log"):
        return 0, ((Hv, True),)
    if p == "norm.weight":
        return None, ()
    if p == "out_proj.weight":
        return 1, ((cfg.value_dim, True),)
    return None


def check_tp(cfg, tp_size: int) -> None:
    """Key heads (and so value heads), the MLPs (dense ones and every expert of the MoE ones) and, with
    full-attention layers, query heads split evenly; key/value heads split or replicated."""
    divisible = {"num_k_heads": cfg.num_k_heads}
    if "dense" in cfg.mlp_layer_types:
        divisible["intermediate_size"] = cfg.intermediate_size
    if "sparse" in cfg.mlp_layer_types:  # every expert's and the shared expert's channels split
        divisible.update({"moe.inter": cfg.moe.inter, "moe.shared_inter": cfg.moe.shared_inter})
    attention = "full_attention" in cfg.layer_types
    if attention:
        divisible["attn_heads"] = cfg.attn_heads
    check_hybrid_tp("gdn", tp_size, divisible, cfg.attn_kv_heads if attention else None)


def tp_cases(cfg, tp_size: int):
    """`cfg` with `tp_size` key heads (two value heads each) and 2 * `tp_size` query heads, over ONE key/value
    head (replicated on every rank), over `tp_size` key/value heads (split) and, where it differs from both
    and `tp_size` allows it, over two (each replicated on half the ranks); the MLP of every layer after the
    first a mixture of experts (Qwen3-Next's: top-2 of 4, a gated shared expert; widths 4 * `tp_size`)."""
    from dataclasses import replace
    from reference.config import MoESpec
    T = tp_size
    moe = MoESpec(num_experts=4, top_k=2, inter=4 * T, shared_inter=4 * T, shared_gate=True)
    mlp_types = tuple("dense" if i == 0 else "sparse" for i in range(cfg.n_layer))
    return tuple((f"{cfg.family}-kv{g}", replace(cfg, mixer=replace(cfg.mixer, num_k_heads=T, num_v_heads=2 * T,
                                                                    attn_heads=2 * T, attn_kv_heads=g, moe=moe,
                                                                    mlp_layer_types=mlp_types)))
                 for g in dict.fromkeys((1, T, 2)) if T % g == 0)


register(EngineFamily("gdn", GDNMixer, OPS, check_tp, shard_sections, attention=GatedAttention, norm_offset=1.0,
                      tp_cases=tp_cases))
