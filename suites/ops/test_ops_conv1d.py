"""Op suite: causal_conv1d_varlen and causal_conv1d_update, every implementation x dtype against the
float64 oracle (harness.impls.reference_impl.oracle), on hypothesis-generated varlen batches."""
import random

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.optest import ALL_DTYPES, interp_small, tiled_seqlens, other_layout_pool, randn, require, require_nightly_gpu, run_pool_case, token_mask
from reference.testing import cu_seqlens_from, gen
from harness.testing import CONV_LAYOUTS, choose_slots, make_pool

DT_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]
seeds = st.integers(0, 2**31 - 1)


def _conv_case(data, impl, device, dtype, small):
    # the usual lengths, or next to a multiple of the implementation's row block (`tiled_seqlens`)
    lengths = data.draw(tiled_seqlens(impl, "causal_conv1d_varlen", max_seqs=3 if small else 5,
                                      max_len=10 if small else 40, tile_cap=10 if small else None), label="lengths")
    D = data.draw(st.sampled_from([1, 3, 5, 16] if small else [1, 3, 7, 33, 64]), label="D")
    K = data.draw(st.sampled_from([2, 3, 4, 5, 8]), label="K")
    seed = data.draw(seeds, label="seed")
    bias = data.draw(st.booleans(), label="bias")
    act = data.draw(st.sampled_from([None, "silu"]), label="activation")
    layout = data.draw(st.sampled_from(CONV_LAYOUTS), label="layout")
    pool_dtype = data.draw(st.sampled_from([dtype, torch.float32]), label="pool_dtype")
    extra = data.draw(st.integers(0, 3), label="extra_slots")
    rng = random.Random(seed)
    S = len(lengths)
    slots = choose_slots(S, S + extra, rng, pad_prob=0.25)
    g = gen(seed)
    T = sum(lengths)
    x = randn(g, (T, D), dtype, device)
    w = randn(g, (D, K), dtype, device, scale=0.5)
    b = randn(g, (D,), dtype, device) if bias else None
    pool = make_pool(S + extra, (D, K - 1), pool_dtype, device, layout=layout, seed=seed)
    hi = torch.tensor([rng.random() < 0.7 for _ in range(S)], dtype=torch.bool, device=device)
    args = [x, w, b, pool, cu_seqlens_from(lengths, device, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32, device=device), hi]
    shapes = dict(x=x, weight=w, conv_states=pool, lengths=lengths, layout=layout)
    return args, dict(activation=act), slots, token_mask(lengths, slots), shapes, seed, layout


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_conv_varlen_matches_oracle(impl, device, check, dtype, data):
    """causal_conv1d_varlen on packed batches (empty, length-1 and odd sequences, pads, K in 2..8, odd D,
    contiguous or page-major pools, pool in the activation dtype or fp32) matches the float64 oracle on
    live tokens and live slots; pad and unnamed slots stay bitwise unchanged; `out=` is written and
    returned; the same call on a pool in another layout (contiguous, page-major, vLLM's channels-last
    slots) passes the same checks."""
    require(impl, "causal_conv1d_varlen", dtype)
    args, kw, slots, mask, shapes, seed, layout = _conv_case(data, impl, device, dtype, interp_small(device, impl))
    alt = other_layout_pool(args[3], layout, seed, CONV_LAYOUTS)
    run_pool_case(check, impl, "causal_conv1d_varlen", args, kw, pool_pos=3, live_slots=slots, y_mask=mask,
                  dtype=dtype, seed=seed, shapes=shapes, alt_pools=(alt,))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_conv_update_matches_oracle(impl, device, check, dtype, data):
    """causal_conv1d_update on a decode batch (pads, odd D, K in 2..8, strided pools: page-major and vLLM's
    channels-last slots) matches the oracle on live rows and slots; other slots are bitwise unchanged;
    `out=` is honoured; the same call on a pool in another layout passes the same checks."""
    require(impl, "causal_conv1d_update", dtype)
    small = interp_small(device, impl)
    Bsz = data.draw(st.integers(1, 4 if small else 9), label="batch")
    D = data.draw(st.sampled_from([1, 3, 5, 16] if small else [1, 3, 7, 33, 64]), label="D")
    K = data.draw(st.sampled_from([2, 3, 4, 5, 8]), label="K")
    seed = data.draw(seeds, label="seed")
    layout = data.draw(st.sampled_from(CONV_LAYOUTS), label="layout")
    pool_dtype = data.draw(st.sampled_from([dtype, torch.float32]), label="pool_dtype")
    bias = data.draw(st.booleans(), label="bias")
    act = data.draw(st.sampled_from([None, "silu"]), label="activation")
    rng = random.Random(seed)
    num_slots = Bsz + data.draw(st.integers(0, 3), label="extra")
    slots = choose_slots(Bsz, num_slots, rng, pad_prob=0.25)
    g = gen(seed)
    x = randn(g, (Bsz, D), dtype, device)
    w = randn(g, (D, K), dtype, device, scale=0.5)
    b = randn(g, (D,), dtype, device) if bias else None
    pool = make_pool(num_slots, (D, K - 1), pool_dtype, device, layout=layout, seed=seed)
    idx = torch.tensor(slots, dtype=torch.int64 if seed % 2 else torch.int32, device=device)
    mask = torch.tensor([s >= 0 for s in slots])
    run_pool_case(check, impl, "causal_conv1d_update", [x, pool, w, b, idx], dict(activation=act), pool_pos=1,
                  live_slots=slots, y_mask=mask, dtype=dtype, seed=seed,
                  shapes=dict(x=x, weight=w, conv_states=pool, layout=layout),
                  alt_pools=(other_layout_pool(pool, layout, seed, CONV_LAYOUTS),))


