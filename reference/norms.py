"""RMSNorm variants used by SSM mixers.

* `rms_norm`: x / sqrt(mean(x^2 over the last dim) + eps) (* weight). Weightless when weight is None
  (Falcon-Mamba normalises B, C and dt this way with its own eps).
* `gated_rms_norm`: Mamba-2's output norm with a silu(z) gate, normalised per group of `group_size`
  channels of the last dim (group_size = hidden / n_groups in Mamba-2; None = the whole last dim):
    norm_before_gate=True:  rms(x) * weight * silu(z)
    norm_before_gate=False: rms(x * silu(z)) * weight        (HF Mamba2's MambaRMSNormGated)
* `add_rms_norm`: a pre-norm layer's residual add and the next layer's RMSNorm:
    h = residual + x;  y = rms_norm(h, weight)   (returns both: y and the new residual h)
"""
from __future__ import annotations

import torch

from reference._common import check_eps, check_float, check_same_device, silu
from reference.validate import check_divides, check_same_dtype, fail

__all__ = ["rms_norm", "gated_rms_norm", "add_rms_norm"]


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dim of x (any leading shape); weight (x.shape[-1],) or None."""
    check_float("x", x)
    if x.dim() < 1:
        fail("x", "at least 1 dim", f"shape {tuple(x.shape)}")
    check_float("weight", weight, shape=(x.shape[-1],), optional=True)
    check_eps(eps)
    check_same_dtype(x=x, weight=weight)
    check_same_device("x", x, weight=weight)
    y = _normalize(x, eps)
    return y if weight is None else y * weight


def gated_rms_norm(x, weight, z=None, *, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm over groups of `group_size` channels of the last dim.

    Args:
        x: (..., D). weight: (D,). z: same shape as x, or None (then no gate: rms_norm per group * weight).
        eps: added to the mean square. group_size: divides D; None = D.
        norm_before_gate: True -> norm(x) * weight * silu(z); False -> norm(x * silu(z)) * weight.
    """
    check_float("x", x)
    if x.dim() < 1:
        fail("x", "at least 1 dim", f"shape {tuple(x.shape)}")
    Dn = x.shape[-1]
    check_float("weight", weight, shape=(Dn,))
    check_float("z", z, shape=tuple(x.shape), optional=True)
    check_eps(eps)
    if group_size is None:
        group_size = Dn
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        fail("group_size", "an int or None", repr(group_size))
    check_divides("group_size", group_size, "the last dim of x", Dn)
    check_same_dtype(x=x, weight=weight, z=z)
    check_same_device("x", x, weight=weight, z=z)

    if z is not None and not norm_before_gate:
        x = x * silu(z)
    groups = x.reshape(*x.shape[:-1], Dn // group_size, group_size)
    y = _normalize(groups, eps).reshape(x.shape) * weight
    if z is not None and norm_before_gate:
        y = y * silu(z)
    return y


def add_rms_norm(x, residual, weight, *, eps=1e-6):
    """Residual add, then RMSNorm of the sum: returns (rms_norm(residual + x, weight, eps), residual + x).

    Args:
        x, residual: (..., D), of one dtype. weight: (D,). eps: added to the mean square.
    The inputs are left unchanged (the new residual is returned, not written into `residual`).
    """
    check_float("x", x)
    check_float("residual", residual, shape=tuple(x.shape))
    check_same_dtype(x=x, residual=residual)
    check_same_device("x", x, residual=residual)
    h = residual + x
    return rms_norm(h, weight, eps), h
