"""Triton causal depthwise conv1d: varlen prefill (`causal_conv1d_varlen`) and decode (`causal_conv1d_update`).

Prefill, one launch: each program owns a segment of packed tokens x a block of BD channels and walks it
in chunks of BT rows, software-pipelined (`stages` chunks in flight through shared memory, cp.async).
Each input row is loaded once, as a coalesced vector load of BD channels; the last K-1 rows of a chunk
stay in registers as the next chunk's halo, so output row r of a chunk uses rows r..r+K-1 of
(halo + chunk) with no reloads and no shifted gathers. A program finds the sequence of its first token
with one scalar binary search over `query_start_loc` (no host-side lengths: CUDA-graph safe); chunks
inside one sequence take a straight-line path without masks, others walk the sequence boundaries row
by row and treat taps before a sequence start as zero. The pool is touched only by a sequence's owner
(the program whose segment holds the sequence's start): it recomputes the first K-1 outputs of a
sequence with an initial window (the other programs skip those rows) and then writes the final window
(last K-1 inputs, from the old window where the sequence is shorter than K-1). Reads of a slot come
before its writes, in one program: no race, no second launch.
Decode: one program per (ROWS batch rows, BD channels), one channel per lane (the windows have stride
K-1), weights loaded once, all loads of its rows issued before any store.
A pad request's outputs (its tokens, or its decode row) are stored as 0; its slot is never touched.
Row offsets are int64 (T*D may exceed 2^31); per-channel offsets are int32 unless the host sees they
could overflow (I64D). SiLU uses the approximate ex2/rcp instructions for fp32 accumulators on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import (Fixed, HostPlans, launch_config, launch_fixed, cdiv, device_guard,
                                          interpreting, next_power_of_2, nvidia_fast, silu_fast, tl_dtype, unit_stride)

# Launch parameters. Prefill: chunks of bt tokens x bd channels (bd / (32 * warps) channels per thread:
# 4 = 8-byte bf16 vectors), `stages` chunks in flight; a program walks at most `chunks` chunks, fewer
# when that would leave fewer than `progs` programs; dfirst: channel blocks vary fastest in the grid;
# maxnreg: register cap (0 = none). Decode: upd_rows batch rows x upd_bd channels per program.
# Defaults: best of the H200 sweep (`harness bench sweep --op causal_conv1d_varlen` / `causal_conv1d_update`;
# the device's values in configs/<device>/conv1d.json). Offline sm_90 compile (Triton 3.6) of a wider config
# (bt 8, bd 1024, 8 warps, 3 stages; upd 512 x 2 rows): prefill 80 registers, no spills, 48 KiB shared
# (3 CTAs / SM); decode 86 registers, one layout, no shared memory.
CONFIG = launch_config("conv1d", {"bt": 16, "bd": 512, "warps": 4, "stages": 2, "dfirst": False, "chunks": 4,
                                  "progs": 1024, "maxnreg": 0, "upd_bd": 256, "upd_warps": 4, "upd_rows": 4})

# Triton decides at import whether its kernels are interpreted; reading the environment once keeps it off the
# per-call path (decode is bound by the host's time per call)
_INTERPRETED = interpreting()


@triton.jit
def _weights(w_ptr, d, dmask, sw_d, sw_k, K: tl.constexpr, ACC: tl.constexpr):
    """The K taps of channels d: a tuple of K vectors in the channel layout."""
    ws = ()
    for k in tl.static_range(K):
        ws = ws + (tl.load(w_ptr + d * sw_d + k * sw_k, mask=dmask, other=0.0).to(ACC),)
    return ws


@triton.jit
def _channels(w_ptr, b_ptr, pid_d, D, sw_d, sw_k, sb_d, K: tl.constexpr, BD: tl.constexpr,
              HAS_BIAS: tl.constexpr, ACC: tl.constexpr, I64D: tl.constexpr):
    """Channel block pid_d: its channels d (int64 when I64D), their mask, their K taps and their bias in ACC
    (zeros without one)."""
    d = pid_d * BD + tl.arange(0, BD)
    if I64D:
        d = d.to(tl.int64)
    dmask = d < D
    ws = _weights(w_ptr, d, dmask, sw_d, sw_k, K, ACC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + d * sb_d, mask=dmask, other=0.0).to(ACC)
    else:
        bias = tl.zeros((BD,), dtype=ACC)
    return d, dmask, ws, bias


@triton.jit
def _epilogue(acc, SILU: tl.constexpr, FAST: tl.constexpr):
    """SiLU; FAST (fp32 on a GPU): x * rcp(1 + 2^(-x log2 e)) with the approximate ftz instructions
    (2 MUFU + 3 ALU instead of ~12 instructions with the denormal fix-ups of exp and division)."""
    if SILU:
        if FAST:
            acc = silu_fast(acc, FAST)
        else:
            acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _load_rows(x_ptr, xo, dmask, first, last, sx_t, N: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows first .. first+N-1 of x (row indices clamped to at most `last`, which is a valid row) as a
    tuple of N vectors."""
    rows = ()
    for i in tl.static_range(N):
        u = tl.minimum(first + i, last)
        if EVEN_D:
            rows = rows + (tl.load(x_ptr + u.to(tl.int64) * sx_t + xo),)
        else:
            rows = rows + (tl.load(x_ptr + u.to(tl.int64) * sx_t + xo, mask=dmask, other=0.0),)
    return rows


