"""Loading runs for `harness gate` and `harness report`.

A RUN argument is one of
* a results file `*.jsonl` of our records (harness.records: env, comparison, timing);
* a run folder holding `results.jsonl` (suites) and/or `bench.jsonl` (benchmarks) and/or
  `bench-pytest.json` (pytest-benchmark output);
* a pytest-benchmark JSON file (`pytest suites/bench --benchmark-json=FILE`); its benchmarks become
  timing records (pytest-benchmark's q1/q3 stand in for p20/p80).

Anything else (a missing path, a line that is not a record, records of another schema version,
a JSON file that is not pytest-benchmark output, a run with nothing in it) raises `RunError` with a
message naming the path and what was expected; the CLI turns that into exit code 2.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from harness.records import ResultsFileError, read_records

RUN_FOLDER_FILES = ("results.jsonl", "bench.jsonl", "bench-pytest.json")


class RunError(ValueError):
    """A RUN argument that cannot be read as a run."""


def num(v) -> float | None:
    """A record's number (JSON may carry 'nan'/'inf' as strings); None when absent."""
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def shape_key(shape) -> str:
    """A canonical string for a shape dict (or list), used in case keys."""
    if shape is None:
        return ""
    if isinstance(shape, dict):
        return ",".join(f"{k}={shape_key(v) if isinstance(v, (dict, list)) else v}"
                        for k, v in sorted(shape.items()))
    if isinstance(shape, (list, tuple)):
        return "x".join(str(v) for v in shape)
    return str(shape)


@dataclass
class Run:
    path: str
    label: str
    envs: list = field(default_factory=list)        # the `env` payloads (dicts), first = main
    comparisons: list = field(default_factory=list)  # comparison records
    timings: list = field(default_factory=list)      # timing records
    sources: list = field(default_factory=list)      # files read

    @property
    def env(self) -> dict:
        return self.envs[0] if self.envs else {}

    @property
    def run_id(self) -> str:
        for r in self.comparisons + self.timings:
            if r.get("run_id"):
                return r["run_id"]
        return self.label

    @property
    def device_kind(self) -> str:
        dev = self.env.get("device")
        if not dev:
            devs = {str(r.get("device", "")) for r in self.comparisons + self.timings if r.get("device")}
            dev = sorted(devs)[0] if devs else "unknown"
        return str(dev).split(":")[0]

    @property
    def device_name(self) -> str:
        return str(self.env.get("device_name") or self.device_kind)

    @property
    def device_id(self) -> str:
        """What must match between runs compared without --allow-cross-device."""
        return f"{self.device_kind} ({self.device_name})"

    def is_empty(self) -> bool:
        return not self.comparisons and not self.timings


def _env_payload(rec: dict) -> dict:
    env = dict(rec.get("env") or {})
    for k in ("profile", "hypothesis_seed", "impls", "clocks"):
        if k in rec and k not in env:
            env[k] = rec[k]
    return env


def _add_records(run: Run, path: str, recs: list[dict]) -> None:
    for r in recs:
        kind = r.get("kind")
        if kind == "env":
            env = _env_payload(r)
            if env not in run.envs:
                run.envs.append(env)
        elif kind == "comparison":
            run.comparisons.append(r)
        elif kind == "timing":
            run.timings.append(r)
        else:
            raise RunError(f"{path}: expected records of kind env/comparison/timing, got kind {kind!r}")
    run.sources.append(path)


