"""Triton residual add + RMSNorm: one program per token, the row in registers; residual read and written once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import Fixed, HostPlans, device_guard, interpreting, launch_fixed, next_power_of_2
from harness.impls.triton.gated_rms_norm import eps_tensor, rms_scale


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, eps_ptr, D, eps, sx0, sx1, sr0, sr1, sw0, sy0, sy1,
                         BD: tl.constexpr, SUM: tl.constexpr, ACC: tl.constexpr, EPS_F64: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BD).to(tl.int64)
    m = tl.arange(0, BD) < D
    xv = tl.load(x_ptr + t * sx0 + c * sx1, mask=m, other=0.0)
    rv = tl.load(r_ptr + t * sr0 + c * sr1, mask=m, other=0.0)
    r_new = (rv.to(SUM) + xv.to(SUM)).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + t * sr0 + c * sr1, r_new, mask=m)
    h = r_new.to(x_ptr.dtype.element_ty).to(ACC)  # the stored residual, in x's dtype, as the unfused norm reads it
    if EPS_F64:  # float arguments arrive as fp32; fp64 runs read the exact eps from a tensor
        eps = tl.load(eps_ptr)
    y = h * rms_scale(h, D, eps) * tl.load(w_ptr + c * sw0, mask=m, other=0.0).to(ACC)
    tl.store(y_ptr + t * sy0 + c * sy1, y.to(y_ptr.dtype.element_ty), mask=m)


def _plan(dims, call):
    """One call's launch (`call`: the validator's arguments, `out=` last) from the validator's answer: (the
    `Fixed` launch, or None where there is no token; y's shape; the strides after eps; whether eps is passed as
    an fp64 tensor)."""
    T, Dd = dims
    x, residual, weight = call[:3]
    out = call[-1]
    if T == 0:
        return None, (T, Dd), (), False
    BD = next_power_of_2(Dd)
    f64 = torch.float64
    acc = tl.float64 if x.dtype == f64 else tl.float32
    sum_t = tl.float64 if f64 in (x.dtype, residual.dtype) else tl.float32
    warps = 1 if interpreting() else max(1, min(16, BD // 256))
    sy = (out if out is not None else torch.empty((T, Dd), dtype=x.dtype, device="meta")).stride()
    fixed = Fixed(_add_rms_norm_kernel, (T,), BD=BD, SUM=sum_t, ACC=acc, EPS_F64=acc is tl.float64, num_warps=warps)
    return fixed, (T, Dd), (x.stride(0), x.stride(1), residual.stride(0), residual.stride(1), weight.stride(0),
                            *sy), acc is tl.float64


# residual (position 1) is written whole in place: its memory must be its own, like out='s
_PLANS = HostPlans(C.validate_add_rms_norm, _plan, alone=(1,))


@provides("triton", "add_rms_norm")
def add_rms_norm(x, residual, weight, *, eps=1e-6, out=None):
    fixed, shape, tail, f64 = _PLANS.plan((x, residual, weight, eps, out))
    y = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    if fixed is None:
        return y
    with device_guard(x):
        launch_fixed(fixed, x, residual, weight, y, eps_tensor(eps, f64, x), shape[1], float(eps), *tail)
    return y
