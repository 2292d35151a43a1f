"""Turn loaded runs into the report's context: a first screen that answers the questions, then the detail.

The first screen (`summary`): the verdict (the gate's: never "pass" over a failure, and "no comparisons" when
there were none), the (implementation x op x dtype) cases that fail with their worst error, what regressed
against the baseline counted by kind, and how fast each implementation is against the best peer and the
copy-bandwidth roofline. Below it: the correctness matrix, the regressions grouped by kind -> op ->
implementation (collapsed `<details>`, counts first), failing cases with reproduce commands, performance
tables and charts (tok/s against length, one fixed colour per implementation, p20-p80 spread bars), the
launches of each case where the records carry them (`harness bench --kernels`, collapsed), a trend over
many runs, skipped tests with their reasons, and the environment.

The first run is the baseline, the last one the candidate; runs are named by short aliases in table
headers ("baseline", "candidate"; #1..#N for a history), with their full labels in the runs legend.
Table model: {"columns": [str], "rows": [[cell]]} where a cell is {"text", "cls", "title"}.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import Counter, defaultdict

from harness.gate import GATING_KINDS, GateConfig, comparison_group, comparison_key, fmt_key, gate_runs, timing_key
from harness.report.runs import Run, num, shape_key
from harness.report.svg import LineChart, impl_color
from harness.testing.resume import CAPPED_WHY

LENGTH_KEYS = ("T", "L", "seqlen", "tokens", "prefill")
SHORT_DTYPES = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16"}


def cell(text, cls: str = "", title: str = "") -> dict:
    return {"text": "" if text is None else str(text), "cls": cls, "title": title}


def fmt(v, digits: int = 3) -> str:
    x = num(v)
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-2):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def fmt_rate(v) -> str:
    x = num(v)
    if x is None or not math.isfinite(x):
        return "-"
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}"
    return f"{x:.3g}"


def _shape_text(shape) -> str:
    if isinstance(shape, dict):
        parts = []
        for k, v in shape.items():
            parts.append(f"{k}={'×'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}")
        return " ".join(parts)
    return shape_key(shape)


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


# --------------------------------------------------------------------------------------- runs legend

def aliases(runs: list[Run]) -> list[str]:
    """Short names for table headers: 'this run'; 'baseline'/'candidate'; '#1 (baseline)' .. '#N'."""
    if len(runs) == 1:
        return ["this run"]
    if len(runs) == 2:
        return ["baseline", "candidate"]
    return ["#1"] + [f"#{i + 1}" for i in range(1, len(runs))]


def _run_time(r: Run) -> str:
    ts = [num(x.get("time")) for x in r.comparisons + r.timings if num(x.get("time"))]
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(min(ts))) + " UTC" if ts else "-"


def _git(r: Run) -> str:
    sha = r.env.get("git_sha")
    if not sha:
        for e in r.envs:
            if e.get("git_sha"):
                sha = e["git_sha"]
                break
    if not sha:
        v = r.env.get("harness")
        return f"unknown (harness {v})" if v else "unknown"
    dirty = sha.endswith("-dirty")
    return sha[:10] + (" (dirty)" if dirty else "")


def run_legend(runs: list[Run]) -> list[dict]:
    names = aliases(runs)
    out = []
    for i, (r, a) in enumerate(zip(runs, names)):
        n_fail = sum(1 for c in r.comparisons if c.get("verdict") != "pass")
        role = "baseline" if (i == 0 and len(runs) > 1) else ("candidate" if i == len(runs) - 1 and len(runs) > 1 else "")
        out.append({"alias": a, "role": role, "label": r.label, "run_id": r.run_id, "device": r.device_kind,
                    "device_name": r.device_name, "git": _git(r), "profile": r.env.get("profile", "-"),
                    "when": _run_time(r), "comparisons": len(r.comparisons), "failed": n_fail,
                    "timings": len(r.timings), "sources": r.sources})
    return out


# --------------------------------------------------------------------------------------- correctness

def _cases(r: Run) -> dict:
    """(op, impl, dtype) -> {n, failed, worst error ratio, worst multiple of the tolerance ratio}."""
    out: dict = {}
    for c in r.comparisons:
        k = (c.get("op") or "-", c.get("impl") or "-", c.get("dtype") or "-")
        d = out.setdefault(k, {"n": 0, "failed": 0, "worst": None, "worst_tol": None})
        d["n"] += 1
        d["failed"] += c.get("verdict") != "pass"
        err = num(c.get("err_ratio"))
        tol = num((c.get("tolerance") or {}).get("ratio"))
        if err is not None and math.isnan(err):
            err = math.inf
        if err is not None and (d["worst"] is None or err > d["worst"]):
            d["worst"] = err
        if err is not None and tol:
            m = err / tol
            if d["worst_tol"] is None or m > d["worst_tol"]:
                d["worst_tol"] = m
    return out


def _case_text(d: dict) -> str:
    worst = f"{fmt(d['worst_tol'], 2)}× tol" if d["worst_tol"] is not None else f"err {fmt(d['worst'], 2)}"
    verdict = "FAIL" if d["failed"] else "pass"
    return f"{verdict} {d['n'] - d['failed']}/{d['n']} · worst {worst}"


DTYPE_ORDER = ("float32", "float64", "bfloat16", "float16")


def correctness_matrix(r: Run) -> dict:
    """One row per (op, implementation) compared, one column per dtype: verdict, comparisons passed and
    the worst error as a multiple of the dtype's tolerance."""
    cases = _cases(r)
    dtypes = sorted({k[2] for k in cases}, key=lambda d: (DTYPE_ORDER.index(d) if d in DTYPE_ORDER else 9, d))
    pairs = sorted({k[:2] for k in cases}, key=lambda p: (p[0], p[1].startswith("reference"), p[1]))
    rows = []
    for op, impl in pairs:
        row = [cell(op, "strong"), cell(impl)]
        for dt in dtypes:
            d = cases.get((op, impl, dt))
            if d is None:
                row.append(cell("—", "muted", "not compared"))
                continue
            row.append(cell(_case_text(d), "fail" if d["failed"] else "pass",
                            f"{op} · {impl} · {dt}: {d['n'] - d['failed']}/{d['n']} comparisons pass; worst error "
                            f"ratio ‖a−b‖/‖b‖ {fmt(d['worst'])}"))
        rows.append(row)
    n_fail = sum(1 for d in cases.values() if d["failed"])
    return {"columns": ["op", "implementation"] + [SHORT_DTYPES.get(d, d) for d in dtypes], "rows": rows,
            "n_cases": len(cases), "n_fail": n_fail}


