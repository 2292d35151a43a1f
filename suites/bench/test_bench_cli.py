"""`harness bench` as one home for benchmarks, on the CPU at tiny shapes: each subcommand runs and writes
timing records the gate reads; name filters take comma lists and an unknown name is a usage error (exit 4);
the timing module's budget and record fields; eager and CUDA-graph timings are separate gate cases."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from harness.bench.timing import Budget, Stats, Timing, cpu_samples, measure
from harness.cli import main
from harness.records import RecordWriter, read_records

QUICK = ["--reps", "2", "--min-time", "0", "--no-progress"]
# a sweep on a GPU runs its groups in child processes: with a budget, one that hangs is killed past it
BOUNDED = ["--budget", "180"]


def timings(path) -> list[dict]:
    recs = read_records(str(path))
    assert recs[0]["kind"] == "env", recs[0]
    return [r for r in recs if r["kind"] == "timing"]


def gates_clean(path, capsys) -> None:
    """The gate reads the file as a run (its own baseline: no regression)."""
    capsys.readouterr()
    assert main(["gate", "--baseline", str(path), "--candidate", str(path)]) == 0
    assert "PASS" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ filters

def test_op_filter_takes_comma_lists(capsys):
    """`--op a,b --list` lists the cases of both ops (and the copy roofline), `--impl` likewise."""
    assert main(["bench", "--device", "cpu", "--op", "ssd_varlen,gated_rms_norm", "--impl", "torch,reference",
                 "--list"]) == 0
    cases = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("skipped")]
    assert {c.split("/")[0] for c in cases} == {"copy", "ssd_varlen", "gated_rms_norm"}
    assert {c.split("/")[1].split("[")[0] for c in cases if not c.startswith("copy")} == {"torch", "reference"}


@pytest.mark.parametrize("argv,named,bad", [
    (["bench", "--device", "cpu", "--op", "nonexistent", "--list"], "--op", "nonexistent"),
    (["bench", "--device", "cpu", "--op", "ssd_varlen,nonexistent", "--list"], "--op", "nonexistent"),
    (["bench", "--device", "cpu", "--impl", "torch", "--impl", "nope", "--list"], "--impl", "nope"),
    (["bench", "peers", "--device", "cpu", "--op", "nonexistent", "--list"], "--op", "nonexistent"),
    (["bench", "peers", "--device", "cpu", "--op", "copy", "--list"], "--op (ops a peer has)", "copy"),
    (["bench", "sweep", "--device", "cpu", "--op", "gated_rms_norm", "--list"],
     "--op (ops with a launch-configuration sweep)", "gated_rms_norm"),
    (["bench", "sweep", "--device", "cpu", "--op", "nonexistent"], "--op (ops with a launch-configuration sweep)",
     "nonexistent"),
    (["bench", "sweep", "--device", "cpu", "--op", "ssd_varlen", "--group", "nope", "--list"], "--group", "nope"),
    (["bench", "throughput", "--device", "cpu", "--impl", "nope", "--no-hf"], "--impl", "nope"),
    (["bench", "host", "--op", "gated_rms_norm,nonexistent"], "--op", "nonexistent"),
    (["bench", "host", "--op", "gated_rms_norm", "--engine", "mamba2,nope"], "--engine", "nope"),
])
def test_unknown_names_are_usage_errors(argv, named, bad, capsys):
    """An unknown op, implementation or group exits 4 with a message naming the option, the unknown name and
    the valid names; nothing is timed."""
    assert main(argv) == 4
    err = capsys.readouterr().err
    assert f"{named}: expected names from" in err and bad in err.split("got unknown")[1]
    listed = err.split("expected names from")[1].split(";")[0]
    assert len(listed.split(",")) >= 3 and bad not in listed.split(", ")


# ------------------------------------------------------------------------------------------ subcommands

def test_bench_ops_default_still_the_op_matrix(tmp_path, capsys):
    """`harness bench` without a subcommand times the op benchmarks (CPU: one record per case, eager only)."""
    out = tmp_path / "ops.jsonl"
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch", *QUICK,
                 "--out", str(out)]) == 0
    t = timings(out)
    assert [r["op"] for r in t] == ["copy", "gated_rms_norm", "gated_rms_norm"]
    assert all(r["cuda_graph"] is False and r["reps"] >= 2 and r["ms_p50"] > 0 for r in t)
    gates_clean(out, capsys)


def test_bench_resume_times_what_a_cut_run_left(tmp_path, capsys):
    """--resume RECORDS times only the cases that file does not time (a failed case counts as not timed; the
    copy roofline is timed again); everything timed leaves nothing to do; a missing file is a usage error."""
    first, again, last = tmp_path / "first.jsonl", tmp_path / "again.jsonl", tmp_path / "last.jsonl"
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch", *QUICK,
                 "--out", str(first)]) == 0
    timed = timings(first)
    shapes = [r["shape"] for r in timed if r["op"] == "gated_rms_norm"]
    assert len(shapes) == 2
    # keep the first run's first case only, as if it had been cut there
    with open(first) as f:
        lines = [ln for ln in f if '"gated_rms_norm"' not in ln or json.dumps(shapes[0])[1:-1] in ln]
    first.write_text("".join(lines))
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch", *QUICK,
                 "--resume", str(first), "--out", str(again)]) == 0
    assert [(r["op"], r["shape"]) for r in timings(again)] == [("copy", timed[0]["shape"]), ("gated_rms_norm", shapes[1])]
    with open(first, "a") as f:
        f.write(open(again).read())
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch", *QUICK,
                 "--resume", str(first), "--out", str(last)]) == 0
    assert "nothing left" in capsys.readouterr().out
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--resume", str(tmp_path / "none.jsonl"),
                 *QUICK]) == 2
    # --retime: the named ops' cases are timed again although the file times them; it needs --resume and op names
    retimed = tmp_path / "retimed.jsonl"
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch", *QUICK,
                 "--resume", str(first), "--retime", "gated_rms_norm", "--out", str(retimed)]) == 0
    assert [(r["op"], r["shape"]) for r in timings(retimed)] == [("copy", timed[0]["shape"])] + \
        [("gated_rms_norm", s) for s in shapes]
    capsys.readouterr()
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--retime", "gated_rms_norm", *QUICK]) == 2
    assert "--retime: expected with --resume" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--resume", str(first), "--retime", "nosuch", *QUICK]) != 0
    assert "--retime" in capsys.readouterr().err


def test_bench_peers_runs_ours_next_to_the_peers(tmp_path, capsys):
    """`harness bench peers` restricts the matrix to the ops a peer has and lists the peers it could not run
    (here: not installed, or their own kernels being CUDA only) with the reason."""
    out = tmp_path / "peers.jsonl"
    assert main(["bench", "peers", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch,mamba_ssm.native",
                 *QUICK, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gated_rms_norm/mamba_ssm.native: runs on cuda only" in printed
    t = timings(out)
    assert {(r["op"], r["impl"]) for r in t} == {("copy", "torch"), ("gated_rms_norm", "torch")}
    assert read_records(str(out))[0]["bench"]["kind"] == "peers"
    gates_clean(out, capsys)


def test_peer_native_backends_are_declared():
    """The peers' own kernels are CUDA-only backends, marked peer: mamba_ssm's and causal-conv1d's for every op
    their adapters have, fla's for the four delta-rule ops (called on dense states, without the adapter's
    pool gather and scatter)."""
    import harness.bench.peers  # noqa: F401 - declares the native backends
    from harness.bench.cli import peer_ops
    from harness.bench.registry import BENCHMARKS
    natives = {(b.op, b.impl.split(".")[0]): b for b in BENCHMARKS.values() if b.impl.endswith(".native")}
    mamba_ops = {"selective_scan_varlen", "causal_conv1d_varlen", "causal_conv1d_update", "selective_state_update",
                 "ssd_varlen", "gated_rms_norm", "add_rms_norm"}
    delta_ops = {"gated_delta_rule_varlen", "gated_delta_rule_update", "kda_varlen", "kda_update"}
    assert {op for op, peer in natives if peer != "fla"} == mamba_ops and mamba_ops <= set(peer_ops())
    assert {op for op, peer in natives if peer == "fla"} == delta_ops and delta_ops <= set(peer_ops())
    assert all(b.peer and b.devices == ("cuda",) for b in natives.values())


def test_jit_launch_variant_is_timed_only_when_asked_for():
    """`triton.jit_launch` (our Triton ops through Triton's own launch path) covers every Triton op, is ours,
    runs on CUDA only, and is left out unless named with --impl (then it is timed beside `triton`)."""
    from harness.bench.registry import BENCHMARKS, benchmarks_for
    from harness.impls.registry import get
    variants = {b.op: b for b in BENCHMARKS.values() if b.impl == "triton.jit_launch"}
    assert set(variants) == set(get("triton").ops)
    assert all(not b.peer and b.devices == ("cuda",) and not b.by_default for b in variants.values())
    timed, skipped = benchmarks_for("cuda", ops=["add_rms_norm"])
    assert not [b for b in timed if b.impl == "triton.jit_launch"]
    assert "add_rms_norm/triton.jit_launch: timed only when asked for (--impl triton.jit_launch)" in skipped
    timed, _ = benchmarks_for("cuda", impls=["triton.jit_launch"], ops=["add_rms_norm"])
    assert [b.impl for b in timed] == ["triton.jit_launch"]


def test_bench_sweep_writes_records_and_the_config_file(tmp_path, capsys, device):
    """`harness bench sweep` times the starting configuration and the candidates at the op's shapes for the
    device of the pytest run (the CPU's under the interpreter),
    records each, writes the module's configuration file for the device folder, and leaves the module's
    configuration in this process as it found it."""
    from harness.impls.triton import selective_state_update as ssu
    before = dict(ssu.CONFIG)
    out, cfg = tmp_path / "sweep.jsonl", tmp_path / "configs"
    assert main(["bench", "sweep", "--device", device.split(":")[0], "--op", "selective_state_update", "--group", "mamba2",
                 "--candidates", "1", *QUICK[:4], *BOUNDED, "--config-dir", str(cfg), "--device-name", "testdev",
                 "--out", str(out)]) == 0
    t = timings(out)
    # one record per candidate and shape (the CPU times one shape of the group, a GPU several)
    assert sorted({(r["bench"], r["candidate"]) for r in t}) == [("sweep/selective_state_update/mamba2/0", 0),
                                                                 ("sweep/selective_state_update/mamba2/1", 1)]
    assert len(t) % 2 == 0 and [r["candidate"] for r in t] == sorted(r["candidate"] for r in t)
    assert all(r["shape"]["layout"] == "mamba2" and r["ms_p50"] > 0 and r["impl"] == "triton" for r in t)
    assert all(r["config"] == ({"m2_pfirst": 1} if r["candidate"] else {}) for r in t)
    with open(cfg / "testdev" / "selective_state_update.json") as f:
        written = json.load(f)["default"]
    assert set(written) == set(before) and written["m2_pfirst"] in (before["m2_pfirst"], 1)
    assert ssu.CONFIG == before
    gates_clean(out, capsys)


def test_bench_sweep_child_dumps_its_stacks_before_it_would_be_killed(tmp_path, monkeypatch, device):
    """A sweep child (the process --isolate starts for one group) with a budget asks faulthandler to write
    every thread's stack 10 s before its parent's kill (budget + CHILD_GRACE_S): a hang says where it was."""
    import faulthandler

    from harness.bench import sweep
    asked = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda s, exit=False: asked.append((s, exit)))
    monkeypatch.setenv(sweep._CHILD, "1")
    assert main(["bench", "sweep", "--device", device.split(":")[0], "--op", "selective_state_update", "--group",
                 "mamba2", "--candidates", "1", *QUICK[:4], "--budget", "30", "--no-write",
                 "--out", str(tmp_path / "sweep.jsonl")]) == 0
    assert asked == [(30 + sweep.CHILD_GRACE_S - 10, False)]


def test_bench_sweep_isolated_runs_each_group_in_its_own_process(tmp_path, device):
    """--isolate (the default on GPUs) sweeps each (op, group) in a child process, one after the other, into
    the same records file under one run id; the second group's child starts from the configuration file the
    first wrote."""
    out, cfg = tmp_path / "sweep.jsonl", tmp_path / "configs"
    assert main(["bench", "sweep", "--device", device.split(":")[0], "--op", "selective_state_update", "--isolate",
                 "--candidates", "1", *QUICK[:4], *BOUNDED, "--config-dir", str(cfg), "--device-name", "testdev",
                 "--out", str(out)]) == 0
    recs = read_records(str(out))
    envs = [r for r in recs if r["kind"] == "env"]
    groups = {r["group"] for r in recs if r["kind"] == "timing"}
    assert len(envs) == 2 and groups == {"mamba2", "mamba1"}
    assert len({r["run_id"] for r in recs}) == 1
    with open(cfg / "testdev" / "selective_state_update.json") as f:
        written = json.load(f)["default"]
    from harness.impls.triton import selective_state_update as ssu
    assert set(written) == set(ssu.CONFIG)


def test_bench_sweep_isolated_children_get_a_device_the_cli_accepts(monkeypatch, tmp_path):
    """The children of --isolate are started with --device as the user gave it: the parent resolved "cuda" to
    "cuda:0", which the child's --device choices reject."""
    import subprocess
    from harness.bench import sweep
    from harness.cli import build_parser
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: seen.append(argv) or subprocess.CompletedProcess(argv, 0))
    cli = ["bench", "sweep", "--device", "cuda", "--op", "causal_conv1d_update", "--out", str(tmp_path / "s.jsonl")]
    args = build_parser(cli).parse_args(cli)
    assert sweep._isolated(args, ["causal_conv1d_update"], None, "cuda:0") == 0
    assert seen
    for argv in seen:
        child = argv[argv.index("bench"):]
        assert build_parser(child).parse_args(child).device == "cuda"  # exits on a --device it rejects


def test_bench_sweep_isolated_child_past_its_budget_is_killed(monkeypatch, tmp_path, capsys):
    """With --budget, a child of --isolate that runs past its budget and the grace after it is killed: the
    sweep says which group, exits non-zero, and goes on with the next group (a hung child cannot hold a
    GPU run); without --budget a child has no time limit."""
    import subprocess
    from harness.bench import sweep
    from harness.cli import build_parser
    limits = []

    def run(argv, timeout=None, **kw):
        limits.append(timeout)
        raise subprocess.TimeoutExpired(argv, timeout)
    monkeypatch.setattr(subprocess, "run", run)
    cli = ["bench", "sweep", "--device", "cuda", "--op", "selective_state_update", "--budget", "30",
           "--out", str(tmp_path / "s.jsonl")]
    args = build_parser(cli).parse_args(cli)
    assert sweep._isolated(args, ["selective_state_update"], None, "cuda:0") == 1
    out = capsys.readouterr().out
    assert len(limits) == len(sweep.SWEEPS["selective_state_update"]) >= 2
    assert all(30 < t <= 30 + sweep.CHILD_GRACE_S for t in limits)
    assert "selective_state_update/mamba2: its process ran" in out and "killed" in out
    limits.clear()
    monkeypatch.setattr(subprocess, "run", lambda argv, timeout=None, **kw: limits.append(timeout)
                        or subprocess.CompletedProcess(argv, 0))
    cli = cli[:-4] + cli[-2:]  # without --budget
    assert "--budget" not in cli
    assert sweep._isolated(build_parser(cli).parse_args(cli), ["selective_state_update"], None, "cuda:0") == 0
    assert limits and all(t is None for t in limits)


def test_bench_sweep_groups_of_other_ops_are_passed_over(tmp_path, capsys, device):
    """--group names of any sweepable op are accepted (runs that split the ops between processes share one
    list): the ops' own groups are swept; a name no op has, or a list with no group of the ops swept, is an
    error naming the argument."""
    from harness.bench.sweep import SWEEPS
    other = next(g.name for g in SWEEPS["gated_delta_rule_varlen"]
                 if g.name not in {h.name for h in SWEEPS["causal_conv1d_update"]})
    assert main(["bench", "sweep", "--device", device.split(":")[0], "--op", "causal_conv1d_update",
                 "--group", f"update,{other}", "--candidates", "1", *QUICK[:4], "--no-write",
                 "--out", str(tmp_path / "s.jsonl")]) == 0
    assert {r["group"] for r in read_records(str(tmp_path / "s.jsonl")) if r["kind"] == "timing"} == {"update"}
    capsys.readouterr()
    for bad in (other, "nosuch"):
        assert main(["bench", "sweep", "--device", "cpu", "--op", "causal_conv1d_update", "--group", bad,
                     "--list"]) != 0
        assert "--group" in capsys.readouterr().err


@pytest.mark.parametrize("fail_at", [1, 0], ids=["candidate", "start"])
def test_bench_sweep_leaves_out_configurations_that_fail_conformance(tmp_path, capsys, device, monkeypatch, fail_at):
    """A configuration that fails the op's conformance cases against the reference (`sweep.conformance`) is
    recorded with the reason and not timed; when the starting configuration fails, the op's sweep stops with
    exit 1 and writes no configuration file (a launch setting the compiler gets wrong must not win by speed)."""
    from harness.bench import sweep
    calls = []

    def conformance(op, fn, dev, refs, seed=0):
        calls.append(op)
        return "conformance: planted" if len(calls) - 1 == fail_at else None
    monkeypatch.setattr(sweep, "conformance", conformance)
    # in this process: on CUDA the sweep otherwise runs each group in a child, which the planted check misses
    monkeypatch.setenv(sweep._CHILD, "1")
    out, cfg = tmp_path / "sweep.jsonl", tmp_path / "configs"
    rc = main(["bench", "sweep", "--device", device.split(":")[0], "--op", "causal_conv1d_update", "--candidates", "1",
               *QUICK[:4], "--config-dir", str(cfg), "--device-name", "testdev", "--out", str(out)])
    recs = [r for r in read_records(str(out)) if r["kind"] == "timing"]
    bad = [r for r in recs if r.get("error")]
    assert len(bad) == 1 and bad[0]["candidate"] == fail_at and bad[0]["error"] == "conformance: planted"
    assert "conformance: planted" in capsys.readouterr().out
    if fail_at == 0:
        assert rc == 1 and len(recs) == 1 and not cfg.exists()
    else:
        assert rc == 0 and all(r["candidate"] == 0 for r in recs if not r.get("error"))
        assert (cfg / "testdev" / "conv1d.json").exists()


def test_bench_sweep_leaves_out_a_configuration_whose_runs_differ(tmp_path, capsys, device, monkeypatch):
    """Each configuration runs the timing shapes' inputs twice, built afresh: outputs that differ between the two
    runs (a race in the compiled code passes one run: docs/findings.md) fail it like a wrong value; at the
    starting configuration the op's sweep stops with exit 1 and writes no configuration file."""
    from harness.bench import sweep
    from harness.impls.registry import get
    ops = get("triton").ops
    real, calls = ops["causal_conv1d_update"], []

    def racy(*a, **k):
        calls.append(1)
        y = real(*a, **k)
        return y + len(calls) * 1e-3  # a different output every run
    monkeypatch.setitem(ops, "causal_conv1d_update", racy)
    monkeypatch.setenv(sweep._CHILD, "1")
    out, cfg = tmp_path / "sweep.jsonl", tmp_path / "configs"
    rc = main(["bench", "sweep", "--device", device.split(":")[0], "--op", "causal_conv1d_update", "--candidates", "1",
               *QUICK[:4], "--config-dir", str(cfg), "--device-name", "testdev", "--out", str(out)])
    recs = [r for r in read_records(str(out)) if r["kind"] == "timing"]
    assert rc == 1 and not cfg.exists() and len(recs) == 1
    assert "differs between two runs of the same inputs" in recs[0]["error"] and recs[0]["candidate"] == 0
    assert "a race in the compiled code" in capsys.readouterr().out


@pytest.mark.parametrize("op", ["gated_delta_rule_varlen", "kda_varlen"])
def test_sweep_conformance_cases_catch_wrong_outputs(device, op):
    """The delta-rule prefills' conformance cases pass with our Triton kernel at its configuration and name
    the case, the run and the output when a value is off (one element of the output moved by 1)."""
    from harness.bench.sweep import CHECK_REPS, conformance
    from harness.impls.registry import get
    impl = get("triton")
    why = impl.why_unavailable(device)
    if why:
        pytest.skip(why)
    fn = impl.ops[op]
    refs = {}
    assert conformance(op, fn, device, refs) is None
    assert refs

    def off(*a, **k):
        y = fn(*a, **k)
        y.view(-1)[0] += 1.0
        return y
    why = conformance(op, off, device, refs)
    assert why and why.startswith("conformance: ") and f"run 1 of {CHECK_REPS}: output error ratio" in why, why


def test_bench_sweep_no_write(tmp_path, device):
    """--no-write reports without writing a configuration file."""
    cfg = tmp_path / "configs"
    assert main(["bench", "sweep", "--device", device.split(":")[0], "--op", "causal_conv1d_update", "--candidates", "1",
                 *QUICK[:4], "--config-dir", str(cfg), "--no-write", "--out", str(tmp_path / "s.jsonl")]) == 0
    assert not cfg.exists()


def test_bench_throughput_subcommand(tmp_path, capsys):
    """`harness bench throughput` writes the engine's prefill and decode records."""
    out = tmp_path / "tp.jsonl"
    assert main(["bench", "throughput", "--device", "cpu", "--family", "mamba2", "--layers", "1", "--d-model", "32",
                 "--vocab", "64", "--d-state", "8", "--head-dim", "16", "--n-groups", "2", "--chunk-size", "8",
                 "--prefill", "8", "--decode-batch", "2", "--dtype", "float32", "--impl", "torch", "--reps", "2",
                 "--warmup", "1", "--no-hf", "--out", str(out)]) == 0
    t = timings(out)
    assert {r["op"] for r in t} == {"model_prefill", "model_decode"}
    assert all(r["eager_ms_p50"] == r["ms_p50"] and r["reps"] >= 2 for r in t)
    gates_clean(out, capsys)


def test_bench_throughput_profiles_the_decode_step(tmp_path, capsys):
    """--profile-decode DIR writes, after the timings, the eager decode step's Python functions by own time
    (cProfile) and its operators (torch.profiler), each headed by the step's host time per layer; a path that
    is a file is refused before anything runs or is written."""
    args = ["bench", "throughput", "--device", "cpu", "--family", "mamba2", "--layers", "2", "--d-model", "32",
            "--vocab", "64", "--d-state", "8", "--head-dim", "16", "--n-groups", "2", "--chunk-size", "8",
            "--prefill", "8", "--decode-batch", "2", "--dtype", "float32", "--impl", "torch", "--reps", "2",
            "--warmup", "1", "--no-hf"]
    prof = tmp_path / "prof"
    assert main(args + ["--profile-decode", str(prof), "--compare-launch", "--out", str(tmp_path / "tp.jsonl")]) == 0
    # the launch comparison is CUDA-only: skipped with the reason on the CPU
    assert "--compare-launch skipped (the launch shortcut is CUDA-only)" in capsys.readouterr().out
    assert not [r for r in read_records(str(tmp_path / "tp.jsonl")) if r.get("op") == "model_decode_jit_launch"]
    py, ops = (prof / "mamba2-decode-python.txt").read_text(), (prof / "mamba2-decode-ops.txt").read_text()
    for text in (py, ops):
        assert text.startswith("mamba2: eager decode step, 2 layers: host ") and " us per layer" in text
    assert "tottime" in py and " harness/engine/families/mamba2.py:" in py  # paths from the repository root
    from harness.env import REPO_ROOT
    assert REPO_ROOT.rstrip("/") + "/" not in py and "-packages/" not in py
    assert "Self CPU" in ops and "aten::" in ops
    assert not list(prof.glob("*.tmp"))
    capsys.readouterr()
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = tmp_path / "none.jsonl"
    assert main(args + ["--profile-decode", str(afile), "--out", str(out)]) == 2
    assert "--profile-decode" in capsys.readouterr().err and not out.exists()


def test_bench_host_subcommand(capsys):
    """`harness bench host` times each op's validator alone (p50 microseconds per call, with and without the
    index checks) at the spec's shapes: one row per shape; the gpu shapes are validated without filling
    their tensors."""
    from harness.bench.host import time_validators
    from harness.ops import SPECS
    assert main(["bench", "host", "--op", "causal_conv1d_update,gated_rms_norm", "--shapes", "contract",
                 "--reps", "3", "--min-time", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["op", "shapes", "dtype"] and len(lines) == 3
    assert [ln.split()[0] for ln in lines[1:]] == ["causal_conv1d_update", "gated_rms_norm"]
    rows = time_validators(["gated_delta_rule_varlen"], ("gpu",), Budget(min_reps=3, min_time=0))
    assert len(rows) == len(SPECS["gated_delta_rule_varlen"].shapes["gpu"])
    assert all(r["dtype"] == "bfloat16" and 0 < r["us_p50"] and 0 < r["us_p50_no_index"] for r in rows)
    assert main(["bench", "host", "--shapes", "contract,nope"]) == 2


def test_bench_host_json(tmp_path, capsys):
    """`--json` writes the printed rows and the environment as one document (made whole or not at all)."""
    import json
    out = tmp_path / "sub" / "host.json"
    assert main(["bench", "host", "--op", "gated_rms_norm", "--shapes", "contract", "--reps", "3",
                 "--min-time", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[1:]
    doc = json.loads(out.read_text())
    assert doc["env"]["device"] == "cpu" and doc["threads"] == 1 and len(doc["rows"]) == len(printed) >= 1
    assert [r["op"] for r in doc["rows"]] == [ln.split()[0] for ln in printed] == ["gated_rms_norm"] * len(printed)
    assert all(r["us_p50"] > 0 and r["us_p50_triton"] > 0 for r in doc["rows"])
    assert [p.name for p in out.parent.iterdir()] == ["host.json"]  # no temporary file left


def test_bench_host_engine_decode(capsys):
    """`--engine` times one eager engine decode step per family with the kernels not run: a row per family, per
    step and per layer (an unknown family: `test_unknown_names_are_usage_errors`)."""
    quick = ["--reps", "3", "--min-time", "0", "--op", "gated_rms_norm", "--shapes", "contract"]
    assert main(["bench", "host", *quick, "--engine", "mamba2,gdn"]) == 0
    out = capsys.readouterr().out
    rows = out.split("eager engine decode step")[1].strip().splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["mamba2", "gdn"]
    assert all(float(r.split()[-1]) > 0 and float(r.split()[-2]) >= float(r.split()[-1]) for r in rows)


def test_bench_host_times_the_triton_path_and_restores_the_launches(capsys):
    """The "triton path" column: our op's Python path per call with every kernel launch replaced by the launch
    shortcut's key (no kernel runs), `out=` given; it exceeds the validator's time (the validator is part of it),
    and afterwards every Triton module launches through `_common.launch` again."""
    from harness.bench.host import launches_keyed_only, time_validators
    from harness.impls.triton import _common
    from harness.ops import SPECS
    quick = Budget(min_reps=5, min_time=0, warmup=1)
    ops = ["gated_delta_rule_update", "causal_conv1d_update"]
    rows = time_validators(ops, ("gpu",), quick, triton_path=True)
    assert [r["op"] for r in rows] == [op for op in SPECS if op in ops for _ in SPECS[op].shapes["gpu"]]
    assert all(r["us_p50_triton"] > 0 for r in rows)
    users = [m for m in _common.kernel_modules() if m is not _common and hasattr(m, "launch")]
    assert users and all(m.launch is _common.launch for m in users)
    # the launch plans' launches (`launch_fixed`, called by the ops and by `_common.Staged`)
    fixed_users = [m for m in _common.kernel_modules() if hasattr(m, "launch_fixed")]
    assert _common in fixed_users and len(fixed_users) > 1
    assert all(m.launch_fixed is _common.launch_fixed for m in fixed_users)
    real_fixed = _common.launch_fixed
    with launches_keyed_only():
        assert all(m.launch is not _common.launch for m in users)
        assert all(m.launch_fixed is not real_fixed for m in fixed_users)
    assert all(m.launch is _common.launch for m in users)
    assert all(m.launch_fixed is real_fixed for m in fixed_users)
    assert main(["bench", "host", "--op", "gated_delta_rule_update", "--shapes", "gpu", "--reps", "3",
                 "--min-time", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "triton path" in lines[0] and all(float(ln.split()[5]) > 0 for ln in lines[1:])



def test_bench_host_new_signatures(capsys, tmp_path):
    """With the gpu shapes, each prefill op at `count` token counts not seen before, one call each and a repeat:
    a row per op with a token count in its shapes (not the decode ops), both p50s; the repeat finds the launch
    plan the first call built, so it costs less. The JSON document holds the rows."""
    from harness.bench.host import time_new_signatures
    rows = time_new_signatures(["ssd_varlen", "gated_delta_rule_update"], count=5, first_tokens=32, step=16)
    assert [r["op"] for r in rows] == ["ssd_varlen"] and rows[0]["tokens"] == [48, 112]
    assert 0 < rows[0]["us_p50_repeat"] < rows[0]["us_p50_new"]
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--op", "causal_conv1d_varlen", "--shapes", "gpu", "--reps", "3", "--min-time", "0",
                 "--json", str(out)]) == 0
    assert "prefill at a new token count" in capsys.readouterr().out
    assert [r["op"] for r in json.loads(out.read_text())["new_signatures"]] == ["causal_conv1d_varlen"]


def test_bench_host_every_op():
    """Every op's input set as `harness bench host` rebuilds it is valid (the speculative-decode ops too: a
    slot table, accepted-token counts and offsets over the shape's tokens, not the pool's first dim)."""
    from harness.bench.host import time_validators
    from harness.ops import SPECS
    quick = Budget(min_reps=1, min_time=0, warmup=0)
    rows = time_validators(None, ("contract",), quick)
    assert [r["op"] for r in rows] == [n for n, s in SPECS.items() for _ in s.shapes["contract"]]
    spec_ops = [n for n in SPECS if n.endswith("_spec")]
    assert spec_ops and len(time_validators(spec_ops, ("gpu",), quick)) == sum(
        len(SPECS[n].shapes["gpu"]) for n in spec_ops)

def test_bench_loader_subcommand(tmp_path, capsys):
    """`harness bench loader` times every loader on one synthetic checkpoint and writes one timing record per
    loader (GB/s of checkpoint data) next to the JSON summary."""
    out, js = tmp_path / "loader.jsonl", tmp_path / "loader.json"
    assert main(["bench", "loader", "--size-gb", "0.01", "--d-model", "256", "--dtype", "float32", "--reps", "2",
                 "--dir", str(tmp_path / "ckpt"), "--out", str(out), "--json", str(js)]) == 0
    t = timings(out)
    assert {r["impl"] for r in t} == {"harness.loader", "harness.loader tp=2 rank0", "reference.loader",
                                      "transformers.from_pretrained"}
    for r in t:
        assert r["bench"] == f"loader/{r['impl']}" and r["reps"] == 2 and r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert r["gb_s"] == pytest.approx(r["bytes"] / (r["ms_p50"] * 1e-3) / 1e9)
    assert set(json.loads(js.read_text())["loads"]) == {r["impl"] for r in t}
    assert main(["bench", "loader", "--size-gb", "0.001"]) == 2
    gates_clean(out, capsys)


# ------------------------------------------------------------------------------------------ timing module

def test_cpu_budget_reaches_samples_and_time():
    """The CPU timer samples until both the sample count and the minimum time are reached, and stops at the
    maximum time even with fewer samples."""
    ms = cpu_samples([lambda: None], Budget(min_reps=25, min_time=0.0))
    assert len(ms) == 25
    import time
    t0 = time.perf_counter()
    ms = cpu_samples([lambda: None], Budget(min_reps=5, min_time=0.05))
    assert time.perf_counter() - t0 >= 0.05 and len(ms) > 5
    ms = cpu_samples([lambda: time.sleep(0.02)], Budget(min_reps=1000, min_time=0.0, max_time=0.1, warmup=0))
    assert 2 <= len(ms) <= 8


def test_timing_fields_carry_eager_graph_and_host():
    """A timing with both figures gives an eager and a graph record, each with both p50s and eager - graph."""
    t = Timing(eager=Stats(1.0, 1.2, 1.5, 30), graph=Stats(0.7, 0.8, 0.9, 20), timer="do_bench")
    e, g = t.fields(False), t.fields(True)
    assert (e["ms_p50"], e["cuda_graph"], e["timer"]) == (1.2, False, "do_bench")
    assert (g["ms_p50"], g["cuda_graph"], g["timer"], g["reps"]) == (0.8, True, "do_bench_cudagraph", 20)
    for r in (e, g):
        assert (r["eager_ms_p50"], r["graph_ms_p50"]) == (1.2, 0.8) and r["host_ms"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="graph"):
        Timing(eager=Stats(1, 1, 1, 1)).fields(True)
    with pytest.raises(ValueError, match="CUDA device"):
        measure([lambda: None], "cpu", graph=True)


def test_gate_keeps_eager_and_graph_apart(tmp_path, capsys):
    """An eager and a CUDA-graph timing of one case are two gate cases: a graph regression is not hidden
    behind the eager record of the same case (and the other way round)."""
    def run(path, graph_ms):
        w = RecordWriter(str(path))
        w.write("env", env={"device": "cuda:0", "device_name": "test GPU"})
        base = dict(bench="ssd_varlen/triton", op="ssd_varlen", impl="triton", device="cuda:0", dtype="bfloat16",
                    shape={"T": 4096}, tokens=4096, peer=False)
        for graph, ms in ((True, graph_ms), (False, 1.0)):
            w.write("timing", **base, cuda_graph=graph, ms_p20=ms, ms_p50=ms, ms_p80=ms, tok_s=4096 / (ms * 1e-3))
    run(tmp_path / "base.jsonl", 0.5)
    run(tmp_path / "cand.jsonl", 0.9)
    capsys.readouterr()
    assert main(["gate", "--baseline", str(tmp_path / "base.jsonl"), "--candidate", str(tmp_path / "cand.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "performance" in out and "cuda_graph" in out


def test_gpu_timer_tops_up_samples_and_keeps_eager_on_capture_failure(monkeypatch):
    """On GPUs the samples come from triton.testing (stood in for here, as this machine may have no GPU):
    a slow call whose first do_bench pass gives 2 samples gets a second pass sized for the rest; the
    CUDA-graph figures come from do_bench_cudagraph passes of 10 samples each; the launch time comes from
    bursts of calls each after the device is drained; a call that cannot be captured keeps its eager figures
    and says why."""
    import triton.testing
    calls = []

    def do_bench(fn, warmup=25, rep=100, return_mode="mean", **kw):
        calls.append(("eager", rep))
        return [50.0] * max(1, int(rep / 50.0))

    def do_bench_cudagraph(fn, rep=20, return_mode="mean", **kw):
        calls.append(("graph", rep))
        return [40.0] * 10
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    from harness.bench import timing
    monkeypatch.setattr(timing, "synchronize", lambda device: calls.append(("sync", device)))
    t = measure([lambda: None], "cuda:0", Budget(min_reps=20), graph=True)
    assert t.eager.n == 20 and t.graph.n == 20 and t.timer == "do_bench"
    # eager passes, then the launch bursts (each after draining the device; one call per burst at 50 ms a
    # call), then the graph passes
    assert calls == ([("eager", 100.0), ("eager", 900.0)] + [("sync", "cuda:0")] * (timing.LAUNCH_BURSTS + 1)
                     + [("graph", 100.0), ("graph", 100.0)])
    assert t.fields(True)["host_ms"] == pytest.approx(10.0)
    assert t.launch.n == timing.LAUNCH_BURSTS and 0 <= t.fields(False)["launch_ms"] < 1.0
    calls.clear()

    def broken(fn, rep=20, return_mode="mean", **kw):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", broken)
    t = measure([lambda: None], "cuda:0", Budget(min_reps=2), graph=True)
    assert t.graph is None and "stream is capturing" in t.graph_error
    assert t.fields()["graph_error"] == t.graph_error and t.fields()["ms_p50"] == 50.0


def test_launch_samples_size_bursts_by_the_call_and_stop_for_slow_calls(monkeypatch):
    """launch_samples: calls per burst from the eager time (8 for a fast call, 1 for a call over the burst's
    device time), LAUNCH_BURSTS bursts, but only LAUNCH_MIN_BURSTS once LAUNCH_MAX_S seconds are spent."""
    from harness.bench import timing
    n = []
    fn = lambda: n.append(1)  # noqa: E731
    assert len(timing.launch_samples(fn, "cpu", 0.01)) == timing.LAUNCH_BURSTS and len(n) == 8 * timing.LAUNCH_BURSTS
    n.clear()
    monkeypatch.setattr(timing, "LAUNCH_MAX_S", 0.0)
    assert len(timing.launch_samples(fn, "cpu", 50.0)) == timing.LAUNCH_MIN_BURSTS
    assert len(n) == timing.LAUNCH_MIN_BURSTS


def test_new_shape_launch_samples_build_each_call_untimed(monkeypatch):
    """new_shape_launch_samples: `make(i)` builds call i outside the timing, the device is drained before each
    call, NEW_SHAPE_CALLS calls, only LAUNCH_MIN_BURSTS once NEW_SHAPE_MAX_S seconds are spent (a kernel tuning
    itself at each new shape); each sample is the call's time alone."""
    import time
    from harness.bench import timing
    seen = []

    def make(i):
        time.sleep(0.01)  # building the inputs is not timed
        return lambda: seen.append(i)
    ms = timing.new_shape_launch_samples(make, "cpu")
    assert seen == list(range(timing.NEW_SHAPE_CALLS)) and len(ms) == timing.NEW_SHAPE_CALLS
    assert all(0 <= m < 5.0 for m in ms)
    seen.clear()
    monkeypatch.setattr(timing, "NEW_SHAPE_MAX_S", 0.0)
    assert len(timing.new_shape_launch_samples(make, "cpu")) == timing.LAUNCH_MIN_BURSTS == len(seen)


def test_prefill_cases_time_a_launch_at_new_token_counts(monkeypatch):
    """On a GPU (here: the launch timing stubbed in), a case with a token count T also times its call at T + 16,
    T + 32, ... (inputs drawn anew at each: `launch_new_ms` in its records); a case without T (decode) does
    not; where those calls fail, the timing stands and says why."""
    from harness.bench import runner, timing
    from harness.bench.runner import build_cases, measure_case

    def fake_measure(fns, device, budget=None, graph=False):
        fns[0]()
        return Timing(eager=Stats(1.0, 1.0, 1.0, 1), launch=Stats(0.01, 0.01, 0.01, 1))
    monkeypatch.setattr(runner, "measure", fake_measure)
    tokens = []
    real_make = runner._new_token_calls

    def spying(case, seed):
        make = real_make(case, seed)

        def counted(i):
            fn = make(i)
            return lambda: (tokens.append(case.shape["T"] + 16 * (i + 1)), fn())
        return counted
    monkeypatch.setattr(runner, "_new_token_calls", spying)
    case = [c for c in build_cases("cpu", impls=["torch"], ops=["gated_rms_norm"])[0] if c.op != "copy"][0]
    t, _ = measure_case(case, Budget(min_reps=1))
    T = case.shape["T"]
    assert tokens == [T + 16 * (i + 1) for i in range(timing.NEW_SHAPE_CALLS)]
    fields = t.fields(False)
    assert fields["launch_new_ms"] >= 0 and "launch_new_error" not in fields
    dec = [c for c in build_cases("cpu", impls=["torch"], ops=["causal_conv1d_update"])[0] if c.op != "copy"][0]
    assert "launch_new_ms" not in measure_case(dec, Budget(min_reps=1))[0].fields(False)

    def broken(case, seed):
        def make(i):
            raise RuntimeError("no inputs at this token count")
        return make
    monkeypatch.setattr(runner, "_new_token_calls", broken)
    fields = measure_case(case, Budget(min_reps=1))[0].fields(False)
    assert "launch_new_ms" not in fields and "no inputs at this token count" in fields["launch_new_error"]
    assert fields["ms_p50"] == 1.0


# ------------------------------------------------------------------------------------------ launches

def test_bench_kernels_records_each_launch(tmp_path, capsys):
    """`--kernels` gives every eager record `kernels`: per name its time and count per call, largest first
    (on the CPU: operators by self CPU time, `kernels_source` "cpu"); the table prints each case's top 3, the
    gate reads the file and the report lists them; without `--kernels` the fields are absent."""
    out, plain = tmp_path / "kernels.jsonl", tmp_path / "plain.jsonl"
    argv = ["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch", *QUICK]
    capsys.readouterr()
    assert main([*argv, "--kernels", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    t = timings(out)
    assert [r["op"] for r in t] == ["copy", "gated_rms_norm", "gated_rms_norm"]
    for r in t:
        ks = r["kernels"]
        assert r["kernels_source"] == "cpu" and "kernels_error" not in r and r["ms_p50"] > 0
        assert ks and all(k["us"] > 0 and k["calls"] > 0 and 0 < len(k["name"]) <= 80 for k in ks)
        assert [k["us"] for k in ks] == sorted((k["us"] for k in ks), reverse=True)
        assert len({k["name"] for k in ks}) == len(ks)
    norm = t[1]["kernels"]
    assert any(k["name"].startswith("aten::") for k in norm) and len(norm) >= 3
    table = printed.split("launches, top 3 of each case")[1]
    assert "operators by self CPU time" in table.splitlines()[0]
    for r in t:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        head = next(i for i, ln in enumerate(table.splitlines()) if ln.startswith(f"{r['op']} torch") and shape in ln)
        listed = table.splitlines()[head + 1:head + 1 + min(3, len(r["kernels"]))]
        assert [ln.split("x  ", 1)[1] for ln in listed] == [k["name"] for k in r["kernels"][:3]]
    gates_clean(out, capsys)
    html = tmp_path / "r.html"
    assert main(["report", str(out), "-o", str(html)]) == 0
    page = html.read_text(encoding="utf-8")
    assert page.count('<details class="launch">') == 3 and norm[0]["name"] in page
    assert main([*argv, "--out", str(plain)]) == 0
    assert "launches, top" not in capsys.readouterr().out
    assert not [r for r in timings(plain) if {"kernels", "kernels_source", "kernels_error"} & set(r)]


def test_failed_profile_keeps_the_timing(monkeypatch, tmp_path, capsys):
    """A case whose profile raises keeps its timing and records `kernels_error` (the run exits 0); the table
    says why there is no list."""
    from harness.bench import runner

    def broken(fns, device, calls=10):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
    monkeypatch.setattr(runner, "profile_launches", broken)
    out = tmp_path / "k.jsonl"
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "torch", *QUICK, "--kernels",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for r in timings(out):
        assert r["ms_p50"] > 0 and "kernels" not in r and "CUPTI_ERROR_NOT_INITIALIZED" in r["kernels_error"]
    assert printed.count("no profile: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED") == 3
    gates_clean(out, capsys)


def test_profile_launches_on_the_cpu_and_bad_arguments():
    """On the CPU the entries are the operators the calls ran, per call (count and self time); bad arguments
    raise ValueError naming them."""
    import torch

    from harness.bench.timing import profile_launches
    x = torch.randn(32, 32)
    source, ks = profile_launches([lambda: torch.sigmoid(x) * x * x], "cpu", calls=4)
    by = {k["name"]: k for k in ks}
    assert source == "cpu" and by["aten::mul"]["calls"] == 2 and by["aten::sigmoid"]["calls"] == 1
    assert all(k["us"] > 0 for k in ks)
    for kw, named in ((dict(calls=0), "calls"), (dict(warmup=-1), "warmup"), (dict(device="mps"), "device")):
        with pytest.raises(ValueError, match=named):
            profile_launches(lambda: None, **{"device": "cpu", **kw})


def test_profile_launches_on_cuda_groups_device_activity(monkeypatch):
    """On CUDA the entries are the device's activity (kernels, copies, memsets) grouped by name: time is the
    device time per call, calls the launches per call; host-side events and annotations are left out, long
    names cut to 80 characters, the largest first. (torch.profiler stood in for: this machine may have no GPU.)"""
    import torch.profiler
    from torch.autograd import DeviceType

    from harness.bench import timing

    class Range:
        def __init__(self, us):
            self.us = us

        def elapsed_us(self):
            return self.us

    def ev(name, us, device=DeviceType.CUDA, activity="kernel", annotation=False):
        return SimpleNamespace(name=name, device_type=device, activity_type=activity, is_user_annotation=annotation,
                               is_async=False, is_python_function=False, self_cpu_time_total=us,
                               time_range=Range(us))
    long_name = "void chunk_fwd_kernel_h<" + "float, " * 30 + ">(...)"
    events = []
    for _ in range(4):  # four profiled calls
        events += [ev("aten::mm", 900.0, device=DeviceType.CPU, activity="cpu_op"),
                   ev("cudaLaunchKernel", 5.0, device=DeviceType.CPU, activity="cuda_runtime"),
                   ev("prep_kernel", 191.0), ev(long_name, 100.0), ev(long_name, 185.0),
                   ev("Memset (Device)", 2.0, activity="gpu_memset"),
                   ev("gated_delta_rule", 480.0, activity="gpu_user_annotation", annotation=True)]
    seen = {}

    class Profile:
        def __init__(self, activities):
            seen["activities"] = activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(timing, "synchronize", lambda device: None)
    calls = []
    source, ks = timing.profile_launches(lambda: calls.append(1), "cuda:0", calls=4, warmup=2)
    assert source == "cuda" and len(calls) == 6
    assert torch.profiler.ProfilerActivity.CUDA in seen["activities"]
    assert ks == [{"name": long_name[:77] + "...", "us": 285.0, "calls": 2.0},
                  {"name": "prep_kernel", "us": 191.0, "calls": 1.0},
                  {"name": "Memset (Device)", "us": 2.0, "calls": 1.0}]
    events.clear()
    with pytest.raises(RuntimeError, match="no device activity"):
        timing.profile_launches(lambda: None, "cuda:0")


def test_timing_fields_put_launches_on_the_eager_record_only():
    """The launch profile goes into the eager record; the CUDA-graph record of the same case does not carry it."""
    t = Timing(eager=Stats(1.0, 1.2, 1.5, 30), graph=Stats(0.7, 0.8, 0.9, 20), timer="do_bench",
               kernels=[{"name": "k", "us": 800.0, "calls": 1.0}], kernels_source="cuda")
    assert t.fields(False)["kernels"] == t.kernels and t.fields(False)["kernels_source"] == "cuda"
    assert not {"kernels", "kernels_source", "kernels_error"} & set(t.fields(True))
    t = Timing(eager=Stats(1.0, 1.2, 1.5, 30), kernels_error="RuntimeError: no profiler")
    assert t.fields()["kernels_error"] == "RuntimeError: no profiler" and "kernels" not in t.fields()
