"""Mixer backend (harness/engine/backend.py) and model runner (harness/engine/runner.py) contracts."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from harness.engine.backend import MixerBackend
from harness.engine.metadata import build_metadata
from harness.engine.pool import PAD_SLOT_ID, StatePool
from harness.engine.runner import state_spec
from harness.engine.scheduler import BatchEntry, Request
from harness.impls import registry
from harness.impls.registry import Impl
from harness.scenarios import (FAMILIES, RunnerFactory, Scenario, engine_ops, factory_for, prop_matches_reference,
                               tiny_model)
from reference.mixers import make_mixer


def _spy(base, calls, pools):
    def wrap(name, fn):
        def op(*a, **k):
            calls.append(name)
            for t in list(a) + list(k.values()):
                if isinstance(t, torch.Tensor) and t.dim() >= 3 and any(t is p for p in pools):
                    calls.append(("pool", name))
            return fn(*a, **k)
        return op
    return Impl(name="spy", ops={n: wrap(n, f) for n, f in base.ops.items()}, devices=base.devices)


@settings(max_examples=12)
@given(st.sampled_from(FAMILIES), st.lists(st.integers(1, 9), min_size=0, max_size=3),
       st.integers(0, 3), st.booleans(), st.integers(0, 1000))
def test_backend_mixed_batch_equals_reference_mixer(family, prefill_lens, ndec, page_major, seed):
    """A mixed batch (prefills -- some continuing from a state -- then decode rows, plus a pad row) through
    the backend equals the reference mixer run per request (forward for prefills, step for decodes) in
    float64: outputs and the states written into the pool; the pad row's slot id touches nothing; the
    backend calls only the op contract's ops, passes the pool views themselves, and returns
    (out, conv_states, ssm_states) with the very pool views it got."""
    if not prefill_lens and not ndec:
        ndec = 1
    cfg, params = tiny_model(family, 0)
    mp = {k[len("layers.0.mixer."):]: v for k, v in params.items() if k.startswith("layers.0.mixer.")}
    ref = make_mixer(cfg, mp, dtype=torch.float64)
    spec = state_spec(cfg, torch.float64, torch.float64)
    nreq = len(prefill_lens) + ndec
    pool = StatePool(spec, 1, nreq + 2, layout="page_major" if page_major else "layer_major")
    g = torch.Generator().manual_seed(seed)
    slots = [pool.alloc() for _ in range(nreq + 2)][::-1][:nreq]  # not in order, last slots included
    for t in (pool.conv(0), pool.recurrent(0)):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64))
    starts = [int(torch.randint(0, 3, (1,), generator=g)) for _ in prefill_lens]
    entries = [BatchEntry(i, slots[i], s, n, False, (0,) * n) for i, (s, n) in enumerate(zip(starts, prefill_lens))]
    entries += [BatchEntry(len(prefill_lens) + j, slots[len(prefill_lens) + j], 5, 1, True, (0,)) for j in range(ndec)]
    entries.append(BatchEntry("pad", PAD_SLOT_ID, 0, 1, True, (0,)))
    md = build_metadata(entries, chunk_size=4)
    T = md.num_tokens
    hidden = torch.randn(T, cfg.d_model, generator=g, dtype=torch.float64)
    before_conv, before_rec = pool.conv(0).clone(), pool.recurrent(0).clone()
    calls = []
    conv_view, rec_view = pool.conv(0), pool.recurrent(0)
    be = MixerBackend(cfg, mp, _spy(registry.get("reference"), calls, [conv_view, rec_view]), dtype=torch.float64,
                      chunk_size=4)
    ret = be(hidden, md, conv_view, rec_view)
    assert isinstance(ret, tuple) and len(ret) == 3 and ret[1] is conv_view and ret[2] is rec_view
    out = ret[0]
    assert {c for c in calls if isinstance(c, str)} <= set(engine_ops(family))
    assert any(isinstance(c, tuple) for c in calls)
    q = md.query_start_loc.tolist()
    for i, e in enumerate(entries[:-1]):
        s = e.slot
        c0, r0 = before_conv[s:s + 1], before_rec[s:s + 1]
        h = hidden[q[i]:q[i + 1]]
        if e.is_decode:
            y, c1, r1 = ref.step(h, c0, r0)
        elif e.start > 0:
            y, c1, r1 = ref.forward(h, None, c0, r0)
        else:
            y, c1, r1 = ref.forward(h, None, None, None)
        torch.testing.assert_close(out[q[i]:q[i + 1]], y, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(pool.conv(0)[s], c1[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(pool.recurrent(0)[s], r1[0], rtol=1e-9, atol=1e-10)
    untouched = [s for s in range(pool.num_slots) if s not in slots]
    for s in untouched:
        assert torch.equal(pool.conv(0)[s], before_conv[s]) and torch.equal(pool.recurrent(0)[s], before_rec[s])


def test_backend_rejects_incomplete_impl_and_bad_hidden():
    """An implementation lacking an op the backend needs, and hidden states of the wrong shape, are
    ValueErrors naming the argument."""
    cfg, params = tiny_model("mamba2", 0)
    mp = {k[len("layers.0.mixer."):]: v for k, v in params.items() if k.startswith("layers.0.mixer.")}
    ref = registry.get("reference")
    partial = Impl(name="partial", ops={k: v for k, v in ref.ops.items() if k != "ssd_varlen"})
    with pytest.raises(ValueError, match=r"^impl: expected an implementation providing .* lacks \['ssd_varlen'\]"):
        MixerBackend(cfg, mp, partial)
    be = MixerBackend(cfg, mp, ref, dtype=torch.float64)
    md = build_metadata([BatchEntry("a", 0, 0, 3, False, (1, 2, 3))])
    pool = StatePool(state_spec(cfg, torch.float64, torch.float64), 1, 1)
    with pytest.raises(ValueError, match=r"^hidden: expected 3 rows"):
        be(torch.zeros(4, cfg.d_model, dtype=torch.float64), md, pool.conv(0), pool.recurrent(0))


def test_runner_snapshots_only_at_step_ends_and_results():
    """In cache mode all, a tracked request's prefill chunks are cut at block boundaries, so each
    snapshot is a step end; untracked requests are not cut and not snapshotted; results carry tokens,
    one logits row per token, final states and the seeded prefix length."""
    cfg, params = tiny_model("mamba1", 0)
    r = RunnerFactory("reference")((cfg, params), token_budget=64, cache_mode="all", block_size=8)
    out = r.run([Request("t", tuple(range(20)), 2, True), Request("u", tuple(range(30, 50)), 2, False)])
    assert [(s[1], s[2]) for s in out["t"].steps if not s[3]] == [(0, 8), (8, 8), (16, 4)]
    assert [(s[1], s[2]) for s in out["u"].steps if not s[3]] == [(0, 20)]
    assert [(rid, len(p)) for rid, p, _ in r.snapshot_log] == [("t", 8), ("t", 16)]
    assert out["t"].step_logits.shape == (2, cfg.vocab_size) and out["t"].final_state is not None
    again = r.run([Request("t2", tuple(range(17)) + (5,), 1, False)])
    assert again["t2"].num_cached == 16


def test_triton_cpu_smoke(device):
    """One small chunked, seeded, padded scenario through the Triton implementation under the CPU
    interpreter (the full scenario suites run Triton on GPU)."""
    if not device.startswith("cpu"):
        pytest.skip("on a GPU the scenario property suites run the Triton implementation in full")
    impl = registry.all_impls().get("triton")
    if impl is None or impl.why_unavailable("cpu"):
        pytest.skip(f"triton implementation not usable on cpu: {impl and impl.why_unavailable('cpu')}")
    case = Scenario(family="mamba2", model_seed=0, prompts=((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)),
                    max_new=(1, 2), track=(True, False), waves=((0,), (1,)), token_budget=8, block_size=8,
                    cache_mode="all", chunk_seed=1, num_slots=2, decode_pad=2)
    prop_matches_reference(case, factory_for(impl, "cpu"))