@triton.jit
def _conv_varlen_kernel(x_ptr, w_ptr, b_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr, y_ptr,
                        T, D, S, pad_id, SEG,
                        sx_t, sx_d, sw_d, sw_k, sb_d, ss_s, ss_d, ss_k, sy_t, sy_d,
                        K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr,
                        NSTEPS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                        DFIRST: tl.constexpr, EVEN_D: tl.constexpr, I64D: tl.constexpr, FAST: tl.constexpr):
    # One program: tokens [ts, te) (SEG a multiple of BT) x channels [pid_d * BD, + BD), walked in chunks
    # of BT rows (software-pipelined: STAGES chunks in flight). Outputs are computed with the taps before
    # a sequence start as zero; the first K-1 outputs of a sequence with an initial window, and every
    # final window, are written by the sequence's owner: the program whose tokens hold its start.
    # Only the owner reads or writes the sequence's slot, reads before writes: no race, one launch.
    if DFIRST:  # channel blocks vary fastest: programs running together read neighbouring columns of a row
        pid_d = tl.program_id(0)
        pid_t = tl.program_id(1)
    else:
        pid_t = tl.program_id(0)
        pid_d = tl.program_id(1)
    ts = pid_t * SEG
    te = tl.minimum(ts + SEG, T)
    d, dmask, ws, bias = _channels(w_ptr, b_ptr, pid_d, D, sw_d, sw_k, sb_d, K, BD, HAS_BIAS, ACC, I64D)
    xo = d * sx_d
    yo = d * sy_d
    # s: the sequence of token ts (the largest s < S with qsl[s] <= ts; then qsl[s + 1] > ts);
    # own: the first sequence the program owns (the smallest s with qsl[s] >= ts)
    lo = pid_t * 0
    hi = lo + S
    ol = lo
    oh = hi
    for _ in tl.static_range(NSTEPS):
        mid = (lo + hi) // 2
        go = tl.load(qsl_ptr + mid).to(tl.int32) <= ts
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
        mid = (ol + oh) // 2
        go = tl.load(qsl_ptr + mid).to(tl.int32) >= ts
        oh = tl.where(go, mid, oh)
        ol = tl.where(go, ol, mid + 1)
    s = lo
    start = tl.load(qsl_ptr + s).to(tl.int32)
    nxt = tl.load(qsl_ptr + s + 1).to(tl.int32)
    own = oh
    own_start = tl.load(qsl_ptr + own).to(tl.int32)
    # the K-1 rows before the first chunk (rows before 0 are masked here, later ones by sequence)
    halo = ()
    for i in tl.static_range(K - 1):
        u = ts + (i - (K - 1))
        halo = halo + (tl.load(x_ptr + tl.maximum(u, 0).to(tl.int64) * sx_t + xo,
                               mask=tl.where(u >= 0, dmask, False), other=0.0),)
    for c in tl.range(0, te - ts, BT, num_stages=STAGES):
        t0 = ts + c
        rows = halo + _load_rows(x_ptr, xo, dmask, t0, te - 1, sx_t, BT, EVEN_D)
        if (start <= t0 - (K - 1)) & (nxt >= t0 + BT):
            # rows and halo inside one sequence, past its first K-1 tokens: no masks
            lv = (d * 0 + tl.load(idx_ptr + s)) != pad_id  # a pad request's tokens get y = 0
            for r in tl.static_range(BT):
                acc = bias
                for k in tl.static_range(K):
                    acc += rows[r + k].to(ACC) * ws[k]
                acc = tl.where(lv, _epilogue(acc, SILU, FAST), 0.0).to(y_ptr.dtype.element_ty)
                yp = y_ptr + (t0 + r).to(tl.int64) * sy_t + yo
                if EVEN_D:
                    tl.store(yp, acc)
                else:
                    tl.store(yp, acc, mask=dmask)
        else:
            for r in tl.static_range(BT):
                t = t0 + r
                if t < te:
                    while (t >= nxt) & (s < S - 1):  # next non-empty sequence
                        s += 1
                        start = nxt
                        nxt = tl.load(qsl_ptr + s + 1).to(tl.int32)
                    acc = bias
                    for k in tl.static_range(K):
                        xv = rows[r + k].to(ACC)
                        if k < K - 1:
                            xv = tl.where(t + (k - (K - 1)) >= start, xv, 0.0)
                        acc += xv * ws[k]
                    lv = (d * 0 + tl.load(idx_ptr + s)) != pad_id  # a pad request's tokens get y = 0
                    acc = tl.where(lv, _epilogue(acc, SILU, FAST), 0.0).to(y_ptr.dtype.element_ty)
                    skip = t - start < K - 1  # the owner writes it if the sequence has an initial window
                    if skip:
                        skip = (tl.load(idx_ptr + s) != pad_id) & (tl.load(hi_ptr + s) != 0)
                    tl.store(y_ptr + t.to(tl.int64) * sy_t + yo, acc, mask=tl.where(skip, False, dmask))
        nh = ()
        for i in tl.static_range(K - 1):
            nh = nh + (rows[BT + i],)
        halo = nh
    # owned sequences: those starting in [ts, te), and for the last program those starting at T
    lim = tl.where(te == T, T + 1, te)
    while (own < S) & (own_start < lim):
        end = tl.load(qsl_ptr + own + 1).to(tl.int32)
        slot = tl.load(idx_ptr + own)
        if slot != pad_id:
            use = tl.load(hi_ptr + own) != 0
            sb = st_ptr + slot.to(tl.int64) * ss_s + d * ss_d
            old = ()
            for j in tl.static_range(K - 1):
                old = old + (tl.load(sb + j * ss_k, mask=tl.where(use, dmask, False), other=0.0),)
            tl.debug_barrier()  # every old window value is read before any is overwritten
            if use:  # outputs of the first K-1 tokens: taps before the start read the old window
                for i in tl.static_range(K - 1):
                    t = own_start + i
                    if t < end:
                        acc = bias
                        for k in tl.static_range(K):
                            if i + k >= K - 1:
                                xv = tl.load(x_ptr + (t + (k - (K - 1))).to(tl.int64) * sx_t + xo, mask=dmask,
                                             other=0.0).to(ACC)
                            else:
                                xv = old[i + k].to(ACC)
                            acc += xv * ws[k]
                        acc = _epilogue(acc, SILU, FAST).to(y_ptr.dtype.element_ty)
                        tl.store(y_ptr + t.to(tl.int64) * sy_t + yo, acc, mask=dmask)
            # final window: col j holds input end-(K-1)+j, from the old window where that precedes the start
            for j in tl.static_range(K - 1):
                u = end + (j - (K - 1))
                v = tl.load(x_ptr + tl.maximum(u, 0).to(tl.int64) * sx_t + xo,
                            mask=tl.where(u >= own_start, dmask, False), other=0.0).to(st_ptr.dtype.element_ty)
                for q in tl.static_range(K - 1):  # the old window's values are copied bit for bit
                    v = tl.where(u - own_start + (K - 1) == q, old[q], v)
                tl.store(sb + j * ss_k, v, mask=dmask)
        own += 1
        own_start = end


