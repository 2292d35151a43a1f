"""Engine units: state pool, scheduler, step metadata, prefix cache (harness/engine/).

The model runner and the scenario suites live elsewhere; here each piece is tested alone, plus one
toy end-to-end loop (a float64 toy mixer driven through pool/scheduler/metadata/prefix cache) that must
equal the plain sequential computation.
"""
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, strategies as st

from harness.engine import (PAD_SLOT_ID, Batch, BatchEntry, PoolExhausted, PrefixCache, Request, Scheduler,
                            Snapshot, StatePool, build_metadata, chunk_indices_offsets)
from reference.cache import GDNSpec, KDASpec, Mamba1Spec, Mamba2Spec

SPECS = [
    Mamba1Spec(intermediate_size=6, state_size=3, conv_kernel=4, conv_dtype=torch.bfloat16),
    Mamba2Spec(num_heads=4, head_dim=3, state_size=5, n_groups=2, conv_kernel=3, conv_dtype=torch.float16),
    GDNSpec(num_k_heads=1, num_v_heads=2, head_k_dim=3, head_v_dim=5, conv_kernel=2),
    KDASpec(num_heads=2, head_dim=3, conv_kernel=4, conv_dtype=torch.float32),
]
layouts = st.sampled_from(["layer_major", "page_major"])
specs = st.sampled_from(SPECS)


def _pool(spec, layout="layer_major", channels_last=False, layers=2, slots=4, **kw):
    return StatePool(spec, layers, slots, layout=layout, conv_channels_last=channels_last, **kw)


def _everything(pool):
    return [t.clone() for t in pool.conv_states + pool.recurrent_states]


# ==================================================================== pool

@given(specs, layouts, st.booleans(), st.integers(1, 3), st.integers(1, 5), st.data())
def test_pool_views_are_disjoint(spec, layout, channels_last, layers, slots, data):
    """Views have the logical shapes (conv (slots, conv_dim, K-1), recurrent (slots, *shape)); writing one
    (layer, slot, state) changes nothing else, bit for bit, in any layout."""
    pool = _pool(spec, layout, channels_last, layers, slots)
    for layer in range(layers):
        assert tuple(pool.conv(layer).shape) == (slots, *spec.conv_shape)
        assert tuple(pool.recurrent(layer).shape) == (slots, *spec.recurrent_shape)
    layer = data.draw(st.integers(0, layers - 1))
    slot = data.draw(st.integers(0, slots - 1))
    kind = data.draw(st.sampled_from(["conv", "recurrent"]))
    before = _everything(pool)
    view = getattr(pool, kind)(layer)
    view[slot] = torch.arange(1, view[slot].numel() + 1, dtype=torch.float64).reshape(view[slot].shape).to(view.dtype)
    after = _everything(pool)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if not torch.equal(a, b)]
    idx = layer + (0 if kind == "conv" else layers)
    assert changed == [idx]
    diff = (before[idx] != after[idx]).flatten(1).any(1)
    assert diff.nonzero().flatten().tolist() == [slot]


@given(specs, st.booleans(), st.integers(1, 3), st.integers(1, 4))
def test_page_major_is_one_buffer_with_per_slot_pages(spec, channels_last, layers, slots):
    """page_major: every view lives in the one byte buffer; a slot's states (all layers) lie inside its own
    page [slot*slot_bytes, (slot+1)*slot_bytes); dim-0 stride is the page, not numel(shape)."""
    pool = _pool(spec, "page_major", channels_last, layers, slots)
    base = pool.buffer.data_ptr()
    for t in pool.conv_states + pool.recurrent_states:
        assert t.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
        assert t.stride(0) * t.element_size() == pool.slot_bytes
        for s in range(slots):
            lo = t[s].data_ptr() - base
            span = (sum((n - 1) * st_ for n, st_ in zip(t[s].shape, t[s].stride())) + 1) * t.element_size()
            assert s * pool.slot_bytes <= lo and lo + span <= (s + 1) * pool.slot_bytes
    assert pool.slot_bytes >= layers * spec.bytes_per_slot
    if channels_last:
        assert pool.conv(0).stride()[1:] == (1, spec.conv_shape[0])


@given(st.lists(st.integers(-2, 6), max_size=40))
def test_alloc_free_model(ops):
    """alloc hands out the lowest free id and raises PoolExhausted when full; free(x) of a non-allocated,
    out-of-range or pad id is a ValueError; the pool's bookkeeping matches a plain set model."""
    pool = _pool(SPECS[0], slots=4)
    model = set()
    for op in ops:
        if op == 6:
            if len(model) == 4:
                with pytest.raises(PoolExhausted):
                    pool.alloc()
            else:
                s = pool.alloc()
                assert s == min(set(range(4)) - model)
                model.add(s)
        elif op in model:
            pool.free(op)
            model.remove(op)
        else:
            with pytest.raises(ValueError, match="^slot: "):
                pool.free(op)
        assert pool.allocated == model and pool.num_free == 4 - len(model)


