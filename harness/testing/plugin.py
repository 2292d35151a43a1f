"""The ssm-harness pytest plugin.

Options
  --device {auto,cpu,cuda,xpu}   where the implementations run (a device the machine lacks is a usage error)
  --impl NAME                    repeatable; a registered name or `module:object`; default: every
                                 registered implementation usable on the device
  --op NAME                      repeatable; keep only the tests that compare these ops (an op name of
                                 harness.ops found in the test's id or code); default: every test
  --profile {ci,dev,nightly}     hypothesis profile (ci is the default)
  --results PATH                 append one JSONL record per comparison (see harness.records)
  --outcomes PATH                append one JSONL line per finished test (node id, outcome, seconds, the
                                 failure's last line, the time it was written) as it finishes: a run killed
                                 by a time limit still says what failed and why (pytest's own summary only
                                 comes at the end); the tests running at any moment are in PATH.running
                                 ({node id: start time}), so a killed run also says which tests it was in
  --resume PATH                  repeatable; an --outcomes file of an earlier (cut) run: the tests it records
                                 as passed or skipped are deselected, so the run does what is left and the
                                 failures again; the tests it records as slow (cut while running: see
                                 harness.testing.resume) start first, one per worker
  --shrink-seconds S             stop shrinking a failing hypothesis example after S seconds (hypothesis' own
                                 limit is 300 s: on a GPU run a failing test could take minutes)
  --generate-seconds S           a property test draws no new example after S seconds of drawing (at least one
                                 example runs; a failure found is still shrunk): the examples run decide it, and
                                 its --outcomes line says the cap ended it and after how many examples
  --resume-failed {rerun,skip}   skip: with --resume, a test whose last recorded failure is an assertion (a
                                 comparison's verdict, e.g. a peer's written-up finding) is not run again;
                                 failures of any other kind (errors, crashes, lost CUDA contexts) are
                                 run again

A lost CUDA context
  A kernel fault (an illegal or misaligned address) leaves the process's CUDA context unusable: every later
  CUDA call in it fails with the same error. After a failed test on a CUDA device the plugin checks the
  context; when it is lost, that test's --outcomes line says so first, and the process ends after the
  test. The fault itself leaves no case to reproduce (hypothesis can neither replay nor print the example:
  every CUDA call fails; the comparison records come only after a call that returned), so the report
  names the process's last op call, noted before the op ran (harness.testing.lastcall: `read_only_inputs`
  and `run_pool_case` note every call, the op suites note their case's drawn shapes and seed): the
  outcome line gets a "last_call" field (the op, the implementation function, every argument's shape,
  dtype, stride and device, the values of small index tensors, the case) and its `why` reads "CUDA context
  lost (<error>) after <op> by <function> with <shapes, indices, seed>: <failure>"; the process prints the
  same before it ends. Under pytest-xdist the controller starts a fresh worker for the tests left (xdist
  reports the next test scheduled on the lost worker as "crashed", unrun: --resume runs it again); without
  xdist the run stops with a message to continue it with --resume.

Bounds checks (CPU)
  Where Triton kernels run through the interpreter (--device cpu), every masked load and store is checked
  against the storages of the kernel's tensor arguments (harness.testing.triton_bounds): an address outside
  all of them fails the test with OutOfBounds, where a GPU would fault or silently read a neighbour's memory.
  HARNESS_TRITON_BOUNDS=0 turns the checks off.

Output
  A skip says one line of reason (hypothesis' "Falsifying explicit example" note on a skipped example is
  dropped). Under pytest-xdist, pytest-benchmark cannot time: tests that take its `benchmark` fixture skip
  with one line saying so (run `pytest suites/bench` without -n, or `harness bench`, to time).

Fixtures
  device   the torch device string for this worker (e.g. "cpu", "cuda:0")
  impl     an `Impl`, parametrized over the selected implementations (tests that take it run once each)
  check    a `Checker`: `check.close(name, actual, expected, op=..., ...)` compares with the reference,
           writes a record and fails with a message that says what, where, tolerance and how to reproduce
"""
from __future__ import annotations

import os
import re
import time

import pytest

from harness import devices

PROFILES = ("ci", "dev", "nightly")
_STATE: dict = {}


