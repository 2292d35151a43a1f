"""The Triton kernels' index arithmetic: int32 while every offset they address fits, int64 past 2^31 elements
(bug class 12). `harness.impls.triton._common.max_offset` / `index_type` decide it from the tensors' sizes
and strides; here they run on meta tensors (sizes without memory) of the sizes the nightly GPU tests
allocate (`test_*_offsets_past_2_31`), so the choice is checked on every machine, in milliseconds."""
import pytest
import torch

_common = pytest.importorskip("harness.impls.triton._common", reason="triton is not installed")
tl = pytest.importorskip("triton.language", reason="triton is not installed")

LIMIT = 2 ** 31
MARGIN = 1 << 20  # index_type's default margin


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_max_offset_is_the_sum_of_extent_times_stride():
    """The largest offset from the base pointer: sum((size - 1) * |stride|), strides included (a transposed
    or page-major view reaches further than its numel); an int is a contiguous buffer of that many elements."""
    t = meta(5, 7)
    assert _common.max_offset(t) == 4 * 7 + 6
    assert _common.max_offset(t.t()) == 4 * 7 + 6
    page = torch.empty((3, 100), device="meta").as_strided((3, 4, 5), (100, 5, 1))
    assert _common.max_offset(page) == 2 * 100 + 3 * 5 + 4
    assert _common.max_offset(None, meta(0, 9), 17) == 17
    assert _common.max_offset(meta(2, 3), 5) == 5


def test_index_type_switches_to_int64_at_2_31():
    """int32 exactly while the largest offset plus the margin stays below 2^31, int64 from there on."""
    below = LIMIT - MARGIN - 1
    assert _common.index_type(below) == tl.int32
    assert _common.index_type(below + 1) == tl.int64
    assert _common.index_type(meta(1 << 16, 1 << 15)) == tl.int64  # 2^31 elements
    assert _common.index_type(meta(1 << 16, 1 << 14)) == tl.int32  # 2^30


@pytest.mark.parametrize("case", ["selective_scan", "conv_varlen", "state_update", "ssd", "wide"])
def test_index_type_of_the_nightly_offset_shapes(case):
    """The tensors of the nightly `*_offsets_past_2_31` tests (and one of 2^33 elements) select int64 index
    math; the same calls with a few hundred tokens keep int32."""
    if case == "selective_scan":  # test_selective_scan_offsets_past_2_31: u, delta (T, Dm) with T * Dm > 2^31
        Dm, N = 8192, 4
        big = [meta((LIMIT // Dm) + 64, Dm), meta(8, Dm, N, dtype=torch.float32)]
        small = [meta(300, Dm), meta(8, Dm, N, dtype=torch.float32)]
    elif case == "conv_varlen":  # test_conv_varlen_offsets_past_2_31: x (T, D), D = 65536
        D = 65536
        big, small = [meta(LIMIT // D + 64, D), meta(3, D, 3)], [meta(300, D), meta(3, D, 3)]
    elif case == "state_update":  # a pool past 2^31 elements: slots (D, N), enough of them
        D, N = 4096, 128
        big = [meta(LIMIT // (D * N) + 2, D, N, dtype=torch.float32), meta(4, D)]
        small = [meta(8, D, N, dtype=torch.float32), meta(4, D)]
    elif case == "ssd":  # x (T, H, P) past 2^31
        H, P = 128, 64
        big, small = [meta(LIMIT // (H * P) + 8, H, P)], [meta(300, H, P)]
    else:
        big, small = [meta(1 << 17, 1 << 16)], [meta(1 << 10, 1 << 10)]
    assert _common.max_offset(*big) >= LIMIT
    assert _common.index_type(*big) == tl.int64, f"{case}: int32 offsets chosen for {_common.max_offset(*big)} elements"
    assert _common.index_type(*small) == tl.int32
