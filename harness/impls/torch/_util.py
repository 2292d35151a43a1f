"""Small helpers for the vectorized torch implementations (device-agnostic, no per-token loops)."""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def up(t, cd):
    return None if t is None else t.to(cd)


def slots(indices: torch.Tensor, pad_slot_id: int):
    """(idx int64, live mask, safe idx (pads -> 0))."""
    idx = indices.to(torch.int64)
    live = idx != pad_slot_id
    return idx, live, torch.where(live, idx, torch.zeros_like(idx))


def gather_init(pool: torch.Tensor, safe: torch.Tensor, use: torch.Tensor, cd) -> torch.Tensor:
    """Initial states per request: the slot where `use`, else zeros (pool values never leak into pads)."""
    g = pool[safe].to(cd)
    return torch.where(use.reshape((-1,) + (1,) * (g.dim() - 1)), g, torch.zeros((), dtype=cd, device=g.device))


def scatter_final(pool: torch.Tensor, idx: torch.Tensor, live: torch.Tensor, final: torch.Tensor) -> None:
    """pool[idx[live]] = final[live], in place (honours a strided pool view)."""
    if bool(live.any()):
        pool[idx[live]] = final[live].to(pool.dtype)


def token_live(query_start_loc: torch.Tensor, live: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Per token of a packed batch, whether its request is live (`live` (S,) per request)."""
    q = query_start_loc.to(torch.int64)
    if num_tokens == 0 or live.numel() == 0:
        return torch.zeros(num_tokens, dtype=torch.bool, device=live.device)
    t = torch.arange(num_tokens, device=q.device)
    seq = torch.searchsorted(q[1:], t, right=True).clamp(max=live.numel() - 1)  # the request of each token
    return live[seq]


def zero_pad_rows(y: torch.Tensor, live_rows: torch.Tensor) -> torch.Tensor:
    """`y` with every row not in `live_rows` (bool, one per row) zero -- the op contract's pad rows; selected,
    not multiplied by a mask, so a NaN computed there does not survive."""
    keep = live_rows.reshape((-1,) + (1,) * (y.dim() - 1))
    return torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device))


def chunk_grid(starts: list, lens: list, device):
    """A padded grid of a chunk table's chunks: (ln, tok, valid) with ln (nc,) the chunk lengths, tok (nc, Lc)
    each position's token (0 where padding), valid (nc, Lc) the real positions; Lc = the longest chunk."""
    Lc = max(lens)
    st = torch.tensor(starts, dtype=torch.int64, device=device)
    ln = torch.tensor(lens, dtype=torch.int64, device=device)
    ar = torch.arange(Lc, device=device)
    valid = ar[None, :] < ln[:, None]
    tok = torch.where(valid, st[:, None] + ar[None, :], torch.zeros_like(valid, dtype=torch.int64))
    return ln, tok, valid


def padded_rows(t: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor, cd) -> torch.Tensor:
    """t's rows at `tok` in the compute dtype, zeros where not `valid` — selected, never multiplied by a 0
    mask, so another request's NaN or inf cannot reach this one."""
    g = t.to(cd)[tok]
    keep = valid.reshape(valid.shape + (1,) * (g.dim() - valid.dim()))
    return torch.where(keep, g, torch.zeros((), dtype=cd, device=g.device))


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(x, torch.zeros_like(x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def emit(y: torch.Tensor, like: torch.Tensor, out):
    if out is None:
        return y.to(like.dtype)
    out.copy_(y)
    return out
