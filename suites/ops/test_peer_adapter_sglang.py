"""The SGLang adapter (harness/impls/adapters/sglang.py) on its own: what the op suites cannot show.

* On the CPU, where the `sglang` Impl does not run (its Triton entry points are CUDA-only): every op
  validates before anything else (bad input is a ValueError naming the argument, and nothing is written),
  and a valid call declines with a NotImplementedError naming sglang.
* On CUDA: the regression examples of the SGLang bugs in docs/findings.md (xfail(strict=True): they
  document the bug, and turn into failures once it is fixed).

Skipped where sglang is not importable (CI): `python scripts/peers_fetch.py sglang` and
`PYTHONPATH=$PWD/.peers/src`.
"""
import pytest
import torch

from harness.ops import SPECS
from harness.impls.adapters import sglang as adapter

_MISSING = adapter.unavailable_reason("sglang", *adapter.MODULES)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

OPS = {"causal_conv1d_varlen": adapter.causal_conv1d_varlen, "causal_conv1d_update": adapter.causal_conv1d_update,
       "selective_state_update": adapter.selective_state_update, "ssd_varlen": adapter.ssd_varlen,
       "gated_rms_norm": adapter.gated_rms_norm, "gated_delta_rule_varlen": adapter.gated_delta_rule_varlen,
       "gated_delta_rule_update": adapter.gated_delta_rule_update, "kda_varlen": adapter.kda_varlen,
       "kda_update": adapter.kda_update}


def _case(op, device="cpu", dtype=torch.float32, **shape):
    sp = SPECS[op]
    base = dict(sp.shapes["contract"][0])
    base.update(shape)
    kw = sp.inputs(base, dtype, device, torch.Generator().manual_seed(0))
    return sp, kw


def _call(op, sp, kw):
    return OPS[op](*[kw[a] for a in sp.args], **{k: kw[k] for k in sp.options if k in kw})


@pytest.mark.parametrize("op", sorted(OPS))
def test_cpu_bad_input_is_rejected_before_anything_is_written(op):
    """A slot id past the pool (or, without one, a weight of the wrong length) is a ValueError naming the
    argument, and the pool is unchanged: validation comes before the CUDA-only decline."""
    sp, kw = _case(op)
    if sp.index:
        n = kw[sp.pool].shape[0]
        kw[sp.index] = torch.full_like(kw[sp.index], n)
        arg = sp.index
    else:
        kw["weight"] = kw["weight"][:-1]
        arg = "weight"
    before = kw[sp.pool].clone() if sp.pool else None
    with pytest.raises(ValueError, match=rf"^{arg}"):
        _call(op, sp, kw)
    if sp.pool:
        assert torch.equal(kw[sp.pool], before)


@pytest.mark.parametrize("op", sorted(OPS))
def test_cpu_valid_call_declines_naming_sglang(op):
    """A valid call on CPU tensors declines (NotImplementedError naming sglang) and writes nothing."""
    sp, kw = _case(op)
    before = kw[sp.pool].clone() if sp.pool else None
    with pytest.raises(NotImplementedError, match=r"^sglang .*CUDA only"):
        _call(op, sp, kw)
    if sp.pool:
        assert torch.equal(kw[sp.pool], before)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the sglang Triton kernels run on CUDA only)")
    return "cuda"


def test_conv_width_above_five_declines():
    """The Triton causal conv keeps its window in named registers for widths 2..5: wider ones decline."""
    sp, kw = _case("causal_conv1d_update", K=6)
    with pytest.raises(NotImplementedError, match="kernel widths 2..5"):
        adapter._conv_width(kw["weight"])


@pytest.mark.xfail(strict=True, reason="sglang 0.5.23 causal_conv1d_triton: width 5 is accepted but the tap loop "
                   "covers widths 2-4 only (every tap uses the first window column); see docs/findings.md")
@pytest.mark.parametrize("op", ["causal_conv1d_varlen", "causal_conv1d_update"])
def test_conv_width_five_matches_reference(op):
    """Kernel width 5 (the contract admits 2..8) gives the reference's outputs and windows."""
    device = _cuda()
    sp, kw = _case(op, device=device, K=5)
    ref_kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    y = _call(op, sp, kw)
    y_ref = sp.reference(torch.float64, *[ref_kw[a] for a in sp.args],
                         **{k: ref_kw[k] for k in sp.options if k in ref_kw})
    torch.testing.assert_close(y.double(), y_ref.double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kw[sp.pool].double(), ref_kw[sp.pool].double(), rtol=1e-4, atol=1e-4)
