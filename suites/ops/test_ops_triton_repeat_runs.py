"""Kernel suite: our Triton kernels give the same bits in every run of the same inputs, at the shapes and launch
configurations they are timed with (each op's "gpu" benchmark shapes, bf16, the device's configuration files).

Why: Triton 3.6 on sm_90 has compiled pipelined loops whose `tl.dot` takes an operand held in registers into
programs that race, so the outputs come out wrong in some runs and right in others (docs/findings.md: our GDN
output launch at one setting; vLLM 0.33.0 drops the same class of SSD chunk-scan configurations on sm_90 for
NaN/Inf rows). The op suites check values at small shapes, once per case; a race at a production configuration
can pass them. Our kernels use no atomics, so every run of one input set must agree bit for bit, and outputs
must be finite where the inputs are. Each case builds its inputs afresh from one seed before every run (the
ops write their state pools in place) and runs RUNS times; under `--profile nightly` NIGHTLY_RUNS times, in
fp16 and fp32 too (a race can depend on the tile's element type: ours showed at fp16, K = 128).

GPU only (CUDA; XPU too, unverified on hardware): the Triton interpreter runs no compiled code, so it has no such
race.
"""
from __future__ import annotations

import pytest
import torch

from harness.bench import ops as _  # noqa: F401 - registers each op's benchmark inputs
from harness.bench.registry import OP_INPUTS
from harness.bench.sweep import _outputs
from harness.bench.timing import synchronize
from harness.ops import SPECS, no_index_checks
from harness.testing.checks import assert_bitwise_equal

RUNS = 6
NIGHTLY_RUNS = 20
NIGHTLY_DTYPES = (torch.float16, torch.float32)
SEED = 7


def _ops():
    return sorted(op for op, spec in OP_INPUTS.items() if spec.level == "kernel" and op in SPECS)


@pytest.mark.parametrize("op", _ops())
def test_every_run_gives_the_same_bits(impl, device, op, request):
    if impl.name != "triton":
        pytest.skip(f"kernel-specific cases of the triton implementation (this run tests {impl.name!r})")
    if device.startswith("cpu"):
        pytest.skip("a race of compiled GPU code; the CPU runs Triton's interpreter, which compiles nothing")
    if op not in impl.ops:
        pytest.skip(f"triton has no {op}")
    spec = OP_INPUTS[op]
    fn = impl.ops[op]
    nightly = request.config.getoption("profile") == "nightly"
    dtypes = spec.dtypes_for(device)[:1]
    if nightly and dtypes[0].is_floating_point:
        dtypes += tuple(d for d in NIGHTLY_DTYPES if d not in dtypes)
    for dtype, shape in [(d, s) for d in dtypes for s in spec.shapes_for(device)]:
        first = None
        for run in range(NIGHTLY_RUNS if nightly else RUNS):
            inputs = spec.make(shape, dtype, device, torch.Generator(device=device).manual_seed(SEED))
            finite_in = all(bool(torch.isfinite(t).all()) for t in inputs.values()
                            if isinstance(t, torch.Tensor) and t.is_floating_point())
            with no_index_checks():
                outs = _outputs(SPECS[op], inputs, spec.call(fn, inputs))
            synchronize(device)
            if finite_in:
                for i, t in enumerate(outs):
                    assert bool(torch.isfinite(t).all()), (
                        f"{op} {shape} {dtype} run {run}: output {i} has {int((~torch.isfinite(t)).sum())} "
                        f"non-finite values from finite inputs")
            if first is None:
                first = outs
                continue
            for i, (a, b) in enumerate(zip(first, outs)):
                assert_bitwise_equal(f"{op} {shape} {dtype}: output {i} of run {run}", b, a,
                                     "against run 0 of the same inputs")
        del first