def test_double_free_message():
    """A double free names the slot and says it is free."""
    pool = _pool(SPECS[0])
    s = pool.alloc()
    pool.free(s)
    with pytest.raises(ValueError, match=r"^slot: expected an allocated slot id, got 0, which is free"):
        pool.free(s)


@given(specs, layouts, st.data())
def test_gather_scatter_pad_and_untouched(spec, layout, data):
    """gather returns zeros for PAD_SLOT_ID rows and exact copies otherwise; scatter writes only the listed
    live slots (pad rows skipped, never wrapped to the last slot): every other slot is bitwise unchanged."""
    pool = _pool(spec, layout, slots=5)
    for _ in range(5):
        pool.alloc()
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    for t in pool.conv_states + pool.recurrent_states:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    slots = data.draw(st.lists(st.sampled_from([PAD_SLOT_ID, 0, 1, 2, 3, 4]), min_size=1, max_size=6)
                      .filter(lambda s: len([x for x in s if x >= 0]) == len({x for x in s if x >= 0})))
    conv, rec = pool.gather(1, slots)
    for i, s in enumerate(slots):
        if s == PAD_SLOT_ID:
            assert not conv[i].any() and not rec[i].any()
        else:
            assert torch.equal(conv[i], pool.conv(1)[s]) and torch.equal(rec[i], pool.recurrent(1)[s])
    before = _everything(pool)
    pool.scatter(1, slots, torch.full_like(conv, 7.0), torch.full_like(rec, 7.0))
    live = {s for s in slots if s >= 0}
    for i, (a, b) in enumerate(zip(before, _everything(pool))):
        for s in range(5):
            if s in live and i in (1, 2 + 1):
                assert (b[s] == 7).all()
            else:
                assert torch.equal(a[s], b[s]), (i, s)


def test_gather_scatter_reject_bad_slots():
    """Free slots, negative ids other than PAD_SLOT_ID, out-of-range ids and duplicates are ValueErrors."""
    pool = _pool(SPECS[1], slots=3)
    a = pool.alloc()
    with pytest.raises(ValueError, match=r"^slots\[1\]: .*free"):
        pool.gather(0, [a, 2])
    with pytest.raises(ValueError, match=r"^slots\[0\]: "):
        pool.gather(0, [-2])
    with pytest.raises(ValueError, match=r"^slots\[0\]: "):
        pool.gather(0, [3])
    c, r = pool.gather(0, [a, a])
    with pytest.raises(ValueError, match=r"^slots: expected distinct"):
        pool.scatter(0, [a, a], c, r)
    with pytest.raises(ValueError, match=r"^conv: "):
        pool.scatter(0, [a], c, None)
    with pytest.raises(ValueError, match=r"^layer: "):
        pool.conv(2)


@given(specs, layouts, layouts, st.booleans())
def test_snapshot_restore_roundtrip(spec, layout_a, layout_b, channels_last):
    """restore(snapshot(slot)) reproduces every layer's state bit for bit, across memory layouts; the
    snapshot is a clone (later writes to the pool don't change it)."""
    a = _pool(spec, layout_a, channels_last)
    b = _pool(spec, layout_b, not channels_last)
    sa, sb = a.alloc(), b.alloc()
    sb = b.alloc()  # a different slot id than sa
    g = torch.Generator().manual_seed(0)
    for t in a.conv_states + a.recurrent_states:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    snap = a.snapshot(sa, num_tokens=16)
    assert isinstance(snap, Snapshot) and snap.num_tokens == 16
    keep = snap.clone()
    a.conv(0)[sa] = 0
    assert all(torch.equal(snap[k], keep[k]) for k in snap)
    b.restore(sb, snap)
    for layer in range(2):
        assert torch.equal(b.conv(layer)[sb], snap[f"conv.{layer}"])
        assert torch.equal(b.recurrent(layer)[sb], snap[f"recurrent.{layer}"])


def test_restore_rejects_other_models():
    """Seeding from a snapshot of another model (spec), layer count, dtype, or a dict with the wrong
    keys/shapes is a ValueError naming the snapshot."""
    a = _pool(SPECS[1])
    s = a.alloc()
    others = [_pool(SPECS[3]), _pool(SPECS[1], layers=3), _pool(SPECS[1], dtype=torch.float64),
              _pool(Mamba2Spec(num_heads=4, head_dim=3, state_size=5, n_groups=1, conv_kernel=3,
                               conv_dtype=torch.float16))]
    for o in others:
        snap = o.snapshot(o.alloc())
        with pytest.raises(ValueError, match=r"^snapshot: expected a snapshot of this pool's model"):
            a.restore(s, snap)
    plain = dict(a.snapshot(s))
    a.restore(s, plain)  # a plain dict with the right tensors is accepted
    bad = dict(plain)
    bad["recurrent.1"] = bad["recurrent.1"].float()[..., :2]
    with pytest.raises(ValueError, match=r"^snapshot\['recurrent.1'\]: "):
        a.restore(s, bad)
    del bad["conv.0"]
    with pytest.raises(ValueError, match=r"^snapshot: expected keys"):
        a.restore(s, bad)
    with pytest.raises(ValueError, match=r"^slot: "):
        a.restore(3, plain)  # not allocated


