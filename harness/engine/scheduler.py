"""Scheduler: splits prompts into prefill chunks at arbitrary boundaries and mixes them with decodes.

Per step, :meth:`Scheduler.schedule` spends a token budget:
  1. one token for every running request in decode (oldest first), while budget lasts;
  2. the next chunk of every running request still in prefill (oldest first);
  3. new requests, admitted in arrival order while a slot is free (a prefix-cache hit restores the
     cached snapshot into the new slot and starts the prefill after the cached tokens).
A prefill chunk is ``min(remaining prompt, remaining budget)`` tokens, or what ``chunk_fn`` says, so
chunk boundaries fall anywhere (not only on kernel chunk or cache block boundaries).
The returned :class:`Batch` lists prefill entries first, then decode entries.

After running the batch, the runner calls :meth:`Scheduler.update` with the sampled token of every entry
whose ``sample`` flag is set (the last prefill chunk of a prompt, and every decode). A request finishes
once it has ``max_new_tokens`` output tokens; its slot is freed then.

Positions: a request with prompt length P has computed ``num_computed`` tokens; a decode entry feeds its
last output token at position ``num_computed`` (P, P+1, ...). The last sampled token is never fed, so a
request occupies at most ``P + max_new_tokens - 1`` positions; the length check uses
``P + max_new_tokens`` against ``max_model_len``.

Speculative decoding (``num_spec`` > 0, as vLLM runs it for Mamba models): a request holds a group of
``1 + num_spec`` slots (``RequestState.slots``, one state per position of a step; ``pool.alloc_group``). A
decode entry carries the last output token and up to ``num_spec`` draft tokens from ``draft_fn`` (fewer
when the budget or the request's remaining output is short: a step never emits more than the request may
still generate), with the request's slot group (``spec_slots``) and ``num_accepted``: the previous step's
accepted count, whose slot ``spec_slots[num_accepted - 1]`` holds the state to start from. Every position's
state goes to its own slot of the group, so a rejected draft costs nothing to roll back. ``update`` takes,
for such an entry, the accepted drafts followed by one bonus token (or one token when nothing was
accepted); the request advances by that many tokens and they become its next ``num_accepted``. Prefill
and prefix-cache seeding use the slot holding the state (``spec_slots[0]`` until the first decode).

Every call is all-or-nothing: ``add``, ``schedule``, ``update`` and ``finish`` check everything (request
ids, sampled tokens, chunk sizes, that a prefix-cache snapshot fits the pool) before they change any
state, so a call that raises leaves the scheduler, its pool and its prefix cache as they were and can
be retried once the cause is fixed.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from reference.validate import check_int, fail

from .pool import StatePool, is_integer_dtype


def check_request_id(arg: str, rid) -> None:
    """ValueError unless `rid` can be a request id (hashable: ids key dicts and sets)."""
    try:
        hash(rid)
    except TypeError:
        fail(arg, "a hashable request id (str, int, tuple, ...)", f"{type(rid).__name__} {rid!r}"[:80])


def token_id(arg: str, t) -> int:
    """`t` as a token id: an int >= 0 (not a bool), or a 0-d integer tensor; ValueError otherwise."""
    if isinstance(t, torch.Tensor):
        if t.dim() != 0 or not is_integer_dtype(t.dtype):
            fail(arg, "a token id (an int >= 0)", f"a tensor of shape {tuple(t.shape)} {t.dtype}")
        t = int(t.item())
    elif isinstance(t, bool):
        fail(arg, "a token id (an int >= 0)", repr(t))
    else:
        try:
            t = operator.index(t)
        except TypeError:
            fail(arg, "a token id (an int >= 0)", repr(t)[:60])
    if t < 0:
        fail(arg, "a token id (an int >= 0)", t)
    return t


@dataclass(frozen=True)
class Request:
    """A generation request: `prompt` token ids, up to `max_new_tokens` output tokens.
    `track=False` excludes it from prefix-cache snapshotting (it can still be seeded from the cache)."""

    id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    track: bool = True

    def __post_init__(self):
        check_request_id("id", self.id)
        try:
            prompt = tuple(self.prompt)
        except TypeError:
            fail("prompt", f"a sequence of token ids (request {self.id!r})", repr(self.prompt)[:60])
        object.__setattr__(self, "prompt", tuple(token_id(f"prompt[{i}]", t) for i, t in enumerate(prompt)))
        if len(self.prompt) == 0:
            fail("prompt", f"at least one token (request {self.id!r})", "an empty prompt")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            fail("max_new_tokens", f"an int >= 1 (request {self.id!r})", repr(self.max_new_tokens))


@dataclass(frozen=True)
class BatchEntry:
    """One request's share of a step: tokens [start, start + num_tokens) of its sequence.

    start      = number of tokens of this request already computed (its state holds them);
    tokens     = the token ids fed this step;
    sample     = whether the runner must sample a token from this entry's last position;
    track      = whether the request may be snapshotted into the prefix cache;
    spec_slots = a speculative decode entry's slot group (the state after its position j goes to
                 spec_slots[j]); empty for every other entry;
    num_accepted = how many tokens the request's previous step accepted: it starts from the state in
                 spec_slots[num_accepted - 1] (== slot).
    """

    request_id: Hashable
    slot: int
    start: int
    num_tokens: int
    is_decode: bool
    tokens: tuple[int, ...] = ()
    sample: bool = False
    track: bool = True
    spec_slots: tuple[int, ...] = ()
    num_accepted: int = 1

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_spec(self) -> bool:
        """A decode entry of a speculative step (it carries its slot group)."""
        return bool(self.spec_slots)

    @property
    def drafts(self) -> tuple[int, ...]:
        """The draft tokens of a speculative decode entry (its tokens after the first)."""
        return self.tokens[1:] if self.is_spec else ()


@dataclass(frozen=True)
class Batch:
    """A step: prefill entries first, then decode entries."""

    entries: tuple[BatchEntry, ...]

    def __post_init__(self):
        object.__setattr__(self, "entries", tuple(self.entries))
        seen_decode = False
        for i, e in enumerate(self.entries):
            if e.is_decode:
                seen_decode = True
            elif seen_decode:
                fail(f"entries[{i}]", "prefill entries before every decode entry", f"prefill {e.request_id!r} after a decode")

    def __iter__(self):
        return iter(self.entries)

    def __len__(self):
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def prefills(self) -> tuple[BatchEntry, ...]:
        return tuple(e for e in self.entries if not e.is_decode)

    @property
    def decodes(self) -> tuple[BatchEntry, ...]:
        return tuple(e for e in self.entries if e.is_decode)

    @property
    def request_ids(self) -> list:
        return [e.request_id for e in self.entries]

    @property
    def slots(self) -> list[int]:
        return [e.slot for e in self.entries]


@dataclass
class RequestState:
    request: Request
    slot: int
    num_computed: int = 0
    num_cached: int = 0  # tokens restored from the prefix cache at admission
    output: list[int] = field(default_factory=list)
    slots: tuple[int, ...] = ()  # speculative decoding: the request's slot group (slot is one of them)
    num_accepted: int = 1  # speculative decoding: tokens accepted by the last step (slot = slots[num_accepted-1])

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.request.prompt)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt + output so far."""
        return self.request.prompt + tuple(self.output)


