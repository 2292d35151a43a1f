"""Variants of our own backends, timed only when asked for by name (`--impl`), beside the backend they vary:

  triton.jit_launch   our Triton ops with every launch through Triton's own `kernel[grid]` path
                      (`harness.impls.triton._common.jit_launches`) instead of the launch shortcut, CUDA only:
                      the shortcut's effect on the host's time per call (`launch_ms`) and on eager times,
                      measured side by side with `triton` in one run
                      (`harness bench --device cuda --impl triton,triton.jit_launch`).
"""
from __future__ import annotations

from harness.bench.registry import OP_INPUTS, register_benchmark


def _jit_launch(op: str):
    def make(inputs):
        from harness.impls.registry import get
        from harness.impls.triton._common import jit_launches
        fn, spec = get("triton").ops[op], OP_INPUTS[op]

        def call():
            with jit_launches():
                return spec.call(fn, inputs)
        return call
    return make


def _register() -> None:
    from harness.impls.registry import get
    for op in get("triton").ops:
        register_benchmark(op=op, impl="triton.jit_launch", devices=("cuda",), peer=False,
                           by_default=False)(_jit_launch(op))


_register()
