"""scripts/gpu.sh: its arguments are checked before anything runs or is removed (on any machine)."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_sh(*args):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _shell_function(name: str) -> str:
    """The definition of gpu.sh's function `name`, from its first line to its closing brace (a newline after)."""
    src = (ROOT / "scripts" / "gpu.sh").read_text()
    fn = src[src.index(f"\n{name}() {{") + 1:]
    return fn[:fn.index("\n}\n") + 2] + "\n"


@pytest.mark.parametrize("args, message", [
    (["--gpus", "3"], "--gpus: expected 1 or 2, got 3"),
    (["--steps", "suites,bogus"],
     "--steps: expected a subset of env,tp,suites,bench,throughput,peers,ieee,sweep, got bogus"),
    (["--budget", "ten"], "--budget: expected whole seconds, got ten"),
    (["--resume", "/no/such/run"], "--resume: expected the logs folder of an earlier run, got /no/such/run"),
    (["--fresh", "suites,tp"], "--fresh: expected a subset of suites,bench,peers,ieee, got tp"),
    (["--frobnicate"], "unknown argument --frobnicate"),
])
def test_bad_arguments_are_refused_first(args, message):
    r = _gpu_sh(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["0", "ten", ""])
def test_a_bad_peers_gib_is_refused_first(value):
    """PEERS_GIB (GPU memory per worker of the peers and ieee steps) that is not a whole number >= 1 stops the
    run before anything runs or is removed."""
    import os
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PEERS_GIB": value})
    assert r.returncode == 2 and f"PEERS_GIB: expected whole GiB >= 1, got '{value}'" in r.stderr, r.stderr


def test_help_names_the_lanes_and_resume():
    r = _gpu_sh("--help")
    assert r.returncode == 0
    assert "--gpus" in r.stdout and "--resume" in r.stdout and "--fresh" in r.stdout and "tp" in r.stdout


@pytest.mark.parametrize("resume, fresh, expected", [
    ("", "", "suites:no peers:no ieee:no bench:no throughput:no tp:no"),
    ("run", "", "suites:yes peers:yes ieee:yes bench:yes throughput:no tp:no"),
    ("run", "suites", "suites:no peers:yes ieee:yes bench:yes throughput:no tp:no"),
    ("run", "suites,bench", "suites:no peers:yes ieee:yes bench:no throughput:no tp:no"),
    ("run", "ieee", "suites:yes peers:yes ieee:no bench:yes throughput:no tp:no"),
])
def test_fresh_steps_start_over_while_the_others_resume(resume, fresh, expected):
    """`resumes STEP` (which gates the outcome file passed to pytest --resume, the bench's --resume, the removal of
    the step's old files and whether its new records are added to them): the suites, peers, ieee and bench steps
    resume with --resume but those --fresh names; throughput and tp always start over (a resumed throughput
    step once added its first preset's records to the file twice)."""
    fn = _shell_function("resumes")
    script = (f'RESUME={resume!r}; FRESH={fresh!r}\n{fn}\n'
              'for s in suites peers ieee bench throughput tp; do resumes $s && a=yes || a=no; '
              'printf "%s:%s " $s $a; done')
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


def test_resumed_bench_replaces_only_the_records_it_timed_again(tmp_path):
    """A resumed bench that times an op again (BENCH_RETIME) drops the old records of the (op, implementation)
    pairs the new file has, and only those: implementations a narrowed bench (BENCH_IMPLS) left out, other
    ops and non-timing lines stay."""
    import json
    import os
    old, new = tmp_path / "bench.jsonl", tmp_path / "new.jsonl"

    def rec(op, impl, ms):
        return json.dumps(dict(kind="timing", op=op, impl=impl, ms_p50=ms))
    old.write_text("\n".join([rec("a", "triton", 1), rec("a", "vllm", 2), rec("b", "triton", 3), '{"kind": "env"}',
                              '{"kind": "tim']) + "\n")
    new.write_text(rec("a", "triton", 9) + "\n")
    src = (ROOT / "scripts" / "gpu.sh").read_text()
    retime = next(ln for ln in src.splitlines() if ln.startswith("retime_ops() "))  # a one-line function
    drop = _shell_function("drop_retimed")
    script = f'want() {{ return 1; }}\n{retime}\n{drop}\ndrop_retimed "$1" "$2"'
    r = subprocess.run(["bash", "-c", script, "-", str(old), str(new)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "BENCH_RETIME": "a"})
    assert r.returncode == 0, r.stderr
    kept = [json.loads(ln) for ln in old.read_text().splitlines()]
    assert [(k.get("kind"), k.get("op"), k.get("impl")) for k in kept] == [
        ("timing", "a", "vllm"), ("timing", "b", "triton"), ("env", None, None)], kept


