"""Reference mixers: Mamba-1 (incl. Falcon-Mamba) and Mamba-2, built only from the reference ops.

A mixer holds one layer's parameters (our names without the `layers.{i}.mixer.` prefix, shapes as in
the checkpoint, see `reference.loader.mixer_parameter_shapes`) converted to one compute dtype, and an
`ops` object (`MixerOps`) that supplies causal_conv1d / selective_scan / ssd / norms. The default ops
are the reference ones; a model runner swaps in kernels through the same object.

Both mixers work on packed varlen tokens with explicit per-request states:

    forward(hidden (T, d_model), cu_seqlens, conv_states_in (S, conv_dim, K-1) | None,
            ssm_states_in (S, ...) | None) -> (out (T, d_model), conv_states_out, ssm_states_out)
    step(hidden (B, d_model), conv_state (B, conv_dim, K-1), ssm_state (B, ...)) -> (out, new_conv, new_ssm)

Inputs are never modified. SSM state shapes: Mamba-1 (S, d_inner, d_state); Mamba-2
(S, num_heads, head_dim, d_state).

Mamba-1 (as transformers' MambaMixer / mamba_ssm's Mamba):
    x, z   = split(in_proj(h), [d_inner, d_inner])
    x      = silu(conv1d(x) + conv_bias)
    dt_low, B, C = split(x_proj(x), [dt_rank, d_state, d_state])
    Falcon-Mamba only: dt_low, B, C = rms(dt_low), rms(B), rms(C)   (weightless, eps = mixer_rms_eps,
                       dt normalised over its dt_rank channels, before dt_proj)
    dt     = dt_proj.weight @ dt_low           (dt_proj.bias is the scan's delta_bias, softplus after)
    y      = selective_scan(x, dt, -exp(A_log), B, C, D, z)
    out    = out_proj(y)
Mamba-2 (as transformers' Mamba2Mixer / mamba_ssm's Mamba2):
    z, xBC, dt = split(in_proj(h), [d_inner, d_inner + 2*G*N, H])
    xBC    = silu(conv1d(xBC) + conv_bias);  x, B, C = split(xBC, [d_inner, G*N, G*N])
    y      = ssd(x as (H, P), dt, -exp(A_log), B as (G, N), C as (G, N), D, dt_bias, softplus,
                 dt_limit = time_step_limit)
    y      = gated_rms_norm(y, norm.weight, z, group_size = d_inner / G, norm_before_gate)
    out    = out_proj(y)
The decode step applies `time_step_limit` too (prefill/decode split invariance); transformers'
and mamba_ssm's decode paths skip the clamp, which only matters for a non-default limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from reference.validate import fail


@dataclass(frozen=True)
class MixerOps:
    """The ops a mixer calls; signatures as in reference/{conv1d,selective_scan,ssd,norms}.py."""
    causal_conv1d: Callable
    causal_conv1d_update: Callable
    selective_scan: Callable
    selective_state_update: Callable
    ssd: Callable
    ssd_state_update: Callable
    rms_norm: Callable
    gated_rms_norm: Callable
    name: str = "reference"

    def replace(self, **ops) -> "MixerOps":
        from dataclasses import replace
        return replace(self, **ops)


def reference_ops(ssd: str = "scan") -> MixerOps:
    """The reference ops. `ssd="scan"` uses the token loop, `"chunked"` the chunked SSD formulation."""
    from reference import conv1d, norms, selective_scan, ssd as ssd_mod
    if ssd not in ("scan", "chunked"):
        fail("ssd", "'scan' or 'chunked'", repr(ssd))
    return MixerOps(
        causal_conv1d=conv1d.causal_conv1d, causal_conv1d_update=conv1d.causal_conv1d_update,
        selective_scan=selective_scan.selective_scan,
        selective_state_update=selective_scan.selective_state_update,
        ssd=ssd_mod.ssd_scan if ssd == "scan" else ssd_mod.ssd_chunked,
        ssd_state_update=ssd_mod.ssd_state_update,
        rms_norm=norms.rms_norm, gated_rms_norm=norms.gated_rms_norm,
        name=f"reference[{ssd}]")


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.t()
    return y + b if b is not None else y


class _Mixer:
    REQUIRED: tuple = ()

    def __init__(self, cfg, params: dict, *, dtype: torch.dtype = torch.float64, ops: MixerOps | None = None,
                 device=None):
        from reference.loader import mixer_parameter_shapes
        shapes = mixer_parameter_shapes(cfg)
        missing = sorted(set(shapes) - set(params))
        extra = sorted(set(params) - set(shapes))
        if missing or extra:
            fail("params", f"exactly the mixer parameters {sorted(shapes)}", f"missing {missing}, unexpected {extra}")
        for k, s in shapes.items():
            if tuple(params[k].shape) != s:
                fail(f"params[{k!r}]", f"shape {s}", f"shape {tuple(params[k].shape)}")
        self.cfg = cfg
        self.dtype = dtype
        self.ops = ops or reference_ops()
        self.p = {k: v.detach().to(device=device if device is not None else v.device, dtype=dtype)
                  for k, v in params.items()}
        self.conv_w = self.p["conv1d.weight"][:, 0, :]  # (conv_dim, K)
        self.conv_b = self.p.get("conv1d.bias")
        self.A = -torch.exp(self.p["A_log"])

    # state shapes -----------------------------------------------------------------------------
    def conv_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.conv_dim, self.cfg.d_conv - 1)

    def zero_states(self, batch: int, device=None):
        device = device if device is not None else self.conv_w.device
        return (torch.zeros(self.conv_state_shape(batch), dtype=self.dtype, device=device),
                torch.zeros(self.ssm_state_shape(batch), dtype=self.dtype, device=device))

    def _check_hidden(self, hidden, arg="hidden"):
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != self.cfg.d_model:
            fail(arg, f"a (tokens, d_model={self.cfg.d_model}) tensor",
                 f"shape {tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
        return hidden.to(self.dtype)


class Mamba1Mixer(_Mixer):
    """Mamba-1 mixer; Falcon-Mamba when `cfg.mixer_rms_eps` is set (family falcon_mamba)."""

    def ssm_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.d_inner, self.cfg.d_state)

    def _falcon(self) -> bool:
        return self.cfg.family == "falcon_mamba"

    def _ssm_inputs(self, x):
        cfg = self.cfg
        x_dbl = x @ self.p["x_proj.weight"].t()
        dt_low, B, C = torch.split(x_dbl, [cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        if self._falcon():
            eps = cfg.mixer_rms_eps
            dt_low = self.ops.rms_norm(dt_low.contiguous(), None, eps)
            B = self.ops.rms_norm(B.contiguous(), None, eps)
            C = self.ops.rms_norm(C.contiguous(), None, eps)
        dt = dt_low @ self.p["dt_proj.weight"].t()
        # B, C as (tokens, 1 group, N)
        return dt, B.unsqueeze(1).contiguous(), C.unsqueeze(1).contiguous()

    def forward(self, hidden, cu_seqlens=None, conv_states_in=None, ssm_states_in=None):
        h = self._check_hidden(hidden)
        D = self.cfg.d_inner
        xz = _linear(h, self.p["in_proj.weight"], self.p.get("in_proj.bias"))
        x, z = xz[:, :D].contiguous(), xz[:, D:].contiguous()
        x, conv_out = self.ops.causal_conv1d(x, self.conv_w, self.conv_b, activation="silu",
                                             cu_seqlens=cu_seqlens, initial_states=_cast(conv_states_in, self.dtype))
        dt, B, C = self._ssm_inputs(x)
        y, ssm_out = self.ops.selective_scan(x, dt.contiguous(), self.A, B, C, self.p["D"], z,
                                             delta_bias=self.p["dt_proj.bias"], delta_softplus=True,
                                             cu_seqlens=cu_seqlens, initial_states=_cast(ssm_states_in, self.dtype))
        out = _linear(y, self.p["out_proj.weight"], self.p.get("out_proj.bias"))
        return out, conv_out, ssm_out

    def step(self, hidden, conv_state, ssm_state):
        h = self._check_hidden(hidden)
        D = self.cfg.d_inner
        xz = _linear(h, self.p["in_proj.weight"], self.p.get("in_proj.bias"))
        x, z = xz[:, :D].contiguous(), xz[:, D:].contiguous()
        x, new_conv = self.ops.causal_conv1d_update(x, _cast(conv_state, self.dtype), self.conv_w, self.conv_b,
                                                    activation="silu")
        dt, B, C = self._ssm_inputs(x)
        y, new_ssm = self.ops.selective_state_update(_cast(ssm_state, self.dtype), x, dt.contiguous(), self.A, B, C,
                                                     self.p["D"], z, dt_bias=self.p["dt_proj.bias"], dt_softplus=True)
        out = _linear(y, self.p["out_proj.weight"], self.p.get("out_proj.bias"))
        return out, new_conv, new_ssm


class Mamba2Mixer(_Mixer):
    """Mamba-2 mixer (SSD, n_groups broadcast by repeat_interleave, gated RMSNorm per group)."""

    def ssm_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.num_heads, self.cfg.head_dim, self.cfg.d_state)

    def _split_in(self, h):
        cfg = self.cfg
        zxbcdt = _linear(h, self.p["in_proj.weight"], self.p.get("in_proj.bias"))
        z, xBC, dt = torch.split(zxbcdt, [cfg.d_inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        return z.contiguous(), xBC.contiguous(), dt.contiguous()

    def _split_xbc(self, xBC):
        cfg = self.cfg
        GN = cfg.n_groups * cfg.d_state
        x, B, C = torch.split(xBC, [cfg.d_inner, GN, GN], dim=-1)
        n = xBC.shape[0]
        return (x.reshape(n, cfg.num_heads, cfg.head_dim), B.reshape(n, cfg.n_groups, cfg.d_state),
                C.reshape(n, cfg.n_groups, cfg.d_state))

    def _out(self, y, z):
        cfg = self.cfg
        y = self.ops.gated_rms_norm(y.reshape(y.shape[0], cfg.d_inner), self.p["norm.weight"], z,
                                    eps=cfg.mixer_norm_eps, group_size=cfg.d_inner // cfg.n_groups,
                                    norm_before_gate=cfg.norm_before_gate)
        return _linear(y, self.p["out_proj.weight"], self.p.get("out_proj.bias"))

    def forward(self, hidden, cu_seqlens=None, conv_states_in=None, ssm_states_in=None):
        h = self._check_hidden(hidden)
        z, xBC, dt = self._split_in(h)
        xBC, conv_out = self.ops.causal_conv1d(xBC, self.conv_w, self.conv_b, activation="silu",
                                               cu_seqlens=cu_seqlens, initial_states=_cast(conv_states_in, self.dtype))
        x, B, C = self._split_xbc(xBC)
        y, ssm_out = self.ops.ssd(x, dt, self.A, B, C, self.p["D"], None, dt_bias=self.p["dt_bias"],
                                  dt_softplus=True, dt_limit=tuple(self.cfg.time_step_limit), cu_seqlens=cu_seqlens,
                                  initial_states=_cast(ssm_states_in, self.dtype))
        return self._out(y, z), conv_out, ssm_out

    def step(self, hidden, conv_state, ssm_state):
        h = self._check_hidden(hidden)
        z, xBC, dt = self._split_in(h)
        xBC, new_conv = self.ops.causal_conv1d_update(xBC, _cast(conv_state, self.dtype), self.conv_w, self.conv_b,
                                                      activation="silu")
        x, B, C = self._split_xbc(xBC)
        y, new_ssm = self.ops.ssd_state_update(_cast(ssm_state, self.dtype), x, dt, self.A, B, C, self.p["D"], None,
                                               dt_bias=self.p["dt_bias"], dt_softplus=True,
                                               dt_limit=tuple(self.cfg.time_step_limit))
        return self._out(y, z), new_conv, new_ssm


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def make_mixer(cfg, params: dict, *, dtype: torch.dtype = torch.float64, ops: MixerOps | None = None, device=None):
    """The mixer for `cfg.family` with one layer's parameters (keys relative to `layers.{i}.mixer.`)."""
    if cfg.family in ("mamba1", "falcon_mamba"):
        return Mamba1Mixer(cfg, params, dtype=dtype, ops=ops, device=device)
    if cfg.family == "mamba2":
        return Mamba2Mixer(cfg, params, dtype=dtype, ops=ops, device=device)
    fail("cfg.family", "one of mamba1, falcon_mamba, mamba2", repr(cfg.family))