def pytest_addoption(parser):
    g = parser.getgroup("ssm-harness")
    g.addoption("--device", action="store", default="auto", choices=devices.CHOICES,
                help="device the implementations run on (default: auto = cuda, else xpu, else cpu)")
    g.addoption("--impl", action="append", default=None, metavar="NAME",
                help="implementation to test (repeatable; a registered name or module:object)")
    g.addoption("--op", action="append", default=None, metavar="NAME",
                help="keep only the tests that compare this op (repeatable; an op name of harness.ops)")
    g.addoption("--profile", action="store", default="ci", choices=PROFILES,
                help="hypothesis profile: ci (fast, default), dev, nightly (deep)")
    g.addoption("--results", action="store", default=None, metavar="PATH",
                help="append result records (JSONL) to PATH")
    g.addoption("--outcomes", action="store", default=None, metavar="PATH",
                help="append one JSONL line per finished test as it finishes (survives a killed run)")
    g.addoption("--resume", action="append", default=None, metavar="PATH",
                help="an --outcomes file of an earlier run: deselect the tests it records as passed or skipped")
    g.addoption("--shrink-seconds", action="store", type=float, default=None, metavar="S",
                help="stop shrinking a failing hypothesis example after S seconds (default: hypothesis' own, 300): "
                     "a failure on a GPU run is reported with a less minimal example instead of using minutes")
    g.addoption("--generate-seconds", action="store", type=float, default=None, metavar="S",
                help="a property test draws no new example after S seconds of drawing (at least one runs); "
                     "its --outcomes line says so (a peer that compiles and autotunes each drawn shape anew "
                     "can take minutes per example)")
    g.addoption("--resume-failed", action="store", default="rerun", choices=("rerun", "skip"),
                help="with --resume: run the tests it records as failed again (rerun, default), or only those "
                     "that did not fail on an assertion (skip: a comparison's verdict stands; errors, crashes "
                     "and lost CUDA contexts run again)")


def _check_seconds(option: str, seconds: float) -> None:
    import math
    if not math.isfinite(seconds) or seconds < 0:
        raise pytest.UsageError(f"{option}: expected a finite number of seconds >= 0, got {seconds}")


def _cap_shrinking(seconds) -> None:
    """--shrink-seconds: hypothesis' limit on the time it shrinks a failing example (its engine's
    MAX_SHRINKING_SECONDS, read when shrinking starts)."""
    if seconds is None:
        return
    from hypothesis.internal.conjecture import engine
    _check_seconds("--shrink-seconds", seconds)
    if not isinstance(getattr(engine, "MAX_SHRINKING_SECONDS", None), (int, float)):
        import hypothesis
        raise pytest.UsageError(f"--shrink-seconds: expected hypothesis' engine to have MAX_SHRINKING_SECONDS, got "
                                f"hypothesis {hypothesis.__version__} without it")
    engine.MAX_SHRINKING_SECONDS = seconds


_CAPPED = "generation_capped"


def _cap_generation(seconds) -> None:
    """--generate-seconds: hypothesis' engine stops generating new examples of a test that has found no failure
    once S seconds have passed since it began generating (and at least one example was valid): the run then ends
    as if its max_examples were reached. The test being run learns it through a user property (`_CAPPED`: the
    examples run, of how many, and the seconds), which the --outcomes line reports."""
    if seconds is None:
        return
    from hypothesis.internal.conjecture import engine
    _check_seconds("--generate-seconds", seconds)
    runner = getattr(engine, "ConjectureRunner", None)
    more = getattr(runner, "should_generate_more", None)
    if more is None:
        import hypothesis
        raise pytest.UsageError(f"--generate-seconds: expected hypothesis' ConjectureRunner.should_generate_more, "
                                f"got hypothesis {hypothesis.__version__} without it")
    if getattr(more, "_capped_at", None) is not None:  # a second configure in one process: the cap changes
        more = more.__wrapped__

    def should_generate_more(self) -> bool:
        if not more(self):
            return False
        began = self.__dict__.setdefault("_harness_began", time.monotonic())
        spent = time.monotonic() - began
        valid = _runner_count(self, "valid")
        if _runner_count(self, "interesting") or valid < 1 or spent < seconds:
            return True
        item = _STATE.get("item")
        if item is not None:
            item.user_properties.append((_CAPPED, {"examples": valid,
                                                   "of": self.settings.max_examples, "seconds": round(spent, 1)}))
        return False
    should_generate_more.__wrapped__, should_generate_more._capped_at = more, seconds
    runner.should_generate_more = should_generate_more


