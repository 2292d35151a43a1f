"""Prefix cache of SSM state snapshots, keyed by token prefix.

Unlike a KV cache, an SSM state at position p summarises the whole prefix, so ONE snapshot per cached
prefix length is enough to resume: entry key = the chained hash of the prefix's token blocks
(``h_0 = hash(()); h_{i+1} = hash((h_i, block_i))``), so equal prefixes give equal keys whatever follows.
Only whole-block prefixes are stored (``len(prefix) % block_size == 0``); which block boundaries get
snapshots is the cache mode's business (``reference.cache.snapshot_positions``), applied by the runner
through the step metadata.

* ``mode="none"``: nothing is stored, every lookup misses;
* ``mode="align"`` / ``"all"``: block-aligned snapshots are stored; lookups return the longest one.

Eviction: least recently used (insert and lookup hits refresh) beyond ``capacity`` entries.
Each entry also keeps its token tuple, so a hash collision can never return a wrong state.
The cache takes ownership of the snapshots given to ``insert`` (pass a clone if you keep using it).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from reference.cache import check_block_size, check_cache_mode
from reference.validate import check_int, fail


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the whole blocks of `tokens`: element i covers tokens[: (i+1)*block_size]."""
    out, h = [], hash(())
    for b in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[b * block_size:(b + 1) * block_size])))
        out.append(h)
    return out


class PrefixCache:
    """LRU cache of state snapshots per block-aligned token prefix.

    Args:
      mode: "none" | "align" | "all".
      block_size: tokens per block (positive multiple of 8).
      capacity: max number of stored snapshots (>= 1).
    """

    def __init__(self, mode: str = "all", block_size: int = 16, capacity: int = 64):
        check_cache_mode(mode)
        check_block_size(block_size)
        check_int("capacity", capacity, 1)
        self.mode = mode
        self.block_size = block_size
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[tuple[int, ...], Any]] = OrderedDict()
        self.hits = self.misses = self.evictions = self.inserts = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens_prefix) -> bool:
        toks = tuple(int(t) for t in tokens_prefix)
        if not toks or len(toks) % self.block_size:
            return False
        e = self._entries.get(block_hashes(toks, self.block_size)[-1])
        return e is not None and e[0] == toks

    @property
    def cached_lengths(self) -> list[int]:
        """Stored prefix lengths, least recently used first."""
        return [len(t) for t, _ in self._entries.values()]

    def _find(self, tokens: Sequence[int], max_tokens: int | None):
        """(hash key or None, num_cached_tokens, snapshot) of the longest stored prefix; changes nothing."""
        toks = tuple(int(t) for t in tokens)
        limit = len(toks) if max_tokens is None else max_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            fail("max_tokens", "None or an int >= 0", repr(max_tokens))
        if self.mode == "none":
            return None, 0, None
        hashes = block_hashes(toks[: min(limit, len(toks))], self.block_size)
        for i in range(len(hashes) - 1, -1, -1):
            e = self._entries.get(hashes[i])
            n = (i + 1) * self.block_size
            if e is not None and e[0] == toks[:n]:
                return hashes[i], n, e[1]
        return None, 0, None

    def peek(self, tokens: Sequence[int], max_tokens: int | None = None) -> tuple[int, Any]:
        """What :meth:`lookup` would return, without counting it or refreshing the entry."""
        _, n, snap = self._find(tokens, max_tokens)
        return n, snap

    def lookup(self, tokens: Sequence[int], max_tokens: int | None = None) -> tuple[int, Any]:
        """The longest stored prefix of `tokens` of at most `max_tokens` tokens (default: all of them):
        ``(num_cached_tokens, snapshot)``, or ``(0, None)`` on a miss. A hit becomes most recently used."""
        key, n, snap = self._find(tokens, max_tokens)
        if key is None:
            self.misses += 1
            return 0, None
        self._entries.move_to_end(key)
        self.hits += 1
        return n, snap

    def insert(self, tokens_prefix: Sequence[int], snapshot: Any) -> bool:
        """Store `snapshot` as the state after `tokens_prefix` (a non-empty whole number of blocks).
        Returns False (and stores nothing) in mode "none"; re-inserting a prefix replaces its snapshot."""
        toks = tuple(int(t) for t in tokens_prefix)
        if not toks or len(toks) % self.block_size:
            fail("tokens_prefix", f"a non-empty multiple of block_size={self.block_size} tokens", f"{len(toks)} tokens")
        if snapshot is None:
            fail("snapshot", "a snapshot", "None")
        if self.mode == "none":
            return False
        key = block_hashes(toks, self.block_size)[-1]
        self._entries[key] = (toks, snapshot)
        self._entries.move_to_end(key)
        self.inserts += 1
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.evictions += 1
        return True

    def clear(self) -> None:
        self._entries.clear()
