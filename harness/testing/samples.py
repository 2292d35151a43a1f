"""Hand-made runs for tests and demos of `harness gate` / `harness report`.

`make_run(path, ...)` writes a results file through `RecordWriter` (so the records are exactly what
the suites and the bench write) with a chosen set of comparisons and timings; the `slow`, `noisy`,
`regress`, `drop` knobs plant the situations the gate must (or must not) flag.
"""
from __future__ import annotations

import os

from harness.records import RecordWriter

OPS = ("causal_conv1d_varlen", "selective_scan_varlen")
DTYPES = ("float32", "bfloat16")
TOL = {"float32": {"atol": 2e-3, "rtol": 2e-3, "ratio": 2e-4}, "bfloat16": {"atol": 0.15, "rtol": 0.1, "ratio": 2e-2}}
LENGTHS = (256, 1024, 4096)


def comparison_cases():
    """(test_id, name, op, impl, dtype, shapes, base error ratio) for the hand-made runs."""
    out = []
    for op in OPS:
        for dtype in DTYPES:
            for impl in ("triton", "torch"):
                for T in (17, 64):
                    test = f"suites/ops/test_ops_{op}.py::test_matches_reference[{impl}]"
                    out.append((test, "y", op, impl, dtype, {"x": [T, 32], "weight": [32, 4]},
                                TOL[dtype]["ratio"] * 0.01))
    return out


def timing_cases():
    out = []
    for op in OPS:
        for impl, base_tok_s, peer in (("triton", 2.0e8, False), ("torch", 5.0e7, False), ("mamba_ssm", 2.2e8, True)):
            for T in LENGTHS:
                out.append((op, impl, "bfloat16", {"T": T, "D": 1024, "K": 4}, T, base_tok_s * (T / 4096) ** 0.3, peer))
    out.append(("copy", "torch", "uint8", {"bytes": 1 << 26}, None, None, False))
    return out


def make_run(path: str, *, device: str = "cuda:0", device_name: str = "NVIDIA H200", git_sha: str = "a" * 40,
             run_id: str | None = None, slow: dict | None = None, noisy: dict | None = None,
             regress: set | None = None, grow: dict | None = None, drop: set | None = None,
             spread: float = 0.01, torch_version: str = "2.11.0+cu130") -> str:
    """Write a run to `path` (a .jsonl file).

    slow:    {(op, impl, T): fraction}  tok/s reduced by the fraction (e.g. 0.10 = 10% slower)
    noisy:   {(op, impl, T): spread}    relative p20-p80 spread for that case (default `spread`)
    regress: {(op, impl, dtype)}        those comparisons fail (error ratio 50x the tolerance)
    grow:    {(op, impl, dtype): factor} passing comparisons with the error ratio times factor
    drop:    {(op, impl)}               cases of these are absent (comparisons and timings)
    """
    slow, noisy, regress, grow, drop = slow or {}, noisy or {}, regress or set(), grow or {}, drop or set()
    if os.path.exists(path):
        os.unlink(path)
    w = RecordWriter(path, run_id=run_id or os.path.splitext(os.path.basename(path))[0])
    w.write("env", env={"git_sha": git_sha, "python": "3.11.9", "torch": torch_version, "triton": "3.6.0",
                        "device": device.split(":")[0], "device_name": device_name, "host": "bench-host"},
            profile="nightly", hypothesis_seed=0, impls=["triton", "torch"], worker="main")
    for test, name, op, impl, dtype, shapes, err in comparison_cases():
        if (op, impl) in drop:
            continue
        tol = TOL[dtype]
        failed = (op, impl, dtype) in regress
        e = tol["ratio"] * 50 if failed else err * grow.get((op, impl, dtype), 1.0)
        w.write("comparison", test_id=test, name=name, op=op, impl=impl, device=device, dtype=dtype, shapes=shapes,
                max_abs_err=e * 10, err_ratio=e, tolerance=tol, verdict="fail" if failed else "pass",
                reason=f"error ratio {e:.3e} exceeds {tol['ratio']:g}" if failed else "",
                seed=1234, worst_index=[3, 7] if failed else None,
                reproduce=f"python -m pytest '{test}' --device cuda --hypothesis-seed=1234" if failed else None)
    copy_gb_s = 4000.0
    for op, impl, dtype, shape, T, tok_s, peer in timing_cases():
        if (op, impl) in drop:
            continue
        if op == "copy":
            nbytes = 2 * shape["bytes"]
            ms = nbytes / (copy_gb_s * 1e9) * 1e3
            w.write("timing", bench="copy", op="copy", impl=impl, device=device, dtype=dtype, shape=shape,
                    tokens=None, ms_p20=ms * (1 - spread / 2), ms_p50=ms, ms_p80=ms * (1 + spread / 2), tok_s=None,
                    bytes=nbytes, gb_s=copy_gb_s, pct_copy_bw=100.0, peer=False, cuda_graph=False)
            continue
        tok_s = tok_s * (1 - slow.get((op, impl, T), 0.0))
        ms = T / tok_s * 1e3
        sp = noisy.get((op, impl, T), spread)
        nbytes = T * shape["D"] * 2 * 2 + shape["D"] * shape["K"] * 2
        gb_s = nbytes / (ms * 1e-3) / 1e9
        w.write("timing", bench=f"{op}/{impl}", op=op, impl=impl, device=device, dtype=dtype, shape=shape, tokens=T,
                ms_p20=ms * (1 - sp / 2), ms_p50=ms, ms_p80=ms * (1 + sp / 2), tok_s=tok_s, bytes=nbytes, gb_s=gb_s,
                pct_copy_bw=100 * gb_s / copy_gb_s, peer=peer, cuda_graph=False)
    return path
