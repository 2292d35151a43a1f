"""The repository speaks of the product: no file is named after a run, no text narrates how it was made,
and README.md points only to paths that exist.

Checks every file git tracks (a tree that is not a git checkout skips, saying so).
"""
import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.relpath(os.path.abspath(__file__), ROOT)

# A path component (or file name part) naming a run: -s2 / _s3 / s2/, call4 / call-5, session...
RUN_NAME = re.compile(r"(?i)(?:^|[-_./])(?:s\d+|call[-_]?\d+|sessions?\w*)(?:[-_./]|$)")

# (pattern, allowed) pairs: a line matching the pattern fails unless it also matches `allowed`.
NARRATION = [
    (re.compile(r"(?i)\bsessions?\b"), re.compile(r"""scope\s*=\s*["']session["']""")),  # pytest fixture scope
    (re.compile(r"(?i)\bcall[ _-]?\d+\b"), None),
    (re.compile(r"[-_/]s[23](?![A-Za-z0-9])"), None),
    (re.compile(r"(?i)\bno device time\b"), None),
    (re.compile(r"BUG_CLASSES|\bANCHORS\b"), None),
    (re.compile(r"(?i)\bas they land\b"), None),
    (re.compile(r"(?i)\bhelper(?:'s)?\b"), None),   # "helpers" (helper functions) is a code word and allowed
    (re.compile(r"(?i)\bissue #?\d+"), None),
    (re.compile(r"/work/|\.\./shared/"), None),
    (re.compile(r"(?i)\b(?:GPU|device) call\b"), None),
]

README_PATH = re.compile(r"(?<![\w./-])((?:reference|harness|suites|scripts|reports|docs|\.github|\.ci)/[\w./<>*+-]*)")
README_MODULE = re.compile(r"python3? -m ((?:harness|reference)(?:\.\w+)+)")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout (git ls-files: {e}); the repository checks need the tracked file list")
    return [p for p in out.decode().split("\0") if p]


def text_lines(path: str):
    try:
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
    except OSError:
        return []
    if b"\0" in data:
        return []
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return []


def narration_hits(path: str, lines) -> list[str]:
    hits = []
    for n, line in enumerate(lines, 1):
        for pat, allowed in NARRATION:
            m = pat.search(line)
            if m and not (allowed and allowed.search(line)):
                hits.append(f"{path}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return hits


def test_no_file_is_named_after_a_run():
    """No tracked file under scripts/ or reports/ carries a run or session name in its path."""
    bad = [p for p in tracked_files() if p.startswith(("scripts/", "reports/"))
           and RUN_NAME.search(p.split("/", 1)[1])]
    assert bad == [], f"files named after a run or session: {bad}"


def test_reports_has_no_gpu_log_folder():
    """Run logs are not committed: reports/gpu/ does not exist and nothing under it is tracked."""
    assert not os.path.exists(os.path.join(ROOT, "reports", "gpu")), "reports/gpu/ exists"
    assert [p for p in tracked_files() if p.startswith("reports/gpu/")] == []


def test_no_text_narrates_how_it_was_made():
    """No tracked text file (code, docs, records, workflows) mentions work sessions, calls, helpers,
    issue numbers or files outside the repository."""
    hits = []
    for p in tracked_files():
        if p != THIS:  # this file states the patterns
            hits += narration_hits(p, text_lines(p))
    assert hits == [], "narration in tracked files:\n" + "\n".join(hits[:60])


def test_narration_check_bites():
    """The narration patterns catch what they are for and let the allowed words through."""
    bad = ["GPU script for session 3", "see reports/gpu/s2/call4-log.txt", "(no device time left)",
           "as in ANCHORS.md", "BUG_CLASSES 1-5", "run, impls (and, as they land: bench)", "the helper's sweep",
           "issue 4: must not be slower", "see /work/shared/DESIGN.md", "results-s2.jsonl"]
    good = ['@pytest.fixture(scope="session")', "Helpers the op suites share", "one call per sequence",
            "def _combine(a1, s1, a2, s2):", "ss0, ss1, ss2", "ANCHOR_ROWS = [", "bench_ssd.py"]
    assert all(narration_hits("x", [s]) for s in bad), [s for s in bad if not narration_hits("x", [s])]
    assert not any(narration_hits("x", [s]) for s in good), [s for s in good if narration_hits("x", [s])]
    assert RUN_NAME.search("gpu_s2_call1.sh") and RUN_NAME.search("gpu/h200-session-log.txt")
    assert not RUN_NAME.search("gpu.sh") and not RUN_NAME.search("sweeps/scan4096.json")


def test_readme_points_only_to_existing_paths():
    """Every repository path README.md names (a `<placeholder>` part aside; a glob must match something)
    exists, and every `python -m` module it runs is a file of the repository."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    missing = []
    for raw in sorted(set(README_PATH.findall(text))):
        p = raw.rstrip(".,;:)`'\"")
        if "<" in p:
            continue
        if "*" in p:
            if not glob.glob(os.path.join(ROOT, p)):
                missing.append(p)
        elif not os.path.exists(os.path.join(ROOT, p)):
            missing.append(p)
    for mod in sorted(set(README_MODULE.findall(text))):
        base = os.path.join(ROOT, *mod.split("."))
        if not (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))):
            missing.append(f"python -m {mod}")
    assert missing == [], f"README.md names paths that do not exist: {missing}"


def test_every_failure_in_a_baseline_is_written_up():
    """Each test that fails in a committed GPU baseline (reports/baselines/*/outcomes*.jsonl, the latest verdict)
    is named in docs/findings.md by its test function, in a section that names its peer: a new failure in a
    peer's kernel lands with its write-up, and a failure of ours is a finding too."""
    import json

    from harness.findings import load, sections, unwritten_failures
    from harness.testing.resume import outcome_lines
    findings = load(os.path.join(ROOT, "docs", "findings.md"))
    assert findings, "docs/findings.md has no sections"
    paths = sorted(glob.glob(os.path.join(ROOT, "reports", "baselines", "*", "outcomes*.jsonl")))
    assert paths, "no baseline outcome files"
    bad = {os.path.relpath(p, ROOT): unwritten_failures(outcome_lines([p]), findings) for p in paths}
    bad = {p: ids for p, ids in bad.items() if ids}
    assert bad == {}, f"failures without a finding that names them:\n{json.dumps(bad, indent=1)[:4000]}"
    # the check bites: a failure the findings do not name, or name only under another peer
    fail = {"nodeid": "suites/ops/test_ops_brand_new.py::test_new_thing[vllm-float32]", "outcome": "failed",
            "why": "E   AssertionError"}
    assert unwritten_failures([fail], findings) == [fail["nodeid"]]
    assert unwritten_failures([fail], sections("## SGLang\n`test_new_thing`\n## vLLM\nother")) == [fail["nodeid"]]
    assert unwritten_failures([fail], sections("## vLLM 0.33.0: `test_new_thing` fails")) == []
    assert unwritten_failures([fail, {**fail, "outcome": "passed"}], []) == []
