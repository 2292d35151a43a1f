"""Small helpers shared by the reference ops (private to the `reference` package)."""
from __future__ import annotations

import math

import torch

from reference.validate import check_cu_seqlens, check_tensor, fail


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), exact in every dtype (no linear cut-off above a threshold)."""
    return torch.logaddexp(x, torch.zeros_like(x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def sequences(cu_seqlens, num_tokens: int) -> list[tuple[int, int]]:
    """Validated `cu_seqlens` as a list of (start, end) token ranges, one per sequence."""
    cu = check_cu_seqlens(cu_seqlens, num_tokens).tolist()
    return list(zip(cu[:-1], cu[1:]))


def start_state(initial_states, s: int, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """Sequence s's state before its first token: a copy of initial_states[s], or zeros of `shape` (in
    `like`'s dtype and device) when there are no initial states."""
    if initial_states is None:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return initial_states[s].clone()


def check_float(arg: str, t, shape=None, ndim=None, optional: bool = False) -> None:
    """A floating-point tensor argument of the given shape (None entries = any size)."""
    check_tensor(arg, t, ndim=ndim, shape=shape, floating=True, optional=optional)


def check_same_device(ref_arg: str, ref: torch.Tensor, **tensors) -> None:
    for k, v in tensors.items():
        if v is not None and v.device != ref.device:
            fail(k, f"a tensor on {ref.device} (same device as {ref_arg})", f"device {v.device}")


def check_dt_limit(dt_limit) -> tuple[float, float]:
    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2:
        fail("dt_limit", "a pair (lo, hi)", repr(dt_limit))
    lo, hi = dt_limit
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)) \
            or math.isnan(lo) or math.isnan(hi) or lo > hi:
        fail("dt_limit", "two numbers lo <= hi", repr(tuple(dt_limit)))
    return float(lo), float(hi)


def check_activation(activation) -> None:
    if activation not in (None, "silu", "swish"):
        fail("activation", "None or 'silu'", repr(activation))


def check_eps(eps) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        fail("eps", "a number >= 0", repr(eps))
