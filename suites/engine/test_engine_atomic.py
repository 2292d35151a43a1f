"""Scheduler, state pool and prefix cache calls are all-or-nothing: a call that raises changes no state
(snapshot before == snapshot after) and can be retried; slot ids and request ids are checked clearly."""
import re

import pytest
import torch
from hypothesis import given, strategies as st

from harness.engine import PrefixCache, Request, Scheduler, StatePool
from reference.cache import Mamba1Spec, Mamba2Spec

SPEC = Mamba2Spec(num_heads=2, head_dim=3, state_size=4, n_groups=1, conv_kernel=3, conv_dtype=torch.float32)
OTHER = Mamba1Spec(intermediate_size=6, state_size=3, conv_kernel=4, conv_dtype=torch.float32)


def _pool(spec=SPEC, slots=3):
    return StatePool(spec, 2, slots)


def pool_state(pool):
    return {"allocated": sorted(pool.allocated), "free": pool.lowest_free(pool.num_slots),
            "tensors": [t.clone() for t in pool.conv_states + pool.recurrent_states]}


def cache_state(cache):
    if cache is None:
        return None
    return {"entries": [(k, toks, id(snap)) for k, (toks, snap) in cache._entries.items()],
            "stats": (cache.hits, cache.misses, cache.evictions, cache.inserts)}


def sched_state(s):
    return {"waiting": [r.id for r in s.waiting],
            "running": [(rid, st.slot, st.num_computed, st.num_cached, tuple(st.output))
                        for rid, st in s.running.items()],
            "finished": {k: tuple(v) for k, v in s.finished.items()}, "ids": set(s._ids),
            "pending": id(s._pending), "steps": s.step_count,
            "pool": pool_state(s.pool), "cache": cache_state(s.prefix_cache)}


