"""Result records: JSONL, one JSON object per line, schema-versioned.

Kinds of record (field `kind`):
- `env`: written once per process that writes to a file: environment (git sha, python/torch/triton
  versions, device name), run id, hypothesis profile and seed.
- `comparison`: one per comparison of an implementation with the reference (see harness.checks).
- `timing`: one per benchmark case (see harness.bench).

Every line is written with a single `os.write` on a file opened with O_APPEND under an exclusive
`flock`, so concurrent writers (pytest-xdist workers) never interleave or lose lines, and a crash
never leaves a half-written line behind.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import time
import uuid
from typing import Iterable

SCHEMA_VERSION = 1
KINDS = ("env", "comparison", "timing")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # 'nan', 'inf' survive JSON as strings
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


class RecordWriter:
    """Appends records to one JSONL file, safe across processes."""

    def __init__(self, path: str, run_id: str | None = None):
        self.path = os.path.abspath(path)
        self.run_id = run_id or new_run_id()
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)

    def write(self, kind: str, **fields) -> dict:
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        rec = {"schema": SCHEMA_VERSION, "kind": kind, "run_id": self.run_id, "time": time.time()}
        rec.update(fields)
        line = (json.dumps(_clean(rec), sort_keys=False, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                view = memoryview(line)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return rec


class ResultsFileError(ValueError):
    """A results file that cannot be read as our records (or pytest-benchmark JSON)."""


def read_records(path: str, kinds: Iterable[str] | None = None) -> list[dict]:
    """Read every record of a JSONL results file; a clear error for anything unreadable."""
    if not os.path.isfile(path):
        raise ResultsFileError(f"{path}: expected a results file, got no such file")
    out = []
    kinds = set(kinds) if kinds else None
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ResultsFileError(f"{path}:{lineno}: expected a JSON record per line, got {e}") from None
            if not isinstance(rec, dict) or "schema" not in rec or "kind" not in rec:
                raise ResultsFileError(f"{path}:{lineno}: expected a record with 'schema' and 'kind', got {line[:80]!r}")
            if rec["schema"] != SCHEMA_VERSION:
                raise ResultsFileError(
                    f"{path}:{lineno}: expected schema {SCHEMA_VERSION}, got schema {rec['schema']!r}")
            if kinds is None or rec["kind"] in kinds:
                out.append(rec)
    return out
