"""Timing per device, done right.

* CUDA / XPU: device events around each call (`torch.cuda.Event` / `torch.xpu.Event`), the device
  synchronised once after all reps; optional CUDA-graph replay (one graph per input set).
* CPU: `time.perf_counter_ns` around each call.
* Warm-up calls first (compilation, autotuning, allocator), then `reps` timed calls cycling through
  several input sets (`rotate`), so a later call never finds its inputs in the cache the previous
  call warmed. On CUDA with a single input set the L2 is flushed between reps (a write of a buffer
  larger than L2, outside the timed region).
* Result: per-call milliseconds; `summarize` gives p20/p50/p80.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Stats:
    ms_p20: float
    ms_p50: float
    ms_p80: float
    n: int

    @property
    def rel_spread(self) -> float:
        return (self.ms_p80 - self.ms_p20) / self.ms_p50 if self.ms_p50 > 0 else 0.0


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not xs:
        raise ValueError("xs: expected at least one timing, got none")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(ms: Sequence[float]) -> Stats:
    return Stats(percentile(ms, 20), percentile(ms, 50), percentile(ms, 80), len(ms))


def device_kind(device: str) -> str:
    return str(device).split(":")[0]


def synchronize(device: str) -> None:
    kind = device_kind(device)
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "xpu":
        torch.xpu.synchronize(device)


def l2_bytes(device: str) -> int:
    kind = device_kind(device)
    try:
        if kind == "cuda":
            return int(getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", 0)) or 50 << 20
        if kind == "xpu":
            return 64 << 20
    except Exception:  # noqa: BLE001 - property missing on some builds
        pass
    return 32 << 20  # a generous last-level cache for CPUs


def rotation_count(bytes_per_set: int | None, device: str, max_sets: int | None = None, mem_cap: int = 2 << 30) -> int:
    """How many input sets make the sets together exceed twice the cache (bounded: 8 on GPUs, 2 on CPUs)."""
    if max_sets is None:
        max_sets = 2 if device_kind(device) == "cpu" else 8
    if not bytes_per_set:
        return min(2, max_sets)
    want = math.ceil(2 * l2_bytes(device) / bytes_per_set)
    cap = max(1, mem_cap // bytes_per_set)
    return int(max(1, min(max_sets, want, cap)))


def _event_cls(device: str):
    return torch.cuda.Event if device_kind(device) == "cuda" else torch.xpu.Event


def time_calls(fns: Sequence[Callable[[], object]], device: str, *, warmup: int = 3, reps: int = 20,
               cuda_graph: bool = False, flush: bool | None = None) -> list[float]:
    """Per-call milliseconds of `reps` calls cycling through `fns` (one closure per input set)."""
    if not fns:
        raise ValueError("fns: expected at least one callable, got none")
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps/warmup: expected reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    kind = device_kind(device)
    for i in range(warmup):
        fns[i % len(fns)]()
    synchronize(device)
    if kind == "cpu":
        out = []
        for i in range(reps):
            t0 = time.perf_counter_ns()
            fns[i % len(fns)]()
            out.append((time.perf_counter_ns() - t0) / 1e6)
        return out

    calls = list(fns)
    if cuda_graph:
        if kind != "cuda":
            raise ValueError(f"cuda_graph: expected a CUDA device, got {device}")
        calls = [_capture(fn, device) for fn in fns]
        for c in calls:
            c()
        synchronize(device)
    if flush is None:
        flush = len(fns) == 1
    scratch = torch.empty(2 * l2_bytes(device), dtype=torch.uint8, device=device) if flush else None
    Event = _event_cls(device)
    starts = [Event(enable_timing=True) for _ in range(reps)]
    ends = [Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if scratch is not None:
            scratch.zero_()
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _capture(fn: Callable[[], object], device: str) -> Callable[[], None]:
    s = torch.cuda.Stream(device=device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """`fn` followed by a device synchronisation (for wall-clock timers such as pytest-benchmark)."""
    def call():
        r = fn()
        synchronize(device)
        return r
    return call
