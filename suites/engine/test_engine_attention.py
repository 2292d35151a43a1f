"""The engine's full-attention pieces (harness/engine/attention.py): the paged KV pool, the hybrid pool's
snapshots, and paged attention over a mixed step against the plain reference attention."""
from __future__ import annotations

import pytest
import torch

from harness.engine.attention import HybridPool, KVPool, paged_attention, token_positions
from harness.engine.metadata import build_metadata
from harness.engine.pool import PAD_SLOT_ID, Snapshot
from harness.engine.scheduler import BatchEntry
from reference.attention import causal_attention
from reference.cache import GDNSpec, KVSpec

KV = KVSpec(num_kv_heads=2, k_head_dim=4, v_head_dim=3, dtype=torch.float64)


def test_engine_kv_pool_pages():
    """Tokens written across page boundaries read back in order; pages come from the free list (lowest
    first), the pool doubles when they run out, a released slot's pages return poisoned with NaN, and a
    write beyond the reserved pages is a ValueError naming the positions."""
    kv = KVPool(KV, 2, page_size=4, num_pages=2)
    k, v = torch.randn(7, 2, 4, dtype=torch.float64), torch.randn(7, 2, 3, dtype=torch.float64)
    kv.reserve(5, 7)
    assert kv.pages(5) == [0, 1]
    kv.write(1, 5, 0, k[:3], v[:3])
    kv.write(1, 5, 3, k[3:], v[3:])
    kv.set_length(5, 7)
    got_k, got_v = kv.read(1, 5, 7)
    assert torch.equal(got_k, k) and torch.equal(got_v, v) and kv.length(5) == 7
    kv.reserve(2, 9)  # 3 pages: the pool grows
    assert kv.num_pages >= 5 and kv.pages(2) == [2, 3, 4]
    kv.release(5)
    assert kv.length(5) == 0 and torch.isnan(kv.k[1][[0, 1]]).all() and {0, 1} <= set(kv._free)
    with pytest.raises(ValueError, match=r"^positions: expected tokens below the 12 reserved for slot 2"):
        kv.write(0, 2, 10, k[:4], v[:4])
    with pytest.raises(ValueError, match=r"^num_tokens: expected at most the 12 tokens reserved"):
        kv.set_length(2, 13)


def test_engine_hybrid_pool_snapshots():
    """A hybrid pool's snapshot holds the mixer states and the first num_tokens keys/values of every
    attention layer; it restores into another slot (fresh pages), and one with keys of another length or a
    missing entry is refused before anything changes."""
    spec = GDNSpec(num_k_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=4, conv_kernel=3,
                   conv_dtype=torch.float64, recurrent_dtype=torch.float64)
    pool = HybridPool(spec, 1, 3, kv_spec=KV, num_attention_layers=2, page_size=4, dtype=torch.float64)
    a, b = pool.alloc(zero=True), pool.alloc(zero=True)
    pool.kv.reserve(a, 6)
    for layer in range(2):
        pool.kv.write(layer, a, 0, torch.full((6, 2, 4), layer + 1.0, dtype=torch.float64),
                      torch.full((6, 2, 3), -layer - 1.0, dtype=torch.float64))
    pool.kv.set_length(a, 6)
    snap = pool.snapshot(a, num_tokens=5)
    assert sorted(snap) == ["conv.0", "kv.0.k", "kv.0.v", "kv.1.k", "kv.1.v", "recurrent.0"]
    assert snap["kv.1.k"].shape == (5, 2, 4) and (snap["kv.1.v"] == -2).all()
    pool.restore(b, snap)
    assert pool.kv.length(b) == 5 and torch.equal(pool.kv.read(1, b, 5)[0], snap["kv.1.k"])
    bad = Snapshot({**snap, "kv.1.k": snap["kv.1.k"][:4]}, snap.model_key, 5)
    with pytest.raises(ValueError, match=r"^snapshot: expected keys and values of 5 tokens in every attention"):
        pool.restore(b, bad)
    missing = Snapshot({k: t for k, t in snap.items() if k != "kv.0.v"}, snap.model_key, 5)
    with pytest.raises(ValueError, match=r"^snapshot: expected keys \["):
        pool.check_snapshot(missing)
    assert pool.kv.length(b) == 5
    pool.free(b)
    assert pool.kv.length(b) == 0 and pool.kv.pages(b) == []