def test_fill_free_poisons_only_free_slots():
    """fill_free_ NaN-fills exactly the free slots."""
    pool = _pool(SPECS[2], "page_major", slots=4)
    a, b = pool.alloc(), pool.alloc()
    pool.free(a)
    pool.fill_free_()
    for t in pool.conv_states + pool.recurrent_states:
        assert t[[0, 2, 3]].isnan().all() and not t[b].isnan().any()


def test_pool_rejects_bad_arguments():
    """Bad constructor arguments are ValueErrors naming the argument."""
    for kw, name in [(dict(spec="x", num_layers=1, num_slots=1), "spec"),
                     (dict(spec=SPECS[0], num_layers=0, num_slots=1), "num_layers"),
                     (dict(spec=SPECS[0], num_layers=1, num_slots=0), "num_slots"),
                     (dict(spec=SPECS[0], num_layers=1, num_slots=1, layout="rows"), "layout"),
                     (dict(spec=SPECS[0], num_layers=1, num_slots=1, dtype=torch.int32), "dtype"),
                     (dict(spec=SPECS[0], num_layers=1, num_slots=1, page_multiple=24), "page_multiple")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            StatePool(**kw)


# ==================================================================== scheduler

requests_st = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 5)), min_size=1, max_size=5)


def _run_schedule(sched, reqs):
    """Drive a scheduler with a fake sampler (token = step*100 + index); return the batches."""
    for i, (plen, new) in enumerate(reqs):
        sched.add(Request(i, list(range(1000 * i, 1000 * i + plen)), new))
    batches = []
    while (b := sched.schedule()) is not None:
        batches.append(b)
        sched.update(b, {e.request_id: len(batches) * 100 + e.request_id for e in b if e.sample})
        assert len(batches) < 1000
    return batches


@given(requests_st, st.integers(1, 24), st.integers(1, 4), st.booleans(), st.data())
def test_scheduler_properties(reqs, budget, slots, random_chunks, data):
    """Every step: <= token_budget tokens, prefills before decodes, distinct slots, decodes of 1 token.
    Per request: entries cover positions 0 .. P+max_new-2 exactly once, in order, contiguously; `sample`
    is set exactly on the chunk that ends the prompt and on decodes; decode tokens are the previous
    outputs; every request finishes with max_new_tokens outputs and all slots are freed."""
    pool = _pool(SPECS[0], slots=slots)
    chunk_fn = (lambda rid, start, cap: data.draw(st.integers(1, cap))) if random_chunks else None
    sched = Scheduler(pool, budget, chunk_fn=chunk_fn)
    batches = _run_schedule(sched, reqs)
    cover = {i: [] for i in range(len(reqs))}
    for b in batches:
        assert 1 <= b.num_tokens <= budget
        kinds = [e.is_decode for e in b]
        assert kinds == sorted(kinds)
        assert len(set(b.slots)) == len(b.slots)
        for e in b:
            assert e.num_tokens == len(e.tokens) and (not e.is_decode or e.num_tokens == 1)
            plen = reqs[e.request_id][0]
            assert e.sample == (e.is_decode or e.end == plen)
            cover[e.request_id].append((e.start, e.end))
    for i, (plen, new) in enumerate(reqs):
        spans = cover[i]
        assert spans[0][0] == 0 and spans[-1][1] == plen + new - 1
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert len(sched.finished[i]) == new
    assert pool.num_used == 0 and not sched.running and not sched.waiting


def test_scheduler_boundaries_anywhere_and_mixing():
    """Hand-checked: budget 7 over prompts of 10 and 3 tokens splits at 7 (not a power of two) and mixes
    a decode with a prefill in one step, prefill first."""
    pool = _pool(SPECS[0], slots=2)
    sched = Scheduler(pool, 7)
    sched.add(Request("a", range(10), 2))
    sched.add(Request("b", range(3), 3))
    got = []
    while (b := sched.schedule()) is not None:
        got.append([(e.request_id, e.slot, e.start, e.num_tokens, e.is_decode) for e in b])
        sched.update(b, {e.request_id: 1 for e in b if e.sample})
    assert got[0] == [("a", 0, 0, 7, False)]
    assert got[1] == [("a", 0, 7, 3, False), ("b", 1, 0, 3, False)]
    assert got[2] == [("a", 0, 10, 1, True), ("b", 1, 3, 1, True)]
    assert got[3] == [("b", 1, 4, 1, True)]
    assert len(got) == 4