# sx_d / sy_d / sb_d stay runtime values: with unit strides specialised, Triton would vectorise the
# x / y / bias accesses and convert layouts (shared memory, barriers) against the window accesses
# (stride K-1), which want one channel per lane; all in one layout, every access is lane-coalesced.
@triton.jit(do_not_specialize=["sx_d", "sy_d", "sb_d"])
def _conv_update_kernel(x_ptr, w_ptr, b_ptr, st_ptr, idx_ptr, y_ptr, Bsz, D, pad_id,
                        sx_b, sx_d, sw_d, sw_k, sb_d, ss_s, ss_d, ss_k, sy_b, sy_d,
                        K: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr, I64D: tl.constexpr,
                        FAST: tl.constexpr):
    # one program: ROWS batch rows x BD channels; weights loaded once; all loads before any store
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    d, dmask, ws, bias = _channels(w_ptr, b_ptr, pid_d, D, sw_d, sw_k, sb_d, K, BD, HAS_BIAS, ACC, I64D)
    xs = ()
    wins = ()
    sbs = ()
    lms = ()
    ybs = ()
    for r in tl.static_range(ROWS):
        # rows past the batch redo row Bsz-1 (same program, same values: harmless duplicate stores)
        bq = tl.minimum(pid_b * ROWS + r, Bsz - 1)
        slot = tl.load(idx_ptr + bq)
        lm = tl.where(slot != pad_id, dmask, False)  # live slot
        sb = st_ptr + tl.where(slot != pad_id, slot, 0).to(tl.int64) * ss_s + d * ss_d
        for j in tl.static_range(K - 1):
            wins = wins + (tl.load(sb + j * ss_k, mask=lm, other=0.0),)
        xs = xs + (tl.load(x_ptr + bq.to(tl.int64) * sx_b + d * sx_d, mask=dmask, other=0.0),)
        sbs = sbs + (sb,)
        lms = lms + (lm,)
        ybs = ybs + (y_ptr + bq.to(tl.int64) * sy_b,)
    for r in tl.static_range(ROWS):
        acc = bias
        for j in tl.static_range(K - 1):
            acc += wins[r * (K - 1) + j].to(ACC) * ws[j]
        acc += xs[r].to(ACC) * ws[K - 1]
        acc = tl.where(lms[r], _epilogue(acc, SILU, FAST), 0.0)  # a pad row gets y = 0
        tl.store(ybs[r] + d * sy_d, acc.to(y_ptr.dtype.element_ty), mask=dmask)
        # shift the window: new col c = old col c + 1, the last = the new input
        for j in tl.static_range(K - 1):
            if j < K - 2:
                v = wins[r * (K - 1) + j + 1]
            else:
                v = xs[r]
            tl.store(sbs[r] + j * ss_k, v.to(st_ptr.dtype.element_ty), mask=lms[r])


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _i64d(D, K, *strides):
    """Per-channel offsets (d * stride + tap * stride) could overflow int32 (PyTorch strides are never
    negative)."""
    return (D + K) * max(1, *strides) >= 2 ** 31


