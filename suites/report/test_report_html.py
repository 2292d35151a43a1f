"""`harness report`: tables, atomic writing, bad input, the first screen's answers (verdict, failing cases,
regressions grouped and collapsed, speed), charts, trend, skips, and the page rendered in a real headless
Chromium at a laptop's size."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from harness.cli import main
from harness.gate import GateConfig, gate_runs
from harness.report import render_html
from harness.report.build import accuracy_matrix, build_context, perf_tables, verdict
from harness.report.runs import load_run, load_runs
from harness.testing.samples import make_run
from harness.report.svg import impl_color

RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")

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
    speed_col = conv["table"]["columns"].index("× baseline")
    rows = {(r[0], r[2]): r[speed_col] for r in _texts(conv["table"])}
    assert rows[("triton", "T=1024 D=1024 K=4")] == "0.90×"
    assert rows[("triton", "T=256 D=1024 K=4")] == "1.00×"


def test_failing_cases_name_the_finding_they_belong_to(pair):
    """A failing case group carries the heading of the findings section that names its test and its
    implementation ("known" in the page); without one it is marked new. A section that names the test under
    another implementation is not it; with no findings to read (a package without the docs) there is no label."""
    from harness.findings import sections
    from harness.report.build import failing_cases
    runs = load_runs(list(pair))
    known = sections("## Ours: the scan at bf16\n`test_matches_reference` through triton fails\n")
    case = failing_cases(runs, known)[0]["cases"][0]
    assert case["test"].startswith(REG_TEST) and case["finding"] == "Ours: the scan at bf16"
    other = sections("## vLLM 0.33.0\n`test_matches_reference` fails with vllm\n")
    assert failing_cases(runs, other)[0]["cases"][0]["finding"] == ""
    assert failing_cases(runs, [])[0]["cases"][0]["finding"] is None  # no findings to read: no label
    html = render_html(runs)  # against the repository's findings: the planted case is written up nowhere
    assert "none written up" in html and "(new)" in html


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


def _gate(a, b):
    return gate_runs(a, b, GateConfig(allow_cross_device=True))


def test_verdict_follows_the_gate(tmp_path):
    """The headline is never green over a failure: gate regressions or failing comparisons make it FAIL,
    a candidate without comparisons says so (not "all pass"), and only a clean gate over passing
    comparisons is PASS."""
    base = load_run(make_run(str(tmp_path / "base.jsonl")))
    slow = load_run(make_run(str(tmp_path / "slow.jsonl"), slow={SLOW_KEY: 0.10}))
    bad = load_run(make_run(str(tmp_path / "bad.jsonl"), regress={REG}))
    same = load_run(make_run(str(tmp_path / "same.jsonl")))
    v = verdict([base, slow], _gate(base, slow), 0)
    assert v["cls"] == "fail" and "1 regression(s)" in v["text"] and "1 performance" in v["text"]
    v = verdict([base, bad], _gate(base, bad), 0)
    assert v["cls"] == "fail" and "2 of 16 comparisons fail" in v["text"]
    assert verdict([base, same], _gate(base, same), 0)["cls"] == "pass"
    assert verdict([base, same], _gate(base, same), 2)["cls"] == "fail"
    timings_only = tmp_path / "t.jsonl"
    with open(tmp_path / "base.jsonl") as f, open(timings_only, "w") as g:
        g.writelines(line for line in f if '"comparison"' not in line)
    v = verdict([load_run(str(timings_only))], None, 0)
    assert v["cls"] == "none" and "NO COMPARISONS" in v["text"] and "pass" not in v["text"].lower()
    html = render_html([base, slow])
    assert "all comparisons pass" not in html and 'class="verdict fail"' in html


def test_one_run_has_no_empty_columns_and_headers_name_no_run_ids(tmp_path):
    """One run: no speedup-against-baseline columns; a run folder named by its 22-character run id heads
    no column (runs are 'baseline'/'candidate' in tables, the ids only in the runs legend)."""
    one = load_runs([make_run(str(tmp_path / "20261130-130645-7e64cd.jsonl"))])
    for p in perf_tables(one):
        cols = p["table"]["columns"]
        assert not any("baseline" in c for c in cols), cols
        for row in p["table"]["rows"]:
            assert len(row) == len(cols)
    pair = load_runs([make_run(str(tmp_path / "20261129-133024-4244ca.jsonl")),
                      make_run(str(tmp_path / "20261130-130645-7e64cd.jsonl"), git_sha="b" * 40)])
    ctx = build_context(pair, "t")
    headers = [c for p in ctx["perf"] for c in p["table"]["columns"]] + ctx["accuracy"]["columns"] + \
        ctx["env"]["differ"]["columns"] + ctx["speed"]["columns"]
    assert headers and not [h for h in headers if RUN_ID.search(h)]
    assert "× baseline" in ctx["perf"][0]["table"]["columns"]
    assert "× best peer" in ctx["perf"][0]["table"]["columns"]  # the hand-made runs time a peer (mamba_ssm)


def test_regressions_are_grouped_by_kind_op_and_implementation(tmp_path):
    """Findings are grouped kind -> (op, implementation) with counts, largest first, each group a collapsed
    <details>; every case key appears whole (nothing cut mid-word)."""
    base = make_run(str(tmp_path / "base.jsonl"))
    cand = make_run(str(tmp_path / "cand.jsonl"), slow={SLOW_KEY: 0.10, ("selective_scan_varlen", "torch", 256): 0.2},
                    drop={("causal_conv1d_varlen", "torch")}, regress={REG})
    runs = load_runs([base, cand])
    ctx = build_context(runs, "t")
    regs = ctx["regressions"]
    kinds = {k["kind"]: k for k in regs["kinds"]}
    assert set(kinds) == {"missing", "performance", "accuracy"}
    assert [k["n"] for k in regs["kinds"]] == sorted((k["n"] for k in regs["kinds"]), reverse=True)
    perf = {(g["op"], g["impl"]): g["n"] for g in kinds["performance"]["groups"]}
    assert perf == {("causal_conv1d_varlen", "triton"): 1, ("selective_scan_varlen", "torch"): 1}
    assert {(g["op"], g["impl"]) for g in kinds["missing"]["groups"]} == {("causal_conv1d_varlen", "torch")}
    assert {(g["op"], g["impl"]) for g in kinds["accuracy"]["groups"]} == {REG[:2]}
    html = render_html(runs)
    sec = re.search(r'<section id="regressions">(.*?)</section>', html, re.S).group(1)
    assert "<details" in sec and "<details open" not in sec and " open>" not in sec
    g = _gate(*runs)
    for f in g.regressions:
        assert f.key.replace("'", "&#39;") in sec or f.key in sec, f.key


def test_charts_keep_one_colour_per_implementation_and_show_spread(tmp_path):
    """Every chart draws an implementation in the same fixed colour (whatever else is in the chart), with
    p20-p80 spread bars."""
    runs = load_runs([make_run(str(tmp_path / "a.jsonl"), spread=0.2)])
    html = render_html(runs)
    series = re.findall(r'<g class="series" data-color="([^"]+)"><title>([^<]+)</title>', html)
    assert len(series) >= 8
    for color, name in series:
        assert color == impl_color(name.split(" ")[0]), (name, color)
    assert impl_color("triton") != impl_color("torch") != impl_color("mamba_ssm")
    assert html.count('class="spread"') >= 9 and "p20–p80" in html


def test_history_of_runs_has_a_trend(tmp_path):
    """Three runs or more (a nightly history) get a trend section: a chart per op over the runs and a
    table of the runs' comparison counts."""
    paths = [make_run(str(tmp_path / f"night{i}.jsonl"), slow={SLOW_KEY: 0.05 * i}) for i in range(4)]
    html = render_html(load_runs(paths))
    sec = re.search(r'<section id="trend">(.*?)</section>', html, re.S)
    assert sec and sec.group(1).count("<svg") == 2  # two ops timed with tokens (+ copy, not charted)
    assert all(f"night{i}" in sec.group(1) for i in range(4))