def test_scheduler_waits_for_slots_and_respects_max_num_seqs():
    """With one slot, the second request waits until the first finishes; max_num_seqs caps a step."""
    pool = _pool(SPECS[0], slots=1)
    sched = Scheduler(pool, 100)
    sched.add(Request("a", range(4), 2))
    sched.add(Request("b", range(4), 1))
    b1 = sched.schedule()
    assert b1.request_ids == ["a"]
    sched.update(b1, {"a": 5})
    b2 = sched.schedule()
    assert b2.request_ids == ["a"] and b2.decodes
    sched.update(b2, {"a": 6})
    b3 = sched.schedule()
    assert b3.request_ids == ["b"] and b3.entries[0].slot == 0
    pool2 = _pool(SPECS[0], slots=4)
    s2 = Scheduler(pool2, 100, max_num_seqs=2)
    for r in "xyz":
        s2.add(Request(r, range(3), 1))
    assert len(s2.schedule()) == 2


def test_scheduler_rejects_bad_input():
    """token_budget 0, requests longer than max_model_len, empty prompts, duplicate ids, wrong sampled sets
    and schedule() twice without update() are rejected clearly."""
    pool = _pool(SPECS[0], slots=2)
    with pytest.raises(ValueError, match=r"^token_budget: expected an int >= 1, got 0"):
        Scheduler(pool, 0)
    sched = Scheduler(pool, 8, max_model_len=16)
    with pytest.raises(ValueError, match=r"^request: expected len\(prompt\) \+ max_new_tokens <= max_model_len=16"):
        sched.add(Request("long", range(15), 2))
    with pytest.raises(ValueError, match=r"^prompt: "):
        Request("e", [], 1)
    with pytest.raises(ValueError, match=r"^max_new_tokens: "):
        Request("e", [1], 0)
    sched.add(Request("a", range(3), 1))
    with pytest.raises(ValueError, match=r"^request: expected a new request id"):
        sched.add(Request("a", range(3), 1))
    b = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError, match=r"^sampled: "):
        sched.update(b, {})
    with pytest.raises(ValueError, match=r"^chunk_fn: "):
        s = Scheduler(_pool(SPECS[0]), 8, chunk_fn=lambda r, s, c: c + 1)
        s.add(Request("x", range(5), 1))
        s.schedule()


def test_scheduler_seeds_from_prefix_cache():
    """A request whose prompt starts with a cached prefix is admitted with start = cached length (at most
    len(prompt) - 1) and its slot holds the cached snapshot."""
    pool = _pool(SPECS[1], slots=2)
    cache = PrefixCache("all", 8, 4)
    donor = pool.alloc()
    pool.recurrent(0)[donor] = 3.0
    snap = pool.snapshot(donor)
    pool.free(donor)
    cache.insert(list(range(16)), snap)
    sched = Scheduler(pool, 64, prefix_cache=cache)
    sched.add(Request("hit", list(range(20)), 1))
    sched.add(Request("exact", list(range(16)), 1))  # whole prompt cached: 8 is the longest usable
    b = sched.schedule()
    (hit, exact) = b.entries
    assert (hit.start, hit.num_tokens) == (16, 4) and (exact.start, exact.num_tokens) == (0, 16)
    assert torch.equal(pool.recurrent(0)[hit.slot], snap["recurrent.0"])
    md = build_metadata(b, mode="all", block_size=8)
    assert md.has_initial_states.tolist() == [True, False]


# ==================================================================== metadata

def _entries(spec):
    """spec: list of (slot, start, num_tokens, is_decode, track)."""
    return [BatchEntry(i, s, st_, n, d, track=t) for i, (s, st_, n, d, t) in enumerate(spec)]


