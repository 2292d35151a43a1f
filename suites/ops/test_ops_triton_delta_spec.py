"""Kernel suite: the Triton speculative-decode kernel of the gated delta rule (harness/impls/triton/
delta_rule_update.py, ops `gated_delta_rule_update_spec` and `kda_update_spec`) on the edges of its layout,
against the float64 oracle.

A program (row, value head, block of value rows) reads its (BV, K) tile of the row's start slot once, then walks the
row's tokens, storing o and each position's state to that position's slot. Cases, in one batch
(harness.testing.spec_decode_rows): rows of every length from 0 to num_spec + 1, every start position, a row that
overwrites its own start slot (and one that starts past its tokens, leaving it untouched), pad entries inside a live
row's slot table, a padding row, a transposed int64 slot table, int32 and int64 query_start_loc. Around it:
contiguous and page-major pools; two value heads per key head (GDN); a key width that is not a power of two (K = 5);
a value width past one value block, the last one partial (V = 13: two blocks of 8 rows, the smallest block, which a
batch this small gets everywhere); l2norm on and off; q, k and v as views of one fused projection. Every slot the
batch does not write stays bit for bit as it was. Runs on the device under test (CPU through the Triton interpreter:
fp32 / fp64 there; fp32 and bf16 on a GPU).
"""
import pytest
import torch

from harness.testing import make_pool
from harness.testing.delta_cases import activations
from harness.testing.spec_decode_rows import ROWS, S, T, check_rows, kernel_dtypes, layout_of_rows, triton_impl

OPS = {"gdn": "gated_delta_rule_update_spec", "kda": "kda_update_spec"}
K, V = 5, 13


def _fused(*ts):
    """The tensors (T, heads, width) as views of one (T, total width + 3) buffer: rows strided past their width,
    NaN in the columns no view covers."""
    widths = [t[0].numel() for t in ts]
    buf = torch.full((ts[0].shape[0], sum(widths) + 3), float("nan"), dtype=ts[0].dtype, device=ts[0].device)
    views, at = [], 0
    for t, w in zip(ts, widths):
        view = buf[:, at:at + w].unflatten(1, t.shape[1:])
        view.copy_(t)
        views.append(view)
        at += w
    return views


@pytest.mark.parametrize("pool_layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("kind", list(OPS))
def test_delta_spec_layout_edges(device, kind, pool_layout):
    """The contiguous case: contiguous activations, no l2norm, int32 query_start_loc, fp32; the page-major one:
    q, k, v of one fused projection, l2norm, int64 query_start_loc, the device's other kernel dtype (fp64 under
    the interpreter, bf16 on a GPU). One dtype a case keeps the interpreter's runs short."""
    impl = triton_impl(device)
    op = OPS[kind]
    Hk, Hv = (1, 2) if kind == "gdn" else (2, 2)
    strided = pool_layout == "page_major"
    seed = int(strided)
    dtype = kernel_dtypes(device)[strided]
    pd = torch.float64 if dtype == torch.float64 else torch.float32
    num_slots = len(ROWS) * S + 3
    qsl, tab, acc, table, qs = layout_of_rows(device, num_slots, seed,
                                              qsl_dtype=torch.int64 if strided else torch.int32)
    q, k, v, g, beta = activations(kind, seed, T, Hk, Hv, K, V, dtype, device)
    if strided:
        q, k, v = _fused(q, k, v)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta,
              ssm_states=make_pool(num_slots, (Hv, V, K), pd, device, layout=pool_layout, seed=seed),
              query_start_loc=qsl, state_indices=tab, num_accepted_tokens=acc, use_qk_l2norm=strided)
    check_rows(impl, op, kw, table, qs, dtype, f"triton {op} {dtype} {pool_layout} l2norm={strided}",
               out_like="v")
