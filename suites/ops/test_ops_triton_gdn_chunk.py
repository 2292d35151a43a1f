"""Kernel suite: the Triton chunked prefill of `gated_delta_rule_varlen` (harness/impls/triton/delta_rule_chunk.py)
at its own edges, against the float64 oracle through the op contract: sequences that start mid-chunk of the
packed stream, a last chunk that is not full, many chunks, chunk sizes 16 / 32 / 64, the diagonal-block size
of the (I + A)^-1 substitution, Hv > Hk, empty and one-token sequences among pads, a growing state (g > 0),
decays that underflow, and padding past a short last chunk that must stay inert (the next request's
non-finite values reach neither the earlier request's outputs nor its state); both pipelines, and both forms
of the state update's keys (CONFIG["update_keys"]: stored decayed keys, or decays on the rows of v' with k read
through its strides).

Runs where the `triton` implementation does (CPU through the interpreter: fp32 / fp64, tiny shapes).
"""
import re
from unittest import mock

import pytest
import torch

from harness.testing.checks import assert_bitwise_equal
from harness.testing.optest import other_layout_pool, rand, randn, require, run_pool_case
from reference.testing import cu_seqlens_from, gen
from harness.testing import make_pool

OP = "gated_delta_rule_varlen"
# fp32 and fp64 with the in-op l2 normalisation, fp32 without it
L2NORM_CASES = pytest.mark.parametrize("dtype,l2norm", [(torch.float32, True), (torch.float64, True),
                                                       (torch.float32, False)],
                                       ids=["float32", "float64", "float32-no-l2norm"])
PAD = -1


def _kernel(impl, dtype):
    """The kernel module (skipped unless the implementation under test is `triton`)."""
    if impl.name != "triton":
        pytest.skip(f"kernel-specific cases of the triton implementation (this run tests {impl.name!r})")
    require(impl, OP, dtype)
    from harness.impls.triton import delta_rule_chunk
    return delta_rule_chunk


def _case(lengths, device, dtype, *, Hk=1, Hv=2, K=8, V=5, slots=None, init=None, g_range=(-1.0, 0.0),
          l2norm=True, seed=0, layout="contiguous"):
    """Positional args of the op and the live slots. slots: per request (-1 a pad), default 1..S; init:
    has_initial_state per request, default alternating from True. q, k ~ N(0, 1/K) (|k| ~ 1 without l2norm),
    g ~ U(g_range), beta ~ sigmoid(N(0, 1)); g and beta float32."""
    g_ = gen(seed)
    S, T = len(lengths), sum(lengths)
    s = 1.0 if l2norm else K ** -0.5
    q, k = randn(g_, (T, Hk, K), dtype, device, scale=s), randn(g_, (T, Hk, K), dtype, device, scale=s)
    v = randn(g_, (T, Hv, V), dtype, device)
    g = rand(g_, (T, Hv), torch.float32, device, *g_range)
    beta = torch.sigmoid(randn(g_, (T, Hv), torch.float32, device))
    slots = list(range(1, S + 1)) if slots is None else list(slots)
    init = [i % 2 == 0 for i in range(S)] if init is None else list(init)
    pool = make_pool(max(slots + [0]) + 2, (Hv, V, K), torch.float64 if dtype == torch.float64 else torch.float32,
                     device, layout=layout, seed=seed)
    args = [q, k, v, g, beta, pool, cu_seqlens_from(lengths, device, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32, device=device), torch.tensor(init, dtype=torch.bool, device=device)]
    return args, slots


def _check(check, impl, args, slots, dtype, *, l2norm=True, layout=None, **shapes):
    """Outputs of every token (pads' included: the zero-state recurrence) and the live slots against the
    float64 oracle; every other slot bitwise unchanged. `layout`: the pool's layout, to run again on a
    copy in the other one."""
    alt = (other_layout_pool(args[5], layout),) if layout else ()
    return run_pool_case(check, impl, OP, args, dict(use_qk_l2norm=l2norm), pool_pos=5, live_slots=slots, y_mask=None,
                         dtype=dtype, seed=0, shapes=shapes, out_like=args[2], alt_pools=alt)


