"""The pytest plugin as a user meets it: device errors, records from xdist workers, impl selection."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from harness.records import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pytest_env():
    """The environment of a pytest run started from a test: not an xdist worker's, whatever this one is."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    env.pop("HARNESS_RUN_ID", None)
    return env


def _pytest(args, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=_pytest_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the property is about machines without")
def test_device_cuda_without_cuda_is_a_usage_error(tmp_path):
    """`--device cuda` on a machine without CUDA exits non-zero with a one-line reason, running nothing."""
    (tmp_path / "test_x.py").write_text("def test_x():\n    assert True\n")
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    r = _pytest(["--device", "cuda", "-q", str(tmp_path)], cwd=tmp_path)
    assert r.returncode != 0
    err = (r.stderr + r.stdout).strip().splitlines()
    assert any("--device cuda: no CUDA device" in line for line in err), r.stderr + r.stdout
    assert "passed" not in r.stdout


def test_records_from_xdist_workers_land_in_one_file(tmp_path):
    """Under -n 2, every comparison of every worker lands as one whole record in the one results file,
    after an env header per process."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_many.py").write_text(textwrap.dedent("""
        import pytest, torch
        @pytest.mark.parametrize("i", range(40))
        def test_cmp(i, check):
            x = torch.full((3,), float(i), dtype=torch.float64)
            check.close("x", x.float(), x, op="demo", seed=i)
    """))
    out = tmp_path / "r.jsonl"
    r = _pytest(["--device", "cpu", "-q", "-n", "2", "--results", str(out), str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = read_records(str(out))
    comps = [x for x in recs if x["kind"] == "comparison"]
    assert sorted(x["seed"] for x in comps) == list(range(40))
    assert all(x["verdict"] == "pass" and x["device"] == "cpu" and x["op"] == "demo" for x in comps)
    envs = [x for x in recs if x["kind"] == "env"]
    assert envs and all("torch" in x["env"] and "git_sha" in x["env"] for x in envs)
    assert len({x["run_id"] for x in recs}) == 1


def test_failing_comparison_is_recorded_and_fails(tmp_path):
    """A failing comparison writes a 'fail' record and fails the test with what/where/tolerance."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_bad.py").write_text(textwrap.dedent("""
        import torch
        def test_bad(check):
            b = torch.zeros(5, dtype=torch.float64)
            a = b.clone(); a[2] = 1.0
            check.close("y", a.float(), b, op="demo", seed=7)
    """))
    out = tmp_path / "r.jsonl"
    r = _pytest(["--device", "cpu", "-q", "--results", str(out), str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 1
    assert "worst at index (2,)" in r.stdout and "tolerance" in r.stdout
    (rec,) = [x for x in read_records(str(out)) if x["kind"] == "comparison"]
    assert rec["verdict"] == "fail" and rec["seed"] == 7 and rec["worst_index"] == [2]


def test_unknown_impl_is_a_usage_error(tmp_path):
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_x.py").write_text("def test_x(impl):\n    assert impl.name\n")
    r = _pytest(["--device", "cpu", "--impl", "no-such-impl", "-q", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 4 and "--impl: expected one of" in r.stderr


def test_outside_impl_by_module_object(tmp_path):
    """`--impl module:object` registers an outside implementation and parametrizes `impl` with it alone."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "my_kernels.py").write_text(textwrap.dedent("""
        from harness.impls import Impl
        IMPL = Impl(name="mine", devices=("cpu",), ops={"gated_rms_norm": lambda *a, **k: None})
    """))
    (tmp_path / "test_x.py").write_text("def test_x(impl):\n    assert impl.name == 'mine'\n")
    r = _pytest(["--device", "cpu", "--impl", "my_kernels:IMPL", "-q", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr


def test_outcomes_name_each_test_as_it_finishes(tmp_path):
    """--outcomes writes one line per finished test from the xdist controller: passes, a failure with its
    error line and a skip with its reason; a test killed mid-run leaves the lines of those before it."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_o.py").write_text(textwrap.dedent("""
        import pytest
        def test_ok():
            assert True
        def test_bad():
            raise AttributeError("'NoneType' object has no attribute 'shape'")
        def test_skip():
            pytest.skip("no CUDA device")
    """))
    out = tmp_path / "o.jsonl"
    import time
    start = time.time()
    r = _pytest(["--device", "cpu", "-q", "-n", "2", "--outcomes", str(out), str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = {json.loads(x)["nodeid"].split("::")[-1]: json.loads(x) for x in out.read_text().splitlines()}
    assert set(lines) == {"test_ok", "test_bad", "test_skip"}, lines
    assert all(start - 1 <= x["at"] <= time.time() + 1 for x in lines.values()), lines  # when each was written
    assert lines["test_ok"]["outcome"] == "passed"
    assert lines["test_bad"]["outcome"] == "failed" and "no attribute 'shape'" in lines["test_bad"]["why"]
    assert lines["test_skip"]["outcome"] == "skipped" and "no CUDA device" in lines["test_skip"]["why"]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_outcomes_running_file_names_the_tests_a_killed_run_was_in(tmp_path, workers):
    """Beside --outcomes, PATH.running holds the tests running at the moment ({node id: start time}): a run
    killed while a test hangs leaves it naming that test (and not the finished ones); a run that ends
    removes it."""
    import signal
    import time
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_h.py").write_text(textwrap.dedent("""
        import time
        def test_done():
            assert True
        def test_hangs():
            time.sleep(600)
    """))
    out = tmp_path / "o.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--device", "cpu", "-q",
                          *workers, "--outcomes", str(out), str(tmp_path)], cwd=tmp_path, env=_pytest_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    running = out.with_name(out.name + ".running")
    t0 = time.time()
    try:
        while time.time() - t0 < 120:
            if running.exists() and "test_hangs" in running.read_text() and out.exists():
                break
            time.sleep(0.2)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    now = json.loads(running.read_text())
    assert [n.split("::")[-1] for n in now] == ["test_hangs"], now
    assert t0 - 1 <= next(iter(now.values())) <= time.time()
    assert [json.loads(x)["nodeid"].split("::")[-1] for x in out.read_text().splitlines()] == ["test_done"]
    (tmp_path / "test_h.py").write_text("def test_done():\n    assert True\n")
    r = _pytest(["--device", "cpu", "-q", *workers, "--outcomes", str(out), str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not running.exists()


@pytest.mark.parametrize("names", [("KeyError", "ValueError"), ("OutOfResources", "CompilationFault")])
def test_outcomes_name_the_error_of_an_exception_group(tmp_path, names):
    """A hypothesis test with several distinct failures reports an exception group: its --outcomes line
    names the first member's error, not the group's frame or margin, also when the members' classes are
    not named ...Error (triton raises `OutOfResources`)."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_g.py").write_text(textwrap.dedent(f"""
        from hypothesis import given, settings, strategies as st
        class OutOfResources(Exception):
            pass
        class CompilationFault(Exception):
            pass
        @settings(database=None, derandomize=True, max_examples=50)
        @given(st.integers(0, 10))
        def test_two_ways(n):
            if n == 3:
                raise {names[0]}("slot 3 was read")
            if n == 7:
                raise {names[1]}("state of slot 7 differs")
    """))
    out = tmp_path / "o.jsonl"
    r = _pytest(["--device", "cpu", "-q", "--outcomes", str(out), str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["outcome"] == "failed"
    assert "slot 3 was read" in line["why"] or "slot 7 differs" in line["why"], line


_LOSES_CONTEXT = textwrap.dedent("""
    import os
    import harness.testing.plugin as plugin
    pytest_plugins = ["harness.testing.plugin"]
    # a stand-in for a kernel fault: the context of the process that ran test_fault is lost from then on
    plugin.cuda_context_error = lambda device: ("AcceleratorError: CUDA error: misaligned address"
                                                if os.environ.get("FAULTED") else None)
""")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_lost_cuda_context_ends_the_process_not_the_tests_after_it(tmp_path, workers):
    """After a test that leaves the CUDA context unusable, its outcome says so and its process ends: under
    xdist a fresh worker runs the tests left (at most the one scheduled next on the lost worker is reported
    as crashed); without xdist the run stops and says how to go on."""
    (tmp_path / "conftest.py").write_text(_LOSES_CONTEXT)
    (tmp_path / "test_f.py").write_text(textwrap.dedent("""
        import os
        import pytest
        import torch
        from harness.testing.optest import note_case, read_only_inputs
        def kernel(*args, **kwargs):
            raise RuntimeError("CUDA error: misaligned address")
        def test_fault():
            os.environ["FAULTED"] = "1"
            note_case(seed=5)
            read_only_inputs("gated_delta_rule_varlen", kernel)(torch.zeros(3, 1, 4),
                                                                query_start_loc=torch.tensor([0, 3]))
        @pytest.mark.parametrize("i", range(12))
        def test_after(i):
            assert not os.environ.get("FAULTED"), "ran in the process whose context was lost"
    """))
    out = tmp_path / "o.jsonl"
    r = _pytest(["--device", "cpu", "-q", "-p", "no:randomly", "--outcomes", str(out), str(tmp_path),
                 *(["-n", str(workers)] if workers else [])], cwd=tmp_path)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    fault = [x for x in lines if x["nodeid"].endswith("test_fault")]
    assert fault and fault[0]["why"].startswith("CUDA context lost (AcceleratorError: CUDA error: misaligned"), lines
    # the call that faulted, noted before it ran, reaches the outcome line (from an xdist worker too)
    assert " after gated_delta_rule_varlen by test_f.kernel with q[3, 1, 4] float32, query_start_loc=[0, 3], " \
           "seed=5: " in fault[0]["why"], fault
    assert fault[0]["last_call"]["args"]["query_start_loc"]["values"] == [0, 3], fault
    assert fault[0]["last_call"]["case"] == {"seed": 5}, fault
    after = [x for x in lines if "test_after" in x["nodeid"]]
    if workers:
        assert sum(x["outcome"] == "passed" for x in after) >= 11, (r.stdout + r.stderr)[-3000:]
        assert all(x["outcome"] == "passed" or "crashed" in x["why"] for x in after), after
    else:
        assert r.returncode == 1 and after == [], r.stdout + r.stderr
        assert "run again with --resume" in r.stdout + r.stderr
        assert "the last op call: gated_delta_rule_varlen by test_f.kernel" in r.stderr, r.stderr


def test_resume_runs_what_a_cut_run_left(tmp_path):
    """--resume OUTCOMES deselects the tests an earlier run recorded as passed or skipped: the failed test and
    the ones it never reached run again; a missing file is a usage error."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_r.py").write_text(textwrap.dedent("""
        import pytest
        def test_a():
            pass
        def test_b():
            pytest.skip("not here")
        def test_c():
            assert False
        def test_d():
            pass
    """))
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps({"nodeid": f"test_r.py::{n}", "when": "call", "outcome": o}) + "\n"
                             for n, o in (("test_a", "passed"), ("test_b", "skipped"), ("test_c", "failed")))
                     + '{"nodeid": "test_r.py::test_d", "wh')  # the run was cut while writing
    again = tmp_path / "again.jsonl"
    r = _pytest(["--device", "cpu", "-q", "--resume", str(first), "--outcomes", str(again), str(tmp_path)],
                cwd=tmp_path)
    assert r.returncode == 1 and "2 deselected" in r.stdout, r.stdout + r.stderr
    ran = {json.loads(x)["nodeid"].split("::")[-1] for x in again.read_text().splitlines()}
    assert ran == {"test_c", "test_d"}
    r = _pytest(["--device", "cpu", "-q", "--resume", str(tmp_path / "none.jsonl"), str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 4 and "--resume: expected an --outcomes file" in r.stderr


def test_resume_order_starts_slow_tests_first_one_per_worker():
    """The tests recorded as slow start first, the longest first: at the head of the list, or under worksteal
    at the heads of the blocks the scheduler first hands each worker (its block sizes, as xdist computes them);
    the rest keep their order; nothing recorded as slow leaves the order as it was."""
    from harness.testing.resume import resume_order, worksteal_blocks
    ids = [f"t{i}" for i in range(10)]
    seconds = {"t8": 100.0, "t9": 300.0, "t3": 40.0, "t1": 5.0}
    assert resume_order(ids, seconds) == ["t9", "t8", "t3", "t0", "t1", "t2", "t4", "t5", "t6", "t7"]
    assert resume_order(ids, seconds, 3, "load") == resume_order(ids, seconds)
    assert worksteal_blocks(10, 3) == [3, 3, 4] and worksteal_blocks(2, 3) == [0, 1, 1]
    assert resume_order(ids, seconds, 3, "worksteal") == ["t9", "t0", "t1", "t8", "t2", "t4",
                                                          "t3", "t5", "t6", "t7"]
    assert resume_order(ids, {"t1": 5.0}, 3, "worksteal") == ids
    # more slow tests than workers: dealt in turn, the rest fill the blocks
    assert resume_order(ids[:5], {i: 60.0 + int(i[1]) for i in ids[:3]}, 2, "worksteal") == \
        ["t2", "t0", "t1", "t3", "t4"]


def test_record_cut_adds_the_running_tests_as_cut(tmp_path):
    """`record_cut` turns a cut run's OUTCOMES.running into outcome lines "cut" with how long each test had
    run: not a verdict (the resume runs them again), but the durations the resume orders by."""
    from harness.testing.plugin import finished_tests
    from harness.testing.resume import main, outcome_lines, record_cut, recorded_seconds
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"nodeid": "a::done", "when": "call", "outcome": "passed", "seconds": 1.0}) + "\n")
    (tmp_path / "o.jsonl.running").write_text(json.dumps({"a::quick": 995.0, "a::slow": 900.0}))
    assert record_cut(str(out), now=1000.0) == ["a::slow", "a::quick"]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["nodeid"], x["outcome"], x["seconds"]) for x in lines[1:]] == [("a::slow", "cut", 100.0),
                                                                               ("a::quick", "cut", 5.0)]
    assert not (tmp_path / "o.jsonl.running").exists() and record_cut(str(out)) == []
    assert finished_tests([str(out)]) == {"a::done"}
    assert recorded_seconds(outcome_lines([str(out)])) == {"a::done": 1.0, "a::slow": 100.0, "a::quick": 5.0}
    assert main(["cut", str(tmp_path / "none.jsonl")]) == 2 and main(["cut"]) == 2


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "worksteal"]])
def test_resume_runs_the_tests_a_cut_run_was_in_first(tmp_path, workers):
    """End to end: the tests recorded as cut run first, one on each worker."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_s.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(8)))
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps({"nodeid": f"test_s.py::test_{i}", "when": "cut", "outcome": "cut",
                                         "seconds": s}) + "\n" for i, s in ((6, 50.0), (7, 100.0))))
    again = tmp_path / "again.jsonl"
    r = _pytest(["--device", "cpu", "-q", *workers, "--resume", str(first), "--outcomes", str(again),
                 str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(x) for x in again.read_text().splitlines()]
    assert len(lines) == 8
    firsts: dict = {}
    for x in lines:
        firsts.setdefault(x["worker"], x["nodeid"].split("::")[-1])
    if workers:
        assert sorted(firsts.values()) == ["test_6", "test_7"], lines
    else:
        assert [x["nodeid"].split("::")[-1] for x in lines[:2]] == ["test_7", "test_6"], lines


def test_resume_failed_skip_keeps_verdicts_and_reruns_errors(tmp_path):
    """--resume-failed skip: a test whose last recorded failure is an assertion is not run again; one that
    failed on an error, or with a lost CUDA context, runs again, as does every test without --resume-failed."""
    from harness.testing.plugin import finished_tests
    lines = [("test_verdict", "E   AssertionError: y: error ratio 1e-01 exceeds 0.005"),
             ("test_mismatch", "E   harness.scenarios.Mismatch: pad rows of y must be zero"),
             ("test_error", "E   RuntimeError: Triton Error [CUDA]: an illegal memory access"),
             ("test_lost", "CUDA context lost (AcceleratorError: x): E   AssertionError: y"),
             ("test_group", "    +-----------------------------------"),
             ("test_fixed", "E   AssertionError: was wrong once")]
    path = tmp_path / "o.jsonl"
    path.write_text("".join(json.dumps({"nodeid": n, "when": "call", "outcome": "failed", "why": w}) + "\n"
                            for n, w in lines)
                    + json.dumps({"nodeid": "test_fixed", "when": "call", "outcome": "passed"}) + "\n")
    assert finished_tests([str(path)]) == {"test_fixed"}
    assert finished_tests([str(path)], skip_failed=True) == {"test_verdict", "test_mismatch", "test_fixed"}
    # the latest verdict counts: a test that passed and then failed (in a later run's lines) runs again
    later = tmp_path / "later.jsonl"
    later.write_text(json.dumps({"nodeid": "test_fixed", "when": "call", "outcome": "failed",
                                 "why": "E   RuntimeError: broke again"}) + "\n")
    assert finished_tests([str(path), str(later)]) == set()
    assert finished_tests([str(path), str(later)], skip_failed=True) == {"test_verdict", "test_mismatch"}


def test_unsupported_examples_are_rejected_not_the_whole_test(tmp_path):
    """An implementation (the plugin's `impl`) whose op raises NotImplementedError for some examples has the
    others still run and checked: a wrong result on a supported example fails the test even when the first
    example drawn was unsupported. One that declines every example skips, giving its reason."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "peer_kernels.py").write_text(textwrap.dedent("""
        from harness.impls import Impl

        def op(n, wrong_at=None):
            if n % 2:
                raise NotImplementedError("odd sizes are not supported")
            return -1 if n == wrong_at else n

        IMPL = Impl(name="peer", devices=("cpu",), ops={"ssd_varlen": op})
    """))
    (tmp_path / "test_u.py").write_text(textwrap.dedent("""
        from hypothesis import example, given, settings, strategies as st

        SEEN = []

        @settings(max_examples=30, database=None)
        @given(n=st.integers(0, 1000))
        @example(n=1)
        def test_runs_supported(impl, n):
            assert impl.op("ssd_varlen")(n) == n
            SEEN.append(n)

        def test_supported_ones_ran():
            assert SEEN and all(n % 2 == 0 for n in SEEN), SEEN

        @settings(max_examples=30, database=None)
        @given(n=st.integers(0, 1000))
        @example(n=1)
        def test_wrong_supported_case_fails(impl, n):
            assert impl.op("ssd_varlen")(n, wrong_at=n if n % 2 == 0 else None) == n

        @settings(max_examples=10, database=None)
        @given(n=st.integers(0, 1000).map(lambda n: 2 * n + 1))
        def test_nothing_supported(impl, n):
            impl.op("ssd_varlen")(n)
    """))
    r = _pytest(["--device", "cpu", "--impl", "peer_kernels:IMPL", "-rfs", "-p", "no:randomly", str(tmp_path)],
                cwd=tmp_path)
    out = r.stdout + r.stderr
    assert "FAILED test_u.py::test_wrong_supported_case_fails" in out, out
    assert "1 failed, 2 passed, 1 skipped" in out, out
    assert "no generated example is supported: peer: odd sizes are not supported" in out, out


def test_strict_op_keeps_not_implemented_a_failure():
    """Contract tests call strict_op: for them a NotImplementedError is a failure, not a declined case."""
    from harness.impls import Impl
    from harness.testing import declining, strict_op

    def op(*a, **k):
        raise NotImplementedError("no such case")

    wrapped = declining(Impl(name="peer", devices=("cpu",), ops={"ssd_varlen": op}))
    assert strict_op(wrapped, "ssd_varlen") is op
    with pytest.raises(NotImplementedError):
        strict_op(wrapped, "ssd_varlen")()
    with pytest.raises(pytest.skip.Exception, match="peer: no such case"):
        wrapped.op("ssd_varlen")()


def _faults(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_an_op_call_is_noted_before_the_op_runs():
    """`read_only_inputs` notes the call as the process's last op call before the implementation runs: a
    call that faults leaves its description (shapes, dtypes, strides, the values of small index tensors, the
    case the suite noted), JSON-serialisable."""
    from harness.testing.optest import last_call, note_case, read_only_inputs
    q = torch.zeros(70, 2, 8)
    qsl = torch.tensor([0, 3, 70], dtype=torch.int32)
    idx = torch.arange(65)  # more than lastcall.SMALL elements: its shape, not its values
    note_case(shapes={"lengths": [3, 67], "q": q}, seed=7)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        read_only_inputs("gated_delta_rule_varlen", _faults)(q, q, q, q[..., 0], q[..., 0], torch.zeros(65, 2, 8, 8),
                                                             qsl, idx, torch.tensor([True, False]), scale=None)
    last = last_call()
    json.dumps(last)
    assert last["op"] == "gated_delta_rule_varlen" and last["fn"] == f"{__name__}._faults", last
    a = last["args"]
    assert a["q"] == {"shape": [70, 2, 8], "dtype": "float32", "stride": [16, 8, 1], "device": "cpu"}, a["q"]
    assert a["g"]["stride"] == [16, 8] and "values" not in a["g"], a["g"]
    assert a["query_start_loc"]["values"] == [0, 3, 70] and a["query_start_loc"]["dtype"] == "int32", a
    assert a["cache_indices"]["shape"] == [65] and "values" not in a["cache_indices"], a["cache_indices"]
    assert a["has_initial_state"]["values"] == [True, False] and a["scale"] is None, a
    assert last["case"] == {"shapes": {"lengths": [3, 67], "q": a["q"]}, "seed": 7}, last["case"]


def test_run_pool_case_notes_its_case_with_the_call():
    """`run_pool_case` notes the suite's drawn shapes and seed with the op call it makes."""
    import types
    from harness.ops import SPECS
    from harness.testing.optest import contract_variants, last_call, run_pool_case
    sp = SPECS["selective_state_update"]
    shape = dict(contract_variants(sp))["mamba1-full"]
    pos, opt = sp.split(sp.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(0)))
    faulting = types.SimpleNamespace(name="faulting", op=lambda name: _faults)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_pool_case(None, faulting, sp.name, pos, opt, pool_pos=0, live_slots=pos[-1].tolist(), y_mask=None,
                      dtype=torch.float32, seed=11, shapes={"batch": 3, "layout": "contiguous"})
    last = last_call()
    assert last["op"] == "selective_state_update" and last["fn"].endswith("._faults"), last
    assert last["case"] == {"shapes": {"batch": 3, "layout": "contiguous"}, "seed": 11}, last["case"]
    assert last["args"]["out"]["shape"] == list(pos[1].shape), last["args"]


def test_outcome_of_a_lost_context_names_the_last_op_call():
    """The --outcomes line of a test that lost the CUDA context carries the last op call (`last_call`) and
    says in `why` which op, by which function, on what it was called; a failure without the lost context
    carries neither."""
    import types
    from harness.testing import plugin
    from harness.testing.lastcall import describe_call, last_call, note_call, note_case
    note_case(shapes={"lengths": [2, 3]}, seed=7)
    note_call(describe_call("gated_delta_rule_varlen", _faults,
                            [torch.zeros(5, 2, 8)] * 5 + [torch.zeros(2, 2, 8, 8), torch.tensor([0, 2, 5])], {}))
    last = last_call()
    err = "AcceleratorError: CUDA error: an illegal memory access was encountered"
    report = types.SimpleNamespace(when="call", passed=False, failed=True, skipped=False, outcome="failed",
                                   nodeid="suites/ops/test_x.py::test_y", duration=1.5,
                                   longreprtext="E   torch.AcceleratorError: CUDA error: an illegal memory access",
                                   user_properties=[(plugin._LOST, err), (plugin._LAST_CALL, last)])
    line = plugin._outcome_line(report)
    json.dumps(line)
    assert line["last_call"] == last, line
    assert line["why"] == (f"CUDA context lost ({err}) after gated_delta_rule_varlen by {__name__}._faults with "
                           f"q[5, 2, 8] float32, query_start_loc=[0, 2, 5], lengths=[2, 3], seed=7: "
                           f"E   torch.AcceleratorError: CUDA error: an illegal memory access"), line["why"]
    report.user_properties = []
    line = plugin._outcome_line(report)
    assert "last_call" not in line and line["why"].startswith("E   torch.AcceleratorError"), line


def test_generate_seconds_caps_drawing_and_says_so(tmp_path):
    """--generate-seconds S: a property test draws no new example after S seconds (the examples run decide it,
    and its --outcomes line says the cap ended it, after how many examples), on pytest-xdist's workers too; a
    failure is still found and reported as one; a test the cap does not reach has no note; a negative S is a
    usage error."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_k.py").write_text(textwrap.dedent("""
        import os, time
        from hypothesis import given, settings, strategies as st
        @settings(max_examples=50, database=None)
        @given(st.integers(0, 10**6))
        def test_slow(x):
            with open(os.path.join(os.path.dirname(__file__), "ran"), "a") as f:
                f.write(".")
            time.sleep(0.1)
        @settings(max_examples=50, database=None)
        @given(st.integers(0, 10**6))
        def test_fails(x):
            time.sleep(0.1)
            assert x < 0
        @settings(max_examples=3, database=None)
        @given(st.integers())
        def test_quick(x):
            pass
    """))
    outcomes, ran = tmp_path / "o.jsonl", tmp_path / "ran"
    r = _pytest(["--device", "cpu", "-q", "--generate-seconds", "0.5", "--shrink-seconds", "1", "--outcomes",
                 str(outcomes), "-n", "2", str(tmp_path / "test_k.py")], cwd=tmp_path)  # the note crosses xdist
    assert r.returncode == 1, r.stdout + r.stderr
    lines = {json.loads(x)["nodeid"].split("::")[-1]: json.loads(x) for x in outcomes.read_text().splitlines()}
    n = len(ran.read_text())
    assert 1 <= n < 20, n  # 50 drawn without the cap (0.1 s each)
    slow = lines["test_slow"]
    assert slow["outcome"] == "passed" and slow["why"].startswith("--generate-seconds: ") and \
        " of 50 examples drawn in " in slow["why"], slow
    assert int(slow["why"].split()[1]) == n, (slow, n)
    assert lines["test_fails"]["outcome"] == "failed", lines["test_fails"]
    assert lines["test_quick"]["outcome"] == "passed" and lines["test_quick"]["why"] == "", lines["test_quick"]
    r = _pytest(["--device", "cpu", "-q", "--generate-seconds", "-1", str(tmp_path / "test_k.py")], cwd=tmp_path)
    assert r.returncode == 4 and "--generate-seconds: expected a finite number of seconds >= 0" in r.stderr, \
        r.stdout + r.stderr


def test_generate_seconds_reads_either_hypothesis_naming():
    """Regression (H100 box, hypothesis 6.170): the engine counts `valid_test_cases` and `interesting_test_cases`
    where 6.15x counted `valid_examples` and `interesting_examples`; the cap read the old names only and every
    property test it ran failed with AttributeError. Either naming is read; neither is a clear error."""
    from types import SimpleNamespace
    from harness.testing.plugin import _runner_count
    old = SimpleNamespace(valid_examples=3, interesting_examples={})
    new = SimpleNamespace(valid_test_cases=4, interesting_test_cases={"origin": 1})
    assert (_runner_count(old, "valid"), _runner_count(old, "interesting")) == (3, {})
    assert (_runner_count(new, "valid"), _runner_count(new, "interesting")) == (4, {"origin": 1})
    with pytest.raises(AttributeError, match="valid_examples or valid_test_cases"):
        _runner_count(SimpleNamespace(), "valid")


def test_shrink_seconds_caps_hypothesis_shrinking(tmp_path):
    """--shrink-seconds S sets the limit hypothesis shrinks a failing example for (a failing test on a GPU run
    spent up to 300 s shrinking), on pytest-xdist's workers too; an infinite S is a usage error."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_k.py").write_text(textwrap.dedent("""
        from hypothesis.internal.conjecture import engine
        def test_limit():
            assert engine.MAX_SHRINKING_SECONDS == 7.5
    """))
    r = _pytest(["--device", "cpu", "-q", "--shrink-seconds", "7.5", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _pytest(["--device", "cpu", "-q", "-n", "2", "--shrink-seconds", "7.5", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr  # on the xdist workers too
    r = _pytest(["--device", "cpu", "-q", "--shrink-seconds", "inf", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 4 and "--shrink-seconds: expected a finite number of seconds >= 0" in r.stderr, \
        r.stdout + r.stderr
