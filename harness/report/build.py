"""Turn loaded runs into the report's context: tables (as cell grids for the jinja2 template) and charts.

Table model: {"columns": [str], "rows": [[cell]]} where a cell is {"text", "cls", "title"}.
"""
from __future__ import annotations

import math
from collections import defaultdict

import pandas as pd

from harness.gate import GateConfig, comparison_group, gate_runs, timing_key
from harness.report.runs import Run, num, shape_key
from harness.report.svg import LineChart

LENGTH_KEYS = ("T", "L", "B", "S", "tokens", "batch", "seqlen")


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


# --------------------------------------------------------------------------------------- summary

def summary(runs: list[Run], gates: list) -> dict:
    cols = ["run", "run id", "device", "device name", "git sha", "profile", "comparisons", "failed",
            "timings", "gate vs baseline"]
    rows = []
    for i, r in enumerate(runs):
        n_fail = sum(1 for c in r.comparisons if c.get("verdict") != "pass")
        g = gates[i - 1] if i else None
        if g is None:
            gcell = cell("baseline", "muted")
        else:
            n = len(g.regressions)
            gcell = cell("PASS" if n == 0 else f"FAIL: {n} regression(s)", "pass" if n == 0 else "fail")
        rows.append([cell(r.label, "strong"), cell(r.run_id), cell(r.device_kind), cell(r.device_name),
                     cell((r.env.get("git_sha") or "-")[:14]), cell(r.env.get("profile", "-")),
                     cell(len(r.comparisons)), cell(n_fail, "fail" if n_fail else "pass"),
                     cell(len(r.timings)), gcell])
    return {"columns": cols, "rows": rows}


def gate_findings(gates: list) -> list[dict]:
    out = []
    for g in gates:
        rows = [[cell(f.kind, "fail"), cell(f.key), cell(fmt(f.baseline) if not isinstance(f.baseline, str) else f.baseline),
                 cell(fmt(f.candidate) if not isinstance(f.candidate, str) else f.candidate), cell(f.detail)]
                for f in g.regressions]
        out.append({"baseline": g.baseline, "candidate": g.candidate, "n": len(g.regressions),
                    "table": {"columns": ["finding", "case", "baseline", "candidate", "detail"], "rows": rows}})
    return out


# --------------------------------------------------------------------------------------- accuracy

def _comparisons_frame(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for r in runs:
        for c in r.comparisons:
            err = num(c.get("err_ratio"))
            tol = num((c.get("tolerance") or {}).get("ratio"))
            rows.append({"run": r.label, "device": r.device_kind, "op": c.get("op") or "-",
                         "impl": c.get("impl") or "-", "dtype": c.get("dtype") or "-",
                         "failed": c.get("verdict") != "pass",
                         "err": err if err is not None else float("nan"),
                         "err_of_tol": (err / tol) if (err is not None and tol) else float("nan")})
    return pd.DataFrame(rows, columns=["run", "device", "op", "impl", "dtype", "failed", "err", "err_of_tol"])


def accuracy_matrix(runs: list[Run]) -> dict:
    df = _comparisons_frame(runs)
    labels = [f"{r.label} ({r.device_kind})" for r in runs]
    cols = ["op", "implementation", "dtype"] + labels
    if df.empty:
        return {"columns": cols, "rows": []}
    agg = (df.groupby(["op", "impl", "dtype", "run"], sort=True)
             .agg(n=("failed", "size"), failed=("failed", "sum"), worst=("err", "max"),
                  worst_of_tol=("err_of_tol", "max"))
             .reset_index())
    rows = []
    for (op, impl, dtype), sub in agg.groupby(["op", "impl", "dtype"], sort=True):
        row = [cell(op, "strong"), cell(impl), cell(dtype)]
        by_run = {rr["run"]: rr for _, rr in sub.iterrows()}
        for r in runs:
            rr = by_run.get(r.label)
            if rr is None:
                row.append(cell("—", "muted", "no comparisons in this run"))
                continue
            n, nf = int(rr["n"]), int(rr["failed"])
            verdict = "pass" if nf == 0 else "FAIL"
            tol_txt = f" ({fmt(rr['worst_of_tol'], 2)}× tol)" if not math.isnan(rr["worst_of_tol"]) else ""
            row.append(cell(f"{verdict} {n - nf}/{n} · worst {fmt(rr['worst'], 2)}{tol_txt}",
                            "pass" if nf == 0 else "fail",
                            "worst error ratio ||a-b||/||b|| and its multiple of the dtype's tolerance ratio"))
        rows.append(row)
    return {"columns": cols, "rows": rows}


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


def failing_cases(runs: list[Run]) -> list[dict]:
    """Per run: failing comparison groups, each with its minimal counterexample (smallest shapes) first."""
    out = []
    for r in runs:
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
            })
        out.append({"run": r.label, "cases": cases})
    return out


