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

IMPL = register(Impl(name="triton", ops=provided("triton", __name__), devices=("cuda", "xpu", "cpu"),
                     dtypes=_DTYPES,
                     deterministic=True, unavailable=_unavailable,
                     description="our Triton kernels (cpu via TRITON_INTERPRET=1, fp32/fp64 only)"))
