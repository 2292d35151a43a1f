"""The one timing module of `harness bench`: op benchmarks, peers, launch-configuration sweeps, model
throughput and the loader benchmark all time through `measure` (or `wall_samples` for one-shot loads).

* CUDA / XPU, eager: `triton.testing.do_bench` (device events around each call, the L2 cache flushed
  before each one, warm-up by time), its raw samples kept (`return_mode="all"`) so that every record has
  p20/p50/p80 and a sample count; when one pass gives fewer than `Budget.min_reps` samples (a slow
  call) further passes sized from the first one's median make up the rest, within `Budget.max_time`.
* CUDA, CUDA graph: `triton.testing.do_bench_cudagraph` (the call captured `rep / estimate` times in one
  graph, replayed 10 times; each sample is the mean per call of one replay), repeated until
  `Budget.min_reps` samples. It does not flush the L2 cache between the calls of a replay, so for an op
  whose inputs fit in L2 the graph figure also gains from a warm cache; for the benchmark shapes (inputs
  of tens of MB and more, against 50-60 MB of L2) the difference is small.
  The host overhead of a call is eager p50 - graph p50.
* CUDA / XPU, launch: what the host spends issuing one eager call (`launch_samples`): bursts of a few calls
  timed with `time.perf_counter_ns`, no synchronisation inside a burst, the device drained before each so
  the launch queue never fills (a full queue would make the host wait for the device). Eager minus graph
  understates it: do_bench's L2 flush (a 256 MB memset) runs on the device while the host issues the call,
  so host time up to the flush's length does not show in the eager figure.
* CUDA / XPU, launch at a new token count (`new_shape_launch_samples`, prefill cases): the host's time to
  issue one call whose token count no call before had (T + 16, T + 32, ...: the other sizes and T mod 16 as
  the case's), the device drained before each, its inputs built untimed: what an eager prefill of ever new
  lengths pays per call (a launch plan built, launch keys new), against `launch_ms`'s repeated call.
* CPU: `time.perf_counter_ns` around each call, cycling through the input sets (so a call does not find
  its inputs in the cache the previous call warmed), until both `Budget.min_reps` samples and
  `Budget.min_time` seconds are reached (or `Budget.max_time` is spent): a time budget per case, so that
  fast calls get hundreds of samples and two runs of one commit agree.

* Launches (`profile_launches`, `harness bench --kernels`): after a case is timed, a few further calls
  under `torch.profiler` say what each launch of the call costs: on CUDA the device activity (kernels,
  copies, memsets) grouped by name, on the CPU (no kernels) the operators by self CPU time. These calls
  are not part of the timing and run back to back (no L2 flush between them), so for inputs that fit in
  the L2 cache the per-launch figures can be below the eager p50's share.

Why triton.testing rather than our own event loop on GPUs: it is what the peers' and Triton's own
benchmarks use, it handles the cache flush and warm-up by time, and its figures are comparable with the
numbers the peers publish.
"""
from __future__ import annotations

import math
import statistics
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


def synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """`fn` followed by a device synchronisation (for wall-clock timers such as pytest-benchmark)."""
    def call():
        r = fn()
        synchronize(device)
        return r
    return call


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