def accuracy_matrix(runs: list[Run]) -> dict:
    """Flat table (op, implementation, dtype, one column per run): the detail behind the matrix."""
    names = aliases(runs)
    per_run = [_cases(r) for r in runs]
    keys = sorted(set().union(*per_run))
    rows = []
    for k in keys:
        row = [cell(k[0], "strong"), cell(k[1]), cell(k[2])]
        for cases in per_run:
            d = cases.get(k)
            row.append(cell("—", "muted", "no comparisons in this run") if d is None else
                       cell(_case_text(d), "fail" if d["failed"] else "pass"))
        rows.append(row)
    return {"columns": ["op", "implementation", "dtype"] + names, "rows": rows}


def _numel(shapes) -> int:
    if not isinstance(shapes, dict):
        return 0
    total = 0
    for v in shapes.values():
        if isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
            total += math.prod(v) if v else 1
        elif isinstance(v, int):
            total += v
    return total


def default_reproduce(c: dict, run: Run) -> str:
    test = c.get("test_id")
    if not test:
        return "-"
    cmd = f"python -m pytest '{test}' --device {run.device_kind}"
    if c.get("impl"):
        cmd += f" --impl {c['impl']}"
    if c.get("seed") is not None:
        cmd += f" --hypothesis-seed={c['seed']}"
    return cmd


