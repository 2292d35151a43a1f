"""SGLang's Mamba-2 metadata builder against the reference semantics (harness.engine.metadata).

What SGLang 0.5.23 computes once per forward for its Mamba-2 / linear-attention layers
(`sglang.srt.layers.attention.mamba.mamba2_metadata.Mamba2Metadata`), imported from SGLang itself:

* `_query_start_loc_to_chunk_indices_offsets`: the logical chunks of the packed prefill stream that
  mamba_chunk_scan_combined consumes (`chunk_indices` / `chunk_offsets`), against
  `harness.engine.metadata.chunk_indices_offsets`;
* `prepare_mixed`: the prefix-cache flags (`has_initial_states`, which must be `extend_prefix_lens > 0` and
  nothing else: neither narrowed by the radix-cache track mask nor widened to requests without a cached
  prefix), `seq_idx`, and whether the chunk tables are built (only when some request has a prefix).

Runs on the CPU (plain tensor code). Skipped where sglang is not importable (CI): locally,
`python scripts/peers_fetch.py sglang` and `PYTHONPATH=$PWD/.peers/src`.
"""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from harness.engine.metadata import build_metadata, chunk_indices_offsets

try:
    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata, Mamba2Metadata
    _MISSING = None
except Exception as e:  # noqa: BLE001 - any import failure means the peer cannot be checked here
    _MISSING = (f"sglang not importable ({type(e).__name__}: {e}); run `python scripts/peers_fetch.py sglang` "
                "and put .peers/src on PYTHONPATH")

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


def _qsl(lengths):
    q = [0]
    for n in lengths:
        q.append(q[-1] + n)
    return q


def _sglang_chunks(q, chunk_size):
    ci, co = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(
        torch.tensor(q, dtype=torch.int32), chunk_size, q[-1])
    return ci.tolist(), co.tolist()


@settings(max_examples=300)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=6), st.sampled_from([1, 2, 4, 8, 16, 64, 256]))
@example([5, 7, 28], 4)       # a start inside a chunk, a start on a boundary
@example([64, 64], 64)        # every boundary aligned
def test_sglang_chunk_indices_offsets_match_reference(lengths, chunk_size):
    """For prefill requests of >= 1 token (all SGLang schedules), SGLang's logical chunks are the reference's:
    one entry per run of one sequence inside one global chunk, with its offset in that chunk."""
    q = _qsl(lengths)
    assert _sglang_chunks(q, chunk_size) == chunk_indices_offsets(q, chunk_size)


@pytest.mark.xfail(strict=True, reason="sglang 0.5.23 Mamba2Metadata._query_start_loc_to_chunk_indices_offsets: "
                   "an empty sequence adds a logical chunk (or indexes past the table); see docs/findings.md")
@pytest.mark.parametrize("lengths,chunk_size", [([3, 0, 2], 4), ([35, 0], 4), ([18, 0], 2)],
                         ids=["empty-mid", "empty-last", "empty-last-on-boundary"])
def test_sglang_chunk_indices_offsets_empty_sequence(lengths, chunk_size):
    """An empty sequence owns no token, so it adds no logical chunk (the reference); SGLang counts its start
    as an interior start: [3, 0, 2] with chunk 4 gives indices [0, 0, 0, 1] / offsets [0, 3, 3, 0] instead
    of [0, 0, 1] / [0, 3, 0]; [18, 0] with chunk 2 raises IndexError."""
    q = _qsl(lengths)
    assert _sglang_chunks(q, chunk_size) == chunk_indices_offsets(q, chunk_size)


class _Mode:
    def __init__(self, decode=False):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_target_verify(self):
        return False


def _forward_batch(lengths, prefix, track, slots):
    """The attributes of an SGLang ForwardBatch that prepare_mixed reads (an extend batch, no speculation)."""
    mode = _Mode()
    return SimpleNamespace(
        extend_num_tokens=sum(lengths), forward_mode=mode, logical_forward_mode=mode,
        extend_seq_lens_cpu=list(lengths), extend_seq_lens=torch.tensor(lengths, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix, lengths)], dtype=torch.int32), spec_info=None,
        mamba_track_mask=torch.tensor(track, dtype=torch.bool),
        mamba_track_indices=torch.tensor(slots, dtype=torch.int64))


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 70), st.booleans()), min_size=1, max_size=6),
       st.sampled_from([4, 8, 64]))
def test_sglang_prefix_flags_match_reference(reqs, chunk_size):
    """prepare_mixed's has_initial_states is the reference's (num_computed_tokens > 0) whatever the track
    mask: a request with a cached prefix starts from it even when it is not tracked (the gate too strict),
    a request without one never reads its slot (the gate too permissive); seq_idx names each token's request;
    the chunk tables exist exactly when some request has a prefix, and then match the reference."""
    lengths = [n for n, _, _ in reqs]
    prefix = [p for _, p, _ in reqs]
    track = [t for _, _, t in reqs]
    slots = list(range(1, len(reqs) + 1))
    q = _qsl(lengths)
    fm = ForwardMetadata(query_start_loc=torch.tensor(q, dtype=torch.int32),
                         mamba_cache_indices=torch.tensor(slots, dtype=torch.int32),
                         has_mamba_track_mask=any(track))
    md = Mamba2Metadata.prepare_mixed(fm, chunk_size, _forward_batch(lengths, prefix, track, slots))
    mixed = md.mixed_metadata
    entries = [SimpleNamespace(slot=s, start=p, num_tokens=n, is_decode=False, track=t)
               for s, p, n, t in zip(slots, prefix, lengths, track)]
    ref = build_metadata(entries, chunk_size=chunk_size)
    assert (md.num_prefills, md.num_decodes, md.num_prefill_tokens) == (len(reqs), 0, q[-1])
    assert mixed.has_initial_states.tolist() == ref.has_initial_states.tolist()
    assert mixed.prep_initial_states == any(p > 0 for p in prefix)
    assert mixed.seq_idx.tolist() == [ref.seq_idx.tolist()]
    if mixed.prep_initial_states:
        assert (mixed.chunk_indices.tolist(), mixed.chunk_offsets.tolist()) == (
            ref.chunk_indices.tolist(), ref.chunk_offsets.tolist())
    else:
        assert mixed.chunk_indices is None and mixed.chunk_offsets is None
    # flipping every track flag changes no seeding flag
    flipped = [not t for t in track]
    md2 = Mamba2Metadata.prepare_mixed(
        ForwardMetadata(query_start_loc=fm.query_start_loc, mamba_cache_indices=fm.mamba_cache_indices,
                        has_mamba_track_mask=any(flipped)),
        chunk_size, _forward_batch(lengths, prefix, flipped, slots))
    assert torch.equal(md2.mixed_metadata.has_initial_states, mixed.has_initial_states)
