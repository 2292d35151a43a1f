"""Triton gated RMSNorm: one program per (token, group of channels), the group in registers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import Fixed, HostPlans, device_guard, interpreting, launch_fixed, next_power_of_2


@triton.jit
def rms_scale(xv, n, eps):
    """1 / sqrt(mean of xv^2 + eps): xv a block of `n` channels (masked-off lanes 0), in xv's dtype."""
    return 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / n + eps)


@triton.jit
def _gated_norm_kernel(x_ptr, w_ptr, z_ptr, y_ptr, eps_ptr, GS, eps, sx0, sx1, sw0, sz0, sz1, sy0, sy1,
                       BG: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                       ACC: tl.constexpr, EPS_F64: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    c = g * GS + tl.arange(0, BG).to(tl.int64)
    m = tl.arange(0, BG) < GS
    xv = tl.load(x_ptr + t * sx0 + c * sx1, mask=m, other=0.0).to(ACC)
    if HAS_Z:
        zv = tl.load(z_ptr + t * sz0 + c * sz1, mask=m, other=0.0).to(ACC)
        gate = zv / (1.0 + tl.exp(-zv))
        if not NORM_BEFORE_GATE:
            xv = xv * gate
    if EPS_F64:  # float arguments arrive as fp32; fp64 runs read the exact eps from a tensor
        eps = tl.load(eps_ptr)
    y = xv * rms_scale(xv, GS, eps) * tl.load(w_ptr + c * sw0, mask=m, other=0.0).to(ACC)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    tl.store(y_ptr + t * sy0 + c * sy1, y.to(y_ptr.dtype.element_ty), mask=m)


def _plan(dims, call, norm_before_gate):
    """One call's launch (`call`: the validator's arguments, `out=` last) from the validator's answer: (the
    `Fixed` launch, or None where there is no token; the group size; the strides after eps; whether eps is
    passed as an fp64 tensor)."""
    T, Dd, gs = dims
    x, weight, z = call[:3]
    out = call[-1]
    if T == 0:
        return None, gs, (), False
    BG = next_power_of_2(gs)
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    zp = z if z is not None else x
    warps = 1 if interpreting() else max(1, min(16, BG // 256))
    sy = (out if out is not None else torch.empty_like(x, device="meta")).stride()  # a new y is empty_like(x)
    fixed = Fixed(_gated_norm_kernel, (T, Dd // gs), BG=BG, HAS_Z=z is not None,
                  NORM_BEFORE_GATE=bool(norm_before_gate), ACC=acc, EPS_F64=acc is tl.float64, num_warps=warps)
    return fixed, gs, (x.stride(0), x.stride(1), weight.stride(0), zp.stride(0), zp.stride(1), *sy), \
        acc is tl.float64


_PLANS = HostPlans(C.validate_gated_rms_norm, _plan)


def eps_tensor(eps, f64: bool, like):
    """The tensor the kernels read eps from in fp64 (`like` where they take the float argument)."""
    return torch.tensor([eps], dtype=torch.float64, device=like.device) if f64 else like


@provides("triton", "gated_rms_norm")
def gated_rms_norm(x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None):
    fixed, gs, tail, f64 = _PLANS.plan((x, weight, z, eps, group_size, out), (norm_before_gate,))
    y = out if out is not None else torch.empty_like(x)
    if fixed is None:
        return y
    with device_guard(x):
        launch_fixed(fixed, x, weight, z if z is not None else x, y, eps_tensor(eps, f64, x), gs, float(eps), *tail)
    return y
