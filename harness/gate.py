"""`harness gate --baseline A --candidate B`: does run B regress against run A?

Cases
  comparisons are keyed by (test_id/name, op, impl, dtype, shape); several records under one key
  (e.g. hypothesis examples of equal shape) merge: verdict fails if any failed, error = the worst.
  timings are keyed by (bench, op, impl, dtype, shape); several records under one key: the last wins.

Findings that gate (exit code 1)
  accuracy      a comparison that passed in the baseline fails in the candidate (matched by key; for
                hypothesis-drawn shapes that differ between runs: any failing example of a
                (test, op, impl, dtype) group that passed everywhere in the baseline);
  new-failure   a failing comparison in a group the baseline does not have;
  error-growth  a matched comparison whose error ratio grew beyond
                max(err_floor_frac x tolerance ratio, err_k x baseline error ratio);
  performance   tok/s (else GB/s, else 1/ms) below (1 - threshold') x baseline, where
                threshold' = threshold + noise_k x max(p20-p80 spread / p50 of either run), so noise
                does not gate; peers' timings (peer=true) are gated only with --gate-peers, the
                float64-oracle `reference` implementation's (plain loops, not a product) only with
                --gate-reference;
  host-overhead an eager timing's host overhead (eager - CUDA-graph p50, `host_ms`) or launch time (the
                host's time to issue one call, `launch_ms`; one at a token count not seen before,
                `launch_new_ms`) above (1 + threshold') x baseline +
                --host-floor-us (host time is noisier than GPU time: the floor keeps a few microseconds
                of jitter from gating); peers and the reference as for performance;
  missing       a baseline case (comparison group or timing) absent from the candidate;
  invalid-timing a timing record (of either run, with no `error`) whose numbers cannot be a
                measurement: tok/s, GB/s or ms p20/p50/p80 NaN, infinite, zero or negative,
                p20 <= p50 <= p80 violated, or no tok/s, GB/s or ms p50 at all. Such a case cannot
                be judged, and a gate that cannot judge a case does not pass it: a candidate whose
                timings are all NaN, 0 or negative fails with one finding per case (and a baseline
                with such a timing fails every gate against it until it is re-recorded).
Informational: still-failing comparisons, improvements, new cases, shapes hypothesis drew differently.

Thresholds must be finite: --perf-threshold in [0, 1), --noise-k >= 0, --err-k >= 1,
--err-floor-frac >= 0 (NaN or inf would switch gating off); they are checked before any file is read.

Exit codes: 0 clean, 1 regression found, 2 bad input or internal error: a bad option, an unreadable
file, a record field of the wrong type (the message names file, line, field, expected and got),
runs from different devices without --allow-cross-device, or a failure of the gate itself. A crash is
never reported as 1. A results file with a torn final line (a writer killed mid-append) is read
without that line, with a warning on stderr.
"""
from __future__ import annotations

import math
import sys
import traceback
import warnings
from dataclasses import asdict, dataclass, field

from harness.records import TornRecordWarning, write_json
from harness.report.runs import Run, RunError, check_same_device, load_run, num, shape_key

GATING_KINDS = ("accuracy", "new-failure", "error-growth", "performance", "host-overhead", "missing",
                "invalid-timing")


