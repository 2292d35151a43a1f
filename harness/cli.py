"""`harness` command line: run, impls, bench, gate, report, replay, selftest.

Every command that runs kernels takes `--device {auto,cpu,cuda,xpu}` (default auto: cuda, else xpu, else cpu).
Exit codes: 0 success, 1 a check/gate failed, 2 usage error or unreadable input, 4 the device asked for is
not on this machine (one line of reason, as from `pytest --device`).

Building the parser imports nothing heavy: `harness --help` and `harness --version` answer at once; a
command's own modules (torch among them) load only when that command runs.
"""
from __future__ import annotations

import argparse
import os
import sys

from harness.devices import add_device_arg as _add_device  # no torch at import

PROG = "harness"


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------- run

def _run_args(p) -> None:
    _add_device(p)
    p.add_argument("--impl", action="append", default=None, help="implementation(s) to test and time (repeatable)")
    p.add_argument("--op", action="append", default=None, metavar="OP",
                   help="op(s) to test and time (repeatable): the suites keep the tests that compare the op, "
                        "the bench times only it")
    p.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                   help="pytest -k expression for the suites; the bench step then times only the ops the "
                        "selected tests compared")
    p.add_argument("--profile", default="ci", choices=("ci", "dev", "nightly"))
    p.add_argument("--out", default=None, help="run folder (default reports/runs/<run id>)")
    p.add_argument("--suites", default="suites", help="suite path(s) for pytest, comma-separated")
    p.add_argument("--workers", type=int, default=None,
                   help="pytest-xdist workers for the suites (default: min(2, CPU count); 1 = no xdist)")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark step")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report step")
    p.add_argument("--bench-reps", type=int, default=None, help="timed calls per benchmark case (bench default)")
    p.add_argument("--baseline", default=None, metavar="RUN",
                   help="a baseline run: the report compares against it and the run is gated against it")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _compared_ops(results: str) -> list[str]:
    """The ops the suite step compared (from its result records), in order of first appearance."""
    from harness.records import read_records
    ops: list[str] = []
    if os.path.exists(results):
        for r in read_records(results, kinds=("comparison",)):
            if r.get("op") and r["op"] not in ops:
                ops.append(r["op"])
    return ops


def suite_command(args, root: str, results: str, outcomes: str) -> list[str]:
    """The suite step's pytest command. pytest-benchmark does not time under xdist: with workers the benchmark
    suite's timed tests skip with one line (the bench step times the same declared cases without xdist), and
    suites/bench alone runs without xdist, timed."""
    suites = [s for s in args.suites.split(",") if s]
    bench_suite = os.path.join(root, "suites", "bench")
    workers = args.workers if args.workers is not None else min(2, os.cpu_count() or 1)
    cmd = [sys.executable, "-m", "pytest", *suites, "-q", "-p", "no:cacheprovider", "-rs",
           "--device", args.device, "--profile", args.profile, "--results", results, "--outcomes", outcomes]
    for i in args.impl or []:
        cmd += ["--impl", i]
    for o in args.op or []:
        cmd += ["--op", o]
    if args.keyword:
        cmd += ["-k", args.keyword]
    if all(_inside(os.path.join(root, s), bench_suite) for s in suites):
        workers = 1
    if workers > 1:
        cmd += ["-n", str(workers)]  # pytest-xdist; records of all workers land in the one results file
    return cmd


