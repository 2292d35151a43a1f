"""State pool: conv + recurrent state per layer for `num_slots` slots, as a serving engine holds them.

Layouts
  * ``"layer_major"``: per layer one contiguous tensor per state, ``(num_slots, *shape)``.
  * ``"page_major"``: ONE contiguous byte buffer of ``num_slots * slot_bytes``; a slot's page holds every
    layer's conv and recurrent state back to back (per layer: conv at offset 0, recurrent at the next
    16-byte boundary, the layer's region padded to ``page_multiple`` bytes). Per layer, the pool exposes
    strided views ``(num_slots, *shape)`` whose dim-0 stride is the slot's whole page: kernels must
    honour ``stride(0)`` rather than assume ``numel(shape)``.
  * ``conv_channels_last=True`` additionally stores each conv state as ``(K-1, conv_dim)`` in memory
    (channel-contiguous, as vLLM does) and exposes it transposed, i.e. with logical shape
    ``(num_slots, conv_dim, K-1)`` and strides ``(slot stride, 1, conv_dim)``.

Whatever the layout, ``conv(layer)`` has the logical shape ``(num_slots, conv_dim, K-1)`` and
``recurrent(layer)`` ``(num_slots, *spec.recurrent_shape)``.

Slots
  ``alloc() -> int`` hands out the lowest free slot id; ``free(slot)``; double free, freeing an id
  that was never handed out or is out of range, and use of the pad id are ValueErrors; allocating from
  a full pool raises :class:`PoolExhausted`. A slot id is an int or a 0-d integer tensor (anything else,
  a bool, a float or a one-element 1-d tensor, is a ValueError). Every operation checks all of its
  arguments before it changes anything: a call that raises leaves slots and states as they were.
  ``alloc_group(n)`` / ``free_group(slots)`` hand out and take back several slots at once, all or nothing (a
  request decoding with ``num_spec`` speculative tokens holds ``1 + num_spec`` slots: one state per position
  of its step, as ``reference.cache.slots_needed`` reserves).
  ``PAD_SLOT_ID = -1`` marks a padded request: gather returns zeros for it and scatter skips it (it
  must never wrap to the last slot).

Snapshots
  ``snapshot(slot)`` returns a :class:`Snapshot` (a dict ``{"conv.<l>": t, "recurrent.<l>": t}`` of
  contiguous clones, in logical shape) tagged with the pool's ``model_key`` (spec, layer count, dtypes).
  ``restore(slot, snapshot)`` copies it in; a snapshot of another model / state layout (other spec,
  layer count or dtype, or a plain dict whose keys, shapes or dtypes differ) is a ValueError. Snapshots
  are independent of the memory layout: one taken from a page-major pool restores into a layer-major
  pool of the same model.
"""
from __future__ import annotations

import heapq
import math
import operator
from typing import Sequence

import torch

from harness.ops import PAD_SLOT_ID  # the op contract's pad id (one definition)
from reference.cache import GDNSpec, KDASpec, Mamba1Spec, Mamba2Spec, itemsize
from reference.validate import check_int, fail

LAYOUTS = ("layer_major", "page_major")
_STATE_ALIGN = 16  # byte alignment of every state inside a page


class PoolExhausted(RuntimeError):
    """alloc() on a pool with no free slot."""


