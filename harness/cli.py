"""`harness` command line: run, impls (and, as they land: bench, gate, report, selftest).

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
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark step")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report step")


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
    if not args.no_bench and "bench" in SUBCOMMANDS:
        pass  # wired by the bench step when it lands
    print(f"harness run: {len(comps)} comparisons, {summary['failed']} failed")
    print(f"harness run: results {results}")
    print(f"harness run: summary {os.path.join(out, 'summary.json')}")
    return 0 if rc == 0 else 1


@subcommand("impls", "list registered implementations and whether they are usable here")
def cmd_impls(args) -> int:
    from harness.impls.registry import all_impls
    for name, impl in all_impls().items():
        why = impl.why_unavailable()
        print(f"{name:16s} devices={','.join(impl.devices):14s} ops={len(impl.ops):2d} "
              f"{'usable' if why is None else 'unavailable: ' + why}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, (fn, help) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help)
        if name == "run":
            _add_run_args(sp)
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
