"""Op suite: selective_state_update (decode) in both layouts, Mamba-1 (num_slots, Dm, N) and Mamba-2
(num_slots, H, P, N), every implementation x dtype against the float64 oracle."""
import math
import random

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.optest import ALL_DTYPES, interp_small, other_layout_pool, rand, randn, require, require_nightly_gpu, run_pool_case
from reference.testing import gen
from harness.testing import LAYOUTS, choose_slots, make_pool

DT_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]
OP = "selective_state_update"
seeds = st.integers(0, 2**31 - 1)


def _divisor_groups(n):
    return sorted({1, 2, n} & {d for d in range(1, n + 1) if n % d == 0})


def _case(data, device, dtype, small, layout_kind):
    seed = data.draw(seeds, label="seed")
    stress = data.draw(st.booleans(), label="stress")
    Bsz = data.draw(st.integers(1, 3 if small else 8), label="batch")
    num_slots = Bsz + data.draw(st.integers(0, 3), label="extra")
    rng = random.Random(seed)
    slots = choose_slots(Bsz, num_slots, rng, pad_prob=0.25)
    pool_layout = data.draw(st.sampled_from(LAYOUTS), label="pool_layout")
    # fp64 runs keep everything fp64 (the `reference` impl computes in its first float argument's dtype)
    wide = [torch.float32, dtype] if dtype != torch.float64 else [dtype]
    pool_dtype = data.draw(st.sampled_from(wide), label="pool_dtype")
    softplus = data.draw(st.booleans(), label="dt_softplus")
    has_bias = data.draw(st.booleans(), label="dt_bias")
    has_z = data.draw(st.booleans(), label="z")
    g = gen(seed)
    N = data.draw(st.sampled_from([1, 3, 8] if small else [1, 3, 8, 16, 24]), label="N")
    if layout_kind == "mamba2":
        H = data.draw(st.sampled_from([1, 2, 3, 4] if small else [1, 2, 3, 4, 6, 8]), label="H")
        P = data.draw(st.sampled_from([1, 3, 4, 8] if small else [1, 3, 4, 8, 17]), label="P")
        G = data.draw(st.sampled_from(_divisor_groups(H)), label="G")
        chans, slot_shape, xshape, dtshape = H, (H, P, N), (Bsz, H, P), (Bsz, H)
        Ashape = (H,)
        Dkind = data.draw(st.sampled_from(["none", "head", "head_dim"]), label="D")
        Dshape = None if Dkind == "none" else ((H,) if Dkind == "head" else (H, P))
    else:
        Dm = data.draw(st.sampled_from([1, 3, 5, 16] if small else [1, 3, 5, 16, 33, 64]), label="Dm")
        G = data.draw(st.sampled_from(_divisor_groups(Dm)), label="G")
        chans, slot_shape, xshape, dtshape = Dm, (Dm, N), (Bsz, Dm), (Bsz, Dm)
        Ashape = (Dm, N)
        Dshape = data.draw(st.sampled_from([None, (Dm,)]), label="D")
    # realistic: dt = softplus(randn - 4), A = -exp(rand); stress: |A| up to e^4, dt spread over the clamp limits
    A = -torch.exp(rand(g, Ashape, torch.float32, "cpu", 0.0, 4.0 if stress else 1.0))
    dt_limit = (1e-3, 0.1) if stress else (0.0, math.inf)
    raw = randn(g, dtshape, torch.float32, "cpu", scale=3.0 if stress else 1.0, shift=-4.0)
    dt = raw if softplus else torch.nn.functional.softplus(raw)
    if stress and not softplus:
        dt = dt * 10
    param_dtype = data.draw(st.sampled_from(wide), label="param_dtype")
    A = A.to(device, param_dtype)
    dt = dt.to(device, dtype)
    x = randn(g, xshape, dtype, device)
    B = randn(g, (Bsz, G, N), dtype, device)
    C = randn(g, (Bsz, G, N), dtype, device)
    D = randn(g, Dshape, param_dtype, device) if Dshape else None
    z = randn(g, xshape, dtype, device) if has_z else None
    dt_bias = randn(g, (chans,), param_dtype, device, scale=0.5) if has_bias else None
    pool = make_pool(num_slots, slot_shape, pool_dtype, device, layout=pool_layout, seed=seed)
    idx = torch.tensor(slots, dtype=torch.int64 if seed % 2 else torch.int32, device=device)
    args = [pool, x, dt, A, B, C, D, z, dt_bias, idx]
    kw = dict(dt_softplus=softplus, dt_limit=dt_limit)
    shapes = dict(state=pool, x=x, B=B, layout=pool_layout, stress=stress, pool_dtype=str(pool_dtype))
    mask = torch.tensor([s >= 0 for s in slots])
    return args, kw, slots, mask, shapes, seed, pool_layout, pool_dtype


