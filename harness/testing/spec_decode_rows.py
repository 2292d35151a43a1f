"""The speculative-decode batch the Triton kernel suites of the multi-token decode ops share
(suites/ops/test_ops_triton_spec_decode.py, suites/ops/test_ops_triton_delta_spec.py), and its check against the
float64 oracle.

`ROWS` covers the edges of the layout (reference.spec_decode) in one batch: rows of every length from 0 to
num_spec + 1, every start position, a row that overwrites its own start slot (and one that starts past its
tokens, leaving its start slot untouched), pad entries inside a live row's slot table, and a padding row (a
start slot that is the pad id). `layout_of_rows` lays it out with a transposed (non-contiguous) int64 slot
table whose slot ids are drawn without repetition from the pool; `check_rows` runs an op on it into a
NaN-poisoned `out=` and judges its outputs, the slots it writes and every slot it must leave bit for bit
unchanged. `triton_impl` and `kernel_dtypes`: the implementation under test on the suite's device (CPU through
the Triton interpreter) and the dtypes it runs there.
"""
from __future__ import annotations

import pytest
import torch

from harness.impls.reference_impl import oracle
from harness.ops import PAD_SLOT_ID, SPECS
from harness.testing.checks import assert_bitwise_equal, compare, poison_, tolerance_for
from harness.testing.optest import check_pad_rows

# rows: (token count, num_accepted_tokens, pad positions in the row's slots, padding row: start slot pad)
NUM_SPEC = 3
S = NUM_SPEC + 1
ROWS = [(4, 1, (), False), (2, 3, (), False), (0, 2, (), False), (3, 2, (1,), False), (1, 4, (), False),
        (4, 4, (2,), False), (2, 2, (1,), True), (3, 1, (), False)]
T = sum(r[0] for r in ROWS)


def triton_impl(device: str):
    """The `triton` implementation, or a skip where Triton cannot run on `device`."""
    from harness.impls.registry import get
    from harness.impls.triton._common import has_gpu, interpreting
    if device.startswith("cpu") and not interpreting():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (pytest --device cpu sets it)")
    if not device.startswith("cpu") and not has_gpu():
        pytest.skip("no GPU for Triton")
    return get("triton")


def kernel_dtypes(device: str) -> list:
    """fp32 and fp64 under the interpreter (its half-precision arithmetic is wrong), fp32 and bf16 on a GPU."""
    return [torch.float32, torch.float64] if device.startswith("cpu") else [torch.float32, torch.bfloat16]


def layout_of_rows(device, num_slots: int, seed: int, qsl_dtype=torch.int32):
    """query_start_loc (of `qsl_dtype`), a transposed (non-contiguous) int64 slot table, num_accepted_tokens
    (int32), and the rows' slots and offsets as lists; slot ids drawn without repetition from the pool (slot
    order unrelated to row order)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_slots, generator=g)[:len(ROWS) * S].tolist()
    table = []
    for b, (_, acc, pads, padding) in enumerate(ROWS):
        row = ids[b * S:(b + 1) * S]
        for j in pads:
            row[j] = PAD_SLOT_ID
        if padding:
            row[acc - 1] = PAD_SLOT_ID
        table.append(row)
    qsl = [0]
    for n, *_ in ROWS:
        qsl.append(qsl[-1] + n)
    tab = torch.tensor(table, dtype=torch.int64, device=device).t().contiguous().t()  # strides (1, Bsz)
    assert not tab.is_contiguous()
    return (torch.tensor(qsl, dtype=qsl_dtype, device=device), tab,
            torch.tensor([r[1] for r in ROWS], dtype=torch.int32, device=device), table, qsl)


def check_rows(impl, op, kw, table, qsl, dtype, ctx, out_like: str = "x"):
    """Run `impl`'s `op` on `kw` (laid out by `layout_of_rows`) into a NaN-poisoned `out=` shaped like
    kw[out_like]: the op returns it; pad rows are 0; the live rows' outputs and every slot a live row writes
    match the float64 oracle; every other slot of the pool is bit for bit as it was."""
    sp = SPECS[op]
    pool = kw[sp.pool]
    before = pool.clone()
    pos, opt = sp.split(kw)
    y_ref, pool_ref = oracle(op, *pos, **opt)
    out = poison_(torch.empty_like(kw[out_like]))
    y = sp.call(impl.op(op), {**kw, "out": out})
    assert y is out, f"{ctx}: the op must return out="
    check_pad_rows(op, y, [], kw, context=f"{ctx}; out= was filled with NaN before the call")
    tol = tolerance_for(dtype, scale=2.0)
    written = set()
    for b, (n, acc, _, _) in enumerate(ROWS):
        if n == 0 or table[b][acc - 1] == PAD_SLOT_ID:
            continue
        c = compare(f"{ctx} row {b}: outputs", y[qsl[b]:qsl[b + 1]], y_ref[qsl[b]:qsl[b + 1]], tol)
        assert c.passed, c.message()
        for j in range(n):
            s = table[b][j]
            if s != PAD_SLOT_ID:
                written.add(s)
                c = compare(f"{ctx} row {b} position {j}: slot {s}", pool[s], pool_ref[s], tol)
                assert c.passed, c.message()
    assert written, f"{ctx}: the case writes no slot"
    for s in range(pool.shape[0]):
        if s not in written:
            assert_bitwise_equal(f"{ctx}: slot {s} (not written)", pool[s], before[s])
