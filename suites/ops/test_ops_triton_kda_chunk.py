"""Kernel suite: the Triton chunked KDA prefill (harness/impls/triton/kda_chunk.py, op `kda_varlen`) on the
edges of its chunk grid, of its two stages and of the per-chunk stage's two intra-chunk paths, against the
float64 oracle.

Chunks restart at every sequence start: sequences that start mid-chunk of the packed stream, a last chunk
that is not full, exactly one chunk, one token past it, many chunks, empty sequences (with and without an
initial state) and pads; the scan finds each sequence's chunks in the per-chunk stage's table (the chunk
decays) by counting the chunks before it, which the multi-sequence cases cover. The pairwise decays
exp(G_i - G_j) are split at the chunk's middle when that is safe (the fast path) and formed pair by pair
otherwise (the exact path), chosen per chunk: weak, typical and strong decays (g ~ -5 per token and channel
on the fast path, g down to -30 on the exact path), growth (g > 0) and mixed signs each match the oracle,
a sequence whose chunks take both paths too, the exact path is also forced on ordinary inputs, and the other
chunk lengths and value blocks the launch configuration offers are exercised. Runs on the device under test
(CPU through the Triton interpreter, fp32 / fp64 there; fp32 and bf16 on a GPU).
"""
import math
from unittest import mock

import pytest
import torch

from harness.testing.checks import assert_bitwise_equal, tolerance_for
from harness.testing.optest import rand, randn, run_pool_case, token_mask
from reference.testing import cu_seqlens_from, gen
from harness.testing import make_pool

OP = "kda_varlen"


def _module(device):
    from harness.impls.triton._common import has_gpu, interpreting
    if device.startswith("cpu") and not interpreting():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (pytest --device cpu sets it)")
    if not device.startswith("cpu") and not has_gpu():
        pytest.skip("no GPU for Triton")
    import harness.impls.triton.kda_chunk as kc
    return kc


def _impl():
    from harness.impls.registry import get
    return get("triton")


def _dtypes(device):
    return [torch.float32, torch.float64] if device.startswith("cpu") else [torch.float32, torch.bfloat16]


def _decays(kind, g_, shape, device):
    """Log-decays (fp32) of one regime."""
    if kind == "weak":
        return -rand(g_, shape, torch.float32, device, 0.0, 0.05)
    if kind == "typical":
        return -rand(g_, shape, torch.float32, device, 0.0, 1.0)
    if kind == "strong5":  # about -5 per token and channel: the split stays within range (fast path)
        return randn(g_, shape, torch.float32, device, scale=0.2, shift=-5.0)
    if kind == "strong30":  # down to -30: pairwise decays underflow (exact path)
        return -rand(g_, shape, torch.float32, device, 5.0, 30.0)
    if kind == "growth":  # g > 0: the state grows (admitted by the contract)
        return rand(g_, shape, torch.float32, device, 0.0, 0.3)
    if kind == "mixed":
        return rand(g_, shape, torch.float32, device, -1.0, 0.3)
    if kind == "banded":  # typical, but tokens 16..31 as strong30: that 16-token chunk alone takes the exact path
        g = _decays("typical", g_, shape, device)
        g[16:32] = _decays("strong30", g_, (min(shape[0], 32) - 16,) + tuple(shape[1:]), device)
        return g
    raise ValueError(kind)