@pytest.mark.parametrize("layout_kind", ["mamba1", "mamba2"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_state_update_matches_oracle(impl, device, check, dtype, layout_kind, data):
    """One decode step (pads, n_groups in {1, 2, H or Dm}, non-power-of-two sizes, D per head or per head
    dim, z, dt_bias, softplus on/off, realistic and stress inputs with dt clamped to dt_limit, fp32 or
    activation-dtype pools, contiguous or page-major) matches the float64 oracle on live rows and live
    slots; pad/unnamed slots stay bitwise unchanged; `out=` is written and returned; the same call on a pool
    in the other layout passes the same checks."""
    require(impl, OP, dtype)
    args, kw, slots, mask, shapes, seed, lay, pool_dtype = _case(data, device, dtype, interp_small(device, impl),
                                                                 layout_kind)
    alt = other_layout_pool(args[0], lay, seed)
    run_pool_case(check, impl, OP, args, kw, pool_pos=0, live_slots=slots, y_mask=mask, dtype=dtype,
                  seed=seed, shapes=shapes, alt_pools=(alt,))


@given(data=st.data())
def test_state_update_mamba2_head_dim_blocks_first(impl, device, check, data):
    """Our Mamba-2 layout kernel with its head-dim blocks on grid axis 0 (CONFIG m2_pfirst, a launch-sweep
    candidate) passes the checks above, at the full shape lists (P 17: two head-dim blocks also under the
    interpreter)."""
    if impl.name != "triton":
        pytest.skip("a launch setting of the triton implementation")
    from unittest import mock
    from harness.impls.triton import selective_state_update as M
    args, kw, slots, mask, shapes, seed, lay, pool_dtype = _case(data, device, torch.float32, False, "mamba2")
    with mock.patch.dict(M.CONFIG, {"m2_pfirst": 1}):
        run_pool_case(check, impl, OP, args, kw, pool_pos=0, live_slots=slots, y_mask=mask, dtype=torch.float32,
                      seed=seed, shapes=dict(shapes, m2_pfirst=1))


@pytest.mark.gpu
def test_state_update_offsets_past_2_31(impl, device, check):
    """Nightly, GPU: a Mamba-2 pool of more than 2^31 elements; updating the last slot (past 2^31) is
    right (int64 offsets) and the first slot stays bitwise unchanged."""
    require(impl, OP, torch.float32, device)
    require_nightly_gpu(device)
    H, P, N = 32, 64, 128
    slots = (1 << 31) // (H * P * N) + 2
    pool = torch.zeros((slots, H, P, N), dtype=torch.float32, device=device)
    g = gen(3)
    pool[-1] = randn(g, (H, P, N), torch.float32, device)
    first = pool[0].clone()
    x = randn(g, (1, H, P), torch.bfloat16, device)
    dt = randn(g, (1, H), torch.bfloat16, device, shift=-4)
    A = -torch.exp(rand(g, (H,), torch.float32, device))
    B = randn(g, (1, 1, N), torch.bfloat16, device)
    C = randn(g, (1, 1, N), torch.bfloat16, device)
    from harness.impls.reference_impl import oracle
    small = pool[-1:].clone()
    y_ref, p_ref = oracle(OP, small, x, dt, A, B, C, None, None, None, torch.tensor([0], device=device))
    y = impl.op(OP)(pool, x, dt, A, B, C, None, None, None, torch.tensor([slots - 1], device=device))
    check.close("y", y, y_ref, op=OP, impl=impl.name, dtype=torch.bfloat16, shapes=dict(state=list(pool.shape)))
    check.close("pool[last]", pool[-1], p_ref[0], op=OP, impl=impl.name, dtype=torch.float32,
                shapes=dict(state=list(pool.shape)))
    assert torch.equal(pool[0], first), "pool[0] changed although the batch names only the last slot"
