"""Run the benchmark matrix: cases from the declarations, timed per device, records appended to JSONL.

Order: the copy roofline first (its GB/s is the 100% of `pct_copy_bw`), then every (backend, shape,
dtype). Each case builds `rotation_count` input sets (on the CPU, so together they exceed twice the
cache; one on GPUs, where the timer flushes the L2 cache), calls the backend once with the op's index
checks on (that call also validates the inputs), then times it with `harness.bench.timing.measure`
inside `harness.ops.no_index_checks()` (host-side checks would synchronise, and peers don't do them).
On CUDA every case is timed eager and as CUDA-graph replays: two records (cuda_graph false / true), each
carrying both p50s and the host overhead; a call that cannot be captured has only the eager record,
with `graph_error`. With `kernels` (`harness bench --kernels`), each timed case is then called a few times
more under torch.profiler (`harness.bench.timing.profile_launches`, outside the timing) and its eager
record gets `kernels`, the cost of each launch per call, largest first, and `kernels_source` ("cuda":
device activity; "cpu": operators by self CPU time); a profile that fails leaves the timing and records
`kernels_error`. A case that raises is recorded with its error (and no numbers) so the gate reports
it; the run goes on.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from harness.bench import metrics as _metrics  # noqa: F401 - registers the built-in metrics
from harness.bench.bytes import op_bytes
from harness.bench.registry import METRICS, OP_INPUTS, Benchmark, benchmarks_for
from harness.bench.timing import (KERNEL_CALLS, Budget, measure, new_shape_launch_samples, profile_launches,
                                   rotation_count, summarize, synchronize)


@dataclass
class Case:
    bench: Benchmark
    shape: dict
    dtype: torch.dtype
    device: str
    tokens: int | None = None
    bytes: int | None = None
    cuda_graph: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def op(self) -> str:
        return self.bench.op

    @property
    def impl(self) -> str:
        return self.bench.impl

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def id(self) -> str:
        shape = ",".join(f"{k}={v}" for k, v in self.shape.items())
        return f"{self.bench.id}[{self.dtype_name},{shape}]"


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def case_key(bench: str, dtype: str, shape: dict) -> tuple:
    """What identifies a timed case across runs: bench id, dtype name, shape."""
    return bench, dtype, tuple(sorted((str(k), str(v)) for k, v in (shape or {}).items()))


def timed_cases(path: str, retime=()) -> set:
    """The case keys a records file times without an error (a torn last line is ignored), but those of the
    ops in `retime`."""
    from harness.records import read_records
    return {case_key(r.get("bench"), r.get("dtype"), r.get("shape")) for r in read_records(path, ["timing"],
                                                                                           on_torn=lambda _: None)
            if not r.get("error") and r.get("op") not in retime}


def build_cases(device: str, *, impls=None, ops=None, dtypes=None, cuda_graph: bool = False,
                include_interpreted: bool = False, max_tokens: int | None = None,
                done: set | None = None) -> tuple[list[Case], list[str]]:
    """The cases to time; `done`: case keys (`timed_cases`) left out, the copy roofline excepted."""
    benches, skipped = benchmarks_for(device, impls=impls, ops=ops, include_interpreted=include_interpreted)
    if ops and "copy" not in ops:  # the roofline is measured in every run
        copy, _ = benchmarks_for(device, ops=["copy"])
        benches = copy + benches
    cases = []
    for b in benches:
        spec = OP_INPUTS[b.op]
        shapes = spec.shapes_for(device) if b.shapes is None else \
            (b.shapes.get(device.split(":")[0]) or b.shapes.get("gpu") or [])
        for shape in shapes:
            tokens = spec.tokens(shape)
            if max_tokens and tokens and tokens > max_tokens:
                continue
            for dt in spec.dtypes_for(device):
                if dtypes and b.op != "copy" and dt not in dtypes:
                    continue
                cases.append(Case(bench=b, shape=dict(shape), dtype=dt, device=device, tokens=tokens,
                                  cuda_graph=cuda_graph and b.op != "copy" and device.startswith("cuda")))
        if not shapes:
            skipped.append(f"{b.id}: no shapes declared for {device.split(':')[0]}")
    if dtypes:
        for d in dtypes:
            if not any(c.dtype == d for c in cases):
                skipped.append(f"--dtype {d}: no case declares it on {device}")
    if done:
        kept = [c for c in cases if c.op == "copy" or case_key(c.bench.id, c.dtype_name, c.shape) not in done]
        if len(kept) < len(cases):
            skipped.append(f"{len(cases) - len(kept)} case(s) timed by the run resumed")
        cases = kept
    cases.sort(key=lambda c: (c.op != "copy",))
    return cases, skipped


def clocks(device: str) -> dict:
    """Clocks where readable: GPU SM/memory clocks via nvidia-smi; CPU MHz from /proc or sysfs."""
    kind = device.split(":")[0]
    out: dict = {}
    if kind == "cuda":
        idx = device.split(":")[1] if ":" in device else "0"
        try:
            r = subprocess.run(["nvidia-smi", "-i", idx, "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,"
                                "clocks.max.mem,power.limit,temperature.gpu,driver_version",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            if r.returncode == 0 and r.stdout.strip():
                vals = [v.strip() for v in r.stdout.strip().splitlines()[0].split(",")]
                keys = ["sm_mhz", "mem_mhz", "max_sm_mhz", "max_mem_mhz", "power_limit_w", "temp_c", "driver"]
                out.update(dict(zip(keys, vals)))
        except (OSError, subprocess.SubprocessError):
            pass
    elif kind == "cpu":
        try:
            with open("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq") as f:
                out["cpu_mhz"] = int(f.read().strip()) / 1000
        except OSError:
            try:
                with open("/proc/cpuinfo") as f:
                    for line in f:
                        if line.lower().startswith("cpu mhz"):
                            out["cpu_mhz"] = float(line.split(":")[1])
                            break
            except OSError:
                pass
        out["threads"] = torch.get_num_threads()
    return out


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True, leave=False)


def _generator(device: str, seed: int) -> torch.Generator:
    """The generator a case's inputs are drawn with: on the GPU for CUDA and XPU devices, else on the CPU."""
    gen = torch.Generator(device=device if device.split(":")[0] in ("cuda", "xpu") else "cpu")
    gen.manual_seed(seed)
    return gen


