"""Op suite: ssd_varlen (Mamba-2 SSD over packed varlen sequences), every implementation x dtype against
the float64 oracle (harness.impls.reference_impl.oracle), on hypothesis-generated batches.

Cases cover the bug classes of docs/bug-classes.md that live in this op: sequences starting
mid-chunk and several requests per batch (4, 5), exp overflow with large |A| (6), 1 < n_groups < H (7),
pad requests (9), dt handling: bias, softplus, dt_limit clamp (10), int64 offsets (12, nightly, GPU).
"""
import math
import random

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import assert_bitwise_equal, poison_
from harness.testing.optest import ALL_DTYPES, coarser, interp_small, tiled_seqlens, other_layout_pool, rand, randn, read_only_inputs, require, require_nightly_gpu, run_pool_case, token_mask
from reference.testing import cu_seqlens_from, gen
from harness.impls.reference_impl import oracle
from harness.testing import LAYOUTS, choose_slots, make_pool, strict_op

OP = "ssd_varlen"
DT_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]
seeds = st.integers(0, 2**31 - 1)


def _small(device) -> bool:
    """CPU cases stay tiny for every implementation (the Triton interpreter costs ms per program and
    loop step; the oracle is a per-token loop); GPU cases are larger."""
    return device.startswith("cpu")


def _dims(data, small):
    """(H, G, P, N, chunk): n_groups in {1, 2, H}; non-power-of-two P and N; chunks shorter than sequences."""
    if small:  # Triton interpreter on CPU: keep programs and loop steps few
        H = data.draw(st.sampled_from([2, 4]), label="H")
        P = data.draw(st.sampled_from([3, 5, 16]), label="P")
        N = data.draw(st.sampled_from([7, 16]), label="N")
        chunk = 16
    else:
        H = data.draw(st.sampled_from([2, 4, 6]), label="H")
        P = data.draw(st.sampled_from([3, 5, 16, 24, 64]), label="P")
        N = data.draw(st.sampled_from([7, 16, 33, 64]), label="N")
        chunk = data.draw(st.sampled_from([8, 16, 32, 64]), label="chunk")
    G = data.draw(st.sampled_from([1, 2, H]), label="G")
    return H, G, P, N, chunk