def _runner_count(runner, kind: str):
    """The engine's valid examples so far (kind "valid": a number) or failures found ("interesting": a dict):
    `valid_examples` / `interesting_examples` up to hypothesis 6.15x, `valid_test_cases` /
    `interesting_test_cases` in later releases."""
    for name in (f"{kind}_examples", f"{kind}_test_cases"):
        if hasattr(runner, name):
            return getattr(runner, name)
    raise AttributeError(f"--generate-seconds: expected hypothesis' ConjectureRunner to count {kind}_examples or "
                         f"{kind}_test_cases, got neither")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The test being run, for the generation cap's note (`_cap_generation`)."""
    _STATE["item"] = item
    try:
        return (yield)
    finally:
        _STATE.pop("item", None)


def _register_profiles():
    from hypothesis import HealthCheck, settings
    common = dict(deadline=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture,
                                         # adapters decline some examples (harness.testing.unsupported_skips)
                                         HealthCheck.filter_too_much])
    # ci: derandomized, so a CI run explores the same examples every time (no flaky landings); dev and
    # nightly explore freshly each run and record the seed.
    settings.register_profile("ci", max_examples=8, derandomize=True, **common)
    settings.register_profile("dev", max_examples=40, **common)
    settings.register_profile("nightly", max_examples=300, **common)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or XPU device")
    try:
        device = devices.resolve(config.getoption("device"))
    except devices.DeviceUnavailable as e:
        raise pytest.UsageError(str(e)) from None
    if device == "cpu":
        # Triton kernels run on CPU tensors through the interpreter; it must be set before any
        # @triton.jit definition is executed.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("HARNESS_TRITON_BOUNDS", "1") != "0":
            from harness.testing import triton_bounds
            why = triton_bounds.install()
            if why:
                import warnings
                warnings.warn(f"ssm-harness: Triton kernels run without bounds checks: {why}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    device = devices.worker_device(device)
    if device == "cpu" and os.environ.get("PYTEST_XDIST_WORKER"):
        # Each xdist worker gets one core: the suites' tensors are tiny, and oversubscribed intra-op
        # threads made small ops 100x slower on a 2-core machine. HARNESS_CPU_THREADS overrides.
        import torch
        torch.set_num_threads(int(os.environ.get("HARNESS_CPU_THREADS", "1")))
    if device.startswith("cuda"):
        import torch
        torch.cuda.set_device(device)

    _register_profiles()
    from hypothesis import settings
    profile = config.getoption("profile")
    settings.load_profile(profile)
    _cap_shrinking(config.getoption("shrink_seconds"))
    _cap_generation(config.getoption("generate_seconds"))

    from harness.impls import registry
    names = config.getoption("impl")
    try:
        if names:
            impls = [registry.get(n) for n in names]
            for i in impls:
                why = i.why_unavailable(device)
                if why:
                    raise pytest.UsageError(f"--impl {i.name}: not usable here: {why}")
        else:
            impls = registry.implementations_for(device)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None

    writer = None
    results = config.getoption("results")
    if results:
        from harness.env import environment
        from harness.records import RecordWriter
        run_id = os.environ.get("HARNESS_RUN_ID")
        writer = RecordWriter(results, run_id=run_id)
        os.environ.setdefault("HARNESS_RUN_ID", writer.run_id)  # xdist workers share the run id
        env = environment(device)
        writer.write("env", env=env, profile=profile,
                     hypothesis_seed=config.getoption("hypothesis_seed", None),
                     impls=[i.name for i in impls], worker=os.environ.get("PYTEST_XDIST_WORKER", "main"))
    _STATE.update(device=device, impls=impls, writer=writer, profile=profile,
                  outcomes=config.getoption("outcomes"))


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A hypothesis test whose every example an implementation declined (NotImplementedError through
    `harness.testing.unsupported_skips`) skips with that reason instead of failing as Unsatisfiable."""
    from harness.testing import UNSUPPORTED
    reasons: list = []
    token = UNSUPPORTED.set(reasons)
    try:
        return (yield)
    except Exception as e:
        from hypothesis.errors import Unsatisfiable
        if isinstance(e, Unsatisfiable) and reasons:
            pytest.skip(f"no generated example is supported: {reasons[0]}")
        raise
    finally:
        UNSUPPORTED.reset(token)


_ERROR_LINE = re.compile(r"^(E\s+.*|[A-Za-z_][\w.]*(Error|Exception|Mismatch|Failed|Failure)(:.*)?)$")
# any exception's last traceback line: a (dotted) class name and its message, e.g. triton's
# "triton.runtime.errors.OutOfResources: out of resource: shared memory"
_RAISED_LINE = re.compile(r"^([a-z_]\w*\.)*[A-Z]\w*: \S.*$")


def failure_line(text: str) -> str:
    """The line of a failure's report that says what went wrong: pytest's first `E` line; in an exception
    group (hypothesis' distinct failures, printed behind `|` margins) the first member's error line, not the
    group's frame; else the last line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("E ")]
    if errs:
        return errs[0]
    inner = [re.sub(r"^\s*(\|\s?|\+-[+-]*.*)*", "", ln).rstrip() for ln in lines]
    for pattern in (_ERROR_LINE, _RAISED_LINE):
        errs = [ln for ln in inner if pattern.match(ln) and not re.match(r"^\w*ExceptionGroup\b", ln)]
        if errs:
            return errs[0]
    return lines[-1] if lines else ""


def _outcome_line(report) -> dict | None:
    """The --outcomes line for a test report: the call phase, or a setup/teardown that did not pass."""
    if report.when != "call" and report.passed:
        return None
    why, lost, last = "", None, None
    if report.failed:
        why = failure_line(report.longreprtext)
        props = dict(getattr(report, "user_properties", ()) or ())
        lost, last = props.get(_LOST), props.get(_LAST_CALL)
        if lost:
            from harness.testing.lastcall import summary
            why = f"CUDA context lost ({lost}){' after ' + summary(last) if last else ''}: {why}"
        why = why[:500]
    elif report.skipped and isinstance(report.longrepr, tuple):
        why = str(report.longrepr[2])[:500]
    else:
        caps = [v for k, v in getattr(report, "user_properties", ()) or () if k == _CAPPED]
        if caps:  # the cap ended the drawing (every hypothesis run of the test: parametrised once, one run)
            from harness.testing.resume import CAPPED_WHY
            why = "; ".join(f"{CAPPED_WHY}{c['examples']} of {c['of']} examples drawn in {c['seconds']} s"
                            for c in caps)
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "seconds": round(report.duration, 3), "why": why,
            "worker": getattr(report, "node", None) and report.node.gateway.id,
            # when the report reached the writer (unix seconds): with the run's start, where a cut run's time
            # went (start-up and collection before the first line, idle workers at the end)
            "at": round(time.time(), 1)}
    if lost and last:
        line["last_call"] = last
    return line


def _outcomes_here() -> str | None:
    """The --outcomes path where this process writes it: the controller only (xdist forwards the workers'
    reports and test starts to it); None elsewhere or without --outcomes."""
    return None if os.environ.get("PYTEST_XDIST_WORKER") else _STATE.get("outcomes")


def pytest_runtest_logreport(report):
    path = _outcomes_here()
    if not path:
        return
    line = _outcome_line(report)
    if line is not None:
        import json
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    if report.when == "teardown":
        _running(report.nodeid, None)


# The tests running now, in <outcomes>.running: {node id: the time it started} (written whole on every change),
# so a run cut by a time limit says which tests it was in, and since when (a test that hangs shows there).
# Removed when the run ends.
def _running(nodeid: str, started: float | None) -> None:
    path = _outcomes_here()
    if not path:
        return
    import json
    now = _STATE.setdefault("running", {})
    if started is None:
        if now.pop(nodeid, None) is None:
            return
    else:
        now[nodeid] = started
    tmp = f"{path}.running.tmp"
    with open(tmp, "w") as f:
        json.dump(now, f, indent=1)
    os.replace(tmp, f"{path}.running")


def pytest_runtest_logstart(nodeid, location):
    _running(nodeid, round(time.time(), 1))


def pytest_sessionfinish():
    path = _outcomes_here()
    if path and os.path.exists(f"{path}.running"):
        os.remove(f"{path}.running")


XDIST_BENCH_SKIP = ("pytest-benchmark does not time under pytest-xdist (-n): run `pytest suites/bench` without -n, "
                    "or `harness bench`, to time")


def _xdist_active(config) -> bool:
    return (config.getoption("dist", "no") or "no") != "no" or bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _test_ops(item, names: set) -> set:
    """The op names a test compares: named in its id, or a string constant of its function (directly or
    through a module-level name it uses, e.g. `OP = "gated_rms_norm"`)."""
    found = {n for n in names if n in item.nodeid}
    fn = getattr(item, "function", None)
    fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)
    code = getattr(fn, "__code__", None)
    if code is not None:
        consts, used = set(), set()
        stack = [code]
        while stack:
            c = stack.pop()
            consts.update(x for x in c.co_consts if isinstance(x, str))
            used.update(c.co_names)
            stack.extend(x for x in c.co_consts if hasattr(x, "co_consts"))
        found |= names & consts
        module = getattr(item, "module", None)
        for name in used:
            v = getattr(module, name, None)
            if isinstance(v, str) and v in names:
                found.add(v)
    return found


