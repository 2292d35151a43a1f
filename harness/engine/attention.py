"""Full-attention layers of hybrid models in the engine: a paged key/value pool, the pool that holds it
beside the mixers' states, and causal attention over a mixed prefill/decode step.

Paged KV pool (:class:`KVPool`)
  Per attention layer, keys ``(num_pages, page_size, H_kv, Dk)`` and values ``(num_pages, page_size, H_kv,
  Dv)``. A request (its state slot) owns a block table: the pages holding its tokens 0.., page_size tokens
  per page, in order. Pages are handed out as a request's sequence grows (``reserve``) and return to the
  free list when its slot is freed; the pool grows by doubling when every page is taken. ``length(slot)`` is
  the number of tokens whose keys and values the slot holds; a step writes positions
  ``[num_computed, num_computed + num_tokens)`` of each request and must start at its length.

Hybrid pool (:class:`HybridPool`)
  A :class:`harness.engine.pool.StatePool` over the model's mixer layers plus a :class:`KVPool` over its
  attention layers, with the same slot ids. A snapshot (prefix cache, final states) holds both: the mixer
  layers' ``conv.<j>`` / ``recurrent.<j>`` and, per attention layer ``a``, a copy of the keys and values of
  the first ``num_tokens`` tokens (``kv.<a>.k`` (n, H_kv, Dk), ``kv.<a>.v`` (n, H_kv, Dv)). Restoring one
  into a slot writes those tokens into fresh pages. Under tensor parallelism a rank's pool holds its own
  key/value heads (H_kv / TP of them, or one replicated head when H_kv < TP; :func:`local_kv_spec`).

Attention (:func:`paged_attention`)
  For every request of the step: its new keys and values are written into its pages, then its queries
  attend to positions ``0 .. num_computed + i`` (query i) of the keys and values gathered back from the
  pages (``torch.nn.functional.scaled_dot_product_attention`` with an explicit causal mask; key/value heads
  repeated for grouped queries). Pad rows (PAD_SLOT_ID) read and write nothing and give zeros. The
  projections around it (norms, rotary embedding, gates, latent expansion) are the family's
  (``harness/engine/families/``); written independently of ``reference.attention``.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from harness.engine.pool import PAD_SLOT_ID, PoolExhausted, StatePool
from reference.validate import check_int, fail

__all__ = ["KVPool", "HybridPool", "local_kv_spec", "paged_attention", "token_positions"]


class KVPool:
    """Paged keys and values of `num_layers` attention layers (see module doc)."""

    def __init__(self, spec, num_layers: int, *, page_size: int = 16, num_pages: int = 16, device="cpu",
                 dtype: torch.dtype | None = None, grow: bool = True):
        for name, v in (("num_layers", num_layers), ("page_size", page_size), ("num_pages", num_pages)):
            check_int(name, v, 1)
        self.spec = spec
        self.num_layers = num_layers
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype or spec.dtype
        self.grow = grow
        self.k = [self._pages(num_pages, spec.k_shape) for _ in range(num_layers)]
        self.v = [self._pages(num_pages, spec.v_shape) for _ in range(num_layers)]
        self._free = list(range(num_pages))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._home: dict[int, int] = {}  # slot -> the slot whose pages it shares (link)

    def _pages(self, n: int, shape) -> torch.Tensor:
        return torch.full((n, self.page_size, *shape), float("nan"), dtype=self.dtype, device=self.device)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def home(self, slot: int) -> int:
        """The slot whose pages `slot` reads and writes: itself, or the one it is linked to."""
        return self._home.get(slot, slot)

    def link(self, slot: int, home: int) -> None:
        """Make `slot` share `home`'s pages (a speculative request's slot group: its state moves from slot to slot
        of the group, its keys and values stay in the group's first slot). Every call naming `slot` then acts on
        `home`, until :meth:`unlink`."""
        if slot == home or self._home.get(home, home) != home:
            fail("home", f"a slot other than {slot} that is not itself linked", home)
        if self._tables.get(slot):
            fail("slot", "a slot without pages of its own", f"slot {slot} with {len(self._tables[slot])} pages")
        self._home[slot] = home

    def unlink(self, slot: int) -> None:
        self._home.pop(slot, None)

    def length(self, slot: int) -> int:
        return self._lengths.get(self.home(slot), 0)

    def pages(self, slot: int) -> list[int]:
        """The block table of `slot` (page ids in token order)."""
        return list(self._tables.get(self.home(slot), ()))

    def _grow_to(self, need: int) -> None:
        n = self.num_pages
        if not self.grow:
            raise PoolExhausted(f"KV pool exhausted: {need} more pages needed, {len(self._free)} of {n} free")
        new = max(n, need - len(self._free))
        for a in range(self.num_layers):
            self.k[a] = torch.cat([self.k[a], self._pages(new, self.spec.k_shape)])
            self.v[a] = torch.cat([self.v[a], self._pages(new, self.spec.v_shape)])
        self._free.extend(range(n, n + new))

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make `slot`'s block table cover `num_tokens` tokens (pages are added, never removed)."""
        table = self._tables.setdefault(self.home(slot), [])
        need = math.ceil(num_tokens / self.page_size) - len(table)
        if need <= 0:
            return
        if need > len(self._free):
            self._grow_to(need)
        self._free.sort()
        table.extend(self._free[:need])
        del self._free[:need]

    def set_length(self, slot: int, num_tokens: int) -> None:
        slot = self.home(slot)
        if num_tokens > len(self._tables.get(slot, ())) * self.page_size:
            fail("num_tokens", f"at most the {len(self._tables.get(slot, ())) * self.page_size} tokens reserved "
                               f"for slot {slot}", num_tokens)
        self._lengths[slot] = num_tokens

    def release(self, slot: int) -> None:
        """Return `slot`'s pages to the free list (their contents are poisoned with NaN); slots linked to it stay
        linked."""
        slot = self.home(slot)
        table = self._tables.pop(slot, [])
        self._lengths.pop(slot, None)
        if table:
            idx = torch.tensor(table, device=self.device)
            for a in range(self.num_layers):
                self.k[a][idx] = float("nan")
                self.v[a][idx] = float("nan")
        self._free.extend(table)

    def _rows(self, slot: int, start: int, end: int):
        """(page ids, offsets) of positions [start, end) of `slot`."""
        slot = self.home(slot)
        pos = torch.arange(start, end)
        table = torch.tensor(self._tables.get(slot, []), dtype=torch.long)
        if end > len(table) * self.page_size:
            fail("positions", f"tokens below the {len(table) * self.page_size} reserved for slot {slot}",
                 f"[{start}, {end})")
        return table[pos // self.page_size].to(self.device), (pos % self.page_size).to(self.device)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pages, offs = self._rows(slot, start, start + k.shape[0])
        self.k[layer][pages, offs] = k.to(self.dtype)
        self.v[layer][pages, offs] = v.to(self.dtype)

    def read(self, layer: int, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (end, H_kv, Dk) and values (end, H_kv, Dv) of positions [0, end) of `slot`."""
        pages, offs = self._rows(slot, 0, end)
        return self.k[layer][pages, offs], self.v[layer][pages, offs]

    def copy(self, src: int, dst: int) -> None:
        if self.home(src) == self.home(dst):
            return
        n = self.length(src)
        self.release(dst)
        self.reserve(dst, n)
        for a in range(self.num_layers):
            k, v = self.read(a, src, n)
            self.write(a, dst, 0, k, v)
        self._lengths[self.home(dst)] = n


class HybridPool(StatePool):
    """Mixer states of the mixer layers and paged keys/values of the attention layers (see module doc).

    Args beyond StatePool's: `kv_spec` (a ``reference.cache.KVSpec`` of the whole model), `num_attention_layers`,
    `page_size` (tokens per KV page), `num_pages` (initial pages; the pool grows when they run out). The pool
    is one rank's: with a per-rank `spec` (``spec.tp_size`` T > 1) it holds the rank's key/value heads
    (:func:`local_kv_spec`; ``self.kv_spec`` is that per-rank spec)."""

    def __init__(self, spec, num_layers: int, num_slots: int, *, kv_spec, num_attention_layers: int,
                 page_size: int = 16, num_pages: int | None = None, device="cpu", dtype: torch.dtype | None = None,
                 **kw):
        super().__init__(spec, num_layers, num_slots, device=device, dtype=dtype, **kw)
        kv_spec = local_kv_spec(kv_spec, getattr(spec, "tp_size", 1))
        self.kv_spec = kv_spec
        self.kv = KVPool(kv_spec, num_attention_layers, page_size=page_size, num_pages=num_pages or 4 * num_slots,
                         device=device, dtype=dtype)
        self.model_key = (*self.model_key, kv_spec, num_attention_layers, self.kv.dtype)

    def _describe_key(self, key) -> str:
        try:
            spec, n, cd, rd, kv, na, kd = key
            return f"{spec.describe()} x {n} layers (conv {cd}, recurrent {rd}); {kv.describe()} x {na} layers ({kd})"
        except Exception:
            return repr(key)

    def alloc_group(self, n: int, *, zero: bool = False) -> list[int]:
        """As StatePool's; the group's keys and values live in its first slot (the others are linked to it: a
        speculative request's state moves within its group, its attention history does not)."""
        slots = super().alloc_group(n, zero=zero)
        for s in slots[1:]:
            self.kv.link(s, slots[0])
        return slots

    def free(self, slot) -> None:
        super().free(slot)
        slot = self._slot_id("slot", slot)
        if self.kv.home(slot) != slot:
            self.kv.unlink(slot)
        else:
            self.kv.release(slot)

    def zero_(self, slot) -> None:
        super().zero_(slot)
        slot = self._slot_id("slot", slot)
        if self.kv.home(slot) == slot:  # a linked slot's zeroing leaves its group's keys and values
            self.kv.release(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        super().copy_slot(src, dst)
        self.kv.copy(self._check_live("src", src), self._check_live("dst", dst))

    def _snapshot_tensors(self, slot: int, num_tokens: int | None) -> dict:
        t = super()._snapshot_tensors(slot, num_tokens)
        n = self.kv.length(slot) if num_tokens is None else num_tokens
        if n > self.kv.length(slot):
            fail("num_tokens", f"at most the {self.kv.length(slot)} tokens slot {slot} holds", n)
        for a in range(self.kv.num_layers):
            k, v = self.kv.read(a, slot, n)
            t[f"kv.{a}.k"], t[f"kv.{a}.v"] = k.clone(), v.clone()
        return t

    def _snapshot_keys(self) -> set:
        return super()._snapshot_keys() | {f"kv.{a}.{x}" for a in range(self.kv.num_layers) for x in "kv"}

    def _check_tensors(self, snapshot) -> None:
        super()._check_tensors(snapshot)
        lengths = set()
        for a in range(self.kv.num_layers):
            for x, shape in (("k", self.kv_spec.k_shape), ("v", self.kv_spec.v_shape)):
                t = snapshot[f"kv.{a}.{x}"]
                if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != shape \
                        or t.dtype != self.kv.dtype:
                    got = f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                    fail(f"snapshot['kv.{a}.{x}']", f"shape (tokens, {shape[0]}, {shape[1]}) {self.kv.dtype}", got)
                lengths.add(int(t.shape[0]))
        n = getattr(snapshot, "num_tokens", None)
        if len(lengths) > 1 or (n is not None and lengths and lengths != {n}):
            fail("snapshot", f"keys and values of {n if n is not None else 'the same number of'} tokens in every "
                             "attention layer", sorted(lengths))

    def _restore_tensors(self, slot: int, snapshot) -> None:
        super()._restore_tensors(slot, snapshot)
        self.kv.release(slot)
        n = int(snapshot["kv.0.k"].shape[0]) if self.kv.num_layers else 0
        self.kv.reserve(slot, n)
        for a in range(self.kv.num_layers):
            self.kv.write(a, slot, 0, snapshot[f"kv.{a}.k"], snapshot[f"kv.{a}.v"])
        self.kv.set_length(slot, n)


def local_kv_spec(kv_spec, tp_size: int):
    """The key/value spec of one rank of `tp_size`: its share of the KV heads, or the one head it holds
    replicated when there are fewer KV heads than ranks (``harness.engine.tp.kv_heads_of_rank``)."""
    from harness.engine.tp import kv_heads_of_rank
    if tp_size == 1:
        return kv_spec
    return replace(kv_spec, num_kv_heads=kv_heads_of_rank(kv_spec.num_kv_heads, 0, tp_size)[1])


def token_positions(md) -> torch.Tensor:
    """The absolute position of every token of a step (num_computed of its request + its index in it)."""
    qsl = md.query_start_loc
    counts = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(counts.numel(), device=qsl.device), counts.long())
    first = torch.repeat_interleave(qsl[:-1].long(), counts.long())
    return md.num_computed_tokens.long()[req] + torch.arange(int(qsl[-1]), device=qsl.device) - first


def paged_attention(kv: KVPool, layer: int, md, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of a mixed step (see module doc): q (T, H, Dk), the step's new keys k (T, H_kv, Dk)
    and values v (T, H_kv, Dv) -> (T, H, Dv). Writes the new keys and values into the requests' pages
    (reserved by the caller up to each request's end)."""
    qsl = md.query_start_loc.tolist()
    slots = md.state_indices.tolist()
    starts = md.num_computed_tokens.tolist()
    T, H, _ = q.shape
    group = H // k.shape[1]
    out = torch.zeros((T, H, v.shape[-1]), dtype=q.dtype, device=q.device)
    for r, slot in enumerate(slots):
        if slot == PAD_SLOT_ID:
            continue
        a, b, start = qsl[r], qsl[r + 1], starts[r]
        if kv.length(slot) != start:
            raise RuntimeError(f"slot {slot} holds keys and values of {kv.length(slot)} tokens, the step starts "
                               f"at position {start}")
        kv.write(layer, slot, start, k[a:b], v[a:b])
        keys, values = kv.read(layer, slot, start + b - a)
        keys = keys.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)      # (H, L, Dk)
        values = values.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, Dv)
        n, L = b - a, start + b - a
        mask = torch.arange(L, device=q.device)[None, :] <= start + torch.arange(n, device=q.device)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, values, attn_mask=mask,
                                                             scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out