def cmd_run(args) -> int:
    import subprocess
    from collections import Counter

    from harness.records import new_run_id, read_records, write_json
    root = _repo_root()
    if args.op:
        from harness.ops import SPECS
        unknown = sorted(set(args.op) - set(SPECS))
        if unknown:
            raise ValueError(f"--op: expected op names of harness.ops {sorted(SPECS)}, got {unknown}")
    run_id = new_run_id()
    out = os.path.abspath(args.out or os.path.join(root, "reports", "runs", run_id))
    os.makedirs(out, exist_ok=True)
    results = os.path.join(out, "results.jsonl")
    outcomes = os.path.join(out, "outcomes.jsonl")
    steps = ["suites"] + ([] if args.no_bench else ["bench"]) + ([] if args.no_report else ["report"])

    def step(name: str, what: str) -> None:
        print(f"\nharness run [{steps.index(name) + 1}/{len(steps)}] {name}: {what}", flush=True)

    cmd = suite_command(args, root, results, outcomes)
    from harness.env import child_pytest_env
    env = child_pytest_env(HARNESS_RUN_ID=run_id, HF_HUB_OFFLINE="1")
    step("suites", " ".join(cmd[1:]))
    rc = subprocess.call(cmd, cwd=root, env=env)
    if rc not in (0, 1):
        print(f"harness run: pytest exited {rc} (usage error or no tests collected)", file=sys.stderr)
        return 4 if rc == 4 else 2
    recs = read_records(results) if os.path.exists(results) else []
    comps = [r for r in recs if r["kind"] == "comparison"]
    by = Counter((r["op"], r["impl"], r["dtype"], r["verdict"]) for r in comps)
    summary = {"run_id": run_id, "pytest_exit": rc, "comparisons": len(comps),
               "failed": sum(1 for r in comps if r["verdict"] != "pass"),
               "by_case": [dict(op=o, impl=i, dtype=d, verdict=v, n=n) for (o, i, d, v), n in sorted(by.items())]}
    write_json(os.path.join(out, "summary.json"), summary)
    print(f"harness run: {len(comps)} comparisons, {summary['failed']} failed; results {results}")
    status = 0 if rc == 0 else 1
    if "bench" in steps:
        ops = list(args.op or [])
        compared: list[str] = []
        if args.keyword and not ops:
            from harness.ops import SPECS
            compared = _compared_ops(results)
            ops = [o for o in compared if o in SPECS]
        if args.keyword and not ops:
            step("bench", f"nothing to time: the tests selected by -k {args.keyword!r} compared no op the bench "
                          f"times (compared: {', '.join(compared) or 'none'})")
        else:
            bench = [sys.executable, "-m", "harness.cli", "bench", "--device", args.device,
                     "--out", os.path.join(out, "bench.jsonl")]
            if not sys.stderr.isatty():
                bench.append("--no-progress")
            for i in args.impl or []:
                bench += ["--impl", i]
            for o in ops:
                bench += ["--op", o]
            if args.bench_reps:
                bench += ["--reps", str(args.bench_reps)]
            step("bench", " ".join(bench[1:]) + ("   (the ops the -k selection compared)" if args.keyword and
                                                 not args.op else ""))
            brc = subprocess.call(bench, cwd=root, env=env)
            if brc != 0:
                print(f"harness run: bench exited {brc}", file=sys.stderr)
                status = max(status, 1)
    if args.baseline:
        from harness.gate import GateConfig, gate_runs, summary_table
        from harness.report.runs import load_run
        try:
            g = gate_runs(load_run(args.baseline), load_run(out), GateConfig())
        except ValueError as e:
            print(f"harness run: gate: {e}", file=sys.stderr)
            return 2
        print(summary_table(g))
        status = max(status, g.exit_code)
    if "report" in steps:
        from harness.report import write_report
        runs = ([args.baseline] if args.baseline else []) + [out]
        step("report", f"{len(runs)} run(s) -> {os.path.join(out, 'report.html')}")
        try:
            path = write_report(runs, os.path.join(out, "report.html"))
        except ValueError as e:
            print(f"harness run: report: {e}", file=sys.stderr)
            return 2
        print(f"harness run: report {path}")
    return status


# ------------------------------------------------------------------------------------------- impls

def _impls_args(p) -> None:
    _add_device(p)


def impls_table(device: str) -> list[dict]:
    """Every registered implementation: whether it runs on `device` here, how, and why not."""
    import torch

    from harness.impls.registry import all_impls
    rows = []
    kind = device.split(":")[0]
    interpreted = kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    for name, impl in all_impls().items():
        why = impl.why_unavailable(device)
        how = ""
        if why is None and interpreted and name == "triton":
            how = "through Triton's interpreter (TRITON_INTERPRET=1, as the suites run it); slow"
        dtypes = ",".join(str(d).replace("torch.", "") for d in impl.dtypes
                          if d in (torch.float32, torch.float64, torch.float16, torch.bfloat16))
        rows.append({"name": name, "runs": why is None, "devices": list(impl.devices), "ops": sorted(impl.ops),
                     "dtypes": dtypes, "how": how, "why_not": why or ""})
    return rows


def cmd_impls(args) -> int:
    from harness import devices
    from harness.env import device_name
    devices.prepare(args.device)
    rows = impls_table(args.device)
    n = sum(r["runs"] for r in rows)
    print(f"implementations on {args.device} ({device_name(args.device)}): {n} of {len(rows)} run here; "
          f"suites and bench select these by default")
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        state = "runs" if r["runs"] else "no  "
        note = r["how"] if r["runs"] else r["why_not"]
        print(f"  {r['name']:{w}s}  {state}  {len(r['ops'])} ops  {r['dtypes'] if r['runs'] else '-':34s}  {note}".rstrip())
    return 0