def pytest_benchmark_to_records(data: dict, path: str = "<json>") -> tuple[dict, list[dict]]:
    """Convert pytest-benchmark JSON into (env payload, timing records)."""
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list) or "machine_info" not in data:
        raise RunError(f"{path}: expected pytest-benchmark JSON (keys 'machine_info', 'benchmarks'), "
                       f"got {'keys ' + str(sorted(data)[:6]) if isinstance(data, dict) else type(data).__name__}")
    mi = data.get("machine_info") or {}
    ci = data.get("commit_info") or {}
    timings = []
    device = None
    device_name = None
    for b in data["benchmarks"]:
        st = b.get("stats") or {}
        ex = dict(b.get("extra_info") or {})
        if "median" not in st:
            raise RunError(f"{path}: benchmark {b.get('name')!r}: expected stats.median, got {sorted(st)}")
        p50 = num(st["median"]) * 1e3
        p20 = num(st.get("q1", st["median"])) * 1e3
        p80 = num(st.get("q3", st["median"])) * 1e3
        tokens = ex.get("tokens")
        nbytes = ex.get("bytes")
        device = device or ex.get("device")
        device_name = device_name or ex.get("device_name")
        rec = {
            "schema": 1, "kind": "timing", "run_id": ex.get("run_id") or data.get("datetime", "pytest-benchmark"),
            "bench": ex.get("bench") or b.get("name"), "op": ex.get("op") or b.get("group") or b.get("name"),
            "impl": ex.get("impl") or b.get("param") or "?", "device": ex.get("device", "cpu"),
            "dtype": ex.get("dtype"), "shape": ex.get("shape") or b.get("params") or {},
            "tokens": tokens, "ms_p20": p20, "ms_p50": p50, "ms_p80": p80,
            "tok_s": (tokens / (p50 * 1e-3)) if tokens and p50 else None,
            "bytes": nbytes, "gb_s": (nbytes / (p50 * 1e-3) / 1e9) if nbytes and p50 else None,
            "pct_copy_bw": ex.get("pct_copy_bw"), "peer": bool(ex.get("peer", False)),
            "cuda_graph": bool(ex.get("cuda_graph", False)), "rounds": st.get("rounds"),
            "source": "pytest-benchmark",
        }
        timings.append(rec)
    cpu = mi.get("cpu") or {}
    env = {"git_sha": ci.get("id"), "python": mi.get("python_version"), "device": device or "cpu",
           "device_name": device_name or cpu.get("brand_raw") or mi.get("processor") or "cpu",
           "host": mi.get("node"), "platform": mi.get("platform") or mi.get("system"),
           "pytest_benchmark": data.get("version")}
    return env, timings


def _load_json(run: Run, path: str) -> None:
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: expected a pytest-benchmark JSON file, got {type(e).__name__}: {e}") from None
    env, timings = pytest_benchmark_to_records(data, path)
    if env not in run.envs:
        run.envs.append(env)
    run.timings.extend(timings)
    run.sources.append(path)


def _load_jsonl(run: Run, path: str) -> None:
    try:
        recs = read_records(path)
    except ResultsFileError as e:
        raise RunError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: expected a readable results file, got {type(e).__name__}: {e}") from None
    _add_records(run, path, recs)


def load_run(path: str, label: str | None = None, allow_empty: bool = False) -> Run:
    """Load one RUN argument (file or folder); see the module docstring."""
    if not isinstance(path, str) or not path:
        raise RunError(f"RUN: expected a results file, run folder or pytest-benchmark JSON, got {path!r}")
    p = os.path.abspath(path)
    if os.path.isdir(p):
        name = os.path.basename(p.rstrip(os.sep))
        run = Run(path=p, label=label or name)
        found = [f for f in RUN_FOLDER_FILES if os.path.isfile(os.path.join(p, f))]
        if not found:
            raise RunError(f"{path}: expected a run folder containing one of {list(RUN_FOLDER_FILES)}, "
                           f"got {sorted(os.listdir(p))[:8]}")
        for f in found:
            fp = os.path.join(p, f)
            (_load_json if f.endswith(".json") else _load_jsonl)(run, fp)
    elif os.path.isfile(p):
        base = os.path.basename(p)
        parent = os.path.basename(os.path.dirname(p))
        default_label = parent if base in RUN_FOLDER_FILES else os.path.splitext(base)[0]
        run = Run(path=p, label=label or default_label)
        if p.endswith(".json"):
            _load_json(run, p)
        else:
            _load_jsonl(run, p)
    else:
        raise RunError(f"{path}: expected a results file, run folder or pytest-benchmark JSON, got no such path")
    if not allow_empty and run.is_empty():
        raise RunError(f"{path}: expected a run with comparison or timing records, got an empty run")
    devs = {r.get("device", "").split(":")[0] for r in run.comparisons + run.timings if r.get("device")}
    if len(devs) > 1:
        raise RunError(f"{path}: expected records from one device kind, got {sorted(devs)}")
    return run


def load_runs(paths: list[str]) -> list[Run]:
    runs = [load_run(p) for p in paths]
    # Labels must be distinct (they head table columns).
    seen: dict[str, int] = {}
    for r in runs:
        if r.label in seen:
            seen[r.label] += 1
            r.label = f"{r.label}#{seen[r.label]}"
        else:
            seen[r.label] = 1
    return runs


def check_same_device(runs: list[Run], allow_cross_device: bool) -> None:
    """Runs from different devices are only compared with --allow-cross-device."""
    if allow_cross_device or len(runs) < 2:
        return
    ids = {r.device_id for r in runs}
    if len(ids) > 1:
        listing = "; ".join(f"{r.label}: {r.device_id}" for r in runs)
        raise RunError(f"runs: expected runs from one device (timings and tolerances are per device), got "
                       f"{listing}; pass --allow-cross-device to compare them anyway")


def finite(v) -> bool:
    x = num(v)
    return x is not None and math.isfinite(x)
