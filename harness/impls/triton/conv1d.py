"""Triton causal depthwise conv1d: varlen prefill (`causal_conv1d_varlen`) and decode (`causal_conv1d_update`).

Prefill: one program per (block of packed tokens, block of channels). Each token finds its sequence
by a binary search over `query_start_loc` (a block may straddle sequences), so no host-side length
information is needed (CUDA-graph safe). Taps that fall before the sequence start read the
sequence's pool slot (when `has_initial_state` and not pad) or zero. A second launch writes each
live slot's final window (last K-1 inputs); it runs after the first, which reads the old windows.
All element offsets are computed in int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.triton._common import launch_config, cdiv, device_guard, interpreting, next_power_of_2, tl_dtype

# Launch parameters (defaults from the H200 sweep of scripts/gpu_ops_bench.py, 2026-11-29).
CONFIG = launch_config("conv1d", {"bt": 32, "bd": 128, "warps": 4, "upd_bd": 512, "upd_warps": 8, "upd_rows": 1,
                                        "dfirst": False})


@triton.jit
def _conv_varlen_kernel(x_ptr, w_ptr, b_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr, y_ptr,
                        T, D, S, pad_id,
                        sx_t, sx_d, sw_d, sw_k, ss_s, ss_d, ss_k, sy_t, sy_d,
                        K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, NSTEPS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr, DFIRST: tl.constexpr):
    if DFIRST:  # channel blocks vary fastest: programs running together read neighbouring columns of a row
        pid_d = tl.program_id(0)
        pid_t = tl.program_id(1)
    else:
        pid_t = tl.program_id(0)
        pid_d = tl.program_id(1)
    t = pid_t.to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    d = pid_d.to(tl.int64) * BD + tl.arange(0, BD).to(tl.int64)
    tmask = t < T
    dmask = d < D
    # sequence of each token: the largest s with qsl[s] <= t
    lo = tl.zeros((BT,), dtype=tl.int64)
    hi = tl.zeros((BT,), dtype=tl.int64) + S
    for _ in tl.static_range(NSTEPS):
        mid = (lo + hi) // 2
        q = tl.load(qsl_ptr + mid, mask=tmask, other=0).to(tl.int64)
        go = q <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    seq = lo
    start = tl.load(qsl_ptr + seq, mask=tmask, other=0).to(tl.int64)
    slot = tl.load(idx_ptr + seq, mask=tmask, other=0).to(tl.int64)
    hinit = tl.load(hi_ptr + seq, mask=tmask, other=0)
    use_state = (slot != pad_id) & (hinit != 0) & tmask
    slot = tl.where(use_state, slot, 0)
    acc = tl.zeros((BT, BD), dtype=ACC)
    for k in tl.static_range(K):
        src = t - (K - 1) + k
        xm = (tmask & (src >= start))[:, None] & dmask[None, :]
        xv = tl.load(x_ptr + src[:, None] * sx_t + d[None, :] * sx_d, mask=xm, other=0.0).to(ACC)
        wk = tl.load(w_ptr + d * sw_d + k * sw_k, mask=dmask, other=0.0).to(ACC)
        acc += xv * wk[None, :]
    # taps before a sequence start read its initial window; only blocks holding one of the first
    # K-1 tokens of a sequence with a state need the (gather) loads
    head = use_state & ((t - start) < (K - 1))
    if tl.sum(head.to(tl.int32), axis=0) > 0:
        for k in tl.static_range(K - 1):
            src = t - (K - 1) + k
            col = (K - 1) + (src - start)
            sm = (head & (src < start))[:, None] & dmask[None, :]
            sv = tl.load(st_ptr + slot[:, None] * ss_s + d[None, :] * ss_d + col[:, None] * ss_k,
                         mask=sm, other=0.0).to(ACC)
            wk = tl.load(w_ptr + d * sw_d + k * sw_k, mask=dmask, other=0.0).to(ACC)
            acc += sv * wk[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=dmask, other=0.0).to(ACC)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    ym = tmask[:, None] & dmask[None, :]
    tl.store(y_ptr + t[:, None] * sy_t + d[None, :] * sy_d, acc.to(y_ptr.dtype.element_ty), mask=ym)


@triton.jit
def _conv_final_state_kernel(x_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr, D, pad_id,
                             sx_t, sx_d, ss_s, ss_d, ss_k,
                             K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    s = tl.program_id(0)
    pid_d = tl.program_id(1)
    d = pid_d.to(tl.int64) * BD + tl.arange(0, BD).to(tl.int64)
    dmask = d < D
    start = tl.load(qsl_ptr + s).to(tl.int64)
    end = tl.load(qsl_ptr + s + 1).to(tl.int64)
    j = tl.arange(0, KP).to(tl.int64)
    zj = j * 0  # scalar conditions as vectors (the interpreter mishandles vector & scalar bools)
    slot = tl.load(idx_ptr + s).to(tl.int64)
    live = (zj + slot) != pad_id
    use_state = live & ((zj + tl.load(hi_ptr + s).to(tl.int64)) != 0)
    slot = tl.where(slot != pad_id, slot, 0)
    jmask = j < (K - 1)
    src = end - (K - 1) + j
    in_x = src >= start
    xm = dmask[:, None] & (jmask & in_x & live)[None, :]
    xv = tl.load(x_ptr + src[None, :] * sx_t + d[:, None] * sx_d, mask=xm, other=0.0)
    col = (K - 1) + (src - start)
    sm = dmask[:, None] & (jmask & (src < start) & use_state)[None, :]
    base = st_ptr + slot * ss_s + d[:, None] * ss_d
    sv = tl.load(base + col[None, :] * ss_k, mask=sm, other=0.0)
    val = tl.where(in_x[None, :], xv.to(st_ptr.dtype.element_ty), sv.to(st_ptr.dtype.element_ty))
    tl.store(base + j[None, :] * ss_k, val, mask=dmask[:, None] & (jmask & live)[None, :])


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, b_ptr, st_ptr, idx_ptr, y_ptr, Bsz, D, pad_id,
                        sx_b, sx_d, sw_d, sw_k, ss_s, ss_d, ss_k, sy_b, sy_d,
                        K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr):
    # one program: ROWS batch rows x BD channels (the weight tile is loaded once for all rows)
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    d = pid_d.to(tl.int64) * BD + tl.arange(0, BD).to(tl.int64)
    dmask = d < D
    j = tl.arange(0, KP).to(tl.int64)
    wt = tl.load(w_ptr + d[:, None] * sw_d + j[None, :] * sw_k, mask=dmask[:, None] & (j < K)[None, :],
                 other=0.0).to(ACC)
    if HAS_BIAS:
        bv = tl.load(b_ptr + d, mask=dmask, other=0.0).to(ACC)
    for r in tl.static_range(ROWS):
        b = pid_b * ROWS + r
        rowm = (j * 0 + b) < Bsz  # vectors, not scalars (the interpreter mishandles vector & scalar bools)
        bq = tl.minimum(b, Bsz - 1)
        slot = tl.load(idx_ptr + bq).to(tl.int64)
        live = rowm & ((j * 0 + slot) != pad_id)
        slot = tl.where(slot != pad_id, slot, 0)
        base = st_ptr + slot * ss_s + d[:, None] * ss_d
        sv = tl.load(base + j[None, :] * ss_k, mask=dmask[:, None] & (live & (j < K - 1))[None, :], other=0.0)
        xv = tl.load(x_ptr + bq * sx_b + d * sx_d, mask=dmask, other=0.0)
        win = tl.where((j == K - 1)[None, :], xv.to(ACC)[:, None], sv.to(ACC))
        y = tl.sum(win * wt, axis=1)
        if HAS_BIAS:
            y += bv
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        ym = dmask & ((d * 0 + b) < Bsz)
        tl.store(y_ptr + bq * sy_b + d * sy_d, y.to(y_ptr.dtype.element_ty), mask=ym)
        # shift the window: new col c = win[c + 1]
        tl.store(base + (j[None, :] - 1) * ss_k, win.to(st_ptr.dtype.element_ty),
                 mask=dmask[:, None] & (live & (j >= 1) & (j < K))[None, :])


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, D, K, S = C.validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                 has_initial_state, activation, pad_slot_id, out)
    y = out if out is not None else torch.empty_like(x)
    if S == 0:
        return y
    interp = interpreting()
    bt = 16 if interp else CONFIG["bt"]
    bd = min(next_power_of_2(D), 16 if interp else CONFIG["bd"])
    hi = has_initial_state.view(torch.uint8)
    b = bias if bias is not None else weight
    with device_guard(x):
        if T > 0:
            dfirst = bool(CONFIG["dfirst"]) if not interp else T % 2 == 1  # interpreter: exercise both orders
            grid = (cdiv(D, bd), cdiv(T, bt)) if dfirst else (cdiv(T, bt), cdiv(D, bd))
            _conv_varlen_kernel[grid](
                x, weight, b, conv_states, query_start_loc, cache_indices, hi, y,
                T, D, S, pad_slot_id,
                x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
                conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), y.stride(0), y.stride(1),
                K=K, BT=bt, BD=bd, NSTEPS=max(1, int(S).bit_length()), HAS_BIAS=bias is not None,
                SILU=activation == "silu", ACC=_acc(x.dtype), DFIRST=dfirst,
                num_warps=1 if interp else CONFIG["warps"])
        fbd = min(next_power_of_2(D), 16 if interp else 256)
        _conv_final_state_kernel[(S, cdiv(D, fbd))](
            x, conv_states, query_start_loc, cache_indices, hi, D, pad_slot_id,
            x.stride(0), x.stride(1), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
            K=K, KP=next_power_of_2(K - 1), BD=fbd, num_warps=1 if interp else 4)
    return y


def causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, *, activation=None,
                         pad_slot_id=C.PAD_SLOT_ID, out=None):
    Bsz, D, K = C.validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation,
                                                pad_slot_id, out)
    y = out if out is not None else torch.empty_like(x)
    if Bsz == 0:
        return y
    interp = interpreting()
    bd = min(next_power_of_2(D), 16 if interp else CONFIG["upd_bd"])
    b = bias if bias is not None else weight
    with device_guard(x):
        rows = 2 if interp else CONFIG["upd_rows"]
        _conv_update_kernel[(cdiv(Bsz, rows), cdiv(D, bd))](
            x, weight, b, conv_states, conv_state_indices, y, Bsz, D, pad_slot_id,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), y.stride(0), y.stride(1),
            K=K, KP=next_power_of_2(K), BD=bd, ROWS=rows, HAS_BIAS=bias is not None, SILU=activation == "silu",
            ACC=_acc(x.dtype), num_warps=1 if interp else CONFIG["upd_warps"])
    return y
