"""Op suite: add_rms_norm (residual add + RMSNorm, the residual written in place), every implementation x dtype.

* Against the unfused sequence the engine runs per layer (the residual add in the residual's dtype, the cast to
  x's dtype, gated_rms_norm without a gate): bit for bit for the torch implementation, within the dtype's
  tolerance for the others, with the residual in float32 and in x's dtype.
* Against the float64 oracle: y and the new residual (`run_pool_case`: `out=` poisoned and returned, inputs but
  the residual unchanged).
* Row-strided and transposed views of x and the residual (the residual's buffer outside the view untouched),
  D not a power of two, T = 0.
"""
import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import assert_bitwise_equal, poison_
from harness.testing.optest import ALL_DTYPES, coarser, interp_small, randn, require, run_pool_case
from reference.testing import gen

OP = "add_rms_norm"
DT_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]
RESIDUALS = ("float32", "x")  # the residual's dtype: float32 (an engine's residual_in_fp32) or x's
BITWISE = ("torch",)  # implementations whose result is the unfused sequence's bit for bit
SCALES = (1e-2, 1.0, 1e2)


def residual_dtype(which: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if which == "x" else torch.float32


def draw_case(data, device, impl, dtype, which):
    """(T, D, eps, seed, x, residual, weight): T from 0, D not only powers of two, inputs of magnitude `scale`
    (the residual 4x x's, as a stream that grows over the layers)."""
    small = interp_small(device, impl)
    T = data.draw(st.integers(0, 4 if small else 17), label="T")
    D = data.draw(st.sampled_from([1, 6, 100] if small else [1, 6, 100, 130, 512]), label="D")
    scale = data.draw(st.sampled_from(SCALES), label="scale")
    eps = data.draw(st.sampled_from([1e-6, 1e-5]), label="eps")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = gen(seed)
    x = randn(g, (T, D), dtype, device, scale=scale)
    residual = randn(g, (T, D), residual_dtype(which, dtype), device, scale=4 * scale)
    weight = randn(g, (D,), dtype, device, shift=1.0, scale=0.2)
    return T, D, eps, seed, x, residual, weight


def engine_sequence(impl, x, residual, weight, eps):
    """The three steps the fused op replaces in the engine's forward (harness/engine/runner.py): the residual add
    in the residual's dtype (one add when that dtype is the promoted one, else x cast first), the residual cast
    to x's dtype, gated_rms_norm of `impl` with no gate. Returns (y, new residual); `residual` is not written."""
    if torch.promote_types(residual.dtype, x.dtype) == residual.dtype:
        r = residual + x
    else:
        r = residual + x.to(residual.dtype)
    h = r if r.dtype == x.dtype else r.to(x.dtype)
    return impl.op("gated_rms_norm")(h.contiguous(), weight, None, eps=eps), r


@pytest.mark.parametrize("which", RESIDUALS, ids=[f"residual-{w}" for w in RESIDUALS])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=DT_IDS[:3])
@given(data=st.data())
def test_add_rms_norm_is_the_engine_sequence(impl, device, check, dtype, which, data):
    """y and the new residual equal the engine's unfused residual add, cast and gated_rms_norm (z None) with
    the same implementation's norm: bit for bit for torch, within the dtype's tolerance otherwise."""
    require(impl, OP, dtype)
    require(impl, "gated_rms_norm", dtype)
    T, D, eps, seed, x, residual, weight = draw_case(data, device, impl, dtype, which)
    y_seq, r_seq = engine_sequence(impl, x, residual, weight, eps)
    y = impl.op(OP)(x, residual, weight, eps=eps)
    shapes = dict(x=x, residual=residual.dtype, eps=eps)
    if impl.name in BITWISE:
        assert_bitwise_equal(f"{OP}.residual vs residual + x", residual, r_seq, f"seed {seed}, {shapes}")
        assert_bitwise_equal(f"{OP}.y vs gated_rms_norm(residual + x)", y, y_seq, f"seed {seed}, {shapes}")
        return
    check.close(f"{OP}.residual vs residual + x", residual, r_seq, op=OP, impl=impl, dtype=residual.dtype,
                seed=seed, shapes=shapes)
    check.close(f"{OP}.y vs gated_rms_norm(residual + x)", y, y_seq, op=OP, impl=impl, dtype=dtype, seed=seed,
                shapes=shapes)


