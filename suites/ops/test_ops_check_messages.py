"""What the op suites' checks say when they fail: the pad-row check names the output, the row and its value;
a failed comparison names the tolerance it used and why (the dtype's policy, a widening by the check, or TF32
matmul for fp32 inputs). Runs on the CPU, independent of --impl / --device."""
import re
from types import SimpleNamespace

import pytest
import torch

from harness.ops import PAD_SLOT_ID
from harness.testing import assert_pad_rows_zero, pad_rows
from harness.testing.checker import Checker
from harness.testing.checks import Tolerance, compare, describe_tolerance, tolerance_for


def _decode_args(slots):
    """selective_state_update's arguments (Mamba-1 layout, 3 channels, N = 2) for rows with `slots`."""
    B = len(slots)
    return [torch.zeros(4, 3, 2), torch.zeros(B, 3), torch.zeros(B, 3), torch.zeros(3, 2), torch.zeros(B, 1, 2),
            torch.zeros(B, 1, 2), None, None, None, torch.tensor(slots)]


def test_pad_rows_of_each_op_form():
    """A decode op's pad rows are the rows with the pad id; a varlen op's are the tokens of pad requests (an
    empty pad request owns none); a multi-token decode's are the tokens of its padding rows; no pad: None."""
    assert pad_rows("selective_state_update", _decode_args([2, PAD_SLOT_ID, 0]), {}).tolist() == [False, True, False]
    assert pad_rows("selective_state_update", _decode_args([2, 1, 0]), {}) is None
    assert pad_rows("selective_state_update", _decode_args([2, 7, 0]), {"pad_slot_id": 7}).tolist() == \
        [False, True, False]
    qsl = torch.tensor([0, 2, 2, 5, 6])
    kw = dict(query_start_loc=qsl, cache_indices=torch.tensor([PAD_SLOT_ID, PAD_SLOT_ID, 1, PAD_SLOT_ID]),
              conv_states=torch.zeros(3, 4, 2))
    assert pad_rows("causal_conv1d_varlen", [], kw).tolist() == [True, True, False, False, False, True]
    spec = dict(query_start_loc=torch.tensor([0, 2, 3]), conv_states=torch.zeros(6, 4, 2),
                conv_state_indices=torch.tensor([[1, PAD_SLOT_ID], [3, 4]]),
                num_accepted_tokens=torch.tensor([2, 1]))
    assert pad_rows("causal_conv1d_update_spec", [], spec).tolist() == [True, True, False]
    assert pad_rows("gated_rms_norm", [torch.zeros(2, 4)], {}) is None


@pytest.mark.parametrize("value", [float("nan"), 0.5, -2.0 ** -100])
def test_pad_row_check_names_the_row_and_its_value(value):
    y = torch.zeros(4, 3)
    y[2, 1] = value
    mask = torch.tensor([False, True, True, False])
    with pytest.raises(AssertionError, match=re.escape(f"op: pad rows of y must be zero: row 2 has {value!r}")):
        assert_pad_rows_zero("op", y, mask)
    y[2, 1] = 0.0
    y[0] = float("nan")  # a live row: not the pad check's business
    assert_pad_rows_zero("op", y, mask)
    y[1, 0] = -0.0
    assert_pad_rows_zero("op", y, mask)


def test_tolerance_is_explained():
    f32 = tolerance_for(torch.float32)
    assert describe_tolerance(f32, torch.float32) == "the float32 policy"
    assert describe_tolerance(tolerance_for(torch.bfloat16, 4.0), torch.bfloat16) == \
        "the bfloat16 policy widened 4x by the check"
    assert "a tolerance the check sets for float16" in describe_tolerance(Tolerance(1e-3, 1e-3, 1e-3), torch.float16)
    assert describe_tolerance(f32, torch.float32, tf32="peer").startswith("TF32 matmul for fp32 inputs: peer")


def _failing(check, impl, dtype=torch.float32, tol=None):
    a = torch.ones(8, dtype=dtype)
    with pytest.raises(AssertionError) as e:
        check.close("y", a * 1.5, a.double(), op="op", impl=impl, dtype=dtype, tol=tol)
    return str(e.value)


def test_failed_comparison_names_its_tolerance_and_why():
    """The message's tolerance line says why: the dtype's policy, the widening, or TF32 on a GPU for an
    implementation that multiplies fp32 in TF32 (on the CPU the same implementation is judged at fp32's)."""
    msg = _failing(Checker("t", "cpu"), "reference")
    assert "tolerance atol=0.002 rtol=0.002 ratio=0.0002 (the float32 policy)" in msg
    msg = _failing(Checker("t", "cpu"), "reference", torch.bfloat16, tolerance_for(torch.bfloat16, 2.0))
    assert "(the bfloat16 policy widened 2x by the check)" in msg
    tf32 = SimpleNamespace(name="peer", fp32_matmul="tf32")
    msg = _failing(Checker("t", "cuda:0"), tf32)
    assert "(TF32 matmul for fp32 inputs: peer multiplies fp32 in TF32" in msg
    assert "tolerance atol=0.03 rtol=0.03 ratio=0.005" in msg
    assert "(the float32 policy)" in _failing(Checker("t", "cpu"), tf32)


def test_engine_completion_keeps_the_tf32_judgement():
    """The engine completes an implementation's missing ops from torch ("fla+torch"): comparisons of that
    completed implementation still know its kernels multiply fp32 in TF32, by object or by name."""
    from harness.impls import registry
    from harness.scenarios import engine_impl
    fla = engine_impl(registry.get("fla"))
    assert fla.name == "fla+torch"
    for impl in (fla, fla.name):
        assert "TF32 matmul for fp32 inputs" in _failing(Checker("t", "cuda:0"), impl)


def test_compare_message_without_a_reason_is_unchanged():
    c = compare("y", torch.ones(2), torch.zeros(2, dtype=torch.float64), tolerance_for(torch.float32))
    assert not c.passed and c.why == ""
    assert "ratio=0.0002\n" in c.message() + "\n"