def _case(device, dtype, lengths, *, H=2, K=8, V=5, decay="typical", seed=0, l2norm=True, slots=None,
          has_init=None, layout="contiguous"):
    """Arguments of one call (pool slots 1.. for the requests unless given; slot 0 never named)."""
    g_ = gen(seed)
    T, S = sum(lengths), len(lengths)
    s = 1.0 if l2norm else K ** -0.5
    q = randn(g_, (T, H, K), dtype, device, scale=s)
    k = randn(g_, (T, H, K), dtype, device, scale=s)
    v = randn(g_, (T, H, V), dtype, device)
    g = _decays(decay, g_, (T, H, K), device)
    beta = torch.sigmoid(randn(g_, (T, H), torch.float32, device))
    if dtype == torch.float64:
        g, beta = g.double(), beta.double()
    slots = list(range(1, S + 1)) if slots is None else slots
    has_init = [i % 2 == 0 for i in range(S)] if has_init is None else has_init
    pool = make_pool(S + 2, (H, V, K), torch.float64 if dtype == torch.float64 else torch.float32, device,
                     layout=layout, seed=seed)
    args = [q, k, v, g, beta, pool, cu_seqlens_from(lengths, device, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(has_init, dtype=torch.bool, device=device)]
    return args, slots


def _run(check, device, dtype, lengths, *, kw=None, scale=1.0, **case):
    args, slots = _case(device, dtype, lengths, **case)
    kw = dict(use_qk_l2norm=case.get("l2norm", True), **(kw or {}))
    y, pool = run_pool_case(check, _impl(), OP, args, kw, pool_pos=5, live_slots=slots,
                            y_mask=token_mask(lengths, slots), dtype=dtype, seed=case.get("seed", 0),
                            shapes=dict(lengths=lengths, **{k: v for k, v in case.items() if k != "seed"}),
                            scale=scale, out_like=args[2])
    m = token_mask(lengths, slots).to(y.device)
    assert bool(torch.isfinite(y[m]).all()), f"{OP}: non-finite output ({case})"
    return args, y


# ------------------------------------------------------------------------------------------------ chunk grid

GRIDS = {
    "mid-chunk starts": [3, 16, 17, 5],  # sequence starts at 3, 19, 36 of the packed stream
    "one full chunk": [16],
    "empty and single": [0, 1, 20, 0],
    "many chunks": [70],
}


@pytest.mark.parametrize("lengths", list(GRIDS.values()), ids=list(GRIDS))
def test_chunk_grid_edges(device, check, lengths):
    """Per-sequence chunks: starts mid-chunk of the packed stream, short last chunks (padding that must not
    decay or write), exactly one chunk, 70 tokens (5 chunks), empty and single-token sequences; outputs and
    live slots match the oracle, unnamed slots bitwise unchanged, on a contiguous and a page-major pool."""
    _module(device)
    for layout in ("contiguous", "page_major"):
        _run(check, device, torch.float32, lengths, layout=layout, seed=len(lengths))


def test_pads_and_empty_sequences_mirror_torch(device):
    """A pad request's tokens are computed from a zero state (as the torch implementation does) and its
    slot untouched; an empty live sequence writes its initial state back (bitwise) or zeros without one."""
    _module(device)
    from harness.impls.registry import get
    lengths = [4, 0, 6, 0, 5]
    args, _ = _case(device, torch.float32, lengths, slots=[1, 2, -1, 4, 5], has_init=[True, True, True, False, False])
    pool = args[5]
    before = pool.clone()
    ours = _impl().op(OP)(*args, use_qk_l2norm=True)
    targs = list(args)
    targs[5] = before.clone()
    theirs = get("torch").op(OP)(*targs, use_qk_l2norm=True)
    tol = tolerance_for(torch.float32)
    pad_rows = slice(4, 10)
    assert torch.allclose(ours[pad_rows], theirs[pad_rows], atol=tol.atol, rtol=tol.rtol), \
        "pad request's outputs differ from the torch implementation's (zero initial state)"
    assert_bitwise_equal("empty sequence with an initial state: its slot", pool[2], before[2])
    assert_bitwise_equal("empty sequence without an initial state: its slot", pool[4], torch.zeros_like(pool[4]))
    for s in (0, 3, 6):
        assert_bitwise_equal(f"slot {s} (not named, or a pad's)", pool[s], before[s])


# ------------------------------------------------------------------------------------------------ decays

DECAYS = ["weak", "typical", "strong5", "strong30", "growth", "mixed"]


@pytest.mark.parametrize("decay", DECAYS)
def test_decay_regimes_match_reference(device, check, decay):
    """Weak, typical, strong (-5 per token: fast path; down to -30: exact path, in 16-token chunks), growing
    and mixed-sign decays match the oracle on several sequences, every dtype of the device, with 16-token
    chunks (the paths as intended) and the configured chunk length."""
    kc = _module(device)
    for bt in sorted({16, int(kc.CONFIG["bt"])}):
        with mock.patch.dict(kc.CONFIG, {"bt": bt}):
            for dtype in _dtypes(device):
                _run(check, device, dtype, [5, 20, 11], decay=decay, seed=DECAYS.index(decay))


def _spread_log2(g, BT):
    """Per chunk of one sequence's g (L, K): max |G - G_mid| (the chunk start included) in log2 units, the
    quantity the kernel compares with fast_thr."""
    out = []
    for c0 in range(0, g.shape[0], BT):
        gc = torch.zeros(BT, g.shape[1], dtype=torch.float64)
        gc[:min(BT, g.shape[0] - c0)] = g[c0:c0 + BT].double()
        G = torch.cumsum(gc, 0) / math.log(2)
        mid = G[BT // 2 - 1]
        out.append(max(float((G - mid).abs().max()), float(mid.abs().max())))
    return out


def test_strong_decay_regimes_take_the_intended_path(device):
    """The regimes above reach the path they are meant for in 16-token chunks with the configured fast_thr:
    g ~ -5 per token keeps every chunk's split within fast_thr, g down to -30 sends every chunk to the exact
    path."""
    kc = _module(device)
    BT, thr = 16, float(kc.CONFIG["fast_thr"])
    g5 = _decays("strong5", gen(1), (64, 8), "cpu")
    g30 = _decays("strong30", gen(1), (64, 8), "cpu")
    assert max(_spread_log2(g5, BT)) <= thr, _spread_log2(g5, BT)
    assert min(_spread_log2(g30, BT)) > thr, _spread_log2(g30, BT)


@pytest.mark.parametrize("decay", ["typical", "growth", "strong5"])
def test_exact_path_forced(device, check, decay):
    """With fast_thr below 0 every chunk takes the exact path: it matches the oracle on the inputs the fast
    path normally serves."""
    kc = _module(device)
    with mock.patch.dict(kc.CONFIG, {"fast_thr": -1.0}):
        _run(check, device, torch.float32, [9, 23], decay=decay, seed=3)


def test_fast_and_exact_chunks_in_one_sequence(device, check):
    """The path is chosen per chunk in the parallel per-chunk stage: a 45-token sequence (16-token chunks)
    whose second chunk has decays down to -30 (exact path) between chunks of typical decays (fast path), a
    second sequence starting mid-chunk of the packed stream behind it, matches the oracle."""
    kc = _module(device)
    with mock.patch.dict(kc.CONFIG, {"bt": 16}):
        thr = float(kc.CONFIG["fast_thr"])
        spread = _spread_log2(_decays("banded", gen(6), (45, 8), "cpu"), 16)
        assert [s > thr for s in spread] == [False, True, False], spread
        _run(check, device, torch.float32, [45, 7], decay="banded", seed=6)


# ------------------------------------------------------------------------------------------------ launch variants

VARIANTS = {
    "bt16": {"bt": 16},
    "bt32": {"bt": 32},
    "bt64": {"bt": 64, "bv": 64},
    "bv16": {"bv": 16, "scan_stages": 1},
    "prep_bv16": {"prep_bv": 16, "bv": 64},
    "prep_bk8": {"prep_bk": 16},  # K = 8 < 16: one block, the two-pass form
}


@pytest.mark.parametrize("over", list(VARIANTS.values()), ids=list(VARIANTS))
def test_launch_variants(device, check, over):
    """The chunk lengths 16, 32 (two chunks and a short one in 70 tokens) and 64, value blocks of 16 over V = 20
    (a partial second block) in the scan and in the per-chunk stage's steps over V, and one block covering V
    match the oracle, as every sweep candidate must."""
    kc = _module(device)
    with mock.patch.dict(kc.CONFIG, over):
        _run(check, device, torch.float32, [3, 70], V=20, seed=4)


BLOCKED = {"typical": ("typical", True, [3, 70]), "strong30-exact": ("strong30", True, [9, 23]),
           "banded-no-l2norm": ("banded", False, [45, 7])}


@pytest.mark.parametrize("case", list(BLOCKED.values()), ids=list(BLOCKED))
@pytest.mark.parametrize("kb", [16, 32])
def test_key_blocked_per_chunk_stage(device, check, kb, case):
    """CONFIG["prep_bk"] (a sweep candidate: fewer live registers): the per-chunk stage over key blocks of 16 or
    32 channels of K = 40 (the last block partial), Qk and k k accumulated over the blocks with the l2
    normalisation and the scale applied after, each block taking the fast or the exact path by its own spread
    (decays typical, strong: every chunk exact, banded: one 16-token chunk exact), matches the oracle, and the
    whole-width stage to rounding."""
    decay, l2norm, lengths = case
    kc = _module(device)
    with mock.patch.dict(kc.CONFIG, {"prep_bk": kb, "bt": 16}):
        args, y = _run(check, device, torch.float32, lengths, K=40, V=20, decay=decay, l2norm=l2norm, seed=8)
    fresh, _ = _case(device, torch.float32, lengths, K=40, V=20, decay=decay, l2norm=l2norm, seed=8)
    with mock.patch.dict(kc.CONFIG, {"bt": 16}):
        y0 = _impl().op(OP)(*fresh, use_qk_l2norm=l2norm)
    assert torch.allclose(y, y0, rtol=1e-4, atol=1e-5), f"outputs, key-blocked vs whole width: {(y - y0).abs().max()}"


@pytest.mark.parametrize("kb", [16, 32])
def test_key_blocked_on_gpu(device, check, kb):
    """GPU only (the interpreter is too slow at this size): prep_bk at the layer's head size, bf16, K = V = 128
    over several 64-token chunks, against the oracle at the bf16 tolerance."""
    if device.startswith("cpu"):
        pytest.skip("a GPU case: K = V = 128 over hundreds of tokens is too slow for the Triton interpreter")
    kc = _module(device)
    with mock.patch.dict(kc.CONFIG, {"prep_bk": kb}):
        _run(check, device, torch.bfloat16, [3, 200, 64], H=4, K=128, V=128, seed=4)


def test_half_t_products(device, check):
    """CONFIG["t_products"] "half" (a sweep candidate): bf16 inputs multiply T and Qk with w, u and the keys in
    bf16 and still match the oracle at the bf16 tolerance, at the layer's head size over several chunks (GPU:
    the interpreter computes in fp32 only; there it must leave fp32 bit for bit as it was)."""
    kc = _module(device)
    if device.startswith("cpu"):
        args, _ = _case(device, torch.float32, [3, 70], V=20, seed=4)
        args2 = [a.clone() for a in args]
        y = _impl().op(OP)(*args, use_qk_l2norm=True)
        with mock.patch.dict(kc.CONFIG, {"t_products": "half"}):
            y2 = _impl().op(OP)(*args2, use_qk_l2norm=True)
        assert_bitwise_equal("fp32 outputs, t_products half vs tf32", y2, y)
        assert_bitwise_equal("fp32 states, t_products half vs tf32", args2[5], args[5])
        return
    with mock.patch.dict(kc.CONFIG, {"t_products": "half"}):
        _run(check, device, torch.bfloat16, [3, 200, 64], H=4, K=128, V=128, seed=4)


def test_unknown_t_products_raises(device):
    """CONFIG["t_products"] other than "tf32" / "half" raises ValueError naming it; nothing is written."""
    kc = _module(device)
    args, _ = _case(device, torch.float32, [5])
    out = torch.full_like(args[2], 7.0)
    before = args[5].clone()
    with mock.patch.dict(kc.CONFIG, {"t_products": "fp8"}), pytest.raises(ValueError, match="t_products.*'fp8'"):
        _impl().op(OP)(*args, use_qk_l2norm=True, out=out)
    assert bool((out == 7.0).all())
    assert_bitwise_equal("pool after a rejected call", args[5], before)


def test_wide_tile_offsets(device):
    """A chunk whose rows span 2**31 elements or more (a view with a huge row stride) takes 64-bit tile offsets
    in the per-chunk stage (delta_rule_chunk.WIDE_SPAN): forced here on small inputs (two sequences, one
    starting mid-chunk), the outputs and states are bit for bit those of the 32-bit offsets."""
    _module(device)
    import harness.impls.triton.delta_rule_chunk as gdn
    args, _ = _case(device, torch.float32, [5, 21], seed=8)
    args2 = [a.clone() for a in args]
    y = _impl().op(OP)(*args, use_qk_l2norm=True)
    with mock.patch.object(gdn, "WIDE_SPAN", 0):
        y2 = _impl().op(OP)(*args2, use_qk_l2norm=True)
    assert_bitwise_equal("outputs, 64-bit vs 32-bit tile offsets", y2, y)
    assert_bitwise_equal("states, 64-bit vs 32-bit tile offsets", args2[5], args[5])


def test_options_and_fp64(device, check):
    """Without l2norm, with an explicit scale, in fp64 (the scale read exactly from a tensor)."""
    _module(device)
    _run(check, device, torch.float32, [7, 12], l2norm=False, kw=dict(scale=0.3), seed=5)
    if device.startswith("cpu"):
        _run(check, device, torch.float64, [7, 12], l2norm=False, kw=dict(scale=0.3), seed=5)


def test_no_host_synchronisation(device):
    """The op reads query_start_loc, cache_indices and has_initial_state only on the device (no .item(),
    .tolist() or bool() of a tensor), so it can be captured in a CUDA graph (index checks off, as under
    capture)."""
    _module(device)
    from harness.ops._checks import no_index_checks
    args, _ = _case(device, torch.float32, [5, 0, 18])

    def refuse(*a, **k):
        raise AssertionError("host synchronisation inside kda_varlen")
    with no_index_checks(), mock.patch.object(torch.Tensor, "item", refuse), \
            mock.patch.object(torch.Tensor, "tolist", refuse), mock.patch.object(torch.Tensor, "__bool__", refuse):
        _impl().op(OP)(*args, use_qk_l2norm=True)


def test_scan_pipeline_fits_shared_memory():
    """The scan's pipeline depth is lowered until its chunk tiles fit: fp16 inputs (fp32 dot operands) at
    K = 128 with two configured stages run one (two needed 238 KB of the H200's 227 KiB and failed to
    launch); bf16 keeps two."""
    from harness.impls.triton.kda_chunk import SCAN_SMEM_BYTES, scan_stages
    assert scan_stages(2, 4, 64, 128, 32) == 1
    assert scan_stages(2, 2, 64, 128, 32) == 2
    assert scan_stages(4, 2, 64, 128, 32) == 3
    assert scan_stages(1, 8, 64, 128, 128) == 1
    for esz in (2, 4, 8):
        for bk in (16, 32, 64, 128):
            n = scan_stages(4, esz, 64, bk, 32)
            assert n == 1 or n * (3 * 64 * bk + 2 * 64 * 32) * esz <= SCAN_SMEM_BYTES
