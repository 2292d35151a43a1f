"""Results records survive a writer killed at any byte: no completed record is lost, a torn line is only
ever the last one, readers skip it with a warning, and the next writer never glues a record onto it."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from harness.records import (RecordWriter, ResultsFileError, TornRecordWarning, _whole_json, read_records,
                             write_json)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A writer that appends records (of varying size, up to 64 KB) and reports each finished write() on stdout.
_CHILD = r"""
import os, random, sys
from harness.records import RecordWriter
path, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(k)
w = RecordWriter(path, run_id=f"w{k}")
for i in range(n):
    w.write("timing", writer=k, seq=i, pad="x" * rng.randrange(1 << 10, 1 << 16))
    os.write(1, b"%d\n" % i)
"""


def _torn_reads(path):
    msgs = []
    recs = read_records(path, on_torn=msgs.append)
    return recs, msgs


def test_sigkill_during_appends_loses_no_completed_record(tmp_path):
    """30 writer processes, each SIGKILLed at a random moment while appending: every record whose write()
    returned is in the file exactly once, the file always reads (a torn line only as its last line), and
    once a later writer has appended, nothing is torn."""
    path = str(tmp_path / "r.jsonl")
    rng = random.Random(0)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done: set[tuple[int, int]] = set()
    torn_seen = 0
    for k in range(30):
        p = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(k), "40"], stdout=subprocess.PIPE,
                             env=env, cwd=REPO)
        first = p.stdout.readline()  # the writer is running; kill it somewhere in its next appends
        time.sleep(rng.uniform(0, 0.003))
        p.send_signal(signal.SIGKILL)
        rest = p.stdout.read()
        p.wait()
        p.stdout.close()
        done |= {(k, int(s)) for s in (first + rest).split()}
        with open(path, "rb") as f:
            tail = f.read().rsplit(b"\n", 1)[-1]
        # torn: a final line without its newline that is not whole JSON (a write cut just before its newline
        # leaves a whole record, which readers keep and writers end: harness.records' own test of it)
        tail_torn = bool(tail) and not _whole_json(tail)
        recs, msgs = _torn_reads(path)  # never a ResultsFileError: only the last line may be torn
        torn_seen += tail_torn
        assert len(msgs) == (1 if tail_torn else 0), msgs
        got = [(r["writer"], r["seq"]) for r in recs]
        assert len(got) == len(set(got)), "a record appears twice"
        assert done <= set(got), f"completed records lost: {sorted(done - set(got))[:5]}"
    # a final writer repairs a torn tail before appending; then the whole file is clean
    RecordWriter(path, run_id="last").write("env", env={"device": "cpu"})
    recs, msgs = _torn_reads(path)
    assert msgs == []
    got = {(r["writer"], r["seq"]) for r in recs if r["kind"] == "timing"}
    assert done <= got and recs[-1]["run_id"] == "last"
    print(f"{torn_seen} of 30 kills left a torn tail; {len(done)} completed records")


def _record_line(tmp_path, **fields) -> bytes:
    scratch = str(tmp_path / "scratch.jsonl")
    RecordWriter(scratch, run_id="x").write("comparison", **fields)
    with open(scratch, "rb") as f:
        line = f.read()
    os.unlink(scratch)
    return line


def test_kill_at_every_byte_of_a_record(tmp_path):
    """A file cut after ANY byte of its last record reads as the complete records before it (a warning
    for the torn line, none when only the newline is missing); the next writer appends a clean line."""
    path = str(tmp_path / "r.jsonl")
    head = b"".join(_record_line(tmp_path, test_id=f"ok{i}") for i in range(2))
    last = _record_line(tmp_path, test_id="torn", payload="p" * 40)
    for cut in range(len(last)):
        with open(path, "wb") as f:
            f.write(head + last[:cut])
        whole = cut == len(last) - 1  # only the newline missing: the record itself is complete
        recs, msgs = _torn_reads(path)
        assert [r["test_id"] for r in recs] == ["ok0", "ok1"] + (["torn"] if whole else [])
        assert len(msgs) == (0 if cut == 0 or whole else 1), (cut, msgs)
        if msgs:
            assert "r.jsonl:3" in msgs[0] and "torn" in msgs[0]
        w = RecordWriter(path, run_id="next")
        if cut == 0 or whole:
            w.write("comparison", test_id="after")
        else:
            with pytest.warns(TornRecordWarning, match=f"dropped a torn final line of {cut} bytes"):
                w.write("comparison", test_id="after")
        recs, msgs = _torn_reads(path)
        assert msgs == []
        assert [r["test_id"] for r in recs] == ["ok0", "ok1"] + (["torn"] if whole else []) + ["after"]
        with open(path, "rb") as f:
            assert f.read().endswith(b"\n")


def test_reader_default_warns_and_torn_middle_line_is_an_error(tmp_path):
    """Without `on_torn` a torn tail is a TornRecordWarning; a torn line before the last line (or a
    line cut inside a multi-byte character there) is a ResultsFileError naming file and line."""
    path = tmp_path / "r.jsonl"
    good = _record_line(tmp_path, test_id="a")
    path.write_bytes(good + good[:30])
    with pytest.warns(TornRecordWarning, match=r"r\.jsonl:2"):
        assert len(read_records(str(path))) == 1
    path.write_bytes(good + good[:30] + b"\n" + good)
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:2: expected a JSON record"):
        read_records(str(path))
    path.write_bytes(good + '{"schema": 1, "kind": "env", "x": "é'.encode()[:-1])
    with pytest.warns(TornRecordWarning, match=r"r\.jsonl:2"):
        assert len(read_records(str(path))) == 1
    path.write_bytes(good + '{"schema": 1, "kind": "env", "x": "é'.encode()[:-1] + b"\n" + good)
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:2"):
        read_records(str(path))
    # a whole final JSON text that is not a record is an error, not a torn line
    path.write_bytes(good + b'{"hello": 1}')
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:2: expected a record with 'schema'"):
        read_records(str(path))


def test_each_record_is_one_write_of_the_whole_line(tmp_path, monkeypatch):
    """The writer hands the kernel the whole line (newline included) in one os.write."""
    calls = []
    real = os.write

    def spy(fd, data):
        calls.append(bytes(data))
        return real(fd, data)

    monkeypatch.setattr(os, "write", spy)
    path = str(tmp_path / "r.jsonl")
    rec = RecordWriter(path, run_id="r").write("timing", pad="y" * 100_000)
    assert len(calls) == 1 and calls[0].endswith(b"\n") and json.loads(calls[0])["pad"] == rec["pad"]


def test_writer_leaves_a_file_that_is_not_ours_alone(tmp_path):
    """A final line that is neither JSON nor the start of a record (not a torn record) is not cut: the
    writer refuses with a ResultsFileError and the file is unchanged; the reader calls it an error too."""
    p = tmp_path / "notes.jsonl"
    p.write_bytes(b"first line\nsomething else")
    with pytest.raises(ResultsFileError, match=r"notes\.jsonl: expected a results file ending in a whole line"):
        RecordWriter(str(p)).write("env")
    assert p.read_bytes() == b"first line\nsomething else"
    with pytest.raises(ResultsFileError, match=r"notes\.jsonl:1"):
        read_records(str(p))
    p.write_bytes(_record_line(tmp_path, test_id="a") + b"partial, not a record")
    with pytest.raises(ResultsFileError, match=r"notes\.jsonl:2: expected a JSON record"):
        read_records(str(p))


def test_short_write_is_cut_off_and_reported(tmp_path, monkeypatch):
    """If the kernel takes only part of a line (disk full), the part is cut off again and the write fails:
    the file still ends in a whole line."""
    path = str(tmp_path / "r.jsonl")
    w = RecordWriter(path, run_id="r")
    w.write("env")
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data)[: len(data) // 2]))
    with pytest.raises(OSError, match=r"wrote \d+ of \d+ bytes of a record"):
        w.write("timing", pad="z" * 1000)
    monkeypatch.setattr(os, "write", real)
    assert [r["kind"] for r in read_records(path)] == ["env"]
    with open(path, "rb") as f:
        assert f.read().endswith(b"\n")


def test_write_json_is_whole_or_not_at_all(tmp_path):
    """`write_json` replaces a document whole; one that fails while being written leaves the old file as it was
    and no temporary file beside it."""
    path = tmp_path / "d" / "s.json"
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot be written")

    with pytest.raises(RuntimeError, match="cannot be written"):
        write_json(path, {"a": 2, "b": Unprintable()})
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(path.parent) == ["s.json"]