def failing_cases(runs: list[Run], found: list | None = None) -> list[dict]:
    """The candidate's (then the baseline's) failing comparison groups, each with its minimal
    counterexample (smallest shapes) first, and the heading of the written-up finding it belongs to
    (`harness.findings`; `found`: the findings' sections, default the repository's docs/findings.md; "" where
    none names it, None for every case where there are no findings to read)."""
    from harness import findings
    found = findings.load() if found is None else found
    names = aliases(runs)
    out = []
    for i in [len(runs) - 1] + ([0] if len(runs) > 1 else []):
        alias, r = names[i], runs[i]
        groups = defaultdict(list)
        for c in r.comparisons:
            if c.get("verdict") != "pass":
                groups[comparison_group(c)].append(c)
        cases = []
        for g, recs in sorted(groups.items(), key=lambda kv: str(kv[0])):
            recs = sorted(recs, key=lambda c: (_numel(c.get("shapes")), num(c.get("err_ratio")) or 0))
            m = recs[0]
            worst = max((num(c.get("err_ratio")) for c in recs if num(c.get("err_ratio")) is not None),
                        default=None)
            cases.append({
                "test": g[0], "op": m.get("op"), "impl": m.get("impl"), "dtype": m.get("dtype"),
                "device": m.get("device") or r.device_kind, "n": len(recs), "worst": fmt(worst),
                "reason": m.get("reason") or "", "shapes": _shape_text(m.get("shapes")),
                "max_abs_err": fmt(m.get("max_abs_err")), "err_ratio": fmt(m.get("err_ratio")),
                "tolerance": ", ".join(f"{k}={v}" for k, v in (m.get("tolerance") or {}).items()),
                "worst_index": m.get("worst_index"), "seed": m.get("seed"),
                "counterexample": m.get("counterexample") or m.get("example"),
                "reproduce": m.get("reproduce") or default_reproduce(m, r),
                # None: no findings to read (an installed package without the repository's docs)
                "finding": (findings.section_of(m.get("test_id") or str(g[0]), m.get("impl"), found) or "")
                if found else None,
            })
        out.append({"run": alias, "label": r.label, "cases": cases})
    return out


# --------------------------------------------------------------------------------------- regressions

def _key_index(runs: list[Run]) -> dict:
    """A finding's key (gate.fmt_key of a comparison or timing key) -> (op, impl)."""
    idx = {}
    for r in runs:
        for c in r.comparisons:
            idx[fmt_key(comparison_key(c))] = (c.get("op") or "-", c.get("impl") or "-")
        for t in r.timings:
            idx[fmt_key(timing_key(t))] = (t.get("op") or "-", t.get("impl") or "-")
    return idx


def _val(v) -> str:
    return v if isinstance(v, str) else fmt(v)


def regression_groups(gate, runs: list[Run]) -> dict:
    """The gate's findings that gate, grouped kind -> (op, impl), counts first (largest group first)."""
    idx = _key_index(runs)
    by_kind: dict = defaultdict(lambda: defaultdict(list))
    for f in gate.regressions:
        by_kind[f.kind][idx.get(f.key, ("-", "-"))].append(f)
    kinds = []
    for kind in GATING_KINDS:
        groups = by_kind.get(kind)
        if not groups:
            continue
        gl = []
        for (op, impl), fs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            rows = [[cell(f.key, "key"), cell(_val(f.baseline)), cell(_val(f.candidate)), cell(f.detail)]
                    for f in sorted(fs, key=lambda f: f.key)]
            gl.append({"op": op, "impl": impl, "n": len(fs),
                       "table": {"columns": ["case", "baseline", "candidate", "detail"], "rows": rows}})
        kinds.append({"kind": kind, "n": sum(g["n"] for g in gl), "groups": gl})
    kinds.sort(key=lambda k: -k["n"])
    s = gate.stats
    return {"n": len(gate.regressions), "kinds": kinds,
            "counts": ", ".join(f"{k['n']} {k['kind']}" for k in kinds),
            "stats": f"{s.get('comparisons_matched', 0)} of {s.get('comparisons_baseline', 0)} baseline comparison "
                     f"cases matched, {s.get('timings_matched', 0)} of {s.get('timings_baseline', 0)} timings; "
                     f"{s.get('still_failing', 0)} still failing, {s.get('improved', 0)} improved, "
                     f"{s.get('new_cases', 0)} new cases"}


# --------------------------------------------------------------------------------------- performance

def _speed(t: dict | None) -> float | None:
    """tok/s, else GB/s, else 1/ms (the gate's throughput order)."""
    if t is None or t.get("error"):
        return None
    for k in ("tok_s", "gb_s"):
        v = num(t.get(k))
        if _finite(v) and v > 0:
            return v
    ms = num(t.get("ms_p50"))
    return 1.0 / ms if _finite(ms) and ms > 0 else None


