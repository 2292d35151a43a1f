"""Pad requests: what an op owes the output rows of a request it was told is padding.

Serving engines pad a batch up to a fixed size (a CUDA-graph batch bucket, a decode batch of a fixed
width) with pad requests whose slot id is the pad id (-1 by default). A pad request is neither read from
nor written to the state pool, and every output row it owns is ZERO. Those rows are not discarded by
the engine: they flow on into the next layer's projections and, under tensor parallelism, into the
all-reduce, so a kernel that leaves them unwritten (whatever a reused buffer held: a previous step's
values, NaN) hands garbage to every later layer.

Which rows a pad request owns:
* a decode op (one row per request): the rows b with ``slot_ids[b] == pad_slot_id``;
* a varlen op (requests packed over ``cu_seqlens``): the tokens of every request i with
  ``slot_ids[i] == pad_slot_id``;
* a multi-token decode (``reference.spec_decode``): the tokens of every padding row there.
"""
from __future__ import annotations

import torch

from reference.validate import check_cu_seqlens

__all__ = ["pad_row_mask", "zero_pad_rows"]


def pad_row_mask(slot_ids, pad_slot_id: int = -1, cu_seqlens=None, num_rows: int | None = None) -> list[bool]:
    """Per output row, whether a pad request owns it. `slot_ids`: one id per request (a list or 1-dim
    tensor). Without `cu_seqlens` request b owns row b; with it request i owns the tokens
    cu_seqlens[i]:cu_seqlens[i+1] (`num_rows` the token count, default cu_seqlens[-1])."""
    ids = [int(s) for s in (slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else slot_ids)]
    if cu_seqlens is None:
        return [s == pad_slot_id for s in ids]
    if num_rows is None:
        num_rows = int(cu_seqlens[-1])
    cu = check_cu_seqlens(cu_seqlens, num_rows).tolist()
    mask = [False] * num_rows
    for i, s in enumerate(ids):
        if s == pad_slot_id:
            for t in range(cu[i], cu[i + 1]):
                mask[t] = True
    return mask


def zero_pad_rows(y: torch.Tensor, mask) -> torch.Tensor:
    """`y` with the rows of `mask` (see `pad_row_mask`) set to zero, in place; returns `y`."""
    rows = [t for t, pad in enumerate(mask) if pad]
    if rows:
        y[torch.tensor(rows, dtype=torch.int64, device=y.device)] = 0
    return y
