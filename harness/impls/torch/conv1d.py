"""Vectorized torch causal conv1d (varlen prefill and decode): one gather per tap, no token loop."""
from __future__ import annotations

import torch

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.torch._util import (compute_dtype, emit, gather_init, scatter_final, silu, slots, token_live,
                                       zero_pad_rows)


@provides("torch", "causal_conv1d_varlen")
def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, D, K, S = C.validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                 has_initial_state, activation, pad_slot_id, out)
    cd = compute_dtype(x.dtype)
    dev = x.device
    q = query_start_loc.to(torch.int64)
    idx, live, safe = slots(cache_indices, pad_slot_id)
    if S == 0:
        return out if out is not None else torch.empty_like(x)
    init = gather_init(conv_states, safe, live & has_initial_state, cd)  # (S, D, K-1)
    xs = x.to(cd)
    w = weight.to(cd)
    t = torch.arange(T, device=dev)
    seq = torch.searchsorted(q[1:], t, right=True).clamp(max=S - 1)  # sequence of each token
    start = q[seq]
    y = torch.zeros((T, D), dtype=cd, device=dev)
    for k in range(K):  # taps (K <= 8), not tokens
        src = t - (K - 1) + k
        inx = src >= start
        xv = xs[src.clamp(min=0)]
        col = (K - 1 + src - start).clamp(0, K - 2)
        sv = init[seq, :, col]  # (T, D)
        y = y + torch.where(inx[:, None], xv, sv) * w[:, k]
    if bias is not None:
        y = y + bias.to(cd)
    if activation == "silu":
        y = silu(y)
    # final windows: the last K-1 inputs of each sequence (from the initial window where too short)
    starts, ends = q[:-1], q[1:]
    j = torch.arange(K - 1, device=dev)
    src = ends[:, None] - (K - 1) + j  # (S, K-1)
    inx = src >= starts[:, None]
    if T > 0:
        xv = xs[src.clamp(0, T - 1)].permute(0, 2, 1)  # (S, D, K-1)
    else:
        xv = torch.zeros((S, D, K - 1), dtype=cd, device=dev)
    col = (K - 1 + src - starts[:, None]).clamp(0, K - 2)
    sv = init[torch.arange(S, device=dev)[:, None], :, col].permute(0, 2, 1)
    final = torch.where(inx[:, None, :], xv, sv)
    scatter_final(conv_states, idx, live, final)
    return emit(zero_pad_rows(y, token_live(q, live, T)), x, out)


@provides("torch", "causal_conv1d_update")
def causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, *, activation=None,
                         pad_slot_id=C.PAD_SLOT_ID, out=None):
    Bsz, D, K = C.validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation,
                                                pad_slot_id, out)
    cd = compute_dtype(x.dtype)
    idx, live, safe = slots(conv_state_indices, pad_slot_id)
    st = gather_init(conv_states, safe, live, cd)  # (B, D, K-1)
    win = torch.cat([st, x.to(cd)[:, :, None]], dim=2)  # (B, D, K)
    y = (win * weight.to(cd)).sum(-1)
    if bias is not None:
        y = y + bias.to(cd)
    if activation == "silu":
        y = silu(y)
    scatter_final(conv_states, idx, live, win[:, :, 1:])
    return emit(zero_pad_rows(y, live), x, out)
