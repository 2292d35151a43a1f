"""The written-up findings (docs/findings.md) a failing test belongs to.

A section of the findings (a "## " heading and what follows it) explains a failure when it names the test — its
function or its suite file — and the implementation that failed (a peer by the words the findings call it:
"vLLM", "SGLang", "mamba_ssm", "causal-conv1d", "fla"; any other implementation by its registered name).
`harness report` labels each failing case with the section it belongs to, so a known failure of a peer reads
apart from a new one; the repository's tests ask every failure in a committed baseline for its section.
"""
from __future__ import annotations

import os
import re

# the implementation ids of the peers' adapters (and their native rows) -> the words a finding names the peer by
PEER_WORDS = {"vllm": ("vllm",), "sglang": ("sglang",), "mamba_ssm": ("mamba_ssm",),
              "mamba_ssm_cuda": ("mamba_ssm",), "causal_conv1d": ("causal-conv1d", "causal_conv1d"),
              "fla": ("fla",)}
FINDINGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "findings.md")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, lower-case text) of each "## " section of the findings' markdown."""
    out = []
    for part in re.split(r"\n(?=## )", text):
        if part.startswith("## "):
            out.append((part.splitlines()[0][3:].strip(), part.lower()))
    return out


def load(path: str | None = None) -> list[tuple[str, str]]:
    """The sections of the findings file (default: the repository's docs/findings.md); none where it is absent
    (an installed package without the repository's docs)."""
    path = path or FINDINGS
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return sections(f.read())


def impl_of(nodeid: str) -> str:
    """The implementation a test id names: the first part of its parameters (`test_x[vllm-float32]` -> vllm)."""
    return re.split(r"[-\]]", nodeid.rpartition("::")[2].partition("[")[2])[0]


def section_of(nodeid: str, impl: str | None, found: list[tuple[str, str]]) -> str | None:
    """The heading of the first section that names the test (function or suite file) and `impl` (default: the
    one the id names); None when none does."""
    name = nodeid.split("::")[-1]
    names = (name.split("[")[0].lower(), os.path.basename(nodeid.split("::")[0]).lower())
    impl = (impl or impl_of(nodeid)).lower().split("+")[0]  # "fla+torch": the engine completed by torch ops
    words = PEER_WORDS.get(impl, (impl,))
    for heading, text in found:
        if any(n and n in text for n in names) and any(w in text for w in words):
            return heading
    return None


def unwritten_failures(outcome_lines, found: list[tuple[str, str]]) -> list[str]:
    """The node ids whose latest verdict (passed, skipped or failed) in --outcomes lines is a failure no section
    belongs to (`section_of`). Lines that hold only an exception group's frame (an older plugin's, run again by
    every resume) are not verdicts."""
    last: dict = {}
    for rec in outcome_lines:
        if rec.get("outcome") in ("passed", "skipped", "failed") and \
                not (rec.get("outcome") == "failed" and (rec.get("why") or "").strip().startswith("+--")):
            last[rec["nodeid"]] = rec
    return [n for n, rec in last.items() if rec["outcome"] == "failed" and section_of(n, None, found) is None]
