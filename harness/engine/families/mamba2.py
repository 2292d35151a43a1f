"""Engine mixer of Mamba-2 (family ``mamba2``).

==========================  ===================================  =================================
part                        prefill tokens                       decode rows
==========================  ===================================  =================================
conv (x, B, C)              ``causal_conv1d_varlen``             ``causal_conv1d_update``
SSD                         ``ssd_varlen``                       ``selective_state_update`` (4-D)
gated norm                  ``gated_rms_norm`` (group_size = d_inner / n_groups, norm_before_gate)
==========================  ===================================  =================================

Speculative decode rows (``harness.engine.spec``): ``causal_conv1d_update_spec`` and
``selective_state_update_spec`` (4-D) in place of the decode rows' ops.

Tensor parallelism (as vLLM's MambaMixer2; heads H, groups G; G % T == 0 shards groups, G == 1
replicates B/C on every rank): in_proj dim 0 [z: Di, x: Di, B: G*N, C: G*N, dt: H]; conv1d dim 0
[x: Di, B: G*N, C: G*N]; dt_bias, A_log, D dim 0 [H]; norm.weight dim 0 [Di]; out_proj dim 1 [Di] (row
parallel). With G == 1 and T > 1 the gated norm's one group spans the ranks: its sum of squares is summed
over the ranks (in torch, as vLLM's Mixer2RMSNormGated does under TP); otherwise every group lies on one
rank and ``gated_rms_norm`` runs per rank.
Written independently of the reference mixer (``reference/families/mamba2.py``): the oracle shares no
code with what it checks.
"""
from __future__ import annotations

import torch

from harness.engine.families import EngineFamily, EngineMixer, cast, decode_rows, linear, prefill_rows, register
from harness.engine.spec import SpecDecodeMixin

OPS = ("causal_conv1d_varlen", "causal_conv1d_update", "ssd_varlen", "selective_state_update", "gated_rms_norm")


class Mamba2Mixer(SpecDecodeMixin, EngineMixer):
    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        self.A = -torch.exp(self.state_param("A_log"))
        self.D = self.state_param("D")
        self.dt_bias = self.state_param("dt_bias")
        self.norm_w = self.weight("norm.weight")
        cfg = self.cfg
        # per-rank sizes: heads and channels split; groups split, or the one group replicated
        self.d_inner, self.num_heads = self.local(cfg.d_inner), self.local(cfg.num_heads)
        self.n_groups = 1 if cfg.n_groups == 1 else self.local(cfg.n_groups)

    def forward(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        Di, G, N, H, Pd = self.d_inner, self.n_groups, cfg.d_state, self.num_heads, cfg.head_dim
        T = h.shape[0]
        P = md.num_prefill_tokens
        zxbcdt = linear(h, self.in_w, self.in_b)
        z, xBC, dt = torch.split(zxbcdt, [Di, Di + 2 * G * N, H], dim=-1)
        xBC = self.conv(xBC, md, conv_states)  # z, xBC, dt, then x, B, C: views (the ops take strided inputs)
        x, B, C = torch.split(xBC, [Di, G * N, G * N], dim=-1)
        x, B, C = x.reshape(T, H, Pd), B.reshape(T, G, N), C.reshape(T, G, N)
        lim = tuple(float(v) for v in cfg.time_step_limit)
        ys = []
        if md.num_prefills:
            xp, dtp, Bp, Cp = (prefill_rows(t, P) for t in (x, dt, B, C))
            ys.append(self.ops["ssd_varlen"](
                xp, dtp, self.A, Bp, Cp, self.chunk_size, self.D, None, self.dt_bias, ssm_states,
                md.prefill_query_start_loc, md.prefill_state_indices, md.prefill_has_initial_states,
                dt_softplus=True, dt_limit=lim))
        if md.num_decodes:
            xd, dtd, Bd, Cd = (decode_rows(t, P) for t in (x, dt, B, C))
            ys.append(self.state_update(md, ssm_states, xd, dtd, self.A, Bd, Cd, self.D, None, self.dt_bias,
                                        dt_softplus=True, dt_limit=lim))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        y = cast(y.reshape(T, Di), self.dtype)  # (T, H, P) rows: contiguous
        if self.tp.size > 1 and cfg.n_groups == 1:
            y = self.gated_norm_across_ranks(y, z)
        else:
            y = self.ops["gated_rms_norm"](y, self.norm_w, z, eps=float(cfg.mixer_norm_eps), group_size=Di // G,
                                           norm_before_gate=bool(cfg.norm_before_gate))
        return self.out_proj(y)

    def gated_norm_across_ranks(self, y, z):
        """The gated RMSNorm of one group split over the ranks: each rank's sum of squares (in float32,
        float64 for a float64 engine) summed over the ranks, divided by the whole d_inner."""
        cfg = self.cfg
        ct = self._pdt
        y, z = y.to(ct), z.to(ct)
        gate = z * torch.sigmoid(z)
        if not cfg.norm_before_gate:
            y = y * gate
        ss = self.tp.all_reduce(y.square().sum(-1, keepdim=True))
        out = y * torch.rsqrt(ss / cfg.d_inner + float(cfg.mixer_norm_eps)) * self.norm_w.to(ct)
        if cfg.norm_before_gate:
            out = out * gate
        return out.to(self.dtype)


def check_tp(cfg, tp_size: int) -> None:
    if cfg.num_heads % tp_size:
        raise ValueError(f"tp_size: expected a divisor of num_heads = {cfg.num_heads}, got {tp_size}")
    if cfg.n_groups % tp_size and cfg.n_groups != 1:
        raise ValueError(f"tp_size: expected a divisor of n_groups = {cfg.n_groups} (or n_groups == 1), "
                         f"got {tp_size}")


def shard_sections(cfg, p: str):
    Di, H = cfg.d_inner, cfg.num_heads
    GN = cfg.n_groups * cfg.d_state
    g_sharded = cfg.n_groups > 1  # n_groups == 1: B and C replicated on every rank
    if p in ("in_proj.weight", "in_proj.bias"):
        return 0, ((Di, True), (Di, True), (GN, g_sharded), (GN, g_sharded), (H, True))
    if p in ("conv1d.weight", "conv1d.bias"):
        return 0, ((Di, True), (GN, g_sharded), (GN, g_sharded))
    if p in ("dt_bias", "A_log", "D"):
        return 0, ((H, True),)
    if p == "norm.weight":
        return 0, ((Di, True),)
    if p == "out_proj.weight":
        return 1, ((Di, True),)
    if p == "out_proj.bias":
        return None, ()
    return None


def tp_cases(cfg, tp_size: int):
    """`cfg` with one group (replicated on every rank) and with `tp_size` groups (split), where the heads
    allow them."""
    from dataclasses import replace
    return tuple((f"{cfg.family}-g{g}", replace(cfg, mixer=replace(cfg.mixer, n_groups=g)))
                 for g in dict.fromkeys((1, tp_size)) if cfg.num_heads % g == 0)


register(EngineFamily("mamba2", Mamba2Mixer, OPS, check_tp, shard_sections, tp_cases=tp_cases))