def test_metadata_hand_example():
    """Hand-computed metadata for: prefill A (slot 3) tokens [0, 5); prefill B (slot 0) tokens [12, 19)
    seeded and NOT tracked; prefill C (slot 1) tokens [4, 20) tracked; decode D (slot 2) at 15; block 8,
    chunk 4, mode all."""
    batch = Batch(tuple(_entries([(3, 0, 5, False, True), (0, 12, 7, False, False), (1, 4, 16, False, True),
                                   (2, 15, 1, True, True)])))
    md = build_metadata(batch, mode="all", block_size=8, chunk_size=4)
    assert md.query_start_loc.tolist() == [0, 5, 12, 28, 29] and md.query_start_loc.dtype == torch.int32
    assert (md.num_prefills, md.num_decodes, md.num_prefill_tokens, md.num_decode_tokens) == (3, 1, 28, 1)
    assert md.has_initial_states.tolist() == [False, True, True, True]
    assert md.state_indices.tolist() == [3, 0, 1, 2] and md.state_indices.dtype == torch.int32
    assert md.seq_lens.tolist() == [5, 19, 20, 16]
    assert md.snapshot_positions == ((), (), (8, 16), (16,))
    assert md.track_mask.tolist() == [False, False, True, True]
    # C: positions 8 and 16 -> 4th and 12th token of C, C starts at stream index 12
    assert md.snapshot_token_indices == ((), (), (15, 23), (28,))
    assert md.seq_idx.tolist() == [0] * 5 + [1] * 7 + [2] * 16 + [3]
    # packed prefill stream [0,5) [5,12) [12,28), global chunks of 4
    # (5 splits global chunk 1; 12 is on a boundary): 7 global chunks + 1 split
    assert md.chunk_indices.tolist() == [0, 1, 1, 2, 3, 4, 5, 6]
    assert md.chunk_offsets.tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    # per-request grid on absolute positions: A 0-4,4-5 | B 12-16,16-19 | C 4-8,8-12,12-16,16-20
    assert md.cu_chunk_seqlens.tolist() == [0, 4, 5, 9, 12, 16, 20, 24, 28]
    assert md.chunk_seq_idx.tolist() == [0, 0, 1, 1, 2, 2, 2, 2]
    assert md.last_chunk_indices.tolist() == [1, 3, 7]
    assert md.snapshot_chunk_indices == ((), (), (4, 6), (-1,))
    md_align = build_metadata(batch, mode="align", block_size=8, chunk_size=4)
    assert md_align.snapshot_positions == ((), (), (), (16,))
    md_none = build_metadata(batch, mode="none", block_size=8, chunk_size=4)
    assert not md_none.track_mask.any() and md_none.has_initial_states.tolist() == [False, True, True, True]


def test_chunk_indices_offsets_hand_example():
    """cu_seqlens [0,5,12,40,41], chunk 8: chunks 0 and 1 split at 5 and 12; 40 is on a boundary."""
    assert chunk_indices_offsets([0, 5, 12, 40, 41], 8) == ([0, 0, 1, 1, 2, 3, 4, 5], [0, 5, 0, 4, 0, 0, 0, 0])
    assert chunk_indices_offsets([0, 16], 8) == ([0, 1], [0, 0])


entry_lists = st.lists(st.tuples(st.integers(0, 70), st.integers(1, 40), st.booleans(), st.booleans()),
                       min_size=1, max_size=6)


@given(entry_lists, st.integers(0, 3), st.sampled_from(["none", "align", "all"]), st.sampled_from([8, 16, 32]),
       st.sampled_from([1, 4, 8, 16]), st.lists(st.booleans(), min_size=6, max_size=6))
