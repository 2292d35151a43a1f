"""Op suite: the gated delta rule ops of harness.ops (gated_delta_rule_varlen / _update, kda_varlen /
_update) of the torch implementation (harness.impls.torch.delta_rule), every dtype, against the float64
reference (reference.delta_rule) on hypothesis-generated batches: several requests with empty / one-token /
odd lengths, pads, has_initial_state mixes, contiguous and page-major (strided) pools, Hv > Hk for GDN,
with/without l2norm, explicit or default scale, weak and strong decays, small chunk sizes so sequences span
many chunks and start mid-chunk of the packed stream.
"""
import contextlib
import random
from unittest import mock

import pytest
import torch
from hypothesis import given, strategies as st

from harness import ops as DC
from harness.testing.checks import assert_bitwise_equal, poison_, tolerance_for
from harness.testing.optest import ALL_DTYPES, check_pad_rows, coarser, interp_small, note_case, tiled_seqlens, tiled_split, other_layout_pool, rand, randn, read_only_inputs, require, token_mask
from reference.testing import cu_seqlens_from, gen
from harness.impls.torch import delta_rule as TD
from harness.testing import LAYOUTS, assert_untouched, choose_slots, make_pool, strict_op
from reference import delta_rule as R

DT_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]
KINDS = ("gdn", "kda")
NAMES = {("gdn", "varlen"): "gated_delta_rule_varlen", ("gdn", "update"): "gated_delta_rule_update",
         ("kda", "varlen"): "kda_varlen", ("kda", "update"): "kda_update"}


def op_of(impl, kind, form, dtype=None):
    """The implementation's op (skipped with the reason where it lacks it or the dtype), checking after
    every call that it wrote no input but the pool and `out=`."""
    name = NAMES[(kind, form)]
    require(impl, name, dtype)
    fn = read_only_inputs(name, impl.op(name))  # every call also checks that the inputs stay unchanged
    return name, fn
REF = {"gdn": (R.gated_delta_rule, R.gated_delta_rule_update), "kda": (R.kda, R.kda_update)}
seeds = st.integers(0, 2**31 - 1)


def _small(device) -> bool:
    """CPU cases stay small (the float64 oracle is a per-token loop); GPU cases are larger."""
    return device.startswith("cpu")


# ----------------------------------------------------------------------------------------------
# the float64 oracle through the contract

def _f64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def oracle_varlen(kind, q, k, v, g, beta, pool, qsl, idx, has_init, *, scale=None, use_qk_l2norm=False,
                  pad_slot_id=-1):
    """(o, pool after) in float64 by the reference recurrence: slots read where live and has_initial_state,
    written where live; every other slot unchanged."""
    ids = idx.tolist()
    hi = has_init.tolist()
    p = _f64(pool).clone()
    init = torch.zeros((len(ids),) + tuple(pool.shape[1:]), dtype=torch.float64)
    for i, (s, h) in enumerate(zip(ids, hi)):
        if s != pad_slot_id and h:
            init[i] = p[s]
    o, fin = REF[kind][0](_f64(q), _f64(k), _f64(v), _f64(g), _f64(beta), scale=scale, use_qk_l2norm=use_qk_l2norm,
                          cu_seqlens=qsl.cpu().long(), initial_states=init)
    for i, s in enumerate(ids):
        if s != pad_slot_id:
            p[s] = fin[i]
    return o, p


def oracle_update(kind, q, k, v, g, beta, pool, idx, *, scale=None, use_qk_l2norm=False, pad_slot_id=-1):
    ids = idx.tolist()
    p = _f64(pool).clone()
    state = torch.stack([p[s] if s != pad_slot_id else torch.zeros(pool.shape[1:], dtype=torch.float64)
                         for s in ids]) if ids else torch.zeros((0,) + tuple(pool.shape[1:]), dtype=torch.float64)
    o, new = REF[kind][1](_f64(q), _f64(k), _f64(v), _f64(g), _f64(beta), state, scale=scale,
                          use_qk_l2norm=use_qk_l2norm)
    for i, s in enumerate(ids):
        if s != pad_slot_id:
            p[s] = new[i]
    return o, p


@contextlib.contextmanager
def chunk_size(kind, cs, impl=None):
    """Run the torch implementation with chunk size `cs` (None: its default; other implementations keep
    their own tiling)."""
    if cs is None or (impl is not None and impl.name != "torch"):
        yield
    else:
        with mock.patch.dict(TD.CHUNK_SIZE, {kind: cs}):
            yield