def _rerun_agrees(impl, M, cfg, args, y, pool, l2norm, what, exact_states=False):
    """The op on `args` (a clone of the inputs that gave `y` and the final `pool`) under CONFIG overrides `cfg`:
    outputs and final states equal to rounding (1e-12 in float64, 1e-5 else), the states bit for bit with
    `exact_states`. Returns the rerun's outputs."""
    with mock.patch.dict(M.CONFIG, cfg):
        y2 = impl.op(OP)(*args, use_qk_l2norm=l2norm)
    tol = 1e-12 if y.dtype == torch.float64 else 1e-5
    assert torch.allclose(y, y2, rtol=tol, atol=tol), f"outputs, {what}: {(y - y2).abs().max()}"
    if exact_states:
        assert torch.equal(pool, args[5]), f"final states, {what}: not bit for bit"
    else:
        assert torch.allclose(pool, args[5], rtol=tol, atol=tol), \
            f"final states, {what}: {(pool - args[5]).abs().max()}"
    return y2


DTYPES = [torch.float32, torch.float64]
DT_IDS = ["float32", "float64"]

# (id, lengths, slots, has_initial_state, heads (Hk, Hv)): each chunk size runs each
BOUNDARY_CASES = [
    ("mid-chunk starts", lambda C: (5, C + 2, 3, 11), None, None, (1, 2)),
    ("short last chunk", lambda C: (C + 3,), None, (True,), (1, 2)),
    ("one short of a chunk", lambda C: (C - 1, 2), None, (False, True), (1, 2)),
    ("empty and one-token among pads", lambda C: (0, 1, 0, 7, 4), (1, PAD, 3, 2, PAD), (True, True, False, False,
                                                                                         True), (1, 2)),
    ("Hv > Hk", lambda C: (9, C - 5), None, None, (2, 6)),
]


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("case", BOUNDARY_CASES, ids=[c[0] for c in BOUNDARY_CASES])
def test_chunk_boundaries(impl, device, check, chunk, case):
    """Per-sequence chunking at chunk sizes 16 / 32 / 64: requests starting anywhere in the packed stream,
    last chunks that are not full, empty / one-token requests and pads, value heads sharing key heads."""
    M = _kernel(impl, torch.float32)
    _, lengths, slots, init, (Hk, Hv) = case
    args, live = _case(lengths(chunk), device, torch.float32, Hk=Hk, Hv=Hv, slots=slots, init=init, seed=chunk)
    with mock.patch.dict(M.CONFIG, {"chunk": chunk, "sub": 16}):
        _check(check, impl, args, live, torch.float32, chunk=chunk, lengths=lengths(chunk))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_many_chunks(impl, device, check, dtype):
    """A request spanning six chunks (the state carried chunk to chunk) after a short one, in a page-major
    pool and again in a contiguous one."""
    M = _kernel(impl, dtype)
    args, live = _case((3, 16 * 5 + 7), device, dtype, Hk=1, Hv=2, init=(True, True), seed=3, layout="page_major")
    with mock.patch.dict(M.CONFIG, {"chunk": 16}):
        _check(check, impl, args, live, dtype, layout="page_major")


@pytest.mark.parametrize("sub", [16, 32, 64])
def test_inverse_block_sizes(impl, device, check, sub):
    """(I + A)^-1 with diagonal blocks of 16 / 32 / 64 tokens (blockwise merge or one substitution) inside
    chunks of 64: a full chunk and a short one."""
    M = _kernel(impl, torch.float32)
    args, live = _case((70, 6), device, torch.float32, K=16, V=16, seed=sub, l2norm=False)
    with mock.patch.dict(M.CONFIG, {"chunk": 64, "sub": sub}):
        _check(check, impl, args, live, torch.float32, l2norm=False, sub=sub)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_growing_state(impl, device, check, dtype):
    """g > 0 (the contract admits it: the state grows by up to e^0.25 a token) across chunk boundaries;
    exponents exp(G_i - G_j), i >= j, are then >= 1 and must not be clamped."""
    M = _kernel(impl, dtype)
    args, live = _case((21, 13), device, dtype, g_range=(0.0, 0.25), init=(True, True), seed=11)
    with mock.patch.dict(M.CONFIG, {"chunk": 16}):
        _check(check, impl, args, live, dtype, g="U(0, 0.25)")


