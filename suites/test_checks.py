"""The checks and records themselves: NaN never passes, tolerances bite, records are whole lines."""
import json
import multiprocessing as mp
import os

import pytest
import torch

from harness.testing.checks import assert_bitwise_equal, compare, poison_, tolerance_for
from harness.records import RecordWriter, ResultsFileError, read_records


def test_nan_never_passes():
    """A NaN in the output fails even when the error ratio of the rest is tiny."""
    b = torch.ones(10, dtype=torch.float64)
    a = b.clone()
    a[3] = float("nan")
    c = compare("x", a, b, tolerance_for(torch.float32))
    assert not c.passed and "non-finite" in c.reason


def test_nan_reference_fails():
    """A comparison against a non-finite reference fails."""
    b = torch.ones(4, dtype=torch.float64)
    b[0] = float("inf")
    assert not compare("x", b.clone(), b, tolerance_for(torch.float32)).passed


def test_tolerance_bites_and_locates():
    """An error above the policy fails and names the worst index; a tiny one passes."""
    b = torch.linspace(-1, 1, 50, dtype=torch.float64).reshape(5, 10)
    a = b.clone()
    a[2, 7] += 0.5
    c = compare("y", a.float(), b, tolerance_for(torch.float32))
    assert not c.passed and c.worst_index == (2, 7)
    assert compare("y", (b + 1e-7).float(), b, tolerance_for(torch.float32)).passed


def test_shape_mismatch_fails():
    assert not compare("z", torch.zeros(3), torch.zeros(4, dtype=torch.float64), tolerance_for(torch.float32)).passed


def test_bitwise_equal_detects_one_bit():
    a = torch.randn(100)
    b = a.clone()
    b.view(torch.int32)[17] ^= 1
    assert_bitwise_equal("same", a, a.clone())
    with pytest.raises(AssertionError, match="first at"):
        assert_bitwise_equal("diff", b, a)


def test_poison():
    t = poison_(torch.zeros(3))
    assert bool(torch.isnan(t).all())


def _write_many(path, k):
    w = RecordWriter(path, run_id="r")
    for i in range(200):
        w.write("comparison", test_id=f"w{k}-{i}", payload="x" * (i * 37 % 5000))


def test_records_concurrent_appends_are_whole_lines(tmp_path):
    """Four processes appending 200 records each give 800 parseable lines, none lost or interleaved."""
    path = str(tmp_path / "r.jsonl")
    ps = [mp.get_context("fork").Process(target=_write_many, args=(path, k)) for k in range(4)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    recs = read_records(path)
    assert len(recs) == 800
    assert len({r["test_id"] for r in recs}) == 800


def test_read_records_rejects_garbage(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"schema": 1, "kind": "env"}\nnot json\n')
    with pytest.raises(ResultsFileError, match="bad.jsonl:2"):
        read_records(str(p))
    p.write_text(json.dumps({"schema": 99, "kind": "env"}) + "\n")
    with pytest.raises(ResultsFileError, match="schema"):
        read_records(str(p))