def test_faulted_tests_have_their_calls_replayed(tmp_path):
    """After the suites or peers step, each test whose outcome line carries a last op call (it lost the CUDA
    context) has that call run again by `harness replay` (under compute-sanitizer where installed; not here:
    the replayed call is a CPU one), once per test, into the replay log; lines without a call are passed
    over."""
    import json
    import os

    import torch

    from harness.impls import registry
    from harness.ops import SPECS
    from harness.testing.lastcall import describe_call
    from reference.testing import gen
    spec = SPECS["gated_delta_rule_varlen"]
    args, options = spec.split(spec.inputs(spec.shapes["contract"][0], torch.float32, "cpu", gen(0)))
    desc = describe_call(spec.name, registry.get("torch").op(spec.name), args, options)
    outcomes, log = tmp_path / "outcomes.jsonl", tmp_path / "replay.txt"
    lines = [{"nodeid": "suites/a.py::test_f[x y]", "outcome": "failed", "last_call": desc},
             {"nodeid": "suites/a.py::test_f[x y]", "outcome": "failed", "last_call": desc},
             {"nodeid": "suites/a.py::test_g", "outcome": "failed", "why": "AssertionError"}]
    outcomes.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    fn = _shell_function("replay_faults")
    script = f'left() {{ echo 999; }}\nlimit() {{ echo "$1"; }}\nlog() {{ :; }}\n{fn}\nreplay_faults "$1" "$2"'
    r = subprocess.run(["bash", "-c", script, "-", str(outcomes), str(log)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "PATH": os.environ["PATH"],
                            "COMPUTE_SANITIZER": ""})
    assert r.returncode == 0, r.stderr
    text = log.read_text()
    assert text.count("== suites/a.py::test_f[x y]") == 1 and "test_g" not in text, text
    assert "replaying gated_delta_rule_varlen by" in text and "returned torch.float32" in text and "exit 0" in text, text


def test_autotune_results_are_kept_and_nothing_else(tmp_path):
    """`keep_tuned FROM TO` (Triton's autotune results kept between runs in .peers/autotune/): every
    `*.autotune.json` under FROM lands in TO at the same relative path, compiled kernels do not, files already
    in TO stay, and a missing FROM is no error."""
    fn = _shell_function("keep_tuned")
    cache, kept = tmp_path / "cache", tmp_path / "kept"
    (cache / "ABC").mkdir(parents=True)
    (cache / "ABC" / "chunk_fwd_kernel.autotune.json").write_text('{"key": [1]}')
    (cache / "ABC" / "chunk_fwd_kernel.cubin").write_text("binary")
    (kept / "OLD").mkdir(parents=True)
    (kept / "OLD" / "k.autotune.json").write_text("{}")
    script = f'{fn}\nkeep_tuned {cache} {kept} && keep_tuned {tmp_path / "none"} {tmp_path / "other"}'
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file()) == \
        ["ABC/chunk_fwd_kernel.autotune.json", "OLD/k.autotune.json"]
    assert (kept / "ABC" / "chunk_fwd_kernel.autotune.json").read_text() == '{"key": [1]}'
    assert not (tmp_path / "other").exists()


