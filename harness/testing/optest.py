"""Shared helpers for the op-level suites (suites/ops/): case strategies, input builders, and one
generic check for ops that update a state pool.

Generic pieces (usable for any op of `harness.ops`):
* `require(impl, op, dtype, device)`: skip (with the reason) when the impl lacks the op or dtype.
* `interp_small(device, impl)`: True when the case must stay tiny (Triton interpreter on CPU).
* `contract_variants(sp)`, `spec_cases()`: every op's contract shapes (with and without the optional inputs)
  and first `cpu` benchmark shape, for the suites that run every op of every implementation.
* `randn(g, shape, dtype, device, scale)`, `rand(...)`: seeded inputs (drawn in fp32 on CPU, cast); the
  generator (`gen(seed)`), request lengths (`seqlens(..., edge_lengths=True)`: empty, one-token, odd and long
  requests) and offsets (`cu_seqlens_from(lengths, device, torch.int32)`) are reference.testing's.
* `coarser(*dtypes)`: the dtype with the loosest tolerance policy (for pools kept in another dtype).
* `run_pool_case(check, impl, op, args, kwargs, pool_pos=..., live_slots=..., y_mask=..., ...)`:
  poisons `out=` with NaN, snapshots the pool, calls `impl.op(op)(*args, out=..., **kwargs)`, then
  (1) the op returned `out`; (2) y on the rows of `y_mask` matches the float64 `oracle`; (3) the rows pad
  requests own are exactly 0 (`harness.testing.pad_rows`: the NaN poured into `out=` must be overwritten,
  "pad rows of y must be zero: row i has nan" otherwise); (4) every live slot matches the oracle's pool;
  (5) every other slot (pads' too) is bitwise unchanged. Returns (y, pool_after) for further checks (e.g.
  layout agreement).
* `check_pad_rows(op, y, args, kwargs)`: (3) alone, for suites that call an op their own way.
* `snapshot_inputs(op, args, kwargs, skip=...)` / `assert_inputs_unchanged(snapshot)`: copies of every tensor
  argument but the pool and `out=`, and the check that the op left each bit for bit unchanged (the op
  contract: an op writes only its pool and `out=`); `run_pool_case` and `run_isolation_case` apply it
  after every call; `read_only_inputs(op, fn)` wraps an op so that every call applies it (for suites that
  call ops directly).
* `note_case(**fields)`, `describe_call(op, fn, args, kwargs)`, `note_call(desc)`, `last_call()`
  (harness.testing.lastcall): the last op call of the process, noted before the op runs, with the case
  the suite noted (drawn `shapes`, `seed`): what the plugin reports when a kernel fault loses the CUDA
  context. `read_only_inputs` and `run_pool_case` note every call they make.
* `pool_like(pool, layout, seed)` / `other_layout_pool(pool, layout)`: the same slot contents in
  another pool layout (contiguous / page_major / channels_last strided view), for
  `run_pool_case(alt_pools=...)`.
* `impl_tiles(impl, op, extra)`, `tile_lengths(tiles, cap, depth)`, `tiled_seqlens(impl, op, ...)`,
  `tiled_split(impl, op, length, ...)`: request lengths and split points drawn on both sides of every
  multiple of the implementation's internal token tiles (`Impl.tiles`: chunk sizes, block lengths it carries
  state across), mixed with the usual lengths; deeper (more multiples) in the nightly profile.
* `poisoned(t, rows, value)`: a copy of `t` with the given rows set to a non-finite `value`;
  `run_isolation_case(check, impl, op, clean, poisoned, kwargs, ...)`: runs the op on a clean and on a
  poisoned copy of the same batch and checks that the requests the poison must not reach are unchanged
  (outputs and final states close to the clean run's, unnamed slots bitwise unchanged).
"""
from __future__ import annotations

import pytest
import torch

from harness.testing.checks import POLICY, assert_bitwise_equal, poison_, tolerance_for
from harness.impls.reference_impl import oracle
from harness.testing import assert_pad_rows_zero, make_pool, pad_rows
from harness.testing.lastcall import arg_names as _arg_names, describe_call, note_call, note_case
from harness.testing.lastcall import last_call  # noqa: F401 - for the suites, with note_case