def ssd_case(data, device, dtype, small, *, impl=None, stress=None, layout=None, tail=False):
    """A drawn ssd_varlen call: (args, kwargs, slots, token mask, shapes, seed, layout). With `tail`,
    one more live request (1..) is appended after the drawn ones. Lengths are the usual ones or next to a
    multiple of the chunk size (and of `impl`'s declared tiles: `tiled_seqlens`); on CPU up to two chunks."""
    H, G, P, N, chunk = _dims(data, small)
    lengths = data.draw(tiled_seqlens(impl, OP, extra_tiles=(chunk,), max_seqs=3 if small else 5,
                                      max_len=20 if small else 150, tile_cap=2 * chunk + 1 if small else None,
                                      max_total=(30 if tail else 48) if small else None), label="lengths")
    if tail:
        lengths = lengths + [data.draw(st.integers(1, 18 if small else 200), label="tail_length")]
    seed = data.draw(seeds, label="seed")
    stress = data.draw(st.booleans(), label="stress") if stress is None else stress
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout") if layout is None else layout
    D_kind = data.draw(st.sampled_from([None, "head", "head_dim"]), label="D")
    has_z = data.draw(st.booleans(), label="z")
    has_bias = data.draw(st.booleans(), label="dt_bias")
    softplus = data.draw(st.booleans(), label="dt_softplus")
    pool_dtype = data.draw(st.sampled_from([torch.float32, dtype]), label="pool_dtype")
    extra = data.draw(st.integers(0, 2), label="extra_slots")
    rng = random.Random(seed)
    S = len(lengths)
    T = sum(lengths)
    slots = choose_slots(S, S + extra, rng, pad_prob=0.25)
    if tail and slots[-1] < 0:
        slots[-1] = max(s for s in range(S + extra) if s not in slots)
    g = gen(seed)
    x = randn(g, (T, H, P), dtype, device)
    B = randn(g, (T, G, N), dtype, device)
    C = randn(g, (T, G, N), dtype, device)
    if stress:
        # Large |A| (up to e^6 ~ 400) and dt pushed against both clamp limits.
        A = -torch.exp(rand(g, (H,), torch.float32, device, 0.0, 6.0))
        dt = randn(g, (T, H), dtype, device, scale=4.0)
        dt_limit = (0.01, 0.5)
    else:
        # Realistic: dt = softplus(randn - 4) before the bias; A = -exp(U(0, 1)).
        A = -torch.exp(rand(g, (H,), torch.float32, device))
        pre = randn(g, (T, H), torch.float32, device, shift=-4.0)
        dt = (pre if softplus else torch.nn.functional.softplus(pre)).to(dtype)
        dt_limit = data.draw(st.sampled_from([(0.0, math.inf), (1e-3, 0.1)]), label="dt_limit")
    bias = randn(g, (H,), torch.float32, device, scale=0.5) if has_bias else None
    D = {None: None, "head": lambda: randn(g, (H,), torch.float32, device),
         "head_dim": lambda: randn(g, (H, P), torch.float32, device)}[D_kind]
    D = D() if D is not None else None
    z = randn(g, (T, H, P), dtype, device) if has_z else None
    pool = make_pool(S + extra, (H, P, N), pool_dtype, device, layout=layout, seed=seed)
    hi = torch.tensor([rng.random() < 0.7 for _ in range(S)], dtype=torch.bool, device=device)
    args = [x, dt, A, B, C, chunk, D, z, bias, pool, cu_seqlens_from(lengths, device, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32, device=device), hi]
    kw = dict(dt_softplus=softplus, dt_limit=dt_limit)
    shapes = dict(x=x, B=B, ssm_states=pool, lengths=lengths, chunk_size=chunk, layout=layout, D=D_kind,
                  z=has_z, dt_bias=has_bias, dt_softplus=softplus, dt_limit=list(dt_limit), stress=stress)
    return args, kw, slots, token_mask(lengths, slots), shapes, seed, layout


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_ssd_varlen_matches_oracle(impl, device, check, dtype, data):
    """ssd_varlen on packed batches (several requests, empty / length-1 / odd lengths, sequences starting
    mid-chunk, chunks shorter than sequences, n_groups in {1, 2, H}, non-power-of-two P and N, D per head
    or per head x dim or none, z or not, dt_bias / softplus / dt_limit, initial states from a contiguous or
    page-major pool, pads; realistic or stress inputs with |A| up to ~400 and dt at the clamp limits)
    matches the float64 oracle on live tokens and live slots, with finite outputs; `out=` (NaN-poisoned)
    is written and returned; pad and unnamed slots stay bitwise unchanged; the same call on a pool of
    the other layout (same slot contents) matches the oracle the same way."""
    require(impl, OP, dtype)
    _matches_oracle(impl, device, check, dtype, data)


