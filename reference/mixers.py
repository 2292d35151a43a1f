"""Reference mixers: the ops object they call and the family-independent part of a mixer.

A mixer holds one layer's parameters (our names without the `layers.{i}.mixer.` prefix, shapes as in
the checkpoint, see `reference.loader.mixer_parameter_shapes`) converted to one compute dtype, and an
`ops` object (`MixerOps`) that supplies causal_conv1d / selective_scan / ssd / norms. The default ops
are the reference ones; a model runner swaps in kernels through the same object.

Every mixer works on packed varlen tokens with explicit per-request states:

    forward(hidden (T, d_model), cu_seqlens, conv_states_in (S, conv_dim, K-1) | None,
            ssm_states_in (S, ...) | None) -> (out (T, d_model), conv_states_out, ssm_states_out)
    step(hidden (B, d_model), conv_state (B, conv_dim, K-1), ssm_state (B, ...)) -> (out, new_conv, new_ssm)

Inputs are never modified. Each family's mixer (its formulas, its SSM state shape) lives in its module
of `reference/families/`; :func:`make_mixer` picks it by `cfg.family`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from reference.validate import fail


def checked_params(params: dict, shapes: dict, what: str, dtype: torch.dtype, device=None) -> dict:
    """`params` after checking it holds exactly the named parameters of `shapes` with those shapes, cast to
    `dtype` (and moved to `device` when given)."""
    missing = sorted(set(shapes) - set(params))
    extra = sorted(set(params) - set(shapes))
    if missing or extra:
        fail("params", f"exactly the {what} parameters {sorted(shapes)}", f"missing {missing}, unexpected {extra}")
    for k, s in shapes.items():
        if tuple(params[k].shape) != s:
            fail(f"params[{k!r}]", f"shape {s}", f"shape {tuple(params[k].shape)}")
    return {k: v.detach().to(device=device if device is not None else v.device, dtype=dtype)
            for k, v in params.items()}


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


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.t()
    return y + b if b is not None else y


def cast(t, dtype):
    return None if t is None else t.to(dtype)


class Mixer:
    """What every reference mixer shares: parameter checks and casting, the conv weights, A = -exp(A_log)
    (when the family has A_log), zero states. Subclasses (one per family module) define
    `ssm_state_shape`, `forward` and `step`."""

    def __init__(self, cfg, params: dict, *, dtype: torch.dtype = torch.float64, ops: MixerOps | None = None,
                 device=None):
        from reference.loader import mixer_parameter_shapes
        shapes = mixer_parameter_shapes(cfg)
        self.cfg = cfg
        self.dtype = dtype
        self.ops = ops or reference_ops()
        self.p = checked_params(params, shapes, "mixer", dtype, device)
        self.conv_w = self.conv_weight()  # (conv_dim, K)
        self.conv_b = self.p.get("conv1d.bias")
        self.A = -torch.exp(self.p["A_log"]) if "A_log" in self.p else None

    def conv_weight(self) -> torch.Tensor:
        """The depthwise conv weight (conv_dim, K) (a family whose checkpoints split it overrides this)."""
        return self.p["conv1d.weight"][:, 0, :]

    def ssm_state_shape(self, batch: int) -> tuple:  # pragma: no cover - defined by each family
        raise NotImplementedError

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


def make_mixer(cfg, params: dict, *, dtype: torch.dtype = torch.float64, ops: MixerOps | None = None, device=None):
    """The mixer for `cfg.family` with one layer's parameters (keys relative to `layers.{i}.mixer.`)."""
    from reference import families
    return families.get(cfg.family, "cfg.family").make_mixer(cfg, params, dtype=dtype, ops=ops, device=device)
