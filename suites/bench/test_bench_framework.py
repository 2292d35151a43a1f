"""The benchmark framework: byte counts, percentiles, timing, declarations, records, error handling."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.bench.bytes import op_bytes
from harness.bench.registry import BENCHMARKS, METRICS, OP_INPUTS, benchmarks_for, register_benchmark, register_metric
from harness.bench.runner import run_benchmarks
from harness.bench.timing import Budget, cpu_samples, percentile, rotation_count, summarize
from harness.cli import main
from harness.records import read_records

TIMING_FIELDS = ("bench", "op", "impl", "device", "dtype", "shape", "tokens", "ms_p20", "ms_p50", "ms_p80",
                 "tok_s", "bytes", "gb_s", "pct_copy_bw", "peer", "cuda_graph", "eager_ms_p50", "reps", "timer")
FAST = Budget(min_reps=3, min_time=0.0)

# (op, shape, ms, GB/s) of peers' kernels measured on the H200 (bf16, docs/targets.md) whose byte convention is "inputs read once,
# outputs written once" including per-token activations and the state slot read and written.
ANCHOR_ROWS = [
    ("causal_conv1d_varlen", dict(T=4096, D=10240, K=4, S=1), 0.048, 3514),
    ("causal_conv1d_varlen", dict(T=16384, D=10240, K=4, S=1), 0.173, 3879),
    ("causal_conv1d_update", dict(B=256, D=10240, K=4), 0.038, 1102),
    ("selective_scan_varlen", dict(T=1024, Dm=8192, N=16, G=1, S=1), 0.152, 444),
    ("ssd_varlen", dict(T=16384, H=128, P=64, G=8, N=128, S=1, chunk=256), 1.295, 677),
    ("selective_state_update", dict(layout="mamba2", B=64, H=128, P=64, N=128, G=8), 0.169, 1592),
    ("selective_state_update", dict(layout="mamba2", B=256, H=128, P=64, N=128, G=8), 0.656, 1636),
]


@pytest.mark.parametrize("op,shape,ms,gbs", ANCHOR_ROWS, ids=[f"{r[0]}-{i}" for i, r in enumerate(ANCHOR_ROWS)])
def test_byte_counts_match_anchors(op, shape, ms, gbs):
    """Our fewest-bytes count for a measured H200 shape, divided by its measured time, gives its GB/s
    within 5% (shape-only `meta` tensors, so nothing is allocated)."""
    import harness.bench.ops  # noqa: F401
    inputs = OP_INPUTS[op].make(shape, torch.bfloat16, "meta", None)
    got = op_bytes(op, inputs) / (ms * 1e-3) / 1e9
    assert got == pytest.approx(gbs, rel=0.05), f"{op} {shape}: {got:.0f} GB/s vs anchor {gbs}"


@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(xs, q):
    """Our percentile is numpy's linear-interpolation percentile for any sample and q."""
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-9)


def test_summarize_and_rotation():
    """p20 <= p50 <= p80; rotation makes the sets exceed twice the cache on the CPU (at most 2); one set on
    GPUs, whose timer flushes the L2 cache."""
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.ms_p20, s.ms_p50, s.ms_p80) == (pytest.approx(1.8), 3.0, pytest.approx(4.2))
    assert rotation_count(1 << 10, "cpu") == 2 and rotation_count(1 << 40, "cpu") == 1
    assert rotation_count(None, "cpu") == 2
    assert rotation_count(1 << 10, "cuda:0") == 1


def test_cpu_timer_measures_the_call():
    """A call that busy-waits 2 ms is timed at 2 ms (within scheduling noise), each input set used in turn,
    warm-up calls first, then as many samples as the budget asks."""
    used = []

    def make(i):
        def f():
            used.append(i)
            t = time.perf_counter()
            while time.perf_counter() - t < 2e-3:
                pass
        return f
    ms = cpu_samples([make(0), make(1)], Budget(min_reps=6, min_time=0.0, warmup=1))
    assert len(ms) == 6 and used == [0, 0, 1, 0, 1, 0, 1]
    assert 1.9 <= summarize(ms).ms_p50 <= 20.0
    with pytest.raises(ValueError, match="reps"):
        Budget(min_reps=0)