HALF = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def require(impl, op: str, dtype: torch.dtype | None = None, device: str | None = None) -> None:
    if op not in impl.ops:
        pytest.skip(f"implementation {impl.name!r} does not provide {op}")
    if dtype is not None and dtype not in impl.dtypes:
        pytest.skip(f"implementation {impl.name!r} does not support {dtype} here (dtypes {list(impl.dtypes)})")
    if device is not None:
        why = impl.why_unavailable(device)
        if why:
            pytest.skip(why)


def contract_variants(sp):
    """(tag, shape) for each contract shape of op spec `sp` as declared and, where the declared one leaves the
    optional inputs out (dt_bias, D, z, bias, the activation, dt softplus), with every one present."""
    for i, sh in enumerate(sp.shapes["contract"]):
        variants = [sh] if sh.get("optional", True) else [sh, {**sh, "optional": True}]
        for v in variants:
            yield f"{sh.get('layout', i)}" + ("" if v.get("optional", True) is False else "-full"), v


def spec_cases() -> dict:
    """case id -> (spec, shape, where) for every op of harness.ops.SPECS: each contract shape as declared and
    with every optional input present (`contract_variants`), and the spec's first `cpu` benchmark shape
    (where = "contract" / "cpu")."""
    from harness.ops import SPECS
    cases = {}
    for name, sp in SPECS.items():
        for tag, v in contract_variants(sp):
            cases[f"{name}/contract-{tag}"] = (sp, v, "contract")
        cases[f"{name}/cpu-0"] = (sp, sp.shapes["cpu"][0], "cpu")
    return cases


def interp_small(device: str, impl) -> bool:
    """Cases run through the Triton interpreter (slow: ms per program per loop step) must be tiny."""
    return device.startswith("cpu") and impl.name == "triton"


def _outcome(fn) -> tuple:
    try:
        return ("returned", fn())
    except Exception as e:  # noqa: BLE001 - compared, not swallowed
        return ("raised", type(e), str(e))


def validator_paths(sp, pos, opt) -> tuple:
    """What op spec `sp`'s validator (its fast path first) and its rule-by-rule checks answer for the call
    (`pos`, `opt`): each ("returned", value) or ("raised", exception type, message). They must agree."""
    return _outcome(lambda: sp.validate(*pos, **opt)), _outcome(lambda: sp.checks(*pos, **opt))


def randn(g, shape, dtype, device, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float32) * scale + shift).to(device, dtype)


