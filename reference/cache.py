"""State cache layouts: what one request's state looks like per layer, as an engine's MambaSpec says it.

One frozen dataclass per mixer kind describes the per-layer, per-rank state of ONE slot:

===========  ======================================  ==========================  ======================
kind         conv state (conv_dim/TP, K-1)            recurrent state             recurrent dtype
===========  ======================================  ==========================  ======================
mamba1       D/TP                                    (D/TP, N)                   recurrent_dtype
mamba2       D/TP + 2*G'*N  (x, B, C convolved)       (H/TP, P, N)                recurrent_dtype
gdn          (2*Hk*Dk + Hv*Dv)/TP  (q, k, v)          (Hv/TP, Dv, Dk)             recurrent_dtype
kda          3*H*Dh/TP  (q, k, v, one buffer)         (H/TP, Dh, Dh)              float32 (or float64)
===========  ======================================  ==========================  ======================

Decisions (documented here, tested in suites/cache/test_cache_specs.py):

* Mamba-2 groups under TP. ``n_groups`` must be a multiple of ``tp_size`` (each rank holds
  ``n_groups / tp_size`` groups), except ``n_groups == 1``, which is *replicated*: every rank holds
  the one group, so ``G' = 1`` per rank and the rank's conv dim is ``D/TP + 2*N``. Any other
  ``n_groups`` not divisible by ``tp_size`` is a ValueError naming ``n_groups``. (vLLM does the same:
  it adds ``tp - 1`` replica groups only when ``n_groups == 1``.)
* GDN's recurrent state is stored value-major ``(Hv/TP, Dv, Dk)``; the conv state is one buffer
  for q, k and v together (``2*key_dim + value_dim`` channels, q|k|v, each sharded by TP).
  ``num_v_heads`` must be a multiple of ``num_k_heads`` (k heads are shared by v heads).
* KDA: q, k and v are convolved in ONE conv buffer of ``3*H*Dh`` channels (engines that keep three
  separate buffers have the same bytes); its recurrent state is float32 whatever the model dtype (float64
  only for a float64 engine, such as the CPU oracle runs); asking for another recurrent dtype is a ValueError
  naming ``recurrent_dtype``.
* Speculative decoding is handled with extra *slots* (see :func:`slots_needed`), not by widening
  the conv window.
* ``page_size`` (= ``bytes_per_slot``) is the conv bytes plus the recurrent bytes of one layer for
  one slot, nothing else. ``padded_page_size(multiple)`` rounds it up to a multiple of ``multiple``
  (typically the attention page size of a hybrid model, so that an SSM page occupies a whole number
  of attention pages; with ``multiple >= page_size`` that is exactly one attention page).
* Mamba-1 in Mamba-2 form ("full rank"): :func:`mamba1_as_mamba2` returns the Mamba-2 spec with
  ``num_heads = D``, ``head_dim = 1``, ``n_groups = 1`` and ``bc_in_conv = False`` (Mamba-1 convolves
  only x; B and C come out of x_proj after the conv). Its recurrent state ``(D/TP, 1, N)`` is Mamba-1's
  ``(D/TP, N)`` up to a reshape and its conv state is identical.

Cache modes (prefix caching of states), block size in tokens (a positive multiple of 8):

* ``none``: only the live state of each request;
* ``align``: a snapshot only where a scheduled step ends exactly on a block boundary;
* ``all``: a snapshot at every block boundary a step crosses or ends on.

Dtypes are ``torch.dtype`` objects (floating point). Defaults: conv ``bfloat16``, recurrent
``float32`` (the usual serving setting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from reference.validate import fail

CACHE_MODES = ("none", "align", "all")
KINDS = ("mamba1", "mamba2", "gdn", "kda")
BLOCK_ALIGN = 8  # block sizes must be a positive multiple of this


# ----------------------------------------------------------------------------------------------
# field checks

def _check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, "an int", f"{type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        fail(name, f"an int {rng}", value)


def _check_multiple(name: str, value: int, tp_size: int) -> None:
    if value % tp_size != 0:
        fail(name, f"a multiple of tp_size={tp_size}", value)


def _check_dtype(name: str, dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        fail(name, "a torch.dtype", f"{type(dtype).__name__} {dtype!r}")
    if not dtype.is_floating_point:
        fail(name, "a floating-point dtype", dtype)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape) -> int:
    return math.prod(shape)


# ----------------------------------------------------------------------------------------------
# the common part of every spec

class _SpecMixin:
    """Derived quantities shared by every spec; subclasses define the shapes."""

    kind: str = ""
    tp_size: int
    conv_kernel: int
    conv_dtype: torch.dtype
    recurrent_dtype: torch.dtype

    # shapes (per rank) -- defined by subclasses
    @property
    def conv_dim(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def recurrent_shape(self) -> tuple[int, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def conv_segments(self) -> list[tuple[str, int, int, bool]]:  # pragma: no cover - abstract
        """The conv channels in buffer order: (name, unsharded size, size per rank, replicated)."""
        raise NotImplementedError

    @property
    def conv_shape(self) -> tuple[int, int]:
        """(conv_dim per rank, K-1): the last K-1 inputs, oldest first."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {"conv": self.conv_shape, "recurrent": self.recurrent_shape}

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        return {"conv": self.conv_dtype, "recurrent": self.recurrent_dtype}

    @property
    def conv_numel(self) -> int:
        return _numel(self.conv_shape)

    @property
    def recurrent_numel(self) -> int:
        return _numel(self.recurrent_shape)

    @property
    def conv_bytes(self) -> int:
        return self.conv_numel * itemsize(self.conv_dtype)

    @property
    def recurrent_bytes(self) -> int:
        return self.recurrent_numel * itemsize(self.recurrent_dtype)

    @property
    def bytes_per_slot(self) -> int:
        """Conv bytes + recurrent bytes of one layer for one slot (on one rank)."""
        return self.conv_bytes + self.recurrent_bytes

    @property
    def page_size(self) -> int:
        """Alias of :attr:`bytes_per_slot` (an engine's page of one layer holds one slot's state)."""
        return self.bytes_per_slot

    def padded_page_size(self, multiple: int) -> int:
        """`page_size` rounded up to a multiple of `multiple` bytes (e.g. the attention page size)."""
        _check_int("multiple", multiple)
        return -(-self.page_size // multiple) * multiple

    def unsharded(self):
        """The same spec with tp_size=1 (the whole state, as one rank without TP holds it)."""
        return replace(self, tp_size=1)

    def describe(self) -> str:
        return (f"{self.kind}: conv {self.conv_shape} {self.conv_dtype}, recurrent {self.recurrent_shape} "
                f"{self.recurrent_dtype}, {self.bytes_per_slot} B/slot, tp_size={self.tp_size}")


def _common_checks(spec) -> None:
    _check_int("tp_size", spec.tp_size)
    _check_int("conv_kernel", spec.conv_kernel, 2, 8)
    _check_dtype("conv_dtype", spec.conv_dtype)
    _check_dtype("recurrent_dtype", spec.recurrent_dtype)


# ----------------------------------------------------------------------------------------------
# the four mixer kinds

@dataclass(frozen=True)
class Mamba1Spec(_SpecMixin):
    """Mamba-1 / Falcon-Mamba: intermediate size D (= expand * d_model), state size N."""

    intermediate_size: int
    state_size: int
    conv_kernel: int = 4
    tp_size: int = 1
    conv_dtype: torch.dtype = torch.bfloat16
    recurrent_dtype: torch.dtype = torch.float32
    kind: str = field(default="mamba1", init=False)

    def __post_init__(self):
        _check_int("intermediate_size", self.intermediate_size)
        _check_int("state_size", self.state_size)
        _common_checks(self)
        _check_multiple("intermediate_size", self.intermediate_size, self.tp_size)

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def recurrent_shape(self) -> tuple[int, int]:
        return (self.intermediate_size // self.tp_size, self.state_size)

    def conv_segments(self):
        return [("x", self.intermediate_size, self.intermediate_size // self.tp_size, False)]


@dataclass(frozen=True)
class Mamba2Spec(_SpecMixin):
    """Mamba-2: H heads of head_dim P (D = H*P), state size N, G groups of B/C.

    ``bc_in_conv=False`` drops B and C from the conv (only used by :func:`mamba1_as_mamba2`).
    """

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    tp_size: int = 1
    conv_dtype: torch.dtype = torch.bfloat16
    recurrent_dtype: torch.dtype = torch.float32
    bc_in_conv: bool = True
    kind: str = field(default="mamba2", init=False)

    def __post_init__(self):
        _check_int("num_heads", self.num_heads)
        _check_int("head_dim", self.head_dim)
        _check_int("state_size", self.state_size)
        _check_int("n_groups", self.n_groups)
        _common_checks(self)
        if not isinstance(self.bc_in_conv, bool):
            fail("bc_in_conv", "a bool", repr(self.bc_in_conv))
        if self.num_heads % self.n_groups != 0:
            fail("n_groups", f"a divisor of num_heads={self.num_heads}", self.n_groups)
        _check_multiple("num_heads", self.num_heads, self.tp_size)
        if self.n_groups != 1 and self.n_groups % self.tp_size != 0:
            fail("n_groups", f"1 (replicated) or a multiple of tp_size={self.tp_size}", self.n_groups)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def groups_per_rank(self) -> int:
        """G' = n_groups / tp_size, or 1 when the single group is replicated on every rank."""
        return 1 if self.n_groups == 1 else self.n_groups // self.tp_size

    @property
    def conv_dim(self) -> int:
        return sum(s[2] for s in self.conv_segments())

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads // self.tp_size, self.head_dim, self.state_size)

    def conv_segments(self):
        d = self.intermediate_size
        segs = [("x", d, d // self.tp_size, False)]
        if self.bc_in_conv:
            gn = self.n_groups * self.state_size
            per_rank = self.groups_per_rank * self.state_size
            replicated = self.n_groups == 1 and self.tp_size > 1
            segs += [("B", gn, per_rank, replicated), ("C", gn, per_rank, replicated)]
        return segs


@dataclass(frozen=True)
class GDNSpec(_SpecMixin):
    """Gated DeltaNet: Hk key heads of Dk, Hv value heads of Dv (Hv a multiple of Hk)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    tp_size: int = 1
    conv_dtype: torch.dtype = torch.bfloat16
    recurrent_dtype: torch.dtype = torch.float32
    kind: str = field(default="gdn", init=False)

    def __post_init__(self):
        for f in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            _check_int(f, getattr(self, f))
        _common_checks(self)
        if self.num_v_heads % self.num_k_heads != 0:
            fail("num_v_heads", f"a multiple of num_k_heads={self.num_k_heads}", self.num_v_heads)
        _check_multiple("num_k_heads", self.num_k_heads, self.tp_size)
        _check_multiple("num_v_heads", self.num_v_heads, self.tp_size)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return (2 * self.key_dim + self.value_dim) // self.tp_size

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads // self.tp_size, self.head_v_dim, self.head_k_dim)

    def conv_segments(self):
        t = self.tp_size
        return [("q", self.key_dim, self.key_dim // t, False), ("k", self.key_dim, self.key_dim // t, False),
                ("v", self.value_dim, self.value_dim // t, False)]


@dataclass(frozen=True)
class KDASpec(_SpecMixin):
    """Kimi Delta Attention: H heads of head_dim Dh for q, k and v; float32 recurrent state."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    tp_size: int = 1
    conv_dtype: torch.dtype = torch.bfloat16
    recurrent_dtype: torch.dtype = torch.float32
    kind: str = field(default="kda", init=False)

    def __post_init__(self):
        _check_int("num_heads", self.num_heads)
        _check_int("head_dim", self.head_dim)
        _common_checks(self)
        if self.recurrent_dtype not in (torch.float32, torch.float64):
            fail("recurrent_dtype", "torch.float32 or torch.float64 (KDA keeps its recurrent state in fp32 at least)",
                 self.recurrent_dtype)
        _check_multiple("num_heads", self.num_heads, self.tp_size)

    @property
    def conv_dim(self) -> int:
        return 3 * self.num_heads * self.head_dim // self.tp_size

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads // self.tp_size, self.head_dim, self.head_dim)

    def conv_segments(self):
        hd = self.num_heads * self.head_dim
        return [(n, hd, hd // self.tp_size, False) for n in ("q", "k", "v")]


@dataclass(frozen=True)
class KVSpec:
    """The key/value cache of one full-attention layer of a hybrid model, per token: keys
    (num_kv_heads, k_head_dim) and values (num_kv_heads, v_head_dim) as the attention reads them (after
    every per-token transform: q/k norms, rotary embedding, latent expansion). Unlike a mixer's state it
    grows with the sequence: a request of L tokens holds (L, num_kv_heads, k_head_dim) keys and
    (L, num_kv_heads, v_head_dim) values."""

    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for f in ("num_kv_heads", "k_head_dim", "v_head_dim"):
            _check_int(f, getattr(self, f))
        _check_dtype("dtype", self.dtype)

    @property
    def k_shape(self) -> tuple[int, int]:
        return (self.num_kv_heads, self.k_head_dim)

    @property
    def v_shape(self) -> tuple[int, int]:
        return (self.num_kv_heads, self.v_head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes of one token of one layer."""
        return (_numel(self.k_shape) + _numel(self.v_shape)) * itemsize(self.dtype)

    def describe(self) -> str:
        return f"kv: k {self.k_shape}, v {self.v_shape} {self.dtype} per token"


StateSpec = Mamba1Spec | Mamba2Spec | GDNSpec | KDASpec
SPEC_TYPES = {"mamba1": Mamba1Spec, "mamba2": Mamba2Spec, "gdn": GDNSpec, "kda": KDASpec}


def make_spec(kind: str, **fields) -> StateSpec:
    """Build the spec of mixer `kind` (one of KINDS) from its fields."""
    if kind not in SPEC_TYPES:
        fail("kind", f"one of {list(KINDS)}", repr(kind))
    return SPEC_TYPES[kind](**fields)


def mamba1_as_mamba2(spec: Mamba1Spec) -> Mamba2Spec:
    """Mamba-1 expressed as Mamba-2 ("full rank"): num_heads = D, head_dim = 1, one group, x-only conv.

    The result's recurrent state (D/TP, 1, N) holds exactly Mamba-1's (D/TP, N) (same numel, bytes,
    dtype; a reshape apart) and its conv state is Mamba-1's (D/TP, K-1).
    """
    if not isinstance(spec, Mamba1Spec):
        fail("spec", "a Mamba1Spec", type(spec).__name__)
    return Mamba2Spec(num_heads=spec.intermediate_size, head_dim=1, state_size=spec.state_size, n_groups=1,
                      conv_kernel=spec.conv_kernel, tp_size=spec.tp_size, conv_dtype=spec.conv_dtype,
                      recurrent_dtype=spec.recurrent_dtype, bc_in_conv=False)


# ----------------------------------------------------------------------------------------------
# cache modes

def check_cache_mode(mode) -> str:
    if mode not in CACHE_MODES:
        fail("mode", f"one of {list(CACHE_MODES)}", repr(mode))
    return mode


def check_block_size(block_size, name: str = "block_size") -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 \
            or block_size % BLOCK_ALIGN != 0:
        fail(name, f"a positive multiple of {BLOCK_ALIGN}", repr(block_size))
    return block_size


def slots_needed(mode: str, max_len: int, block_size: int, num_spec: int = 0) -> int:
    """How many state slots one request may need at once.

    * ``none``:  ``1 + num_spec`` (the live state plus one per speculative token);
    * ``all``:   ``1 + num_spec + max_len // block_size`` (plus one snapshot per full block);
    * ``align``: the same upper bound as ``all`` (a request's steps may all end on block boundaries).

    `max_len` is the request's maximum total length in tokens (prompt + generated), >= 0;
    `block_size` a positive multiple of 8; `num_spec` >= 0.
    """
    check_cache_mode(mode)
    _check_int("max_len", max_len, 0)
    check_block_size(block_size)
    _check_int("num_spec", num_spec, 0)
    base = 1 + num_spec
    if mode == "none":
        return base
    return base + max_len // block_size


def snapshot_positions(mode: str, num_computed: int, num_scheduled: int, block_size: int) -> list[int]:
    """Absolute token counts at which a step that computes tokens [num_computed, num_computed+num_scheduled)
    takes snapshots (the state after that many tokens):

    * ``none``:  none;
    * ``align``: ``[end]`` if the step ends on a block boundary (``end % block_size == 0``), else none;
    * ``all``:   every multiple of block_size in ``(num_computed, end]``.

    A step with no tokens takes no snapshot.
    """
    check_cache_mode(mode)
    _check_int("num_computed", num_computed, 0)
    _check_int("num_scheduled", num_scheduled, 0)
    check_block_size(block_size)
    end = num_computed + num_scheduled
    if mode == "none" or num_scheduled == 0:
        return []
    if mode == "align":
        return [end] if end % block_size == 0 else []
    first = (num_computed // block_size + 1) * block_size
    return list(range(first, end + 1, block_size))
