"""Loading runs for `harness gate` and `harness report`.

A RUN argument is one of
* a results file `*.jsonl` of our records (harness.records: env, comparison, timing);
* a run folder holding `results.jsonl` (suites) and/or `bench.jsonl` (benchmarks) and/or
  `bench-pytest.json` (pytest-benchmark output);
* a pytest-benchmark JSON file (`pytest suites/bench --benchmark-json=FILE`); its benchmarks become
  timing records (pytest-benchmark's q1/q3 stand in for p20/p80).

Anything else (a missing path, a line that is not a record, records of another schema version,
a JSON file that is not pytest-benchmark output, a run with nothing in it) raises `RunError` with a
message naming the path and what was expected; the CLI turns that into exit code 2. So does a record
whose field the gate or the report reads has the wrong type (`tolerance` a string, `error` a number,
`env` a list, a pytest-benchmark `median` of null, ...): the message names file, line (or benchmark),
field, what was expected and what came. Fields nobody reads are not checked.

A results file whose last line is torn (a writer killed mid-append, see harness.records) is read
without that line: the run keeps a message in `Run.warnings` and a `TornRecordWarning` is issued.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field

from harness.records import SCHEMA_VERSION, ResultsFileError, TornRecordWarning, read_numbered_records

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
    warnings: list = field(default_factory=list)     # what was skipped while reading (torn final lines)
    origin: dict = field(default_factory=dict)       # id(record) -> "file:line" (or "file: benchmark")

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

    def where(self, rec: dict) -> str:
        """The file and line a record was read from (the run's path for records built in memory)."""
        return self.origin.get(id(rec), self.path)


# ------------------------------------------------------------------------------ field checks
# What the gate and the report read from a record, and the JSON types it may have. A number may be
# written as one of the strings harness.records writes for non-finite floats.

_NONFINITE = ("nan", "inf", "-inf")
_NUM = "a number (or 'nan'/'inf'/'-inf') or null"
_STR = "a string or null"
_DICT = "an object or null"
_BOOL = "true, false or null"


def _is_num(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in _NONFINITE


def _is_str(v) -> bool:
    return v is None or isinstance(v, str)


def _is_dict(v) -> bool:
    return v is None or isinstance(v, dict)


def _is_bool(v) -> bool:
    return v is None or isinstance(v, bool)


_CHECKS = {"num": (_is_num, _NUM), "str": (_is_str, _STR), "dict": (_is_dict, _DICT), "bool": (_is_bool, _BOOL)}
_CASE = {"run_id": "str", "device": "str", "op": "str", "impl": "str", "dtype": "str"}
_FIELDS = {
    "env": {"env": "dict"},
    "comparison": {**_CASE, "test_id": "str", "name": "str", "err_ratio": "num", "max_abs_err": "num",
                   "tolerance": "dict", "reason": "str", "reproduce": "str"},
    "timing": {**_CASE, "bench": "str", "tok_s": "num", "gb_s": "num", "ms_p20": "num", "ms_p50": "num",
               "ms_p80": "num", "tokens": "num", "bytes": "num", "pct_copy_bw": "num", "error": "str",
               "peer": "bool", "cuda_graph": "bool", "kernels_source": "str", "kernels_error": "str"},
}
_KERNELS = "a list of objects {name, us, calls} or null"
_KERNEL_FIELDS = {"name": "str", "us": "num", "calls": "num"}
_ENV_FIELDS = {"device": "str", "device_name": "str", "git_sha": "str"}
_VERDICTS = ("pass", "fail")


def _bad(where: str, fld: str, expected: str, got) -> RunError:
    return RunError(f"{where}: field {fld!r}: expected {expected}, got {got!r}")


def _check_fields(where: str, obj: dict, spec: dict, prefix: str = "") -> None:
    for name, kind in spec.items():
        ok, expected = _CHECKS[kind]
        if name in obj and not ok(obj[name]):
            raise _bad(where, prefix + name, expected, obj[name])


def check_record(where: str, rec: dict) -> None:
    """RunError naming `where`, the field, what was expected and what came, for a record field of the
    wrong type (only fields the gate and the report read are checked)."""
    kind = rec.get("kind")
    if kind not in _FIELDS:
        raise _bad(where, "kind", "one of 'env', 'comparison', 'timing'", kind)
    _check_fields(where, rec, _FIELDS[kind])
    if kind == "env":
        _check_fields(where, rec.get("env") or {}, _ENV_FIELDS, "env.")
    elif kind == "comparison":
        if rec.get("verdict") not in _VERDICTS:
            raise _bad(where, "verdict", "'pass' or 'fail'", rec.get("verdict"))
        tol = rec.get("tolerance") or {}
        _check_fields(where, tol, {k: "num" for k in tol}, "tolerance.")
    elif kind == "timing" and rec.get("kernels") is not None:  # `harness bench --kernels`
        ks = rec["kernels"]
        if not isinstance(ks, list):
            raise _bad(where, "kernels", _KERNELS, ks)
        for i, k in enumerate(ks):
            if not isinstance(k, dict):
                raise _bad(where, f"kernels[{i}]", "an object {name, us, calls}", k)
            _check_fields(where, k, _KERNEL_FIELDS, f"kernels[{i}].")


def _env_payload(rec: dict) -> dict:
    env = dict(rec.get("env") or {})
    for k in ("profile", "hypothesis_seed", "impls", "clocks"):
        if k in rec and k not in env:
            env[k] = rec[k]
    return env


def _add_records(run: Run, path: str, recs: list[tuple[int, dict]]) -> None:
    for lineno, r in recs:
        where = f"{path}:{lineno}"
        check_record(where, r)
        run.origin[id(r)] = where
        kind = r.get("kind")
        if kind == "env":
            env = _env_payload(r)
            if env not in run.envs:
                run.envs.append(env)
        elif kind == "comparison":
            run.comparisons.append(r)
        elif kind == "timing":
            run.timings.append(r)
    run.sources.append(path)


_BENCH_EXTRA = {"bench": "str", "op": "str", "impl": "str", "dtype": "str", "device": "str", "device_name": "str",
                "run_id": "str", "tokens": "num", "bytes": "num", "pct_copy_bw": "num", "peer": "bool",
                "cuda_graph": "bool"}


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def pytest_benchmark_to_records(data: dict, path: str = "<json>") -> tuple[dict, list[dict]]:
    """Convert pytest-benchmark JSON into (env payload, timing records)."""
    env, timings = _pytest_benchmark(data, path)
    return env, [r for _, r in timings]


def _pytest_benchmark(data: dict, path: str) -> tuple[dict, list[tuple[str, dict]]]:
    """(env payload, [(where, timing record)]); RunError for anything that is not pytest-benchmark JSON."""
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list) or "machine_info" not in data:
        raise RunError(f"{path}: expected pytest-benchmark JSON (keys 'machine_info', 'benchmarks'), "
                       f"got {'keys ' + str(sorted(data)[:6]) if isinstance(data, dict) else type(data).__name__}")
    for name, want in (("machine_info", dict), ("commit_info", (dict, type(None)))):
        if not isinstance(data.get(name), want):
            raise _bad(path, name, "an object", data.get(name))
    mi = data["machine_info"]
    ci = data.get("commit_info") or {}
    _check_fields(path, mi, {"cpu": "dict", "python_version": "str", "node": "str", "processor": "str"},
                  "machine_info.")
    _check_fields(path, ci, {"id": "str"}, "commit_info.")
    timings = []
    device = None
    device_name = None
    for i, b in enumerate(data["benchmarks"]):
        where = f"{path}: benchmarks[{i}]"
        if not isinstance(b, dict):
            raise _bad(where, "benchmarks[]", "an object", b)
        _check_fields(where, b, {"name": "str"})
        where = f"{path}: benchmarks[{i}] ({b.get('name')!r})"
        _check_fields(where, b, {"group": "str", "param": "str", "params": "dict", "extra_info": "dict"})
        st = b.get("stats")
        if not isinstance(st, dict):
            raise _bad(where, "stats", "an object with 'median'", st)
        if "median" not in st:
            raise RunError(f"{where}: field 'stats.median': expected a number, got no such field "
                           f"(stats has {sorted(st)})")
        for k in ("median", "q1", "q3"):
            if k in st and not _real(st[k]):
                raise _bad(where, f"stats.{k}", "a number", st[k])
        ex = dict(b.get("extra_info") or {})
        _check_fields(where, ex, _BENCH_EXTRA, "extra_info.")
        p50 = st["median"] * 1e3
        p20 = st.get("q1", st["median"]) * 1e3
        p80 = st.get("q3", st["median"]) * 1e3
        tokens = num(ex.get("tokens"))
        nbytes = num(ex.get("bytes"))
        device = device or ex.get("device")
        device_name = device_name or ex.get("device_name")
        rec = {
            "schema": SCHEMA_VERSION, "kind": "timing",
            "run_id": ex.get("run_id") or data.get("datetime", "pytest-benchmark"),
            "bench": ex.get("bench") or b.get("name"), "op": ex.get("op") or b.get("group") or b.get("name"),
            "impl": ex.get("impl") or b.get("param") or "?", "device": ex.get("device") or "cpu",
            "dtype": ex.get("dtype"), "shape": ex.get("shape") or b.get("params") or {},
            "tokens": tokens, "ms_p20": p20, "ms_p50": p50, "ms_p80": p80,
            "tok_s": (tokens / (p50 * 1e-3)) if tokens and p50 else None,
            "bytes": nbytes, "gb_s": (nbytes / (p50 * 1e-3) / 1e9) if nbytes and p50 else None,
            "pct_copy_bw": ex.get("pct_copy_bw"), "peer": bool(ex.get("peer", False)),
            "cuda_graph": bool(ex.get("cuda_graph", False)), "rounds": st.get("rounds"),
            "source": "pytest-benchmark",
        }
        check_record(where, rec)
        timings.append((where, rec))
    cpu = mi.get("cpu") or {}
    env = {"git_sha": ci.get("id"), "python": mi.get("python_version"), "device": device or "cpu",
           "device_name": device_name or cpu.get("brand_raw") or mi.get("processor") or "cpu",
           "host": mi.get("node"), "platform": mi.get("platform") or mi.get("system"),
           "pytest_benchmark": data.get("version")}
    _check_fields(path, env, _ENV_FIELDS, "env.")
    return env, timings


def _load_json(run: Run, path: str) -> None:
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: expected a pytest-benchmark JSON file, got {type(e).__name__}: {e}") from None
    env, timings = _pytest_benchmark(data, path)
    if env not in run.envs:
        run.envs.append(env)
    for where, rec in timings:
        run.origin[id(rec)] = where
        run.timings.append(rec)
    run.sources.append(path)


def _load_jsonl(run: Run, path: str) -> None:
    torn: list[str] = []
    try:
        recs = read_numbered_records(path, on_torn=torn.append)
    except ResultsFileError as e:
        raise RunError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: expected a readable results file, got {type(e).__name__}: {e}") from None
    _add_records(run, path, recs)
    for msg in torn:
        run.warnings.append(msg)
        warnings.warn(TornRecordWarning(msg), stacklevel=2)


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
