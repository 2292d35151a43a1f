"""Argument checks shared by the op validators (private to `harness.ops`).

Every check raises ValueError naming (argument, expected, got) through `reference.validate.fail`.
Index range checks read indices on the host (one device->host transfer per call: a varlen op's offsets
and slot ids travel together); inside `no_index_checks()` (CUDA-graph capture, the benchmark loop) they
are skipped. Validators run before every eager call, so the success path builds no message.

Fast paths: each validator first asks a predicate whether its whole input is valid, reading each tensor's
metadata once (the `*_ok` helpers below, which never raise); only when that says no do the checks one by
one run, the first broken rule raising its error. A predicate may say no to valid input (the checks then
accept it) but never yes to input a check rejects (the suites' bad-input and fuzz tests drive both).
"""
from __future__ import annotations

import contextlib
import math

import numpy
import torch

from reference.validate import check_offsets, check_tensor, fail

PAD_SLOT_ID = -1
INF = math.inf

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)

_INDEX_CHECKS = [True]


@contextlib.contextmanager
def no_index_checks():
    """Skip the host-side index range checks (they synchronise; illegal under CUDA-graph capture)."""
    _INDEX_CHECKS.append(False)
    try:
        yield
    finally:
        _INDEX_CHECKS.pop()


def index_checks_on() -> bool:
    return _INDEX_CHECKS[-1]


def same_device(**tensors):
    dev = None
    first = None
    for k, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev, first = t.device, k
        elif t.device != dev:
            fail(k, f"a tensor on {dev} (same device as {first})", f"a tensor on {t.device}")


# slot ids read to the host are checked as a Python list up to this many, as a numpy array from here on
# (a set over a few hundred ints costs more than numpy's fixed overhead)
_NUMPY_FROM = 128


def _host_values(t):
    return t.tolist() if t.shape[0] < _NUMPY_FROM else t.cpu().numpy()


def read_host(*tensors) -> list:
    """The values of 1-dim integer tensors on the host (a list of ints, or a numpy array for long ones), with
    one device->host transfer for all of them (on the CPU each is read as it is)."""
    if len(tensors) > 1 and not tensors[0].is_cpu:
        tensors = torch.cat(tensors).cpu().split([t.shape[0] for t in tensors])  # int32 + int64 -> int64
    return [_host_values(t) for t in tensors]


def check_qsl(query_start_loc, num_tokens, arg="query_start_loc", values=None):
    """query_start_loc: int32/int64 (S+1,), starts at 0, non-decreasing, ends at T. Returns S.
    `values`: its entries already read to the host (else they are read here)."""
    check_tensor(arg, query_start_loc, ndim=1, dtypes=INT_DTYPES)
    if _INDEX_CHECKS[-1]:
        if values is None:
            values = query_start_loc.tolist()
        check_offsets(arg, values if isinstance(values, list) else values.tolist(), num_tokens)
    elif query_start_loc.shape[0] < 2:
        fail(arg, "at least 2 entries [0, ..., T]", f"{query_start_loc.shape[0]} entries")
    return query_start_loc.shape[0] - 1


def check_qsl_indices(query_start_loc, num_tokens, arg, idx, num_slots, pad_slot_id):
    """`check_qsl` then `check_indices(arg, idx, S, ...)`, in that order, with both tensors' values read to
    the host in one transfer when both are well-formed. Returns S."""
    qv = iv = None
    if _INDEX_CHECKS[-1] and isinstance(query_start_loc, torch.Tensor) and isinstance(idx, torch.Tensor) \
            and query_start_loc.dim() == 1 and idx.dim() == 1 and idx.shape[0] == query_start_loc.shape[0] - 1 \
            and query_start_loc.dtype in INT_DTYPES and idx.dtype in INT_DTYPES \
            and not query_start_loc.is_meta and query_start_loc.device == idx.device:
        qv, iv = read_host(query_start_loc, idx)
    S = check_qsl(query_start_loc, num_tokens, values=qv)
    check_indices(arg, idx, S, num_slots, pad_slot_id, values=iv)
    return S


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_REAL = (int, float)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_INT64 = (-(1 << 63), (1 << 63) - 1)


def check_pad_slot_id(pad_slot_id):
    """An int that an int64 slot-id tensor can hold (kernels compare slot ids with it)."""
    if not _is_int(pad_slot_id) or not _INT64[0] <= pad_slot_id <= _INT64[1]:
        fail("pad_slot_id", "an int in the int64 range (default -1)", repr(pad_slot_id))