def _tokens(t: dict) -> float | None:
    v = num(t.get("tokens"))
    if _finite(v) and v > 0:
        return v
    shape = t.get("shape") if isinstance(t.get("shape"), dict) else {}
    for k in LENGTH_KEYS:
        if isinstance(shape.get(k), (int, float)) and shape[k] > 0:
            return float(shape[k])
    return None


def _tok_s(t: dict, ms_key: str = "ms_p50") -> float | None:
    if ms_key == "ms_p50":
        v = num(t.get("tok_s"))
        if _finite(v) and v > 0:
            return v
    n, ms = _tokens(t), num(t.get(ms_key))
    return n / (ms * 1e-3) if n and _finite(ms) and ms > 0 else None


def _peer_key(t: dict) -> tuple:
    return (t.get("op"), t.get("dtype"), shape_key(t.get("shape")), bool(t.get("cuda_graph")))


def best_peers(r: Run) -> dict:
    """(op, dtype, shape, cuda_graph) -> the fastest peer timing of run `r` there."""
    best: dict = {}
    for t in r.timings:
        if t.get("peer") and _speed(t):
            k = _peer_key(t)
            if k not in best or _speed(t) > _speed(best[k]):
                best[k] = t
    return best


def _impl_name(t: dict) -> str:
    return (t.get("impl") or "-") + (" [graph]" if t.get("cuda_graph") else "")


KERNEL_SOURCES = {"cuda": "CUDA: device time of each kernel, copy and memset",
                  "xpu": "XPU: device time of each kernel, copy and memset",
                  "cpu": "CPU: operators by self CPU time"}


def launches(case: str, recs: list[tuple[str, dict | None]]) -> dict | None:
    """One case's launch profiles (`kernels` of `harness bench --kernels`), given (run alias, eager timing
    record or None) per run shown: None when no record has one; else a summary line and a table, one row
    per launch name (largest first, in the last run that has the name), the time and the launches per call
    of each run."""
    have = [(a, r) for a, r in recs if r is not None and (r.get("kernels") or r.get("kernels_error"))]
    if not have:
        return None
    names: list = []
    for _, r in reversed(have):
        for k in r.get("kernels") or []:
            if k.get("name") not in names:
                names.append(k.get("name"))
    one = len(have) == 1
    cols = ["name"]
    for a, _ in have:
        cols += ["µs per call", "calls per call"] if one else [f"µs {a}", f"calls {a}"]
    rows = []
    for name in names:
        row = [cell(name, "key")]
        for _, r in have:
            k = next((k for k in r.get("kernels") or [] if k.get("name") == name), None)
            row += [cell(fmt(k.get("us"))), cell(fmt(k.get("calls")))] if k else \
                [cell("—", "muted", "not among this run's launches")] * 2
        rows.append(row)
    texts = []
    for a, r in have:
        ks = r.get("kernels") or []
        if r.get("kernels_error"):
            text = f"no profile ({r['kernels_error']})"
        else:
            total = sum(num(k.get("us")) or 0.0 for k in ks)
            text = f"{fmt(total)} µs per call over {len(ks)} name(s), largest {ks[0].get('name')} " \
                   f"({fmt(ks[0].get('us'))} µs)"
        texts.append(text if one else f"{a}: {text}")
    return {"case": case, "text": "; ".join(texts), "error": any(r.get("kernels_error") for _, r in have),
            "sources": sorted({str(r["kernels_source"]) for _, r in have if r.get("kernels_source")}),
            "table": {"columns": cols, "rows": rows}}


def _host_cell(t: dict) -> dict:
    """An eager timing's host overhead (eager - graph p50) and, in brackets, its launch time (the host's time
    to issue one call; after a slash, one at a token count not seen before), in µs; a dash for CUDA-graph
    records and where neither was measured."""
    host, launch, new = num(t.get("host_ms")), num(t.get("launch_ms")), num(t.get("launch_new_ms"))
    if t.get("cuda_graph") or (host is None and launch is None):
        return cell("—", "muted")
    text = f"{1000 * host:.1f}" if host is not None else "—"
    if launch is not None:
        text += f" ({1000 * launch:.1f}" + (f" / {1000 * new:.1f})" if new is not None else ")")
    return cell(text, "", "eager − graph p50; in brackets the host's time to issue one eager call (after the "
                          "slash: one at a token count no call before had)")