def _plan_varlen(dims, call):
    """One prefill call's launch (`call`: the validator's arguments, `out=` last) from the validator's answer:
    (the `Fixed` launch, or None where there is no sequence; the arguments between the tensors and pad_slot_id;
    those after it)."""
    T, D, K, S = dims
    x, weight, bias, conv_states = call[:4]
    activation, out = call[7], call[-1]
    if S == 0:
        return None, (), ()
    interp = _INTERPRETED
    if interp:  # small blocks; exercise both grid orders, both paths, 1-3 chunks per program
        bt, bd, warps, stages, dfirst, nch = 4, min(next_power_of_2(D), 16), 1, 1, T % 2 == 1, 1 + T % 3
    else:
        bt, warps, stages, dfirst = CONFIG["bt"], CONFIG["warps"], CONFIG["stages"], bool(CONFIG["dfirst"])
        bd = min(CONFIG["bd"], max(next_power_of_2(D), 32 * warps))
        while stages > 1 and stages * bt * bd * x.element_size() > 160 * 1024:  # pipeline buffers (fp32/fp64)
            stages -= 1
        # chunks of bt tokens per program: at least `progs` programs, at most `chunks` chunks each
        nch = max(1, min(CONFIG["chunks"], cdiv(T, bt) * cdiv(D, bd) // CONFIG["progs"]))
    seg = bt * nch
    grid_t = max(1, cdiv(T, seg))  # T == 0: one program per channel block still writes the final windows
    grid = (cdiv(D, bd), grid_t) if dfirst else (grid_t, cdiv(D, bd))
    extra = {} if interp or not CONFIG.get("maxnreg") else {"maxnreg": CONFIG["maxnreg"]}
    b = bias if bias is not None else weight
    sy = (out if out is not None else torch.empty_like(x, device="meta")).stride()  # a new y is empty_like(x)
    fixed = Fixed(_conv_varlen_kernel, grid,
                  K=K, BT=bt, BD=bd, STAGES=stages, NSTEPS=max(1, int(S).bit_length()),
                  HAS_BIAS=bias is not None, SILU=activation == "silu", ACC=_acc(x.dtype), DFIRST=dfirst,
                  EVEN_D=D % bd == 0,
                  I64D=_i64d(D, K, x.stride(1), sy[1], weight.stride(0), weight.stride(1), b.stride(0),
                             conv_states.stride(1), conv_states.stride(2)),
                  FAST=nvidia_fast(x) and x.dtype != torch.float64, num_warps=warps, **extra)
    return fixed, (T, D, S), (seg, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), b.stride(0),
                              conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), sy[0], sy[1])