def run_case(check, kind, op, oracle, args, kw, *, pool_pos, live_slots, y_mask, dtype, seed, shapes, impl):
    """Call `fn` with a NaN-poisoned `out=`: it returns `out`; o on `y_mask` rows and the live slots match
    the float64 oracle; the pads' rows of o are 0 (`check_pad_rows`); every other slot (pads' too) is bitwise
    unchanged. The case (`shapes`, `seed`) is noted with the op call (harness.testing.lastcall)."""
    note_case(shapes=shapes, seed=seed)
    pool = args[pool_pos]
    before = pool.clone()
    out = poison_(torch.empty_like(args[2]))
    o_ref, p_ref = oracle(kind, *args, **kw)
    name, fn = op
    o = fn(*args, out=out, **kw)
    assert o is out, f"{kind}: expected the op to return the `out=` tensor it was given"
    check_pad_rows(name, o, args, kw, "o", "out= was filled with NaN before the call")
    m = y_mask.to(o.device)
    check.close(f"{name}.o", o[m], o_ref.to(o.device)[m], op=name, impl=impl.name, dtype=dtype, shapes=shapes,
                seed=seed)
    live = sorted(set(s for s in live_slots if s >= 0))
    if live:
        pd = coarser(dtype, pool.dtype)
        li = torch.tensor(live, device=pool.device)
        check.close(f"{name}.pool[live]", pool[li], p_ref.to(pool.device)[li], op=name, impl=impl.name, dtype=pd,
                    tol=tolerance_for(pd), shapes=shapes, seed=seed)
    assert_untouched(before, pool, live_slots, name=f"{name} pool")
    return o


# ----------------------------------------------------------------------------------------------
# cases

def dims(data, kind, small):
    Hk = data.draw(st.sampled_from([1, 2]), label="Hk")
    H = Hk * data.draw(st.sampled_from([1, 2, 3]), label="Hv/Hk") if kind == "gdn" else Hk
    if small:
        K = data.draw(st.sampled_from([3, 8, 16]), label="K")
        V = data.draw(st.sampled_from([2, 5, 16]), label="V")
    else:
        K = data.draw(st.sampled_from([3, 64, 128]), label="K")
        V = data.draw(st.sampled_from([5, 64, 128]), label="V")
    return Hk, H, K, V


def activations(kind, g_, rows, Hk, H, K, V, dtype, device, use_qk_l2norm, strong):
    """q, k, v, g, beta for `rows` rows. Without l2norm, q and k ~ N(0, 1/K) keep |k| ~ 1 (a bounded
    recurrence); g = -U(0, 1) (or -U(0, 30): decays that underflow); beta = sigmoid(N(0, 1)); g and beta
    in float32 half the time (as engines keep them)."""
    s = 1.0 if use_qk_l2norm else K ** -0.5
    q = randn(g_, (rows, Hk, K), dtype, device, scale=s)
    k = randn(g_, (rows, Hk, K), dtype, device, scale=s)
    v = randn(g_, (rows, H, V), dtype, device)
    gshape = (rows, H, K) if kind == "kda" else (rows, H)
    g = -rand(g_, gshape, torch.float32, device, 0.0, 30.0 if strong else 1.0)
    beta = torch.sigmoid(randn(g_, (rows, H), torch.float32, device))
    return q, k, v, g, beta