def test_strong_decay_underflows_to_zero(impl, device, check):
    """g down to -30 a token: pairwise decays of a chunk underflow to exact zeros (masked exponents, never
    inf * 0); outputs and states finite and equal to the oracle."""
    M = _kernel(impl, torch.float32)
    args, live = _case((19, 7), device, torch.float32, g_range=(-30.0, -5.0), seed=5)
    with mock.patch.dict(M.CONFIG, {"chunk": 16}):
        y, pool = _check(check, impl, args, live, torch.float32, g="U(-30, -5)")
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(pool).all())


@pytest.mark.parametrize("update_keys", ["stored", "rows"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30], ids=["nan", "inf", "huge"])
def test_padding_past_a_short_last_chunk_is_inert(impl, device, value, update_keys):
    """A request of 13 tokens (chunk 16) followed by one whose q, k, v, g and beta hold `value`: the tile
    positions past the first request's end (the second's tokens) change neither its outputs nor its final
    state, bit for bit, with either CONFIG["update_keys"]."""
    M = _kernel(impl, torch.float32)
    clean, _ = _case((13, 8), device, torch.float32, init=(True, False), seed=2)
    dirty = [a.clone() for a in clean]
    for i in range(5):
        dirty[i][13:] = value
    with mock.patch.dict(M.CONFIG, {"chunk": 16, "update_keys": update_keys}):
        yc = impl.op(OP)(*clean, use_qk_l2norm=True)
        yd = impl.op(OP)(*dirty, use_qk_l2norm=True)
    assert_bitwise_equal("outputs of the first request", yd[:13], yc[:13])
    assert_bitwise_equal("final state of the first request (slot 1)", dirty[5][1], clean[5][1])
    assert bool(torch.isfinite(yc).all())