def _assertion_failure(rec: dict) -> bool:
    """An outcome line of a test that failed on an assertion (a comparison's verdict), not on an error, a
    crash or a lost CUDA context."""
    return rec.get("outcome") == "failed" and \
        re.match(r"(E\s+)?(AssertionError|harness\.scenarios\.Mismatch)\b", rec.get("why") or "") is not None


def finished_tests(paths, skip_failed: bool = False) -> set[str]:
    """Node ids whose latest verdict in the --outcomes files (read in order, a cut last line ignored) is passed
    or skipped; with `skip_failed`, also those whose latest verdict is a failure on an assertion
    (`_assertion_failure`). A test that passed once and failed in a later run is not finished."""
    return _finished(_resume_records(paths), skip_failed)


def _resume_records(paths) -> list[dict]:
    """The lines of the --resume files, read once (a usage error names a missing file)."""
    from harness.testing.resume import outcome_lines
    for path in paths:
        if not os.path.isfile(path):
            raise pytest.UsageError(f"--resume: expected an --outcomes file, got {path!r} (no such file)")
    return list(outcome_lines(paths))


def _finished(records, skip_failed: bool) -> set[str]:
    last: dict = {}
    for rec in records:
        if rec.get("when") == "call" and rec.get("outcome") in ("passed", "skipped") or \
                rec.get("when") == "setup" and rec.get("outcome") == "skipped" or \
                rec.get("outcome") == "failed":
            last[rec["nodeid"]] = rec
    return {n for n, rec in last.items()
            if rec.get("outcome") != "failed" or skip_failed and _assertion_failure(rec)}


