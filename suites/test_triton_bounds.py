"""The interpreter's bounds checks (harness.testing.triton_bounds): an access outside every tensor argument
fails before it is made, naming the kernel; masked-off addresses and any address inside an argument's storage
(a view's neighbours included) pass."""
import os

import pytest
import torch

from harness.testing import triton_bounds

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the bounds checks hook Triton's interpreter, which runs for --device cpu")


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x_ptr, y_ptr, shift, n, B: tl.constexpr, MASKED: tl.constexpr):
        o = tl.arange(0, B)
        m = o < n if MASKED else o < B
        v = tl.load(x_ptr + o + shift, mask=m, other=0.0)
        tl.store(y_ptr + o, v, mask=m)

    return _copy


def test_out_of_bounds_load_is_named():
    assert triton_bounds.install() is None
    copy = _kernels()
    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    copy[(1,)](x, y, 0, 8, B=8, MASKED=False)
    assert torch.equal(y, x)
    with pytest.raises(Exception, match=r"_copy: load of 2 element\(s\) outside every tensor argument's storage"):
        copy[(1,)](x, y, 2, 8, B=8, MASKED=False)  # reads x[8], x[9]


def test_masked_off_and_view_neighbours_pass():
    assert triton_bounds.install() is None
    copy = _kernels()
    base = torch.arange(16, dtype=torch.float32)
    x, y = base[4:8], torch.zeros(8)
    copy[(1,)](x, y, 2, 4, B=8, MASKED=True)  # x[2..5]: past the view, inside its storage
    assert y[:4].tolist() == [6.0, 7.0, 8.0, 9.0]
    copy[(1,)](torch.zeros(4), y, 0, 4, B=64, MASKED=True)  # 60 addresses past the end, all masked off
    assert y[:4].tolist() == [0.0] * 4


def test_out_of_bounds_store_is_caught_before_it_writes():
    assert triton_bounds.install() is None
    copy = _kernels()
    big = torch.zeros(64)
    x, y = torch.ones(8), big[:4].clone()
    with pytest.raises(Exception, match=r"store of 4 element\(s\)"):
        copy[(1,)](x, y, 0, 8, B=8, MASKED=False)
    assert big.sum().item() == 0.0