def test_skipped_tests_get_their_own_section(tmp_path):
    """A run folder's outcomes.jsonl (harness run writes it) lists skips: grouped by one-line reason with
    counts, the test ids inside a collapsed <details>; the passes a --generate-seconds cap cut short in a group
    of their own, not counted as skips."""
    d = tmp_path / "run"
    d.mkdir()
    make_run(str(d / "results.jsonl"))
    lines = [{"nodeid": f"suites/ops/test_x.py::test_a[{i}]", "when": "setup", "outcome": "skipped",
              "why": "Skipped: triton: no initial state for the CUDA scan\nFalsifying explicit example: ..."}
             for i in range(3)]
    lines.append({"nodeid": "suites/ops/test_y.py::test_b", "when": "call", "outcome": "skipped",
                  "why": "needs a CUDA device"})
    lines.append({"nodeid": "suites/ops/test_y.py::test_c", "when": "call", "outcome": "passed", "why": ""})
    lines.append({"nodeid": "suites/ops/test_y.py::test_d", "when": "call", "outcome": "passed",
                  "why": "--generate-seconds: 3 of 8 examples drawn in 241.2 s"})
    (d / "outcomes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    html = render_html(load_runs([str(d)]))
    sec = re.search(r'<section id="skipped">(.*?)</section>', html, re.S).group(1)
    assert re.search(r'<span class="count">3</span> triton: no initial state for the CUDA scan</summary>', sec)
    assert re.search(r'<span class="count">1</span> needs a CUDA device</summary>', sec)
    assert "Falsifying" not in sec and "test_c" not in sec
    # a pass on fewer examples than asked (a --generate-seconds cap) is listed apart, with its note
    assert re.search(r'<span class="count">1</span> passed on fewer examples than the profile draws', sec)
    assert "test_d (3 of 8 examples drawn in 241.2 s)" in sec
    assert '4 skipped tests' in html  # on the first screen


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


LAPTOP = (1366, 768)
# Injected into a copy of the page (the report itself has no scripts): measures the laid-out page.
PROBE = """<script>
window.addEventListener("load", () => {
  const box = s => { const e = document.querySelector(s); if (!e) return null;
                     const b = e.getBoundingClientRect(); return {top: b.top, bottom: b.bottom, right: b.right}; };
  const out = {vw: window.innerWidth, vh: window.innerHeight, scroll_w: document.documentElement.scrollWidth,
               summary: box("#summary"), verdict: box("#verdict"), regressions: box("#regressions"),
               open_groups: document.querySelectorAll("#regressions details[open]").length,
               groups: document.querySelectorAll("#regressions details").length,
               verdict_color: getComputedStyle(document.querySelector("#verdict")).backgroundColor};
  // then with every <details> opened: no table may run past the window's right-hand side
  document.querySelectorAll("details").forEach(d => { d.open = true; });
  out.wide_tables = [...document.querySelectorAll("table")].filter(t => t.getBoundingClientRect().right > window.innerWidth)
                       .map(t => t.closest("section").id + ": " + t.querySelector("th").textContent);
  out.scroll_w_open = document.documentElement.scrollWidth;
  const p = document.createElement("pre"); p.id = "probe"; p.textContent = JSON.stringify(out);
  document.body.appendChild(p);
});
</script>"""


def _first_screen(out, tmp_path) -> dict:
    """Lay the page out in headless Chromium at a laptop's window size: a screenshot of the first screen
    (a real PNG), and the probe's measurements of the page."""
    common = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              f"--user-data-dir={tmp_path / 'profile-laptop'}", f"--window-size={LAPTOP[0]},{LAPTOP[1]}"]
    png = tmp_path / "first-screen.png"
    shot = subprocess.run(common + [f"--screenshot={png}", "file://" + str(out)], capture_output=True, text=True,
                          timeout=120)
    assert shot.returncode == 0 and png.stat().st_size > 10_000, shot.stderr[-2000:]
    probed = tmp_path / "probed.html"
    probed.write_text(out.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = subprocess.run(common + ["--dump-dom", "file://" + str(probed)], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert m, "the probe did not run"
    return json.loads(m.group(1).replace("&quot;", '"'))


def _assert_first_screen(m: dict) -> None:
    assert m["vw"] == LAPTOP[0] and m["vh"] <= LAPTOP[1]
    # the summary (verdict, failing cases, regressions by kind, speed) is all on the first screen
    assert m["summary"]["top"] >= 0 and m["summary"]["bottom"] <= m["vh"], m
    assert m["verdict"]["bottom"] <= m["vh"] / 3, m
    # nothing runs off the right-hand side
    assert m["scroll_w"] <= m["vw"] and m["scroll_w_open"] <= m["vw"] and m["wide_tables"] == [], m
    assert m["open_groups"] == 0, m


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install -y chromium); CI installs it")
def test_first_screen_at_laptop_size_in_chromium(pair, tmp_path):
    """At 1366x768 the first screen holds the whole summary with a red verdict (the candidate has an
    accuracy regression and a slowdown), the regression groups start collapsed, no table overflows."""
    out = tmp_path / "report.html"
    assert main(["report", *pair, "-o", str(out)]) == 0
    m = _first_screen(out, tmp_path)
    _assert_first_screen(m)
    assert m["groups"] >= 3 and m["verdict_color"] == "rgb(253, 226, 226)"


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
    messages, naming both devices and the H200's ops in its tables. Its thousands of regressions (the H200's cases
    the CPU run lacks) stay behind a few collapsed groups: at 1366x768 the first screen is the summary."""
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
    m = _first_screen(out, tmp_path)
    _assert_first_screen(m)
    assert m["regressions"]["bottom"] - m["regressions"]["top"] < 300, m  # collapsed, not thousands of rows
    assert m["verdict_color"] == "rgb(253, 226, 226)"  # red: the gate fails
    assert re.search(r"FAIL: \d{4,} regression\(s\) against the baseline", dom)


LONG_KERNEL = "void causal_conv1d_fwd_kernel<Causal_conv1d_fwd_kernel_traits<128, 4, true, true, __nv_bf..."


def _with_launches(src: str, dst, launches: dict) -> str:
    """Copy the run `src` to `dst`, giving the timing records of (op, impl, T) in `launches` its fields
    (`kernels`, `kernels_source`, `kernels_error`), as `harness bench --kernels` writes them."""
    with open(src) as f:
        recs = [json.loads(line) for line in f]
    with open(dst, "w") as f:
        for r in recs:
            if r["kind"] == "timing":
                r.update(launches.get((r["op"], r["impl"], r.get("tokens")), {}))
            f.write(json.dumps(r) + "\n")
    return str(dst)


def _launch_runs(tmp_path):
    conv = ("causal_conv1d_varlen", "triton", 1024)
    base = _with_launches(make_run(str(tmp_path / "b.jsonl")), tmp_path / "base.jsonl", {
        conv: {"kernels": [{"name": LONG_KERNEL, "us": 10.0, "calls": 1.0}, {"name": "pack", "us": 2.0, "calls": 1.0}],
               "kernels_source": "cuda"}})
    cand = _with_launches(make_run(str(tmp_path / "c.jsonl"), git_sha="b" * 40), tmp_path / "cand.jsonl", {
        conv: {"kernels": [{"name": LONG_KERNEL, "us": 12.5, "calls": 1.0},
                           {"name": "unpack", "us": 3.0, "calls": 2.0}],
               "kernels_source": "cuda"},
        ("causal_conv1d_varlen", "torch", 256): {"kernels_error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}})
    return base, cand


def test_launch_profiles_are_listed_per_case(tmp_path):
    """Records carrying `kernels` (`harness bench --kernels`) get a collapsed list per case under their op's
    table: one row per name (the candidate's order, then the baseline's other names), the time and calls per
    call of each run; a case whose profile failed says why; ops without profiles get no list; the gate
    ignores the fields."""
    base, cand = _launch_runs(tmp_path)
    runs = load_runs([base, cand])
    perf = {p["op"]: p for p in build_context(runs, "t")["perf"]}
    assert perf["selective_scan_varlen"]["launches"] == [] and perf["copy"]["launches"] == []
    lp = perf["causal_conv1d_varlen"]["launches"]
    assert [x["case"] for x in lp] == ["torch · bfloat16 · T=256 D=1024 K=4",
                                       "triton · bfloat16 · T=1024 D=1024 K=4"]
    err, conv = lp
    assert err["error"] and "no profile (RuntimeError: CUPTI_ERROR_NOT_INITIALIZED)" in err["text"]
    assert conv["table"]["columns"] == ["name", "µs baseline", "calls baseline", "µs candidate", "calls candidate"]
    assert _texts(conv["table"]) == [[LONG_KERNEL, "10", "1", "12.5", "1"], ["unpack", "—", "—", "3", "2"],
                                     ["pack", "2", "1", "—", "—"]]
    assert conv["text"].startswith("baseline: 12 µs per call over 2 name(s)") and "candidate: 15.5 µs" in conv["text"]
    assert "CUDA: device time" in perf["causal_conv1d_varlen"]["launch_sources"]
    one = {p["op"]: p for p in perf_tables(load_runs([cand]))}["causal_conv1d_varlen"]["launches"][1]
    assert one["table"]["columns"] == ["name", "µs per call", "calls per call"]
    html = render_html(runs)
    sec = re.search(r'<section id="performance">(.*?)</section>', html, re.S).group(1)
    assert sec.count('<details class="launch">') == 2 and " open" not in sec and "unpack" in sec
    plain = load_run(make_run(str(tmp_path / "plain.jsonl")))
    assert _gate(plain, runs[1]).regressions == [] and _gate(runs[1], plain).regressions == []


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install -y chromium); CI installs it")
def test_launch_lists_fit_a_laptop_screen_in_chromium(tmp_path):
    """With every list opened, launch tables with 80-character kernel names stay within a laptop's window."""
    base, cand = _launch_runs(tmp_path)
    out = tmp_path / "report.html"
    assert main(["report", base, cand, "-o", str(out)]) == 0
    m = _first_screen(out, tmp_path)
    assert m["wide_tables"] == [] and m["scroll_w_open"] <= m["vw"], m


