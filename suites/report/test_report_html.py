"""`harness report`: tables, atomic writing, bad input, and the page rendered in a real headless Chromium."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from harness.cli import main
from harness.report import render_html
from harness.report.build import accuracy_matrix, perf_tables
from harness.report.runs import load_runs
from harness.report.samples import make_run

REG = ("selective_scan_varlen", "triton", "bfloat16")
REG_TEST = "suites/ops/test_ops_selective_scan_varlen.py::test_matches_reference[triton]"
SLOW_KEY = ("causal_conv1d_varlen", "triton", 1024)


@pytest.fixture
def pair(tmp_path):
    base = make_run(str(tmp_path / "base.jsonl"))
    cand = make_run(str(tmp_path / "cand.jsonl"), git_sha="b" * 40, torch_version="2.12.0",
                    slow={SLOW_KEY: 0.10}, regress={REG})
    return base, cand


def _texts(table):
    return [[c["text"] for c in row] for row in table["rows"]]


def test_tables_show_planted_cases(pair):
    """The accuracy matrix marks the regressed (op, impl, dtype) FAIL in the candidate only, and the tok/s
    table shows the planted 10% slowdown as 0.90x against the baseline."""
    runs = load_runs(list(pair))
    acc = {tuple(r[:3]): r[3:] for r in _texts(accuracy_matrix(runs))}
    base_cell, cand_cell = acc[REG]
    assert base_cell.startswith("pass 2/2") and cand_cell.startswith("FAIL 0/2")
    assert all(v[1].startswith("pass") for k, v in acc.items() if k != REG)
    conv = next(p for p in perf_tables(runs) if p["op"] == "causal_conv1d_varlen")
    speed_col = conv["table"]["columns"].index("cand: × base")
    rows = {(r[0], r[2]): r[speed_col] for r in _texts(conv["table"])}
    assert rows[("triton", "T=1024 D=1024 K=4")] == "0.90×"
    assert rows[("triton", "T=256 D=1024 K=4")] == "1.00×"


def test_html_is_self_contained(pair):
    """The page loads nothing from the network: no scripts, no external src/href (only the SVG namespace URI)."""
    html = render_html(load_runs(list(pair)))
    assert "<script" not in html
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', html)
    assert "<svg" in html and REG_TEST in html


def test_bad_input_leaves_no_file(pair, tmp_path, capsys):
    """Unreadable input, cross-device runs without the flag and an empty run exit 2 and write nothing."""
    base, _ = pair
    out = tmp_path / "out" / "r.html"
    cpu = make_run(str(tmp_path / "cpu.jsonl"), device="cpu", device_name="x86_64")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"schema": 1, "kind": "env", "env": {"device": "cpu"}}\n')
    for args, msg in (([base, cpu], "--allow-cross-device"), ([base, str(bad)], "bad.jsonl:1"),
                      ([str(empty)], "empty run"), ([base, str(tmp_path / "missing")], "no such path")):
        assert main(["report", *args, "-o", str(out)]) == 2
        assert msg in capsys.readouterr().err
        assert not out.exists()
        assert not out.parent.exists() or os.listdir(out.parent) == []
    assert main(["report", base, cpu, "--allow-cross-device", "-o", str(out)]) == 0
    assert out.exists() and os.listdir(out.parent) == ["r.html"]


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def _render(out, tmp_path):
    """Screenshot `out` in headless Chromium (asserting a real PNG), then dump its DOM.
    Returns (the screenshot run's stderr, the rendered DOM)."""
    url = "file://" + str(out)
    common = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2000"]
    png = tmp_path / "shot.png"
    shot = subprocess.run(common + ["--enable-logging=stderr", "--v=0", f"--screenshot={png}", url],
                          capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert png.exists() and png.stat().st_size > 20_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return shot.stderr, dom.stdout


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install -y chromium); CI installs it")
def test_report_renders_in_chromium(pair, tmp_path):
    """Rendered in headless Chromium the report makes a non-trivial screenshot, logs no console errors, and
    its failing-case section shows the planted accuracy regression with its reproduce command."""
    out = tmp_path / "report.html"
    assert main(["report", *pair, "-o", str(out)]) == 0
    stderr, dom = _render(out, tmp_path)
    # The page has no scripts: any console message at all (Chromium logs them as ":CONSOLE") is an error.
    console = [ln for ln in stderr.splitlines() if "Uncaught" in ln or ":CONSOLE" in ln]
    assert console == [], console
    m = re.search(r'<section id="failing">(.*?)</section>', dom, re.S)
    assert m, "no failing-case section in the rendered DOM"
    failing = m.group(1)
    assert f'data-test="{REG_TEST}/y"' in failing
    assert "--hypothesis-seed=1234" in failing and "error ratio" in failing
    assert "FAIL: " in dom  # the summary's gate column flags the candidate


BASELINE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "reports", "baselines", "h200")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install -y chromium); CI installs it")
def test_cpu_run_against_committed_h200_baseline_in_chromium(tmp_path):
    """A report comparing a real CPU run (suites + bench, made here) with the committed H200 baseline needs
    --allow-cross-device (exit 2 without, no file left), then renders in headless Chromium with no console
    messages, naming both devices and the H200's ops in its tables."""
    assert os.path.isfile(os.path.join(BASELINE, "results.jsonl")), "the committed H200 baseline is missing"
    run = tmp_path / "cpu-run"
    rc = main(["run", "--device", "cpu", "--suites", "suites/reference/test_ref_edge_cases.py", "--workers", "1",
               "--bench-reps", "2", "--no-report", "--out", str(run)])
    assert rc == 0 and (run / "results.jsonl").is_file() and (run / "bench.jsonl").is_file()
    out = tmp_path / "vs-h200.html"
    assert main(["report", BASELINE, str(run), "-o", str(out)]) == 2 and not out.exists()
    assert main(["report", BASELINE, str(run), "-o", str(out), "--allow-cross-device"]) == 0
    stderr, dom = _render(out, tmp_path)
    console = [ln for ln in stderr.splitlines() if "Uncaught" in ln or ":CONSOLE" in ln]
    assert console == [], console
    assert "NVIDIA H200" in dom and "ssd_varlen" in dom and "selective_state_update" in dom
