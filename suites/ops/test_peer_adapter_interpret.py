"""The shims that let a peer's Triton kernels run under Triton's interpreter (`harness.impls.adapters._interpret`,
what the fla adapter applies on the CPU), on a stand-in peer module with both things the interpreter lacks: an
autotuned kernel with two configs, and a loop index used as a tensor (`i.to(tl.int64)`, as fla-core's chunked
GDN state kernel does)."""
import importlib.util
import inspect
import sys
import textwrap

import pytest
import torch

from harness.impls.adapters._interpret import interpretable, interpreted
from harness.impls.triton._common import interpreting

PEER = textwrap.dedent("""
    import triton
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 8})], key=["n"])
    @triton.jit
    def cumsum_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros((), dtype=tl.float32)
        for i in range(n):
            j = i.to(tl.int64)
            acc += tl.load(x_ptr + j)
            tl.store(o_ptr + j, acc)

    def cumsum(x):
        o = x.new_empty(x.shape)
        cumsum_kernel[(1,)](x, o, x.numel())
        return o

    def host_indices(n):
        return [i for i in range(n)]

    def cumsum_on_its_device(x, *, out=None):
        import torch
        with torch.cuda.device(x.device.index):  # as mamba_ssm launches its kernels
            o = cumsum(x)
        return o if out is None else out.copy_(o)
""")


def _load(tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(PEER)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not interpreting(), reason="the shims are for Triton's interpreter (pytest --device cpu sets it)")
def test_interpretable_runs_a_peer_kernel_the_interpreter_could_not(tmp_path):
    """Without the shims the stand-in kernel cannot run under the interpreter; with them it computes the
    cumulative sum, its autotuner keeps one config, and the module's host code still gets Python ints from
    `range`."""
    x = torch.arange(1.0, 7.0)
    bare = _load(tmp_path, "harness_stand_in_peer_bare")
    try:
        with pytest.raises(Exception):
            bare.cumsum(x)
    finally:
        del sys.modules["harness_stand_in_peer_bare"]
    mod = _load(tmp_path, "harness_stand_in_peer")
    try:
        interpretable("harness_stand_in_peer")
        assert len(mod.cumsum_kernel.configs) == 1
        got = mod.cumsum(x)
        assert torch.equal(got, torch.cumsum(x, 0)), got
        assert mod.host_indices(3) == [0, 1, 2] and all(type(i) is int for i in mod.host_indices(3))
    finally:
        del sys.modules["harness_stand_in_peer"]


@pytest.mark.skipif(not interpreting(), reason="the shims are for Triton's interpreter (pytest --device cpu sets it)")
def test_interpreted_op_runs_a_peer_that_enters_the_cuda_device_of_a_cpu_tensor(tmp_path):
    """`interpreted(prefix, op)`: the peer's kernels made interpretable at the call, and `torch.cuda.device` of a
    CPU tensor's index (None) a no-op around it (torch's raises); the op keeps its name and signature and is
    what `inspect.unwrap` returns (the contract tests unwrap ops to what was registered)."""
    mod = _load(tmp_path, "harness_stand_in_peer_dev")
    try:
        x = torch.arange(1.0, 5.0)
        with pytest.raises(TypeError):
            with torch.cuda.device(x.device.index):
                pass
        op = interpreted("harness_stand_in_peer_dev", mod.cumsum_on_its_device)
        assert inspect.unwrap(op) is op and op.__name__ == "cumsum_on_its_device"
        assert "out" in inspect.signature(op).parameters
        assert torch.equal(op(x), torch.cumsum(x, 0))
        with pytest.raises(TypeError):  # only while the op runs
            with torch.cuda.device(x.device.index):
                pass
    finally:
        del sys.modules["harness_stand_in_peer_dev"]
