"""Peer adapters' decode paths without host reads (harness/impls/adapters: fla, vllm, sglang).

`harness bench` times every op eager and as CUDA-graph replays inside `harness.ops.no_index_checks()`; a
call that copies a device tensor to the host (`.tolist()`, `.item()`, `.cpu()`, `torch.tensor(list)`)
cannot be captured. Inside no_index_checks() the adapters' decode ops handle pads on the device
(`gather_slots`, `scatter_slots`, `mask_rows`):

* the helpers against host-list versions of the same gather / scatter (CPU or CUDA; on CUDA also
  captured in a CUDA graph and replayed);
* each adapter's GDN / KDA decode wrapper with the peer kernel replaced by a stand-in (one step of
  reference.delta_rule, behaving like the peer's kernel towards its slot indices), run inside
  no_index_checks() with every host read of a tensor raising: live outputs and slots equal the host-list
  result (and the same call outside no_index_checks()), pads and unnamed slots bitwise unchanged;
* the same for the speculative GDN / KDA wrappers (vLLM's GDN and KDA, SGLang's GDN verify, fla's KDA), on
  slot tables with pad positions, rows without tokens, padding rows and a row that writes the slot it
  started from, against the float64 reference;
* the conv and Mamba state updates of vLLM and SGLang reach their (stand-in) kernel with no host read.

The stand-ins stand for device kernels, so they may read indices on the host. No peer package is needed.
"""
import contextlib
import types

import pytest
import torch

from harness.impls.adapters import fla as fla_adapter
from harness.impls.adapters import gather_slots, mask_rows, scatter_slots
from harness.impls.adapters import sglang as sglang_adapter
from harness.impls.adapters import vllm as vllm_adapter
from harness.ops import PAD_SLOT_ID, SPECS, no_index_checks
from harness.ops import _inputs as I
from harness.testing import assert_untouched, make_pool
from harness.testing.delta_cases import activations
from reference import delta_rule as R

_HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _Guard:
    """Every host read of a tensor raises while armed; `kernel()` lifts it (a stand-in for a device kernel)."""

    def __init__(self):
        self.lifted = 0

    @contextlib.contextmanager
    def kernel(self):
        self.lifted += 1
        try:
            yield
        finally:
            self.lifted -= 1

    def check(self, what):
        if not self.lifted:
            raise AssertionError(f"host read inside no_index_checks(): {what}")


@pytest.fixture
def guard(monkeypatch):
    """Arms the guard on torch.Tensor's host reads, `.to(<cpu>)` and `torch.tensor`; `guard.armed()` arms it
    (with no_index_checks() active) for the adapter call only."""
    g = _Guard()
    g.active = False

    def wrap(name, orig):
        def f(*a, **kw):
            if g.active:
                g.check(f"Tensor.{name}")
            return orig(*a, **kw)
        return f

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    orig_to, orig_tensor = torch.Tensor.to, torch.tensor

    def to(self, *a, **kw):
        if g.active:
            dev = kw.get("device", a[0] if a and isinstance(a[0], (str, torch.device)) else None)
            if dev is not None and torch.device(dev).type == "cpu":
                g.check("Tensor.to(cpu)")
        return orig_to(self, *a, **kw)

    def tensor(*a, **kw):
        if g.active:
            g.check("torch.tensor(host data)")
        return orig_tensor(*a, **kw)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "tensor", tensor)

    @contextlib.contextmanager
    def armed():
        with no_index_checks():
            g.active = True
            try:
                yield
            finally:
                g.active = False

    g.armed = armed
    return g


# ------------------------------------------------------------------------------------------- helpers

def _host_gather(pool, slots, use, dtype):
    out = torch.zeros((len(slots),) + tuple(pool.shape[1:]), dtype=dtype, device=pool.device)
    for i, (s, u) in enumerate(zip(slots, use)):
        if u:
            out[i] = pool[s].to(dtype)
    return out


def _host_scatter(pool, slots, live, states):
    for i, (s, u) in enumerate(zip(slots, live)):
        if u:
            pool[s] = states[i].to(pool.dtype)


HELPER_CASES = [  # (slots, num_slots); pad -1
    ([2, -1, 0, 4], 6),
    ([-1, -1, -1], 3),
    ([0], 1),
    ([5, 1, -1, 3, 0], 6),
    ([-1, -1], 0),
    ([], 3),
]


