"""Adapter for flash-linear-attention (fla-core). It provides none of the ops of `harness.ops` yet
(GDN/KDA ops are not in the contract), so it registers with an empty op set: `harness impls` lists
it, suites skip it for every op."""
from __future__ import annotations

from harness.impls.adapters import unavailable_reason
from harness.impls.registry import Impl, register

register(Impl(name="fla", devices=("cuda",), ops={}, unavailable=lambda: unavailable_reason("fla", "fla"),
              description="flash-linear-attention (no contract op yet)"))