def test_engine_hybrid_pool_slot_groups_share_their_keys_and_values():
    """A slot group (speculative decoding) keeps its keys and values in its first slot: every other slot of the
    group reads, writes, reserves and snapshots the first one's pages; zeroing or restoring the group's state
    keeps the links; freeing the group unlinks and releases, and a freed slot starts without pages."""
    spec = GDNSpec(num_k_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=4, conv_kernel=3,
                   conv_dtype=torch.float64, recurrent_dtype=torch.float64)
    pool = HybridPool(spec, 1, 4, kv_spec=KV, num_attention_layers=1, page_size=4, dtype=torch.float64)
    group = pool.alloc_group(3, zero=True)
    home, other = group[0], group[2]
    k, v = torch.randn(5, 2, 4, dtype=torch.float64), torch.randn(5, 2, 3, dtype=torch.float64)
    pool.kv.reserve(other, 5)
    pool.kv.write(0, other, 0, k, v)
    pool.kv.set_length(group[1], 5)
    assert pool.kv.pages(home) == pool.kv.pages(other) != [] and pool.kv.length(home) == 5
    assert torch.equal(pool.kv.read(0, home, 5)[0], k)
    snap = pool.snapshot(other, num_tokens=3)
    assert torch.equal(snap["kv.0.v"], v[:3])
    pool.zero_(other)
    pool.restore(home, snap)
    assert pool.kv.home(other) == home and pool.kv.length(other) == 3
    with pytest.raises(ValueError, match=r"^home: expected a slot other than"):
        pool.kv.link(home, other)
    pool.free_group(group)
    lone = pool.alloc()
    assert all(pool.kv.home(s) == s for s in group) and pool.kv.pages(lone) == [] and pool.kv.length(lone) == 0


def test_engine_paged_attention_matches_plain_attention():
    """Paged attention over a mixed step (a prefill continuing from 5 cached tokens, a fresh prefill, a
    decode row, a pad row) equals plain causal attention per request over its whole history, grouped
    query heads included; the pad row reads and writes nothing."""
    g = torch.Generator().manual_seed(0)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    kv = KVPool(KV, 1, page_size=4, num_pages=2)
    hist = {0: (rn(5, 2, 4), rn(5, 2, 3)), 1: (rn(0, 2, 4), rn(0, 2, 3)), 2: (rn(9, 2, 4), rn(9, 2, 3))}
    for slot, (k, v) in hist.items():
        kv.reserve(slot, k.shape[0])
        kv.write(0, slot, 0, k, v)
        kv.set_length(slot, k.shape[0])
    entries = [BatchEntry("a", 0, 5, 3, False, (0,) * 3), BatchEntry("b", 1, 0, 4, False, (0,) * 4),
               BatchEntry("c", 2, 9, 1, True, (0,)), BatchEntry("pad", PAD_SLOT_ID, 0, 1, True, (0,))]
    md = build_metadata(entries)
    T = 9
    q, k, v = rn(T, 4, 4), rn(T, 2, 4), rn(T, 2, 3)
    for e in entries[:3]:
        kv.reserve(e.slot, e.end)
    out = paged_attention(kv, 0, md, q, k, v, 0.5)
    assert token_positions(md).tolist() == [5, 6, 7, 0, 1, 2, 3, 9, 0]
    rows = [(0, 3), (3, 7), (7, 8)]
    for (a, b), e in zip(rows, entries):
        k0, v0 = hist[e.slot]
        want = causal_attention(q[a:b], torch.cat([k0, k[a:b]]), torch.cat([v0, v[a:b]]), e.start, 0.5)
        torch.testing.assert_close(out[a:b], want, rtol=1e-12, atol=1e-12)
    assert (out[8] == 0).all() and PAD_SLOT_ID not in kv._tables