def perf_tables(runs: list[Run]) -> list[dict]:
    """Per op: one row per case of the candidate (and the baseline's cases it lacks), columns for the
    candidate's figures, the baseline's tok/s and the speedup when there is a baseline, x best peer when
    the candidate timed peers at that case; and the cases' launch profiles (`launches`) where the records
    carry them."""
    names = aliases(runs)
    last, base = runs[-1], (runs[0] if len(runs) > 1 else None)
    lt = {timing_key(t): t for t in last.timings}
    bt = {timing_key(t): t for t in base.timings} if base else {}
    peers = best_peers(last)
    out = []
    for op in sorted({k[1] or "-" for k in list(lt) + list(bt)}):
        keys = [k for k in lt if (k[1] or "-") == op] + [k for k in bt if (k[1] or "-") == op and k not in lt]
        any_rec = {k: lt.get(k) or bt.get(k) for k in keys}
        keys.sort(key=lambda k: (str(k[3]), _tokens(any_rec[k]) or 0, str(any_rec[k].get("shape")),
                                 bool(any_rec[k].get("peer")), str(k[2]), bool(any_rec[k].get("cuda_graph"))))
        has_peer_col = any(not (lt.get(k) or {}).get("peer") and _peer_key(lt[k]) in peers for k in keys if k in lt)
        cols = ["implementation", "dtype", "shape"]
        if base:
            cols += [f"tok/s {names[0]}", f"tok/s {names[-1]}", f"× {names[0]}"]
        else:
            cols += ["tok/s"]
        cols += ["ms p50 [p20–p80]", "GB/s", "% copy BW", "host µs (launch)"]
        if has_peer_col:
            cols += ["× best peer"]
        rows, profiled = [], []
        for k in keys:
            t, b = lt.get(k), bt.get(k)
            a = t or b
            peer = bool(a.get("peer"))
            lp = launches(f"{_impl_name(a)}{' (peer)' if peer else ''} · {a.get('dtype') or '-'} · "
                          f"{_shape_text(a.get('shape'))}",
                          ([(names[0], b)] if base else []) + [(names[-1], t)])
            if lp is not None:
                profiled.append(lp)
            row = [cell(_impl_name(a) + (" (peer)" if peer else ""), "muted" if peer else "strong",
                        "a third-party kernel" if peer else ""),
                   cell(a.get("dtype") or "-"), cell(_shape_text(a.get("shape")), "shape")]
            if base:
                row.append(cell(fmt_rate(_tok_s(b)) if b else "—", "" if b else "muted",
                                "" if b else "not timed in the baseline"))
            if t is None:
                row.append(cell("—", "muted", f"not timed in the {names[-1]}"))
            elif t.get("error"):
                row.append(cell("error", "fail", str(t["error"])))
            else:
                row.append(cell(fmt_rate(_tok_s(t))))
            if base:
                sb, sc = _speed(b), _speed(t)
                if sb and sc:
                    s = sc / sb
                    row.append(cell(f"{s:.2f}×", "pass" if s >= 0.95 else "fail"))
                else:
                    row.append(cell("—", "muted"))
            if t is None or t.get("error"):
                row += [cell("—", "muted")] * 4
            else:
                row += [cell(f"{fmt(t.get('ms_p50'))} [{fmt(t.get('ms_p20'))}–{fmt(t.get('ms_p80'))}]"),
                        cell(fmt(t.get("gb_s"))), cell(fmt(t.get("pct_copy_bw"))), _host_cell(t)]
            if has_peer_col:
                p = peers.get(_peer_key(t)) if t is not None and not peer else None
                if p is not None and _speed(t) and _speed(p):
                    s = _speed(t) / _speed(p)
                    row.append(cell(f"{s:.2f}× {p.get('impl')}", "pass" if s >= 1 else "warn"))
                else:
                    row.append(cell("—", "muted"))
            rows.append(row)
        sources = sorted({s for lp in profiled for s in lp["sources"]})
        out.append({"op": op, "table": {"columns": cols, "rows": rows}, "launches": profiled,
                    "launch_sources": "; ".join(KERNEL_SOURCES.get(s, s) for s in sources)})
    return out