def rotation_count(bytes_per_set: int | None, device: str, max_sets: int = 2, mem_cap: int = 2 << 30) -> int:
    """Input sets to cycle through on the CPU, so that together they exceed twice the cache (at most
    `max_sets`). One on GPUs: do_bench flushes the L2 cache before every timed call."""
    if device_kind(device) != "cpu":
        return 1
    if not bytes_per_set:
        return max_sets
    want = math.ceil(2 * l2_bytes(device) / bytes_per_set)
    cap = max(1, mem_cap // bytes_per_set)
    return int(max(1, min(max_sets, want, cap)))


@dataclass(frozen=True)
class Budget:
    """How long one case is timed. `min_reps`: samples wanted; `min_time` (s): least timed time on the CPU;
    `max_time` (s): stop adding samples after this; `warmup`: untimed calls first on the CPU (GPUs warm
    up for `warmup_ms`); `rep_ms`: do_bench's timed window per pass on GPUs."""
    min_reps: int = 20
    min_time: float = 0.25
    max_time: float = 10.0
    warmup: int = 1
    warmup_ms: float = 25.0
    rep_ms: float = 100.0

    def __post_init__(self):
        from reference.validate import fail
        if not (isinstance(self.min_reps, int) and self.min_reps >= 1):
            fail("reps", "an int >= 1", self.min_reps)
        if not (self.min_time >= 0 and self.max_time > 0):
            fail("min_time/max_time", "min_time >= 0 and max_time > 0", f"{self.min_time}/{self.max_time}")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            fail("warmup", "an int >= 0", self.warmup)


@dataclass
class Timing:
    """One case's figures: eager always; CUDA graph where it was asked for and the call could be captured;
    the launches of an eager call (`profile_launches`) where they were asked for, or why they are missing."""
    eager: Stats
    graph: Stats | None = None
    graph_error: str | None = None
    timer: str = "perf_counter"
    kernels: list | None = None
    kernels_source: str | None = None
    kernels_error: str | None = None
    launch: Stats | None = None
    launch_new: Stats | None = None
    launch_new_error: str | None = None

    def fields(self, graph: bool = False) -> dict:
        """The timing record's fields with the eager (graph=False) or CUDA-graph figures as the primary
        ms_p20/ms_p50/ms_p80; both p50s and the host overhead (eager - graph) in every record."""
        st = self.graph if graph else self.eager
        if st is None:
            raise ValueError("graph: expected a CUDA-graph timing, got none (not asked for, or capture failed)")
        out = dict(ms_p20=st.ms_p20, ms_p50=st.ms_p50, ms_p80=st.ms_p80, reps=st.n, cuda_graph=graph,
                   eager_ms_p50=self.eager.ms_p50,
                   timer=("do_bench_cudagraph" if graph else self.timer))
        if self.graph is not None:
            out.update(graph_ms_p50=self.graph.ms_p50, host_ms=self.eager.ms_p50 - self.graph.ms_p50)
        if self.launch is not None:
            out["launch_ms"] = self.launch.ms_p50
        if self.launch_new is not None:
            out["launch_new_ms"] = self.launch_new.ms_p50
        if self.launch_new_error:
            out["launch_new_error"] = self.launch_new_error
        if self.graph_error:
            out["graph_error"] = self.graph_error
        if not graph:  # the profiled calls are eager ones
            for k in ("kernels", "kernels_source", "kernels_error"):
                if getattr(self, k) is not None:
                    out[k] = getattr(self, k)
        return out


def cpu_samples(fns: Sequence[Callable[[], object]], budget: Budget) -> list[float]:
    """Per-call milliseconds on the CPU, cycling through `fns`, until `budget` is met."""
    for i in range(budget.warmup):
        fns[i % len(fns)]()
    out: list[float] = []
    t_start = time.perf_counter()
    i = 0
    while True:
        t0 = time.perf_counter_ns()
        fns[i % len(fns)]()
        out.append((time.perf_counter_ns() - t0) / 1e6)
        i += 1
        spent = time.perf_counter() - t_start
        if (len(out) >= budget.min_reps and spent >= budget.min_time) or spent >= budget.max_time:
            return out


def gpu_samples(fn: Callable[[], object], budget: Budget) -> list[float]:
    """Per-call milliseconds from triton.testing.do_bench (see the module docstring)."""
    from triton.testing import do_bench
    t0 = time.perf_counter()
    ms = list(do_bench(fn, warmup=budget.warmup_ms, rep=budget.rep_ms, return_mode="all"))
    while len(ms) < budget.min_reps and time.perf_counter() - t0 < budget.max_time:
        need = budget.min_reps - len(ms)
        ms += do_bench(fn, warmup=0, rep=max(need * statistics.median(ms), 1e-3), return_mode="all")
    return ms


LAUNCH_BURSTS = 7        # bursts timed per case
LAUNCH_MIN_BURSTS = 3    # ... at least, when the bursts of a slow call take over LAUNCH_MAX_S seconds
LAUNCH_MAX_S = 1.0
LAUNCH_BURST_MS = 2.0    # device time a burst may queue: calls per burst = this / the eager p50, 1 to 8


def launch_samples(fn: Callable[[], object], device: str, eager_ms: float, bursts: int = LAUNCH_BURSTS) -> list[float]:
    """Per-call milliseconds the host spends issuing `fn` (see the module docstring): `bursts` bursts of
    calls (LAUNCH_MIN_BURSTS once LAUNCH_MAX_S seconds are spent), as many per burst as fit LAUNCH_BURST_MS of
    device time at `eager_ms` per call (1 to 8)."""
    calls = max(1, min(8, int(LAUNCH_BURST_MS / eager_ms) if eager_ms > 0 else 8))
    out: list[float] = []
    t_start = time.perf_counter()
    for _ in range(bursts):
        if len(out) >= LAUNCH_MIN_BURSTS and time.perf_counter() - t_start > LAUNCH_MAX_S:
            break
        synchronize(device)
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter_ns() - t0) / 1e6 / calls)
    synchronize(device)
    return out


