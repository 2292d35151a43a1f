"""The `torch` implementation: vectorized, device-agnostic PyTorch (no per-token Python loops).

Recurrences run as chunked/segment-sum formulations with a loop over chunks; half inputs compute
in fp32, fp64 in fp64.
"""
from __future__ import annotations

from harness.impls.registry import Impl, register
from harness.impls.torch.conv1d import causal_conv1d_update, causal_conv1d_varlen
from harness.impls.torch.gated_rms_norm import gated_rms_norm
from harness.impls.torch.selective_scan import selective_scan_varlen
from harness.impls.torch.selective_state_update import selective_state_update
from harness.impls.torch.ssd import ssd_varlen

OPS = {
    "causal_conv1d_varlen": causal_conv1d_varlen,
    "causal_conv1d_update": causal_conv1d_update,
    "selective_scan_varlen": selective_scan_varlen,
    "selective_state_update": selective_state_update,
    "ssd_varlen": ssd_varlen,
    "gated_rms_norm": gated_rms_norm,
}


IMPL = register(Impl(name="torch", ops=OPS, devices=("cpu", "cuda", "xpu"), deterministic=True,
                     description="vectorized PyTorch (chunked recurrences), any device"))