# ------------------------------------------------------------------------------------------- selftest

def _selftest_args(p) -> None:
    p.add_argument("--impl", default="reference", help="base implementation the variants break (default reference)")
    p.add_argument("--variant", action="append", default=None, help="run only these variants (name or bug class)")
    p.add_argument("--max-examples", type=int, default=30, help="hypothesis examples per variant (default 30)")
    p.add_argument("--seconds", type=float, default=8.0, help="search+shrink time budget per variant (default 8)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis search seed (default 0; -1: random)")
    _add_device(p)
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="engine dtype (default float64: the tightest tolerances; float32 may let the smallest "
                        "bugs, e.g. a wrong norm eps, pass)")
    p.add_argument("--kind", choices=("all", "scenario", "suite"), default="all",
                   help="which variants: scenario (a broken engine, caught by the scenario properties), suite (a "
                        "broken component, caught by the suites' tests, run by pytest on the CPU) or all (default)")
    p.add_argument("--list", action="store_true", help="list the variants and exit")


def cmd_selftest(args) -> int:
    from harness.selftest import main
    return main(args)


# ------------------------------------------------------------------------------------------- the others

def _gate_args(p) -> None:
    from harness.gate import add_args
    add_args(p)


def cmd_gate(args) -> int:
    from harness.gate import run_gate
    return run_gate(args)


def _report_args(p) -> None:
    from harness.report import add_args
    add_args(p)


def cmd_report(args) -> int:
    from harness.report import run_report
    return run_report(args)


def _bench_args(p) -> None:
    from harness.bench.cli import add_args
    add_args(p)


def cmd_bench(args) -> int:
    from harness.bench.cli import run_bench
    return run_bench(args)


def _replay_args(p) -> None:
    from harness.replay import add_args
    add_args(p)


def cmd_replay(args) -> int:
    from harness.replay import main as replay_main
    return replay_main(args)


# name: (function, arguments, help)
SUBCOMMANDS: dict = {
    "run": (cmd_run, _run_args, "the main job: suites, then bench and report, into a run folder (with progress)"),
    "impls": (cmd_impls, _impls_args, "list the implementations: which run on the device here, how, and why not"),
    "gate": (cmd_gate, _gate_args,
             "compare a candidate run with a baseline: accuracy, tok/s, missing cases (exit 1 on regression)"),
    "report": (cmd_report, _report_args,
               "render runs (results .jsonl, run folders, pytest-benchmark JSON) into one HTML file"),
    "bench": (cmd_bench, _bench_args,
              "kernel/model benchmarks over a shape matrix; timing records appended to a JSONL file"),
    "replay": (cmd_replay, _replay_args,
               "run again the op call a test left in its --outcomes line when it lost the CUDA context (alone, "
               "under compute-sanitizer, or on the CPU with the interpreter's bounds checks)"),
    "selftest": (cmd_selftest, _selftest_args,
                 "break the engine or one component on purpose (docs/bug-classes.md variants) and require the "
                 "scenario properties or the suites to catch each (exit 1 if one escapes)"),
}


class _Version(argparse.Action):
    """`--version`: the package version and the git sha, computed only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from harness.env import git_info, harness_version
        sha = git_info()[0]
        print(f"{PROG} (ssm-harness) {harness_version()}" + (f", git {sha}" if sha else ", git sha unknown"))
        parser.exit()


def _command_in(argv: list[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a if a in SUBCOMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the command named in `argv` gets its arguments (None: every command's)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                epilog="exit codes: 0 ok, 1 a check or the gate failed, 2 usage error or "
                                       "unreadable input, 4 the device asked for is not on this machine")
    p.add_argument("--version", action=_Version, help="print the version (package and git sha) and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    chosen = _command_in(argv) if argv is not None else None
    for name, (fn, add_args, help) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help, description=help)
        if argv is None or name == chosen:
            add_args(sp)
        sp.set_defaults(func=fn)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    device = getattr(args, "device", None)
    if device is not None:
        from harness import devices
        try:
            args.device = devices.resolve_or_exit(device, f"{PROG} {args.command}")
        except SystemExit as e:
            return int(e.code)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"{PROG} {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
