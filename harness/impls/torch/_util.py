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


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(x, torch.zeros_like(x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def emit(y: torch.Tensor, like: torch.Tensor, out):
    if out is None:
        return y.to(like.dtype)
    out.copy_(y)
    return out