@pytest.mark.parametrize("which", RESIDUALS, ids=[f"residual-{w}" for w in RESIDUALS])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_add_rms_norm_matches_oracle(impl, device, check, dtype, which, data):
    """y and the residual written in place match the float64 oracle; `out=` (poisoned) is written and returned;
    x and weight are left unchanged. y is normalised from the stored residual: judged at the coarser of x's
    and the residual's precision (a float32 residual under float64 x)."""
    require(impl, OP, dtype)
    T, D, eps, seed, x, residual, weight = draw_case(data, device, impl, dtype, which)
    run_pool_case(check, impl, OP, [x, residual, weight], dict(eps=eps), pool_pos=1, live_slots=range(T),
                  y_mask=None, dtype=coarser(dtype, residual.dtype), seed=seed,
                  shapes=dict(x=x, residual=residual.dtype, eps=eps))


def _row_strided(t: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): `t`'s values in a view of a NaN buffer of rows 2 * D + 1 long, `offset` elements in."""
    T, D = t.shape
    buf = torch.full((T, 2 * D + 1), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:, offset:offset + D]
    view.copy_(t)
    return view, buf


def _transposed(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): `t`'s values in the transpose of a (D, T) buffer (no unit stride along D)."""
    buf = torch.full(tuple(reversed(t.shape)), float("nan"), dtype=t.dtype, device=t.device)
    view = buf.t()
    view.copy_(t)
    return view, buf


LAYOUTS = {"rows": _row_strided, "transposed": lambda t, offset: _transposed(t)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("which", RESIDUALS, ids=[f"residual-{w}" for w in RESIDUALS])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=DT_IDS[:2])
@given(data=st.data())
def test_add_rms_norm_strided_views(impl, device, check, dtype, which, layout, data):
    """x and the residual as strided views (rows of a wider buffer, x and the residual at different offsets; or
    transposed buffers) give the contiguous call's y and residual; the residual's buffer outside the view is
    bitwise unchanged (no write past a row's D channels)."""
    require(impl, OP, dtype)
    T, D, eps, seed, x, residual, weight = draw_case(data, device, impl, dtype, which)
    make = LAYOUTS[layout]
    xs, _ = make(x, 0)
    rs, buf = make(residual, 1)
    before = buf.clone()
    y = impl.op(OP)(x, residual, weight, eps=eps)
    ys = impl.op(OP)(xs, rs, weight, eps=eps)
    shapes = dict(x=x, residual=residual.dtype, layout=layout, strides=(xs.stride(), rs.stride()))
    check.close(f"{OP}.y (strided x, residual)", ys, y, op=OP, impl=impl, dtype=dtype, seed=seed, shapes=shapes)
    check.close(f"{OP}.residual (strided)", rs, residual, op=OP, impl=impl, dtype=residual.dtype, seed=seed,
                shapes=shapes)
    outside = torch.ones_like(buf, dtype=torch.bool)
    (outside[:, 1:1 + D] if layout == "rows" else outside).fill_(False)
    assert_bitwise_equal(f"{OP}: the residual's buffer outside the view", buf[outside], before[outside])


@pytest.mark.parametrize("D", [1, 5, 100])
def test_add_rms_norm_no_tokens(impl, device, D):
    """T = 0: y is (0, D) in x's dtype, `out=` is returned, nothing else is touched; with D not a power of two."""
    require(impl, OP, torch.float32)
    x = torch.zeros((0, D), device=device)
    residual = torch.zeros((0, D), device=device)
    weight = torch.ones(D, device=device)
    y = impl.op(OP)(x, residual, weight, eps=1e-6)
    assert y.shape == (0, D) and y.dtype == x.dtype, f"{OP}: T = 0 gave {tuple(y.shape)} {y.dtype}"
    out = poison_(torch.empty((0, D), device=device))
    assert impl.op(OP)(x, residual, weight, eps=1e-6, out=out) is out, f"{OP}: expected the `out=` tensor back"