_VARLEN_PLANS = HostPlans(C.validate_causal_conv1d_varlen, _plan_varlen, CONFIG)


@provides("triton", "causal_conv1d_varlen")
def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    fixed, head, tail = _VARLEN_PLANS.plan((x, weight, bias, conv_states, query_start_loc, cache_indices,
                                            has_initial_state, activation, pad_slot_id, out))
    y = out if out is not None else torch.empty_like(x)
    if fixed is None:
        return y
    query_start_loc, cache_indices, has_initial_state = unit_stride(query_start_loc, cache_indices, has_initial_state)
    with device_guard(x):
        launch_fixed(fixed, x, weight, bias if bias is not None else weight, conv_states, query_start_loc,
                     cache_indices, has_initial_state.view(torch.uint8), y, *head, pad_slot_id, *tail)
    return y


def _plan_update(dims, call):
    """One decode call's launch (`call`: the validator's arguments, `out=` last) from the validator's answer:
    (the `Fixed` launch, or None where there is no row; the strides after pad_slot_id)."""
    Bsz, D, K = dims
    x, conv_states, weight, bias = call[:4]
    activation, out = call[5], call[-1]
    if Bsz == 0:
        return None, (), ()
    if _INTERPRETED:
        bd, warps, rows = min(next_power_of_2(D), 16), 1, 2
    else:
        warps, rows = CONFIG["upd_warps"], CONFIG["upd_rows"]
        bd = min(CONFIG["upd_bd"], max(next_power_of_2(D), 32 * warps))
    b = bias if bias is not None else weight
    sx, sw, sb, ss = x.stride(), weight.stride(), b.stride(0), conv_states.stride()
    sy = (out if out is not None else torch.empty_like(x, device="meta")).stride()  # a new y is empty_like(x)
    fixed = Fixed(_conv_update_kernel, (cdiv(Bsz, rows), cdiv(D, bd)),
                  K=K, BD=bd, ROWS=rows, HAS_BIAS=bias is not None, SILU=activation == "silu",
                  ACC=_acc(x.dtype), I64D=_i64d(D, K, sx[1], sy[1], *sw, sb, ss[1], ss[2]),
                  FAST=x.dtype != torch.float64 and nvidia_fast(x), num_warps=warps)
    return fixed, (Bsz, D), (*sx, *sw, sb, *ss, *sy)


_UPDATE_PLANS = HostPlans(C.validate_causal_conv1d_update, _plan_update, CONFIG, same=0)  # out= may be x


@provides("triton", "causal_conv1d_update")
def causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, *, activation=None,
                         pad_slot_id=C.PAD_SLOT_ID, out=None):
    fixed, dims, tail = _UPDATE_PLANS.plan((x, conv_states, weight, bias, conv_state_indices, activation,
                                            pad_slot_id, out))
    y = out if out is not None else torch.empty_like(x)
    if fixed is None:
        return y
    with device_guard(x):
        launch_fixed(fixed, x, weight, bias if bias is not None else weight, conv_states,
                     unit_stride(conv_state_indices)[0], y, *dims, pad_slot_id, *tail)
    return y
