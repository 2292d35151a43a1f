"""Benchmarks: kernel- and model-level timings over a shape matrix, as records (kind "timing").

Declare, don't edit a table (see harness.bench.registry):

    from harness.bench import register_benchmark, register_metric

    @register_benchmark(op="ssd_varlen", impl="my_ssd")           # one more backend, next to the registry's
    def my_ssd(inputs):                                             # inputs: the op contract's keyword arguments
        return lambda: my_kernels.ssd(**inputs)

    @register_metric("tflops")
    def tflops(case, ms, ctx):
        return flops_of(case.shape) / (ms * 1e-3) / 1e12

Every implementation in harness.impls.registry that provides an op is benchmarked automatically; the
peers' own kernels are decorated backends (harness.bench.peers), and so are variants of ours timed only when
named with --impl (harness.bench.variants: `triton.jit_launch`, our Triton ops through Triton's own launch path).
Run with `harness bench` (records to JSONL) or `pytest suites/bench --benchmark-json=...`; the other
benchmarks are its subcommands: `peers`, `sweep` (launch configurations, harness.bench.sweep),
`throughput` (model tok/s, harness.bench.throughput) and `loader` (harness.bench.loader). All of them
time through harness.bench.timing.
"""
from __future__ import annotations

__all__ = ["register_benchmark", "register_inputs", "register_metric", "run_benchmarks", "benchmarks_for"]


def __getattr__(name):  # lazy: `harness --help` must not import torch
    if name in ("register_benchmark", "register_inputs", "register_metric", "benchmarks_for"):
        from harness.bench import registry
        return getattr(registry, name)
    if name == "run_benchmarks":
        from harness.bench.runner import run_benchmarks
        return run_benchmarks
    raise AttributeError(name)