@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slots,num_slots", HELPER_CASES, ids=lambda c: str(c))
def test_device_helpers_match_host_lists(device, slots, num_slots, pool_dtype, layout):
    """gather_slots / scatter_slots / mask_rows equal the host-list gather and scatter; slots not written
    (NaN-poisoned ones included) keep their bits."""
    pool = make_pool(num_slots, (2, 3, 4), pool_dtype, device, layout=layout, seed=1)
    if num_slots > 1:
        pool[num_slots - 1] = float("nan")
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    live = idx != PAD_SLOT_ID
    flags = [s != PAD_SLOT_ID for s in slots]
    got = gather_slots(pool, idx, live, torch.float32)
    want = _host_gather(pool, slots, flags, torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    states = torch.randn((len(slots), 2, 3, 4), generator=torch.Generator().manual_seed(2)).to(device)
    before = pool.clone()
    ref = pool.clone()
    _host_scatter(ref, slots, flags, states)
    scatter_slots(pool, idx, live, states)
    named = [s for s in slots if s != PAD_SLOT_ID]
    assert torch.equal(pool[named], ref[named])
    assert_untouched(before, pool, named, name="scatter_slots pool")
    y = torch.randn((len(slots), 3), generator=torch.Generator().manual_seed(3)).to(device)
    m = mask_rows(y, live)
    for i, f in enumerate(flags):
        assert torch.equal(m[i], y[i] if f else torch.zeros_like(y[i]))


def test_device_helpers_capture_in_cuda_graph(device):
    """On CUDA the gather / scatter of a decode step capture in a CUDA graph and replay with new slot ids."""
    if not device.startswith("cuda"):
        pytest.skip("needs a CUDA device (CUDA-graph capture)")
    pool = make_pool(6, (2, 3, 4), torch.float32, device, seed=1)
    idx = torch.tensor([2, -1, 0, 4], dtype=torch.int32, device=device)
    states = torch.randn((4, 2, 3, 4), device=device)
    with no_index_checks():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the capture
            live = idx != PAD_SLOT_ID
            scatter_slots(pool.clone(), idx, live, gather_slots(pool.clone(), idx, live) + states)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            live = idx != PAD_SLOT_ID
            scatter_slots(pool, idx, live, gather_slots(pool, idx, live) + states)
    for slots in ([2, -1, 0, 4], [-1, 5, -1, 1], [-1, -1, -1, -1]):
        idx.copy_(torch.tensor(slots, dtype=torch.int32))
        before = pool.clone()
        ref = pool.clone()
        _host_scatter(ref, slots, [s != PAD_SLOT_ID for s in slots],
                      _host_gather(pool, slots, [s != PAD_SLOT_ID for s in slots], torch.float32) + states)
        graph.replay()
        torch.cuda.synchronize()
        named = [s for s in slots if s != PAD_SLOT_ID]
        assert torch.equal(pool[named], ref[named])
        assert_untouched(before, pool, named, name="captured scatter_slots pool")


# ------------------------------------------------------------------------------ GDN / KDA decode wrappers

def _step(kind, q, k, v, g, beta, state, scale, l2):
    f = R.gated_delta_rule_update if kind == "gdn" else R.kda_update
    return f(q.float(), k.float(), v.float(), g.float(), beta.float(), state.float(), scale=scale, use_qk_l2norm=l2)


def _fla_peer(kind, guard):
    """fla's fused_recurrent_* on (B, 1, ...) rows with one fp32 initial state per row (state_v_first)."""
    def fn(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, state_v_first=False, **_):
        assert state_v_first and output_final_state
        with guard.kernel():
            o, new = _step(kind, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state, scale,
                           use_qk_l2norm_in_kernel)
        return o[:, None].to(q.dtype), new
    return fn


def _vllm_peer(kind, guard):
    """vLLM's fused recurrent kernels in its decode form: batch 1, the pool as initial_state, rows whose slot
    index is <= 0 (its null block) skipped (their outputs left unwritten: NaN here), others updated in place."""
    def fn(q, k, v, g, beta, scale=None, initial_state=None, inplace_final_state=True, cu_seqlens=None,
           ssm_state_indices=None, use_qk_l2norm_in_kernel=False, **_):
        assert inplace_final_state and cu_seqlens is not None
        with guard.kernel():
            o = torch.full(v.shape, float("nan"), dtype=q.dtype, device=q.device)
            for b, s in enumerate(ssm_state_indices.tolist()):
                if s <= 0:
                    continue
                ob, new = _step(kind, q[0, b:b + 1], k[0, b:b + 1], v[0, b:b + 1], g[0, b:b + 1], beta[0, b:b + 1],
                                initial_state[s][None], scale, use_qk_l2norm_in_kernel)
                o[0, b] = ob[0].to(o.dtype)
                initial_state[s] = new[0].to(initial_state.dtype)
        return o, initial_state
    return fn


def _sglang_gdn_peer(guard):
    """SGLang's fused_recurrent_gated_delta_rule_update: a negative index starts from zeros and writes nothing."""
    def fn(q, k, v, g, beta, scale=None, initial_state_source=None, initial_state_indices=None,
           use_qk_l2norm_in_kernel=False, **_):
        assert initial_state_indices.dtype == torch.int32
        with guard.kernel():
            src = initial_state_source
            idx = initial_state_indices.tolist()
            h0 = torch.stack([src[s].float() if s >= 0 else torch.zeros(src.shape[1:], device=src.device) for s in idx])
            o, new = _step("gdn", q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0.to(q.device), scale,
                           use_qk_l2norm_in_kernel)
            for b, s in enumerate(idx):
                if s >= 0:
                    src[s] = new[b].to(src.dtype)
        return o[:, None].to(q.dtype)
    return fn


def _sglang_kda_peer(guard):
    """SGLang's fused_recurrent_kda: every row from its initial state, final states written into it."""
    def fn(q, k, v, g, beta, scale=None, initial_state=None, inplace_final_state=False,
           use_qk_l2norm_in_kernel=False, **_):
        assert inplace_final_state
        with guard.kernel():
            o, new = _step("kda", q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state, scale,
                           use_qk_l2norm_in_kernel)
            initial_state.copy_(new.to(initial_state.dtype))
        return o[:, None].to(q.dtype), initial_state
    return fn


def _patch_peers(monkeypatch, guard):
    fla_ns = types.SimpleNamespace(fused_recurrent_gated_delta_rule=_fla_peer("gdn", guard),
                                   fused_recurrent_kda=_fla_peer("kda", guard))
    monkeypatch.setattr(fla_adapter, "import_peer", lambda name: fla_ns)
    vllm_ns = types.SimpleNamespace(fused_recurrent_gated_delta_rule=_vllm_peer("gdn", guard),
                                    fused_recurrent_kda_fwd=_vllm_peer("kda", guard))
    monkeypatch.setattr(vllm_adapter, "import_peer", lambda name: vllm_ns)
    sg_ns = types.SimpleNamespace(fused_recurrent_gated_delta_rule_update=_sglang_gdn_peer(guard),
                                  fused_recurrent_kda=_sglang_kda_peer(guard))
    monkeypatch.setattr(sglang_adapter, "import_peer", lambda name: sg_ns)
    monkeypatch.setattr(sglang_adapter, "_on_gpu", lambda t, what: None)


ADAPTERS = {"fla": fla_adapter, "vllm": vllm_adapter, "sglang": sglang_adapter}
UPDATE_CASES = [  # (slots, num_slots): pads, a pool slot no row names; vLLM's slot ids > 0 (0 is its null block)
    ([3, -1, 1, 5], 7),
    ([2, 0, -1], 4),
    ([-1, -1], 3),
    ([1], 2),
]


def _host_update(kind, q, k, v, g, beta, pool, slots, scale, l2):
    """The host-list result: live rows one at a time from their slot; (outputs, pool after)."""
    p = pool.clone()
    o = torch.zeros(v.shape, dtype=torch.float32)
    for b, s in enumerate(slots):
        if s != PAD_SLOT_ID:
            r = slice(b, b + 1)
            ob, new = _step(kind, q[r], k[r], v[r], g[r], beta[r], pool[s][None], scale, l2)
            o[b] = ob[0].cpu()
            p[s] = new[0].to(p.dtype)
    return o, p


@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("slots,num_slots", UPDATE_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("kind,op", [("gdn", "gated_delta_rule_update"), ("kda", "kda_update")])
@pytest.mark.parametrize("peer", ["fla", "vllm", "sglang"])
def test_decode_wrapper_reads_nothing_on_the_host(monkeypatch, guard, device, peer, kind, op, slots, num_slots,
                                                   layout):
    """Inside no_index_checks() the decode wrapper runs with every host read raising; live outputs and slots
    equal the host-list result and the call outside no_index_checks(); pad slots and unnamed slots keep
    their bits (a NaN-poisoned one included)."""
    if peer == "vllm" and 0 in slots:
        pytest.skip("vLLM's recurrent kernels treat slot 0 as the null block (declined outside "
                    "no_index_checks(), required > 0 inside)")
    if peer == "vllm" and layout == "page_major":
        pytest.skip("vLLM's recurrent kernels index the pool as dense slots: a page-major pool is declined")
    _patch_peers(monkeypatch, guard)
    fn = getattr(ADAPTERS[peer], op)
    H, K, V = 2, 4, 3
    B = len(slots)
    q, k, v, g, beta = activations(kind, 0, B, H, H, K, V, torch.float32, device)
    pool = make_pool(num_slots, (H, V, K), torch.float32, device, layout=layout, seed=1)
    unnamed = [s for s in range(num_slots) if s not in slots]
    pool[unnamed[-1]] = float("nan")
    before = pool.clone()
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    o_ref, p_ref = _host_update(kind, q, k, v, g, beta, before, slots, None, True)

    with guard.armed():
        o = fn(q, k, v, g, beta, pool, idx, use_qk_l2norm=True)
    live_rows = [b for b, s in enumerate(slots) if s != PAD_SLOT_ID]
    named = [s for s in slots if s != PAD_SLOT_ID]
    torch.testing.assert_close(o.cpu().float()[live_rows], o_ref[live_rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool.cpu()[named], p_ref.cpu()[named], rtol=1e-5, atol=1e-6)
    assert_untouched(before, pool, named, name=f"{peer} {op} pool")
    pads = [b for b, s in enumerate(slots) if s == PAD_SLOT_ID]
    if peer == "fla" or (peer, kind) == ("sglang", "kda"):
        assert bool((o[pads] == 0).all()), f"{peer} {op}: pad rows should be zero, got {o[pads]}"

    pool2 = before.clone()
    o2 = fn(q, k, v, g, beta, pool2, idx, use_qk_l2norm=True)  # outside no_index_checks(): host reads allowed
    torch.testing.assert_close(o2.cpu()[live_rows], o.cpu()[live_rows], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pool2[named], pool[named], rtol=1e-6, atol=1e-7)
    assert_untouched(before, pool2, named, name=f"{peer} {op} pool (host path)")


# ------------------------------------------------------------------------------ GDN / KDA speculative decode

def _spec_rows(cu_seqlens, num_accepted_tokens):
    cu, acc = cu_seqlens.tolist(), num_accepted_tokens.tolist()
    return [(b, cu[b], cu[b + 1], acc[b]) for b in range(len(cu) - 1)]


def _vllm_spec_peer(kind, guard):
    """vLLM's recurrent kernels in their speculative form (batch 1, cu_seqlens, the pool as initial_state): per
    row with tokens, the start slot ssm_state_indices[b, num_accepted_tokens[b] - 1]; a row whose start index is
    <= 0 is skipped (outputs left unwritten, NaN here; KDA zeroes its first token's), otherwise the state after
    token j is stored into ssm_state_indices[b, j] when that index is > 0. The table is read without a column
    stride (kimi_k3's launcher asserts stride(1) == 1)."""
    def fn(q, k, v, g, beta, scale=None, initial_state=None, inplace_final_state=True, cu_seqlens=None,
           ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, **_):
        assert inplace_final_state and ssm_state_indices.dim() == 2 and ssm_state_indices.stride(1) == 1
        assert cu_seqlens.is_contiguous() and num_accepted_tokens.is_contiguous()
        with guard.kernel():
            o = torch.full(v.shape, float("nan"), dtype=q.dtype, device=q.device)
            idx = ssm_state_indices.tolist()
            for b, bos, eos, a in _spec_rows(cu_seqlens, num_accepted_tokens):
                if eos == bos:
                    continue
                if idx[b][a - 1] <= 0:
                    if kind == "kda":
                        o[0, bos] = 0
                    continue
                h = initial_state[idx[b][a - 1]][None].clone()
                for j, t in enumerate(range(bos, eos)):
                    r = slice(t, t + 1)
                    ot, h = _step(kind, q[0, r], k[0, r], v[0, r], g[0, r], beta[0, r], h, scale,
                                  use_qk_l2norm_in_kernel)
                    o[0, t] = ot[0].to(o.dtype)
                    if idx[b][j] > 0:
                        initial_state[idx[b][j]] = h[0].to(initial_state.dtype)
        return o, initial_state
    return fn


def _sglang_spec_peer(guard):
    """SGLang's fused_recurrent_gated_delta_rule_update in its target-verify form: every row from
    initial_state_source[initial_state_indices[b]] (zeros for a negative index), the state after token j
    recorded in intermediate_states_buffer[intermediate_state_indices[b], j] (none for a negative index), the
    source not written (disable_state_update)."""
    def fn(q, k, v, g, beta, scale=None, initial_state_source=None, initial_state_indices=None, cu_seqlens=None,
           use_qk_l2norm_in_kernel=False, disable_state_update=False, intermediate_states_buffer=None,
           intermediate_state_indices=None, cache_steps=None, **_):
        buf = intermediate_states_buffer
        assert disable_state_update and buf.is_contiguous() and cache_steps == buf.shape[1]
        with guard.kernel():
            o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
            src, idx = initial_state_source, initial_state_indices.tolist()
            cache = intermediate_state_indices.tolist()
            for b, bos, eos, _a in _spec_rows(cu_seqlens, torch.zeros(len(idx), dtype=torch.int32)):
                h = (src[idx[b]].float() if idx[b] >= 0 else torch.zeros(src.shape[1:]))[None].to(q.device)
                for j, t in enumerate(range(bos, eos)):
                    r = slice(t, t + 1)
                    ot, h = _step("gdn", q[0, r], k[0, r], v[0, r], g[0, r], beta[0, r], h, scale,
                                  use_qk_l2norm_in_kernel)
                    o[0, t] = ot[0].to(o.dtype)
                    if cache[b] >= 0:
                        buf[cache[b], j] = h[0].to(buf.dtype)
        return o
    return fn


def _fla_spec_peer(guard):
    """fla's fused_recurrent_kda_fwd in its speculative form (inplace_final_state, state_v_first): per row with
    tokens, the start slot ssm_state_indices[b, num_accepted_tokens[b] - 1] and the state after token j stored
    into ssm_state_indices[b, j], with no pad test (every index must be a slot of initial_state)."""
    def fn(q, k, v, g, beta, scale=None, initial_state=None, inplace_final_state=False, state_v_first=False,
           cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, **_):
        assert inplace_final_state and state_v_first and ssm_state_indices.dim() == 2
        with guard.kernel():
            o = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
            idx, n = ssm_state_indices.tolist(), initial_state.shape[0]
            for b, bos, eos, a in _spec_rows(cu_seqlens, num_accepted_tokens):
                if eos == bos:
                    continue
                assert all(0 <= s < n for s in idx[b]), f"fla's kernel reads and writes every index: {idx[b]}"
                h = initial_state[idx[b][a - 1]][None].clone()
                for j, t in enumerate(range(bos, eos)):
                    r = slice(t, t + 1)
                    ot, h = _step("kda", q[0, r], k[0, r], v[0, r], g[0, r], beta[0, r], h, scale,
                                  use_qk_l2norm_in_kernel)
                    o[0, t] = ot[0].to(o.dtype)
                    initial_state[idx[b][j]] = h[0].to(initial_state.dtype)
        return o, initial_state
    return fn


def _patch_spec_peers(monkeypatch, guard):
    monkeypatch.setattr(fla_adapter, "import_peer",
                        lambda name: types.SimpleNamespace(fused_recurrent_kda_fwd=_fla_spec_peer(guard)))
    vllm_ns = types.SimpleNamespace(fused_recurrent_gated_delta_rule=_vllm_spec_peer("gdn", guard),
                                    fused_recurrent_kda_fwd=_vllm_spec_peer("kda", guard))
    monkeypatch.setattr(vllm_adapter, "import_peer", lambda name: vllm_ns)
    sg_ns = types.SimpleNamespace(fused_recurrent_gated_delta_rule_update=_sglang_spec_peer(guard))
    monkeypatch.setattr(sglang_adapter, "import_peer", lambda name: sg_ns)
    monkeypatch.setattr(sglang_adapter, "_on_gpu", lambda t, what: None)


SPEC_CASES = [  # (slot table, row lengths, num_accepted_tokens, num_slots); pad -1; vLLM's slot ids > 0
    ([[3, 1, 5], [7, -1, 4], [2, 6, 8]], [3, 2, 0], [2, 1, 3], 10),  # a pad position, a row without tokens
    ([[4, 3, 2, 1]], [1], [4], 5),  # one token from the last position
    ([[1, 2]], [2], [2], 4),  # position 1 writes the slot the row started from
    ([[2, -1, 3], [5, 6, 7]], [3, 2], [2, 3], 8),  # row 0 padding (start slot = pad id) with tokens
    ([[-1, 2, 3], [4, -1, 5]], [2, 3], [1, 2], 6),  # padding rows only
]
SPEC_PEERS = [("vllm", "gated_delta_rule_update_spec"), ("vllm", "kda_update_spec"),
              ("sglang", "gated_delta_rule_update_spec"), ("fla", "kda_update_spec")]


@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("table,lens,accepted,num_slots", SPEC_CASES, ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("peer,op", SPEC_PEERS)
def test_spec_decode_wrapper_reads_nothing_on_the_host(monkeypatch, guard, device, peer, op, table, lens, accepted,
                                                        num_slots, layout):
    """Inside no_index_checks() the speculative GDN / KDA wrapper runs with every host read raising, its peer
    kernel a stand-in that reads the slot table as the peer's kernel does: the live rows' outputs and the slots
    of their written positions equal the float64 reference and the call outside no_index_checks(); every other
    slot keeps its bits (a NaN-poisoned one included). fla's pad outputs are zero (its adapter masks them)."""
    _patch_spec_peers(monkeypatch, guard)
    sp = SPECS[op]
    kind = "kda" if op.startswith("kda") else "gdn"
    fn = getattr(ADAPTERS[peer], op)
    Hk, Hv, K, V = (2, 4, 4, 3) if kind == "gdn" else (2, 2, 4, 3)
    T = sum(lens)
    q, k, v, g, beta = activations(kind, 0, T, Hk, Hv, K, V, torch.float32, device)
    pool = make_pool(num_slots, (Hv, V, K), torch.float32, device, layout=layout, seed=1)
    named = {s for row in table for s in row}
    pool[[s for s in range(num_slots) if s not in named][-1]] = float("nan")
    before = pool.clone()
    i32 = dict(dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + [sum(lens[:b + 1]) for b in range(len(lens))], **i32)
    idx, acc = torch.tensor(table, **i32), torch.tensor(accepted, **i32)
    args = (q, k, v, g, beta)
    ref_pool = before.clone()
    y_ref = sp.reference(torch.float64, *args, ref_pool, qsl, idx, acc, use_qk_l2norm=True)

    with guard.armed():
        o = fn(*args, pool, qsl, idx, acc, use_qk_l2norm=True)
    live = [b for b in range(len(lens)) if lens[b] and table[b][accepted[b] - 1] != PAD_SLOT_ID]
    live_tok = [t for b in live for t in range(int(qsl[b]), int(qsl[b + 1]))]
    written = [table[b][j] for b in live for j in range(lens[b]) if table[b][j] != PAD_SLOT_ID]
    torch.testing.assert_close(o.cpu().double()[live_tok], y_ref.cpu().double()[live_tok], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool.cpu().double()[written], ref_pool.cpu().double()[written], rtol=1e-5,
                               atol=1e-6)
    assert_untouched(before, pool, written, name=f"{peer} {op} pool")
    pad_tok = [t for t in range(T) if t not in live_tok]
    if peer == "fla":
        assert bool((o[pad_tok] == 0).all()), f"{peer} {op}: pad rows' tokens should be zero, got {o[pad_tok]}"

    pool2 = before.clone()
    o2 = fn(*args, pool2, qsl, idx, acc, use_qk_l2norm=True)  # outside no_index_checks(): host reads allowed
    torch.testing.assert_close(o2.cpu()[live_tok], o.cpu()[live_tok], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pool2[written], pool[written], rtol=1e-6, atol=1e-7)
    assert_untouched(before, pool2, written, name=f"{peer} {op} pool (host path)")
    if not live:
        assert not bool(o2.any()), f"{peer} {op}: a step without a live row gives zeros (no kernel runs)"


@pytest.mark.parametrize("op", ["gated_delta_rule_update_spec", "kda_update_spec"])
def test_vllm_spec_table_reaches_the_kernel_with_unit_column_stride(monkeypatch, guard, device, op):
    """vLLM's recurrent kernels read the slot table at b * stride(0) + j: a table whose columns are strided
    (here a transposed view) reaches the kernel as a copy with stride(1) == 1 and the same ids."""
    _patch_spec_peers(monkeypatch, guard)
    sp = SPECS[op]
    kw = sp.inputs(dict(sp.shapes["contract"][0]), torch.float32, device, torch.Generator().manual_seed(0))
    kw["state_indices"] = kw["state_indices"].t().contiguous().t()
    assert kw["state_indices"].stride(1) != 1
    ref = {a: (t.clone() if isinstance(t, torch.Tensor) else t) for a, t in kw.items()}
    y = sp.call(vllm_adapter.OPS[op], kw)
    y_ref = sp.call(lambda *a, **o: sp.reference(torch.float64, *a, **o), ref)
    torch.testing.assert_close(y.double(), y_ref.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kw["ssm_states"].double(), ref["ssm_states"].double(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ conv and Mamba decode

def _recorder(calls, guard):
    def fn(*a, **kw):
        with guard.kernel():
            calls.append((a, kw))
            out = kw.get("out")
            return out if out is not None else a[0].clone()
    return fn


@pytest.mark.parametrize("slots", [[2, -1], [-1, -1]], ids=["pad", "pads_only"])
@pytest.mark.parametrize("op", ["causal_conv1d_update", "selective_state_update"])
@pytest.mark.parametrize("peer", ["vllm", "sglang"])
def test_mamba_decode_reaches_the_kernel_without_host_reads(monkeypatch, guard, device, peer, op, slots):
    """Inside no_index_checks() the conv and Mamba-2 state updates hand the caller's slot ids to the kernel
    (pads included: the kernels skip them) with no host read."""
    calls = []
    ns = types.SimpleNamespace(causal_conv1d_update=_recorder(calls, guard),
                               selective_state_update=_recorder(calls, guard))
    monkeypatch.setattr(ADAPTERS[peer], "import_peer", lambda name: ns)
    if peer == "sglang":
        monkeypatch.setattr(sglang_adapter, "_on_gpu", lambda t, what: None)
    sp = SPECS[op]
    kw = sp.inputs(dict(sp.shapes["contract"][0], B=len(slots)), torch.float32, device,
                   torch.Generator().manual_seed(0))
    key = "conv_state_indices" if op == "causal_conv1d_update" else "state_batch_indices"
    kw[key] = torch.tensor(slots, dtype=torch.int32, device=device)
    if op == "selective_state_update":
        kw["dt_softplus"] = True  # (without it the case is declined inside no_index_checks(): the next test)
    with guard.armed():
        getattr(ADAPTERS[peer], op)(*[kw[a] for a in sp.args], **{k: kw[k] for k in sp.options if k in kw})
    assert len(calls) == 1, f"{peer} {op}: expected one kernel call, got {len(calls)}"
    passed = calls[0][1][key]
    assert passed.device == kw[key].device and passed.tolist() == slots


@pytest.mark.parametrize("peer", ["vllm", "sglang"])
def test_state_update_without_softplus_declined_inside_no_index_checks(monkeypatch, guard, device, peer):
    """Without dt_softplus the peers do not clamp a negative dt at 0; inside no_index_checks() dt is not read
    on the host to rule one out, so the case is declined (outside, a non-negative dt runs)."""
    if peer == "sglang":
        monkeypatch.setattr(sglang_adapter, "_on_gpu", lambda t, what: None)
    sp = SPECS["selective_state_update"]
    kw = sp.inputs(dict(sp.shapes["contract"][0]), torch.float32, device, torch.Generator().manual_seed(0))
    kw["dt_softplus"] = False
    with guard.armed(), pytest.raises(NotImplementedError, match="no_index_checks"):
        ADAPTERS[peer].selective_state_update(*[kw[a] for a in sp.args],
                                              **{k: kw[k] for k in sp.options if k in kw})


@pytest.mark.parametrize("op", ["gated_delta_rule_update", "kda_update", "causal_conv1d_update",
                                "selective_state_update"])
def test_benchmark_decode_slots_are_not_vllm_null_block(op):
    """Inside no_index_checks() vLLM's adapter does not look for a live request on slot 0 (its kernels' null
    block): the benchmark's decode inputs name slots 1..B only, for every benchmark shape."""
    sp = SPECS[op]
    for where in ("cpu", "gpu"):
        for shape in sp.shapes[where]:
            idx, _ = I.slots(shape, shape["B"], "cpu")
            assert int(idx.min()) >= 1, f"{op} {where} shape {shape}: slot ids {idx.tolist()}"
    kw = sp.inputs(dict(sp.shapes["cpu"][0]), torch.float32, "cpu", torch.Generator().manual_seed(0))
    idx = kw["state_indices" if "state_indices" in kw else
             ("conv_state_indices" if "conv_state_indices" in kw else "state_batch_indices")]
    assert int(idx.min()) >= 1


@pytest.mark.parametrize("op", ["gated_delta_rule_update_spec", "kda_update_spec"])
def test_benchmark_spec_slots_are_not_vllm_null_block(op):
    """The same for the speculative GDN / KDA steps: the benchmark's slot tables name slots 1.. only."""
    from harness.ops import _spec_decode as layouts
    for where in ("cpu", "gpu", "aot"):
        for shape in SPECS[op].shapes.get(where, []):
            table = layouts.layout(shape, "cpu")["state_indices"]
            assert int(table.min()) >= 1, f"{op} {where} shape {shape}: slot ids {table.tolist()}"


# ------------------------------------------------------------------------------ CUDA graph, real kernels

DECODE_OPS = ["gated_delta_rule_update", "kda_update", "causal_conv1d_update", "selective_state_update"]
_INDEX_ARG = {"gated_delta_rule_update": "state_indices", "kda_update": "state_indices",
              "causal_conv1d_update": "conv_state_indices", "selective_state_update": "state_batch_indices"}
_CAPTURE_SLOTS = ([1, -1, 3, 4, -1, 6, 7, 8], [-1, 2, 5, -1, 8, 1, -1, 3])  # B = 8, pool slots 0..8; > 0 (vLLM)


def _capturable(device, peer, op):
    """(the peer's op, its spec) for a CUDA-graph capture test; skips without CUDA, the peer or the op."""
    if not device.startswith("cuda"):
        pytest.skip("needs a CUDA device (CUDA-graph capture of the peers' Triton kernels)")
    from harness.impls.registry import get
    impl = get(peer)
    why = impl.why_unavailable(device)
    if why:
        pytest.skip(why)
    if op not in impl.ops:
        pytest.skip(f"{peer} does not provide {op}")
    return impl.ops[op], SPECS[op]


def _captured(peer, call, pool0, pool_g, index):
    """`call(pool, index)` once eagerly with index checks on (compiles and autotunes the kernels; a decline
    skips), once on a side stream inside no_index_checks(), then captured in a CUDA graph on `pool_g` and the
    static `index` tensors. Returns (the graph, its output)."""
    try:
        call(pool0.clone(), tuple(t.clone() for t in index))
    except NotImplementedError as e:
        pytest.skip(f"{peer} declines the case: {e}")
    with no_index_checks():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call(pool0.clone(), index)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g = call(pool_g, index)
    return graph, y_g


@pytest.mark.parametrize("op,shape", [(op, sh) for op in DECODE_OPS for sh in SPECS[op].shapes["cpu"]],
                         ids=lambda v: v if isinstance(v, str) else "_".join(f"{k}{x}" for k, x in v.items()))
@pytest.mark.parametrize("peer", ["fla", "vllm", "sglang"])
def test_peer_decode_captures_in_cuda_graph(device, peer, op, shape):
    """With the real kernels (CUDA): the decode op captured in a CUDA graph inside no_index_checks() and
    replayed for two batches of slot ids (pads included) gives the eager call's live outputs and pool."""
    fn, sp = _capturable(device, peer, op)
    kw = sp.inputs(dict(shape), torch.float32, device, torch.Generator().manual_seed(0))
    assert kw[sp.pool].shape[0] == 9 and kw[_INDEX_ARG[op]].shape[0] == 8, "the slot batches below are for B = 8"
    key = _INDEX_ARG[op]
    pool0 = kw[sp.pool].clone()

    def call(pool, idx):
        args = dict(kw, **{sp.pool: pool, key: idx})
        return fn(*[args[a] for a in sp.args], **{k: args[k] for k in sp.options if k in args})

    idx = torch.tensor(_CAPTURE_SLOTS[0], dtype=torch.int32, device=device)
    pool_g = pool0.clone()
    graph, y_g = _captured(peer, lambda pool, i: call(pool, *i), pool0, pool_g, (idx,))
    for slots in _CAPTURE_SLOTS:
        idx.copy_(torch.tensor(slots, dtype=torch.int32))
        pool_g.copy_(pool0)
        graph.replay()
        pool_e = pool0.clone()
        y_e = call(pool_e, idx.clone())
        torch.cuda.synchronize()
        live = [b for b, s in enumerate(slots) if s != PAD_SLOT_ID]
        named = [s for s in slots if s != PAD_SLOT_ID]
        torch.testing.assert_close(y_g[live], y_e[live], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool_g[named], pool_e[named], rtol=1e-5, atol=1e-6)
        assert_untouched(pool0, pool_g, named, name=f"{peer} {op} pool (graph)")


SPEC_CAPTURE_OPS = ["gated_delta_rule_update_spec", "kda_update_spec"]


@pytest.mark.parametrize("op", SPEC_CAPTURE_OPS)
@pytest.mark.parametrize("peer", ["fla", "vllm", "sglang"])
def test_peer_spec_decode_captures_in_cuda_graph(device, peer, op):
    """With the real kernels (CUDA): the speculative GDN / KDA step captured in a CUDA graph inside
    no_index_checks() and replayed for two slot tables and accepted counts (a padding row and a pad position
    in the second; slot ids > 0, vLLM's null block being 0) gives the eager call's live outputs and pool."""
    fn, sp = _capturable(device, peer, op)
    kw = sp.inputs(dict(sp.shapes["cpu"][0]), torch.float32, device, torch.Generator().manual_seed(0))
    table0, acc0 = kw["state_indices"].clone(), kw["num_accepted_tokens"].clone()
    Bsz, S = table0.shape
    num_slots = kw[sp.pool].shape[0]
    g = torch.Generator().manual_seed(1)
    table1 = (torch.randperm(num_slots - 1, generator=g)[:Bsz * S] + 1).reshape(Bsz, S).to(table0)
    table1[1] = PAD_SLOT_ID  # a padding row
    table1[3, S - 1] = PAD_SLOT_ID  # a position whose state is not kept
    acc1 = torch.randint(1, S + 1, (Bsz,), generator=g).to(acc0)
    acc1[3] = 1
    qsl = kw["query_start_loc"].tolist()
    pool0 = kw[sp.pool].clone()
    table, acc = table0.clone(), acc0.clone()

    def call(pool, t, a):
        args = dict(kw, **{sp.pool: pool, "state_indices": t, "num_accepted_tokens": a})
        return fn(*[args[x] for x in sp.args], **{k: args[k] for k in sp.options if k in args})

    pool_g = pool0.clone()
    graph, y_g = _captured(peer, lambda pool, i: call(pool, *i), pool0, pool_g, (table, acc))
    for t, a in ((table0, acc0), (table1, acc1)):
        table.copy_(t)
        acc.copy_(a)
        pool_g.copy_(pool0)
        graph.replay()
        pool_e = pool0.clone()
        y_e = call(pool_e, t.clone(), a.clone())
        torch.cuda.synchronize()
        tl, al = t.tolist(), a.tolist()
        live = [b for b in range(Bsz) if tl[b][al[b] - 1] != PAD_SLOT_ID]
        tok = [i for b in live for i in range(qsl[b], qsl[b + 1])]
        named = [tl[b][j] for b in live for j in range(qsl[b + 1] - qsl[b]) if tl[b][j] != PAD_SLOT_ID]
        torch.testing.assert_close(y_g[tok], y_e[tok], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool_g[named], pool_e[named], rtol=1e-5, atol=1e-6)
        assert_untouched(pool0, pool_g, named, name=f"{peer} {op} pool (graph)")
