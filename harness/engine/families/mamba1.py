"""Engine mixer of Mamba-1 (family ``mamba1``) and Falcon-Mamba (family ``falcon_mamba``).

==========================  ===================================  =================================
part                        prefill tokens                       decode rows
==========================  ===================================  =================================
conv                        ``causal_conv1d_varlen``             ``causal_conv1d_update``
selective scan              ``selective_scan_varlen``            ``selective_state_update`` (3-D)
Falcon-Mamba B/C/dt norms   ``gated_rms_norm`` (weight = ones, z = None, eps = ``mixer_rms_eps``)
==========================  ===================================  =================================

Speculative decode rows (``harness.engine.spec``): ``causal_conv1d_update_spec`` and
``selective_state_update_spec`` in place of the decode rows' ops.

Tensor parallelism (as vLLM's MambaMixer; d_inner = Di sharded): in_proj dim 0 [x: Di, z: Di];
conv1d, dt_proj, A_log, D dim 0 [Di]; x_proj and out_proj dim 1 [Di] (row parallel: their partial
products are summed over the ranks); out_proj.bias replicated. Written independently of the reference mixer (``reference/families/mamba1.py``): the oracle
shares no code with what it checks.
"""
from __future__ import annotations

import torch

from harness.engine.families import EngineFamily, EngineMixer, decode_rows, linear, prefill_rows, register
from harness.engine.spec import SpecDecodeMixin

OPS = ("causal_conv1d_varlen", "causal_conv1d_update", "selective_scan_varlen", "selective_state_update")
FALCON_OPS = OPS + ("gated_rms_norm",)


class Mamba1Mixer(SpecDecodeMixin, EngineMixer):
    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        self.A = -torch.exp(self.state_param("A_log"))
        self.D = self.state_param("D")
        self.x_proj = self.weight("x_proj.weight")
        self.dt_proj = self.weight("dt_proj.weight")
        self.dt_bias = self.state_param("dt_proj.bias")

    def norm_ssm_inputs(self, x_dbl):
        """dt_low, B, C as they enter dt_proj and the scan, from x_proj's output [dt_low | B | C] (Mamba-1:
        its three parts unchanged)."""
        cfg = self.cfg
        return torch.split(x_dbl, [cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)

    def forward(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        Dm = self.local(cfg.d_inner)
        P = md.num_prefill_tokens
        xz = linear(h, self.in_w, self.in_b)
        x, z = xz[:, :Dm], xz[:, Dm:]  # views: the ops take strided inputs (harness.ops)
        x = self.conv(x, md, conv_states)
        x_dbl = self.tp.all_reduce(linear(x, self.x_proj))  # row parallel
        dt_low, B, C = self.norm_ssm_inputs(x_dbl)
        dt = linear(dt_low, self.dt_proj)
        B, C = B.unsqueeze(1), C.unsqueeze(1)
        ys = []
        if md.num_prefills:
            xp, dtp, Bp, Cp, zp = (prefill_rows(t, P) for t in (x, dt, B, C, z))
            ys.append(self.ops["selective_scan_varlen"](
                xp, dtp, self.A, Bp, Cp, self.D, zp, self.dt_bias, ssm_states,
                md.prefill_query_start_loc, md.prefill_state_indices, md.prefill_has_initial_states,
                delta_softplus=True))
        if md.num_decodes:
            xd, dtd, Bd, Cd, zd = (decode_rows(t, P) for t in (x, dt, B, C, z))
            ys.append(self.state_update(md, ssm_states, xd, dtd, self.A, Bd, Cd, self.D, zd, self.dt_bias,
                                        dt_softplus=True))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return self.out_proj(y)


class FalconMambaMixer(Mamba1Mixer):
    """Mamba-1 with Falcon-Mamba's weightless RMSNorm of dt_low, B and C (eps = ``cfg.mixer_rms_eps``)."""

    def __init__(self, cfg, params, ops, **kw):
        super().__init__(cfg, params, ops, **kw)
        self._ones_dt = torch.ones(cfg.dt_rank, dtype=self.dtype, device=self.device)
        self._ones_bc = torch.ones(2 * cfg.d_state, dtype=self.dtype, device=self.device)

    def falcon_norm(self, t: torch.Tensor, ones: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
        """Falcon-Mamba's weightless RMSNorm with eps = cfg.mixer_rms_eps over each group of `group_size`
        columns of `t` (None: the whole row) (patchable)."""
        return self.ops["gated_rms_norm"](t, ones, None, eps=float(self.cfg.mixer_rms_eps), group_size=group_size)

    def norm_ssm_inputs(self, x_dbl):
        """dt_low normalised over its dt_rank columns; B and C, adjacent and of d_state columns each, in one
        launch as two groups of the [B | C] view."""
        R, N = self.cfg.dt_rank, self.cfg.d_state
        bc = self.falcon_norm(x_dbl[:, R:], self._ones_bc, group_size=N)
        return (self.falcon_norm(x_dbl[:, :R], self._ones_dt), *torch.split(bc, [N, N], dim=-1))


def check_tp(cfg, tp_size: int) -> None:
    if cfg.d_inner % tp_size:
        raise ValueError(f"tp_size: expected a divisor of d_inner = {cfg.d_inner}, got {tp_size}")


def shard_sections(cfg, p: str):
    Di = cfg.d_inner
    if p in ("in_proj.weight", "in_proj.bias"):
        return 0, ((Di, True), (Di, True))
    if p in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "A_log", "D"):
        return 0, ((Di, True),)
    if p in ("x_proj.weight", "out_proj.weight"):
        return 1, ((Di, True),)
    if p == "out_proj.bias":
        return None, ()
    return None


register(EngineFamily("mamba1", Mamba1Mixer, OPS, check_tp, shard_sections))
register(EngineFamily("falcon_mamba", FalconMambaMixer, FALCON_OPS, check_tp, shard_sections))