class Snapshot(dict):
    """A dict of state tensors ``{"conv.<layer>": ..., "recurrent.<layer>": ...}`` plus the key of the
    model/state layout it was taken from (``model_key``) and, optionally, the token count it holds."""

    def __init__(self, tensors: dict, model_key, num_tokens: int | None = None):
        super().__init__(tensors)
        self.model_key = model_key
        self.num_tokens = num_tokens

    def clone(self) -> "Snapshot":
        return Snapshot({k: v.clone() for k, v in self.items()}, self.model_key, self.num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values())


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """An integer dtype (not bool): what slot ids and token ids may be held in."""
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class StatePool:
    """Conv + recurrent state of every SSM layer for `num_slots` request slots.

    Args:
      spec: a reference.cache spec (Mamba1Spec, Mamba2Spec, GDNSpec, KDASpec) -- per layer, per rank.
      num_layers: number of SSM layers (all share the spec).
      num_slots: number of slots.
      device: torch device of the states.
      dtype: if given, overrides both state dtypes (e.g. float64 for oracle runs); else the spec's.
      layout: "layer_major" or "page_major" (see module doc).
      conv_channels_last: store conv states as (K-1, conv_dim) in memory (exposed transposed).
      page_multiple: page_major only: each layer's region in a page is padded to this many bytes
        (a multiple of 16).
    """

    def __init__(self, spec, num_layers: int, num_slots: int, *, device="cpu", dtype: torch.dtype | None = None,
                 layout: str = "layer_major", conv_channels_last: bool = False, page_multiple: int = 16):
        if not isinstance(spec, (Mamba1Spec, Mamba2Spec, GDNSpec, KDASpec)):
            fail("spec", "a reference.cache spec (Mamba1Spec, Mamba2Spec, GDNSpec or KDASpec)", type(spec).__name__)
        for name, v, lo in (("num_layers", num_layers, 1), ("num_slots", num_slots, 1)):
            check_int(name, v, lo)
        if layout not in LAYOUTS:
            fail("layout", f"one of {list(LAYOUTS)}", repr(layout))
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            fail("dtype", "None or a floating-point torch.dtype", repr(dtype))
        if isinstance(page_multiple, bool) or not isinstance(page_multiple, int) or page_multiple <= 0 \
                or page_multiple % _STATE_ALIGN:
            fail("page_multiple", f"a positive multiple of {_STATE_ALIGN}", repr(page_multiple))
        self.spec = spec
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.layout = layout
        self.conv_channels_last = bool(conv_channels_last)
        self.conv_dtype = dtype or spec.conv_dtype
        self.recurrent_dtype = dtype or spec.recurrent_dtype
        self.conv_shape = tuple(spec.conv_shape)
        self.recurrent_shape = tuple(spec.recurrent_shape)
        self.model_key = (spec, num_layers, self.conv_dtype, self.recurrent_dtype)

        self._free_heap = list(range(num_slots))
        self._allocated: set[int] = set()
        self._conv: list[torch.Tensor] = []
        self._rec: list[torch.Tensor] = []
        if layout == "layer_major":
            self.slot_bytes = None
            self.buffer = None
            for _ in range(num_layers):
                self._conv.append(self._new_conv())
                self._rec.append(torch.zeros((num_slots, *self.recurrent_shape), dtype=self.recurrent_dtype,
                                             device=self.device))
        else:
            self._build_page_major(page_multiple)

    # ------------------------------------------------------------------ storage
    def _new_conv(self) -> torch.Tensor:
        c, k1 = self.conv_shape
        if self.conv_channels_last:
            return torch.zeros((self.num_slots, k1, c), dtype=self.conv_dtype, device=self.device).transpose(1, 2)
        return torch.zeros((self.num_slots, c, k1), dtype=self.conv_dtype, device=self.device)

    def _build_page_major(self, page_multiple: int) -> None:
        conv_bytes = math.prod(self.conv_shape) * itemsize(self.conv_dtype)
        rec_bytes = math.prod(self.recurrent_shape) * itemsize(self.recurrent_dtype)
        self.conv_offset = 0
        self.recurrent_offset = _round_up(conv_bytes, _STATE_ALIGN)
        self.layer_bytes = _round_up(self.recurrent_offset + rec_bytes, page_multiple)
        self.slot_bytes = self.layer_bytes * self.num_layers
        self.buffer = torch.zeros(self.num_slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        conv_flat = self.buffer.view(self.conv_dtype)
        rec_flat = self.buffer.view(self.recurrent_dtype)
        ci, ri = itemsize(self.conv_dtype), itemsize(self.recurrent_dtype)
        c, k1 = self.conv_shape
        rec_strides = [1]
        for s in reversed(self.recurrent_shape[1:]):
            rec_strides.insert(0, rec_strides[0] * s)
        for layer in range(self.num_layers):
            base = layer * self.layer_bytes
            conv_inner = (1, c) if self.conv_channels_last else (k1, 1)
            self._conv.append(torch.as_strided(conv_flat, (self.num_slots, c, k1),
                                               (self.slot_bytes // ci, *conv_inner),
                                               (base + self.conv_offset) // ci))
            self._rec.append(torch.as_strided(rec_flat, (self.num_slots, *self.recurrent_shape),
                                              (self.slot_bytes // ri, *rec_strides),
                                              (base + self.recurrent_offset) // ri))

    def conv(self, layer: int) -> torch.Tensor:
        """The conv states of `layer`: (num_slots, conv_dim, K-1), possibly a strided view."""
        return self._conv[self._layer(layer)]

    def recurrent(self, layer: int) -> torch.Tensor:
        """The recurrent states of `layer`: (num_slots, *recurrent_shape), possibly a strided view."""
        return self._rec[self._layer(layer)]

    @property
    def conv_states(self) -> list[torch.Tensor]:
        return list(self._conv)

    @property
    def recurrent_states(self) -> list[torch.Tensor]:
        return list(self._rec)

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            fail("layer", f"an int in 0..{self.num_layers - 1}", repr(layer))
        return layer

    # ------------------------------------------------------------------ slots
    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return len(self._allocated)

    @property
    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    def is_allocated(self, slot) -> bool:
        return self._slot_id("slot", slot, allow_pad=True) in self._allocated

    def lowest_free(self, n: int) -> list[int]:
        """The slot ids the next `n` alloc() calls would hand out (fewer if fewer are free)."""
        return heapq.nsmallest(n, self._free_heap)

    def alloc(self, *, zero: bool = False) -> int:
        """Hand out the lowest free slot id (its state is left as is unless `zero`)."""
        if not self._free_heap:
            raise PoolExhausted(f"state pool exhausted: all {self.num_slots} slots are in use")
        slot = heapq.heappop(self._free_heap)
        self._allocated.add(slot)
        if zero:
            self.zero_(slot)
        return slot

    def free(self, slot) -> None:
        slot = self._slot_id("slot", slot)
        if slot not in self._allocated:
            fail("slot", "an allocated slot id", f"{slot}, which is free (double free or never allocated)")
        self._allocated.remove(slot)
        heapq.heappush(self._free_heap, slot)

    def alloc_group(self, n: int, *, zero: bool = False) -> list[int]:
        """Hand out the `n` lowest free slot ids at once (a request's slot group: its state plus one slot per
        speculative token, ``reference.cache.slots_needed``); all or nothing: :class:`PoolExhausted` when
        fewer than `n` are free, and nothing is handed out."""
        check_int("n", n, 1)
        if len(self._free_heap) < n:
            raise PoolExhausted(f"state pool exhausted: {n} slots wanted, {len(self._free_heap)} of "
                                f"{self.num_slots} free")
        return [self.alloc(zero=zero) for _ in range(n)]

    def free_group(self, slots) -> None:
        """Free every slot of `slots` (a group from :meth:`alloc_group`); all or nothing: a slot that is not
        allocated, or listed twice, is a ValueError and nothing is freed."""
        ids = self._slot_list(slots)
        for i, s in enumerate(ids):
            if s == PAD_SLOT_ID:
                fail(f"slots[{i}]", f"a real slot id (not PAD_SLOT_ID={PAD_SLOT_ID})", s)
        if len(set(ids)) != len(ids):
            fail("slots", "distinct slot ids", ids)
        for s in ids:
            self.free(s)

    def _slot_id(self, arg: str, slot, allow_pad: bool = False) -> int:
        """`slot` as an int: an int (not a bool) or a 0-d integer tensor, in range (or PAD_SLOT_ID if
        `allow_pad`); ValueError otherwise."""
        if isinstance(slot, torch.Tensor):
            if slot.dim() != 0 or not is_integer_dtype(slot.dtype):
                fail(arg, "an int slot id or a 0-d integer tensor",
                     f"a tensor of shape {tuple(slot.shape)} {slot.dtype}")
            slot = int(slot.item())
        elif isinstance(slot, bool):
            fail(arg, "an int slot id", repr(slot))
        else:
            try:
                slot = operator.index(slot)
            except TypeError:
                fail(arg, "an int slot id", repr(slot))
        if slot == PAD_SLOT_ID:
            if not allow_pad:
                fail(arg, f"a real slot id (not PAD_SLOT_ID={PAD_SLOT_ID})", slot)
            return slot
        if not 0 <= slot < self.num_slots:
            fail(arg, f"a slot id in 0..{self.num_slots - 1}" + (f" or PAD_SLOT_ID={PAD_SLOT_ID}" if allow_pad else ""),
                 slot)
        return slot

    def _check_live(self, arg: str, slot) -> int:
        slot = self._slot_id(arg, slot)
        if slot not in self._allocated:
            fail(arg, "an allocated slot id", f"{slot}, which is free")
        return slot

    def zero_(self, slot) -> None:
        slot = self._slot_id("slot", slot)
        for c, r in zip(self._conv, self._rec):
            c[slot].zero_()
            r[slot].zero_()

    def fill_free_(self, value: float = float("nan")) -> None:
        """Fill every free slot's states with `value` (NaN by default), to catch reads of unowned slots."""
        free = sorted(self._free_heap)
        if not free:
            return
        idx = torch.tensor(free, device=self.device)
        for c, r in zip(self._conv, self._rec):
            c[idx] = value
            r[idx] = value

    # ------------------------------------------------------------------ batched access for a runner
    def _slot_list(self, slots) -> list[int]:
        if isinstance(slots, torch.Tensor):
            if slots.dim() != 1 or not is_integer_dtype(slots.dtype):
                fail("slots", "a sequence of slot ids or a 1-d integer tensor",
                     f"a tensor of shape {tuple(slots.shape)} {slots.dtype}")
            slots = slots.detach().cpu().tolist()
        elif isinstance(slots, (str, bytes)) or not hasattr(slots, "__iter__"):
            fail("slots", "a sequence of slot ids or a 1-d integer tensor", repr(slots))
        out = []
        for i, s in enumerate(slots):
            s = self._slot_id(f"slots[{i}]", s, allow_pad=True)
            if s != PAD_SLOT_ID and s not in self._allocated:
                fail(f"slots[{i}]", "an allocated slot id or PAD_SLOT_ID", f"{s}, which is free")
            out.append(s)
        return out

    def gather(self, layer: int, slots: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of `layer`'s states for `slots` (zeros for PAD_SLOT_ID rows):
        conv (S, conv_dim, K-1), recurrent (S, *recurrent_shape)."""
        slots = self._slot_list(slots)
        out = []
        for src in (self.conv(layer), self.recurrent(layer)):
            res = torch.zeros((len(slots), *src.shape[1:]), dtype=src.dtype, device=src.device)
            live = [i for i, s in enumerate(slots) if s != PAD_SLOT_ID]
            if live:
                res[live] = src[[slots[i] for i in live]]
            out.append(res)
        return out[0], out[1]

    def scatter(self, layer: int, slots: Sequence[int] | torch.Tensor, conv: torch.Tensor | None = None,
                recurrent: torch.Tensor | None = None) -> None:
        """Write per-request states (row i -> slots[i]) into `layer`; PAD_SLOT_ID rows are skipped.
        A slot listed twice is a ValueError (the write order would decide the result)."""
        slots = self._slot_list(slots)
        live = [i for i, s in enumerate(slots) if s != PAD_SLOT_ID]
        targets = [slots[i] for i in live]
        if len(set(targets)) != len(targets):
            fail("slots", "distinct slot ids (apart from PAD_SLOT_ID)", slots)
        writes = []  # every value is checked (and converted) before anything is written
        for name, dst, val in (("conv", self.conv(layer), conv), ("recurrent", self.recurrent(layer), recurrent)):
            if val is None:
                continue
            want = (len(slots), *dst.shape[1:])
            if not isinstance(val, torch.Tensor) or tuple(val.shape) != want:
                fail(name, f"a tensor of shape {want}", tuple(val.shape) if isinstance(val, torch.Tensor) else val)
            if live:
                writes.append((dst, val[live].to(device=dst.device, dtype=dst.dtype)))
        for dst, val in writes:
            dst[targets] = val

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, slot: int, num_tokens: int | None = None) -> Snapshot:
        """Contiguous clones of every layer's state of `slot` (an allocated slot)."""
        slot = self._check_live("slot", slot)
        return Snapshot(self._snapshot_tensors(slot, num_tokens), self.model_key, num_tokens)

    def _snapshot_tensors(self, slot: int, num_tokens: int | None) -> dict:
        t = {}
        for layer in range(self.num_layers):
            t[f"conv.{layer}"] = self._conv[layer][slot].clone(memory_format=torch.contiguous_format)
            t[f"recurrent.{layer}"] = self._rec[layer][slot].clone(memory_format=torch.contiguous_format)
        return t

    def _describe_key(self, key) -> str:
        try:
            spec, n, cd, rd = key
            return f"{spec.describe()} x {n} layers (conv {cd}, recurrent {rd})"
        except Exception:
            return repr(key)

    def check_snapshot(self, snapshot) -> None:
        """ValueError unless `snapshot` holds exactly this pool's states (same model and state layout)."""
        if not isinstance(snapshot, dict):
            fail("snapshot", "a dict of state tensors (Snapshot)", type(snapshot).__name__)
        key = getattr(snapshot, "model_key", None)
        if key is not None and key != self.model_key:
            fail("snapshot", f"a snapshot of this pool's model [{self._describe_key(self.model_key)}]",
                 f"one of [{self._describe_key(key)}]")
        self._check_tensors(snapshot)

    def _snapshot_keys(self) -> set:
        return {f"{kind}.{layer}" for layer in range(self.num_layers) for kind in ("conv", "recurrent")}

    def _check_tensors(self, snapshot) -> None:
        """The keys, shapes and dtypes of a snapshot's tensors."""
        want = self._snapshot_keys()
        if set(snapshot) != want:
            fail("snapshot", f"keys {sorted(want)}", sorted(snapshot))
        for layer in range(self.num_layers):
            for kind, shape, dt in (("conv", self.conv_shape, self.conv_dtype),
                                    ("recurrent", self.recurrent_shape, self.recurrent_dtype)):
                t = snapshot[f"{kind}.{layer}"]
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dt:
                    got = f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                    fail(f"snapshot['{kind}.{layer}']", f"shape {shape} {dt}", got)

    def restore(self, slot: int, snapshot) -> None:
        """Copy `snapshot` into the allocated `slot` (after :meth:`check_snapshot`)."""
        slot = self._check_live("slot", slot)
        self.check_snapshot(snapshot)
        self._restore_tensors(slot, snapshot)

    def _restore_tensors(self, slot: int, snapshot) -> None:
        for layer in range(self.num_layers):
            self._conv[layer][slot].copy_(snapshot[f"conv.{layer}"])
            self._rec[layer][slot].copy_(snapshot[f"recurrent.{layer}"])

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's state of slot `src` into slot `dst` (both allocated)."""
        src = self._check_live("src", src)
        dst = self._check_live("dst", dst)
        for c, r in zip(self._conv, self._rec):
            c[dst] = c[src]
            r[dst] = r[src]

    def __repr__(self) -> str:
        return (f"StatePool({self.spec.kind}, layers={self.num_layers}, slots={self.num_slots}, layout={self.layout}, "
                f"conv {self.conv_shape} {self.conv_dtype}, recurrent {self.recurrent_shape} {self.recurrent_dtype}, "
                f"used={self.num_used})")
