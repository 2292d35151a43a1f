"""Op suite: selective_scan_varlen (Mamba-1 prefill over packed sequences), every implementation x
dtype against the float64 oracle."""
import random

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.optest import ALL_DTYPES, interp_small, other_layout_pool, rand, randn, require, require_nightly_gpu, run_pool_case, token_mask
from reference.testing import cu_seqlens_from, gen, seqlens
from harness.testing import LAYOUTS, choose_slots, make_pool

DT_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]
OP = "selective_scan_varlen"
seeds = st.integers(0, 2**31 - 1)


def _case(data, device, dtype, small):
    lengths = data.draw(seqlens(edge_lengths=True, max_seqs=3 if small else 5, max_len=12 if small else 40,
                                   max_total=24 if small else None), label="lengths")
    seed = data.draw(seeds, label="seed")
    stress = data.draw(st.booleans(), label="stress")
    Dm = data.draw(st.sampled_from([1, 3, 5, 16] if small else [1, 3, 5, 16, 33, 64]), label="Dm")
    N = data.draw(st.sampled_from([1, 3, 8] if small else [1, 3, 8, 16]), label="N")
    G = data.draw(st.sampled_from(sorted({1, 2, Dm} & {d for d in range(1, Dm + 1) if Dm % d == 0})), label="G")
    softplus = data.draw(st.booleans(), label="delta_softplus")
    has_D, has_z, has_bias = (data.draw(st.booleans(), label=k) for k in ("D", "z", "delta_bias"))
    layout = data.draw(st.sampled_from(LAYOUTS), label="pool_layout")
    wide = [torch.float32, dtype] if dtype != torch.float64 else [dtype]
    pool_dtype = data.draw(st.sampled_from(wide), label="pool_dtype")
    extra = data.draw(st.integers(0, 3), label="extra")
    S, T = len(lengths), sum(lengths)
    rng = random.Random(seed)
    slots = choose_slots(S, S + extra, rng, pad_prob=0.25)
    g = gen(seed)
    # realistic: dt = softplus(randn - 4), A = -exp(rand); stress: |A| up to e^4 and dt up to ~10
    A = -torch.exp(rand(g, (Dm, N), torch.float32, "cpu", 0.0, 4.0 if stress else 1.0)).to(device)
    raw = randn(g, (T, Dm), torch.float32, "cpu", scale=3.0 if stress else 1.0, shift=1.0 if stress else -4.0)
    delta = (raw if softplus else torch.nn.functional.softplus(raw)).to(device, dtype)
    u = randn(g, (T, Dm), dtype, device)
    B = randn(g, (T, G, N), dtype, device)
    C = randn(g, (T, G, N), dtype, device)
    D = randn(g, (Dm,), torch.float32, device) if has_D else None
    z = randn(g, (T, Dm), dtype, device) if has_z else None
    # without softplus a negative bias could make dt < 0 (exponential growth): keep it >= 0 then
    db = (randn(g, (Dm,), torch.float32, device, scale=0.5) if softplus
          else rand(g, (Dm,), torch.float32, device, 0.0, 0.1)) if has_bias else None
    pool = make_pool(S + extra, (Dm, N), pool_dtype, device, layout=layout, seed=seed)
    hi = torch.tensor([rng.random() < 0.7 for _ in range(S)], dtype=torch.bool, device=device)
    idx = torch.tensor(slots, dtype=torch.int64 if seed % 2 else torch.int32, device=device)
    args = [u, delta, A, B, C, D, z, db, pool, cu_seqlens_from(lengths, device, dtype=torch.int32), idx, hi]
    shapes = dict(u=u, A=A, B=B, lengths=lengths, layout=layout, stress=stress, pool_dtype=str(pool_dtype))
    return args, dict(delta_softplus=softplus), slots, token_mask(lengths, slots), shapes, seed, layout


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_selective_scan_matches_oracle(impl, device, check, dtype, data):
    """Mamba-1 prefill over packed batches (empty, length-1, odd lengths; several requests; pads;
    n_groups in {1, 2, Dm}; odd Dm and N; D, z, delta_bias and softplus on/off; realistic and stress
    inputs; fp32 or activation-dtype pools, contiguous or page-major) matches the float64 oracle on
    live tokens and live slots; pad/unnamed slots stay bitwise unchanged; `out=` is written and
    returned; the same call on a pool in the other layout passes the same checks. Lengths stay <= 40, where the
    dtype policies hold without widening."""
    require(impl, OP, dtype)
    args, kw, slots, mask, shapes, seed, lay = _case(data, device, dtype, interp_small(device, impl))
    alt = other_layout_pool(args[8], lay, seed)
    run_pool_case(check, impl, OP, args, kw, pool_pos=8, live_slots=slots, y_mask=mask, dtype=dtype,
                  seed=seed, shapes=shapes, alt_pools=(alt,))


@pytest.mark.gpu
def test_selective_scan_offsets_past_2_31(impl, device, check):
    """Nightly, GPU: packed inputs of T*Dm > 2^31 elements; the last sequence (past 2^31) matches the
    oracle run on it alone (int64 offsets), and so does its final state."""
    require(impl, OP, torch.bfloat16, device)
    require_nightly_gpu(device)
    Dm, N, tail = 8192, 4, 7
    T = (1 << 31) // Dm + 64
    g = gen(5)
    u = torch.zeros((T, Dm), dtype=torch.bfloat16, device=device)
    delta = torch.full((T, Dm), -4.0, dtype=torch.bfloat16, device=device)
    u[-tail:] = randn(g, (tail, Dm), torch.bfloat16, device)
    delta[-tail:] = randn(g, (tail, Dm), torch.bfloat16, device, shift=-4)
    A = -torch.exp(rand(g, (Dm, N), torch.float32, device))
    B = randn(g, (T, 1, N), torch.bfloat16, device)
    C = randn(g, (T, 1, N), torch.bfloat16, device)
    pool = make_pool(2, (Dm, N), torch.float32, device, seed=2)
    q = torch.tensor([0, T - tail, T], dtype=torch.int64, device=device)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=device)
    hi = torch.tensor([False, True], device=device)
    from harness.impls.reference_impl import oracle
    y_ref, p_ref = oracle(OP, u[-tail:], delta[-tail:], A, B[-tail:], C[-tail:], None, None, None, pool[1:2].clone(),
                          torch.tensor([0, tail], device=device), torch.tensor([0], device=device),
                          torch.tensor([True], device=device))
    y = impl.op(OP)(u, delta, A, B, C, None, None, None, pool, q, idx, hi)
    check.close("y[last sequence]", y[-tail:], y_ref, op=OP, impl=impl.name, dtype=torch.bfloat16,
                shapes=dict(u=[T, Dm]))
    check.close("pool[1]", pool[1], p_ref[0], op=OP, impl=impl.name, dtype=torch.float32, shapes=dict(u=[T, Dm]))
