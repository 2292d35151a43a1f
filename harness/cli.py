"""`harness` command line: run, impls, bench, gate, report, selftest.

Exit codes: 0 success, 1 a check/gate failed, 2 usage error or unreadable input.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter

from harness.env import REPO_ROOT

SUBCOMMANDS: dict = {}


def subcommand(name, help):
    def deco(fn):
        SUBCOMMANDS[name] = (fn, help)
        return fn
    return deco


def _add_run_args(p):
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda", "xpu"))
    p.add_argument("--impl", action="append", default=None, help="implementation(s) to test (repeatable)")
    p.add_argument("--profile", default="ci", choices=("ci", "dev", "nightly"))
    p.add_argument("--out", default=None, help="run folder (default reports/runs/<run id>)")
    p.add_argument("--suites", default="suites", help="suite path(s) for pytest, comma-separated")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--workers", type=int, default=None,
                   help="pytest-xdist workers for the suites (default: min(2, CPU count); 1 = no xdist)")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark step")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report step")
    p.add_argument("--bench-reps", type=int, default=None, help="timed calls per benchmark case (bench default)")
    p.add_argument("--baseline", default=None, metavar="RUN",
                   help="a baseline run: the report compares against it and the run is gated against it")


@subcommand("run", "the main job: suites (+ bench + report as available) into a run folder")
def cmd_run(args) -> int:
    from harness.records import new_run_id, read_records
    run_id = new_run_id()
    out = os.path.abspath(args.out or os.path.join(REPO_ROOT, "reports", "runs", run_id))
    os.makedirs(out, exist_ok=True)
    results = os.path.join(out, "results.jsonl")
    cmd = [sys.executable, "-m", "pytest", *args.suites.split(","), "-q", "-p", "no:cacheprovider",
           "--device", args.device, "--profile", args.profile, "--results", results]
    for i in args.impl or []:
        cmd += ["--impl", i]
    if args.keyword:
        cmd += ["-k", args.keyword]
    workers = args.workers if args.workers is not None else min(2, os.cpu_count() or 1)
    if workers > 1:
        cmd += ["-n", str(workers)]  # pytest-xdist; records of all workers land in the one results file
    env = dict(os.environ, HARNESS_RUN_ID=run_id, HF_HUB_OFFLINE="1")
    print("harness run:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=REPO_ROOT, env=env)
    if rc not in (0, 1):
        print(f"harness run: pytest exited {rc} (usage error or no tests collected)", file=sys.stderr)
        return 2
    recs = read_records(results) if os.path.exists(results) else []
    comps = [r for r in recs if r["kind"] == "comparison"]
    by = Counter((r["op"], r["impl"], r["dtype"], r["verdict"]) for r in comps)
    summary = {"run_id": run_id, "pytest_exit": rc, "comparisons": len(comps),
               "failed": sum(1 for r in comps if r["verdict"] != "pass"),
               "by_case": [dict(op=o, impl=i, dtype=d, verdict=v, n=n) for (o, i, d, v), n in sorted(by.items())]}
    tmp = os.path.join(out, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, os.path.join(out, "summary.json"))
    print(f"harness run: {len(comps)} comparisons, {summary['failed']} failed")
    print(f"harness run: results {results}")
    print(f"harness run: summary {os.path.join(out, 'summary.json')}")
    status = 0 if rc == 0 else 1
    if not args.no_bench:
        bench = [sys.executable, "-m", "harness.cli", "bench", "--device", args.device, "--no-progress",
                 "--out", os.path.join(out, "bench.jsonl")]
        for i in args.impl or []:
            bench += ["--impl", i]
        if args.bench_reps:
            bench += ["--reps", str(args.bench_reps)]
        print("harness run:", " ".join(bench), flush=True)
        brc = subprocess.call(bench, cwd=REPO_ROOT, env=env)
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
    if not args.no_report:
        from harness.report import write_report
        runs = ([args.baseline] if args.baseline else []) + [out]
        try:
            path = write_report(runs, os.path.join(out, "report.html"))
        except ValueError as e:
            print(f"harness run: report: {e}", file=sys.stderr)
            return 2
        print(f"harness run: report {path}")
    return status


@subcommand("impls", "list registered implementations and whether they are usable here")
def cmd_impls(args) -> int:
    from harness.impls.registry import all_impls
    for name, impl in all_impls().items():
        why = impl.why_unavailable()
        print(f"{name:16s} devices={','.join(impl.devices):14s} ops={len(impl.ops):2d} "
              f"{'usable' if why is None else 'unavailable: ' + why}")
    return 0


@subcommand("gate", "compare a candidate run with a baseline: accuracy, tok/s, missing cases (exit 1 on regression)")
def cmd_gate(args) -> int:
    from harness.gate import run_gate
    return run_gate(args)


def _gate_args(p):
    from harness.gate import add_args
    add_args(p)


cmd_gate.add_args = _gate_args


@subcommand("report", "render runs (results .jsonl, run folders, pytest-benchmark JSON) into one HTML file")
def cmd_report(args) -> int:
    from harness.report import run_report
    return run_report(args)


def _report_args(p):
    from harness.report import add_args
    add_args(p)


cmd_report.add_args = _report_args


@subcommand("bench", "kernel/model benchmarks over a shape matrix; timing records appended to a JSONL file")
def cmd_bench(args) -> int:
    from harness.bench.cli import run_bench
    return run_bench(args)


def _bench_args(p):
    from harness.bench.cli import add_args
    add_args(p)


cmd_bench.add_args = _bench_args


@subcommand("selftest", "break the engine on purpose (docs/bug-classes.md variants) and require the scenario properties to catch each (exit 1 if one escapes)")
def cmd_selftest(args) -> int:
    from harness.selftest import main
    return main(args)


def _selftest_args(p):
    from harness.selftest import add_args
    add_args(p)


cmd_selftest.add_args = _selftest_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, (fn, help) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help)
        if name == "run":
            _add_run_args(sp)
        elif hasattr(fn, "add_args"):
            fn.add_args(sp)
        sp.set_defaults(func=fn)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"harness {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
