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
(``check_tp`` refuses tp_size > 1). Written independently of the reference mixer
(``reference/families/gdn.py``): the oracle shares no code with what it checks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.engine.families import EngineFamily, EngineMixer, linear, register
from harness.engine.families._delta import delta_step, no_tp

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


register(EngineFamily("gdn", GDNMixer, OPS, no_tp("gdn"), shard_sections))