@dataclass
class GateConfig:
    perf_threshold: float = 0.05   # a 5% tok/s drop gates (before noise widening)
    noise_k: float = 1.0           # widening per unit of relative p20-p80 spread
    err_k: float = 2.0             # error ratio may grow up to err_k x baseline ...
    err_floor_frac: float = 0.1    # ... or up to this fraction of the dtype's tolerance ratio
    host_floor_us: float = 5.0     # host overhead may grow by this much on top of the relative threshold
    gate_peers: bool = False
    gate_reference: bool = False
    allow_cross_device: bool = False

    def validate(self) -> None:
        """ValueError naming the option unless every threshold is a finite number in its range."""
        from reference.validate import fail

        def real(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not (real(self.perf_threshold) and 0 <= self.perf_threshold < 1):
            fail("--perf-threshold", "a finite fraction in [0, 1)", self.perf_threshold)
        if not (real(self.noise_k) and self.noise_k >= 0):
            fail("--noise-k", "a finite number >= 0", self.noise_k)
        if not (real(self.host_floor_us) and self.host_floor_us >= 0):
            fail("--host-floor-us", "a finite number of microseconds >= 0", self.host_floor_us)
        if not (real(self.err_k) and self.err_k >= 1):
            fail("--err-k", "a finite factor >= 1", self.err_k)
        if not (real(self.err_floor_frac) and self.err_floor_frac >= 0):
            fail("--err-floor-frac", "a finite number >= 0", self.err_floor_frac)


@dataclass
class Finding:
    kind: str
    key: str
    detail: str
    baseline: float | str | None = None
    candidate: float | str | None = None

    @property
    def gating(self) -> bool:
        return self.kind in GATING_KINDS


@dataclass
class GateResult:
    baseline: str
    candidate: str
    findings: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def regressions(self) -> list[Finding]:
        return [f for f in self.findings if f.gating]

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions else 0

    def to_dict(self) -> dict:
        return {"baseline": self.baseline, "candidate": self.candidate, "exit_code": self.exit_code,
                "stats": self.stats, "findings": [dict(asdict(f), gating=f.gating) for f in self.findings]}


# ----------------------------------------------------------------------------------------- keys

def comparison_group(r: dict) -> tuple:
    test = r.get("test_id") or ""
    name = r.get("name") or ""
    return (f"{test}/{name}" if test else name, r.get("op"), r.get("impl"), r.get("dtype"))


def comparison_key(r: dict) -> tuple:
    return comparison_group(r) + (shape_key(r.get("shapes", r.get("shape"))),)


def timing_key(r: dict) -> tuple:
    return (r.get("bench"), r.get("op"), r.get("impl"), r.get("dtype"), shape_key(r.get("shape")) + (" cuda_graph" if r.get("cuda_graph") else ""))


def fmt_key(k: tuple) -> str:
    parts = [str(x) for x in k if x not in (None, "")]
    if len(k) == 5 and len(parts) >= 3 and parts[0] == f"{parts[1]}/{parts[2]}":
        parts = parts[1:]  # a timing key whose bench id is just op/impl
    return " | ".join(parts)


def _merge_comparisons(recs: list[dict]) -> dict:
    out: dict = {}
    for r in recs:
        k = comparison_key(r)
        err = num(r.get("err_ratio"))
        err = math.inf if err is not None and math.isnan(err) else err
        cur = out.get(k)
        failed = r.get("verdict") != "pass"
        tol = num((r.get("tolerance") or {}).get("ratio"))
        if cur is None:
            out[k] = {"failed": failed, "err": err, "tol": tol, "rec": r}
        else:
            cur["failed"] = cur["failed"] or failed
            if err is not None and (cur["err"] is None or err > cur["err"]):
                cur["err"] = err
                cur["rec"] = r if not cur["failed"] or failed else cur["rec"]
            if failed and cur["rec"].get("verdict") == "pass":
                cur["rec"] = r
    return out


METRICS = ("tok_s", "gb_s", "1/ms")
_TIMING_NUMBERS = ("tok_s", "gb_s", "ms_p20", "ms_p50", "ms_p80")


def _metric(r: dict, name: str) -> float | None:
    if name == "1/ms":
        ms = num(r.get("ms_p50"))
        return 1.0 / ms if ms and ms > 0 and math.isfinite(ms) else None
    v = num(r.get(name))
    return v if v is not None and math.isfinite(v) and v > 0 else None


def throughput(r: dict, other: dict | None = None) -> tuple[str, float | None]:
    """(metric name, value) used for perf gating: tok/s, else GB/s, else 1/ms -- the first one that `r`
    (and `other`, if given) both have."""
    for name in METRICS:
        v = _metric(r, name)
        if v is not None and (other is None or _metric(other, name) is not None):
            return name, v
    return METRICS[-1], None


def timing_problem(r: dict) -> str | None:
    """Why a timing record (one without `error`) cannot be a measurement, or None if it can."""
    if r.get("error"):
        return None
    bad = []
    for k in _TIMING_NUMBERS:
        v = num(r.get(k))
        if v is not None and not (math.isfinite(v) and v > 0):
            bad.append(f"{k} = {v:g}")
    if bad:
        return ", ".join(bad) + " (expected finite numbers > 0)"
    p20, p50, p80 = (num(r.get(k)) for k in ("ms_p20", "ms_p50", "ms_p80"))
    if None not in (p20, p50, p80) and not p20 <= p50 <= p80:
        return f"ms p20 {p20:g}, p50 {p50:g}, p80 {p80:g} (expected p20 <= p50 <= p80)"
    if all(num(r.get(k)) is None for k in ("tok_s", "gb_s", "ms_p50")):
        return "no tok_s, gb_s or ms_p50 (and no error)"
    return None


def rel_spread(r: dict) -> float:
    p20, p50, p80 = (num(r.get(k)) for k in ("ms_p20", "ms_p50", "ms_p80"))
    if not p50 or p20 is None or p80 is None or not all(math.isfinite(x) for x in (p20, p50, p80)):
        return 0.0
    return max(0.0, (p80 - p20) / p50)


# ----------------------------------------------------------------------------------------- gate

def gate_runs(base: Run, cand: Run, cfg: GateConfig | None = None) -> GateResult:
    cfg = cfg or GateConfig()
    cfg.validate()
    check_same_device([base, cand], cfg.allow_cross_device)
    res = GateResult(baseline=base.label, candidate=cand.label)
    F = res.findings

    # --- accuracy
    bc, cc = _merge_comparisons(base.comparisons), _merge_comparisons(cand.comparisons)
    b_groups: dict = {}
    for k, v in bc.items():
        b_groups.setdefault(k[:-1], []).append(v)
    c_groups = {k[:-1] for k in cc}
    b_group_failed = {g: any(v["failed"] for v in vs) for g, vs in b_groups.items()}
    matched = redrawn = still = 0
    for k, c in cc.items():
        b = bc.get(k)
        g = k[:-1]
        rec = c["rec"]
        where = f"{rec.get('reason') or ''}".strip()
        if b is not None:
            matched += 1
            if c["failed"] and not b["failed"]:
                F.append(Finding("accuracy", fmt_key(k), f"passed in the baseline, fails now: {where}",
                                 b["err"], c["err"]))
                continue
            if c["failed"]:
                still += 1
                F.append(Finding("still-failing", fmt_key(k), where, b["err"], c["err"]))
                continue
            if b["err"] is not None and c["err"] is not None and math.isfinite(b["err"]):
                tol = c["tol"] if c["tol"] is not None else b["tol"]
                floor = cfg.err_floor_frac * tol if tol is not None else 0.0
                limit = max(floor, cfg.err_k * b["err"])
                if c["err"] > limit:
                    F.append(Finding("error-growth", fmt_key(k),
                                     f"error ratio {c['err']:.3e} > max({cfg.err_floor_frac:g} x tolerance "
                                     f"{tol if tol is not None else 0:g}, {cfg.err_k:g} x baseline {b['err']:.3e})",
                                     b["err"], c["err"]))
        elif c["failed"]:
            if g in b_groups and not b_group_failed[g]:
                F.append(Finding("accuracy", fmt_key(k),
                                 f"group passed every baseline example, this example fails: {where}", None, c["err"]))
            elif g in b_groups:
                still += 1
                F.append(Finding("still-failing", fmt_key(k), where, None, c["err"]))
            else:
                F.append(Finding("new-failure", fmt_key(k), f"new case, fails: {where}", None, c["err"]))
    for k in bc:
        if k in cc:
            continue
        if k[:-1] in c_groups:
            redrawn += 1
        else:
            F.append(Finding("missing", fmt_key(k), "comparison case absent from the candidate",
                             "fail" if bc[k]["failed"] else "pass", None))

    # --- performance
    bt = {timing_key(r): r for r in base.timings}
    ct = {timing_key(r): r for r in cand.timings}
    perf_matched = improved = 0
    invalid = set()
    for run, side, table in ((base, "baseline", bt), (cand, "candidate", ct)):
        for k, r in table.items():
            why = timing_problem(r)
            if why is not None and (side == "candidate" or k in ct):
                invalid.add(k)
                F.append(Finding("invalid-timing", fmt_key(k), f"{side} {run.where(r)}: {why}",
                                 *(("invalid", None) if side == "baseline" else (None, "invalid"))))
    for k, b in bt.items():
        c = ct.get(k)
        if c is None:
            F.append(Finding("missing", fmt_key(k), "timing case absent from the candidate",
                             throughput(b)[1], None))
            continue
        perf_matched += 1
        if k in invalid:
            continue
        if c.get("error") and not b.get("error"):
            F.append(Finding("missing", fmt_key(k), f"benchmark failed in the candidate: {c['error'][:200]}",
                             throughput(b)[1], None))
            continue
        mname, bv = throughput(b, c)
        cname, cv = throughput(c, b)
        if bv is None or cv is None or cname != mname:
            F.append(Finding("info", fmt_key(k), f"no comparable throughput ({mname} vs {cname})", bv, cv))
            continue
        spread = max(rel_spread(b), rel_spread(c))
        thr = cfg.perf_threshold + cfg.noise_k * spread
        ratio = cv / bv
        peer = bool(b.get("peer")) or bool(c.get("peer"))
        oracle = b.get("impl") == "reference" or c.get("impl") == "reference"
        if ratio < 1 - thr:
            kind = ("peer-slower" if peer and not cfg.gate_peers else
                    "reference-slower" if oracle and not cfg.gate_reference else "performance")
            F.append(Finding(kind, fmt_key(k),
                             f"{mname} {cv:.4g} is {100 * (1 - ratio):.1f}% below baseline {bv:.4g} "
                             f"(allowed {100 * thr:.1f}% = threshold {100 * cfg.perf_threshold:.1f}% "
                             f"+ noise {100 * cfg.noise_k * spread:.1f}%)", bv, cv))
        elif ratio > 1 + thr:
            improved += 1
            F.append(Finding("improved", fmt_key(k), f"{mname} {ratio:.2f}x baseline", bv, cv))
        for field, what in (("host_ms", "host overhead"), ("launch_ms", "launch time"),
                            ("launch_new_ms", "launch time at a new token count")):
            bh, ch = _metric(b, field), _metric(c, field)
            if b.get("cuda_graph") or bh is None or ch is None:
                continue
            allowed = bh * (1 + thr) + cfg.host_floor_us / 1000
            if ch > allowed:
                kind = ("peer-slower" if peer and not cfg.gate_peers else
                        "reference-slower" if oracle and not cfg.gate_reference else "host-overhead")
                F.append(Finding(kind, fmt_key(k),
                                 f"{what} {1000 * ch:.1f} us above baseline {1000 * bh:.1f} us (allowed "
                                 f"{1000 * allowed:.1f} us = +{100 * thr:.1f}% + {cfg.host_floor_us:g} us)", bh, ch))
    new_cases = len([k for k in cc if k not in bc and k[:-1] not in b_groups]) + len([k for k in ct if k not in bt])
    res.stats = {"comparisons_baseline": len(bc), "comparisons_candidate": len(cc),
                 "comparisons_matched": matched, "comparisons_redrawn": redrawn, "still_failing": still,
                 "timings_baseline": len(bt), "timings_candidate": len(ct), "timings_matched": perf_matched,
                 "improved": improved, "new_cases": new_cases,
                 "regressions": len(res.regressions), "config": asdict(cfg)}
    return res


# ----------------------------------------------------------------------------------------- output

def _trunc(s: str, n: int) -> str:
    """Shorten from the middle: both the test/op (start) and the shape (end) stay readable."""
    s = str(s)
    if len(s) <= n:
        return s
    head = (n - 1) // 2
    return s[:head] + "…" + s[len(s) - (n - 1 - head):]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def summary_table(res: GateResult, show_info: bool = False, width: int = 150) -> str:
    shown = ("still-failing", "peer-slower", "reference-slower")
    rows = [f for f in res.findings if f.gating or show_info or f.kind in shown]
    order = {k: i for i, k in enumerate(GATING_KINDS + shown + ("improved", "info"))}
    rows.sort(key=lambda f: (order.get(f.kind, 99), f.key))
    s = res.stats
    lines = [f"gate: baseline {res.baseline}  vs  candidate {res.candidate}",
             f"  comparisons: {s['comparisons_matched']} matched of {s['comparisons_baseline']} baseline keys "
             f"({s['comparisons_redrawn']} drawn differently), {s['still_failing']} still failing",
             f"  timings:     {s['timings_matched']} matched of {s['timings_baseline']}, {s['improved']} improved; "
             f"{s['new_cases']} new cases"]
    if rows:
        kw = max(8, width - 14 - 12 - 12 - 40)
        lines.append("")
        lines.append(f"  {'finding':13s} {'case':{kw}s} {'baseline':>11s} {'candidate':>11s}  detail")
        lines.append("  " + "-" * (width - 2))
        for f in rows:
            lines.append(f"  {f.kind:13s} {_trunc(f.key, kw):{kw}s} {_fmt(f.baseline):>11s} {_fmt(f.candidate):>11s}  "
                         f"{_trunc(f.detail, 200)}")
    n = len(res.regressions)
    by = {}
    for f in res.regressions:
        by[f.kind] = by.get(f.kind, 0) + 1
    lines.append("")
    lines.append(f"gate: {'FAIL' if n else 'PASS'}: {n} regression(s)" +
                 (" (" + ", ".join(f"{v} {k}" for k, v in sorted(by.items())) + ")" if by else ""))
    return "\n".join(lines)


def add_args(p) -> None:
    p.add_argument("--baseline", required=True, metavar="RUN", help="baseline run (jsonl, run folder, pytest-benchmark JSON)")
    p.add_argument("--candidate", required=True, metavar="RUN", help="candidate run")
    d = GateConfig()
    p.add_argument("--perf-threshold", type=float, default=d.perf_threshold,
                   help=f"allowed fractional tok/s drop before noise widening (default {d.perf_threshold})")
    p.add_argument("--noise-k", type=float, default=d.noise_k,
                   help=f"threshold widening per unit of relative p20-p80 spread (default {d.noise_k})")
    p.add_argument("--err-k", type=float, default=d.err_k,
                   help=f"allowed growth factor of a passing comparison's error ratio (default {d.err_k})")
    p.add_argument("--err-floor-frac", type=float, default=d.err_floor_frac,
                   help=f"errors below this fraction of the dtype's tolerance ratio never gate (default {d.err_floor_frac})")
    p.add_argument("--host-floor-us", type=float, default=d.host_floor_us,
                   help=f"host overhead may grow by this many microseconds beyond the relative threshold "
                        f"(default {d.host_floor_us:g})")
    p.add_argument("--gate-peers", action="store_true", help="also gate peers' (third-party) timings")
    p.add_argument("--gate-reference", action="store_true",
                   help="also gate the reference implementation's timings (plain loops; not gated by default)")
    p.add_argument("--allow-cross-device", action="store_true", help="compare runs from different devices")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the findings as JSON")
    p.add_argument("--all", action="store_true", help="list informational findings too (improvements, ...)")


def run_gate(args) -> int:
    """The `harness gate` command: 0 clean, 1 regression found, 2 bad input or internal error."""
    try:
        cfg = GateConfig(perf_threshold=args.perf_threshold, noise_k=args.noise_k, err_k=args.err_k,
                         err_floor_frac=args.err_floor_frac, host_floor_us=args.host_floor_us,
                         gate_peers=args.gate_peers,
                         gate_reference=args.gate_reference,
                         allow_cross_device=args.allow_cross_device)
        cfg.validate()  # before any file is read
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TornRecordWarning)  # kept on the runs, printed below
            base = load_run(args.baseline)
            cand = load_run(args.candidate)
        for w in base.warnings + cand.warnings:
            print(f"harness gate: warning: {w}", file=sys.stderr)
        res = gate_runs(base, cand, cfg)
        table = summary_table(res, show_info=args.all)
    except (RunError, ValueError) as e:
        print(f"harness gate: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a failure of the gate itself is exit 2, never 1 ("regression")
        traceback.print_exc(file=sys.stderr)
        print(f"harness gate: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(table)
    if args.json:
        try:
            write_json(args.json, res.to_dict())
        except OSError as e:
            print(f"harness gate: --json: expected a writable path, got {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    return res.exit_code
