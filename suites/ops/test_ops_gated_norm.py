"""Op suite: gated_rms_norm, every implementation x dtype against the float64 oracle."""
import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import poison_
from harness.testing.optest import ALL_DTYPES, interp_small, randn, read_only_inputs, require
from reference.testing import gen
from harness.impls.reference_impl import oracle

DT_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]
OP = "gated_rms_norm"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DT_IDS)
@given(data=st.data())
def test_gated_norm_matches_oracle(impl, device, check, dtype, data):
    """Gated RMSNorm (T in 1..; D and group sizes non-power-of-two; one group, several, or one channel
    per group; z absent, gate before or after the norm; inputs of magnitude 1e-3..1e3 so eps matters
    or not) matches the float64 oracle; `out=` is written and returned; a strided (column-sliced) x
    gives the same result."""
    require(impl, OP, dtype)
    small = interp_small(device, impl)
    T = data.draw(st.integers(1, 5 if small else 17), label="T")
    D = data.draw(st.sampled_from([1, 3, 12, 48] if small else [1, 3, 12, 48, 96, 160]), label="D")
    gs = data.draw(st.sampled_from(sorted({None, 1, D} | {d for d in (3, 4, 16) if D % d == 0}, key=str)),
                   label="group_size")
    has_z = data.draw(st.booleans(), label="z")
    nbg = data.draw(st.booleans(), label="norm_before_gate")
    scale = data.draw(st.sampled_from([1e-3, 1.0, 1e3]), label="scale")
    eps = data.draw(st.sampled_from([1e-6, 1e-5]), label="eps")
    strided = data.draw(st.booleans(), label="strided_x")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = gen(seed)
    big = randn(g, (T, 2 * D), dtype, device, scale=scale)
    x = big[:, ::2] if strided else big[:, :D].contiguous()
    w = randn(g, (D,), dtype, device, shift=1.0, scale=0.2)
    z = randn(g, (T, D), dtype, device) if has_z else None
    out = poison_(torch.empty((T, D), dtype=dtype, device=device))
    y_ref, _ = oracle(OP, x, w, z, eps=eps, group_size=gs, norm_before_gate=nbg)
    y = read_only_inputs(OP, impl.op(OP))(x, w, z, eps=eps, group_size=gs, norm_before_gate=nbg, out=out)
    assert y is out, "gated_rms_norm: expected the `out=` tensor back"
    check.close(f"{OP}.y", y, y_ref, op=OP, impl=impl.name, dtype=dtype, seed=seed,
                shapes=dict(x=x, group_size=gs, z=has_z, norm_before_gate=nbg, strided=strided, scale=scale))