def speed_summary(r: Run) -> dict:
    """Per implementation of run `r` (peers too): cases timed, x best peer (median, min-max over the cases
    where a peer was timed), % of copy bandwidth (median, max), errors."""
    peers = best_peers(r)
    by: dict = defaultdict(lambda: {"n": 0, "vs_peer": [], "pct": [], "errors": 0, "peer": False})
    for t in r.timings:
        if t.get("op") == "copy":
            continue
        d = by[_impl_name(t)]
        d["n"] += 1
        d["peer"] = d["peer"] or bool(t.get("peer"))
        if t.get("error"):
            d["errors"] += 1
            continue
        pct = num(t.get("pct_copy_bw"))
        if _finite(pct):
            d["pct"].append(pct)
        p = peers.get(_peer_key(t))
        if p is not None and not t.get("peer") and _speed(t) and _speed(p):
            d["vs_peer"].append(_speed(t) / _speed(p))
    rows = []
    any_peer = any(d["vs_peer"] for d in by.values())
    for name, d in sorted(by.items(), key=lambda kv: (kv[1]["peer"], kv[0])):
        vp = d["vs_peer"]
        row = [cell(name + (" (peer)" if d["peer"] else ""), "muted" if d["peer"] else "strong"), cell(d["n"])]
        if any_peer:
            if vp:
                med = statistics.median(vp)
                row.append(cell(f"{med:.2f}× ({min(vp):.2f}–{max(vp):.2f})", "pass" if med >= 1 else "warn",
                                f"median, min–max over the {len(vp)} cases where a peer was timed"))
            else:
                row.append(cell("—", "muted", "no peer timed at these cases"))
        pc = d["pct"]
        row.append(cell(f"{statistics.median(pc):.3g} (max {max(pc):.3g})" if pc else "—",
                        "" if pc else "muted", "median over the cases (max)"))
        row.append(cell(d["errors"], "fail" if d["errors"] else "muted"))
        rows.append(row)
    cols = ["implementation", "cases"] + (["× best peer"] if any_peer else []) + ["% copy BW (median)", "errors"]
    return {"columns": cols, "rows": rows,
            "errors": sum(d["errors"] for d in by.values())}


def _chart_x(t: dict) -> float | None:
    return _tokens(t)


def perf_charts(runs: list[Run]) -> list[dict]:
    """Per (op, dtype): tok/s against tokens, one colour per implementation in every chart (dashed: the
    baseline's), p20-p80 spread bars; and % of copy bandwidth against tokens."""
    names = aliases(runs)
    show = [(names[0], runs[0], True), (names[-1], runs[-1], False)] if len(runs) > 1 else [(names[0], runs[0], False)]
    groups: dict = defaultdict(list)
    for alias, r, is_base in show:
        for t in r.timings:
            if t.get("op") == "copy" or t.get("error") or _chart_x(t) is None:
                continue
            groups[(t.get("op") or "-", t.get("dtype") or "-")].append((alias, is_base, t))
    charts = []
    for (op, dtype), items in sorted(groups.items()):
        series: dict = defaultdict(list)
        for alias, is_base, t in items:
            shape = t.get("shape") if isinstance(t.get("shape"), dict) else {}
            other = {k: v for k, v in shape.items() if k not in LENGTH_KEYS}
            name = _impl_name(t) + (" (peer)" if t.get("peer") else "")
            if len(show) > 1:
                name = f"{name} · {alias}"
            series[(t.get("impl") or "-", bool(t.get("cuda_graph")), is_base, name, _shape_text(other))].append(t)
        # a dimension other than length that varies within one implementation's series splits it
        tok_vals = [v for ts in series.values() for v in (_tok_s(t) for t in ts) if v]
        log_y = bool(tok_vals) and max(tok_vals) / min(tok_vals) > 50
        tok = LineChart(f"{op} · {dtype}: tok/s against tokens", "tokens", "tok/s", log_x=True, log_y=log_y)
        roof = LineChart(f"{op} · {dtype}: % of copy bandwidth", "tokens", "% of copy BW", log_x=True)
        multi_shape = defaultdict(set)
        for (impl, graph, is_base, name, other) in series:
            multi_shape[(impl, graph, is_base)].add(other)
        for (impl, graph, is_base, name, other), ts in sorted(series.items(), key=lambda kv: kv[0][3:]):
            label = name + (f" [{other}]" if len(multi_shape[(impl, graph, is_base)]) > 1 and other else "")
            dash = "6 3" if is_base else ("2 2" if graph else "")
            color = impl_color(impl)
            pts = [(_chart_x(t), _tok_s(t)) for t in ts]
            spread = [(_chart_x(t), _tok_s(t, "ms_p80"), _tok_s(t, "ms_p20")) for t in ts]
            tok.add_series(label, pts, color=color, dash=dash, spread=spread)
            roof.add_series(label, [(_chart_x(t), num(t.get("pct_copy_bw"))) for t in ts], color=color, dash=dash)
        svgs = [c.to_svg() for c in (tok, roof) if c]
        if svgs:
            charts.append({"title": f"{op} · {dtype}", "svgs": svgs})
    return charts