class Scheduler:
    """Chunked-prefill + decode scheduler over a :class:`StatePool` (one slot per running request).

    Args:
      pool: the state pool; a request holds one slot (1 + num_spec slots) from admission until it finishes.
      token_budget: max tokens per step (>= 1).
      max_model_len: max ``len(prompt) + max_new_tokens`` of a request (None: no limit).
      max_num_seqs: max requests per step (default: pool.num_slots // (1 + num_spec)).
      prefix_cache: optional :class:`harness.engine.prefix_cache.PrefixCache`; on admission its longest
        snapshot for the prompt (leaving at least one prompt token to compute) is restored into the slot.
      chunk_fn: optional ``chunk_fn(request_id, start, max_tokens) -> n`` choosing a prefill chunk size
        in 1..max_tokens (tests use it to put boundaries anywhere); default: as many as fit.
      num_spec: speculative tokens per decode step (0: plain decoding); see the module doc.
      draft_fn: with num_spec > 0, ``draft_fn(request_id, tokens, max_drafts) -> drafts``: up to
        `max_drafts` draft token ids to follow `tokens` (the request's prompt + outputs so far); default:
        no drafts.
    """

    def __init__(self, pool: StatePool, token_budget: int, *, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, prefix_cache=None,
                 chunk_fn: Callable[[Hashable, int, int], int] | None = None, num_spec: int = 0,
                 draft_fn: Callable[[Hashable, tuple, int], object] | None = None):
        if not isinstance(pool, StatePool):
            fail("pool", "a StatePool", type(pool).__name__)
        check_int("token_budget", token_budget, 1)
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 2):
            fail("max_model_len", "None or an int >= 2", repr(max_model_len))
        check_int("num_spec", num_spec, 0)
        if pool.num_slots < 1 + num_spec:
            fail("pool", f"at least 1 + num_spec = {1 + num_spec} slots (one request's group)",
                 f"{pool.num_slots} slots")
        if max_num_seqs is None:
            max_num_seqs = pool.num_slots // (1 + num_spec)
        check_int("max_num_seqs", max_num_seqs, 1)
        self.pool = pool
        self.token_budget = token_budget
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.prefix_cache = prefix_cache
        self.chunk_fn = chunk_fn
        self.num_spec = num_spec
        self.draft_fn = draft_fn
        self.waiting: list[Request] = []
        self.running: dict[Hashable, RequestState] = {}  # insertion order = admission order
        self.finished: dict[Hashable, list[int]] = {}
        self._ids: set = set()
        self._pending: Batch | None = None
        self.step_count = 0

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        if not isinstance(request, Request):
            fail("request", "a Request", type(request).__name__)
        if request.id in self._ids:
            fail("request", "a new request id", f"duplicate id {request.id!r}")
        total = len(request.prompt) + request.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            fail("request", f"len(prompt) + max_new_tokens <= max_model_len={self.max_model_len}",
                 f"{len(request.prompt)} + {request.max_new_tokens} = {total} (request {request.id!r})")
        self._ids.add(request.id)
        self.waiting.append(request)

    def state(self, request_id) -> RequestState:
        check_request_id("request_id", request_id)
        if request_id not in self.running:
            fail("request_id", "a running request id", repr(request_id))
        return self.running[request_id]

    def tokens(self, request_id) -> tuple[int, ...]:
        """Prompt + outputs so far of a running request."""
        return self.state(request_id).tokens

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def _chunk(self, rid, start: int, remaining: int, budget: int) -> int:
        cap = min(remaining, budget)
        if self.chunk_fn is None:
            return cap
        n = self.chunk_fn(rid, start, cap)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cap:
            fail("chunk_fn", f"a chunk size in 1..{cap} (request {rid!r} at {start})", repr(n))
        return n

    def _drafts(self, st: RequestState, k: int) -> tuple[int, ...]:
        """Up to `k` draft tokens for a decoding request (none without a draft_fn), checked."""
        if k < 1 or self.draft_fn is None:
            return ()
        rid = st.request.id
        got = self.draft_fn(rid, st.tokens, k)
        if isinstance(got, torch.Tensor):
            got = got.tolist() if got.dim() == 1 else got
        if isinstance(got, (str, bytes, Mapping)) or not hasattr(got, "__len__"):
            fail("draft_fn", f"a sequence of at most {k} token ids (request {rid!r})", repr(got)[:60])
        if len(got) > k:
            fail("draft_fn", f"at most {k} draft tokens (request {rid!r})", f"{len(got)}")
        return tuple(token_id(f"draft_fn drafts[{j}] (request {rid!r})", t) for j, t in enumerate(got))

    def _decode_entry(self, st: RequestState, budget: int) -> BatchEntry:
        req = st.request
        if not self.num_spec:
            return BatchEntry(req.id, st.slot, st.num_computed, 1, True, (st.output[-1],), sample=True,
                              track=req.track)
        # the step emits at most 1 + len(drafts) tokens: never more than the request may still generate
        k = min(self.num_spec, req.max_new_tokens - len(st.output) - 1, budget - 1)
        drafts = self._drafts(st, k)
        return BatchEntry(req.id, st.slot, st.num_computed, 1 + len(drafts), True, (st.output[-1],) + drafts,
                          sample=True, track=req.track, spec_slots=st.slots, num_accepted=st.num_accepted)

    def _prefill_entry(self, req: Request, slot: int, start: int, budget: int) -> BatchEntry:
        prompt = req.prompt
        n = self._chunk(req.id, start, len(prompt) - start, budget)
        return BatchEntry(req.id, slot, start, n, False, prompt[start:start + n],
                          sample=start + n == len(prompt), track=req.track)

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when there is nothing to run. Call :meth:`update` before the
        next schedule(). The step is planned in full (chunk sizes, admissions, the prefix-cache snapshot
        each admitted request starts from, checked against the pool) before any state changes."""
        if self._pending is not None:
            raise RuntimeError("schedule() called again before update() of the previous batch")
        budget = self.token_budget
        prefills: list[BatchEntry] = []
        decodes: list[BatchEntry] = []
        nseq = 0
        for st in self.running.values():
            if budget == 0 or nseq == self.max_num_seqs:
                break
            if not st.in_prefill:
                e = self._decode_entry(st, budget)
                decodes.append(e)
                budget -= e.num_tokens
                nseq += 1
        for st in self.running.values():
            if budget == 0 or nseq == self.max_num_seqs:
                break
            if st.in_prefill:
                e = self._prefill_entry(st.request, st.slot, st.num_computed, budget)
                prefills.append(e)
                budget -= e.num_tokens
                nseq += 1
        admits = []  # (request, slot group, cached tokens, snapshot)
        group = 1 + self.num_spec
        free = self.pool.lowest_free(min(len(self.waiting), self.max_num_seqs) * group)
        groups = [tuple(free[i * group:(i + 1) * group]) for i in range(len(free) // group)]
        for req, slots in zip(self.waiting, groups):
            slot = slots[0]
            if budget == 0 or nseq == self.max_num_seqs:
                break
            n, snap = 0, None
            if self.prefix_cache is not None:
                n, snap = self.prefix_cache.peek(req.prompt, max_tokens=len(req.prompt) - 1)
                if n > 0:
                    try:
                        self.pool.check_snapshot(snap)
                    except ValueError as e:
                        raise ValueError(f"prefix cache: the snapshot of the first {n} tokens of request "
                                         f"{req.id!r} does not fit the state pool: {e}") from None
            e = self._prefill_entry(req, slot, n, budget)
            admits.append((req, slots, n, snap))
            prefills.append(e)
            budget -= e.num_tokens
            nseq += 1
        if not prefills and not decodes:
            return None
        batch = Batch(tuple(prefills) + tuple(decodes))
        # commit: nothing below can fail on input checked above
        for req, slots, n, snap in admits:
            got = tuple(self.pool.alloc_group(group)) if self.num_spec else (self.pool.alloc(),)
            assert got == slots, (got, slots)
            slot = slots[0]
            if self.prefix_cache is not None:
                self.prefix_cache.lookup(req.prompt, max_tokens=len(req.prompt) - 1)  # count it, refresh LRU
                if n > 0:
                    self.pool.restore(slot, snap)
            self.running[req.id] = RequestState(req, slot, num_computed=n, num_cached=n,
                                                slots=slots if self.num_spec else ())
        del self.waiting[:len(admits)]
        self._pending = batch
        return batch

    def update(self, batch: Batch, sampled: Mapping | None = None) -> list:
        """Advance the requests of `batch` (the last scheduled one) and append sampled tokens.

        `sampled` maps request id -> token id (an int >= 0) for exactly the entries with ``sample=True``;
        for a speculative decode entry, the emitted tokens: its accepted drafts (a prefix of
        ``entry.drafts``) followed by one token (a single token id: nothing accepted). Returns the ids of
        requests that finished (their slots are freed). Bad input changes nothing.
        """
        if batch is not self._pending:
            fail("batch", "the batch returned by the last schedule()", "another batch")
        if sampled is None:
            sampled = {}
        if not isinstance(sampled, Mapping):
            fail("sampled", "a dict request id -> token id", type(sampled).__name__)
        want = {e.request_id for e in batch if e.sample}
        if set(sampled) != want:
            fail("sampled", f"tokens for exactly the sampling entries {sorted(map(repr, want))}",
                 sorted(map(repr, sampled)))
        tokens = {e.request_id: (_emitted(e, sampled[e.request_id]) if e.is_spec
                                 else [token_id(f"sampled[{e.request_id!r}]", sampled[e.request_id])])
                  for e in batch if e.sample}
        done = []
        for e in batch:
            st = self.running[e.request_id]
            if e.is_spec:
                n = len(tokens[e.request_id])
                st.num_computed += n
                st.num_accepted = n
                st.slot = st.slots[n - 1]
            else:
                st.num_computed += e.num_tokens
            if e.sample:
                st.output.extend(tokens[e.request_id])
                if len(st.output) >= st.request.max_new_tokens:
                    done.append(e.request_id)
        for rid in done:
            st = self.running.pop(rid)
            self._release(st)
            self.finished[rid] = list(st.output)
        self._pending = None
        self.step_count += 1
        return done

    def finish(self, request_id) -> None:
        """Abort/finish a running request early (e.g. on EOS) and free its slot."""
        check_request_id("request_id", request_id)
        if self._pending is not None and any(e.request_id == request_id for e in self._pending):
            raise RuntimeError(f"request {request_id!r} is in the pending batch; call update() first")
        if request_id not in self.running:
            fail("request_id", "a running request id", repr(request_id))
        st = self.running.pop(request_id)
        self._release(st)
        self.finished[request_id] = list(st.output)

    def _release(self, st: RequestState) -> None:
        """Free the request's slot (its slot group under speculative decoding)."""
        if st.slots:
            self.pool.free_group(st.slots)
        else:
            self.pool.free(st.slot)


def _emitted(e: BatchEntry, value) -> list[int]:
    """The tokens a speculative decode entry emits: `value` is one token id, or a sequence of 1..num_tokens
    ids whose all but last are the entry's first drafts (the accepted ones); ValueError otherwise."""
    arg = f"sampled[{e.request_id!r}]"
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        seq = [token_id(f"{arg}[{j}]", t) for j, t in enumerate(value)]
    else:
        seq = [token_id(arg, value)]
    if not 1 <= len(seq) <= e.num_tokens:
        fail(arg, f"1..{e.num_tokens} tokens (accepted drafts, then one token)", f"{len(seq)} tokens")
    if tuple(seq[:-1]) != e.drafts[:len(seq) - 1]:
        fail(arg, f"the accepted drafts (a prefix of {list(e.drafts)}) followed by one token", seq)
    return seq
