"""The `harness` command line as a user meets it: one --device (auto by default) and one exit-4 line for a
device the machine lacks in every command, --help/--version without torch, `impls --device`, `run`'s -k/--op
reaching every step with progress, one-line skips, honest benchmarks under xdist, and what the environment
records (CPU model, git sha without git)."""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from harness import devices
from harness.cli import build_parser, main, suite_command
from harness.records import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the property is about machines without")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", **extra)
    for k in ("PYTEST_XDIST_WORKER", "HARNESS_RUN_ID", "TRITON_INTERPRET"):
        env.pop(k, None)
    return env


def _py(args, cwd=ROOT, timeout=300, **env):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------------------- 1: devices

@NO_CUDA
def test_missing_device_is_one_exit_4_line_in_every_command(tmp_path, capsys):
    """`--device cuda` without CUDA: selftest, bench, run, impls and the throughput tool each print the
    plugin's reason on one line and exit 4, running nothing (no twelve ESCAPED variants, no traceback)."""
    with pytest.raises(devices.DeviceUnavailable) as e:
        devices.resolve("cuda")
    reason = str(e.value)
    for argv in (["selftest", "--device", "cuda"], ["bench", "--device", "cuda"], ["impls", "--device", "cuda"],
                 ["run", "--device", "cuda", "--out", str(tmp_path / "run"), "--no-report"]):
        assert main(argv) == 4, argv
        out, err = capsys.readouterr()
        assert err.strip().splitlines() == [f"harness {argv[0]}: error: {reason}"], err
        assert "ESCAPED" not in out and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    r = _py(["-m", "harness.bench.throughput", "--device", "cuda", "--layers", "1", "--d-model", "8"])
    assert r.returncode == 4, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"harness bench throughput: error: {reason}"], r.stderr
    from harness.selftest import main as selftest_main
    with pytest.raises(SystemExit) as ex:
        selftest_main(argparse.Namespace(list=False, impl="reference", variant=None, max_examples=1, seconds=1.0,
                                         device="cuda"))
    assert ex.value.code == 4


def test_device_defaults_to_auto_everywhere():
    """Every command that takes --device defaults to auto (cuda, else xpu, else cpu), the throughput tool too."""
    for cmd in ("run", "bench", "selftest", "impls"):
        assert build_parser([cmd]).parse_args([cmd]).device == "auto", cmd
    from harness.bench.throughput import build_parser as tp_parser
    assert tp_parser().parse_args([]).device == "auto"


def test_selftest_table_says_when_the_unbroken_engine_fails_too():
    """A variant whose control fails is not listed as 'caught NO' beside the properties that 'caught' it:
    the table says the unbroken engine fails too."""
    from harness.selftest import VARIANTS, Outcome, format_table
    o = Outcome(VARIANTS[0], False, [("matches_reference", "RuntimeError: boom")], None, False, 0.1, 1)
    row = format_table([o]).splitlines()[2]
    assert "NO: the unbroken engine fails too" in row and "matches_reference" in row


# --------------------------------------------------------------------------------------- 3: CLI

@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"],
                                  ["selftest", "--help"], ["impls", "--help"], ["gate", "--help"],
                                  ["report", "--help"], ["bench", "--help"], ["bench", "throughput", "--help"],
                                  ["bench", "loader", "--help"], ["bench", "sweep", "--help"]])
def test_help_and_version_import_no_torch(argv):
    """Building the parser imports no torch: `harness --help`, `--version` and each command's --help answer
    without loading it."""
    code = textwrap.dedent(f"""
        import sys
        from harness.cli import main
        try:
            main({argv!r})
        except SystemExit as e:
            assert e.code in (0, None), e.code
        print("TORCH-LOADED" if "torch" in sys.modules else "NO-TORCH")
    """)
    r = _py(["-c", code])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH", r.stdout[-500:]