NEW_SHAPE_CALLS = 8       # calls at new token counts per case
NEW_SHAPE_MAX_S = 3.0     # ... fewer (at least LAUNCH_MIN_BURSTS) once these seconds are spent: a kernel that tunes
                          # itself per shape takes seconds per call, and that is then its figure; one compile of a
                          # new specialisation class (a chunk count past a multiple of 16) leaves the median alone


def new_shape_launch_samples(make: Callable[[int], Callable[[], object]], device: str,
                             calls: int = NEW_SHAPE_CALLS) -> list[float]:
    """Per-call milliseconds the host spends issuing a call not made before: `make(i)` builds the i-th call
    (its inputs; untimed), then the device is drained and the call timed with `time.perf_counter_ns`, alone.
    `calls` calls, fewer (at least LAUNCH_MIN_BURSTS) once NEW_SHAPE_MAX_S seconds are spent."""
    out: list[float] = []
    t_start = time.perf_counter()
    for i in range(calls):
        if len(out) >= LAUNCH_MIN_BURSTS and time.perf_counter() - t_start > NEW_SHAPE_MAX_S:
            break
        fn = make(i)
        synchronize(device)
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e6)
        del fn
    synchronize(device)
    return out


def graph_samples(fn: Callable[[], object], budget: Budget) -> list[float]:
    """Per-call milliseconds of CUDA-graph replays from triton.testing.do_bench_cudagraph."""
    from triton.testing import do_bench_cudagraph
    t0 = time.perf_counter()
    ms: list[float] = []
    while not ms or (len(ms) < budget.min_reps and time.perf_counter() - t0 < budget.max_time):
        ms += do_bench_cudagraph(fn, rep=budget.rep_ms, return_mode="all")
    return ms


def measure(fns: Sequence[Callable[[], object]] | Callable[[], object], device: str, budget: Budget | None = None,
            *, graph: bool = False) -> Timing:
    """Time zero-argument calls on `device`: eager always, CUDA-graph replays too when `graph` (CUDA only).
    `fns`: one callable or one per input set (the CPU cycles through them; GPUs use the first). A call
    that cannot be captured keeps its eager figures and says why in `graph_error`."""
    fns = [fns] if callable(fns) else list(fns)
    if not fns:
        raise ValueError("fns: expected at least one callable, got none")
    budget = budget or Budget()
    kind = device_kind(device)
    if graph and kind != "cuda":
        raise ValueError(f"graph: expected a CUDA device for CUDA-graph timing, got {device}")
    if kind == "cpu":
        return Timing(eager=summarize(cpu_samples(fns, budget)), timer="perf_counter")
    eager = summarize(gpu_samples(fns[0], budget))
    t = Timing(eager=eager, timer="do_bench", launch=summarize(launch_samples(fns[0], device, eager.ms_p50)))
    if graph:
        try:
            t.graph = summarize(graph_samples(fns[0], budget))
        except Exception as e:  # noqa: BLE001 - a call that cannot be captured still has its eager figure
            t.graph_error = f"{type(e).__name__}: {str(e)[:300]}"
            try:
                synchronize(device)
            except Exception:  # noqa: BLE001 - the failed capture's error is the one reported
                pass
    return t


