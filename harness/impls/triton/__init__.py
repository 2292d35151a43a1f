"""The `triton` implementation: our Triton kernels for the ops of `harness.ops`.

Runs on cuda and xpu, and on cpu through Triton's interpreter (TRITON_INTERPRET=1, set by the pytest
plugin for `--device cpu`; slow, and fp32/fp64 only there since its half-precision arithmetic is wrong).
"""
from __future__ import annotations

import torch

from harness.impls.registry import Impl, provided, register
from harness.impls.triton._common import has_gpu, interpreting


def _unavailable():
    if interpreting() or has_gpu():
        return None
    return ("Triton needs a CUDA/XPU device, or TRITON_INTERPRET=1 to run on CPU through its interpreter "
            "(pytest --device cpu sets it)")


# Under the interpreter only fp32/fp64: its bf16/fp16 arithmetic is wrong (loads/stores are fine).
_DTYPES = (torch.float32, torch.float64) if interpreting() else (
    torch.float32, torch.float16, torch.bfloat16, torch.float64)

_OPS = provided("triton", __name__)

from harness.impls.triton import conv1d as _conv, delta_rule_chunk as _gdn, kda_chunk as _kda  # noqa: E402
from harness.impls.triton import selective_scan as _scan  # noqa: E402


def _tiles() -> dict:
    """The token tiles of the launch configs: the scan's piece length (8 under the interpreter), the delta
    rules' chunks, the conv's row block (4 under the interpreter; a program walks 1-3 of them there).
    ssd_varlen's chunk is its `chunk_size` argument."""
    interp = interpreting()
    piece = 8 if interp else int(_scan.CONFIG["chunk"])
    t = {"gated_delta_rule_varlen": (int(_gdn.CONFIG["chunk"]),), "kda_varlen": (int(_kda.CONFIG["bt"]),),
         "causal_conv1d_varlen": (4 if interp else int(_conv.CONFIG["bt"]),)}
    if piece:
        t["selective_scan_varlen"] = (piece,)
    return t


IMPL = register(Impl(name="triton", ops=_OPS, devices=("cuda", "xpu", "cpu"), tiles=_tiles(),
                     dtypes=_DTYPES,
                     deterministic=True, unavailable=_unavailable,
                     description="our Triton kernels (cpu via TRITON_INTERPRET=1, fp32/fp64 only)"))