def _cpu_seconds(argv) -> tuple[float, subprocess.CompletedProcess]:
    """CPU seconds (user + system) a child `python argv` takes: unlike wall time, it does not grow when the
    machine is busy with other work (the suites run this beside 2-14 xdist workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _py(argv)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r


def test_help_and_version_answer_in_well_under_a_second():
    """`python -m harness.cli --help` / `--version` take well under a second of CPU time (the best of three
    tries); --version names the package version and the git sha."""
    for argv in (["--help"], ["--version"]):
        best = float("inf")
        for _ in range(3):
            secs, r = _cpu_seconds(["-m", "harness.cli", *argv])
            best = min(best, secs)
            assert r.returncode == 0, r.stderr
        assert best < 1.0, (argv, best)
    assert re.match(r"harness \(ssm-harness\) \S+( \(source tree\))?, git (\w{40}(-dirty)?|sha unknown)$", r.stdout.strip()), r.stdout


def test_impls_lists_what_runs_on_the_device_and_why_not():
    """`harness impls --device cpu` (rejected before) lists triton as running on the CPU through Triton's
    interpreter, as the suites run it, and every implementation that does not run with its reason."""
    r = _py(["-m", "harness.cli", "impls", "--device", "cpu"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:] if ln.strip()}
    assert " runs " in lines["triton"] and "interpreter" in lines["triton"]
    assert " runs " in lines["reference"] and " runs " in lines["torch"]
    for name, line in lines.items():
        if " no " in line:
            assert len(line.split(" no ", 1)[1].split()) >= 3, line  # a reason, not a bare "no"
    assert r.stdout.startswith("implementations on cpu (")


def _ns(**kw):
    d = dict(device="cpu", profile="ci", impl=None, op=None, keyword=None, suites="suites", workers=None)
    d.update(kw)
    return argparse.Namespace(**d)


def test_run_times_the_bench_suite_without_xdist():
    """pytest-benchmark does not time under xdist: `harness run --suites suites/bench` runs it without xdist
    (timed) whatever --workers says; other suites get the workers; -k/--op/--impl and the outcomes file pass on."""
    cmd = suite_command(_ns(workers=2, op=["ssd_varlen"], keyword="triton", impl=["torch"]), ROOT, "r", "o")
    assert cmd[cmd.index("-n") + 1] == "2" and cmd[cmd.index("--impl") + 1] == "torch"
    assert cmd[cmd.index("--op") + 1] == "ssd_varlen" and cmd[cmd.index("-k") + 1] == "triton"
    assert cmd[cmd.index("--outcomes") + 1] == "o" and "-rs" in cmd
    for suites in ("suites/bench", "suites/bench/test_bench_ops.py,suites/bench/test_bench_framework.py"):
        assert "-n" not in suite_command(_ns(workers=2, suites=suites), ROOT, "r", "o"), suites
    assert "-n" not in suite_command(_ns(workers=1), ROOT, "r", "o")


def _ops(path, kind):
    return {r.get("op") for r in read_records(str(path), kinds=(kind,))}


def test_run_k_and_op_reach_every_step(tmp_path, capsys):
    """`harness run -k gated_rms_norm` tests and times only gated_rms_norm (the bench step times the ops the
    selected tests compared) and shows each step's progress; `--op gated_rms_norm` does the same."""
    out = tmp_path / "k"
    rc = main(["run", "--device", "cpu", "--suites", "suites/reference/test_ref_edge_cases.py", "-k", "gated_rms_norm",
               "--workers", "1", "--bench-reps", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    assert _ops(out / "results.jsonl", "comparison") == {"gated_rms_norm"}
    assert _ops(out / "bench.jsonl", "timing") - {"copy"} == {"gated_rms_norm"}
    assert (out / "report.html").is_file() and (out / "outcomes.jsonl").is_file()
    for n, step in enumerate(("suites", "bench", "report"), 1):
        assert f"harness run [{n}/3] {step}: " in text, text[-3000:]
    out = tmp_path / "op"
    rc = main(["run", "--device", "cpu", "--suites", "suites/reference/test_ref_edge_cases.py", "--op", "gated_rms_norm",
               "--workers", "1", "--bench-reps", "1", "--no-report", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out[-3000:]
    assert _ops(out / "results.jsonl", "comparison") == {"gated_rms_norm"}
    assert _ops(out / "bench.jsonl", "timing") - {"copy"} == {"gated_rms_norm"}
    assert main(["run", "--device", "cpu", "--op", "no_such_op", "--out", str(tmp_path / "x")]) == 2
    assert "--op: expected op names" in capsys.readouterr().err


def test_op_option_keeps_the_tests_that_compare_the_op():
    """`pytest --op gated_rms_norm` keeps the op suite's oracle test (its module names the op in a constant)
    and the reference tests named after it, and drops the conv tests."""
    r = _py(["-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "--device", "cpu",
             "--op", "gated_rms_norm", "suites/ops/test_ops_gated_norm.py", "suites/ops/test_ops_conv1d.py",
             "suites/reference/test_ref_edge_cases.py"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert any("test_gated_norm_matches_oracle" in i for i in ids)
    assert any("test_ref_edge_cases.py::test_gated_rms_norm" in i for i in ids)
    assert not [i for i in ids if "conv" in i], ids
    assert re.search(r"\d+ deselected", r.stdout)


def test_setup_says_what_it_installs():
    """scripts/setup.sh announces each install before it starts (a first run downloads for minutes)."""
    lines = open(os.path.join(ROOT, "scripts", "setup.sh")).read().splitlines()
    installs = [i for i, ln in enumerate(lines) if re.search(r"(pip|apt-get)( -qq)? install", ln)]
    assert len(installs) >= 3
    for i in installs:
        before = [ln for ln in lines[max(0, i - 2):i] if ln.strip().startswith("step ")]
        assert before and "install" in before[-1], lines[i]
    r = subprocess.run(["bash", "-c", 'source <(grep "^step()" scripts/setup.sh); step 1 "installing x"'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.stderr.strip() == "setup [1/4] installing x"


# --------------------------------------------------------------------------------------- 4: pytest noise

def test_a_skip_says_one_line(tmp_path):
    """A skip inside a hypothesis @example says its reason on one line with -rs (hypothesis' multi-line
    "Falsifying explicit example" note is dropped)."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_s.py").write_text(textwrap.dedent("""
        import pytest
        from hypothesis import example, given, strategies as st

        @given(x=st.lists(st.integers()))
        @example(x=list(range(40)))
        def test_s(x):
            pytest.skip("triton: no initial state for the CUDA scan")
    """))
    r = _py(["-m", "pytest", "-p", "no:cacheprovider", "-rs", "--device", "cpu", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "Falsifying" not in r.stdout and "x=[" not in r.stdout
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert len(skipped) == 1 and skipped[0].endswith("triton: no initial state for the CUDA scan"), r.stdout


def test_benchmarks_under_xdist_skip_with_one_line_and_time_without(tmp_path):
    """Under -n 2 pytest-benchmark cannot time: a test taking `benchmark` skips with one line saying so
    (not a silent untimed pass); without -n it is timed."""
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['harness.testing.plugin']\n")
    (tmp_path / "test_b.py").write_text("def test_b(benchmark):\n    benchmark(lambda: sum(range(1000)))\n")
    js = tmp_path / "b.json"
    r = _py(["-m", "pytest", "-p", "no:cacheprovider", "-rs", "--device", "cpu", "-n", "2",
             f"--benchmark-json={js}", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "1 skipped" in r.stdout and "pytest-benchmark does not time under pytest-xdist" in r.stdout
    r = _py(["-m", "pytest", "-p", "no:cacheprovider", "--device", "cpu", f"--benchmark-json={js}", str(tmp_path)],
            cwd=tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:]
    (b,) = json.loads(js.read_text())["benchmarks"]
    assert b["stats"]["rounds"] > 1 and b["stats"]["median"] > 0


# --------------------------------------------------------------------------------------- environment

def test_cpu_device_name_is_the_model():
    """On the CPU the recorded device name is the processor's model (from /proc/cpuinfo), not "x86_64"."""
    import platform

    from harness.env import device_name
    name = device_name("cpu")
    assert name != platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        models = []
    if models:
        assert name.startswith(models[0])


def test_git_sha_is_recorded_without_git(monkeypatch):
    """Without a git binary the sha still lands in the env record: from $HARNESS_GIT_SHA (a tree copied to a
    machine without .git), else read from the .git folder; the package version is always there."""
    import harness.env as E
    real = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    def no_git(*a, **k):
        raise FileNotFoundError("git")
    for var in E.GIT_SHA_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(E.subprocess, "run", no_git)
    E.git_info.cache_clear()
    try:
        monkeypatch.setenv("HARNESS_GIT_SHA", "0123abc")
        assert E.git_info() == ("0123abc", "$HARNESS_GIT_SHA")
        E.git_info.cache_clear()
        monkeypatch.delenv("HARNESS_GIT_SHA")
        if real:
            assert E.git_info() == (real, ".git")
        env = E.environment("cpu")
        assert env["harness"] and env["git_sha_source"] in (".git", None)
    finally:
        E.git_info.cache_clear()


def test_harness_git_sha_wins_over_git(monkeypatch):
    """$HARNESS_GIT_SHA names the commit even where git answers: a copied tree's .git can point elsewhere."""
    import harness.env as E
    monkeypatch.setenv("HARNESS_GIT_SHA", "0123abc-dirty")
    E.git_info.cache_clear()
    try:
        assert E.git_info() == ("0123abc-dirty", "$HARNESS_GIT_SHA")
        assert E.environment("cpu")["git_sha"] == "0123abc-dirty"
    finally:
        E.git_info.cache_clear()