def trend(runs: list[Run]) -> dict | None:
    """With three runs or more (a nightly history, oldest first): per op, tok/s of each implementation at
    the op's largest case timed in most runs, against the run; and comparisons passed/failed per run."""
    if len(runs) < 3:
        return None
    names = aliases(runs)
    charts = []
    by_op: dict = defaultdict(lambda: defaultdict(dict))  # op -> timing key -> run index -> record
    for i, r in enumerate(runs):
        for t in r.timings:
            if t.get("op") != "copy" and not t.get("error") and _speed(t):
                by_op[t.get("op") or "-"][timing_key(t)][i] = t
    for op, keys in sorted(by_op.items()):
        by_impl: dict = defaultdict(list)
        for k, per_run in keys.items():
            by_impl[(k[2] or "-", k[3])].append((len(per_run), _tokens(next(iter(per_run.values()))) or 0, str(k), k))
        ch = LineChart(f"{op}: tok/s (else GB/s) per run, largest case", "run", "throughput", y_min=0)
        for (impl, dtype), cands in sorted(by_impl.items()):
            _, _, _, k = max(cands)
            per_run = keys[k]
            sample = next(iter(per_run.values()))
            ch.add_series(f"{_impl_name(sample)} {dtype} {_shape_text(sample.get('shape'))}",
                          [(i + 1, _speed(t)) for i, t in sorted(per_run.items())], color=impl_color(impl),
                          dash="" if not sample.get("peer") else "4 2")
        if ch:
            charts.append(ch.to_svg())
    rows = []
    for a, r in zip(names, runs):
        n = len(r.comparisons)
        nf = sum(1 for c in r.comparisons if c.get("verdict") != "pass")
        rows.append([cell(a, "strong"), cell(r.label), cell(_run_time(r)), cell(_git(r)), cell(n),
                     cell(nf, "fail" if nf else ("pass" if n else "muted")), cell(len(r.timings))])
    return {"charts": charts, "table": {"columns": ["run", "label", "when", "git", "comparisons", "failed",
                                                    "timings"], "rows": rows}}


# --------------------------------------------------------------------------------------- skipped

def _outcome_files(r: Run) -> list[str]:
    folders = {r.path if os.path.isdir(r.path) else os.path.dirname(r.path)}
    return [os.path.join(d, "outcomes.jsonl") for d in sorted(folders) if os.path.isfile(os.path.join(d, "outcomes.jsonl"))]


CAPPED = "passed on fewer examples than the profile draws (--generate-seconds ended the drawing)"