KERNEL_CALLS = 10        # profiled calls per case
KERNELS_KEPT = 20        # entries kept per case, largest first
KERNEL_NAME_CHARS = 80   # a kernel name longer than this is cut (C++ template names run to hundreds)
_PROFILER_ACTIVITY = {"cpu": (), "cuda": ("CUDA",), "xpu": ("XPU",)}


def _short_name(name: str) -> str:
    return name if len(name) <= KERNEL_NAME_CHARS else name[:KERNEL_NAME_CHARS - 3] + "..."


def profile_launches(fns: Sequence[Callable[[], object]] | Callable[[], object], device: str,
                     calls: int = KERNEL_CALLS, warmup: int = 1) -> tuple[str, list[dict]]:
    """What one call costs, launch by launch: `warmup` untimed calls, then `calls` calls (cycling through
    `fns`) under torch.profiler. Returns (source, entries), each entry {"name", "us": time per call in
    microseconds, "calls": launches per call}, largest first, at most `KERNELS_KEPT`:
    on CUDA (XPU) source "cuda" ("xpu"), the device activity (kernels, memcpy, memset) grouped by name;
    on the CPU, where nothing is launched, source "cpu", the operators grouped by name with their self
    CPU time. RuntimeError when the profiler recorded nothing (a profiler that cannot see the device)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from reference.validate import fail
    fns = [fns] if callable(fns) else list(fns)
    if not fns:
        fail("fns", "at least one callable", "none")
    if not (isinstance(calls, int) and calls >= 1):
        fail("calls", "an int >= 1", calls)
    if not (isinstance(warmup, int) and warmup >= 0):
        fail("warmup", "an int >= 0", warmup)
    kind = device_kind(device)
    if kind not in _PROFILER_ACTIVITY:
        fail("device", f"a device of kind {'/'.join(_PROFILER_ACTIVITY)}", device)
    activities = [ProfilerActivity.CPU] + [getattr(ProfilerActivity, a) for a in _PROFILER_ACTIVITY[kind]]
    for i in range(warmup):
        fns[i % len(fns)]()
    synchronize(device)
    with profile(activities=activities) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        synchronize(device)
    per: dict[str, list] = {}
    for e in prof.events():
        # (FunctionEvent has no activity_type nor is_python_function before torch 2.12)
        if getattr(e, "is_user_annotation", False) or "annotation" in str(getattr(e, "activity_type", "") or ""):
            continue
        if kind == "cpu":
            if e.device_type != DeviceType.CPU or e.is_async or getattr(e, "is_python_function", False):
                continue
            us = e.self_cpu_time_total
        else:
            if e.device_type == DeviceType.CPU:
                continue
            us = e.time_range.elapsed_us()
        acc = per.setdefault(e.name, [0.0, 0])
        acc[0] += us
        acc[1] += 1
    entries = [dict(name=_short_name(name), us=round(us / calls, 3), calls=round(n / calls, 3))
               for name, (us, n) in per.items() if us > 0]
    entries.sort(key=lambda d: -d["us"])
    if not entries:
        what = "operator" if kind == "cpu" else "device activity"
        raise RuntimeError(f"torch.profiler recorded no {what} over {calls} call(s) on {device}")
    return kind, entries[:KERNELS_KEPT]


def wall_samples(fn: Callable[[], object], device: str, reps: int = 1) -> list[float]:
    """Wall-clock milliseconds of `reps` one-shot calls (each synchronised), for work that is timed whole
    (a checkpoint load): no warm-up, no cycling."""
    if not (isinstance(reps, int) and reps >= 1):
        from reference.validate import fail
        fail("reps", "an int >= 1", reps)
    out = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out
