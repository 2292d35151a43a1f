"""Engine mixer of Kimi Delta Attention (family ``kda``, Kimi Linear's linear attention).

==========================  ===================================  =================================
part                        prefill tokens                       decode rows
==========================  ===================================  =================================
conv (q, k, v)              ``causal_conv1d_varlen``             ``causal_conv1d_update``
delta rule                  ``kda_varlen``                       ``kda_update``
output norm                 ``gated_rms_norm`` without a gate (group_size = head_dim), then the sigmoid
                            output gate as an elementwise product
==========================  ===================================  =================================

The q/k/v projections and their three conv weights are fused into one weight each at load. Tensor parallelism is not supported yet
(``check_tp`` refuses tp_size > 1). Written independently of the reference mixer
(``reference/families/kda.py``): the oracle shares no code with what it checks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.engine.families import EngineFamily, EngineMixer, linear, register
from harness.engine.families._delta import delta_step, no_tp

OPS = ("causal_conv1d_varlen", "causal_conv1d_update", "kda_varlen", "kda_update", "gated_rms_norm")


class KDAMixer(EngineMixer):
    def conv_weight(self):
        return torch.cat([self.weight(f"{n}_conv1d.weight")[:, 0, :] for n in "qkv"]).contiguous()

    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        H, D = cfg.num_heads, cfg.head_dim
        self.qkv_w = torch.cat([self.weight(f"{n}_proj.weight") for n in "qkv"]).contiguous()
        self.fa_w, self.fb_w = self.weight("f_a_proj.weight"), self.weight("f_b_proj.weight")
        self.ga_w, self.gb_w = self.weight("g_a_proj.weight"), self.weight("g_b_proj.weight")
        self.b_w = self.weight("b_proj.weight")
        self.A = -torch.exp(self.state_param("A_log").reshape(H, 1))
        self.dt_bias = self.state_param("dt_bias").reshape(H, D)
        self.norm_w = self.weight("o_norm.weight").repeat(H).contiguous()
        self.o_w = self.weight("o_proj.weight")

    def forward(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        T, H, D = h.shape[0], cfg.num_heads, cfg.head_dim
        qkv = self.conv(linear(h, self.qkv_w).contiguous(), md, conv_states)
        q, k, v = (x.reshape(T, H, D).contiguous() for x in torch.split(qkv, [H * D] * 3, dim=-1))
        f = linear(linear(h, self.fa_w), self.fb_w).reshape(T, H, D).to(self._pdt)
        g = (self.A * F.softplus(f + self.dt_bias)).to(self.dtype).contiguous()
        beta = torch.sigmoid(linear(h, self.b_w).to(self._pdt)).to(self.dtype).contiguous()
        o = delta_step(self.ops, "kda_varlen", "kda_update", md, q, k, v, g, beta, ssm_states)
        y = self.ops["gated_rms_norm"](o.reshape(T, H * D).to(self.dtype).contiguous(), self.norm_w, None,
                                       eps=float(cfg.norm_eps), group_size=D)
        gate = torch.sigmoid(linear(linear(h, self.ga_w), self.gb_w))
        return linear(y.to(self.dtype) * gate, self.o_w)


def shard_sections(cfg, p: str):
    """The cut each parameter would take (heads split across ranks); `check_tp` refuses tp_size > 1."""
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


register(EngineFamily("kda", KDAMixer, OPS, no_tp("kda"), shard_sections))