def skipped(runs: list[Run]) -> list[dict]:
    """Per run with an `outcomes.jsonl` (the suites' --outcomes file): skipped tests grouped by reason (`n`
    counts them), and a group of the tests that passed on fewer examples than asked, a `--generate-seconds` cap
    having ended their drawing (`CAPPED`; each id with its note; not in `n`)."""
    out = []
    for alias, r in zip(aliases(runs), runs):
        reasons: dict = defaultdict(list)
        capped: list = []
        for path in _outcome_files(r):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        o = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if o.get("outcome") == "skipped":
                        why = (str(o.get("why") or "").strip().splitlines() or ["(no reason given)"])[0]
                        why = why.removeprefix("Skipped: ")
                        reasons[why].append(o.get("nodeid", "?"))
                    elif o.get("outcome") == "passed" and str(o.get("why") or "").startswith(CAPPED_WHY):
                        capped.append(f"{o.get('nodeid', '?')} ({str(o['why']).removeprefix(CAPPED_WHY)})")
        if reasons or capped:
            groups = [{"reason": why, "n": len(ids), "tests": sorted(ids)}
                      for why, ids in sorted(reasons.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
            n = sum(g["n"] for g in groups)
            if capped:
                groups.append({"reason": CAPPED, "n": len(capped), "tests": sorted(capped)})
            out.append({"run": alias, "label": r.label, "n": n, "groups": groups})
    return out


# --------------------------------------------------------------------------------------- environment

def env_diff(runs: list[Run]) -> dict:
    keys = []
    for r in runs:
        for k in r.env:
            if k not in keys:
                keys.append(k)
    diff_rows, same_rows = [], []
    for k in keys:
        vals = [r.env.get(k) for r in runs]
        texts = ["-" if v is None else (", ".join(map(str, v)) if isinstance(v, list) else
                                        json.dumps(v) if isinstance(v, dict) else str(v)) for v in vals]
        differs = len(set(texts)) > 1
        row = [cell(k, "strong")] + [cell(t, "warn" if differs else "") for t in texts]
        (diff_rows if differs else same_rows).append(row)
    cols = ["key"] + aliases(runs)
    return {"differ": {"columns": cols, "rows": diff_rows}, "same": {"columns": cols, "rows": same_rows}}


# --------------------------------------------------------------------------------------- verdict

def verdict(runs: list[Run], gate, bench_errors: int) -> dict:
    """The headline, consistent with the gate: FAIL when the candidate has failing comparisons, the gate
    found regressions or a benchmark raised; 'no comparisons' (not pass) when the candidate made none."""
    names = aliases(runs)
    last = runs[-1]
    n = len(last.comparisons)
    nf = sum(1 for c in last.comparisons if c.get("verdict") != "pass")
    problems = []
    if nf:
        problems.append(f"{nf} of {n} comparisons fail")
    if gate is not None and gate.regressions:
        by = Counter(f.kind for f in gate.regressions)
        problems.append(f"{len(gate.regressions)} regression(s) against the {names[0]} ("
                        + ", ".join(f"{v} {k}" for k, v in by.most_common()) + ")")
    if bench_errors:
        problems.append(f"{bench_errors} benchmark case(s) raised")
    where = f" in the {names[-1]}" if len(runs) > 1 else ""
    if problems:
        return {"cls": "fail", "text": "FAIL: " + "; ".join(problems)}
    if n == 0:
        gate_txt = "; gate clean" if gate is not None else ""
        return {"cls": "none", "text": f"NO COMPARISONS{where}: correctness was not checked "
                                       f"({len(last.timings)} timings){gate_txt}"}
    gate_txt = f"; no regressions against the {names[0]}" if gate is not None else ""
    return {"cls": "pass", "text": f"PASS: all {n} comparisons pass{where}{gate_txt}"}


def build_context(runs: list[Run], title: str, cfg: GateConfig | None = None) -> dict:
    cfg = cfg or GateConfig(allow_cross_device=True)
    gate = gate_runs(runs[0], runs[-1], cfg) if len(runs) > 1 else None
    speed = speed_summary(runs[-1])
    matrix = correctness_matrix(runs[-1])
    regs = regression_groups(gate, runs) if gate is not None else None
    skips = skipped(runs)
    failing_now = [(o, i, dt, d) for (o, i, dt), d in sorted(_cases(runs[-1]).items()) if d["failed"]]
    cross = len({r.device_id for r in runs}) > 1
    return {
        "title": title, "runs": run_legend(runs), "aliases": aliases(runs), "cross_device": cross,
        "verdict": verdict(runs, gate, speed["errors"]),
        "failing_now": [{"op": o, "impl": i, "dtype": dt, "text": _case_text(d)} for o, i, dt, d in failing_now],
        "matrix": matrix, "accuracy": accuracy_matrix(runs), "regressions": regs, "speed": speed,
        "failing": failing_cases(runs),
        "perf": perf_tables(runs), "charts": perf_charts(runs), "trend": trend(runs),
        "skipped": skips, "n_skipped": sum(s["n"] for s in skips if s["label"] == runs[-1].label),
        "env": env_diff(runs),
    }
