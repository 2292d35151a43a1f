"""Bad input to the engine runner: clear ValueErrors (argument, expected, got), and no other request's
state touched (pool buffers and prefix cache bitwise unchanged, the runner still usable)."""
import pytest
import torch

from harness.engine.pool import Snapshot
from harness.engine.scheduler import Request
from harness.scenarios import RunnerFactory, tiny_model

MAKE = RunnerFactory("reference", dtype=torch.float64)
PROMPT = tuple(range(1, 20))


def _warm_runner(**kw):
    """A runner that already served a request (its cache holds snapshots, its free slots hold NaN)."""
    r = MAKE(tiny_model("mamba1", 0), num_slots=2, token_budget=8, cache_mode="all", block_size=8,
             max_model_len=32, **kw)
    r.run([Request("warm", PROMPT, 2)])
    return r


def _state(r):
    pool = [t.clone() for t in r.pool.conv_states + r.pool.recurrent_states]
    return pool, list(r.cache.cached_lengths), r.cache.inserts, r.pool.allocated


def _assert_untouched(r, before):
    pool, lengths, inserts, allocated = _state(r)
    for a, b in zip(before[0], pool):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())
    assert (lengths, inserts, allocated) == before[1:]


def _still_works(r):
    out = r.run([Request("after", PROMPT[:10], 2)])
    assert len(out["after"].tokens) == 2 and out["after"].num_cached == 8


def test_request_longer_than_max_model_len():
    """A request with len(prompt) + max_new_tokens > max_model_len is rejected before anything runs,
    even when other (valid) requests come with it; nothing changes and the runner keeps working."""
    r = _warm_runner()
    before = _state(r)
    with pytest.raises(ValueError, match=r"^requests\[1\]: expected len\(prompt\) \+ max_new_tokens <= "
                                         r"max_model_len=32, got 30 \+ 5"):
        r.run([Request("ok", PROMPT[:5], 1), Request("long", tuple(range(30)), 5)])
    _assert_untouched(r, before)
    _still_works(r)


def test_bad_token_ids_and_duplicate_ids():
    """Token ids outside the vocabulary and reused request ids are rejected before anything runs."""
    r = _warm_runner()
    before = _state(r)
    with pytest.raises(ValueError, match=r"^requests\[0\]\.prompt: expected token ids in \[0, 64\)"):
        r.run([Request("x", (1, 2, 99), 1)])
    with pytest.raises(ValueError, match=r"^requests\[1\]: expected a new request id, got duplicate id 'warm'"):
        r.run([Request("y", (1, 2), 1), Request("warm", (1, 2), 1)])
    _assert_untouched(r, before)
    _still_works(r)


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_token_budget_must_be_positive_int(budget):
    """token_budget 0 (or negative, float, bool) is a ValueError naming token_budget."""
    with pytest.raises(ValueError, match=r"^token_budget: expected an int >= 1"):
        MAKE(tiny_model("mamba2", 0), token_budget=budget)


@pytest.mark.parametrize("block", [0, 4, 12, 20, 7.0])
def test_block_size_must_be_multiple_of_8(block):
    """A block size that is not a positive multiple of 8 is a ValueError naming block_size."""
    with pytest.raises(ValueError, match=r"^block_size: expected a positive multiple of 8"):
        MAKE(tiny_model("mamba2", 0), cache_mode="all", block_size=block)


def test_other_bad_runner_arguments():
    """Cache mode, slot count, dtype and chunk size are checked with the argument's name."""
    model = tiny_model("mamba1", 0)
    for kw, name in [(dict(cache_mode="some"), "mode"), (dict(num_slots=0), "num_slots"),
                     (dict(chunk_size=0), "chunk_size"), (dict(decode_pad_multiple=0), "decode_pad_multiple")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            MAKE(model, **kw)
    with pytest.raises(ValueError, match=r"^dtype: "):
        RunnerFactory("reference", dtype=torch.int32)(model)


def test_seed_from_another_model_or_layout():
    """Seeding the prefix cache with a snapshot of another model (other family / dims), another state
    layout (other dtype), a plain dict with wrong shapes, or one of another token count is a ValueError
    naming the snapshot; the pool and the cache are unchanged and the runner keeps working."""
    r = _warm_runner()
    good = r.pool.snapshot(r.pool.alloc(), num_tokens=8)
    r.pool.free(next(iter(r.pool.allocated)))
    r.pool.fill_free_()
    before = _state(r)
    other_family = MAKE(tiny_model("mamba2", 0), num_slots=1)
    other_dtype = RunnerFactory("reference", dtype=torch.float32)(tiny_model("mamba1", 0), num_slots=1)
    for other in (other_family, other_dtype):
        snap = other.pool.snapshot(other.pool.alloc(), num_tokens=8)
        with pytest.raises(ValueError, match=r"^snapshot: expected a snapshot of this pool's model"):
            r.seed(PROMPT[:8], snap)
    bad = dict(good)
    bad["recurrent.1"] = bad["recurrent.1"][..., :2]
    with pytest.raises(ValueError, match=r"^snapshot\['recurrent.1'\]: expected shape"):
        r.seed(PROMPT[:8], bad)
    with pytest.raises(ValueError, match=r"^snapshot: expected the state after 8 tokens, got a snapshot of 16"):
        r.seed(PROMPT[:8], Snapshot(dict(good), good.model_key, 16))
    with pytest.raises(ValueError, match=r"^prefix_tokens: expected a non-empty multiple of block_size=8"):
        r.seed(PROMPT[:5], good)
    _assert_untouched(r, before)
    _still_works(r)
    r.seed((40,) * 8, good)  # a correct snapshot is accepted
    assert r.cache.lookup((40,) * 9, max_tokens=8)[0] == 8