def case_inputs(case: Case, seed: int = 0, rotate: int | None = None) -> tuple[list[dict], list]:
    """The case's input sets and one backend callable per set (sets `case.bytes`)."""
    spec = OP_INPUTS[case.op]
    device = case.device
    gen = _generator(device, seed)
    first = spec.make(case.shape, case.dtype, device, gen)
    case.bytes = op_bytes(case.op, first)
    n_sets = rotate or rotation_count(case.bytes, device)
    sets = [first] + [spec.make(case.shape, case.dtype, device, gen) for _ in range(n_sets - 1)]
    return sets, [case.bench.fn(s) for s in sets]


def _new_token_calls(case: Case, seed: int):
    """`make(i)` for `new_shape_launch_samples`: the case's call at T + 16 (i + 1) tokens, inputs drawn anew."""
    spec = OP_INPUTS[case.op]
    gen = _generator(case.device, seed + 1)

    def make(i: int):
        shape = {**case.shape, "T": case.shape["T"] + 16 * (i + 1)}
        return case.bench.fn(spec.make(shape, case.dtype, case.device, gen))
    return make


def measure_case(case: Case, budget: Budget, *, seed: int = 0, rotate: int | None = None, kernels: int = 0):
    """Time one case (eager, and CUDA graph when `case.cuda_graph`); returns (Timing, number of input sets).
    `kernels` > 0: then profile that many further calls (`profile_launches`) into the Timing's `kernels`
    (or `kernels_error` when the profile fails: the timing stands)."""
    from harness.ops import no_index_checks
    sets, fns = case_inputs(case, seed, rotate)
    fns[0]()  # checked call: validates the inputs, compiles, fails loudly
    synchronize(case.device)
    with no_index_checks():
        t = measure(fns, case.device, budget, graph=case.cuda_graph)
        if t.launch is not None and "T" in case.shape:
            try:
                t.launch_new = summarize(new_shape_launch_samples(_new_token_calls(case, seed), case.device))
            except Exception as e:  # noqa: BLE001 - the timing stands; why this figure is missing is kept
                t.launch_new_error = f"{type(e).__name__}: {str(e)[:300]}"
                try:
                    synchronize(case.device)
                except Exception:  # noqa: BLE001 - the first error is the one reported
                    pass
        if kernels:
            try:
                t.kernels_source, t.kernels = profile_launches(fns, case.device, calls=kernels)
            except Exception as e:  # noqa: BLE001 - a failed profile leaves the timing as measured
                t.kernels_error = f"{type(e).__name__}: {str(e)[:300]}"
                try:
                    synchronize(case.device)
                except Exception:  # noqa: BLE001 - the profile's error is the one reported
                    pass
    return t, len(sets)


