"""The validators' slot-id and offset checks at batch sizes on both sides of the list / numpy switch
(harness.ops._checks._NUMPY_FROM), on the device under test: out-of-range ids, duplicate live ids and pads
give the same verdicts and messages whatever the batch size, and a varlen op's offsets and slot ids read
together keep their errors' order (offsets first)."""
import pytest
import torch

from harness.ops import _checks as ck
from harness.ops import no_index_checks

SIZES = (3, ck._NUMPY_FROM - 1, ck._NUMPY_FROM, 300)


def _ids(n, device, dtype=torch.int32):
    return torch.arange(1, n + 1, dtype=dtype, device=device)


def _error(fn, *args, **kw) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    return str(e.value)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", (torch.int32, torch.int64))
def test_valid_ids_pass(n, dtype, device):
    idx = _ids(n, device, dtype)[torch.randperm(n, generator=torch.Generator().manual_seed(n)).to(device)]
    idx[::3] = -1  # pads may repeat
    ck.check_indices("idx", idx, n, n + 1, -1)
    idx[0] = 0  # slot 0 is a slot like any other when the pad id is -1
    ck.check_indices("idx", idx, n, n + 1, -1)


@pytest.mark.parametrize("n", SIZES)
def test_out_of_range_named_with_positions(n, device):
    idx = _ids(n, device)
    idx[1] = n + 1
    idx[-1] = -2
    msg = _error(ck.check_indices, "idx", idx, n, n + 1, -1)
    assert msg == (f"idx: expected slot ids in [0, {n + 1}) or pad_slot_id=-1, "
                   f"got [{n + 1}, -2] at positions [1, {n - 1}]")


@pytest.mark.parametrize("n", SIZES)
def test_duplicate_live_ids(n, device):
    idx = _ids(n, device)
    idx[0] = -1
    idx[-1] = idx[1]
    msg = _error(ck.check_indices, "idx", idx, n, n + 1, -1)
    assert msg == f"idx: expected distinct slot ids for live requests, got {idx.tolist()}"


@pytest.mark.parametrize("n", SIZES)
def test_pad_id_inside_the_pool(n, device):
    """A pad id that is also a slot number: its rows are pads, repeated freely, never out of range."""
    idx = _ids(n, device)
    idx[:2] = 0
    ck.check_indices("idx", idx, n, n + 1, 0)
    assert "distinct" in _error(ck.check_indices, "idx", idx, n, n + 1, -1)


@pytest.mark.parametrize("n", SIZES)
def test_offsets_and_ids_read_together(n, device):
    qsl = torch.arange(0, n + 1, dtype=torch.int32, device=device)
    idx = _ids(n, device, torch.int64)
    assert ck.check_qsl_indices(qsl, n, "cache_indices", idx, n + 1, -1) == n
    bad_idx = idx.clone()
    bad_idx[0] = n + 5
    assert "cache_indices: expected slot ids" in _error(ck.check_qsl_indices, qsl, n, "cache_indices", bad_idx,
                                                        n + 1, -1)
    bad_qsl = qsl.clone()
    bad_qsl[1] = n + 3  # decreasing after it: the offsets are named although the ids are bad as well
    msg = _error(ck.check_qsl_indices, bad_qsl, n, "cache_indices", bad_idx, n + 1, -1)
    assert msg == f"query_start_loc: expected non-decreasing offsets, got {bad_qsl.tolist()}"
    assert _error(ck.check_qsl_indices, qsl, n + 1, "cache_indices", idx, n + 1, -1) == \
        f"query_start_loc: expected to end at the token count {n + 1}, got {n}"
    with no_index_checks():  # the values are not read; the tensors' shapes and dtypes still are
        assert ck.check_qsl_indices(bad_qsl, n, "cache_indices", bad_idx, n + 1, -1) == n
        assert "cache_indices: expected 1 dims" in _error(ck.check_qsl_indices, qsl, n, "cache_indices",
                                                          idx[None], n + 1, -1)