# --------------------------------------------------------------------------------------- performance

def _timings_frame(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for r in runs:
        for t in r.timings:
            rows.append({"run": r.label, "key": timing_key(t), "bench": t.get("bench"), "op": t.get("op") or "-",
                         "impl": t.get("impl") or "-", "dtype": t.get("dtype") or "-",
                         "shape": _shape_text(t.get("shape")), "shape_raw": t.get("shape"),
                         "tokens": num(t.get("tokens")), "tok_s": num(t.get("tok_s")),
                         "ms_p20": num(t.get("ms_p20")), "ms_p50": num(t.get("ms_p50")),
                         "ms_p80": num(t.get("ms_p80")), "gb_s": num(t.get("gb_s")),
                         "pct": num(t.get("pct_copy_bw")), "peer": bool(t.get("peer")), "error": t.get("error"),
                         "graph": bool(t.get("cuda_graph"))})
    return pd.DataFrame(rows)


def _speed(row) -> float | None:
    if row is None:
        return None
    for k in ("tok_s", "gb_s"):
        v = row.get(k)
        if v is not None and not (isinstance(v, float) and math.isnan(v)) and v > 0:
            return v
    ms = row.get("ms_p50")
    return 1.0 / ms if ms else None


def perf_tables(runs: list[Run]) -> list[dict]:
    df = _timings_frame(runs)
    if df.empty:
        return []
    labels = [r.label for r in runs]
    base = labels[0]
    by = {(row["run"], row["key"]): row for row in df.to_dict("records")}
    out = []
    for op in sorted(df["op"].unique()):
        sub = df[df["op"] == op]
        tokens = {k: (sub[sub["key"] == k]["tokens"].max() or 0) for k in set(sub["key"])}
        peer_of = {k: bool(any(by.get((lb, k), {}).get("peer") for lb in labels)) for k in tokens}
        # one block per (dtype, shape): our implementations first, then the peers, side by side
        keys = sorted(tokens, key=lambda k: (str(k[3]), 0 if math.isnan(tokens[k]) else tokens[k], str(k[4]),
                                             peer_of[k], str(k[2])))
        cols = ["impl", "dtype", "shape"]
        for lb in labels:
            cols += [f"{lb}: tok/s", f"{lb}: ms p50 [p20–p80]", f"{lb}: GB/s", f"{lb}: % copy BW"]
        cols += [f"{lb}: × {base}" for lb in labels[1:]]
        cols += [f"{labels[-1]}: × best peer"]
        rows = []
        for k in keys:
            any_row = next(by[(lb, k)] for lb in labels if (lb, k) in by)
            peer = any_row["peer"]
            row = [cell(any_row["impl"] + (" (peer)" if peer else "") + (" [graph]" if any_row["graph"] else ""),
                        "muted" if peer else "strong"),
                   cell(any_row["dtype"]), cell(any_row["shape"])]
            for lb in labels:
                t = by.get((lb, k))
                if t is None:
                    row += [cell("—", "muted")] * 4
                    continue
                err = t.get("error")
                if isinstance(err, str) and err:  # pandas turns a missing error into NaN, which is truthy
                    row += [cell("error", "fail", err[:300])] + [cell("—", "muted")] * 3
                    continue
                row += [cell(fmt_rate(t["tok_s"])),
                        cell(f"{fmt(t['ms_p50'])} [{fmt(t['ms_p20'])}–{fmt(t['ms_p80'])}]"),
                        cell(fmt(t["gb_s"])), cell(fmt(t["pct"]))]
            b = _speed(by.get((base, k)))
            for lb in labels[1:]:
                c = _speed(by.get((lb, k)))
                if b and c:
                    s = c / b
                    row.append(cell(f"{s:.2f}×", "pass" if s >= 0.95 else "fail"))
                else:
                    row.append(cell("—", "muted"))
            last = labels[-1]
            me = by.get((last, k))
            peers = [by[(last, kk)] for kk in keys
                     if (last, kk) in by and by[(last, kk)]["peer"] and kk[1] == k[1] and kk[3] == k[3]
                     and kk[4] == k[4]]
            if me is not None and not me["peer"] and peers:
                best = max(peers, key=lambda p: _speed(p) or 0)
                s = (_speed(me) or 0) / (_speed(best) or math.inf)
                row.append(cell(f"{s:.2f}× {best['impl']}", "pass" if s >= 1 else "warn"))
            else:
                row.append(cell("—", "muted"))
            rows.append(row)
        out.append({"op": op, "table": {"columns": cols, "rows": rows}})
    return out


def perf_charts(runs: list[Run]) -> list[dict]:
    df = _timings_frame(runs)
    if df.empty:
        return []
    df = df[df["tokens"].notna()]
    charts = []
    multi = len(runs) > 1
    for (op, dtype), sub in df.groupby(["op", "dtype"], sort=True):
        series = defaultdict(list)
        for t in sub.to_dict("records"):
            other = {k: v for k, v in (t["shape_raw"] or {}).items() if k not in LENGTH_KEYS} \
                if isinstance(t["shape_raw"], dict) else {}
            name = (f"{t['run']}: " if multi else "") + t["impl"] + (" (peer)" if t["peer"] else "")
            if other:
                name += " " + _shape_text(other)
            series[name].append(t)
        tok = LineChart(f"{op} {dtype}: tok/s vs length", "tokens", "tok/s", log_x=True)
        roof = LineChart(f"{op} {dtype}: % of copy bandwidth", "tokens", "% of copy BW", log_x=True)
        for name, ts in sorted(series.items()):
            tok.add_series(name, [(t["tokens"], t["tok_s"]) for t in ts])
            roof.add_series(name, [(t["tokens"], t["pct"]) for t in ts])
        svgs = [c.to_svg() for c in (tok, roof) if c]
        if svgs:
            charts.append({"title": f"{op} · {dtype}", "svgs": svgs})
    return charts


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
        texts = ["-" if v is None else (", ".join(map(str, v)) if isinstance(v, list) else str(v)) for v in vals]
        differs = len(set(texts)) > 1
        row = [cell(k, "strong")] + [cell(t, "warn" if differs else "") for t in texts]
        (diff_rows if differs else same_rows).append(row)
    cols = ["key"] + [r.label for r in runs]
    return {"differ": {"columns": cols, "rows": diff_rows}, "same": {"columns": cols, "rows": same_rows}}


def build_context(runs: list[Run], title: str, cfg: GateConfig | None = None) -> dict:
    cfg = cfg or GateConfig(allow_cross_device=True)
    gates = [gate_runs(runs[0], r, cfg) for r in runs[1:]]
    return {
        "title": title, "runs": runs, "summary": summary(runs, gates), "gates": gate_findings(gates),
        "accuracy": accuracy_matrix(runs), "failing": failing_cases(runs), "perf": perf_tables(runs),
        "charts": perf_charts(runs), "env": env_diff(runs),
        "n_failing": sum(1 for r in runs for c in r.comparisons if c.get("verdict") != "pass"),
    }