def test_a_cut_step_records_its_running_tests_before_they_are_placed(tmp_path):
    """`cut_in` (run before `place` adds the step's outcome lines to the baseline folder): the tests the cut
    pytest was still in are logged with how long they had run and added to the outcome file as lines "cut",
    which `--resume` starts first; the .running file is gone after."""
    import json
    import os
    import time
    outcomes = tmp_path / "outcomes-peers.jsonl"
    outcomes.write_text(json.dumps({"nodeid": "a.py::t0", "when": "call", "outcome": "passed"}) + "\n")
    (tmp_path / "outcomes-peers.jsonl.running").write_text(json.dumps({"a.py::slow[x y]": time.time() - 300}))
    fn = _shell_function("cut_in")
    log = tmp_path / "gpu.log"
    script = f'LOG={str(log)!r}; OURS_PATH={str(ROOT)!r}\nlog() {{ echo "$*" >> "$LOG"; }}\n{fn}\ncut_in peers "$1"'
    r = subprocess.run(["bash", "-c", script, "-", str(outcomes)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PATH": os.environ["PATH"]})
    assert r.returncode == 0, r.stderr
    lines = [json.loads(ln) for ln in outcomes.read_text().splitlines()]
    assert [(x["nodeid"], x["outcome"]) for x in lines] == [("a.py::t0", "passed"), ("a.py::slow[x y]", "cut")]
    assert 299 <= lines[1]["seconds"] <= 330, lines
    text = log.read_text()
    assert "peers: running when it ended: a.py::slow[x y] (30" in text and "1 test(s) recorded as cut" in text, text
    assert not (tmp_path / "outcomes-peers.jsonl.running").exists()


def test_the_peers_step_keeps_every_autotune_result():
    """The peers step's pytest runs with TRITON_CACHE_AUTOTUNING=1 (each peer's @triton.autotune keeps its
    results in Triton's cache, gathered into .peers/autotune); the bench's harness runs do not (a bench
    tunes on an idle GPU, not under a suite's load)."""
    assert "env TRITON_CACHE_AUTOTUNING=1 python3 -m pytest suites/" in _shell_function("step_peers")
    assert "TRITON_CACHE_AUTOTUNING" not in _shell_function("step_bench")
    assert "env HARNESS_FLA_FP32=ieee TRITON_CACHE_AUTOTUNING=1 python3 -m pytest suites/" in \
        _shell_function("step_ieee")


@pytest.mark.parametrize("addopts, ok", [("", True), ("--no-such-option", False)])
def test_preflight_checks_the_generation_cap_before_any_step(addopts, ok):
    """`preflight` (run before anything is removed when the suites, peers, ieee or tp step is asked for): a property
    test capped by --generate-seconds must pass with the cap's note in its outcome line, on this machine's
    pytest and hypothesis; otherwise gpu.sh stops with the reason (exit 3). A GPU machine's newer hypothesis
    once made every capped test fail, which a run of hundreds of seconds found instead."""
    import os
    fn = _shell_function("preflight")
    env = {**os.environ, "PYTEST_ADDOPTS": addopts}
    for k in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "HARNESS_RUN_ID"):
        env.pop(k, None)
    r = subprocess.run(["bash", "-c", f"{fn}\npreflight"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=env)
    if ok:
        assert r.returncode == 0 and r.stderr == "", r.stderr
    else:
        assert r.returncode == 3 and "gpu.sh: preflight: expected a property test capped by --generate-seconds " \
            "to pass, got exit 4" in r.stderr, r.stderr


@pytest.mark.parametrize("gib, workers, per, expected", [
    (79, 14, "", 7), (139, 14, "", 13), (79, 4, "", 4), (79, 14, "100", 1), (79, 14, "20", 3)])
def test_the_peers_workers_fit_the_gpu_memory(gib, workers, per, expected):
    """`peer_workers`: the peers and ieee steps run --workers pytest workers, at most the GPU's memory over
    PEERS_GIB (default 10 GiB a worker; at least one): fla-core's tests in 14 workers on an 80 GB card stopped on
    CUDA out-of-memory errors. Both steps' pytest takes its -n from it; the suites step keeps --workers."""
    per_worker = f"PEERS_GIB={per}" if per else ""
    script = f"GPU_GIB={gib}; WORKERS={workers}; {per_worker}\n{_shell_function('peer_workers')}peer_workers"
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(expected)
    assert '-n "$(peer_workers)"' in _shell_function("step_peers")
    assert '-n "$(peer_workers)"' in _shell_function("step_ieee")
    assert '-n "$WORKERS"' in _shell_function("step_suites")