def _matches_oracle(impl, device, check, dtype, data):
    args, kw, slots, mask, shapes, seed, layout = ssd_case(data, device, dtype, _small(device), impl=impl)
    alt = other_layout_pool(args[9], layout, seed=seed)
    run_pool_case(check, impl, OP, args, kw, pool_pos=9, live_slots=slots, y_mask=mask, dtype=dtype, seed=seed,
                  shapes=shapes, alt_pools=(alt,))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_ssd_varlen_stress_is_finite(impl, device, check, dtype, data):
    """With large |A| (A = -exp(U(0, 6))) and dt clamped at both dt_limit ends, every live output and
    final state is finite (no exp overflow of segment sums, bug class 6) and equals the oracle."""
    require(impl, OP, dtype)
    args, kw, slots, mask, shapes, seed, _ = ssd_case(data, device, dtype, _small(device), impl=impl,
                                                      stress=True)
    y, pool = run_pool_case(check, impl, OP, args, kw, pool_pos=9, live_slots=slots, y_mask=mask,
                            dtype=dtype, seed=seed, shapes=shapes)
    assert bool(torch.isfinite(y[mask.to(y.device)]).all()), "ssd_varlen: non-finite output under stress inputs"
    live = [s for s in slots if s >= 0]
    assert bool(torch.isfinite(pool[live]).all()), "ssd_varlen: non-finite final state under stress inputs"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_ssd_varlen_batch_invariance(impl, device, check, dtype, data):
    """A request's output and final state do not depend on the requests packed before it: the last
    request run alone (its own initial state) equals the same request at the end of a packed batch,
    where it starts mid-chunk of the packed stream (bug classes 4 and 5)."""
    require(impl, OP, dtype)
    args, kw, slots, mask, shapes, seed, _ = ssd_case(data, device, dtype, _small(device), impl=impl,
                                                      stress=False, layout="contiguous", tail=True)
    lengths = shapes["lengths"]
    T0 = sum(lengths[:-1])
    last = slots[-1]
    op = read_only_inputs(OP, impl.op(OP))
    pool_all = args[9].clone()
    a_all = list(args)
    a_all[9] = pool_all
    y_all = op(*a_all, **kw)
    pool_one = args[9].clone()
    tok = slice(T0, None)
    a_one = [args[0][tok], args[1][tok], args[2], args[3][tok], args[4][tok], args[5], args[6],
             None if args[7] is None else args[7][tok], args[8], pool_one,
             torch.tensor([0, lengths[-1]], dtype=torch.int32, device=device),
             torch.tensor([last], dtype=torch.int32, device=device), args[12][-1:]]
    y_ref, pool_ref = oracle(OP, *a_one, **kw)
    y_one = op(*a_one, **kw)
    y_ref = y_ref.to(device)
    check.close(f"{OP}.y (last request in a batch)", y_all[tok], y_ref, op=OP, impl=impl.name, dtype=dtype,
                shapes=shapes, seed=seed)
    check.close(f"{OP}.y (last request alone)", y_one, y_ref, op=OP, impl=impl.name, dtype=dtype,
                shapes=shapes, seed=seed)
    pd = coarser(dtype, args[9].dtype)
    check.close(f"{OP}.pool[last] (in a batch)", pool_all[last], pool_ref[last].to(device), op=OP,
                impl=impl.name, dtype=pd, shapes=shapes, seed=seed)


@pytest.mark.parametrize("lengths,from_state", [([1], [True]), ([5], [True]), ([5, 6], [True, False]),
                                                 ([3, 6], [True, True]), ([13], [True]), ([8], [True])],
                         ids=["one-token", "first-chunk", "first-chunk+1", "both-from-state", "two-chunks",
                              "exactly-a-chunk"])
def test_ssd_varlen_state_of_a_sequence_ending_in_its_first_chunk(impl, device, check, lengths, from_state):
    """Regression (mamba_ssm 2.3.2, found by the engine oracle on the H200): a sequence that starts from a
    state and ends inside its first chunk must still carry that state into its final state. mamba_ssm's
    chunk_state_varlen adds the passed-in chunk state only when the sequence began before the chunk, so
    this final state lost the initial state's decayed contribution; y was right, so the error showed on
    the next decode step (chunked prefill of one request, then decode). Chunk 8; lengths 1-13. `one-token`
    is what test_ssd_varlen_matches_oracle shrank the failure to (mamba_ssm under the CPU interpreter)."""
    _final_states_match(impl, device, check, lengths, from_state)


@pytest.mark.parametrize("lengths", [[0, 5], [0, 0, 9]], ids=["one-empty", "two-empty"])
def test_ssd_varlen_empty_first_sequence(impl, device, check, lengths):
    """Regression (mamba_ssm 2.3.2, found under the CPU interpreter's bounds checks by
    test_ssd_varlen_batch_invariance): with an empty first sequence (cu_seqlens [0, 0, ...]) its
    `_chunk_state_varlen_kernel` reads dA_cumsum one element before the tensor (its chunk (end - 1) // chunk
    is 0, and the last-token offset end - 1 is -1). The outputs and states must still be the reference's and no
    kernel may read outside its arguments (on a GPU such a read goes unseen; the interpreter's checks fail it)."""
    _final_states_match(impl, device, check, lengths, [False] * len(lengths))


