"""`harness report RUN [RUN ...] -o reports/NAME.html`: one self-contained HTML page comparing runs.

The first RUN is the baseline, the last the candidate; three or more make a history (oldest first) with a
trend view. A RUN is a results .jsonl, a run folder or a pytest-benchmark JSON (see
harness.report.runs). The first screen holds the verdict (the gate's), the failing implementation x op x
dtype cases with their worst error, the regressions against the baseline counted by kind and the speed
against the best peer and the copy-bandwidth roofline; then the correctness matrix, the regressions
grouped by kind, op and implementation (collapsed), failing cases with their reproduce command, tok/s
tables and charts, the trend, skipped tests with their reasons and the environment (harness.report.build).
It is written to a temp file in the target folder and renamed, so no partial HTML is ever left.
"""
from __future__ import annotations

import os
import sys
import tempfile

from harness.report.runs import Run, RunError, check_same_device, load_runs

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


def render_html(runs: list[Run], title: str = "ssm-harness report") -> str:
    import jinja2

    from harness.report.build import build_context
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
                             autoescape=jinja2.select_autoescape(["html", "j2"], default=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html.j2").render(**build_context(runs, title))


def default_title(runs: list[Run]) -> str:
    if len(runs) == 1:
        return f"ssm-harness report: {runs[0].label}"
    if len(runs) == 2:
        return f"ssm-harness report: {runs[1].label} against {runs[0].label}"
    return f"ssm-harness report: {len(runs)} runs, {runs[0].label} to {runs[-1].label}"


def write_report(paths: list[str], out: str, *, title: str | None = None,
                 allow_cross_device: bool = False) -> str:
    """Load RUNs, render, write atomically to `out`; returns the absolute path. Raises RunError/ValueError."""
    if not paths:
        raise RunError("RUN: expected at least one run, got none")
    if not out or not out.endswith((".html", ".htm")):
        raise RunError(f"-o: expected an output path ending in .html, got {out!r}")
    runs = load_runs(paths)
    check_same_device(runs, allow_cross_device)
    html = render_html(runs, title or default_title(runs))
    out = os.path.abspath(out)
    d = os.path.dirname(out)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html.tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out


def add_args(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="results .jsonl, run folder or pytest-benchmark JSON; the first is the baseline")
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help="HTML file to write (default reports/report-<first run>.html)")
    p.add_argument("--title", default=None)
    p.add_argument("--allow-cross-device", action="store_true", help="compare runs from different devices")


def run_report(args) -> int:
    from harness.env import REPO_ROOT
    out = args.output
    if out is None:
        first = os.path.basename(os.path.abspath(args.runs[0]).rstrip(os.sep))
        out = os.path.join(REPO_ROOT, "reports", f"report-{os.path.splitext(first)[0]}.html")
    try:
        path = write_report(args.runs, out, title=args.title, allow_cross_device=args.allow_cross_device)
    except (RunError, ValueError) as e:
        print(f"harness report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
