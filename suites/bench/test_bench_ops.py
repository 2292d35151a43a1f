"""The benchmark matrix as pytest-benchmark tests (the same declarations `harness bench` runs).

    python -m pytest suites/bench --device cuda --benchmark-json=reports/bench-pytest.json
    harness gate --baseline reports/baselines/h200 --candidate reports/bench-pytest.json

Each case is one test: it builds the op's inputs (several sets, rotated between rounds), calls the
backend once with the op's input checks on, then times it with the device synchronised inside the
timed function. `extra_info` carries bench/op/impl/dtype/shape/tokens/bytes so `harness gate` and
`harness report` read the JSON as timing records. Under pytest-xdist pytest-benchmark disables
timing and each case runs once: a smoke test that every backend runs on every declared shape.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from harness.bench.bytes import op_bytes
from harness.bench.registry import OP_INPUTS
from harness.bench.runner import build_cases
from harness.bench.timing import rotation_count, synced, synchronize


def pytest_generate_tests(metafunc):
    if "bench_case" not in metafunc.fixturenames:
        return
    from harness.testing import plugin
    device = plugin._STATE.get("device", "cpu")
    asked = metafunc.config.getoption("impl") or None
    names = [i.name for i in plugin.selected_impls()] if asked else None
    cases, _ = build_cases(device, impls=names)
    if not any(c.op == "copy" for c in cases):
        cases = build_cases(device, ops=["copy"])[0][:1] + cases
    metafunc.parametrize("bench_case", cases, ids=[c.id for c in cases])


@pytest.fixture
def one_thread(device):
    """Tiny CPU shapes time stably (and fast under -n 2) on one thread; restores the setting."""
    if device != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_bench(bench_case, benchmark, device, one_thread):
    """Every declared backend runs on every declared shape of its op and can be timed."""
    from harness.env import device_name
    from harness.ops import no_index_checks
    case = bench_case
    spec = OP_INPUTS[case.op]
    gen = torch.Generator(device=device if device.split(":")[0] in ("cuda", "xpu") else "cpu").manual_seed(0)
    first = spec.make(case.shape, case.dtype, device, gen)
    nbytes = op_bytes(case.op, first)
    sets = [first] + [spec.make(case.shape, case.dtype, device, gen)
                      for _ in range(rotation_count(nbytes, device) - 1)]
    fns = [case.bench.fn(s) for s in sets]
    out = fns[0]()  # checked call
    synchronize(device)
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        assert torch.isfinite(out).all(), f"{case.id}: non-finite output"
    benchmark.group = case.op
    benchmark.extra_info.update(bench=case.bench.id, op=case.op, impl=case.impl, dtype=case.dtype_name,
                                shape=case.shape, tokens=case.tokens, bytes=nbytes, device=device,
                                device_name=device_name(device), peer=case.bench.peer, cuda_graph=False)
    cycle = itertools.cycle([synced(f, device) for f in fns])
    rounds = 5 if device == "cpu" else 50
    with no_index_checks():
        benchmark.pedantic(lambda f: f(), setup=lambda: ((next(cycle),), {}), rounds=rounds, warmup_rounds=1,
                           iterations=1)