@pytest.fixture
def planted_backends():
    """A decorated backend that works, one that raises, and a custom metric; removed afterwards."""
    @register_benchmark(op="gated_rms_norm", impl="planted_ok")
    def planted_ok(inp):
        return lambda: inp["x"] * 2

    @register_benchmark(op="gated_rms_norm", impl="planted_broken")
    def planted_broken(inp):
        def call():
            raise RuntimeError("planted failure")
        return call

    @register_metric("planted_ms_x2")
    def planted_metric(case, ms, ctx):
        return 2 * ms
    yield
    BENCHMARKS.pop("gated_rms_norm/planted_ok")
    BENCHMARKS.pop("gated_rms_norm/planted_broken")
    METRICS.pop("planted_ms_x2")


def test_decorated_backend_joins_the_matrix(planted_backends, tmp_path):
    """One decorated function adds a backend: it is listed, timed, recorded with every timing field and any
    registered metric; the copy roofline comes first at 100%; a raising backend is recorded with its error."""
    benches, _ = benchmarks_for("cpu", ops=["gated_rms_norm"])
    ids = {b.id for b in benches}
    assert {"gated_rms_norm/planted_ok", "gated_rms_norm/planted_broken"} <= ids
    assert next(b for b in benches if b.impl == "planted_ok").peer  # not one of ours
    out = tmp_path / "bench.jsonl"
    recs = run_benchmarks("cpu", str(out), impls=["planted_ok", "planted_broken"], ops=["gated_rms_norm"],
                          budget=FAST, progress=False, log=lambda *a: None)
    on_disk = read_records(str(out))
    assert on_disk[0]["kind"] == "env" and on_disk[0]["env"]["device"] == "cpu" and "clocks" in on_disk[0]["env"]
    timings = [r for r in on_disk if r["kind"] == "timing"]
    assert len(timings) == len(recs) == 1 + 2 * 2  # copy + 2 backends x 2 shapes
    assert timings[0]["op"] == "copy" and timings[0]["pct_copy_bw"] == pytest.approx(100.0)
    ok = [r for r in timings if r["impl"] == "planted_ok"]
    for r in ok:
        assert all(k in r for k in TIMING_FIELDS)
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"] and r["reps"] >= 3 and r["cuda_graph"] is False
        assert r["eager_ms_p50"] == r["ms_p50"] and "graph_ms_p50" not in r and r["timer"] == "perf_counter"
        assert r["tok_s"] == pytest.approx(r["tokens"] / (r["ms_p50"] * 1e-3))
        assert r["gb_s"] == pytest.approx(r["bytes"] / (r["ms_p50"] * 1e-3) / 1e9)
        assert r["pct_copy_bw"] == pytest.approx(100 * r["gb_s"] / timings[0]["gb_s"])
        assert r["planted_ms_x2"] == pytest.approx(2 * r["ms_p50"])
        assert r["bytes"] == 3 * r["shape"]["T"] * r["shape"]["D"] * 4 + r["shape"]["D"] * 4
    broken = [r for r in timings if r["impl"] == "planted_broken"]
    assert all("planted failure" in r["error"] and r["ms_p50"] is None for r in broken)


def test_bench_cli_and_gate(planted_backends, tmp_path, capsys):
    """`harness bench` on the CPU writes a run the gate and the report read; a backend that raises makes the
    bench exit 1 and gates as missing against a run where it worked."""
    base = tmp_path / "base.jsonl"
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "planted_ok", "--reps", "2",
                 "--min-time", "0", "--no-progress", "--out", str(base)]) == 0
    assert "gated_rms_norm" in capsys.readouterr().out
    assert main(["gate", "--baseline", str(base), "--candidate", str(base)]) == 0
    cand = tmp_path / "cand.jsonl"
    BENCHMARKS["gated_rms_norm/planted_ok"].fn = BENCHMARKS["gated_rms_norm/planted_broken"].fn
    assert main(["bench", "--device", "cpu", "--op", "gated_rms_norm", "--impl", "planted_ok", "--reps", "2",
                 "--min-time", "0", "--no-progress", "--out", str(cand)]) == 1
    capsys.readouterr()
    assert main(["gate", "--baseline", str(base), "--candidate", str(cand)]) == 1
    assert "benchmark failed in the candidate" in capsys.readouterr().out
    assert main(["report", str(base), str(cand), "-o", str(tmp_path / "r.html")]) == 0
    assert main(["bench", "--device", "cpu", "--dtype", "float7"]) == 2
