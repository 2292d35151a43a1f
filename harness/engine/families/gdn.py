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
[b | a] row blocks, so a step needs no per-token reshuffle. Tensor parallelism is not supported yet
(``check_tp`` refuses tp_size > 1).

Qwen3-Next's full-attention layers (:class:`GatedAttention`): q_proj gives per head the query and the output
gate; q and k go through per-head RMSNorms (weights 1 + stored weight, as the block norms:
``norm_offset`` 1) via ``gated_rms_norm``, then the rotary embedding on the first ``rotary_dim`` channels of
each head; ``paged_attention`` over the paged KV pool; the output times sigmoid(gate) through o_proj.
Written independently of the reference (``reference/families/gdn.py``): the oracle shares no code with what
it checks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.engine.families import EngineFamily, EngineMixer, linear, register
from harness.engine.families._delta import AttentionLayer, delta_step, no_tp

OPS = ("causal_conv1d_varlen", "causal_conv1d_update", "gated_delta_rule_varlen", "gated_delta_rule_update",
       "gated_rms_norm")


def _block_rows(groups: int, sizes: list[int]) -> list[torch.Tensor]:
    """Row indices of each part of a weight laid out as `groups` repeats of parts of `sizes` rows:
    part i's rows of every group, group-major."""
    width = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [torch.cat([torch.arange(s, s + n) + j * width for j in range(groups)]) for s, n in zip(starts, sizes)]


class GDNMixer(EngineMixer):
    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        Hk, K, V = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
        r = cfg.num_v_heads // Hk
        qkvz = self.weight("in_proj_qkvz.weight")
        self.qkvz_w = qkvz[torch.cat(_block_rows(Hk, [K, K, r * V, r * V])).to(qkvz.device)].contiguous()
        ba = self.weight("in_proj_ba.weight")
        self.ba_w = ba[torch.cat(_block_rows(Hk, [r, r])).to(ba.device)].contiguous()
        self.A = -torch.exp(self.state_param("A_log"))
        self.dt_bias = self.state_param("dt_bias")
        self.norm_w = self.weight("norm.weight").repeat(cfg.num_v_heads).contiguous()

    def forward(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        T = h.shape[0]
        Hk, Hv, K, V = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        qkv, z = torch.split(linear(h, self.qkvz_w), [cfg.conv_dim, cfg.value_dim], dim=-1)
        b, a = torch.split(linear(h, self.ba_w), [Hv, Hv], dim=-1)
        qkv = self.conv(qkv.contiguous(), md, conv_states)
        q, k, v = torch.split(qkv, [Hk * K, Hk * K, Hv * V], dim=-1)
        g = (self.A * F.softplus(a.to(self._pdt) + self.dt_bias)).to(self.dtype).contiguous()
        beta = torch.sigmoid(b.to(self._pdt)).to(self.dtype).contiguous()
        o = delta_step(self.ops, "gated_delta_rule_varlen", "gated_delta_rule_update", md,
                       q.reshape(T, Hk, K).contiguous(), k.reshape(T, Hk, K).contiguous(),
                       v.reshape(T, Hv, V).contiguous(), g, beta, ssm_states)
        y = self.ops["gated_rms_norm"](o.reshape(T, Hv * V).to(self.dtype).contiguous(), self.norm_w,
                                       z.contiguous(), eps=float(cfg.norm_eps), group_size=V, norm_before_gate=True)
        return linear(y.to(self.dtype), self.out_w)


class GatedAttention(AttentionLayer):
    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        H, Hkv = cfg.attn_heads, cfg.attn_kv_heads
        self.q_w, self.q_b = self.weight("q_proj.weight"), self.weight("q_proj.bias")
        self.k_w, self.k_b = self.weight("k_proj.weight"), self.weight("k_proj.bias")
        self.v_w, self.v_b = self.weight("v_proj.weight"), self.weight("v_proj.bias")
        self.o_w, self.o_b = self.weight("o_proj.weight"), self.weight("o_proj.bias")
        self.q_norm = (1 + self.weight("q_norm.weight")).repeat(H).contiguous()
        self.k_norm = (1 + self.weight("k_norm.weight")).repeat(Hkv).contiguous()
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
        T, H, Hkv, D = h.shape[0], cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim
        qg = self.project(h, self.q_w, self.q_b).reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        q = self.head_norm(q, self.q_norm, cfg.norm_eps)
        k = self.head_norm(self.project(h, self.k_w, self.k_b).reshape(T, Hkv, D), self.k_norm, cfg.norm_eps)
        v = self.project(h, self.v_w, self.v_b).reshape(T, Hkv, D)
        pos = self.positions(md)
        o = self.attend(kv, layer, md, self.rope(q, pos), self.rope(k, pos), v, D ** -0.5)
        return self.project(o.reshape(T, H * D) * torch.sigmoid(gate), self.o_w, self.o_b)


def shard_sections(cfg, p: str):
    """The cut each parameter would take (heads split across ranks); `check_tp` refuses tp_size > 1
    until the loader permutes the head-interleaved projections per rank."""
    Hv = cfg.num_v_heads
    if p == "in_proj_qkvz.weight":
        return 0, ((2 * cfg.key_dim + 2 * cfg.value_dim, True),)
    if p == "in_proj_ba.weight":
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


register(EngineFamily("gdn", GDNMixer, OPS, no_tp("gdn"), shard_sections, attention=GatedAttention, norm_offset=1.0))
