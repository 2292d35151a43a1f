"""Result records: JSONL, one JSON object per line, schema-versioned.

Kinds of record (field `kind`):
- `env`: written once per process that writes to a file: environment (git sha, python/torch/triton
  versions, device name), run id, hypothesis profile and seed.
- `comparison`: one per comparison of an implementation with the reference (see harness.testing.checks).
- `timing`: one per benchmark case (see harness.bench).

Crash safety (a writer killed at any byte loses no completed record)
  * A writer appends each record as ONE ``os.write`` of the whole line (newline included) on a file
    opened with O_APPEND, under an exclusive ``flock``, so concurrent writers (pytest-xdist workers)
    never interleave.
  * A writer killed inside that write can leave a torn line: a final line without its newline. The
    next writer, holding the lock, finds it (the file's last byte is not a newline) and cuts the file
    back to the end of its last whole line before appending, with a :class:`TornRecordWarning` saying
    how many bytes of the unfinished record it dropped (a final line that is whole JSON lacking only
    its newline is kept and ended instead; a final line that is neither is not ours, and the writer
    refuses to touch the file). So a record is never glued onto a torn line, and a torn line is only
    ever the file's last line.
  * A reader skips a torn final line (no trailing newline, a record's beginning but not a whole JSON
    text) with a :class:`TornRecordWarning` naming file, line and size; every complete record before
    it is read. Anything else unreadable, on any line, is a :class:`ResultsFileError` naming file and
    line.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
import uuid
import warnings
from typing import Callable, Iterable

SCHEMA_VERSION = 1
KINDS = ("env", "comparison", "timing")
_SCAN = 1 << 16  # bytes read per step when looking back for the last newline


class TornRecordWarning(UserWarning):
    """A results file ended in a torn (partly written) record, left by a writer killed mid-append."""


class ResultsFileError(ValueError):
    """A results file that cannot be read as our records (or pytest-benchmark JSON)."""


def write_json(path, obj, indent: int = 1) -> None:
    """`obj` as one JSON document at `path`, whole or not at all: written to a temporary file in the same folder
    (made if missing), then renamed over `path`, so a process killed while writing leaves the old file."""
    import tempfile
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".json.tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, default=str)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


def _end_of_last_line(fd: int, size: int) -> int:
    """Offset just past the last newline of the first `size` bytes of `fd` (0 if there is none)."""
    end = size
    while end > 0:
        start = max(0, end - _SCAN)
        chunk = os.pread(fd, end - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


_RECORD_START = b'{"schema": '  # every line RecordWriter writes begins so (the schema key comes first)


def _whole_json(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
        return True
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def _torn_record(raw: bytes) -> bool:
    """Whether a final line (without its newline) is a record cut short: the beginning of a line as
    RecordWriter writes it, but not a whole JSON text."""
    head = raw[:len(_RECORD_START)]
    return head == _RECORD_START[:len(head)] and not _whole_json(raw)


def _repair_tail(fd: int, path: str) -> bytes:
    """Under the writer's lock: make the file end in a whole line before a record is appended.

    A final line without its newline that is a record cut short (its writer was killed mid-write) is
    cut off, with a TornRecordWarning; a whole JSON text missing only its newline is kept and ended.
    Anything else is not ours to cut or extend: ResultsFileError, and the file is left alone.
    Returns the bytes to put before the next record."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return b""
    keep = _end_of_last_line(fd, size)
    tail = os.pread(fd, size - keep, keep)
    if _whole_json(tail):
        return b"\n"
    if not _torn_record(tail):
        raise ResultsFileError(f"{path}: expected a results file ending in a whole line, got a final line of "
                               f"{size - keep} bytes that is neither JSON nor the start of a record; "
                               f"not appending to it")
    os.ftruncate(fd, keep)
    warnings.warn(TornRecordWarning(
        f"{path}: dropped a torn final line of {size - keep} bytes at offset {keep} "
        f"(a record whose writer was killed before finishing it)"), stacklevel=3)
    return b""


class RecordWriter:
    """Appends records to one JSONL file, safe across processes and against a kill at any byte."""

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
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                line = _repair_tail(fd, self.path) + line
                n = os.write(fd, line)
                if n != len(line):
                    # A short write (disk full, a signal): cut it off again, so the file still ends
                    # in a whole line, and report the failure.
                    size = os.fstat(fd).st_size
                    os.ftruncate(fd, size - n)
                    raise OSError(f"{self.path}: wrote {n} of {len(line)} bytes of a record; dropped them")
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return rec


def _parse(path: str, lineno: int, raw: bytes, is_tail: bool) -> dict | None:
    """The record on one line; None for a torn final line (`is_tail` and a record cut short)."""
    try:
        text = raw.decode("utf-8")
        rec = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        if is_tail and _torn_record(raw):
            return None
        raise ResultsFileError(f"{path}:{lineno}: expected a JSON record per line, got {e}") from None
    if not isinstance(rec, dict) or "schema" not in rec or "kind" not in rec:
        raise ResultsFileError(f"{path}:{lineno}: expected a record with 'schema' and 'kind', got {text[:80]!r}")
    if rec["schema"] != SCHEMA_VERSION:
        raise ResultsFileError(f"{path}:{lineno}: expected schema {SCHEMA_VERSION}, got schema {rec['schema']!r}")
    return rec


def read_numbered_records(path: str, on_torn: Callable[[str], None] | None = None) -> list[tuple[int, dict]]:
    """``(line number, record)`` for every record of a JSONL results file; a clear error for anything
    unreadable.

    A torn final line (no trailing newline, the beginning of a record but not a whole JSON text: a
    writer killed mid-append, or one still writing) is skipped; its message goes to `on_torn` if given, else it is issued as a
    :class:`TornRecordWarning`. An unreadable line anywhere else is a :class:`ResultsFileError` naming
    file and line.
    """
    if not os.path.isfile(path):
        raise ResultsFileError(f"{path}: expected a results file, got no such file")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    tail = lines.pop()  # b"" when the file ends in a newline, else its last line, which has none
    numbered = [(i, raw, False) for i, raw in enumerate(lines, 1)] + [(len(lines) + 1, tail, True)]
    out = []
    for lineno, raw, is_tail in numbered:
        if not raw.strip():
            continue
        rec = _parse(path, lineno, raw, is_tail)
        if rec is None:
            msg = (f"{path}:{lineno}: skipped a torn final line ({len(raw)} bytes without a newline, not a "
                   f"whole record): its writer was killed (or is still writing it)")
            if on_torn is not None:
                on_torn(msg)
            else:
                warnings.warn(TornRecordWarning(msg), stacklevel=3)
            continue
        out.append((lineno, rec))
    return out


def read_records(path: str, kinds: Iterable[str] | None = None,
                 on_torn: Callable[[str], None] | None = None) -> list[dict]:
    """Every record of a JSONL results file (of the given `kinds`, default all), in file order; see
    :func:`read_numbered_records` for torn final lines and errors."""
    kinds = set(kinds) if kinds else None
    return [rec for _, rec in read_numbered_records(path, on_torn)
            if kinds is None or rec["kind"] in kinds]