def test_metadata_properties(raw, ndec, mode, block, chunk, mask):
    """query_start_loc is the int32 cumsum of the scheduled tokens; has_initial_states == (num_computed > 0)
    whatever the track mask (bug class 1); seq_idx names each token's request; every snapshot position is a
    block multiple inside its request's step, its token index is that request's token at that position,
    and track_mask == (tracked and has snapshots); chunk_indices/offsets tile the packed prefill stream with
    pieces of one sequence each, L = ceil(T/cs) + interior unaligned starts; the per-request chunks tile
    each request without crossing an absolute multiple of chunk_size; with block % chunk == 0 every
    prefill snapshot ends a chunk."""
    ents = [(i, s, n, False, t) for i, (s, n, t, _) in enumerate(raw)]
    ents += [(len(raw) + j, 5 + j, 1, True, True) for j in range(ndec)]
    S = len(ents)
    m = mask[:S] + [True] * max(0, S - 6)
    md = build_metadata(_entries(ents), track_mask=m, mode=mode, block_size=block, chunk_size=chunk)
    n = [e[2] for e in ents]
    start = [e[1] for e in ents]
    qsl = md.query_start_loc.tolist()
    assert md.query_start_loc.dtype == torch.int32 and qsl == [sum(n[:i]) for i in range(S + 1)]
    assert md.has_initial_states.tolist() == [s > 0 for s in start]
    # seeding is independent of tracking: flipping every track flag changes no has_initial_states
    md_flip = build_metadata(_entries(ents), track_mask=[not x for x in m], mode=mode, block_size=block,
                             chunk_size=chunk)
    assert torch.equal(md_flip.has_initial_states, md.has_initial_states)
    seq_idx = md.seq_idx.tolist()
    assert seq_idx == [i for i in range(S) for _ in range(n[i])]
    for i in range(S):
        pos, tok = md.snapshot_positions[i], md.snapshot_token_indices[i]
        assert md.track_mask[i].item() == (m[i] and bool(pos))
        if not m[i] or mode == "none":
            assert pos == ()
        for p, t in zip(pos, tok):
            assert p % block == 0 and start[i] < p <= start[i] + n[i]
            assert seq_idx[t] == i and t - qsl[i] + 1 == p - start[i]
    # mamba_ssm chunk indices / offsets over the prefill tokens
    T = md.num_prefill_tokens
    pre_starts = qsl[: md.num_prefills]
    ci, co = md.chunk_indices.tolist(), md.chunk_offsets.tolist()
    unaligned = sum(1 for s in pre_starts[1:] if s % chunk and s < T)
    assert len(ci) == -(-T // chunk) + unaligned
    piece_starts = [g * chunk + o for g, o in zip(ci, co)]
    assert piece_starts == sorted(piece_starts) and (not piece_starts or piece_starts[0] == 0)
    bounds = piece_starts + [T]
    for g, a, b in zip(ci, bounds, bounds[1:]):
        assert g * chunk <= a < b <= (g + 1) * chunk
        assert len(set(seq_idx[a:b])) == 1
    # per-request chunk grid
    cu = md.cu_chunk_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == T
    cseq = md.chunk_seq_idx.tolist()
    for k, (a, b) in enumerate(zip(cu, cu[1:])):
        r = cseq[k]
        assert b > a and set(seq_idx[a:b]) == {r}
        abs_a = start[r] + a - qsl[r]
        assert (abs_a // chunk) == ((abs_a + b - a - 1) // chunk)
    assert [cu[k + 1] for k in md.last_chunk_indices.tolist()] == qsl[1: md.num_prefills + 1]
    if block % chunk == 0:
        for i in range(md.num_prefills):
            for p, k in zip(md.snapshot_positions[i], md.snapshot_chunk_indices[i]):
                assert k >= 0 and cseq[k] == i and start[i] + cu[k + 1] - qsl[i] == p


def test_metadata_rejects_bad_batches():
    """Prefill after decode, multi-token decodes, bad mode/block/chunk sizes and mismatched per-request
    lists are ValueErrors naming the argument."""
    e = _entries([(0, 0, 3, True, True)])
    with pytest.raises(ValueError, match=r"^batch\[0\].num_tokens: "):
        build_metadata(e)
    e = _entries([(0, 0, 1, True, True), (1, 0, 3, False, True)])
    with pytest.raises(ValueError, match=r"^batch\[1\]: "):
        build_metadata(e)
    ok = _entries([(0, 0, 3, False, True)])
    for kw, name in [(dict(mode="some"), "mode"), (dict(block_size=12), "block_size"),
                     (dict(chunk_size=0), "chunk_size"), (dict(track_mask=[True, False]), "track_mask"),
                     (dict(num_computed_tokens=[-1]), r"num_computed_tokens\[0\]")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            build_metadata(ok, **kw)
    with pytest.raises(ValueError, match=r"^batch\[0\].slot: "):
        build_metadata(_entries([(-3, 0, 3, False, True)]))
    with pytest.raises(ValueError, match=r"^entries\[1\]: "):
        Batch(tuple(_entries([(0, 0, 1, True, True), (1, 0, 3, False, True)])))


def test_metadata_pad_requests_take_no_snapshot():
    """A pad request (slot PAD_SLOT_ID) is never tracked."""
    md = build_metadata(_entries([(PAD_SLOT_ID, 0, 16, False, True)]), mode="all", block_size=8)
    assert md.snapshot_positions == ((),) and not md.track_mask.any()
    assert md.state_indices.tolist() == [PAD_SLOT_ID]


# ==================================================================== prefix cache

tok_lists = st.lists(st.integers(0, 2), min_size=0, max_size=48)


@given(st.lists(st.tuples(st.sampled_from(["ins", "look"]), tok_lists, st.integers(0, 60)), max_size=30),
       st.integers(1, 5))
def test_prefix_cache_matches_lru_model(ops, capacity):
    """Against a plain OrderedDict LRU model keyed by the token tuple: lookup returns the longest stored
    whole-block prefix of at most max_tokens tokens (refreshing it), insert stores/refreshes and evicts the
    least recently used beyond capacity; unaligned inserts are ValueErrors naming tokens_prefix."""
    bs = 8
    cache = PrefixCache("all", bs, capacity)
    model = OrderedDict()
    for kind, toks, lim in ops:
        if kind == "ins":
            if not toks or len(toks) % bs:
                with pytest.raises(ValueError, match="^tokens_prefix: "):
                    cache.insert(toks, object())
                continue
            snap = ("snap", tuple(toks))
            assert cache.insert(toks, snap)
            model[tuple(toks)] = snap
            model.move_to_end(tuple(toks))
            while len(model) > capacity:
                model.popitem(last=False)
        else:
            n, snap = cache.lookup(toks, max_tokens=lim)
            best = max((len(k) for k in model if len(k) <= min(lim, len(toks)) and tuple(toks[:len(k)]) == k),
                       default=0)
            assert n == best
            if n:
                assert snap == model[tuple(toks[:n])]
                model.move_to_end(tuple(toks[:n]))
            else:
                assert snap is None
        assert cache.cached_lengths == [len(k) for k in model]


def test_prefix_cache_modes_and_errors():
    """mode none stores nothing and always misses; block sizes must be positive multiples of 8; capacity
    >= 1; a prefix with equal length but other tokens never hits."""
    none = PrefixCache("none", 8, 4)
    assert none.insert(list(range(8)), "s") is False and none.lookup(list(range(8))) == (0, None)
    c = PrefixCache("align", 16, 2)
    c.insert(list(range(16)), "s16")
    assert c.lookup(list(range(20))) == (16, "s16")
    assert c.lookup(list(range(1, 17))) == (0, None)
    assert c.lookup(list(range(16)), max_tokens=15) == (0, None)
    assert list(range(16)) in c and list(range(8)) not in c
    for kw, name in [(dict(mode="x"), "mode"), (dict(block_size=12), "block_size"), (dict(block_size=0), "block_size"),
                     (dict(capacity=0), "capacity")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            PrefixCache(**kw)
    with pytest.raises(ValueError, match="^max_tokens: "):
        c.lookup([1, 2], max_tokens=-1)


# ==================================================================== toy end-to-end loop

def _toy_step(conv, rec, x):
    """A toy mixer on one token: conv window shift + linear recurrence; returns (y, conv, rec)."""
    window = torch.cat([conv, x[:, None].expand(-1, 1)], dim=1)  # (D, K)
    y_conv = window.mean(1)
    rec = 0.9 * rec + y_conv[:, None] * torch.linspace(0.5, 1.5, rec.shape[1], dtype=rec.dtype)
    return rec.sum(1), window[:, 1:], rec


def _toy_token(y) -> int:
    return int(torch.floor(y.abs().sum() * 7)) % 11


def _toy_sequential(prompt, new, D, N, K, layers):
    conv = [torch.zeros(D, K - 1, dtype=torch.float64) for _ in range(layers)]
    rec = [torch.zeros(D, N, dtype=torch.float64) for _ in range(layers)]
    out, feed = [], list(prompt)
    while len(out) < new:
        for tok in feed:
            x = torch.full((D,), float(tok) / 10, dtype=torch.float64)
            for layer in range(layers):
                x, conv[layer], rec[layer] = _toy_step(conv[layer], rec[layer], x)
        out.append(_toy_token(x))
        feed = [out[-1]]
    return out


@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 4)), min_size=1, max_size=4), st.integers(1, 20),
       st.sampled_from(["none", "align", "all", "all"]), st.data())