@pytest.mark.parametrize("outputs", ["scan", "parallel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_output_pipelines(impl, device, check, dtype, outputs):
    """Both pipelines of CONFIG["outputs"] (outputs inside the sequential scan, or from the per-chunk states
    in a parallel launch) against the oracle: a request of three chunks whose last is partial and starts
    mid-chunk of the stream, a pad among live requests, an empty live request, has_initial_state mixed
    (pads' o = 0 and untouched slots checked by the harness); the two agree with each other."""
    M = _kernel(impl, dtype)
    lengths, slots, init = (3, 2 * 16 + 5, 6, 0, 9), (2, 4, PAD, 1, 3), (True, False, True, True, False)
    args, live = _case(lengths, device, dtype, Hk=1, Hv=2, slots=slots, init=init, seed=17)
    args2 = [a.clone() for a in args]
    with mock.patch.dict(M.CONFIG, {"chunk": 16, "outputs": outputs}):
        y, pool = _check(check, impl, args, live, dtype, outputs=outputs)
    other = "scan" if outputs == "parallel" else "parallel"
    _rerun_agrees(impl, M, {"chunk": 16, "outputs": other}, args2, y, pool, True, f"{outputs} vs {other}")


@L2NORM_CASES
def test_output_key_blocks(impl, device, check, dtype, l2norm):
    """CONFIG["out_bk"]: the parallel output launch walking the key dimension in blocks of 16 (K 40: two
    full blocks and a partial one; the rows' sums of squares accumulated beside the dots, the l2 norms
    applied to the products after the pass) against the oracle, and
    against the whole-key-width path (out_bk 0) on the same inputs: a request over two chunks that starts
    mid-chunk of the stream, a pad, an empty live request."""
    M = _kernel(impl, dtype)
    lengths, slots, init = (3, 16 + 5, 0, 9), (2, PAD, 1, 3), (True, True, True, False)
    args, live = _case(lengths, device, dtype, Hk=1, Hv=2, K=40, V=5, slots=slots, init=init, l2norm=l2norm,
                       seed=23)
    args2 = [a.clone() for a in args]
    with mock.patch.dict(M.CONFIG, {"chunk": 16, "outputs": "parallel", "out_bk": 16}):
        y, pool = _check(check, impl, args, live, dtype, l2norm=l2norm, out_bk=16)
    # the final states do not depend on the output launch's key blocks
    _rerun_agrees(impl, M, {"chunk": 16, "outputs": "parallel", "out_bk": 0}, args2, y, pool, l2norm,
                  "out_bk 16 vs 0", exact_states=True)


# the launches that can serve a key head's value heads in one program: (CONFIG keys set, the knob)
PER_KEY_HEAD = {"output": ({"outputs": "parallel", "out_bk": 16}, "out_heads"),
                "prep-parallel": ({"outputs": "parallel"}, "prep_heads"),
                "prep-scan": ({"outputs": "scan"}, "prep_heads")}


@pytest.mark.parametrize("launch", list(PER_KEY_HEAD))
@pytest.mark.parametrize("heads", [(1, 2), (2, 6)], ids=["Hk1-Hv2", "Hk2-Hv6"])
@L2NORM_CASES
def test_launch_per_key_head(impl, device, check, dtype, l2norm, heads, launch):
    """CONFIG["out_heads"] / ["prep_heads"] "key": the parallel output launch (q k^T and the norms formed once, a
    pass over K per value head for q S_c^T; key blocks of 16 over K 40) or the per-chunk launch (the normalised
    k tile, k k^T and, for the "scan" pipeline, q k^T formed once) with a program per key head serving its value
    heads, against the oracle and against the per-value-head launch on the same inputs (the same products: equal
    to rounding): a request over two chunks that starts mid-chunk of the stream, a pad, an empty live request;
    three value heads per key head in the second case."""
    M = _kernel(impl, dtype)
    Hk, Hv = heads
    base, knob = PER_KEY_HEAD[launch]
    lengths, slots, init = (3, 16 + 5, 0, 9), (2, PAD, 1, 3), (True, True, True, False)
    args, live = _case(lengths, device, dtype, Hk=Hk, Hv=Hv, K=40, V=5, slots=slots, init=init, l2norm=l2norm,
                       seed=29)
    args2 = [a.clone() for a in args]
    with mock.patch.dict(M.CONFIG, {"chunk": 16, **base, knob: "key"}):
        y, pool = _check(check, impl, args, live, dtype, l2norm=l2norm, **{knob: "key"}, outputs=base["outputs"])
    _rerun_agrees(impl, M, {"chunk": 16, **base, knob: "value"}, args2, y, pool, l2norm, f"{knob} key vs value")


def test_prep_per_key_head_needs_the_whole_key_width(impl, device):
    """prep_heads "key" with prep_bk splitting the key width raises ValueError naming prep_heads; nothing is
    written."""
    M = _kernel(impl, torch.float32)
    args, _ = _case((5,), device, torch.float32, K=40)
    out = torch.full_like(args[2], 7.0)
    before = args[5].clone()
    with mock.patch.dict(M.CONFIG, {"prep_heads": "key", "prep_bk": 16}), \
            pytest.raises(ValueError, match="prep_heads.*'key'"):
        impl.op(OP)(*args, use_qk_l2norm=True, out=out)
    assert bool((out == 7.0).all())
    assert_bitwise_equal("pool after a rejected call", args[5], before)


@pytest.mark.parametrize("outputs", ["parallel", "scan"])
@L2NORM_CASES
def test_prep_key_blocks(impl, device, check, dtype, l2norm, outputs):
    """CONFIG["prep_bk"]: the per-chunk launch walking the key dimension in blocks of 16 (K 40: two full
    blocks and a partial one; k k^T, and q k^T for the "scan" pipeline, accumulated over the blocks with the
    rows' sums of squares, the l2 norms applied to the products after; w and kg stored block by block)
    against the oracle, and against the
    whole-key-width path (prep_bk 0) on the same inputs, in either pipeline."""
    M = _kernel(impl, dtype)
    lengths, slots, init = (3, 16 + 5, 0, 9), (2, PAD, 1, 3), (True, True, True, False)
    args, live = _case(lengths, device, dtype, Hk=1, Hv=2, K=40, V=5, slots=slots, init=init, l2norm=l2norm,
                       seed=29)
    args2 = [a.clone() for a in args]
    with mock.patch.dict(M.CONFIG, {"chunk": 16, "outputs": outputs, "prep_bk": 16}):
        y, pool = _check(check, impl, args, live, dtype, l2norm=l2norm, prep_bk=16, outputs=outputs)
    _rerun_agrees(impl, M, {"chunk": 16, "outputs": outputs, "prep_bk": 0}, args2, y, pool, l2norm,
                  "prep_bk 16 vs 0")


@pytest.mark.parametrize("bk", [0, 16], ids=["whole-width", "key-blocks"])
def test_wide_tile_offsets(impl, device, bk):
    """A chunk whose rows span 2**31 elements or more (a view with a huge row stride) takes 64-bit tile
    offsets (WIDE_SPAN): forced here on small inputs, the outputs and states are bit for bit those of the
    32-bit offsets, with the key dimension whole or in blocks (K 40), the l2 normalisation on."""
    dtype = torch.float32
    M = _kernel(impl, dtype)
    lengths, slots, init = (3, 16 + 5, 0, 9), (2, PAD, 1, 3), (True, True, True, False)
    args, _ = _case(lengths, device, dtype, Hk=1, Hv=2, K=40, V=5, slots=slots, init=init, seed=31)
    args2 = [a.clone() for a in args]
    knobs = {"chunk": 16, "outputs": "parallel", "prep_bk": bk, "out_bk": bk}
    with mock.patch.dict(M.CONFIG, knobs):
        y = impl.op(OP)(*args, use_qk_l2norm=True)
        with mock.patch.object(M, "WIDE_SPAN", 0):
            y2 = impl.op(OP)(*args2, use_qk_l2norm=True)
    assert_bitwise_equal("outputs, 64-bit vs 32-bit tile offsets", y2, y)
    assert_bitwise_equal("states, 64-bit vs 32-bit tile offsets", args2[5], args[5])


@pytest.mark.parametrize("knob", ["out_bk", "prep_bk"])
def test_bad_key_block_raises(impl, device, knob):
    """CONFIG["out_bk"] / ["prep_bk"] neither 0 nor a power of two >= 16 raises ValueError naming it;
    nothing is written."""
    M = _kernel(impl, torch.float32)
    args, _ = _case((5,), device, torch.float32)
    out = torch.full_like(args[2], 7.0)
    before = args[5].clone()
    with mock.patch.dict(M.CONFIG, {knob: 24}), pytest.raises(ValueError, match=f"{knob}.*24"):
        impl.op(OP)(*args, use_qk_l2norm=True, out=out)
    assert bool((out == 7.0).all()) and torch.equal(args[5], before)


@pytest.mark.parametrize("knob,value", [("outputs", "fused"), ("update_keys", "kg"), ("out_heads", "query"),
                                        ("prep_heads", "query"), ("t_products", "fp8")])
def test_unknown_pipeline_choice_raises(impl, device, knob, value):
    """CONFIG["outputs"] other than "scan" / "parallel", CONFIG["update_keys"] other than "stored" / "rows",
    CONFIG["out_heads"] or ["prep_heads"] other than "value" / "key", CONFIG["t_products"] other than "tf32" /
    "half", raises ValueError naming it; nothing is written."""
    M = _kernel(impl, torch.float32)
    args, _ = _case((5,), device, torch.float32)
    out = torch.full_like(args[2], 7.0)
    before = args[5].clone()
    with mock.patch.dict(M.CONFIG, {knob: value}), pytest.raises(ValueError, match=f"{knob}.*'{value}'"):
        impl.op(OP)(*args, use_qk_l2norm=True, out=out)
    assert bool((out == 7.0).all())
    assert_bitwise_equal("pool after a rejected call", args[5], before)


def _strided(t: torch.Tensor, layout: str, half: int = 0) -> torch.Tensor:
    """`t`'s values in a view: "fused", one half (`half` 0 / 1) of the last dim of a (T, H, 2 K) buffer (q and
    k as the two halves of one projection: rows and heads twice as far apart); "transposed", of a buffer holding
    its dims in reverse order (no unit stride but the first dim's)."""
    if layout == "fused":
        K = t.shape[-1]
        view = torch.full((*t.shape[:-1], 2 * K), float("nan"), dtype=t.dtype, device=t.device)[..., half * K:]
        view = view[..., :K]
    else:
        view = torch.full(tuple(reversed(t.shape)), float("nan"), dtype=t.dtype, device=t.device).permute(2, 1, 0)
    view.copy_(t)
    return view


# (id, dtype, l2norm, g range, q / k layout): CONFIG["update_keys"] "rows" against the oracle
ROWS_CASES = [
    ("float32", torch.float32, True, (-1.0, 0.0), None),
    ("float64", torch.float64, True, (-1.0, 0.0), None),
    ("float32-no-l2norm", torch.float32, False, (-1.0, 0.0), None),
    ("float64-no-l2norm", torch.float64, False, (-1.0, 0.0), None),
    ("strong-decay", torch.float32, True, (-30.0, -5.0), None),
    ("fused-qk", torch.float32, True, (-1.0, 0.0), "fused"),
    ("transposed-qk", torch.float64, False, (-1.0, 0.0), "transposed"),
]


@pytest.mark.parametrize("outputs", ["parallel", "scan"])
@pytest.mark.parametrize("case", ROWS_CASES, ids=[c[0] for c in ROWS_CASES])
def test_update_keys_rows(impl, device, check, case, outputs):
    """CONFIG["update_keys"] "rows" (the state update's decays and key norms on the rows of v', k loaded in
    the recurrence; no kg scratch in the parallel pipeline) against the oracle, in either pipeline: two key
    heads each shared by two value heads, a request of three chunks whose last is partial starting from its
    initial state, a short one and a pad; fp32 / fp64, with and without the l2 normalisation, g down to -30,
    q and k as halves of one buffer or transposed views."""
    _, dtype, l2norm, g_range, layout = case
    M = _kernel(impl, dtype)
    lengths, slots, init = (5, 2 * 16 + 7, 4), (2, 1, PAD), (False, True, True)
    args, live = _case(lengths, device, dtype, Hk=2, Hv=4, K=24, V=5, slots=slots, init=init, g_range=g_range,
                       l2norm=l2norm, seed=37)
    if layout:
        args[0], args[1] = _strided(args[0], layout, 0), _strided(args[1], layout, 1)
    with mock.patch.dict(M.CONFIG, {"chunk": 16, "outputs": outputs, "update_keys": "rows"}):
        y, pool = _check(check, impl, args, live, dtype, l2norm=l2norm, outputs=outputs, update_keys="rows",
                         g=g_range, qk_layout=layout)
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(pool).all())


@pytest.mark.parametrize("outputs", ["parallel", "scan"])
@L2NORM_CASES
def test_update_keys_agree(impl, device, dtype, l2norm, outputs):
    """CONFIG["update_keys"] "stored" and "rows" on the same inputs: outputs and final states equal to
    rounding (the products' factors applied to other operands), in either pipeline."""
    M = _kernel(impl, dtype)
    lengths, slots, init = (3, 2 * 16 + 5, 0, 9), (2, PAD, 1, 3), (True, True, True, False)
    args, _ = _case(lengths, device, dtype, Hk=1, Hv=2, K=40, V=5, slots=slots, init=init, l2norm=l2norm, seed=41)
    args2 = [a.clone() for a in args]
    with mock.patch.dict(M.CONFIG, {"chunk": 16, "outputs": outputs, "update_keys": "stored"}):
        y = impl.op(OP)(*args, use_qk_l2norm=l2norm)
    _rerun_agrees(impl, M, {"chunk": 16, "outputs": outputs, "update_keys": "rows"}, args2, y, args[5], l2norm,
                  "stored vs rows")


def test_half_t_products_leave_fp32_as_is(impl, device):
    """CONFIG["t_products"] "half" rounds T's products for bf16 inputs only (`test_large_batch_on_gpu` runs it at
    bf16): fp32 outputs and states are bit for bit those of "tf32"."""
    M = _kernel(impl, torch.float32)
    args, _ = _case((3, 16 + 5, 0, 9), device, torch.float32, Hk=1, Hv=2, K=40, V=5, slots=(2, PAD, 1, 3), seed=29)
    args2 = [a.clone() for a in args]
    with mock.patch.dict(M.CONFIG, {"chunk": 16}):
        y = impl.op(OP)(*args, use_qk_l2norm=True)
    with mock.patch.dict(M.CONFIG, {"chunk": 16, "t_products": "half"}):
        y2 = impl.op(OP)(*args2, use_qk_l2norm=True)
    assert_bitwise_equal("fp32 outputs, t_products half vs tf32", y2, y)
    assert_bitwise_equal("fp32 states, t_products half vs tf32", args2[5], args[5])


SPLIT_CASES = [(torch.float32, True, "parallel", "stored"), (torch.float32, True, "parallel", "rows"),
               (torch.float64, False, "scan", "rows"), (torch.float32, False, "scan", "stored")]


@pytest.mark.parametrize("dtype, l2norm, outputs, keys", SPLIT_CASES,
                         ids=["fp32-l2-parallel-stored", "fp32-l2-parallel-rows", "fp64-scan-rows", "fp32-scan-stored"])
def test_split_prep_matches_the_fused_launch(impl, device, dtype, l2norm, outputs, keys):
    """CONFIG["prep_split"]: the per-chunk launch stores T and the key norms, and `_gdn_wu_kernel` forms w, u and
    kg from them in blocks of wu_bw columns (here 16: three key blocks over K = 40, the last partial, two value
    blocks over V = 20): the same operations on the same values as the fused launch, so outputs and final states
    agree with it to rounding (bit for bit under the interpreter), in both pipelines and with both state-update
    keys; the second launch is made."""
    M = _kernel(impl, dtype)
    lengths, slots, init = (3, 16 + 5, 0, 40), (2, PAD, 1, 3), (True, True, True, False)
    args, _ = _case(lengths, device, dtype, Hk=1, Hv=2, K=40, V=20, slots=slots, init=init, l2norm=l2norm, seed=29)
    args2 = [a.clone() for a in args]
    base = {"chunk": 16, "outputs": outputs, "update_keys": keys}
    with mock.patch.dict(M.CONFIG, base):
        y = impl.op(OP)(*args, use_qk_l2norm=l2norm)
    launched = []
    from harness.impls.triton import _common
    real = _common.launch_fixed  # the op's launch plan launches through it

    def recording(fixed, *a):
        kernel = fixed.kernel
        launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real(fixed, *a)
    with mock.patch.object(_common, "launch_fixed", recording):
        y2 = _rerun_agrees(impl, M, {**base, "prep_split": True, "wu_bw": 16}, args2, y, args[5], l2norm,
                           "split vs fused per-chunk launch", exact_states=device.startswith("cpu"))
    assert "_gdn_wu_kernel" in launched, launched
    if device.startswith("cpu"):
        assert_bitwise_equal("outputs, split vs fused per-chunk launch", y2, y)


@pytest.mark.parametrize("keys", ["stored", "rows"])
@L2NORM_CASES
def test_key_major_state_tile_agrees(impl, device, dtype, l2norm, keys):
    """CONFIG["state_major"] "key": the parallel recurrence holds S^T (K, BV) instead of S (BV, K) and forms
    the update as k^T v' (the same sums in another product shape): outputs and final states equal those of the
    value-major tile to rounding, with either state-update key operand, over two blocks of value rows (V = 20
    in blocks of bv 16: the last partial)."""
    M = _kernel(impl, dtype)
    lengths, slots, init = (3, 2 * 16 + 5, 0, 9), (2, PAD, 1, 3), (True, True, True, False)
    args, _ = _case(lengths, device, dtype, Hk=1, Hv=2, K=40, V=20, slots=slots, init=init, l2norm=l2norm, seed=43)
    args2 = [a.clone() for a in args]
    base = {"chunk": 16, "bv": 16, "update_keys": keys}
    with mock.patch.dict(M.CONFIG, base):
        y = impl.op(OP)(*args, use_qk_l2norm=l2norm)
    _rerun_agrees(impl, M, {**base, "state_major": "key"}, args2, y, args[5], l2norm, "key- vs value-major state")


@pytest.mark.parametrize("cfg, expected", [
    ({"prep_split": True, "prep_heads": "key"}, 'False unless prep_heads is "value" and prep_bk 0'),
    ({"prep_split": True, "prep_bk": 16}, 'False unless prep_heads is "value" and prep_bk 0'),
    ({"prep_split": "yes"}, "True or False"),
    ({"prep_split": True, "wu_bw": 24}, "a power of two >= 16"),
    ({"state_major": "rows"}, "one of ('value', 'key')")])
def test_split_prep_bad_settings_are_refused(impl, device, cfg, expected):
    """prep_split with a per-key-head or key-blocked per-chunk launch (which it does not take), a flag that is not
    a bool, or a column block that is not a power of two: an error naming the setting, before any launch."""
    M = _kernel(impl, torch.float32)
    args, _ = _case((5,), device, torch.float32, Hk=1, Hv=2, K=32, V=16, seed=3)
    with mock.patch.dict(M.CONFIG, {"chunk": 16, **cfg}), pytest.raises(ValueError, match=re.escape(expected)):
        impl.op(OP)(*args, use_qk_l2norm=True)


@pytest.mark.parametrize("knobs", [{}, {"update_keys": "rows"}, {"t_products": "half"}, {"prep_split": True},
                                   {"prep_split": True, "t_products": "half"}, {"state_major": "key"}],
                         ids=["default", "rows", "half-T-products", "split-prep", "split-prep-half-T", "key-major"])
def test_large_batch_on_gpu(impl, device, check, knobs):
    """GPU only (too slow for the interpreter): bf16 activations at the layer's head size (K = V = 128),
    Hv = 2 Hk, a long request of many 64-token chunks among short ones, every launch default (and with two sweep
    candidates: the state update's keys on the rows of v'; T's products with the keys and values in bf16; the
    per-chunk launch split in two, T stored in fp32 and in bf16; the recurrence's state tile key-major)."""
    if device.startswith("cpu"):
        pytest.skip("a GPU case: thousands of tokens at K = V = 128 are too slow for the Triton interpreter")
    M = _kernel(impl, torch.bfloat16)
    args, live = _case((1000, 1, 333, 64, 0), device, torch.bfloat16, Hk=2, Hv=4, K=128, V=128, seed=9,
                       slots=(3, PAD, 1, 2, 4))
    with mock.patch.dict(M.CONFIG, knobs):
        _check(check, impl, args, live, torch.bfloat16, layout="contiguous", **knobs)
