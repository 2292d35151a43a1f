"""The `torch` implementation: vectorized, device-agnostic PyTorch (no per-token Python loops).

Recurrences run as chunked/segment-sum formulations with a loop over chunks; half inputs compute
in fp32, fp64 in fp64. Each module of this package registers the ops it implements with
`@provides("torch", op)`.
"""
from __future__ import annotations

from harness.impls.registry import Impl, provided, register

_OPS = provided("torch", __name__)

from harness.impls.torch import delta_rule as _delta, selective_scan as _scan  # noqa: E402 (imported by provided)

# The chunk lengths the chunked forms carry state across: the selective scan's chunk (MAX_CHUNK while
# S * Dm * N <= ELEMENT_BUDGET / MAX_CHUNK^2, i.e. for the suites' feature sizes; shorter above), the
# delta rules' chunk grids. ssd_varlen's chunk is its `chunk_size` argument.
TILES = {"selective_scan_varlen": (_scan.MAX_CHUNK,), "gated_delta_rule_varlen": (_delta.CHUNK_SIZE["gdn"],),
         "kda_varlen": (_delta.CHUNK_SIZE["kda"],)}

IMPL = register(Impl(name="torch", ops=_OPS, devices=("cpu", "cuda", "xpu"), tiles=TILES,
                     deterministic=True, description="vectorized PyTorch (chunked recurrences), any device"))