def _apply_metrics(case: Case, fields: dict, ctx: dict) -> None:
    for name, m in METRICS.items():
        fields[name] = m.fn(case, fields["ms_p50"], ctx)


def run_benchmarks(device: str, out_path: str | None, *, impls=None, ops=None, dtypes=None,
                   budget: Budget | None = None, cuda_graph: bool | None = None, progress: bool = True, seed: int = 0,
                   include_interpreted: bool = False, max_tokens: int | None = None, run_id: str | None = None,
                   log=print, env_extra: dict | None = None, done: set | None = None,
                   kernels: bool | int = False) -> list[dict]:
    """Run every case; append records to `out_path` (env first); return the timing records.
    `cuda_graph`: also time CUDA-graph replays (default: on CUDA devices). `kernels`: profile each timed
    case's launches into its eager record (True: `KERNEL_CALLS` calls; an int: that many)."""
    from harness.env import environment
    from harness.records import RecordWriter
    budget = budget or Budget()
    if kernels is not True and kernels is not False and not (isinstance(kernels, int) and kernels >= 0):
        from reference.validate import fail
        fail("kernels", "a bool or an int >= 0", kernels)
    kernel_calls = KERNEL_CALLS if kernels is True else int(kernels)
    if cuda_graph is None:
        cuda_graph = device.startswith("cuda")
    cases, skipped = build_cases(device, impls=impls, ops=ops, dtypes=dtypes, cuda_graph=cuda_graph,
                                 include_interpreted=include_interpreted, max_tokens=max_tokens, done=done)
    for s in skipped:
        log(f"harness bench: skipped {s}")
    if not [c for c in cases if c.op != "copy"] and done:
        log("harness bench: every case is timed in the run resumed: nothing left")
        return []
    if not [c for c in cases if c.op != "copy"]:
        raise ValueError(f"benchmarks: expected at least one case on {device} "
                         f"(impls={impls or 'all'}, ops={ops or 'all'}), got none")
    writer = RecordWriter(out_path, run_id=run_id or os.environ.get("HARNESS_RUN_ID")) if out_path else None
    if writer:
        env = environment(device)
        env["clocks"] = clocks(device)
        writer.write("env", env=env, bench=dict(min_reps=budget.min_reps, min_time=budget.min_time,
                                                 max_time=budget.max_time, warmup=budget.warmup,
                                                 cuda_graph=cuda_graph, seed=seed, cases=len(cases),
                                                 kernel_calls=kernel_calls,
                                                 **(env_extra or {})))
    ctx: dict = {}
    records = []
    bar = _progress(len(cases), progress)
    try:
        for case in cases:
            if bar is not None:
                bar.set_description(case.id[:60])
            base = dict(bench=case.bench.id, op=case.op, impl=case.impl, device=device, dtype=case.dtype_name,
                        shape=case.shape, tokens=case.tokens, peer=case.bench.peer, cuda_graph=False,
                        level=OP_INPUTS[case.op].level)
            rows = []
            try:
                t, n_sets = measure_case(case, budget, seed=seed, kernels=kernel_calls)
            except Exception as e:  # noqa: BLE001 - a broken backend is reported, the run goes on
                fields = dict(base, ms_p20=None, ms_p50=None, ms_p80=None, tok_s=None, bytes=case.bytes, gb_s=None,
                              pct_copy_bw=None, error=f"{type(e).__name__}: {str(e)[:500]}")
                log(f"harness bench: {case.id}: {fields['error']}")
                rows.append(fields)
            else:
                for graph in ((False, True) if t.graph is not None else (False,)):
                    fields = dict(base, **t.fields(graph), input_sets=n_sets, bytes=case.bytes)
                    _apply_metrics(case, fields, ctx)
                    if case.op == "copy" and fields.get("gb_s"):
                        ctx["copy_gb_s"] = max(ctx.get("copy_gb_s", 0.0), fields["gb_s"])
                        fields["pct_copy_bw"] = 100.0 * fields["gb_s"] / ctx["copy_gb_s"]
                    rows.append(fields)
                if t.graph_error:
                    log(f"harness bench: {case.id}: no CUDA-graph timing ({t.graph_error[:200]})")
                if t.kernels_error:
                    log(f"harness bench: {case.id}: no launch profile ({t.kernels_error[:200]})")
            for fields in rows:
                if writer:
                    writer.write("timing", **fields)
                records.append(fields)
            if bar is not None:
                bar.update(1)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        if bar is not None:
            bar.close()
    return records


