"""The built-in metrics of every timing record, declared with `@register_metric`.

A metric is `fn(case, ms_p50, ctx) -> float | None`; `ctx["copy_gb_s"]` is the device-to-device copy
bandwidth measured earlier in the same run (the roofline).
"""
from __future__ import annotations

from harness.bench.registry import register_metric


@register_metric("tok_s", unit="tokens/s")
def tok_s(case, ms, ctx):
    return case.tokens / (ms * 1e-3) if case.tokens and ms > 0 else None


@register_metric("gb_s", unit="GB/s")
def gb_s(case, ms, ctx):
    return case.bytes / (ms * 1e-3) / 1e9 if case.bytes and ms > 0 else None


@register_metric("pct_copy_bw", unit="%")
def pct_copy_bw(case, ms, ctx):
    g = gb_s(case, ms, ctx)
    roof = ctx.get("copy_gb_s")
    return 100.0 * g / roof if g and roof else None
