"""`harness gate` and the run loader on hand-made runs: record -> case table -> findings -> exit code."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from harness.cli import main
from harness.gate import GateConfig, gate_runs
from harness.records import TornRecordWarning
from harness.report.runs import Run, RunError, load_run
from harness.testing.samples import make_run

SLOW_KEY = ("causal_conv1d_varlen", "triton", 1024)


@pytest.fixture
def runs(tmp_path):
    def mk(name, **kw):
        return make_run(str(tmp_path / f"{name}.jsonl"), **kw)
    return mk


def kinds(res, kind):
    return [f for f in res.findings if f.kind == kind]


def test_identical_runs_are_clean(runs):
    """A run gated against an identical run has no findings that gate, and exit code 0."""
    b = load_run(runs("base"))
    c = load_run(runs("cand"))
    res = gate_runs(b, c)
    assert res.regressions == []
    assert res.exit_code == 0
    assert res.stats["timings_matched"] == len(b.timings) and res.stats["comparisons_matched"] == 16


def test_planted_slowdown_is_flagged(runs):
    """A 10% tok/s drop of one case (p20-p80 spread 1%) is a performance regression of exactly that case."""
    res = gate_runs(load_run(runs("base")), load_run(runs("cand", slow={SLOW_KEY: 0.10})))
    perf = kinds(res, "performance")
    assert len(perf) == 1, res.findings
    assert "causal_conv1d_varlen" in perf[0].key and "triton" in perf[0].key and "T=1024" in perf[0].key
    assert perf[0].candidate == pytest.approx(0.9 * perf[0].baseline)
    assert res.exit_code == 1


def test_slowdown_within_noise_is_not_flagged(runs):
    """An 8% drop whose p20-p80 spread is 10% of the median does not gate (threshold 5% + noise 10%);
    the same drop with a 1% spread does."""
    noisy = {SLOW_KEY: 0.10}
    res = gate_runs(load_run(runs("base", noisy=noisy)), load_run(runs("cand", slow={SLOW_KEY: 0.08}, noisy=noisy)))
    assert kinds(res, "performance") == [] and res.exit_code == 0
    res = gate_runs(load_run(runs("base2")), load_run(runs("cand2", slow={SLOW_KEY: 0.08})))
    assert len(kinds(res, "performance")) == 1


@given(drop=st.floats(0.0, 0.6), spread=st.floats(0.0, 0.3), threshold=st.floats(0.0, 0.3))
def test_perf_threshold_widened_by_spread(drop, spread, threshold):
    """For any drop d, spread s and threshold t: flagged iff d > t + s (noise_k = 1), up to rounding."""
    assume(abs(drop - (threshold + spread)) > 1e-6)

    def timing(tok_s, sp):
        ms = 1000.0 / tok_s
        return {"kind": "timing", "bench": "b", "op": "op", "impl": "triton", "dtype": "bfloat16",
                "shape": {"T": 1024}, "tokens": 1, "tok_s": tok_s, "ms_p50": ms, "ms_p20": ms * (1 - sp / 2),
                "ms_p80": ms * (1 + sp / 2), "device": "cuda:0"}
    env = [{"device": "cuda", "device_name": "H200"}]
    b = Run("b", "b", envs=env, timings=[timing(1000.0, spread)])
    c = Run("c", "c", envs=env, timings=[timing(1000.0 * (1 - drop), 0.0)])
    res = gate_runs(b, c, GateConfig(perf_threshold=threshold))
    assert bool(kinds(res, "performance")) == (drop > threshold + spread)


def test_host_overhead_growth_gates_beyond_threshold_and_floor():
    """The eager record's host overhead (eager - graph p50) is watched: the same GPU time with 20 us more on
    the host gates as host-overhead; 4 us more (below the 5 us floor) does not; a CUDA-graph record never
    gates on it, and a negative floor is a usage error."""
    def timing(host_us, graph=False, ms=0.010):
        return {"kind": "timing", "bench": "op/triton", "op": "op", "impl": "triton", "dtype": "bfloat16",
                "shape": {"B": 64}, "tokens": 64, "tok_s": 64 / ms * 1000, "ms_p50": ms, "ms_p20": ms,
                "ms_p80": ms, "device": "cuda:0", "cuda_graph": graph, "host_ms": host_us / 1000}
    env = [{"device": "cuda", "device_name": "H200"}]

    def gate(base_us, cand_us, graph=False):
        b = Run("b", "b", envs=env, timings=[timing(base_us, graph)])
        c = Run("c", "c", envs=env, timings=[timing(cand_us, graph)])
        return gate_runs(b, c, GateConfig())
    res = gate(30.0, 50.0)
    (f,) = kinds(res, "host-overhead")
    assert "50.0 us above baseline 30.0 us" in f.detail and res.exit_code == 1
    assert kinds(gate(30.0, 34.0), "host-overhead") == []
    assert kinds(gate(30.0, 50.0, graph=True), "host-overhead") == []
    with pytest.raises(ValueError, match="--host-floor-us"):
        GateConfig(host_floor_us=-1.0).validate()


def test_launch_time_growth_gates_like_host_overhead():
    """The eager record's launch time (`launch_ms`, the host's time to issue one call, which the L2 flush of
    the eager timing can hide from eager - graph) is watched the same way: 20 us more gates as host-overhead
    and says "launch time"; 4 us more does not; a baseline without it gates nothing."""
    def timing(launch_us):
        r = {"kind": "timing", "bench": "op/triton", "op": "op", "impl": "triton", "dtype": "bfloat16",
             "shape": {"B": 64}, "tokens": 64, "tok_s": 6.4e6, "ms_p50": 0.01, "ms_p20": 0.01, "ms_p80": 0.01,
             "device": "cuda:0", "cuda_graph": False, "host_ms": 0.001}
        if launch_us is not None:
            r["launch_ms"] = launch_us / 1000
        return r
    env = [{"device": "cuda", "device_name": "H200"}]

    def gate(base_us, cand_us):
        return gate_runs(Run("b", "b", envs=env, timings=[timing(base_us)]),
                         Run("c", "c", envs=env, timings=[timing(cand_us)]), GateConfig())
    (f,) = kinds(gate(60.0, 80.0), "host-overhead")
    assert "launch time 80.0 us above baseline 60.0 us" in f.detail
    assert kinds(gate(60.0, 64.0), "host-overhead") == []
    assert kinds(gate(None, 80.0), "host-overhead") == []

    # a prefill's launch at a token count not seen before (`launch_new_ms`) likewise
    def gate_new(base_us, cand_us):
        b, c = timing(60.0), timing(60.0)
        b["launch_new_ms"], c["launch_new_ms"] = base_us / 1000, cand_us / 1000
        return gate_runs(Run("b", "b", envs=env, timings=[b]), Run("c", "c", envs=env, timings=[c]), GateConfig())
    (f,) = kinds(gate_new(150.0, 300.0), "host-overhead")
    assert "launch time at a new token count 300.0 us above baseline 150.0 us" in f.detail
    assert kinds(gate_new(150.0, 154.0), "host-overhead") == []


def test_reference_and_peer_timings_gate_only_when_asked():
    """A 50 % slowdown of the `reference` implementation (plain float64-oracle loops) or of a peer is listed
    but does not gate by default; --gate-reference / --gate-peers make it gate; ours always gates."""
    def timing(impl, tok_s, peer=False):
        ms = 1000.0 / tok_s
        return {"kind": "timing", "bench": f"op/{impl}", "op": "op", "impl": impl, "dtype": "float32",
                "shape": {"T": 64}, "tokens": 1, "tok_s": tok_s, "ms_p50": ms, "ms_p20": ms, "ms_p80": ms,
                "device": "cpu", "peer": peer}
    env = [{"device": "cpu", "device_name": "cpu"}]
    impls = (("reference", False), ("vllm", True), ("torch", False))
    b = Run("b", "b", envs=env, timings=[timing(i, 1000.0, p) for i, p in impls])
    c = Run("c", "c", envs=env, timings=[timing(i, 500.0, p) for i, p in impls])
    res = gate_runs(b, c, GateConfig())
    assert [f.key.split(" | ")[1] for f in kinds(res, "performance")] == ["torch"]
    assert len(kinds(res, "reference-slower")) == 1 and len(kinds(res, "peer-slower")) == 1
    res = gate_runs(b, c, GateConfig(gate_reference=True, gate_peers=True))
    assert len(kinds(res, "performance")) == 3


def test_planted_accuracy_regression_is_flagged(runs):
    """Comparisons that passed in the baseline and fail in the candidate are accuracy regressions."""
    reg = {("selective_scan_varlen", "triton", "bfloat16")}
    res = gate_runs(load_run(runs("base")), load_run(runs("cand", regress=reg)))
    acc = kinds(res, "accuracy")
    assert len(acc) == 2  # two shapes of that case
    assert all("selective_scan_varlen" in f.key and "triton" in f.key and "bfloat16" in f.key for f in acc)
    assert res.exit_code == 1
    # a case failing in both runs is still failing, not a regression
    res = gate_runs(load_run(runs("b2", regress=reg)), load_run(runs("c2", regress=reg)))
    assert kinds(res, "accuracy") == [] and len(kinds(res, "still-failing")) == 2 and res.exit_code == 0


def test_error_growth(runs):
    """A passing comparison whose error ratio grows beyond max(0.1 x tolerance, 2 x baseline) gates;
    growth under that limit does not."""
    key = ("causal_conv1d_varlen", "torch", "float32")  # baseline error = 0.01 x tolerance
    res = gate_runs(load_run(runs("base")), load_run(runs("cand", grow={key: 20.0})))
    assert len(kinds(res, "error-growth")) == 2 and res.exit_code == 1
    res = gate_runs(load_run(runs("b2")), load_run(runs("c2", grow={key: 5.0})))  # 0.05 x tol < floor
    assert kinds(res, "error-growth") == [] and res.exit_code == 0


def test_missing_cases_are_flagged(runs):
    """Cases of the baseline absent from the candidate (comparisons and timings) gate as missing."""
    res = gate_runs(load_run(runs("base")), load_run(runs("cand", drop={("selective_scan_varlen", "torch")})))
    missing = kinds(res, "missing")
    assert len(missing) == 4 + 3  # 2 dtypes x 2 shapes of comparisons + 3 lengths of timings
    assert all("selective_scan_varlen" in f.key and "torch" in f.key for f in missing)
    assert res.exit_code == 1


def test_redrawn_hypothesis_shapes_are_not_missing():
    """A comparison group present in both runs but with other (hypothesis-drawn) shapes is not missing;
    a failing example in a group that passed everywhere in the baseline is an accuracy regression."""
    def comp(shape, verdict="pass"):
        return {"kind": "comparison", "test_id": "t.py::test_x", "name": "y", "op": "op", "impl": "triton",
                "dtype": "float32", "shapes": {"x": [shape, 4]}, "err_ratio": 1e-6, "verdict": verdict,
                "tolerance": {"ratio": 2e-4}, "device": "cpu"}
    env = [{"device": "cpu", "device_name": "x"}]
    b = Run("b", "b", envs=env, comparisons=[comp(3), comp(5)])
    c = Run("c", "c", envs=env, comparisons=[comp(7), comp(9)])
    res = gate_runs(b, c)
    assert res.regressions == [] and res.stats["comparisons_redrawn"] == 2
    c = Run("c", "c", envs=env, comparisons=[comp(7), comp(9, "fail")])
    assert [f.kind for f in gate_runs(b, c).regressions] == ["accuracy"]


def test_cli_exit_codes(runs, tmp_path, capsys):
    """Exit codes: 0 clean, 1 regression, 2 unreadable input / cross-device / bad option; --json output."""
    base = runs("base")
    assert main(["gate", "--baseline", base, "--candidate", runs("same")]) == 0
    out = capsys.readouterr().out
    assert "gate: PASS" in out
    js = str(tmp_path / "gate.json")
    assert main(["gate", "--baseline", base, "--candidate", runs("slow", slow={SLOW_KEY: 0.10}), "--json", js]) == 1
    assert "gate: FAIL" in capsys.readouterr().out
    with open(js) as f:
        assert json.load(f)["exit_code"] == 1
    cpu = runs("cpu", device="cpu", device_name="x86_64")
    assert main(["gate", "--baseline", base, "--candidate", cpu]) == 2
    assert "--allow-cross-device" in capsys.readouterr().err
    assert main(["gate", "--baseline", base, "--candidate", cpu, "--allow-cross-device"]) in (0, 1)
    assert main(["gate", "--baseline", base, "--candidate", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such path" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": 1, "kind": "env"}\nnot json\n')
    assert main(["gate", "--baseline", base, "--candidate", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["gate", "--baseline", base, "--candidate", base, "--perf-threshold", "1.5"]) == 2
    assert "--perf-threshold" in capsys.readouterr().err


def test_loader_rejects_bad_runs(tmp_path):
    """Mixed schema versions, an empty run, non-benchmark JSON and an empty folder are clear RunErrors."""
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"schema": 1, "kind": "timing", "op": "a"}\n{"schema": 2, "kind": "timing", "op": "b"}\n')
    with pytest.raises(RunError, match="schema"):
        load_run(str(mixed))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"schema": 1, "kind": "env", "env": {"device": "cpu"}}\n')
    with pytest.raises(RunError, match="empty run"):
        load_run(str(empty))
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(RunError, match="pytest-benchmark"):
        load_run(str(other))
    (tmp_path / "folder").mkdir()
    with pytest.raises(RunError, match="run folder"):
        load_run(str(tmp_path / "folder"))


def _pytest_benchmark_json(path, median_s, q1, q3):
    data = {"machine_info": {"node": "h", "cpu": {"brand_raw": "Fake CPU"}}, "commit_info": {"id": "abc"},
            "version": "5.2.3", "datetime": "2026-11-29T00:00:00",
            "benchmarks": [{"name": "test_bench[conv-torch]", "group": None, "params": {},
                            "extra_info": {"bench": "causal_conv1d_varlen/torch", "op": "causal_conv1d_varlen",
                                           "impl": "torch", "dtype": "float32", "shape": {"T": 64, "D": 16},
                                           "tokens": 64, "bytes": 10000, "device": "cpu"},
                            "stats": {"median": median_s, "q1": q1, "q3": q3, "rounds": 10}}]}
    path.write_text(json.dumps(data))
    return str(path)


def test_pytest_benchmark_json_is_a_run(tmp_path):
    """pytest-benchmark JSON loads as timings (ms from seconds, tok/s from extra_info tokens) and gates."""
    b = _pytest_benchmark_json(tmp_path / "b.json", 1e-3, 0.99e-3, 1.01e-3)
    run = load_run(b)
    (t,) = run.timings
    assert t["ms_p50"] == pytest.approx(1.0) and t["tok_s"] == pytest.approx(64000.0)
    assert run.device_kind == "cpu" and run.env["device_name"] == "Fake CPU"
    c = _pytest_benchmark_json(tmp_path / "c.json", 1.25e-3, 1.24e-3, 1.26e-3)
    assert main(["gate", "--baseline", b, "--candidate", c]) == 1
    folder = tmp_path / "run1"
    folder.mkdir()
    os.rename(c, folder / "bench-pytest.json")
    assert main(["gate", "--baseline", b, "--candidate", str(folder)]) == 1


# ------------------------------------------------------------------------ bad input, torn files, broken timings

def _rewrite(src: str, dst, mutate) -> str:
    """Copy the records of `src` to `dst`, passing each (a dict) through `mutate` first."""
    with open(src) as f:
        recs = [json.loads(line) for line in f]
    with open(dst, "w") as f:
        for r in recs:
            mutate(r)
            f.write(json.dumps(r) + "\n")
    return str(dst)


def _first(kind, field, value):
    """A mutation setting `field` of the first record of `kind` (its 1-based line goes into `seen`)."""
    seen = {"n": 0, "line": None}

    def mutate(r):
        seen["n"] += 1
        if r["kind"] == kind and seen["line"] is None:
            seen["line"] = seen["n"]
            r[field] = value
    return mutate, seen


@pytest.mark.parametrize("kind,field,value,expected", [
    ("comparison", "tolerance", "tight", "an object or null"),
    ("comparison", "err_ratio", "small", "a number (or 'nan'/'inf'/'-inf') or null"),
    ("comparison", "verdict", 1, "'pass' or 'fail'"),
    ("timing", "error", 5, "a string or null"),
    ("timing", "tok_s", [1.0], "a number (or 'nan'/'inf'/'-inf') or null"),
    ("timing", "peer", "yes", "true, false or null"),
    ("timing", "kernels", "fast", "a list of objects {name, us, calls} or null"),
    ("timing", "kernels_error", {"why": "x"}, "a string or null"),
    ("env", "env", ["cuda", "H200"], "an object or null"),
])
def test_malformed_field_is_exit_2_naming_file_line_field(runs, tmp_path, capsys, kind, field, value, expected):
    """A record field of the wrong type is bad input: gate and report exit 2 (never 1, never a crash) with
    file, line, field, what was expected and what came."""
    base = runs("base")
    mutate, seen = _first(kind, field, value)
    bad = _rewrite(base, tmp_path / "bad.jsonl", mutate)
    want = f"bad.jsonl:{seen['line']}: field '{field}': expected {expected}, got {value!r}"
    assert main(["gate", "--baseline", base, "--candidate", bad]) == 2
    assert want in capsys.readouterr().err
    assert main(["gate", "--baseline", bad, "--candidate", base]) == 2
    assert want in capsys.readouterr().err
    out = tmp_path / "r.html"
    assert main(["report", base, bad, "-o", str(out)]) == 2 and not out.exists()
    assert want in capsys.readouterr().err


@pytest.mark.parametrize("value,field,expected", [
    ([{"name": "k", "us": 1.0, "calls": 1}, {"name": "m", "us": "slow", "calls": 1}], "kernels[1].us",
     "a number (or 'nan'/'inf'/'-inf') or null, got 'slow'"),
    ([{"name": 7, "us": 1.0, "calls": 1}], "kernels[0].name", "a string or null, got 7"),
    ([["k", 1.0, 1]], "kernels[0]", "an object {name, us, calls}, got ['k', 1.0, 1]"),
])
def test_malformed_launch_entry_is_exit_2_naming_it(runs, tmp_path, capsys, value, field, expected):
    """An entry of a timing's `kernels` list (`harness bench --kernels`) of the wrong type is bad input too:
    the message names the entry by its index."""
    base = runs("base")
    mutate, seen = _first("timing", "kernels", value)
    bad = _rewrite(base, tmp_path / "bad.jsonl", mutate)
    assert main(["gate", "--baseline", base, "--candidate", bad]) == 2
    assert f"bad.jsonl:{seen['line']}: field '{field}': expected {expected}" in capsys.readouterr().err
    out = tmp_path / "r.html"
    assert main(["report", bad, "-o", str(out)]) == 2 and not out.exists()


def test_malformed_pytest_benchmark_json_is_exit_2(tmp_path, capsys):
    """pytest-benchmark JSON with `median: null` (or extra_info of the wrong type) is exit 2 naming the
    benchmark and field, for the gate and the report."""
    good = _pytest_benchmark_json(tmp_path / "good.json", 1e-3, 0.99e-3, 1.01e-3)
    for name, edit, want in (
            ("median", lambda b: b["stats"].update(median=None), "field 'stats.median': expected a number, got None"),
            ("q3", lambda b: b["stats"].update(q3="slow"), "field 'stats.q3': expected a number, got 'slow'"),
            ("tokens", lambda b: b["extra_info"].update(tokens={}), "field 'extra_info.tokens': expected a number"),
            ("extra", lambda b: b.update(extra_info=[1]), "field 'extra_info': expected an object or null")):
        data = json.loads(open(good).read())
        edit(data["benchmarks"][0])
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps(data))
        assert main(["gate", "--baseline", good, "--candidate", str(bad)]) == 2, name
        err = capsys.readouterr().err
        assert f"{name}.json: benchmarks[0] ('test_bench[conv-torch]')" in err and want in err, err
        assert main(["report", good, str(bad), "-o", str(tmp_path / "r.html")]) == 2
        assert want in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", 0, -1.0, "-inf"])
def test_impossible_timings_fail_the_gate(runs, tmp_path, capsys, value):
    """A candidate whose timings are all NaN, 0 or negative fails (exit 1, one invalid-timing finding per
    timing case, naming file and line); the same numbers in the baseline fail the gate too; the report
    still renders both."""
    base = runs("base")

    def broken(r):
        if r["kind"] == "timing":
            for k in ("tok_s", "gb_s", "ms_p20", "ms_p50", "ms_p80"):
                r[k] = value
    cand = _rewrite(base, tmp_path / "cand.jsonl", broken)
    n_timings = len(load_run(base).timings)
    res = gate_runs(load_run(base), load_run(cand))
    inv = kinds(res, "invalid-timing")
    assert len(inv) == n_timings and res.exit_code == 1
    assert all(f.detail.startswith("candidate ") and "cand.jsonl:" in f.detail for f in inv)
    assert main(["gate", "--baseline", base, "--candidate", cand]) == 1
    assert "invalid-timing" in capsys.readouterr().out
    assert main(["gate", "--baseline", cand, "--candidate", base]) == 1
    assert "baseline " in capsys.readouterr().out
    assert main(["report", base, cand, "-o", str(tmp_path / "r.html")]) == 0


def test_timing_without_numbers_or_out_of_order_fails_the_gate(runs, tmp_path):
    """A timing with no tok/s, GB/s or ms (and no error), or with p20 > p50, cannot be judged: it gates,
    also as a case new in the candidate; a timing recorded with an error is not invalid."""
    base = load_run(runs("base"))

    def t(**kw):
        r = {"kind": "timing", "bench": "b", "op": "op", "impl": "triton", "dtype": "bfloat16", "shape": {"T": 8},
             "tokens": 8, "tok_s": 1e6, "ms_p20": 0.009, "ms_p50": 0.01, "ms_p80": 0.011, "device": "cuda:0"}
        r.update(kw)
        return r
    env = base.envs
    b = Run("b", "b", envs=env, timings=[t()])
    for bad in (t(tok_s=None, ms_p20=None, ms_p50=None, ms_p80=None), t(ms_p20=0.02)):
        assert [f.kind for f in gate_runs(b, Run("c", "c", envs=env, timings=[bad])).regressions] == ["invalid-timing"]
        new = Run("c", "c", envs=env, timings=[t(), dict(bad, bench="new")])
        assert [f.kind for f in gate_runs(b, new).regressions] == ["invalid-timing"]
    failed = t(tok_s=None, ms_p20=None, ms_p50=None, ms_p80=None, error="RuntimeError: boom")
    assert [f.kind for f in gate_runs(b, Run("c", "c", envs=env, timings=[failed])).regressions] == ["missing"]


@pytest.mark.parametrize("opt,value", [("--noise-k", "inf"), ("--noise-k", "nan"), ("--noise-k", "-1"),
                                       ("--err-k", "nan"), ("--err-k", "inf"), ("--err-k", "0.5"),
                                       ("--perf-threshold", "nan"), ("--perf-threshold", "-0.1"),
                                       ("--err-floor-frac", "inf"), ("--err-floor-frac", "-1")])
def test_thresholds_are_validated_before_reading(tmp_path, capsys, opt, value):
    """A NaN, infinite or out-of-range threshold (which would switch gating off) is exit 2 naming the option,
    before any file is read (the runs here do not exist)."""
    nope = str(tmp_path / "nope.jsonl")
    assert main(["gate", "--baseline", nope, "--candidate", nope, opt, value]) == 2
    err = capsys.readouterr().err
    assert f"{opt}: expected a finite" in err and "no such path" not in err
    with pytest.raises(ValueError, match=opt):
        GateConfig(**{opt[2:].replace("-", "_"): float(value)}).validate()


def test_internal_error_is_exit_2_not_1(runs, monkeypatch, capsys):
    """A failure inside the gate itself exits 2 with the error, never 1 (which means "regression")."""
    import harness.gate as gate_mod

    def boom(*a, **k):
        raise KeyError("unexpected")
    monkeypatch.setattr(gate_mod, "gate_runs", boom)
    base = runs("base")
    assert main(["gate", "--baseline", base, "--candidate", base]) == 2
    assert "internal error: KeyError" in capsys.readouterr().err


def test_torn_final_line_is_a_warning_torn_middle_line_an_error(runs, tmp_path, capsys):
    """A results file whose last record was cut by a killed writer gates and reports with a warning on
    stderr; a torn line before the last one is exit 2 naming file and line."""
    base = runs("base")
    with open(base, "rb") as f:
        data = f.read()
    cand = tmp_path / "cand.jsonl"
    cand.write_bytes(data + data.splitlines(True)[-1][:50])
    n = len(data.splitlines())
    assert main(["gate", "--baseline", base, "--candidate", str(cand)]) == 0
    cap = capsys.readouterr()
    assert f"harness gate: warning: {cand}:{n + 1}: skipped a torn final line" in cap.err and "gate: PASS" in cap.out
    with pytest.warns(TornRecordWarning, match=f"cand.jsonl:{n + 1}"):
        run = load_run(str(cand))
    assert len(run.warnings) == 1 and len(run.timings) == len(load_run(base).timings)
    with pytest.warns(TornRecordWarning):
        assert main(["report", base, str(cand), "-o", str(tmp_path / "r.html")]) == 0
    mid = tmp_path / "mid.jsonl"
    mid.write_bytes(data[:100] + b"\n" + data)
    assert main(["gate", "--baseline", base, "--candidate", str(mid)]) == 2
    assert "mid.jsonl:1: expected a JSON record" in capsys.readouterr().err