def check_indices(arg, idx, n, num_slots, pad_slot_id, values=None):
    """Slot ids: (n,) int, each in [0, num_slots) or the pad id, live ones distinct. `values`: the ids
    already read to the host (else they are read here)."""
    if type(pad_slot_id) is not int or not _INT64[0] <= pad_slot_id <= _INT64[1]:
        check_pad_slot_id(pad_slot_id)
    check_tensor(arg, idx, shape=(n,), dtypes=INT_DTYPES)
    if _INDEX_CHECKS[-1] and n:
        ids = read_host(idx)[0] if values is None else values
        if not _ids_ok(ids, n, num_slots, pad_slot_id):
            _fail_ids(arg, ids if isinstance(ids, list) else ids.tolist(), num_slots, pad_slot_id)


def _ids_ok(ids, n, num_slots, pad_slot_id) -> bool:
    """Every id in [0, num_slots) or the pad id, the live ones distinct (`ids` a list or a numpy array)."""
    if isinstance(ids, list):
        live = set(ids)
        live.discard(pad_slot_id)
        return not live or (min(live) >= 0 and max(live) < num_slots and len(live) == n - ids.count(pad_slot_id))
    live = ids[ids != pad_slot_id]
    if not live.size:
        return True
    if live.min() < 0 or live.max() >= num_slots:
        return False
    live = numpy.sort(live)
    return not (live[1:] == live[:-1]).any()


def _fail_ids(arg, ids: list, num_slots, pad_slot_id):
    """The error of slot ids `_ids_ok` rejected: the out-of-range ones with their positions, else the
    duplicates."""
    bad = [p for p, v in enumerate(ids) if v != pad_slot_id and not 0 <= v < num_slots]
    if bad:
        fail(arg, f"slot ids in [0, {num_slots}) or pad_slot_id={pad_slot_id}",
             f"{[ids[p] for p in bad]} at positions {bad}")
    fail(arg, "distinct slot ids for live requests", ids)


def check_flags(arg, flags, n):
    check_tensor(arg, flags, shape=(n,), dtypes=(torch.bool,))


def check_out(out, shape, dtype, device):
    if out is None:
        return
    check_tensor("out", out, shape=shape)
    if out.dtype != dtype:
        fail("out", f"dtype {dtype}", f"dtype {out.dtype}")
    if out.device != device:
        fail("out", f"a tensor on {device}", f"a tensor on {out.device}")


def check_groups(arg, t, rows, channels, what):
    """B / C of shape (rows, G, N) with G dividing `channels`. Returns (G, N)."""
    check_tensor(arg, t, ndim=3, dtypes=ACT_DTYPES)
    if t.shape[0] != rows:
        fail(arg, f"shape ({rows}, G, N)", f"shape {tuple(t.shape)}")
    G = t.shape[1]
    if G <= 0 or channels % G != 0:
        fail(arg, f"a group count G dividing {what}={channels}", f"G={G} (shape {tuple(t.shape)})")
    return G, t.shape[2]


