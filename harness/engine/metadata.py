"""Mixer metadata for one step: a PURE function of the batch (no pool, no scheduler state, no globals).

:func:`build_metadata` turns a batch (prefill entries first, then decodes; each entry = request slot,
``start`` = tokens already computed, ``num_tokens`` scheduled) into what a mixer backend needs:

* ``query_start_loc`` (int32, S+1): offsets of each request's tokens in the packed step (= cu_seqlens);
* ``num_computed_tokens`` (int32, S) and ``seq_lens`` = num_computed + scheduled;
* ``has_initial_states`` (bool, S) = ``num_computed_tokens > 0``. It is NEVER combined with the track
  mask: a request seeded from the prefix cache that is not being tracked this step still starts from
  its state (bug class 1);
* ``state_indices`` (int32, S): the pool slot per request (PAD_SLOT_ID = -1 for pad requests);
* ``track_mask`` (bool, S): the request is tracked (its entry's ``track`` flag / the given mask) AND
  this step takes at least one snapshot of it under the cache mode;
* ``snapshot_positions`` (per request, tuple of absolute token counts, see
  ``reference.cache.snapshot_positions``: ``all`` = every block multiple in (start, end]; ``align`` =
  ``end`` if it is a block multiple) and ``snapshot_token_indices`` (the packed-stream index of the last
  token each snapshot includes, i.e. the state after that token);
* ``seq_idx`` (int32, T): request index of every token of the packed step;
* chunked SSD over the packed PREFILL tokens (the first ``num_prefill_tokens`` tokens):
  - ``chunk_indices`` / ``chunk_offsets`` (int32, L) -- mamba_ssm's varlen convention. The packed
    prefill stream is cut into a global grid of ``chunk_size`` tokens. A *logical chunk* is a maximal run
    of tokens of one sequence inside one global chunk; logical chunks are listed in stream order.
    ``chunk_indices[j]`` is the global chunk that logical chunk j lies in and ``chunk_offsets[j]`` the
    offset of its first token inside that global chunk (non-zero exactly where a sequence starts
    mid-chunk). L = ceil(T_prefill / chunk_size) + #(sequence starts, other than the first, that are not
    on a global chunk boundary);
  - ``cu_chunk_seqlens`` (int32, C+1), ``chunk_seq_idx`` (int32, C), ``last_chunk_indices`` (int32,
    num_prefills) -- the per-request grid: each request's tokens are cut at multiples of ``chunk_size``
    of its ABSOLUTE position (``num_computed + i``), so that with ``block_size % chunk_size == 0`` every
    block boundary is a chunk end; ``snapshot_chunk_indices`` gives, per snapshot, the index of the chunk
    that ends exactly there (or -1 when none does).

Speculative decoding (``num_spec`` > 0): a decode entry carries 1..num_spec+1 tokens (the last accepted
token and its drafts), its request's slot group (``spec_slots``) and ``num_accepted`` (its slot
``spec_slots[num_accepted - 1]`` is the entry's ``slot``, the state it starts from). The decode part is
then described for the speculative decode ops (``selective_state_update_spec``,
``causal_conv1d_update_spec``):

* ``spec_query_start_loc`` (int32, num_decodes+1): offsets of the decode rows' tokens in the decode part;
* ``spec_state_indices`` (int32, (num_decodes, num_spec+1)): row i's slot group (all PAD_SLOT_ID for a
  pad row);
* ``num_accepted_tokens`` (int32, num_decodes).

Decode rows of a speculative step take no snapshot here (their ``snapshot_positions`` are empty): which
of their positions count is known only after verification, and the runner takes them from the slots of
the accepted positions. Without speculative decoding these three fields are None.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from reference.cache import check_block_size, check_cache_mode, snapshot_positions
from reference.validate import check_int, fail

from .pool import PAD_SLOT_ID


@dataclass(frozen=True)
class MambaMetadata:
    num_prefills: int
    num_decodes: int
    num_prefill_tokens: int
    num_decode_tokens: int
    mode: str
    block_size: int
    chunk_size: int
    query_start_loc: torch.Tensor
    num_computed_tokens: torch.Tensor
    seq_lens: torch.Tensor
    has_initial_states: torch.Tensor
    state_indices: torch.Tensor
    track_mask: torch.Tensor
    snapshot_positions: tuple[tuple[int, ...], ...]
    snapshot_token_indices: tuple[tuple[int, ...], ...]
    seq_idx: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    cu_chunk_seqlens: torch.Tensor
    chunk_seq_idx: torch.Tensor
    last_chunk_indices: torch.Tensor
    snapshot_chunk_indices: tuple[tuple[int, ...], ...]
    num_spec: int = 0
    spec_query_start_loc: torch.Tensor | None = None
    spec_state_indices: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return self.num_prefills + self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    # prefill / decode parts, as backends split them
    # (a step of only one kind gets the whole tensor: no slice op per layer on an eager step's host path)
    @property
    def prefill_query_start_loc(self) -> torch.Tensor:
        return prefill_rows(self.query_start_loc, self.num_prefills + 1)

    @property
    def prefill_state_indices(self) -> torch.Tensor:
        return prefill_rows(self.state_indices, self.num_prefills)

    @property
    def prefill_has_initial_states(self) -> torch.Tensor:
        return prefill_rows(self.has_initial_states, self.num_prefills)

    @property
    def decode_state_indices(self) -> torch.Tensor:
        return decode_rows(self.state_indices, self.num_prefills)

    @property
    def prefill_seq_idx(self) -> torch.Tensor:
        return self.seq_idx[: self.num_prefill_tokens]


def prefill_rows(t: torch.Tensor, P: int) -> torch.Tensor:
    """The first P rows of a step's tensor (its prefill part): `t` itself when they are all of it (no slice op
    per layer on an eager step's host path)."""
    return t if P == t.shape[0] else t[:P]