def test_toy_engine_loop_equals_sequential(reqs, budget, mode, data):
    """Driving a toy float64 mixer through pool + scheduler + build_metadata + prefix cache (seeding and
    snapshots at the metadata's positions), with prompts sharing prefixes and chunk boundaries anywhere,
    gives the same tokens as running each request alone from scratch. This is the loop the model runner
    implements; it fails if has_initial_states is ANDed with the track mask or snapshots land at the
    wrong positions."""
    D, N, K, L = 3, 2, 3, 2
    spec = Mamba1Spec(intermediate_size=D, state_size=N, conv_kernel=K)
    pool = StatePool(spec, L, 3, dtype=torch.float64, layout="page_major")
    cache = PrefixCache(mode, 8, 16)
    sched = Scheduler(pool, budget, prefix_cache=cache, chunk_fn=lambda rid, s, cap: data.draw(st.integers(1, cap)))
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    prompts = [base[:plen] if i % 2 == 0 else base[:plen // 2] + [i] * (plen - plen // 2)
               for i, (plen, _) in enumerate(reqs)]

    def run():
        steps = 0
        while (batch := sched.schedule()) is not None:
            steps += 1
            md = build_metadata(batch, mode=mode, block_size=8, chunk_size=4)
            ys = {}
            for i, e in enumerate(batch):
                conv0, rec0 = [], []
                for layer in range(L):
                    c, r = pool.gather(layer, [e.slot])
                    if not md.has_initial_states[i]:
                        c, r = torch.zeros_like(c), torch.zeros_like(r)
                    conv0.append(c[0])
                    rec0.append(r[0])
                snaps = set(md.snapshot_positions[i])
                for k, tok in enumerate(e.tokens):
                    x = torch.full((D,), float(tok) / 10, dtype=torch.float64)
                    for layer in range(L):
                        x, conv0[layer], rec0[layer] = _toy_step(conv0[layer], rec0[layer], x)
                    pos = e.start + k + 1
                    if pos in snaps:
                        snap = Snapshot({**{f"conv.{l}": conv0[l].clone() for l in range(L)},
                                         **{f"recurrent.{l}": rec0[l].clone() for l in range(L)}},
                                        pool.model_key, pos)
                        cache.insert(sched.tokens(e.request_id)[:pos], snap)
                for layer in range(L):
                    pool.scatter(layer, [e.slot], conv0[layer][None], rec0[layer][None])
                ys[e.request_id] = x
            sched.update(batch, {e.request_id: _toy_token(ys[e.request_id]) for e in batch if e.sample})
            assert steps < 500

    # two waves: the first request alone (it fills the cache), then the others together (seeded from it)
    for wave in ([0], range(1, len(reqs))):
        for i in wave:
            sched.add(Request(i, prompts[i], reqs[i][1], track=i == 0 or data.draw(st.booleans())))
        run()
    for i, (plen, new) in enumerate(reqs):
        assert sched.finished[i] == _toy_sequential(prompts[i], new, D, N, K, L), i
    if mode == "all" and len(reqs) > 2 and reqs[0][0] >= 8 and reqs[2][0] >= 9:
        assert cache.hits > 0  # request 2 shares request 0's first block, snapshotted in mode all


# ==================================================================== op-contract compatibility

@given(st.integers(2, 40), st.integers(1, 16), st.booleans(), st.data())
def test_pool_and_metadata_drive_the_op_contract(plen, budget, channels_last, data):
    """The pool's (page-major, strided) views and build_metadata's query_start_loc / state_indices /
    has_initial_states feed harness.ops' varlen ops directly: running the `reference` impl's conv + SSD
    chunk by chunk (chunks from the scheduler, a pad request appended to every step) gives the same
    outputs and final states as one reference call over the whole prompt, and the pad request's slot
    id -1 never touches a live slot."""
    from harness.impls import registry
    from reference.conv1d import causal_conv1d
    from reference.ssd import ssd_scan
    ops = registry.get("reference").ops
    H, P, N, G, K = 2, 2, 3, 1, 4
    spec = Mamba2Spec(num_heads=H, head_dim=P, state_size=N, n_groups=G, conv_kernel=K)
    pool = StatePool(spec, 1, 3, dtype=torch.float64, layout="page_major", conv_channels_last=channels_last)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    Dc = spec.conv_dim
    xs = torch.randn(plen, Dc, generator=g, dtype=torch.float64)
    w = torch.randn(Dc, K, generator=g, dtype=torch.float64)
    dts = torch.randn(plen, H, generator=g, dtype=torch.float64)
    A = -torch.rand(H, generator=g, dtype=torch.float64)
    sched = Scheduler(pool, budget, chunk_fn=lambda rid, s, cap: data.draw(st.integers(1, cap)))
    sched.add(Request("r", list(range(plen)), 1))
    ys = []
    while (b := sched.schedule()) is not None:
        e = b.entries[0]
        pad = BatchEntry("pad", PAD_SLOT_ID, 3, 2, False)
        md = build_metadata(tuple(b.entries) + (pad,), chunk_size=4)
        x = torch.cat([xs[e.start:e.end], torch.full((2, Dc), float("nan"), dtype=torch.float64)])
        dt = torch.cat([dts[e.start:e.end], torch.zeros(2, H, dtype=torch.float64)])
        before = pool.recurrent(0).clone()
        y = ops["causal_conv1d_varlen"](x, w, None, pool.conv(0), md.query_start_loc, md.state_indices,
                                        md.has_initial_states, activation="silu")
        xbc = y
        xh = xbc[:, : H * P].reshape(-1, H, P)
        Bm = xbc[:, H * P: H * P + G * N].reshape(-1, G, N)
        Cm = xbc[:, H * P + G * N:].reshape(-1, G, N)
        out = ops["ssd_varlen"](xh, dt, A, Bm, Cm, 4, None, None, None, pool.recurrent(0), md.query_start_loc,
                                md.state_indices, md.has_initial_states)
        for s in range(3):
            if s != e.slot:
                assert torch.equal(pool.recurrent(0)[s], before[s])
        ys.append(out[: e.num_tokens])
        sched.update(b, {"r": 0} if e.sample else {})
    yc, conv_final = causal_conv1d(xs, w, activation="silu")
    y_ref, ssm_final = ssd_scan(yc[:, : H * P].reshape(-1, H, P), dts, A, yc[:, H * P: H * P + G * N].reshape(-1, G, N),
                                yc[:, H * P + G * N:].reshape(-1, G, N))
    assert torch.allclose(torch.cat(ys), y_ref, rtol=1e-10, atol=1e-10)
    slot = 0  # the only request held slot 0 (lowest free id)
    assert torch.allclose(pool.conv(0)[slot], conv_final[0]) and torch.allclose(pool.recurrent(0)[slot], ssm_final[0])