def check_bc(B, C, rows, channels, what, N=None):
    """B and C with the same (rows, G, N); N must equal `N` when given. Returns (G, N)."""
    G, NB = check_groups("B", B, rows, channels, what)
    GC, NC = check_groups("C", C, rows, channels, what)
    want = NB if N is None else N
    if NB != want or NC != want or GC != G:
        fail("B/C", f"shape ({rows}, G, {want}) with the same G", f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    return G, want


def check_dt_limit(dt_limit):
    """(lo, hi): two real numbers, not NaN, lo <= hi (lo may be negative: dt is then allowed below 0)."""
    if type(dt_limit) is tuple and len(dt_limit) == 2 and type(dt_limit[0]) in _REAL and type(dt_limit[1]) in _REAL \
            and dt_limit[0] <= dt_limit[1]:  # the common case; NaN fails the comparison
        return
    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2 or not all(_is_real(v) for v in dt_limit) \
            or any(math.isnan(v) for v in dt_limit) or not dt_limit[0] <= dt_limit[1]:
        fail("dt_limit", "(lo, hi): two numbers, lo <= hi, not NaN", repr(dt_limit))


def check_eps(eps):
    if not _is_real(eps) or not math.isfinite(eps) or not eps > 0:
        fail("eps", "a finite number > 0", repr(eps))


def check_chunk_size(chunk_size):
    if not _is_int(chunk_size) or chunk_size < 1:
        fail("chunk_size", "a positive int", repr(chunk_size))


def check_param(arg, t, shape, optional=True):
    """A per-channel parameter (D, dt_bias, ...): a float tensor of the given shape(s)."""
    shapes = shape if isinstance(shape, list) else [shape]
    check_tensor(arg, t, dtypes=ACT_DTYPES, optional=optional)
    if t is not None and tuple(t.shape) not in [tuple(s) for s in shapes]:
        fail(arg, " or ".join(f"shape {tuple(s)}" for s in shapes), f"shape {tuple(t.shape)}")


def slots_disjoint(pool) -> bool:
    """No two elements of the pool share memory: its dims (size > 1), sorted by stride, each step past the
    extent of the ones before (an `expand`ed or overlapping view would let writing one slot change another)."""
    if pool.is_contiguous():  # row-major strides: no two elements share memory
        return True
    extent = 1
    for st, sz in sorted((st, sz) for st, sz in zip(pool.stride(), pool.shape) if sz > 1):
        if st < extent:
            return False
        extent = st * (sz - 1) + extent
    return True


def check_disjoint_slots(arg, pool):
    """No two elements of the pool share memory (`slots_disjoint`)."""
    if not slots_disjoint(pool):
        fail(arg, "a pool whose slots and elements do not overlap in memory",
             f"shape {tuple(pool.shape)} with strides {tuple(pool.stride())}")


def check_pool(arg, pool, slot_shape):
    """A state pool (num_slots, *slot_shape) of a float dtype (any strides)."""
    check_tensor(arg, pool, ndim=1 + len(slot_shape), dtypes=ACT_DTYPES)
    if tuple(pool.shape[1:]) != tuple(slot_shape):
        want = ", ".join(str(s) for s in slot_shape)
        fail(arg, f"shape (num_slots, {want})", f"shape {tuple(pool.shape)}")
    check_disjoint_slots(arg, pool)


def check_spec_decode(query_start_loc, indices_arg, state_indices, num_accepted_tokens, num_tokens, num_slots,
                      pad_slot_id):
    """The multi-token decode layout (reference.spec_decode): query_start_loc (Bsz+1,) over the packed tokens,
    `indices_arg` (Bsz, num_spec + 1) slot ids per position, num_accepted_tokens (Bsz,) in 1..num_spec+1; rows
    of at most num_spec + 1 tokens; live slot ids in the pool and distinct over the whole table. The host-side
    value checks are skipped inside `no_index_checks()`. Returns (Bsz, num_spec + 1)."""
    from reference.spec_decode import spec_rows
    check_pad_slot_id(pad_slot_id)
    check_qsl(query_start_loc, num_tokens)
    Bsz = query_start_loc.numel() - 1
    check_tensor(indices_arg, state_indices, ndim=2, dtypes=INT_DTYPES)
    if state_indices.shape[0] != Bsz or state_indices.shape[1] < 1:
        fail(indices_arg, f"shape ({Bsz}, num_spec + 1) (one row per query_start_loc row)",
             f"shape {tuple(state_indices.shape)}")
    check_tensor("num_accepted_tokens", num_accepted_tokens, shape=(Bsz,), dtypes=INT_DTYPES)
    if index_checks_on():
        spec_rows(query_start_loc, state_indices, num_accepted_tokens, num_tokens, num_slots, pad_slot_id,
                  indices_arg)
    return Bsz, state_indices.shape[1]


# ------------------------------------------------------------------------------ fast paths
# Predicates over many rules at once, for the validators' success path (module docstring). Each returns
# True only where the corresponding check_* functions pass, and never raises: any argument may be anything.
# `dev` is the device of the op's first activation, already known not to be the meta device; a tensor on
# `dev` has data.

_Tensor = torch.Tensor
ACT = frozenset(ACT_DTYPES)
INT = frozenset(INT_DTYPES)


def act_shape(x, ndim: int):
    """`x` a tensor with data, of an activation dtype and `ndim` dims: its shape, else None."""
    if isinstance(x, _Tensor) and not x.is_meta and x.dtype in ACT:
        s = x.shape
        if len(s) == ndim:
            return s
    return None


def pad_ok(pad_slot_id) -> bool:
    """`check_pad_slot_id` passes."""
    return type(pad_slot_id) is int and _INT64[0] <= pad_slot_id <= _INT64[1]


def fits(t, shape: tuple, dev) -> bool:
    """A tensor of an activation dtype and exactly `shape` on `dev`."""
    return isinstance(t, _Tensor) and t.device == dev and t.dtype in ACT and t.shape == shape


def opt_ok(t, shape: tuple, dev) -> bool:
    """An optional float tensor: None, or `fits`."""
    return t is None or (isinstance(t, _Tensor) and t.device == dev and t.dtype in ACT and t.shape == shape)


def param_ok(t, shapes: tuple, dev) -> bool:
    """`check_param(arg, t, shapes)` passes and `t` (None or a tensor) is on `dev`."""
    return t is None or (isinstance(t, _Tensor) and t.device == dev and t.dtype in ACT and t.shape in shapes)


def out_ok(out, shape: tuple, dtype, dev) -> bool:
    """`check_out(out, shape, dtype, dev)` passes."""
    return out is None or (isinstance(out, _Tensor) and out.device == dev and out.dtype == dtype
                           and out.shape == shape)


def pool_ok(pool, dev) -> bool:
    """A pool on `dev` of an activation dtype whose slots do not overlap (its shape is the caller's)."""
    return isinstance(pool, _Tensor) and pool.device == dev and pool.dtype in ACT and slots_disjoint(pool)


def bc_ok(B, C, rows: int, channels: int, N, dev) -> int:
    """B and C pass `check_groups` alike (same shape; N = `N` unless None) on `dev`: the group count G, else 0."""
    if not (isinstance(B, _Tensor) and isinstance(C, _Tensor) and B.device == dev and C.device == dev
            and B.dtype in ACT and C.dtype in ACT):
        return 0
    bs = B.shape
    if len(bs) != 3 or bs[0] != rows or (N is not None and bs[2] != N) or C.shape != bs:
        return 0
    G = bs[1]
    return G if G > 0 and channels % G == 0 else 0


def eps_ok(eps) -> bool:
    """`check_eps` passes (for a float; an int goes through the check)."""
    return type(eps) is float and 0.0 < eps < INF


def limit_ok(dt_limit) -> bool:
    """`check_dt_limit` passes (its common case: a tuple of two ints or floats, lo <= hi; NaN fails)."""
    return type(dt_limit) is tuple and len(dt_limit) == 2 and type(dt_limit[0]) in _REAL \
        and type(dt_limit[1]) in _REAL and dt_limit[0] <= dt_limit[1]


def _offsets_ok(values, num_tokens: int) -> bool:
    """`check_offsets` passes on offsets read by `read_host` (a list, or a numpy array for long ones)."""
    if isinstance(values, list):
        return len(values) >= 2 and values[0] == 0 and values[-1] == num_tokens and values == sorted(values)
    return len(values) >= 2 and values[0] == 0 and values[-1] == num_tokens and bool((values[1:] >= values[:-1]).all())


def slots_ok(idx, n: int, num_slots: int, pad_slot_id, dev) -> bool:
    """`check_indices(arg, idx, n, num_slots, pad_slot_id)` passes and `idx` is on `dev` (the values read
    unless inside `no_index_checks()`)."""
    if not (isinstance(idx, _Tensor) and idx.device == dev and idx.dtype in INT and idx.shape == (n,)
            and pad_ok(pad_slot_id)):
        return False
    return not (_INDEX_CHECKS[-1] and n) or _ids_ok(read_host(idx)[0], n, num_slots, pad_slot_id)


def varlen_ok(query_start_loc, num_tokens: int, idx, flags, num_slots: int, pad_slot_id, dev):
    """`check_qsl_indices` and `check_flags` pass, the three tensors on `dev`: the sequence count S, else None
    (offsets and slot ids read in one transfer unless inside `no_index_checks()`)."""
    q = query_start_loc
    if not (isinstance(q, _Tensor) and isinstance(idx, _Tensor) and isinstance(flags, _Tensor)
            and q.device == dev and idx.device == dev and flags.device == dev and pad_ok(pad_slot_id)
            and q.dtype in INT and idx.dtype in INT and flags.dtype == torch.bool):
        return None
    qs = q.shape
    if len(qs) != 1 or qs[0] < 2:
        return None
    S = qs[0] - 1
    if idx.shape != (S,) or flags.shape != (S,):
        return None
    if _INDEX_CHECKS[-1]:
        qv, iv = read_host(q, idx)
        if not _offsets_ok(qv, num_tokens) or (S and not _ids_ok(iv, S, num_slots, pad_slot_id)):
            return None
    return S


def spec_decode_ok(query_start_loc, table, num_accepted_tokens, num_tokens: int, num_slots: int, pad_slot_id,
                   dev):
    """`check_spec_decode` passes, the three tensors on `dev`: (Bsz, num_spec + 1), else None (the offsets,
    counts and slot table read in one transfer unless inside `no_index_checks()`)."""
    q, acc = query_start_loc, num_accepted_tokens
    if not (isinstance(q, _Tensor) and isinstance(table, _Tensor) and isinstance(acc, _Tensor)
            and q.device == dev and table.device == dev and acc.device == dev and pad_ok(pad_slot_id)
            and q.dtype in INT and table.dtype in INT and acc.dtype in INT):
        return None
    qs, ts = q.shape, table.shape
    if len(qs) != 1 or qs[0] < 2 or len(ts) != 2:
        return None
    Bsz, S = ts
    if qs[0] != Bsz + 1 or S < 1 or acc.shape != (Bsz,):
        return None
    if _INDEX_CHECKS[-1]:
        qv, av, tv = read_host(q, acc, table.reshape(-1))
        if not _offsets_ok(qv, num_tokens) or not _ids_ok(tv, Bsz * S, num_slots, pad_slot_id):
            return None
        longest = max(e - s for s, e in zip(qv, qv[1:])) if isinstance(qv, list) else (qv[1:] - qv[:-1]).max()
        lo, hi = (min(av), max(av)) if isinstance(av, list) else (av.min(), av.max())  # Bsz >= 1 here
        if longest > S or lo < 1 or hi > S:
            return None
    return Bsz, S


# --------------------------------------------------------------------------------------------------- out=

def _byte_extent(t) -> tuple[int, int] | None:
    """[first, last + 1) byte addresses a tensor's elements lie within (None: no elements, or no memory)."""
    numel = t.numel()
    if numel == 0 or t.is_meta:
        return None
    start = t.data_ptr()
    if t.is_contiguous():  # most arguments: no walk over the dims (this runs on every op call given out=)
        return start, start + numel * t.element_size()
    span = 0
    for n, s in zip(t.shape, t.stride()):
        span += (n - 1) * s
    return start, start + (span + 1) * t.element_size()


def _element_bytes(t, base: int):
    """Every byte address (relative to `base`) of `t`'s elements, as a CPU int64 tensor (metadata only)."""
    e = t.element_size()
    idx = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * (s * e)
    return (idx.reshape(-1, 1) + torch.arange(e, dtype=torch.int64) + (t.data_ptr() - base)).reshape(-1)


def _extents_apart(ea, eb) -> bool:
    return ea is None or eb is None or ea[1] <= eb[0] or eb[1] <= ea[0]


def extents_apart(a, b) -> bool:
    """The byte ranges `a`'s and `b`'s elements lie within do not meet, so no element is shared (metadata only;
    False decides nothing: `shares_memory` then compares the elements)."""
    return _extents_apart(_byte_extent(a), _byte_extent(b))


def shares_memory(a, b) -> bool:
    """Whether tensors `a` and `b` have an element byte in common. From their metadata alone (addresses,
    shapes, strides): disjoint address ranges answer at once; interleaved views of one buffer (the x and z
    halves of a projection) are told apart element by element, on the CPU, only when their ranges meet."""
    if a.device != b.device:
        return False
    ea, eb = _byte_extent(a), _byte_extent(b)
    if _extents_apart(ea, eb):
        return False
    base = min(ea[0], eb[0])
    mark = torch.zeros(max(ea[1], eb[1]) - base, dtype=torch.bool)
    mark[_element_bytes(a, base)] = True
    return bool(mark[_element_bytes(b, base)].any())


def same_view(a, b) -> bool:
    """`a` and `b` are the same elements in the same order: one tensor, or two views of it alike."""
    return same_view_shape(a, b) and a.data_ptr() == b.data_ptr()


def check_out_alone(out, tensors: dict, in_place: str | None = None) -> None:
    """`out=` shares no memory with the op's tensor arguments (`tensors`: name -> tensor or None; the state
    pool among them), or is the argument `in_place` itself (the op then writes its result over that input,
    as engines run some ops in place). An output that overlaps an input would be read after it is written."""
    if out is None or not isinstance(out, _Tensor):
        return
    eo = _byte_extent(out)  # once, not per argument: this runs on every op call given out=
    if eo is None:
        return
    for name, t in tensors.items():
        # apart address ranges answer at once; the in-place argument itself is admitted without comparing its
        # elements; `shares_memory` tells devices and interleaved views apart
        if not isinstance(t, _Tensor) or _extents_apart(eo, _byte_extent(t)) \
                or (name == in_place and same_view(out, t)) or not shares_memory(out, t):
            continue
        own = "memory of its own (no element shared with an input or the state pool)"
        expected = own if in_place is None else f"{own}, or {in_place} itself (in place)"
        fail("out", expected, f"elements shared with {name}")


# ------------------------------------------------------------------------------ per-signature memos
# A validator's answer (with the index checks off) depends on the arguments' metadata and option values, and on
# their addresses only through the rule that `out=` and an argument written whole in place (add_rms_norm's
# residual: a spec's `pool` without `index`) share no memory with the other arguments; the byte spans those
# checks compare depend on metadata alone. `call_key` is that metadata as one hashable tuple: a memo keyed on
# it (the validators' memo in `harness.ops`, the Triton ops' launch plans) answers a repeated call with one
# dictionary lookup, then compares the addresses of those arguments with the others' (`all_apart`). Equal keys:
# tensors of equal dtype, device, shape and strides; other arguments of one type and equal values (True and 1
# differ; 0.0 and -0.0 do not, so a memo keeps no value derived from a float argument).

def call_key(args) -> tuple:
    """The metadata of `args` (tensors: dtype, device, shape, strides; anything else: its type and value).
    Looking up a key that holds an unhashable value (a list) raises TypeError: the caller then takes its uncached
    path."""
    key = []
    for a in args:
        if isinstance(a, _Tensor):
            key += (a.dtype, a.device, a.shape, a.stride())
        else:
            key += (type(a), a)
    return tuple(key)


def _nbytes_spanned(t) -> int:
    """The length of the byte range `_byte_extent` gives `t` (0: no elements or no memory)."""
    if t.numel() == 0 or t.is_meta:
        return 0
    span = 0
    for n, s in zip(t.shape, t.stride()):
        span += (n - 1) * s
    return (span + 1) * t.element_size()


def out_spans(out, tensors, same: int | None = None) -> tuple:
    """What `out_apart` compares, from metadata alone (one signature's): ((position, bytes spanned, whether a
    range at `out`'s own address is `out` itself), ...) of the tensors among `tensors` (a sequence, None and
    non-tensors skipped) that have elements on `out`'s device, and `out`'s own span (0: `out` has no elements,
    nothing to compare). `same`: the position of the argument `out` may be (the spec's `in_place`): at `out`'s
    address with `out`'s dtype, shape and strides, it is `out` itself (`same_view`)."""
    span = _nbytes_spanned(out)
    if not span:
        return (), 0
    dev = out.device
    return tuple((i, n, i == same and same_view_shape(out, t)) for i, t in enumerate(tensors)
                 if isinstance(t, _Tensor) and t.device == dev and (n := _nbytes_spanned(t))), span


def same_view_shape(a, b) -> bool:
    """`same_view(a, b)` but for the addresses."""
    return a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


def out_apart(out, tensors, spans) -> bool:
    """Whether `out`'s byte range meets none of the byte ranges of `tensors` (`spans` = `out_spans` of a call
    with the same metadata) but where that tensor is `out` itself as the in-place argument: then
    `check_out_alone` passes. False decides nothing (interleaved views): the caller runs `check_out_alone`."""
    at, span = spans
    if not span:
        return True
    lo = out.data_ptr()
    hi = lo + span
    for i, n, itself in at:
        p = tensors[i].data_ptr()
        if p < hi and lo < p + n and not (itself and p == lo):
            return False
    return True


def alone_spans(args, alone, same: int | None = None) -> tuple:
    """`out_spans` of each tensor at a position of `alone` among `args` (the arguments that must share no memory
    with the others: `out=` first, an argument written whole in place), against the other arguments:
    ((position, spans), ...); `same`: the position of the argument `out=` may be itself."""
    return tuple((w, out_spans(args[w], [None if i == w else t for i, t in enumerate(args)],
                               same if k == 0 else None))
                 for k, w in enumerate(alone) if isinstance(args[w], _Tensor))


def all_apart(args, spans) -> bool:
    """`out_apart` for every tensor of `alone_spans(args, ...)`: False decides nothing (the caller then runs the
    validator's own checks)."""
    for w, sp in spans:
        if not out_apart(args[w], args, sp):
            return False
    return True