def assert_same(a, b):
    """Equal snapshots (tensors compared exactly)."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        elif k == "tensors":
            assert len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k
        else:
            assert a[k] == b[k], k


def fails_and_changes_nothing(obj_state, call, match, exc=ValueError):
    before = obj_state()
    with pytest.raises(exc, match=match):
        call()
    assert_same(before, obj_state())


# ==================================================================== scheduler.update

@pytest.mark.parametrize("bad", ["x", 1.5, -1, True, None, torch.tensor([3]), torch.tensor(2.0)])
def test_update_with_a_bad_token_in_a_later_entry_changes_nothing(bad):
    """A bad sampled token for the LAST sampling entry leaves the earlier entries unadvanced; the retry
    with good tokens counts every entry once."""
    s = Scheduler(_pool(), 16)
    s.add(Request("a", range(3), 2))
    s.add(Request("b", range(4), 2))
    b = s.schedule()
    assert [e.request_id for e in b if e.sample] == ["a", "b"]
    fails_and_changes_nothing(lambda: sched_state(s), lambda: s.update(b, {"a": 5, "b": bad}),
                              r"^sampled\['b'\]: expected a token id")
    assert s.update(b, {"a": 5, "b": torch.tensor(6)}) == []
    assert (s.state("a").num_computed, s.state("a").output) == (3, [5])
    assert (s.state("b").num_computed, s.state("b").output) == (4, [6])


def test_update_rejects_wrong_sampled_sets_and_types_without_change():
    s = Scheduler(_pool(), 16)
    s.add(Request("a", range(3), 1))
    b = s.schedule()
    state = lambda: sched_state(s)  # noqa: E731
    fails_and_changes_nothing(state, lambda: s.update(b, {"a": 1, "zzz": 2}), r"^sampled: expected tokens for exactly")
    fails_and_changes_nothing(state, lambda: s.update(b, [("a", 1)]), r"^sampled: expected a dict")
    assert s.update(b, {"a": 1}) == ["a"] and s.finished == {"a": [1]} and s.pool.num_used == 0


# ==================================================================== scheduler.schedule

def _mismatched_cache():
    """A prefix cache holding, under tokens 0..7, a snapshot of ANOTHER model (it cannot be restored)."""
    other = _pool(OTHER)
    cache = PrefixCache("all", 8, 4)
    cache.insert(list(range(8)), other.snapshot(other.alloc()))
    return cache


def test_admission_with_a_snapshot_that_does_not_fit_changes_nothing():
    """A prefix-cache hit whose snapshot does not fit the pool: schedule() raises (naming the request and
    the cache) with no slot allocated, the request still waiting and the cache's LRU order and counters
    untouched; after the cache is cleared the same request is admitted normally."""
    pool = _pool()
    cache = _mismatched_cache()
    s = Scheduler(pool, 32, prefix_cache=cache)
    s.add(Request("run", range(100, 103), 3))
    b = s.schedule()
    s.update(b, {"run": 1})
    s.add(Request("hit", list(range(12)), 1))
    fails_and_changes_nothing(lambda: sched_state(s), s.schedule,
                              r"^prefix cache: the snapshot of the first 8 tokens of request 'hit' does not fit")
    assert pool.num_used == 1 and [r.id for r in s.waiting] == ["hit"]
    cache.clear()
    b = s.schedule()
    assert [(e.request_id, e.slot, e.start) for e in b] == [("hit", 1, 0), ("run", 0, 3)]


def test_chunk_fn_failure_on_a_later_admission_changes_nothing():
    """A chunk_fn that returns a bad size for the second new request: the first is not admitted either."""
    calls = []

    def chunk_fn(rid, start, cap):
        calls.append(rid)
        return cap + 1 if rid == "b" and len(calls) < 3 else cap
    s = Scheduler(_pool(), 16, chunk_fn=chunk_fn)
    s.add(Request("a", range(3), 1))
    s.add(Request("b", range(3), 1))
    fails_and_changes_nothing(lambda: sched_state(s), s.schedule,
                              r"^chunk_fn: expected a chunk size in 1\.\.3 \(request 'b' at 0\)")
    b = s.schedule()
    assert [(e.request_id, e.slot, e.num_tokens) for e in b] == [("a", 0, 3), ("b", 1, 3)]


# ==================================================================== request ids

@pytest.mark.parametrize("rid", [["a"], {"a": 1}, {1, 2}, torch.zeros(2)])
def test_unhashable_request_id_is_a_clear_value_error(rid):
    """An unhashable id is refused at Request() (not a TypeError later); state()/finish() with one too."""
    if isinstance(rid, torch.Tensor):  # tensors hash by identity: allowed, like any hashable object
        assert Request(rid, [1], 1).id is rid
        return
    with pytest.raises(ValueError, match=r"^id: expected a hashable request id"):
        Request(rid, [1], 1)
    s = Scheduler(_pool(), 8)
    s.add(Request("a", [1], 2))
    s.schedule()
    state = lambda: sched_state(s)  # noqa: E731
    fails_and_changes_nothing(state, lambda: s.state(rid), r"^request_id: expected a hashable request id")
    fails_and_changes_nothing(state, lambda: s.finish(rid), r"^request_id: expected a hashable request id")


@pytest.mark.parametrize("tok", [1.5, "3", True, -2, torch.tensor([1])])
def test_prompt_tokens_must_be_token_ids(tok):
    """A float, string, bool, negative or 1-d tensor token is refused (1.5 is not silently token 1)."""
    with pytest.raises(ValueError, match=r"^prompt\[1\]: expected a token id"):
        Request("a", [0, tok], 1)
    assert Request("a", [0, torch.tensor(7)], 1).prompt == (0, 7)


# ==================================================================== pool

def test_tensor_slot_ids_are_slot_ids():
    """A 0-d integer tensor is the slot id it holds: free(torch.tensor(slot)) frees an allocated slot
    (never "which is free"); 1-d, float and bool tensors and Python floats/bools are refused clearly,
    changing nothing."""
    pool = _pool()
    a, b = pool.alloc(), pool.alloc()
    assert pool.is_allocated(torch.tensor(a)) and pool.is_allocated(torch.tensor(b, dtype=torch.int32))
    snap = pool.snapshot(torch.tensor(a))
    pool.restore(torch.tensor(b), snap)
    ps = lambda: pool_state(pool)  # noqa: E731
    for bad, what in ((torch.tensor([a]), "a tensor of shape (1,)"), (torch.tensor(float(a)), "torch.float32"),
                      (torch.tensor(True), "torch.bool"), (1.0, "1.0"), (True, "True")):
        fails_and_changes_nothing(ps, lambda: pool.free(bad), r"^slot: expected an int slot id.*" + re.escape(what))
    pool.free(torch.tensor(a))
    assert pool.allocated == frozenset({b}) and not pool.is_allocated(a)
    fails_and_changes_nothing(ps, lambda: pool.free(torch.tensor(a)), r"^slot: expected an allocated slot id, got 0, "
                                                                       r"which is free")
    fails_and_changes_nothing(ps, lambda: pool.gather(0, torch.tensor([[b]])), r"^slots: expected a sequence")
    assert pool.gather(0, torch.tensor([b, -1]))[1].shape[0] == 2


def test_scatter_checks_both_states_before_writing_either():
    """scatter() with a good conv and a bad recurrent writes neither."""
    pool = _pool()
    s = pool.alloc()
    conv = torch.ones((1, *pool.conv(0).shape[1:]))
    bad_rec = torch.ones((1, 99))
    fails_and_changes_nothing(lambda: pool_state(pool), lambda: pool.scatter(0, [s], conv, bad_rec),
                              r"^recurrent: expected a tensor of shape")
    pool.scatter(0, [s], conv, torch.ones((1, *pool.recurrent(0).shape[1:])))
    assert bool((pool.conv(0)[s] == 1).all()) and bool((pool.recurrent(0)[s] == 1).all())


def test_prefix_cache_peek_changes_nothing():
    """peek() answers like lookup() without counting or refreshing; lookup() then counts the hit."""
    cache = PrefixCache("all", 8, 2)
    cache.insert(list(range(8)), "s8")
    cache.insert(list(range(100, 108)), "other")
    before = cache_state(cache)
    assert cache.peek(list(range(12))) == (8, "s8") and cache.peek([5] * 9) == (0, None)
    assert cache_state(cache) == before
    assert cache.lookup(list(range(12))) == (8, "s8") and cache.cached_lengths == [8, 8]
    assert (cache.hits, cache.misses) == (1, 0) and cache_state(cache) != before


# ==================================================================== property

@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 3)), min_size=1, max_size=4), st.integers(1, 12),
       st.integers(1, 3), st.data())
def test_failing_calls_interleaved_with_a_run_change_nothing(reqs, budget, slots, data):
    """Drive requests to completion; before each update, a bad update (a bad token for a random sampling
    entry, or a wrong key set), and each schedule first tried with a chunk_fn that fails on a random call:
    each failing call changes nothing, and the run gives exactly the steps and outputs of an undisturbed
    one."""
    def run(disturb):
        fail_at = []

        def chunk_fn(rid, start, cap):
            if fail_at and fail_at[0] == 0:
                fail_at.clear()
                return 0
            if fail_at:
                fail_at[0] -= 1
            return min(cap, 5)
        s = Scheduler(_pool(slots=slots), budget, chunk_fn=chunk_fn)
        for i, (plen, new) in enumerate(reqs):
            s.add(Request(i, range(10 * i, 10 * i + plen), new))
        log = []
        while True:
            if disturb:  # chunk_fn returns 0 on its k-th call of this step (if it gets that far)
                fail_at[:] = [data.draw(st.integers(0, 3))]
                before = sched_state(s)
                try:
                    b = s.schedule()
                except ValueError:
                    assert_same(before, sched_state(s))
                    fail_at.clear()
                    b = s.schedule()
                fail_at.clear()
            else:
                b = s.schedule()
            if b is None:
                break
            good = {e.request_id: len(log) + e.request_id for e in b if e.sample}
            if disturb and good:
                bad = dict(good)
                victim = data.draw(st.sampled_from(sorted(good)))
                if data.draw(st.booleans()):
                    bad[victim] = data.draw(st.sampled_from([-1, 0.5, "t", None]))
                else:
                    del bad[victim]
                fails_and_changes_nothing(lambda: sched_state(s), lambda: s.update(b, bad), r"^sampled")
            s.update(b, good)
            log.append([(e.request_id, e.slot, e.start, e.num_tokens) for e in b])
        return log, s.finished
    assert run(True) == run(False)
