"""Mamba-2 SSD: the token-loop recurrence (`ssd_scan`) and the chunked form (`ssd_chunked`) are two
independent formulations of the same op; in float64 they must agree to 1e-10 relative error."""
import math

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness.testing.checks import Tolerance, tolerance_for
from reference.ssd import segsum, ssd_chunked, ssd_scan
from reference.testing import cu_seqlens_from, make_ssd_inputs, seqlens

TIGHT = Tolerance(atol=1e-11, rtol=1e-10, ratio=1e-10)

DT_LIMITS = [(0.0, math.inf), (0.005, 0.05), (0.0, 0.02)]


@st.composite
def ssd_cases(draw):
    lengths = draw(seqlens(min_seqs=1, max_seqs=3, min_len=0, max_len=20))
    H = draw(st.sampled_from([2, 4]))
    G = draw(st.sampled_from(sorted({1, 2, H})))
    return dict(
        lengths=lengths, H=H, G=G,
        P=draw(st.sampled_from([1, 3])), N=draw(st.sampled_from([1, 4])),
        chunk_size=draw(st.sampled_from([1, 2, 3, 5, 7, 8, 16, 64])),
        D=draw(st.sampled_from(["head", "head_dim", None])),
        z=draw(st.booleans()), initial_states=draw(st.booleans()), dt_bias=draw(st.booleans()),
        dt_softplus=draw(st.booleans()), dt_limit=draw(st.sampled_from(DT_LIMITS)),
        seed=draw(st.integers(0, 2**31 - 1)))


# Always-run examples: groups mapped to several heads, chunk sizes not dividing the lengths, empty sequences.
_EX = dict(P=3, N=4, z=True, initial_states=True, dt_bias=True, dt_softplus=True, seed=7)


@given(case=ssd_cases())
@example(case=dict(_EX, lengths=[5, 0, 13], H=4, G=2, chunk_size=4, D="head_dim", dt_limit=(0.005, 0.05)))
@example(case=dict(_EX, lengths=[17], H=4, G=1, chunk_size=3, D="head", dt_limit=(0.0, math.inf)))
@example(case=dict(_EX, lengths=[9, 11], H=2, G=2, chunk_size=64, D=None, dt_limit=(0.0, 0.02)))
def test_chunked_equals_scan_float64(case, check):
    """For any packed batch (empty sequences included), chunk size (dividing the lengths or not),
    n_groups in {1, 2, H}, D per head or per head x dim, with/without z, dt_bias, softplus, dt_limit and
    initial states: ssd_chunked's y and final states equal ssd_scan's to <= 1e-10 relative error."""
    c = case
    T = sum(c["lengths"])
    inp = make_ssd_inputs(T, c["H"], c["P"], c["N"], c["G"], seed=c["seed"],
                          cu_seqlens=cu_seqlens_from(c["lengths"]), initial_states=c["initial_states"],
                          D=c["D"], z=c["z"], dt_bias=c["dt_bias"], dt_softplus=c["dt_softplus"],
                          dt_limit=c["dt_limit"])
    y_ref, s_ref = ssd_scan(**inp)
    y, s = ssd_chunked(**inp, chunk_size=c["chunk_size"])
    shapes = {k: v for k, v in inp.items() if isinstance(v, torch.Tensor)}
    ctx = f"case={c}"
    check.close("y", y, y_ref, op="ssd", impl="reference", tol=TIGHT, shapes=shapes, seed=c["seed"], context=ctx)
    check.close("final_states", s, s_ref, op="ssd", impl="reference", tol=TIGHT, shapes=shapes, seed=c["seed"],
                context=ctx)


@given(chunk_size=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**31 - 1),
       log_scale=st.sampled_from([3.0, 6.0, 12.0]))
def test_chunked_strong_decay_is_finite_and_equal(chunk_size, seed, log_scale, check):
    """With decays so strong that exp(sum dt*A) underflows (dt*A down to -1e12 per token), the chunked form
    stays finite (masked segment sums give exact zeros, never inf*0) and still equals the recurrence."""
    inp = make_ssd_inputs(40, 2, 3, 4, 1, seed=seed, initial_states=True, cu_seqlens=[0, 15, 40])
    inp["A"] = inp["A"] * 10.0 ** log_scale
    inp["dt_softplus"], inp["dt_bias"] = False, None
    inp["dt"] = inp["dt"].abs() + 0.5
    y_ref, s_ref = ssd_scan(**inp)
    y, s = ssd_chunked(**inp, chunk_size=chunk_size)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    check.close("y", y, y_ref, op="ssd", impl="reference", tol=TIGHT, seed=seed)
    check.close("final_states", s, s_ref, op="ssd", impl="reference", tol=TIGHT, seed=seed)


@given(a=st.lists(st.floats(-50, 0, allow_nan=False), min_size=1, max_size=12))
def test_segsum_is_masked_segment_sum(a):
    """segsum(a)[i, j] = sum_{k=j+1..i} a[k] for i >= j (0 on the diagonal) and -inf above it, so that
    exp(segsum) is lower-triangular with exact zeros above the diagonal and ones on it."""
    t = torch.tensor(a, dtype=torch.float64)
    L = len(a)
    out = segsum(t)
    for i in range(L):
        for j in range(L):
            if i >= j:
                assert math.isclose(float(out[i, j]), sum(a[j + 1:i + 1]), rel_tol=1e-12, abs_tol=1e-12)
            else:
                assert out[i, j] == float("-inf")
    e = torch.exp(out)
    assert torch.equal(torch.triu(e, diagonal=1), torch.zeros(L, L, dtype=torch.float64))
    assert torch.equal(torch.diagonal(e), torch.ones(L, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_and_scan_in_low_precision_stay_near_float64(dtype, check):
    """Both formulations compute in the dtype they are given: in float32/bf16 the outputs keep that dtype
    and stay within the dtype's tolerance policy of the float64 result."""
    inp64 = make_ssd_inputs(24, 2, 4, 8, 2, seed=5, initial_states=True, cu_seqlens=[0, 9, 24])
    y64, s64 = ssd_scan(**inp64)
    inp = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in inp64.items()}
    for name, fn in (("scan", ssd_scan), ("chunked", lambda **kw: ssd_chunked(**kw, chunk_size=8))):
        y, s = fn(**inp)
        assert y.dtype == dtype and s.dtype == dtype
        # Inputs are rounded to `dtype` first, so widen the policy for a 24-token recurrence a little.
        tol = tolerance_for(dtype, scale=2.0)
        check.close(f"y[{name}]", y, y64, op="ssd", impl="reference", dtype=dtype, tol=tol, seed=5)
        check.close(f"final_states[{name}]", s, s64, op="ssd", impl="reference", dtype=dtype, tol=tol, seed=5)