def test_perf_table_shows_host_overhead_and_launch_time(tmp_path):
    """Each eager row carries its host overhead (eager - graph p50) and, in brackets, the launch time (the
    host's time to issue one call; after a slash, one at a new token count where measured), in µs; the
    CUDA-graph row and a record with neither show a dash."""
    from harness.records import RecordWriter
    path = str(tmp_path / "run.jsonl")
    w = RecordWriter(path, run_id="r")
    w.write("env", env={"device": "cuda", "device_name": "NVIDIA H200", "git_sha": "a" * 40})
    base = dict(op="causal_conv1d_update", impl="triton", device="cuda:0", dtype="bfloat16", tokens=64,
                tok_s=6.4e6, ms_p20=0.01, ms_p50=0.01, ms_p80=0.01, peer=False)
    w.write("timing", bench="u/triton", shape={"B": 64}, cuda_graph=False, host_ms=0.012, launch_ms=0.065, **base)
    w.write("timing", bench="u/triton", shape={"B": 64}, cuda_graph=True, host_ms=0.012, launch_ms=0.065, **base)
    w.write("timing", bench="u/triton", shape={"B": 256}, cuda_graph=False, **base)
    w.write("timing", bench="u/triton", shape={"B": 512}, cuda_graph=False, host_ms=0.012, launch_ms=0.065,
            launch_new_ms=0.21, **base)
    (table,) = [p["table"] for p in perf_tables(load_runs([path]))]
    col = table["columns"].index("host µs (launch)")
    texts = {(r[2]["text"], r[0]["text"]): r[col]["text"] for r in table["rows"]}
    assert texts == {("B=64", "triton"): "12.0 (65.0)", ("B=64", "triton [graph]"): "—",
                     ("B=256", "triton"): "—", ("B=512", "triton"): "12.0 (65.0 / 210.0)"}, texts
