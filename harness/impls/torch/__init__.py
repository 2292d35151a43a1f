"""The `torch` implementation: vectorized, device-agnostic PyTorch (no per-token Python loops).

Recurrences run as chunked/segment-sum formulations with a loop over chunks; half inputs compute
in fp32, fp64 in fp64. Each module of this package registers the ops it implements with
`@provides("torch", op)`.
"""
from __future__ import annotations

from harness.impls.registry import Impl, provided, register

IMPL = register(Impl(name="torch", ops=provided("torch", __name__), devices=("cpu", "cuda", "xpu"),
                     deterministic=True, description="vectorized PyTorch (chunked recurrences), any device"))