def decode_rows(t: torch.Tensor, P: int) -> torch.Tensor:
    """The rows of a step's tensor from row P on (its decode part): `t` itself in a decode-only step."""
    return t if P == 0 else t[P:]


def chunk_indices_offsets(cu_seqlens: Sequence[int], chunk_size: int) -> tuple[list[int], list[int]]:
    """mamba_ssm-style logical chunks of a packed stream (see module doc). Pure python lists."""
    cu = [int(c) for c in cu_seqlens]
    total = cu[-1]
    starts = sorted({c for c in cu[1:-1] if 0 < c < total})
    indices, offsets = [], []
    for g in range(math.ceil(total / chunk_size)):
        lo, hi = g * chunk_size, min((g + 1) * chunk_size, total)
        cuts = [lo] + [s for s in starts if lo < s < hi]
        for c in cuts:
            indices.append(g)
            offsets.append(c - lo)
    return indices, offsets


def request_chunks(num_computed: Sequence[int], num_scheduled: Sequence[int], chunk_size: int):
    """Per-request chunk grid aligned to absolute positions. Returns (cu_chunk_seqlens, chunk_seq_idx,
    last_chunk_indices, chunk_ends) where chunk_ends[i] lists the absolute end position of each chunk
    of request i (in order)."""
    cu, seq, last, ends = [0], [], [], []
    for i, (s, n) in enumerate(zip(num_computed, num_scheduled)):
        pos, end, mine = s, s + n, []
        while pos < end:
            nxt = min((pos // chunk_size + 1) * chunk_size, end)
            cu.append(cu[-1] + nxt - pos)
            seq.append(i)
            mine.append(nxt)
            pos = nxt
        last.append(len(seq) - 1)
        ends.append(mine)
    return cu, seq, last, ends


def _entries(batch):
    entries = getattr(batch, "entries", batch)
    try:
        return list(entries)
    except TypeError:
        fail("batch", "a Batch or a sequence of BatchEntry", type(batch).__name__)


def _int_list(arg: str, values, n: int, minimum: int | None = 0) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    values = list(values)
    if len(values) != n:
        fail(arg, f"{n} entries (one per request)", f"{len(values)}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            fail(f"{arg}[{i}]", "an int", repr(v))
        if minimum is not None and v < minimum:
            fail(f"{arg}[{i}]", f">= {minimum}", v)
    return values


def _spec_rows(entries, is_decode, nsched, slots, S: int) -> tuple[list[list[int]], list[int]]:
    """The slot group and num_accepted of every decode entry of a speculative step, checked."""
    table, accepted = [], []
    for i, e in enumerate(entries):
        if not is_decode[i]:
            continue
        group = list(getattr(e, "spec_slots", ()) or ())
        acc = getattr(e, "num_accepted", 1)
        if isinstance(acc, bool) or not isinstance(acc, int) or not 1 <= acc <= S:
            fail(f"batch[{i}].num_accepted", f"an int in 1..num_spec + 1 = {S}", repr(acc))
        if slots[i] == PAD_SLOT_ID and not group:
            group = [PAD_SLOT_ID] * S
        if len(group) != S:
            fail(f"batch[{i}].spec_slots", f"num_spec + 1 = {S} slot ids (the request's slot group)", group)
        for j, s in enumerate(group):
            if isinstance(s, bool) or not isinstance(s, int) or (s < 0 and s != PAD_SLOT_ID):
                fail(f"batch[{i}].spec_slots[{j}]", f"a slot id >= 0 or PAD_SLOT_ID={PAD_SLOT_ID}", repr(s))
        if group[acc - 1] != slots[i]:
            fail(f"batch[{i}].slot", f"spec_slots[num_accepted - 1] = {group[acc - 1]} (the state it starts from)",
                 slots[i])
        table.append(group)
        accepted.append(acc)
    return table, accepted


def build_metadata(batch, *, num_computed_tokens: Sequence[int] | None = None,
                   track_mask: Sequence[bool] | None = None, mode: str = "none", block_size: int = 16,
                   chunk_size: int = 64, num_spec: int = 0, device="cpu") -> MambaMetadata:
    """Metadata of one step (see module doc).

    Args:
      batch: a Batch (or a sequence of BatchEntry-like objects with ``slot``, ``start``, ``num_tokens``,
        ``is_decode`` and ``track``), prefills first, then decodes; every entry has >= 1 token and decode
        entries exactly 1.
      num_computed_tokens: per request, tokens already in its state (the prefix length); default each
        entry's ``start``.
      track_mask: per request, whether it may be snapshotted; default each entry's ``track`` flag.
      mode: cache mode "none" | "align" | "all".
      block_size: cache block size (positive multiple of 8).
      chunk_size: the SSD kernel's chunk size (>= 1).
      num_spec: speculative tokens per decode row (0: plain decoding, every decode entry has one token);
        see the module doc.
      device: where the tensors go.
    """
    entries = _entries(batch)
    check_cache_mode(mode)
    check_block_size(block_size)
    check_int("chunk_size", chunk_size, 1)
    check_int("num_spec", num_spec, 0)
    S = len(entries)
    slots = _int_list("slots", [e.slot for e in entries], S, minimum=None)
    for i, s in enumerate(slots):
        if s < 0 and s != PAD_SLOT_ID:
            fail(f"batch[{i}].slot", f"a slot id >= 0 or PAD_SLOT_ID={PAD_SLOT_ID}", s)
    nsched = _int_list("num_tokens", [e.num_tokens for e in entries], S, minimum=1)
    is_decode = [bool(e.is_decode) for e in entries]
    num_prefills = 0
    for i, d in enumerate(is_decode):
        if not d:
            if i != num_prefills:
                fail(f"batch[{i}]", "prefill entries before every decode entry", "a prefill after a decode")
            num_prefills += 1
        elif not 1 <= nsched[i] <= 1 + num_spec:
            fail(f"batch[{i}].num_tokens", "1 for a decode entry" if not num_spec else
                 f"1..num_spec + 1 = {1 + num_spec} for a decode entry", nsched[i])
        elif not num_spec and getattr(entries[i], "spec_slots", ()):
            fail(f"batch[{i}].spec_slots", "none (num_spec is 0)", tuple(entries[i].spec_slots))
    spec_table, spec_acc = _spec_rows(entries, is_decode, nsched, slots, 1 + num_spec) if num_spec else ([], [])
    computed = _int_list("num_computed_tokens",
                         [e.start for e in entries] if num_computed_tokens is None else num_computed_tokens, S)
    if track_mask is None:
        track_in = [bool(getattr(e, "track", True)) for e in entries]
    else:
        track_in = list(track_mask.tolist() if isinstance(track_mask, torch.Tensor) else track_mask)
        if len(track_in) != S:
            fail("track_mask", f"{S} entries (one per request)", len(track_in))
        track_in = [bool(t) for t in track_in]

    qsl = [0]
    for n in nsched:
        qsl.append(qsl[-1] + n)
    num_prefill_tokens = qsl[num_prefills]

    positions, token_idx, tracked = [], [], []
    for i in range(S):
        p = tuple(snapshot_positions(mode, computed[i], nsched[i], block_size)) if track_in[i] else ()
        if slots[i] == PAD_SLOT_ID or (num_spec and is_decode[i]):
            p = ()
        positions.append(p)
        token_idx.append(tuple(qsl[i] + (q - computed[i]) - 1 for q in p))
        tracked.append(bool(p))

    ci, co = chunk_indices_offsets(qsl[: num_prefills + 1], chunk_size)
    cu_chunks, chunk_seq, last_chunk, chunk_ends = request_chunks(computed[:num_prefills], nsched[:num_prefills],
                                                                 chunk_size)
    snap_chunks = []
    for i in range(S):
        if i < num_prefills:
            base = last_chunk[i] - len(chunk_ends[i]) + 1
            idx = {end: base + k for k, end in enumerate(chunk_ends[i])}
            snap_chunks.append(tuple(idx.get(q, -1) for q in positions[i]))
        else:
            snap_chunks.append(tuple(-1 for _ in positions[i]))

    seq_idx = [i for i in range(S) for _ in range(nsched[i])]

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    computed_t = i32(computed)
    spec = {}
    if num_spec:
        nd = S - num_prefills
        spec = dict(num_spec=num_spec,
                    spec_query_start_loc=i32([q - num_prefill_tokens for q in qsl[num_prefills:]]),
                    spec_state_indices=i32(spec_table).reshape(nd, 1 + num_spec),
                    num_accepted_tokens=i32(spec_acc))
    return MambaMetadata(
        num_prefills=num_prefills, num_decodes=S - num_prefills, num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=qsl[-1] - num_prefill_tokens, mode=mode, block_size=block_size, chunk_size=chunk_size,
        query_start_loc=i32(qsl), num_computed_tokens=computed_t,
        seq_lens=i32([c + n for c, n in zip(computed, nsched)]),
        has_initial_states=computed_t > 0,
        state_indices=i32(slots), track_mask=torch.tensor(tracked, dtype=torch.bool, device=device),
        snapshot_positions=tuple(positions), snapshot_token_indices=tuple(token_idx),
        seq_idx=i32(seq_idx), chunk_indices=i32(ci), chunk_offsets=i32(co),
        cu_chunk_seqlens=i32(cu_chunks), chunk_seq_idx=i32(chunk_seq), last_chunk_indices=i32(last_chunk),
        snapshot_chunk_indices=tuple(snap_chunks), **spec,
    )
