"""Adapter for the causal-conv1d CUDA package (needs its compiled extension `causal_conv1d_cuda`).

* causal_conv1d_varlen <- causal_conv1d_fn, one call per live sequence on a channel-last view
  (1, D, L) with initial_states / return_final_states (channel-last is what its state path needs).
  Sequences shorter than K-1 tokens: its final state would not take the older columns from the
  initial window, so the adapter builds that window itself.
* causal_conv1d_update <- causal_conv1d_update(x, conv_state, weight, bias, activation,
  conv_state_indices=...) on the live rows only (pads are filtered out here).
The peer never sees a pad request, so the adapter stores y = 0 over the pad requests' rows (the op contract).
Declined (NotImplementedError, the peer's own checks): widths outside 2..4; varlen with a channel count
not divisible by 8 (its channel-last path); update with a pool dtype other than x's. The channel-last path
also requires x.stride(0) and x.stride(2) to be multiples of 8: each sequence's tokens reach it as rows D
apart (a copy unless they already are).
"""
from __future__ import annotations

import torch

from harness import ops as C
from harness.impls.adapters import host_slots, import_peer, unavailable_reason, zero_pad_tokens
from harness.impls.adapters._source import PeerSdist
from harness.impls.registry import Impl, register

# the source archive scripts/peers_fetch.py downloads; scripts/gpu.sh builds its CUDA extensions
SOURCE = PeerSdist("causal-conv1d==1.7.0")


def _check_width(K):
    if not 2 <= K <= 4:
        raise NotImplementedError(f"causal_conv1d: kernel widths 2..4, got {K}")


def _channel_last(rows):
    """The (L, D) token rows as the (1, D, L) channel-last view causal_conv1d_fn takes (stride(1) == 1), rows D
    elements apart (copied unless they are): its channel-last path requires x.stride(0) and x.stride(2) to be
    multiples of 8 (with D divisible by 8, D is). `contiguous()` is not enough: a one-token slice of a wider
    buffer (x of a fused projection) counts as contiguous and keeps the buffer's row stride."""
    D = rows.shape[1]
    if rows.stride() != (D, 1):
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.t()[None]


def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, D, K, S = C.validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                 has_initial_state, activation, pad_slot_id, out)
    _check_width(K)
    if D % 8:
        raise NotImplementedError(f"causal_conv1d causal_conv1d_fn (channel-last, which initial states need): "
                                  f"channels divisible by 8, got {D}")
    fn = import_peer("causal_conv1d").causal_conv1d_fn
    idx, live = host_slots(cache_indices, pad_slot_id)
    hi = has_initial_state.detach().cpu().tolist()
    q = query_start_loc.detach().cpu().tolist()
    y = zero_pad_tokens(out if out is not None else torch.empty_like(x), query_start_loc, cache_indices, pad_slot_id)
    for i in live:
        a, b = q[i], q[i + 1]
        init = conv_states[idx[i]].to(x.dtype) if hi[i] else torch.zeros((D, K - 1), dtype=x.dtype, device=x.device)
        if b > a:
            xs = _channel_last(x[a:b])
            # channel-last initial state (1, D, K-1) in storage of its own: the kernel's vector loads need a
            # 16-byte aligned start, which a view of a pool slot need not have (docs/findings.md)
            init_cl = init.t().clone(memory_format=torch.contiguous_format).t()[None]
            ys, fin = fn(xs, weight, bias, initial_states=init_cl, return_final_states=True, activation=activation)
            y[a:b] = ys[0].t()
        if b - a >= K - 1:
            final = x[b - (K - 1):b].t()
        else:
            final = torch.cat([init[:, (b - a):], x[a:b].t()], dim=1)
        conv_states[idx[i]] = final.to(conv_states.dtype)
    return y


def causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, *, activation=None,
                         pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation, pad_slot_id, out)
    _check_width(weight.shape[1])
    if conv_states.dtype != x.dtype:
        raise NotImplementedError(f"causal_conv1d causal_conv1d_update: conv state dtype must equal x's "
                                  f"({x.dtype}), got {conv_states.dtype}")
    upd = import_peer("causal_conv1d").causal_conv1d_update
    idx, live = host_slots(conv_state_indices, pad_slot_id)
    y = out if out is not None else torch.empty_like(x)
    pads = [b for b, s in enumerate(idx) if s == pad_slot_id]
    if pads:
        y[torch.tensor(pads, device=x.device)] = 0  # pad rows
    if not live:
        return y
    rows = torch.tensor(live, device=x.device)
    ci = torch.tensor([idx[i] for i in live], dtype=torch.int32, device=x.device)
    ys = upd(x[rows].contiguous(), conv_states, weight, bias, activation, conv_state_indices=ci)
    y[rows] = ys
    return y


register(Impl(name="causal_conv1d", reads_host=True,
              devices=("cuda",), dtypes=(torch.float32, torch.float16, torch.bfloat16),
              ops={"causal_conv1d_varlen": causal_conv1d_varlen, "causal_conv1d_update": causal_conv1d_update},
              unavailable=lambda: unavailable_reason("causal_conv1d", "causal_conv1d"),
              description="causal-conv1d CUDA kernels (per-sequence calls for varlen)"))