def varlen_case(data, kind, device, dtype, small, *, impl=None, strong=None):
    """A drawn varlen call. Lengths are the usual ones or next to a multiple of the implementation's chunk
    (`tiled_seqlens`: the drawn `chunk_size` for torch, else its declared tiles), up to 70 tokens on CPU
    (the Triton interpreter: the usual lengths only)."""
    Hk, H, K, V = dims(data, kind, small)
    cs = data.draw(st.sampled_from([None, 1, 3, 8, 16]), label="chunk_size")
    torch_cs = cs is not None and impl is not None and impl.name == "torch"
    interp = impl is not None and interp_small(device, impl)
    lengths = data.draw(tiled_seqlens(None if torch_cs else impl, NAMES[(kind, "varlen")],
                                      extra_tiles=(cs,) if torch_cs else (), max_seqs=4 if small else 6,
                                      max_len=20 if small else 300, tile_cap=(20 if interp else 70) if small else None,
                                      max_total=48 if small else None), label="lengths")
    seed = data.draw(seeds, label="seed")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    l2 = data.draw(st.booleans(), label="use_qk_l2norm")
    scale = data.draw(st.sampled_from([None, 0.25]), label="scale")
    strong = data.draw(st.booleans(), label="strong") if strong is None else strong
    gb_dtype = data.draw(st.sampled_from([torch.float32, dtype]), label="g_beta_dtype")
    pool_dtype = data.draw(st.sampled_from([torch.float32, dtype]), label="pool_dtype")
    extra = data.draw(st.integers(0, 2), label="extra_slots")
    rng = random.Random(seed)
    S, T = len(lengths), sum(lengths)
    slots = choose_slots(S, S + extra, rng, pad_prob=0.25)
    g_ = gen(seed)
    q, k, v, g, beta = activations(kind, g_, T, Hk, H, K, V, dtype, device, l2, strong)
    pool = make_pool(S + extra, (H, V, K), pool_dtype, device, layout=layout, seed=seed)
    hi = torch.tensor([rng.random() < 0.6 for _ in range(S)], dtype=torch.bool, device=device)
    args = [q, k, v, g.to(gb_dtype), beta.to(gb_dtype), pool, cu_seqlens_from(lengths, device, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32, device=device), hi]
    kw = dict(scale=scale, use_qk_l2norm=l2)
    shapes = dict(q=q, v=v, g=g, ssm_states=pool, lengths=lengths, layout=layout, chunk_size=cs,
                  has_initial_state=hi.tolist(), slots=slots, strong=strong)
    return args, kw, slots, token_mask(lengths, slots), shapes, seed, layout, cs


