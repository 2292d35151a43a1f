"""Engine host path: the aten calls an eager decode step makes outside the op contract.

Serving engines run decode eagerly when they do not capture it, and at decode sizes each call on the host
(a projection, a cast, a slice, a reshape) costs microseconds of Python and dispatcher time whether or not it
launches a kernel. The engine keeps that glue small: projections are one `linear` call, a decode-only step
passes its tensors and metadata parts whole (no per-layer slices), no-op casts are skipped, the delta rules'
gates stay in float32. Counted here with a dispatch mode around one decode step of a tiny two-layer model
(the family's own layer kinds: hybrids count their attention and MLP layers too), each op of the contract
counted as one call and its insides left out: a change that adds glue to the step fails with the calls it
makes.
"""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.engine import BatchEntry, build_metadata
from harness.engine import families as engine_families
from harness.engine.runner import EngineRunner
from harness.impls.registry import Impl, get
from harness.scenarios import random_params, tiny_config

# aten calls outside the ops in one decode step of four rows through the tiny config's two layers, with a
# little room for torch versions that decompose a call differently (counted with torch 2.13: Mamba-1 22,
# Falcon-Mamba 26, Mamba-2 20; the hybrids' tiny configs hold a full-attention layer, whose paged attention
# in torch is most of their 290 / 240 calls)
BUDGET = {"mamba1": 24, "falcon_mamba": 28, "mamba2": 22, "gdn": 300, "kda": 250}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls, self.inside = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _counting(impl, mode):
    """`impl` whose ops count as one call each and hide their own aten calls from `mode`."""
    def wrap(name, fn):
        def call(*a, **kw):
            mode.calls["op:" + name] += 1
            mode.inside += 1
            try:
                return fn(*a, **kw)
            finally:
                mode.inside -= 1
        return call
    return Impl(name=impl.name, ops={n: wrap(n, f) for n, f in impl.ops.items()}, devices=impl.devices,
                dtypes=impl.dtypes)


@pytest.mark.parametrize("family", engine_families.names())
def test_decode_step_glue_is_within_budget(family, device):
    if not device.startswith("cpu"):
        pytest.skip("the engine's host calls are counted on the CPU run (the torch implementation, float32)")
    assert family in BUDGET, f"engine family {family!r} has no budget here: count its decode step's calls, add it"
    cfg = tiny_config(family, n_layer=2)
    mode = _Count()
    runner = EngineRunner((cfg, random_params(cfg, 0)), _counting(get("torch"), mode), num_slots=4,
                          token_budget=16, dtype=torch.float32, poison_free_slots=False)
    kv = getattr(runner.pool, "kv", None)  # hybrids: the attention layers' pages, reserved as a step does
    for _ in range(4):
        slot = runner.pool.alloc()
        if kv is not None:
            kv.reserve(slot, 1)
    md = build_metadata([BatchEntry(i, i, 0, 1, True) for i in range(4)], chunk_size=runner.chunk_size,
                        device="cpu")
    tokens = torch.zeros(4, dtype=torch.long)
    with torch.inference_mode():
        runner.forward(tokens, md)  # first step: lazily built state
        mode.calls.clear()
        with mode:
            runner.forward(tokens, md)
    glue = {k: v for k, v in mode.calls.items() if not k.startswith("op:")}
    n = sum(glue.values())
    assert n <= BUDGET[family], (f"{family}: a decode step makes {n} aten calls outside the ops (budget "
                                 f"{BUDGET[family]}): {dict(Counter(glue).most_common())}")


@pytest.mark.parametrize("reads_host", [False, True])
def test_engine_checks_slot_ids_once_per_step(monkeypatch, reads_host):
    """With an implementation that reads nothing on the host (ours), an engine step reads its offsets and slot
    ids to the host once (`_check_metadata`) and the ops make no read of their own (`no_index_checks()` around
    the layers); an implementation that reads slot ids to decline cases (`Impl.reads_host`, the peers'
    adapters) keeps every op call's checks. Either way the requests get their tokens."""
    from dataclasses import replace
    from harness.engine import Request
    from harness.ops import _checks
    reads = []
    real = _checks.read_host
    monkeypatch.setattr(_checks, "read_host", lambda *t: reads.append(len(t)) or real(*t))
    cfg = tiny_config("mamba2", n_layer=2)
    impl = replace(get("torch"), name="torch-host", reads_host=True) if reads_host else get("torch")
    runner = EngineRunner((cfg, random_params(cfg, 0)), impl, num_slots=2, token_budget=8, dtype=torch.float64)
    out = runner.run([Request("a", [1, 2, 3, 4, 5], max_new_tokens=3), Request("b", [6, 7], max_new_tokens=3)])
    steps = runner.step_count
    assert (len(reads) > steps) if reads_host else (len(reads) == steps), f"{len(reads)} host reads in {steps} steps"
    assert [len(out[k].tokens) for k in "ab"] == [3, 3]


def test_engine_step_rejects_metadata_outside_the_pool():
    """The per-step check reads the metadata the layers will get (a patched builder's too) and names what is
    wrong before anything runs: a slot id outside the pool, two live requests on one slot, offsets that do not
    end at the token count."""
    from dataclasses import replace
    cfg = tiny_config("mamba2", n_layer=1)
    runner = EngineRunner((cfg, random_params(cfg, 0)), get("torch"), num_slots=2, token_budget=8,
                          dtype=torch.float64)
    md = build_metadata([BatchEntry(0, 1, 0, 1, True), BatchEntry(1, -1, 0, 1, True)], chunk_size=runner.chunk_size,
                        device="cpu")
    assert runner._check_metadata(md, 2) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"state_indices.*slot ids in \[0, 2\).*got \[2\] at positions \[1\]"):
        runner._check_metadata(replace(md, state_indices=torch.tensor([1, 2], dtype=torch.int32)), 2)
    with pytest.raises(ValueError, match=r"state_indices.*distinct slot ids"):
        runner._check_metadata(replace(md, state_indices=torch.tensor([1, 1], dtype=torch.int32)), 2)
    with pytest.raises(ValueError, match=r"query_start_loc.*end at the token count 3"):
        runner._check_metadata(md, 3)
