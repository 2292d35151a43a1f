"""vLLM's own Mamba metadata builder against the semantics of ours (harness.engine.metadata).

vLLM 0.33.0 builds the SSD chunk grid of a prefill batch on the host in
`vllm/v1/attention/backends/mamba_attn.py::BaseMambaAttentionMetadataBuilder._compute_chunk_metadata`
and derives the prefill context lengths (has_initial_states = num_computed_tokens > 0) from CPU data in
`_prefill_cpu_metadata`. Both are imported from vLLM itself (installed, or extracted by
`python scripts/peers_fetch.py vllm` and put on PYTHONPATH by scripts/peers_setup.sh) and checked with
hypothesis against `request_chunks` / `build_metadata`:

* chunks end at multiples of chunk_size counted from each request's num_computed_tokens (its absolute
  position), never cross a request, and the last chunk of each request is where ours says;
* a checkpoint that falls on a chunk boundary leaves the grid unchanged and names the chunk ending there;
* num_computed_tokens and has_initial_states per prefill request equal ours, with decodes in the batch;
* the vllm adapter's on-device grid (harness.impls.adapters.vllm.chunk_metadata, sequences from position 0)
  is vLLM's grid with num_computed_tokens = 0.
"""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.engine.metadata import build_metadata, request_chunks

try:
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder as _Builder
except Exception as _e:  # noqa: BLE001 - any import failure means vLLM is not here
    pytest.skip(f"vllm not importable ({type(_e).__name__}: {_e}); install vllm==0.33.0 or run "
                "python scripts/peers_fetch.py vllm and put .peers/src on PYTHONPATH", allow_module_level=True)

CHUNKS = st.sampled_from([4, 8, 16, 64, 256])
PREFILL = st.tuples(st.integers(0, 300), st.integers(1, 300))  # (num_computed_tokens, scheduled tokens)


def _vllm_chunks(chunk, computed, scheduled, ckpt=None):
    qsl = torch.tensor([0] + [sum(scheduled[:i + 1]) for i in range(len(scheduled))], dtype=torch.int32)
    return _Builder._compute_chunk_metadata(chunk, len(scheduled), torch.tensor(computed, dtype=torch.int32),
                                            qsl, ckpt)


@settings(max_examples=200, deadline=None)
@given(chunk=CHUNKS, reqs=st.lists(PREFILL, min_size=1, max_size=6))
def test_chunk_grid_is_ours(chunk, reqs):
    computed, scheduled = [c for c, _ in reqs], [n for _, n in reqs]
    cu, seq_idx, last, ckpt = _vllm_chunks(chunk, computed, scheduled)
    cu_ref, seq_ref, last_ref, ends = request_chunks(computed, scheduled, chunk)
    assert cu == cu_ref, f"cu_chunk_seqlens: vLLM {cu}, ours {cu_ref} (chunk {chunk}, requests {reqs})"
    assert seq_idx == seq_ref, f"seq_idx: vLLM {seq_idx}, ours {seq_ref}"
    assert last == last_ref, f"last_chunk_indices: vLLM {last}, ours {last_ref}"
    assert ckpt == [-1] * len(reqs)
    for i, (c, n) in enumerate(reqs):  # every chunk end is a multiple of chunk_size or the request's end
        assert all(e % chunk == 0 or e == c + n for e in ends[i])


@settings(max_examples=200, deadline=None)
@given(chunk=CHUNKS, reqs=st.lists(PREFILL, min_size=1, max_size=5), data=st.data())
def test_checkpoint_on_a_chunk_boundary(chunk, reqs, data):
    """vLLM forces a chunk end at each checkpoint; one that falls on a multiple of chunk_size changes
    nothing in the grid, and its index is the chunk that ends there in ours."""
    computed, scheduled = [c for c, _ in reqs], [n for _, n in reqs]
    offsets = []
    for c, n in reqs:
        inside = [m - c for m in range((c // chunk + 1) * chunk, c + n, chunk)]  # boundaries strictly inside
        offsets.append(data.draw(st.sampled_from([0] + inside)))
    cu, seq_idx, last, ckpt = _vllm_chunks(chunk, computed, scheduled, offsets)
    cu_ref, seq_ref, last_ref, ends = request_chunks(computed, scheduled, chunk)
    assert (cu, seq_idx, last) == (cu_ref, seq_ref, last_ref), f"grid with checkpoints {offsets} differs"
    for i, off in enumerate(offsets):
        if off == 0:
            assert ckpt[i] == -1
        else:
            first = last_ref[i] - len(ends[i]) + 1
            assert ckpt[i] == first + ends[i].index(computed[i] + off), (i, off, ckpt, ends[i])


@settings(max_examples=200, deadline=None)
@given(prefills=st.lists(PREFILL, min_size=1, max_size=5), decodes=st.lists(st.integers(1, 500), max_size=4))
def test_prefill_context_lengths_and_initial_state_flags(prefills, decodes):
    """vLLM orders decodes first; its prefill context lengths come from seq_lens - query_lens on the host
    and has_initial_states_p = num_computed_tokens > 0 (the rule of our build_metadata)."""
    nd = len(decodes)
    q_lens = [1] * nd + [n for _, n in prefills]
    seq_lens = [c + 1 for c in decodes] + [c + n for c, n in prefills]
    qsl = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    cam = types.SimpleNamespace(seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
                                query_start_loc_cpu=qsl)
    computed_p, qsl_p = _Builder._prefill_cpu_metadata(None, cam, len(q_lens), len(prefills), nd)
    entries = [types.SimpleNamespace(slot=i, start=c, num_tokens=n, is_decode=False, track=False)
               for i, (c, n) in enumerate(prefills)]
    entries += [types.SimpleNamespace(slot=len(prefills) + j, start=c, num_tokens=1, is_decode=True, track=False)
                for j, c in enumerate(decodes)]
    md = build_metadata(entries, chunk_size=8)
    P = len(prefills)
    assert computed_p.tolist() == md.num_computed_tokens[:P].tolist()
    assert (computed_p > 0).tolist() == md.prefill_has_initial_states.tolist()
    assert qsl_p.tolist() == md.prefill_query_start_loc.tolist()


@settings(max_examples=100, deadline=None)
@given(chunk=CHUNKS, lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6))
def test_adapter_grid_is_vllms(chunk, lengths):
    from harness.impls.adapters.vllm import chunk_metadata
    qsl = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    cu, last, seq = chunk_metadata(qsl, chunk)
    cu_v, seq_v, last_v, _ = _vllm_chunks(chunk, [0] * len(lengths), lengths)
    assert (cu.tolist(), seq.tolist(), last.tolist()) == (cu_v, seq_v, last_v)
