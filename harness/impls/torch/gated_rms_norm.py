"""Vectorized torch gated RMSNorm (per group of channels, optional silu(z) gate before or after)."""
from __future__ import annotations

import torch

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.torch._util import compute_dtype, emit, silu


def rms_groups(xs: torch.Tensor, gs: int, eps: float) -> torch.Tensor:
    """xs (T, D) normalised by the root mean square of each group of `gs` channels (in xs's dtype)."""
    T, Dd = xs.shape
    g = xs.reshape(T, Dd // gs, gs)
    return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(T, Dd)


@provides("torch", "gated_rms_norm")
def gated_rms_norm(x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None):
    T, Dd, gs = C.validate_gated_rms_norm(x, weight, z, eps, group_size, out)
    cd = compute_dtype(x.dtype)
    xs = x.to(cd)
    zs = None if z is None else silu(z.to(cd))
    if zs is not None and not norm_before_gate:
        xs = xs * zs
    y = rms_groups(xs, gs, eps) * weight.to(cd)
    if zs is not None and norm_before_gate:
        y = y * zs
    return emit(y, x, out)