def pytest_collection_modifyitems(config, items):
    resume = config.getoption("resume")
    if resume:
        records = _resume_records(resume)
        done = _finished(records, skip_failed=config.getoption("resume_failed") == "skip")
        drop = [item for item in items if item.nodeid in done]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if item.nodeid not in done]
    ops = config.getoption("op")
    if ops:
        from harness.ops import SPECS
        unknown = sorted(set(ops) - set(SPECS))
        if unknown:
            raise pytest.UsageError(f"--op: expected op names of harness.ops {sorted(SPECS)}, got {unknown}")
        keep, drop = [], []
        for item in items:
            (keep if _test_ops(item, set(SPECS)) & set(ops) else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if resume:
        _slow_first(config, items, records)
    if _xdist_active(config):
        mark = pytest.mark.skip(reason=XDIST_BENCH_SKIP)
        for item in items:
            if "benchmark" in getattr(item, "fixturenames", ()):
                item.add_marker(mark)


_DIST = "ssm_harness_dist"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist, on the controller) the workers learn the scheduler, which their own options do not say."""
    node.workerinput[_DIST] = node.config.getoption("dist", "load") or "load"


def _slow_first(config, items, records) -> None:
    """A resumed run starts the tests the earlier runs' outcome lines (`records`) record as slow (cut while
    running, or long and failed) first, one per worker (`harness.testing.resume`). Every pytest-xdist worker
    orders its collection alike."""
    from harness.testing.resume import recorded_seconds, resume_order
    seconds = recorded_seconds(records)
    worker = getattr(config, "workerinput", None)  # on a pytest-xdist worker: what its controller sent
    workers = int(worker["workercount"]) if worker else 1
    dist = worker.get(_DIST, "load") if worker else "no"
    if dist not in ("no", "load", "worksteal"):
        return  # loadscope, loadfile, each: the scheduler groups the tests itself
    by_id = {item.nodeid: item for item in items}
    if len(by_id) == len(items):  # node ids are unique (else the order stays)
        items[:] = [by_id[i] for i in resume_order(list(by_id), seconds, workers, dist)]


_LOST = "cuda_context_lost"
_LAST_CALL = "last_op_call"


def cuda_context_error(device) -> str | None:
    """None while `device` still runs CUDA work (or is not a CUDA device); else the error a kernel fault left
    in this process's context (every later CUDA call fails with it)."""
    if not str(device).startswith("cuda"):
        return None
    import torch
    try:
        torch.cuda.synchronize(device)
        (torch.ones(1, device=device) + 1).item()
        return None
    except Exception as e:  # noqa: BLE001 - whatever the fault, the context is what is reported
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a test that lost the CUDA context, end this process (see the module doc)."""
    from harness.testing import lastcall
    lastcall.clear()  # a test's report names only the op calls it made
    result = yield
    lost = _STATE.get("lost")
    if lost:
        import json
        import sys
        nodeid, err, last = lost
        after = f"; the last op call: {lastcall.summary(last)}\n  {json.dumps(last)}\n" if last else ""
        msg = (f"the CUDA context of this process is unusable after {nodeid} ({err}); the tests after it need "
               f"a new process")
        if os.environ.get("PYTEST_XDIST_WORKER"):
            import time
            print(f"ssm-harness: {msg}: this worker ends, pytest-xdist starts another{after}", file=sys.stderr,
                  flush=True)
            time.sleep(1.0)  # the worker's reports of the test reach the controller first
            os._exit(3)
        if after:
            print(f"ssm-harness: {msg}{after}", file=sys.stderr, flush=True)
        pytest.exit(f"{msg}: run again with --resume OUTCOMES (with --outcomes set) to go on", returncode=1)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip's reason is one line: hypothesis appends its multi-line "Falsifying explicit example" note
    (the whole example's repr) to a skip raised inside an explicit @example. A failed test on a CUDA device
    is followed by a check of the context; a lost one is reported with the last op call (see the module
    doc)."""
    report = yield
    if report.failed and not _STATE.get("lost"):
        err = cuda_context_error(_STATE.get("device", ""))
        if err:
            from harness.testing.lastcall import last_call
            last = last_call()
            _STATE["lost"] = (item.nodeid, err, last)
            report.user_properties.append((_LOST, err))
            if last:
                report.user_properties.append((_LAST_CALL, last))
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        path, lineno, reason = report.longrepr
        lines = [ln for ln in str(reason).splitlines() if ln.strip()]
        if len(lines) > 1:
            report.longrepr = (path, lineno, lines[0])
    return report


def pytest_report_header(config):
    if not _STATE:
        return None
    return (f"ssm-harness: device={_STATE['device']} impls={[i.name for i in _STATE['impls']]} "
            f"profile={_STATE['profile']} results={config.getoption('results')}")


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        from harness.testing import declining  # ops that raise NotImplementedError decline the case
        impls = _STATE.get("impls", [])
        metafunc.parametrize("impl", [declining(i) for i in impls], ids=[i.name for i in impls], scope="function")


def selected_impls():
    return list(_STATE.get("impls", []))


@pytest.fixture(scope="session")
def device() -> str:
    return _STATE["device"]


@pytest.fixture(scope="session")
def results_writer():
    return _STATE.get("writer")


@pytest.fixture
def check(request, device, results_writer):
    from harness.testing.checker import Checker
    return Checker(test_id=request.node.nodeid, device=device, writer=results_writer)