def _final_states_match(impl, device, check, lengths, from_state):
    """The op on sequences of `lengths` (chunk 8), each from its slot's state where `from_state`, against the
    reference: y, every request's final state, and an unnamed slot left bit for bit."""
    require(impl, OP, torch.float32)
    H, P, N, chunk = 2, 4, 4, 8
    g = torch.Generator().manual_seed(sum(lengths))
    T, S = sum(lengths), len(lengths)
    r = lambda *shape: torch.randn(*shape, generator=g)
    x, dt, B, Cm = r(T, H, P), torch.rand(T, H, generator=g) * 0.5, r(T, 1, N), r(T, 1, N)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.5, r(H), torch.rand(H, generator=g) * 0.1
    pool = r(S + 1, H, P, N)  # one slot more than requests: it must stay untouched
    qsl = cu_seqlens_from(lengths, "cpu", dtype=torch.int32)
    idx = torch.arange(S, dtype=torch.int32)
    hi = torch.tensor(from_state)
    args = [x, dt, A, B, Cm, chunk, D, None, dt_bias, pool, qsl, idx, hi]
    y_ref, pool_ref = oracle(OP, *args, dt_softplus=True)
    dev = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    y = read_only_inputs(OP, impl.op(OP))(*dev, dt_softplus=True)
    shapes = {"lengths": lengths, "has_initial_state": from_state, "chunk_size": chunk}
    check.close(f"{OP}.y", y, y_ref.to(device), op=OP, impl=impl.name, dtype=torch.float32, shapes=shapes)
    for i in range(S):
        check.close(f"{OP}.pool[{i}] (final state, lengths {lengths}, from state {from_state})", dev[9][i],
                    pool_ref[i].to(device), op=OP, impl=impl.name, dtype=torch.float32, shapes=shapes)
    assert_bitwise_equal(f"{OP}: slot {S} (no request)", dev[9][S], pool[S].to(device))


def test_ssd_varlen_rejects_bad_input(impl, device):
    """Bad input raises ValueError naming the argument before any kernel runs: C shaped unlike B, a
    slot id outside the pool, query_start_loc not ending at T, chunk_size 0, a wrongly shaped D."""
    require(impl, OP)
    T, H, P, N = 5, 2, 3, 4
    x = torch.randn(T, H, P, device=device)
    dt = torch.randn(T, H, device=device)
    A = -torch.ones(H, device=device)
    B = torch.randn(T, 1, N, device=device)
    pool = torch.zeros(2, H, P, N, device=device)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=device)
    idx = torch.tensor([0], dtype=torch.int32, device=device)
    hi = torch.tensor([False], device=device)
    op = strict_op(impl, OP)  # a NotImplementedError here fails: bad input must raise ValueError
    good = [x, dt, A, B, B.clone(), 4, None, None, None, pool, qsl, idx, hi]
    cases = {"C": (4, torch.randn(T, 1, N + 1, device=device)),
             "cache_indices": (11, torch.tensor([5], dtype=torch.int32, device=device)),
             "query_start_loc": (10, torch.tensor([0, T - 1], dtype=torch.int32, device=device)),
             "chunk_size": (5, 0),
             "D": (6, torch.ones(H + 1, device=device))}
    for name, (pos, bad) in cases.items():
        a = list(good)
        a[pos] = bad
        before = pool.clone()
        with pytest.raises(ValueError, match=name):
            op(*a)
        assert_bitwise_equal(f"pool after a rejected call ({name})", pool, before)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bfloat16"])