# ----------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_varlen_matches_reference(impl, kind, dtype, device, check, data):
    """The varlen op on packed batches matches the float64 reference on live tokens and live slots, with
    `out=` (NaN-poisoned) written and returned, pads' and unnamed slots bitwise unchanged; the same call on
    a pool of the other layout (same slot contents) matches the reference the same way."""
    op = op_of(impl, kind, "varlen", dtype)
    args, kw, slots, mask, shapes, seed, layout, cs = varlen_case(data, kind, device, dtype, _small(device), impl=impl)
    alt = other_layout_pool(args[5], layout, seed=seed)
    for pool in (args[5], alt):
        a = list(args)
        a[5] = pool
        with chunk_size(kind, cs, impl):
            run_case(check, kind, op, oracle_varlen, a, kw, pool_pos=5, live_slots=slots, y_mask=mask,
                     dtype=dtype, seed=seed, shapes=dict(shapes, pool_strides=list(pool.stride())), impl=impl)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_update_matches_reference(impl, kind, dtype, device, check, data):
    """The decode op on a batch of rows (pads among them, some slots not named) matches the float64
    reference step on live rows and slots, writes `out=`, leaves other slots bitwise unchanged."""
    op = op_of(impl, kind, "update", dtype)
    Hk, H, K, V = dims(data, kind, _small(device))
    B = data.draw(st.integers(0, 5), label="batch")
    seed = data.draw(seeds, label="seed")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    l2 = data.draw(st.booleans(), label="use_qk_l2norm")
    scale = data.draw(st.sampled_from([None, 0.25]), label="scale")
    pool_dtype = data.draw(st.sampled_from([torch.float32, dtype]), label="pool_dtype")
    extra = data.draw(st.integers(0, 2), label="extra_slots")
    rng = random.Random(seed)
    slots = choose_slots(B, B + extra, rng, pad_prob=0.3)
    q, k, v, g, beta = activations(kind, gen(seed), B, Hk, H, K, V, dtype, device, l2,
                                   data.draw(st.booleans(), label="strong"))
    pool = make_pool(B + extra, (H, V, K), pool_dtype, device, layout=layout, seed=seed)
    args = [q, k, v, g, beta, pool, torch.tensor(slots, dtype=torch.int64, device=device)]
    mask = torch.tensor([s >= 0 for s in slots], dtype=torch.bool)
    shapes = dict(q=q, v=v, ssm_states=pool, layout=layout, slots=slots)
    run_case(check, kind, op, oracle_update, args, dict(scale=scale, use_qk_l2norm=l2), pool_pos=5,
             live_slots=slots, y_mask=mask, dtype=dtype, seed=seed, shapes=shapes, impl=impl)


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_prefill_then_decode_equals_one_prefill(impl, kind, device, check, data):
    """Chunked prefill of a prefix followed by decode steps through the same pool slot (the engine's path)
    equals the float64 reference of the whole sequence: output of every token and the final state."""
    _, varlen = op_of(impl, kind, "varlen", torch.float32)
    _, update = op_of(impl, kind, "update", torch.float32)
    Hk, H, K, V = dims(data, kind, True)
    cs = data.draw(st.sampled_from([None, 4]), label="chunk_size")
    # the prefill/decode boundary anywhere (up to 20 tokens under the Triton interpreter, else 130), half
    # the time next to a multiple of the prefill's chunk (`tiled_split`)
    torch_cs = cs is not None and impl.name == "torch"
    L0 = data.draw(tiled_split(None if torch_cs else impl, NAMES[(kind, "varlen")],
                               20 if interp_small(device, impl) else 130, extra_tiles=(cs,) if torch_cs else ()),
                   label="prefix")
    n = data.draw(st.integers(1, 4), label="decode_steps")
    seed = data.draw(seeds, label="seed")
    q, k, v, g, beta = activations(kind, gen(seed), L0 + n, Hk, H, K, V, torch.float32, device, True, False)
    pool = make_pool(3, (H, V, K), torch.float32, device, layout="page_major", seed=seed)
    slot = torch.tensor([1], dtype=torch.int32, device=device)
    init = pool[1:2].to("cpu", torch.float64).clone()
    with chunk_size(kind, cs, impl):
        o_pre = varlen(q[:L0], k[:L0], v[:L0], g[:L0], beta[:L0], pool, cu_seqlens_from([L0], device, dtype=torch.int32), slot,
                             torch.tensor([True], device=device), use_qk_l2norm=True)
    os_ = [o_pre]
    for t in range(L0, L0 + n):
        os_.append(update(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool, slot,
                                use_qk_l2norm=True))
    o_ref, s_ref = REF[kind][0](_f64(q), _f64(k), _f64(v), _f64(g), _f64(beta), use_qk_l2norm=True,
                                initial_states=init)
    shapes = dict(prefix=L0, decode_steps=n, chunk_size=cs)
    check.close(f"{kind} o (prefill + decode)", torch.cat(os_), o_ref.to(device), op=kind, impl=impl.name,
                dtype=torch.float32, shapes=shapes, seed=seed)
    check.close(f"{kind} final state", pool[1], s_ref[0].to(device), op=kind, impl=impl.name, dtype=torch.float32,
                shapes=shapes, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_varlen_strong_decay_is_finite(impl, kind, dtype, device, check, data):
    """With decays down to g = -30 per token (pairwise decays underflow to 0 inside a chunk), outputs and
    final states stay finite (masked exponents, no inf * 0) and equal the reference."""
    op = op_of(impl, kind, "varlen", dtype)
    args, kw, slots, mask, shapes, seed, _, cs = varlen_case(data, kind, device, dtype, _small(device), impl=impl, strong=True)
    with chunk_size(kind, cs, impl):
        o = run_case(check, kind, op, oracle_varlen, args, kw, pool_pos=5, live_slots=slots,
                     y_mask=mask, dtype=dtype, seed=seed, shapes=shapes, impl=impl)
    assert bool(torch.isfinite(o[mask.to(o.device)]).all()), f"{kind}: non-finite output under strong decays"
    live = [s for s in slots if s >= 0]
    assert bool(torch.isfinite(args[5][live]).all()), f"{kind}: non-finite final state under strong decays"


def test_float64_inputs_compute_in_float64(impl, device, check):
    """float64 inputs run in float64 end to end: the result equals the float64 reference to 1e-10 even with
    a float64 pool (a float32 step anywhere would leave ~1e-7)."""
    _, fn = op_of(impl, "kda", "varlen", torch.float64)
    g_ = gen(5)
    T, H, K, V = 40, 2, 8, 4
    q, k, v, g, beta = activations("kda", g_, T, H, H, K, V, torch.float64, device, True, False)
    pool = make_pool(2, (H, V, K), torch.float64, device, seed=5)
    args = [q, k, v, g.double(), beta.double(), pool, cu_seqlens_from([T], device, dtype=torch.int32), torch.tensor([1], device=device),
            torch.tensor([True], device=device)]
    o_ref, p_ref = oracle_varlen("kda", *args)
    o = fn(*args)
    assert o.dtype == torch.float64
    check.close("kda_varlen.o (float64)", o, o_ref.to(device), op="kda_varlen", impl=impl.name, dtype=torch.float64)
    check.close("kda_varlen.pool (float64)", pool[1], p_ref[1].to(device), op="kda_varlen", impl=impl.name,
                dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_gdn_half_l2norm_narrow_values(impl, dtype, device, check):
    """The minimal GDN case that once lost the CUDA context on an H200 (Triton 3.6 compiled the output
    launch's one-pass l2 normalisation of whole (C, K) tiles to an out-of-range shared-memory address at
    half inputs, K = 64, five value columns): two requests of 5 and 1 tokens, GQA 2 -> 4 heads, l2norm,
    scale 0.25, decays down to -30, the first request from zeros, the second from its slot."""
    op = op_of(impl, "gdn", "varlen", dtype)
    lengths, Hk, H, K, V = [5, 1], 2, 4, 64, 5
    q, k, v, g, beta = activations("gdn", gen(6588), sum(lengths), Hk, H, K, V, dtype, device, True, True)
    args = [q, k, v, g, beta, make_pool(3, (H, V, K), torch.float32, device, seed=6588),
            cu_seqlens_from(lengths, device, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32, device=device),
            torch.tensor([False, True], device=device)]
    run_case(check, "gdn", op, oracle_varlen, args, dict(scale=0.25, use_qk_l2norm=True),
             pool_pos=5, live_slots=[0, 2], y_mask=token_mask(lengths, [0, 2]), dtype=dtype, seed=6588,
             shapes=dict(lengths=lengths, K=K, V=V), impl=impl)


# ----------------------------------------------------------------------------------------------
# bad input

def _good(kind, device, op):
    T, Hk, H, K, V = 5, 2, 4 if kind == "gdn" else 2, 3, 4
    q, k, v, g, beta = activations(kind, gen(0), T if op == "varlen" else 2, Hk, H, K, V, torch.float32, device,
                                   False, False)
    pool = torch.zeros(3, H, V, K, device=device)
    if op == "varlen":
        return [q, k, v, g, beta, pool, torch.tensor([0, 2, T], dtype=torch.int32, device=device),
                torch.tensor([0, 2], dtype=torch.int32, device=device), torch.tensor([True, False], device=device)]
    return [q, k, v, g, beta, pool, torch.tensor([0, -1], dtype=torch.int32, device=device)]


def _bad_cases(kind, op, device):
    """name -> (position or keyword, bad value, argument named in the error)."""
    T, n, Hk, H, K, V = 5, (5 if op == "varlen" else 2), 2, (4 if kind == "gdn" else 2), 3, 4
    f = lambda *s, dtype=torch.float32: torch.zeros(*s, dtype=dtype, device=device)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)
    cases = {
        "int q": (0, torch.zeros(n, Hk, K, dtype=torch.int32, device=device), "q"),
        "k shape": (1, f(n, Hk, K + 1), "k"),
        "k dtype": (1, f(n, Hk, K, dtype=torch.float16), "k"),
        "v rows": (2, f(n + 1, H, V), "v"),
        "beta shape": (4, f(n, H + 1), "beta"),
        "key-major pool": (5, f(3, H, K, V), "ssm_states"),
        "pool 3-d": (5, f(3, H, V * K), "ssm_states"),
        "scale 0": ("scale", 0.0, "scale"),
        "use_qk_l2norm int": ("use_qk_l2norm", 1, "use_qk_l2norm"),
        "out shape": ("out", f(n, H, V + 1), "out"),
        "out dtype": ("out", f(n, H, V, dtype=torch.float64), "out"),
    }
    if kind == "gdn":
        cases["per-channel g"] = (3, f(n, H, K), "g")
        cases["key heads do not divide"] = (2, f(n, 3, V), "k")
    else:
        cases["per-head g"] = (3, f(n, H), "g")
        cases["value heads differ"] = (2, f(n, 3, V), "v")
    if op == "varlen":
        cases["query_start_loc end"] = (6, i32(0, 2, T - 1), "query_start_loc")
        cases["cache_indices out of pool"] = (7, i32(0, 3), "cache_indices")
        cases["cache_indices repeated"] = (7, i32(1, 1), "cache_indices")
        cases["has_initial_state int"] = (8, i32(1, 0), "has_initial_state")
    else:
        cases["state_indices out of pool"] = (6, i32(5, 0), "state_indices")
        cases["state_indices count"] = (6, i32(0), "state_indices")
    return cases


@pytest.mark.parametrize("op", ["varlen", "update"])
@pytest.mark.parametrize("kind", KINDS)
def test_rejects_bad_input_before_writing(impl, kind, op, device):
    """Bad input raises ValueError naming the argument ("arg: expected ..., got ...") and leaves the pool
    and `out=` untouched; the unmodified base case is accepted (or declined with NotImplementedError)."""
    name, _ = op_of(impl, kind, op)
    fn = strict_op(impl, name)
    good = _good(kind, device, op)
    try:
        fn(*good)
    except NotImplementedError:
        pass  # a peer that takes no fp32 activations declines the base case; bad input must still be rejected
    for name, (where, bad, arg) in _bad_cases(kind, op, device).items():
        a = list(_good(kind, device, op))
        kw = {}
        if isinstance(where, int):
            a[where] = bad
        else:
            kw[where] = bad
        pool = a[5]
        pool.normal_()
        before = pool.clone()
        with pytest.raises(ValueError, match=rf"^{arg}: expected .+, got .+"):
            fn(*a, **kw)
        assert_bitwise_equal(f"pool after a rejected call ({name})", pool, before)


def test_validators_are_the_contracts():
    """The four validators exist under the contract's names and return the sizes the ops use."""
    q = torch.zeros(6, 2, 3)
    v = torch.zeros(6, 4, 5)
    pool = torch.zeros(2, 4, 5, 3)
    qsl = torch.tensor([0, 6], dtype=torch.int32)
    assert DC.validate_gated_delta_rule_varlen(q, q, v, torch.zeros(6, 4), torch.zeros(6, 4), pool, qsl,
                                               torch.tensor([1]), torch.tensor([True])) == (6, 2, 4, 3, 5, 1)
    assert DC.validate_gated_delta_rule_update(q, q, v, torch.zeros(6, 4), torch.zeros(6, 4), torch.zeros(7, 4, 5, 3),
                                               torch.arange(6)) == (6, 2, 4, 3, 5)
    kq = torch.zeros(6, 4, 3)
    assert DC.validate_kda_varlen(kq, kq, v, torch.zeros(6, 4, 3), torch.zeros(6, 4), pool, qsl, torch.tensor([0]),
                                  torch.tensor([False])) == (6, 4, 4, 3, 5, 1)
    assert DC.validate_kda_update(kq, kq, v, torch.zeros(6, 4, 3), torch.zeros(6, 4), torch.zeros(6, 4, 5, 3),
                                  torch.arange(6)) == (6, 4, 4, 3, 5)
    assert {"gated_delta_rule_varlen", "gated_delta_rule_update", "kda_varlen", "kda_update"} <= set(DC.OP_NAMES)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_varlen_request_isolation(impl, kind, value, device, check):
    """A non-finite value in one request's tokens never reaches another request's output or final state:
    the chunk grid pads with selected zeros, never with another request's values times a zero mask.
    (Three requests of 3, 5 and 4 tokens, chunks of 8; the first is poisoned: padding positions of a
    gathered grid point at token 0, which is its.)"""
    from harness.testing.optest import poisoned, run_isolation_case
    name, _ = op_of(impl, kind, "varlen", torch.float32)
    lengths, Hk, H, K, V = [3, 5, 4], 1, 2 if kind == "gdn" else 1, 4, 3
    T = sum(lengths)
    q, k, v, g, beta = activations(kind, gen(7), T, Hk, H, K, V, torch.float32, device, True, False)
    rows = range(0, 3)
    keep = torch.tensor([t >= 3 for t in range(T)])

    def case(poison):
        p = (lambda t: poisoned(t, rows, value)) if poison else (lambda t: t.clone())
        return [p(q), p(k), p(v), p(g), p(beta), make_pool(4, (H, V, K), torch.float32, device, seed=7),
                cu_seqlens_from(lengths, device, dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.int32, device=device),
                torch.tensor([True, True, False], device=device)]
    with chunk_size(kind, 8, impl):
        run_isolation_case(check, impl, name, case(False), case(True), dict(use_qk_l2norm=True), pool_pos=5,
                           keep_rows=keep, keep_slots=[2, 3], untouched_slots=[0], dtype=torch.float32,
                           what=f"{value} in the first request's tokens")