def rand(g, shape, dtype, device, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    return (torch.rand(tuple(shape), generator=g, dtype=torch.float32) * (hi - lo) + lo).to(device, dtype)


def token_mask(lengths, slots, pad_slot_id=-1) -> torch.Tensor:
    m = []
    for n, s in zip(lengths, slots):
        m += [s != pad_slot_id] * int(n)
    return torch.tensor(m, dtype=torch.bool)


def coarser(*dtypes) -> torch.dtype:
    return max((d for d in dtypes if d is not None), key=lambda d: POLICY[d].ratio)


def pool_like(pool: torch.Tensor, layout: str, seed: int = 0) -> torch.Tensor:
    """A pool with the same slot contents as `pool`, in `layout`."""
    p = make_pool(pool.shape[0], tuple(pool.shape[1:]), pool.dtype, pool.device, layout=layout, seed=seed)
    p.copy_(pool)
    return p


def snapshot_inputs(op: str, args, kwargs: dict, skip=()) -> list:
    """(name, tensor, copy) for every tensor argument of a call of `op` (positional, named by the op's
    spec, and keyword) except `out` and the names or positions in `skip` (the pool): what
    `assert_inputs_unchanged` compares after the call."""
    snap = []
    for i, (name, a) in enumerate(zip(_arg_names(op, len(args)), args)):
        if isinstance(a, torch.Tensor) and i not in skip and name not in skip:
            snap.append((name, a, a.detach().clone()))
    for name, a in kwargs.items():
        if isinstance(a, torch.Tensor) and name != "out" and name not in skip:
            snap.append((name, a, a.detach().clone()))
    return snap


def assert_inputs_unchanged(op: str, snap: list, context: str = "") -> None:
    """Every input of `snap` (see `snapshot_inputs`) is bit-for-bit what it was before the call: an op
    writes only its pool and `out=` (harness.ops, "Inputs are read-only")."""
    for name, t, before in snap:
        assert_bitwise_equal(f"{op}: input `{name}` was written by the op (an op writes only its pool and out=)",
                             t, before, context)


def read_only_inputs(op: str, fn):
    """`fn` (an implementation of `op`) checking after every call that it left every tensor argument but
    the pool and `out=` bitwise unchanged (not for inputs of gigabytes: each call copies its inputs). Each
    call is noted as the process's last op call before `fn` runs (`note_call`)."""
    import functools
    from harness.ops import SPECS
    pool = SPECS[op].pool if op in SPECS else None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        snap = snapshot_inputs(op, args, kwargs, skip=(pool,) if pool else ())
        note_call(describe_call(op, fn, args, kwargs))
        y = fn(*args, **kwargs)
        assert_inputs_unchanged(op, snap)
        return y
    return call


def check_pad_rows(op: str, y: torch.Tensor, args, kwargs: dict, name: str = "y", context: str = "") -> None:
    """The output rows of the pad requests of the call `op(*args, **kwargs)` that returned `y` are exactly 0
    (the op contract; see `harness.testing.pad_rows`). Call it on the arguments as they were passed."""
    assert_pad_rows_zero(op, y, pad_rows(op, args, kwargs), name, context)


def run_pool_case(check, impl, op: str, args: list, kwargs: dict, *, pool_pos: int | None, live_slots,
                  y_mask: torch.Tensor | None, dtype: torch.dtype, pool_dtype: torch.dtype | None = None,
                  seed=None, shapes=None, scale: float = 1.0, out_like: torch.Tensor | None = None,
                  alt_pools: tuple = ()):
    """Call `impl`'s `op` with a NaN-poisoned `out=` and check y, live slots and untouched slots.

    `scale` widens the dtype's tolerance (`tolerance_for(dtype, scale)`); callers justify it.
    `alt_pools`: pools with the same initial slot contents in other layouts (see `pool_like`); the op
    is run again on each and checked the same way against the same oracle. (Not bitwise against the
    first run: compiled kernels may specialise on strides and change the summation order.)
    """
    res = _run_pool_case(check, impl, op, args, kwargs, pool_pos=pool_pos, live_slots=live_slots, y_mask=y_mask,
                         dtype=dtype, pool_dtype=pool_dtype, seed=seed, shapes=shapes, scale=scale,
                         out_like=out_like)
    for alt in alt_pools:
        a2 = list(args)
        a2[pool_pos] = alt
        sh = dict(shapes or {}, alt_pool_strides=list(alt.stride()))
        _run_pool_case(check, impl, op, a2, kwargs, pool_pos=pool_pos, live_slots=live_slots, y_mask=y_mask,
                       dtype=dtype, pool_dtype=pool_dtype, seed=seed, shapes=sh, scale=scale, out_like=out_like,
                       tag="[other pool layout]")
    return res


def _run_pool_case(check, impl, op, args, kwargs, *, pool_pos, live_slots, y_mask, dtype, pool_dtype, seed,
                   shapes, scale, out_like, tag=""):
    args = list(args)
    like = out_like if out_like is not None else args[0 if pool_pos != 0 else 1]
    out = poison_(torch.empty_like(like))
    pool = args[pool_pos] if pool_pos is not None else None
    before = pool.clone() if pool is not None else None
    y_ref, pool_ref = oracle(op, *args, **kwargs)
    inputs = snapshot_inputs(op, args, kwargs, skip=(pool_pos,))
    pads = pad_rows(op, args, kwargs)
    fn = impl.op(op)
    note_case(shapes=shapes, seed=seed)
    note_call(describe_call(op, fn, args, dict(kwargs, out=out)))
    y = fn(*args, out=out, **kwargs)
    assert_inputs_unchanged(op, inputs, tag)
    assert y is out, f"{op}: expected the op to return the `out=` tensor it was given, got another tensor"
    assert_pad_rows_zero(op, y, pads, f"y{tag}", "out= was filled with NaN before the call")
    tol = tolerance_for(dtype, scale)
    m = y_mask if y_mask is not None else torch.ones(y.shape[0], dtype=torch.bool)
    m = m.to(y.device)
    check.close(f"{op}.y{tag}", y[m], y_ref.to(y.device)[m], op=op, impl=impl.name, dtype=dtype, tol=tol,
                shapes=shapes, seed=seed)
    if pool is not None:
        live = sorted(set(int(s) for s in live_slots if s >= 0))
        pd = coarser(dtype, pool_dtype or pool.dtype)
        if live:
            li = torch.tensor(live, device=pool.device)
            check.close(f"{op}.pool[live]{tag}", pool[li], pool_ref.to(pool.device)[li], op=op, impl=impl.name,
                        dtype=pd, tol=tolerance_for(pd, scale), shapes=shapes, seed=seed)
        for s in range(pool.shape[0]):
            if s not in live:
                assert_bitwise_equal(f"{op}: pool[{s}] (slot not named by the batch, or a pad's)", pool[s], before[s])
    return y, pool


def other_layout_pool(pool: torch.Tensor, layout: str, seed: int = 0, layouts=None) -> torch.Tensor:
    """A copy of `pool`'s contents in the layout after `layout` in `layouts` (default harness.testing.LAYOUTS;
    CONV_LAYOUTS for conv states), cyclically: drawing `layout` from `layouts` covers every pair of
    neighbouring layouts."""
    from harness.testing import LAYOUTS
    layouts = tuple(layouts or LAYOUTS)
    nxt = layouts[(layouts.index(layout) + 1) % len(layouts)] if layout in layouts else layouts[0]
    return pool_like(pool, nxt, seed=seed + 1)


def profile() -> str:
    from harness.testing import plugin
    return plugin._STATE.get("profile", "ci")


def require_nightly_gpu(device: str) -> None:
    """Large-offset cases: GPU only (gigabytes of memory), nightly profile only (seconds each)."""
    if device.startswith("cpu"):
        pytest.skip("needs a GPU: the case allocates > 2^31 elements (several GB)")
    if profile() != "nightly":
        pytest.skip("nightly-profile case (run with --profile nightly)")


# Multiples k * tile (k = 1..depth) around which lengths and split points are drawn, per profile.
TILE_DEPTH = {"ci": 2, "dev": 3, "nightly": 4}
# The longest tile length drawn when the suite names no cap (GPU suites; a CPU suite passes its own), unless
# a tile is longer: then one past it.
TILE_CAP = {"ci": 520, "dev": 520, "nightly": 4200}


def impl_tiles(impl, op: str, extra=()) -> tuple[int, ...]:
    """The token tiles `impl` declares for `op` (`Impl.tiles`) and the `extra` ones (a tile the caller
    passes as an argument, e.g. ssd_varlen's `chunk_size`), sorted, without None or duplicates."""
    t = set(getattr(impl, "tiles", {}).get(op, ())) | {int(e) for e in extra if e}
    return tuple(sorted(t))


def tile_lengths(tiles, cap: int, depth: int | None = None) -> list[int]:
    """k*t - 1, k*t, k*t + 1 for every tile t and k = 1..depth (default: the profile's TILE_DEPTH), the ones
    in [1, cap], sorted: a length or split that ends just before, at and just after a tile boundary."""
    depth = TILE_DEPTH.get(profile(), 2) if depth is None else depth
    vals = {k * t + d for t in tiles for k in range(1, depth + 1) for d in (-1, 0, 1)}
    return sorted(v for v in vals if 1 <= v <= cap)


def tiled_seqlens(impl, op: str, *, max_len: int, tile_cap: int | None = None, extra_tiles=(), min_seqs: int = 1,
                  max_seqs: int = 4, max_total: int | None = None, depth: int | None = None):
    """Strategy: request lengths as `reference.testing.seqlens(edge_lengths=True, ...)` draws them (empty,
    one-token, odd, up to `max_len`), plus, a third of the time each, a length next to a multiple of one of
    `impl`'s tiles for `op` (`tile_lengths(impl_tiles(impl, op, extra_tiles), tile_cap)`: tile lengths may
    exceed max_len; `tile_cap` defaults to the profile's TILE_CAP, raised to one past the longest tile --
    CPU suites pass a small one, the Triton interpreter's smaller still).
    `max_total` bounds the sum (a tile length alone may exceed it: the bound is raised to the longest tile
    length, so such a request is drawn alone or with short ones)."""
    from hypothesis import strategies as st
    from reference.testing import seqlens
    tiles = impl_tiles(impl, op, extra_tiles)
    # without a cap every declared tile is crossed at least once (mamba_ssm's 2048-token chunks included)
    cap = max([TILE_CAP.get(profile(), 520)] + [t + 1 for t in tiles]) if tile_cap is None else tile_cap
    near = tile_lengths(tiles, cap, depth)
    if not near:
        return seqlens(edge_lengths=True, min_seqs=min_seqs, max_seqs=max_seqs, max_len=max_len, max_total=max_total)
    usual = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7]), st.integers(0, max_len))
    length = st.one_of(usual, usual, st.sampled_from(near))
    s = st.lists(length, min_size=min_seqs, max_size=max_seqs)
    if max_total is not None:
        bound = max(max_total, max(near))
        s = s.filter(lambda ls: sum(ls) <= bound)
    return s