def _table_order(records: list[dict]) -> list[dict]:
    """The eager records, sorted by op (the copy roofline first), dtype, shape, then implementation."""
    rows = [r for r in records if not r.get("cuda_graph")]
    rows.sort(key=lambda r: (r["op"] != "copy", r["op"], r["dtype"], r.get("tokens") or 0, str(r["shape"]),
                             r["peer"], r["impl"]))
    return rows


def format_kernels(records: list[dict], top: int = 3) -> str:
    """A second table, for the records that carry a launch profile (`--kernels`): per case, its `top`
    launches by time per call with their launches per call (or why the profile is missing); "" when no
    record has one."""
    rows = [r for r in _table_order(records) if r.get("kernels") or r.get("kernels_error")]
    if not rows:
        return ""
    sources = sorted({r["kernels_source"] for r in rows if r.get("kernels_source")})
    what = {"cpu": "cpu: operators by self CPU time", "cuda": "cuda: device time of kernels, copies, memsets",
            "xpu": "xpu: device time of kernels, copies, memsets"}
    lines = [f"launches, top {top} of each case ({'; '.join(what.get(s, s) for s in sources) or '-'}); "
             f"us and launches per call:"]
    for r in rows:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        ks = r.get("kernels") or []
        total = sum(k["us"] for k in ks)
        head = f"{r['op']} {r['impl'] + ('*' if r['peer'] else '')} {r['dtype']} {shape}"
        if r.get("kernels_error"):
            lines.append(f"{head}: no profile: {r['kernels_error'][:120]}")
            continue
        lines.append(f"{head}: {total:.4g} us per call over {len(ks)} name(s)")
        for k in ks[:top]:
            lines.append(f"  {k['us']:10.4g} us {format(k['calls'], 'g'):>5s}x  {k['name']}")
    return "\n".join(lines)


def format_table(records: list[dict]) -> str:
    """A terminal table, one row per case, peers side by side (sorted by op, dtype, shape, then
    implementation): eager p50 with its p20-p80, the CUDA-graph p50, the host overhead and the host's launch
    time per call (repeated, and at a new token count) where timed;
    then, where records carry a launch profile, `format_kernels`."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)
    rows = _table_order(records)
    head = f"{'op':24s} {'impl':20s} {'dtype':9s} {'shape':40s} {'ms p50':>9s} {'[p20-p80]':>19s} " \
           f"{'graph':>9s} {'host':>8s} {'launch':>8s} {'new T':>8s} {'tok/s':>10s} {'GB/s':>8s} {'%copy':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        spread = f"[{f(r['ms_p20'], '.4g')}-{f(r['ms_p80'], '.4g')}]" if r.get("ms_p20") is not None else "-"
        impl = r["impl"] + ("*" if r["peer"] else "")
        err = f"  ERROR {r['error'][:60]}" if r.get("error") else ""
        lines.append(f"{r['op'][:24]:24s} {impl[:20]:20s} {r['dtype'][:9]:9s} {shape[:40]:40s} "
                     f"{f(r.get('ms_p50'), '.4g'):>9s} {spread:>19s} {f(r.get('graph_ms_p50'), '.4g'):>9s} "
                     f"{f(r.get('host_ms'), '.3g'):>8s} {f(r.get('launch_ms'), '.3g'):>8s} "
                     f"{f(r.get('launch_new_ms'), '.3g'):>8s} "
                     f"{f(r.get('tok_s'), '.4g'):>10s} "
                     f"{f(r.get('gb_s'), '.4g'):>8s} {f(r.get('pct_copy_bw'), '.3g'):>6s}{err}")
    lines.append("(* = peer implementation; graph = CUDA-graph replay p50, host = eager - graph, launch = the "
                 "host's time to issue one eager call, new T = one at a token count no call had before; ms)")
    kernels = format_kernels(records)
    return "\n".join(lines) + (f"\n\n{kernels}" if kernels else "")
