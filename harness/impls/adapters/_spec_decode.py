"""Device-side pieces of the speculative-decode adapters (vLLM, SGLang): the contract's layout
(`harness.ops.selective_state_update_spec`: packed rows, a (Bsz, num_spec + 1) slot table, the start slot
picked by num_accepted_tokens) taken apart with index tensors of static shape and no host read, so the ops
stay capturable inside `harness.ops.no_index_checks()`.

* `rows(query_start_loc, table, num_accepted_tokens, pad_slot_id)`: each row's token count, start slot and
  whether it is live (tokens, and a start slot that is not the pad id).
* `written(table, lens, live, pad_slot_id)`: (Bsz, S) mask of the positions whose state the step writes.
* `dense_tokens(t, query_start_loc, S)` / `packed(y, query_start_loc, T)`: packed tokens as (Bsz, S, ...)
  rows (positions past a row's tokens repeat some other token: their results are dropped) and back.
* `mask_tokens(y, query_start_loc, live)`: the packed tokens of rows that are not live set to zero.
* `scatter_positions(pool, table, mask, states)`: pool[table[b, j]] = states[b, j] where mask[b, j].
* `idle(indices_arg...)`: whether a call has nothing for a kernel to do.
"""
from __future__ import annotations

import torch

from harness.impls.adapters import host_reads_ok, scatter_slots


def rows(query_start_loc, table, num_accepted_tokens, pad_slot_id):
    """(lens (Bsz,) int64, start slot (Bsz,) int64, live (Bsz,) bool), on the device."""
    q = query_start_loc.to(torch.int64)
    lens = q[1:] - q[:-1]
    start = table.to(torch.int64).gather(1, (num_accepted_tokens.to(torch.int64) - 1)[:, None])[:, 0]
    return lens, start, (lens > 0) & (start != pad_slot_id)


def written(table, lens, live, pad_slot_id):
    """(Bsz, S) bool: the positions of live rows that have a token and a slot that is not the pad id."""
    pos = torch.arange(table.shape[1], device=table.device)
    return live[:, None] & (pos[None, :] < lens[:, None]) & (table != pad_slot_id)


def token_index(query_start_loc, S: int, T: int):
    """(Bsz, S) int64: the packed token of each row position; positions past a row's tokens are clamped into
    [0, T) (they name some token; whatever is computed from it is dropped)."""
    q = query_start_loc.to(torch.int64)
    idx = q[:-1, None] + torch.arange(S, device=q.device)[None, :]
    return idx.clamp(0, max(T - 1, 0))


def dense_tokens(t, query_start_loc, S: int):
    """`t` (T, ...) as (Bsz, S, ...) rows (None stays None)."""
    if t is None:
        return None
    return t[token_index(query_start_loc, S, t.shape[0])]


def token_rows(query_start_loc, T: int):
    """(T,) int64: the row of each packed token."""
    q = query_start_loc.to(torch.int64)
    return torch.searchsorted(q[1:], torch.arange(T, device=q.device), right=True)


def packed(y, query_start_loc, T: int):
    """(Bsz, S, ...) row outputs back to the packed (T, ...) tokens."""
    q = query_start_loc.to(torch.int64)
    row = token_rows(query_start_loc, T)
    return y[row, torch.arange(T, device=q.device) - q[row]]


def mask_tokens(y, query_start_loc, live):
    """`y` (T, ...) with the tokens of the rows where `live` (Bsz,) is False set to zero (on the device)."""
    keep = live[token_rows(query_start_loc, y.shape[0])]
    return torch.where(keep.reshape((-1,) + (1,) * (y.dim() - 1)), y, 0)


def scatter_positions(pool, table, mask, states):
    """pool[table[b, j]] = states[b, j] (cast to the pool's dtype) where mask[b, j]; every other slot keeps
    its bits (live slot ids are distinct over the table: the contract's rule)."""
    Bsz, S = table.shape
    scatter_slots(pool, table.reshape(Bsz * S), mask.reshape(Bsz * S), states.reshape((Bsz * S,) + states.shape[2:]))


def idle(query_start_loc, table, num_accepted_tokens, pad_slot_id, pool, T: int) -> bool:
    """Nothing for a kernel to do: no rows, no tokens, an empty pool, or (where the host may read the
    indices) no live row. Inside `no_index_checks()` a batch of padding rows only is not recognised and runs
    (no slot is read or written)."""
    if table.shape[0] == 0 or T == 0 or pool.shape[0] == 0:
        return True
    if not host_reads_ok():
        return False
    return not bool(rows(query_start_loc, table, num_accepted_tokens, pad_slot_id)[2].any())