def tiled_split(impl, op: str, length: int, extra_tiles=(), depth: int | None = None):
    """Strategy: a split point in [0, length] (a chunked-prefill boundary), half the time next to a multiple
    of one of `impl`'s tiles for `op` (see `tile_lengths`), else anywhere."""
    from hypothesis import strategies as st
    near = tile_lengths(impl_tiles(impl, op, extra_tiles), length, depth)
    anywhere = st.integers(0, max(0, length))
    return st.one_of(anywhere, st.sampled_from(near)) if near else anywhere


NONFINITE = (float("nan"), float("inf"), float("-inf"))


def poisoned(t: torch.Tensor | None, rows, value: float) -> torch.Tensor | None:
    """A copy of `t` whose rows (first-dim indices) `rows` hold `value`; None stays None."""
    if t is None:
        return None
    out = t.clone()
    rows = list(rows)
    if rows:
        out[torch.tensor(rows, dtype=torch.long, device=t.device)] = value
    return out


def run_isolation_case(check, impl, op: str, clean: list, poison: list, kwargs: dict, *, pool_pos: int,
                       keep_rows: torch.Tensor, keep_slots, untouched_slots=(), dtype: torch.dtype, seed=None,
                       shapes=None, what: str = ""):
    """Run `op` on the argument lists `clean` and `poison` (the same batch, `poison` with non-finite values
    planted where they must not spread; each list holds its own pool, at `pool_pos`) and check that the
    poisoned run's output rows `keep_rows` (bool mask) and slots `keep_slots` equal the clean run's (close
    under the dtype's policy: a NaN or inf where the clean run is finite fails), that its slots
    `untouched_slots` (not named by the batch, or pads') stay bitwise unchanged, and that both runs' pad rows
    are exactly 0 (even where the poison sits in a pad request's own tokens). `what` describes the
    poison in failure messages. Returns (y_clean, y_poisoned)."""
    pool_p = poison[pool_pos]
    before = pool_p.clone()
    snaps = [snapshot_inputs(op, a, kwargs, skip=(pool_pos,)) for a in (clean, poison)]
    pads = pad_rows(op, clean, kwargs)
    y_c = impl.op(op)(*clean, **kwargs)
    y_p = impl.op(op)(*poison, **kwargs)
    for snap, which in zip(snaps, ("clean run", "poisoned run")):
        assert_inputs_unchanged(op, snap, which)
    assert_pad_rows_zero(op, y_c, pads, "y (clean run)")
    assert_pad_rows_zero(op, y_p, pads, "y (poisoned run)", f"poison: {what}" if what else "")
    m = keep_rows.to(y_c.device)
    tol = tolerance_for(dtype)
    ctx = f"poison: {what}" if what else ""
    check.close(f"{op}.y of the other requests", y_p[m], y_c[m], op=op, impl=impl.name, dtype=dtype, tol=tol,
                shapes=shapes, seed=seed, context=ctx)
    keep = sorted(set(int(s) for s in keep_slots if s >= 0))
    if keep:
        k = torch.tensor(keep, device=pool_p.device)
        pd = coarser(dtype, pool_p.dtype)
        check.close(f"{op}.pool[slots {keep} of the other requests]", pool_p[k], clean[pool_pos][k], op=op,
                    impl=impl.name, dtype=pd, tol=tolerance_for(pd), shapes=shapes, seed=seed, context=ctx)
    for s in untouched_slots:
        assert_bitwise_equal(f"{op}: pool[{s}] (not named by the batch, or a pad's; {ctx})", pool_p[s], before[s])
    return y_c, y_p