def test_ssd_varlen_int64_offsets(impl, device, check, dtype):
    """Past 2^31 elements of x (T*H*P > 2^31), the op is right (int64 offsets, bug class 12): a short
    request packed after a 2^31-element one gives the same output and final state as the oracle of that
    request alone. Nightly profile, GPU only."""
    require(impl, OP, dtype)
    require_nightly_gpu(device)
    if impl.name == "reference":
        pytest.skip("the plain per-token reference loop is far too slow for 2^23 tokens")
    H, P, N, G, chunk = 4, 64, 16, 1, 64
    T0 = (2**31) // (H * P) + 1000  # the first request alone crosses 2^31 elements
    L = 77
    T = T0 + L
    g = gen(0)
    x = torch.empty((T, H, P), dtype=dtype, device=device).normal_()
    dt = randn(g, (T, H), torch.float32, device, shift=-4.0).to(dtype)
    A = -torch.exp(rand(g, (H,), torch.float32, device))
    B = torch.empty((T, G, N), dtype=dtype, device=device).normal_()
    C = torch.empty((T, G, N), dtype=dtype, device=device).normal_()
    pool = make_pool(3, (H, P, N), torch.float32, device, seed=1)
    qsl = torch.tensor([0, T0, T], dtype=torch.int32, device=device)
    idx = torch.tensor([0, 2], dtype=torch.int32, device=device)
    hi = torch.tensor([False, True], device=device)
    out = poison_(torch.empty_like(x))
    tail_pool = pool.clone()
    y = impl.op(OP)(x, dt, A, B, C, chunk, None, None, None, pool, qsl, idx, hi, out=out)
    tok = slice(T0, T)
    y_ref, p_ref = oracle(OP, x[tok], dt[tok], A, B[tok], C[tok], chunk, None, None, None, tail_pool,
                          torch.tensor([0, L], dtype=torch.int32, device=device), idx[1:], hi[1:])
    check.close(f"{OP}.y past 2^31 elements", y[tok], y_ref.to(device), op=OP, impl=impl.name, dtype=dtype,
                shapes=dict(T=T, H=H, P=P, N=N), seed=0)
    check.close(f"{OP}.pool past 2^31 elements", pool[2], p_ref[2].to(device), op=OP, impl=impl.name,
                dtype=dtype, shapes=dict(T=T, H=H, P=P, N=N), seed=0)


DECAY_SIGN_CASES = {  # name: (A per head, dt_softplus, dt_limit, dt scale, dt shift)
    "A=+0.05": (0.05, True, (0.0, math.inf), 1.0, -1.0),
    "A=+0.5": (0.5, True, (0.0, math.inf), 1.0, -1.0),
    "negative-dt": (-0.5, False, (-1.0, math.inf), 0.5, 0.0),
    "A=-inf": (-math.inf, True, (0.0, math.inf), 1.0, -1.0),
}


@pytest.mark.parametrize("name", list(DECAY_SIGN_CASES))
def test_ssd_varlen_growing_and_wiping_decays(impl, device, check, name):
    """Regression: segment-sum exponents were clamped at 0 before exp (assuming dt*A <= 0), which the
    contract does not promise: A > 0, or dt < 0 allowed by a negative dt_limit low end, gave error ratios
    0.1-0.9 against the oracle; A = -inf (decay exp(-inf) = 0, the state wiped at every token) gave NaN
    from -inf - (-inf) and from 0 * -inf at chunk padding. Three requests (one mid-chunk start, one
    shorter than a chunk, two from a state), chunk 8, fp32, against the float64 oracle."""
    require(impl, OP, torch.float32)
    a, softplus, limit, scale, shift = DECAY_SIGN_CASES[name]
    H, P, N, chunk, lengths = 2, 3, 4, 8, [5, 13, 3]
    g = gen(11)
    T, S = sum(lengths), len(lengths)
    x, B, C = randn(g, (T, H, P), torch.float32, device), randn(g, (T, 1, N), torch.float32, device), \
        randn(g, (T, 1, N), torch.float32, device)
    dt = randn(g, (T, H), torch.float32, device, scale=scale, shift=shift)
    A = torch.full((H,), a, device=device)
    pool = make_pool(S + 1, (H, P, N), torch.float32, device, seed=3)
    args = [x, dt, A, B, C, chunk, randn(g, (H,), torch.float32, device), None, None, pool,
            cu_seqlens_from(lengths, device, dtype=torch.int32), torch.tensor([2, 0, 3], dtype=torch.int32, device=device),
            torch.tensor([True, False, True], device=device)]
    run_pool_case(check, impl, OP, args, dict(dt_softplus=softplus, dt_limit=limit), pool_pos=9,
                  live_slots=[2, 0, 3], y_mask=None, dtype=torch.float32, seed=11,
                  shapes=dict(case=name, lengths=lengths, chunk_size=chunk))