def _channels_last_cases(device, dtype=torch.float32, layout="channels_last"):
    """One decode and one prefill case (pads, a slot the batch does not name, a sequence without an initial
    window, one shorter than K-1) on conv pools in `layout`: (op, args, kwargs, pool_pos, slots, y_mask)."""
    D, K, g = 5, 4, gen(11)
    w = randn(g, (D, K), dtype, device, scale=0.5)
    b = randn(g, (D,), dtype, device)
    pool = make_pool(5, (D, K - 1), torch.float32, device, layout=layout, seed=3)
    slots = [3, -1, 0]
    upd = ("causal_conv1d_update", [randn(g, (3, D), dtype, device), pool, w, b,
                                    torch.tensor(slots, dtype=torch.int32, device=device)],
           dict(activation="silu"), 1, slots, torch.tensor([s >= 0 for s in slots]))
    lengths, vslots = [6, 2, 3], [4, 1, -1]
    pool2 = make_pool(5, (D, K - 1), torch.float32, device, layout=layout, seed=4)
    var = ("causal_conv1d_varlen", [randn(g, (sum(lengths), D), dtype, device), w, b, pool2,
                                    cu_seqlens_from(lengths, device, dtype=torch.int32),
                                    torch.tensor(vslots, dtype=torch.int32, device=device),
                                    torch.tensor([False, True, True], device=device)],
           dict(activation=None), 3, vslots, token_mask(lengths, vslots))
    return [upd, var]


def test_conv_pools_with_vllm_channels_last_slots(impl, device, check):
    """vLLM stores each conv-state slot channels-last, (K-1, conv_dim) in memory, and hands kernels the
    transposed view (conv_dim, K-1) with strides (page, 1, conv_dim). Both conv ops honour it: outputs and
    live slots match the oracle, other slots stay bitwise unchanged."""
    for op, args, kw, pos, slots, mask in _channels_last_cases(device):
        require(impl, op, torch.float32, device)
        D, K1 = args[pos].shape[1:]
        assert args[pos].stride()[1:] == (1, D) and args[pos].stride(0) >= D * K1, args[pos].stride()
        run_pool_case(check, impl, op, args, kw, pool_pos=pos, live_slots=slots, y_mask=mask, dtype=torch.float32,
                      seed=11, shapes=dict(layout="channels_last", conv_states=list(args[pos].shape)))


def test_row_major_conv_slots_are_caught_only_by_channels_last_pools(check):
    """The planted conv ops that assume a row-major slot (`harness.selftest.row_major_conv_slots`, also the
    selftest variant `conv_row_major_slots`) pass every check on contiguous and page-major pools and fail
    on vLLM's channels-last slots, for both the decode and the prefill op."""
    from harness.impls import registry
    from harness.selftest import row_major_conv_slots
    broken = row_major_conv_slots(registry.get("torch"))
    for layout in ("contiguous", "page_major"):
        for op, args, kw, pos, slots, mask in _channels_last_cases("cpu", layout=layout):
            run_pool_case(check, broken, op, args, kw, pool_pos=pos, live_slots=slots, y_mask=mask,
                          dtype=torch.float32)
    for op, args, kw, pos, slots, mask in _channels_last_cases("cpu"):
        with pytest.raises(AssertionError, match=r"causal_conv1d_(update|varlen)\.(y|pool)"):
            run_pool_case(check, broken, op, args, kw, pool_pos=pos, live_slots=slots, y_mask=mask,
                          dtype=torch.float32)


@pytest.mark.gpu
def test_conv_varlen_offsets_past_2_31(impl, device, check):
    """Nightly, GPU: a packed input of T*D > 2^31 elements; the last sequence (whose elements sit past
    2^31) is computed right (int64 offsets): its outputs and final window match the oracle."""
    require(impl, "causal_conv1d_varlen", torch.bfloat16, device)
    require_nightly_gpu(device)
    D, K, tail = 65536, 4, 9
    T = (1 << 31) // D + 64
    g = gen(0)
    x = torch.empty((T, D), dtype=torch.bfloat16, device=device)
    x[:-tail] = 0.5
    x[-tail:] = randn(g, (tail, D), torch.bfloat16, device)
    w = randn(g, (D, K), torch.bfloat16, device)
    pool = make_pool(3, (D, K - 1), torch.bfloat16, device, seed=1)
    q = torch.tensor([0, T - tail, T], dtype=torch.int32, device=device)
    idx = torch.tensor([0, 2], dtype=torch.int32, device=device)
    hi = torch.tensor([False, True], device=device)
    y = impl.op("causal_conv1d_varlen")(x, w, None, pool, q, idx, hi, activation="silu")
    from harness.impls.reference_impl import oracle
    small_pool = pool.clone()
    small_pool[2] = make_pool(3, (D, K - 1), torch.bfloat16, device, seed=1)[2]
    y_ref, p_ref = oracle("causal_conv1d_varlen", x[-tail:], w, None, small_pool[2:3],
                          torch.tensor([0, tail], device=device), torch.tensor([0], device=device),
                          torch.tensor([True], device=device), activation="silu")
    check.close("y[last sequence]", y[-tail:], y_ref, op="causal_conv1d_varlen", impl=impl.name,
                dtype=torch.bfloat16, shapes=dict(x=[T, D]), seed=0)
    check.close("pool[2]", pool[2], p_ref[0], op="causal_conv1d_varlen", impl=impl.name, dtype=torch.bfloat16,
                shapes=dict(x=[T, D]), seed=0)
