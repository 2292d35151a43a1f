"""Causal depthwise conv1d with a carried conv state (the short convolution in front of every SSM mixer).

Width K (2..8). The conv state of a sequence is its last K-1 inputs, oldest first, shape (D, K-1).

    y[t] = act(bias + sum_{k=0}^{K-1} weight[:, k] * xpad[t + k])

where `xpad` is the sequence's inputs preceded by its K-1 state columns (zeros without an initial
state), i.e. weight[:, K-1] multiplies the current token and weight[:, 0] the oldest one.
"""
from __future__ import annotations

import torch

from reference._common import check_activation, check_float, check_same_device, sequences, silu
from reference.validate import check_same_dtype, fail

__all__ = ["causal_conv1d", "causal_conv1d_update"]


def _check_weight(weight) -> tuple[int, int]:
    check_float("weight", weight, ndim=2)
    D, K = weight.shape
    if not 2 <= K <= 8:
        fail("weight", "kernel width K in 2..8 (weight shape (D, K))", f"K = {K} (shape {tuple(weight.shape)})")
    return D, K


def _activate(y: torch.Tensor, activation) -> torch.Tensor:
    return silu(y) if activation in ("silu", "swish") else y


def causal_conv1d(x, weight, bias=None, *, activation=None, cu_seqlens=None, initial_states=None):
    """Causal depthwise conv1d over packed sequences.

    Args:
        x: (T, D) packed tokens.
        weight: (D, K), K in 2..8.
        bias: (D,) or None.
        activation: None or "silu" ("swish" is accepted as an alias).
        cu_seqlens: int (S+1,) offsets, or None for one sequence.
        initial_states: (S, D, K-1) conv states (oldest input first), or None for zeros.

    Returns:
        (y, final_states): y (T, D); final_states (S, D, K-1), the last K-1 inputs of each sequence,
        oldest first (taken from its initial state where the sequence is shorter than K-1).
    """
    check_float("x", x, ndim=2)
    T, D = x.shape
    Dw, K = _check_weight(weight)
    if Dw != D:
        fail("weight", f"shape (D, K) with D = {D} (channels of x)", f"shape {tuple(weight.shape)}")
    check_float("bias", bias, shape=(D,), optional=True)
    check_activation(activation)
    seqs = sequences(cu_seqlens, T)
    S = len(seqs)
    check_float("initial_states", initial_states, shape=(S, D, K - 1), optional=True)
    check_same_dtype(x=x, weight=weight, bias=bias, initial_states=initial_states)
    check_same_device("x", x, weight=weight, bias=bias, initial_states=initial_states)

    y = torch.empty_like(x)
    final_states = torch.empty((S, D, K - 1), dtype=x.dtype, device=x.device)
    for s, (start, end) in enumerate(seqs):
        if initial_states is None:
            state = torch.zeros((K - 1, D), dtype=x.dtype, device=x.device)
        else:
            state = initial_states[s].transpose(0, 1)  # (K-1, D), oldest first
        xpad = torch.cat([state, x[start:end]], dim=0)  # (K-1 + L, D)
        for t in range(end - start):
            acc = torch.zeros(D, dtype=x.dtype, device=x.device) if bias is None else bias.clone()
            for k in range(K):
                acc = acc + weight[:, k] * xpad[t + k]
            y[start + t] = _activate(acc, activation)
        final_states[s] = xpad[xpad.shape[0] - (K - 1):].transpose(0, 1)
    return y, final_states


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None):
    """One decode step for a batch of sequences.

    Args:
        x: (B, D), the new token of each sequence.
        conv_state: (B, D, K-1), the last K-1 inputs, oldest first (not modified).
        weight: (D, K); bias: (D,) or None; activation: None or "silu".

    Returns:
        (y, new_state): y (B, D); new_state (B, D, K-1) = the state shifted left by one with x appended.
    """
    check_float("x", x, ndim=2)
    Bsz, D = x.shape
    Dw, K = _check_weight(weight)
    if Dw != D:
        fail("weight", f"shape (D, K) with D = {D} (channels of x)", f"shape {tuple(weight.shape)}")
    check_float("conv_state", conv_state, shape=(Bsz, D, K - 1))
    check_float("bias", bias, shape=(D,), optional=True)
    check_activation(activation)
    check_same_dtype(x=x, conv_state=conv_state, weight=weight, bias=bias)
    check_same_device("x", x, conv_state=conv_state, weight=weight, bias=bias)

    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)  # (B, D, K), oldest first
    y = (window * weight.unsqueeze(0)).sum(dim=-1)
    if bias is not None:
        y = y + bias
    return _activate(y, activation), window[:, :, 1:].clone()
