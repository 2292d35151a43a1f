"""Vectorized torch residual add + RMSNorm: the residual updated in place, then normalised in x's dtype."""
from __future__ import annotations

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.torch._util import compute_dtype, emit
from harness.impls.torch.gated_rms_norm import rms_groups


@provides("torch", "add_rms_norm")
def add_rms_norm(x, residual, weight, *, eps=1e-6, out=None):
    T, Dd = C.validate_add_rms_norm(x, residual, weight, eps, out)
    residual.add_(x)  # torch's promotion: computed in fp32 (fp64 with an fp64 operand), stored in residual's dtype
    cd = compute_dtype(x.dtype)
    h = residual.to(x.dtype).to(cd)
    return emit(rms_groups(h, Dd, eps) * weight.to(cd), x, out)
