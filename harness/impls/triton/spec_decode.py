"""Triton multi-token decode for speculative decoding: `selective_state_update_spec` (Mamba-1 and Mamba-2
layouts) and `causal_conv1d_update_spec`.

The one-token decode kernels (selective_state_update.py, conv1d.py) with a row's up to S = num_spec + 1
tokens walked inside the program. One program per (row, head, block of P rows) (Mamba-2), per (row, block
of channels) (Mamba-1, conv). A program reads its row's start slot
(state_indices[b, num_accepted_tokens[b] - 1]) once into registers, then for each of the row's positions j
advances the state by token query_start_loc[b] + j in fp32 (fp64 for fp64 inputs), writes the output and
stores the state to slot state_indices[b, j] (unless it is the pad id). The SSM kernels loop over the row's
tokens (fewer live registers than an unrolled walk; a short row costs only its tokens); the conv kernel,
whose window is a tuple of K-1 vectors, walks all S positions unrolled (S is a compile-time constant) and
masks off those past the row's tokens, computed on a stand-in token. A row without tokens or whose start
slot is the pad id reads and writes no slot, and its tokens get y = 0. Slot ids are distinct
over the whole table, so a program is the only reader and writer of its row's slots' tile, and its start
state is in registers before its first store: no race, one launch, no host synchronisation (the layout's
value checks run in the op's validation, which `no_index_checks()` skips). Offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import (Fixed, HostPlans, launch_config, launch_fixed, cdiv, device_guard,
                                          interpreting, next_power_of_2, nvidia_fast, softplus_fast, unit_stride)
from harness.impls.triton.conv1d import _acc as _conv_acc, _channels, _epilogue, _i64d
from harness.impls.triton.selective_state_update import _acc, _clamp, _softplus, limits

# Launch parameters (defaults: those of the one-token kernels, selective_state_update.json / conv1d.json, to be
# confirmed by a sweep on the device; its values in configs/<device>/spec_decode.json). m2: BP rows of P per
# program; m1: bd channels per program; conv: bd channels per program (one per lane).
CONFIG = launch_config("spec_decode", {"m2_bp": 16, "m2_warps": 4, "m1_bd": 64, "m1_warps": 2,
                                       "conv_bd": 256, "conv_warps": 4})

# read once at import (decode is bound by the host's time per call)
_INTERPRETED = interpreting()
_NO_STRIDES = (0, 0, 0)


@triton.jit
def _row(qsl_ptr, tab_ptr, acc_ptr, b, st0, st1, pad_id, S: tl.constexpr):
    """Row b's first token, its token count (0 for a padding row: no tokens or a pad start slot) and its
    start slot (0 for a padding row)."""
    start = tl.load(qsl_ptr + b).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1).to(tl.int64)
    first = tl.minimum(tl.maximum(tl.load(acc_ptr + b).to(tl.int64), 1), S) - 1
    init = tl.load(tab_ptr + b * st0 + first * st1).to(tl.int64)
    ntok = tl.where(init != pad_id, end - start, 0)
    return start, ntok, tl.where(init != pad_id, init, 0)


@triton.jit
def _zero_padding_row(y_ptr, qsl_ptr, b, start, ntok, off, mask, sy_t):
    """A padding row's tokens (those from start + ntok to the row's end: all of them, ntok being 0; none for
    a live row) get y = 0 at the offsets `off` of a token row."""
    end = tl.load(qsl_ptr + b + 1).to(tl.int64)
    for t in range(start + ntok, end):
        tl.store(y_ptr + t * sy_t + off, (off * 0).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pos(tab_ptr, b, j, start, ntok, st0, st1, pad_id):
    """Position j of the row: its token (token 0 past the row's end: a stand-in, to be masked off), whether it
    is a token of the row, whether its slot is a live id, and the slot (0 for a pad)."""
    on = j < ntok
    t = tl.where(on, start + j, 0)
    slot = tl.load(tab_ptr + b * st0 + j * st1).to(tl.int64)
    return t, on, slot != pad_id, tl.where(slot != pad_id, slot, 0)


@triton.jit
def _spec_mamba2_kernel(st_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, qsl_ptr, tab_ptr, acc_ptr,
                        y_ptr, P, N, HPG, pad_id, dt_lo, dt_hi, lim_ptr,
                        ss0, ss1, ss2, ss3, sx0, sx1, sx2, sdt0, sdt1, sa0, sb0, sb1, sb2, sc0, sc1, sc2,
                        sd0, sd1, sz0, sz1, sz2, sdtb0, sy0, sy1, sy2, st0, st1,
                        S: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                        D_PER_P: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
                        ACC: tl.constexpr, LIM_F64: tl.constexpr):
    # one program: row b, head h, rows [pb * BP, + BP) of P; the (BP, N) state tile stays in registers
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pb = tl.program_id(2)
    g = h // HPG
    p = pb.to(tl.int64) * BP + tl.arange(0, BP).to(tl.int64)
    n = tl.arange(0, BN).to(tl.int64)
    pm = p < P
    nm = n < N
    zero = tl.arange(0, BP) * 0  # masks are built as vectors (the interpreter mishandles vector & scalar bools)
    start, ntok, init = _row(qsl_ptr, tab_ptr, acc_ptr, b, st0, st1, pad_id, S)
    # offsets inside a slot (< 2^31 elements) in int32: fewer registers than int64 tile offsets
    tile = h.to(tl.int32) * ss1 + p.to(tl.int32)[:, None] * ss2 + n.to(tl.int32)[None, :] * ss3
    m2 = pm[:, None] & nm[None, :]
    s = tl.load(st_ptr + init * ss0 + tile, mask=m2 & ((zero + ntok) > 0)[:, None], other=0.0).to(ACC)
    a = tl.load(a_ptr + h * sa0).to(ACC)
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + h * sdtb0).to(ACC)
    if HAS_D:
        if D_PER_P:
            dv = tl.load(d_ptr + h * sd0 + p * sd1, mask=pm, other=0.0).to(ACC)
        else:
            dv = tl.load(d_ptr + h * sd0).to(ACC)
    _zero_padding_row(y_ptr, qsl_ptr, b, start, ntok, h * sy1 + p * sy2, pm, sy0)
    for j in range(0, ntok):
        t, on, wr, slot = _pos(tab_ptr, b, j, start, ntok, st0, st1, pad_id)
        xv = tl.load(x_ptr + t * sx0 + h * sx1 + p * sx2, mask=pm, other=0.0).to(ACC)
        dtv = tl.load(dt_ptr + t * sdt0 + h * sdt1).to(ACC)
        if HAS_DTB:
            dtv += dtb
        if SOFTPLUS:
            dtv = _softplus(dtv)
        dtv = _clamp(dtv, dt_lo, dt_hi, lim_ptr, LIM_F64)
        dA = tl.exp(dtv * a)
        bv = tl.load(b_ptr + t * sb0 + g * sb1 + n * sb2, mask=nm, other=0.0).to(ACC)
        cv = tl.load(c_ptr + t * sc0 + g * sc1 + n * sc2, mask=nm, other=0.0).to(ACC)
        s = s * dA + (xv * dtv)[:, None] * bv[None, :]
        y = tl.sum(s * cv[None, :], axis=1)
        if HAS_D:
            y += dv * xv
        if HAS_Z:
            zv = tl.load(z_ptr + t * sz0 + h * sz1 + p * sz2, mask=pm, other=0.0).to(ACC)
            y = y * zv / (1.0 + tl.exp(-zv))
        tl.store(y_ptr + t * sy0 + h * sy1 + p * sy2, y.to(y_ptr.dtype.element_ty), mask=pm)
        wv = (zero + wr.to(tl.int32)) != 0
        tl.store(st_ptr + slot * ss0 + tile, s.to(st_ptr.dtype.element_ty), mask=m2 & wv[:, None])


@triton.jit
def _spec_mamba1_kernel(st_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, qsl_ptr, tab_ptr, acc_ptr,
                        y_ptr, Dm, N, CPG, pad_id, dt_lo, dt_hi, lim_ptr,
                        ss0, ss1, ss2, sx0, sx1, sdt0, sdt1, sa0, sa1, sb0, sb1, sb2, sc0, sc1, sc2,
                        sd0, sz0, sz1, sdtb0, sy0, sy1, st0, st1,
                        S: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, GU: tl.constexpr, HAS_D: tl.constexpr,
                        HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, ACC: tl.constexpr,
                        LIM_F64: tl.constexpr, FAST: tl.constexpr):
    # one program: row b, channels [pd * BD, + BD); the (BD, N) state tile stays in registers. The math is
    # the one-token kernel's (exp2 with A pre-scaled by log2 e, except for fp64).
    b = tl.program_id(0).to(tl.int64)
    pd = tl.program_id(1)
    d = pd * BD + tl.arange(0, BD)
    d64 = d.to(tl.int64)
    n64 = tl.arange(0, BN).to(tl.int64)
    dm = d < Dm
    nm = n64 < N
    m2 = dm[:, None] & nm[None, :]
    g0 = (pd * BD) // CPG
    g = (d // CPG).to(tl.int64)
    zero = d * 0
    start, ntok, init = _row(qsl_ptr, tab_ptr, acc_ptr, b, st0, st1, pad_id, S)
    # offsets inside a slot (< 2^31 elements) in int32: fewer registers than int64 tile offsets
    tile = d[:, None] * ss1 + n64.to(tl.int32)[None, :] * ss2
    s = tl.load(st_ptr + init * ss0 + tile, mask=m2 & ((zero + ntok) > 0)[:, None], other=0.0).to(ACC)
    a = tl.load(a_ptr + d64[:, None] * sa0 + n64[None, :] * sa1, mask=m2, other=0.0).to(ACC)
    if not LIM_F64:
        a = a * 1.4426950408889634
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + d64 * sdtb0, mask=dm, other=0.0).to(ACC)
    if HAS_D:
        dsk = tl.load(d_ptr + d64 * sd0, mask=dm, other=0.0).to(ACC)
    _zero_padding_row(y_ptr, qsl_ptr, b, start, ntok, d64 * sy1, dm, sy0)
    for j in range(0, ntok):
        t, on, wr, slot = _pos(tab_ptr, b, j, start, ntok, st0, st1, pad_id)
        xv = tl.load(x_ptr + t * sx0 + d64 * sx1, mask=dm, other=0.0).to(ACC)
        dtv = tl.load(dt_ptr + t * sdt0 + d64 * sdt1, mask=dm, other=0.0).to(ACC)
        if GU:  # all channels of the block read one group: the B/C rows as (1, BN)
            bv = tl.load(b_ptr + t * sb0 + g0 * sb1 + n64 * sb2, mask=nm, other=0.0).to(ACC)[None, :]
            cv = tl.load(c_ptr + t * sc0 + g0 * sc1 + n64 * sc2, mask=nm, other=0.0).to(ACC)[None, :]
        else:
            bv = tl.load(b_ptr + t * sb0 + g[:, None] * sb1 + n64[None, :] * sb2, mask=m2, other=0.0).to(ACC)
            cv = tl.load(c_ptr + t * sc0 + g[:, None] * sc1 + n64[None, :] * sc2, mask=m2, other=0.0).to(ACC)
        if HAS_DTB:
            dtv += dtb
        if LIM_F64:
            if SOFTPLUS:
                dtv = _softplus(dtv)
            dtv = _clamp(dtv, dt_lo, dt_hi, lim_ptr, LIM_F64)
            dA = tl.exp(dtv[:, None] * a)
        else:
            if SOFTPLUS:
                dtv = softplus_fast(dtv, FAST)
            dtv = _clamp(dtv, dt_lo, dt_hi, lim_ptr, LIM_F64)
            dA = tl.exp2(dtv[:, None] * a)
        s = s * dA + (xv * dtv)[:, None] * bv
        y = tl.sum(s * cv, axis=1)
        if HAS_D:
            y += dsk * xv
        if HAS_Z:
            zv = tl.load(z_ptr + t * sz0 + d64 * sz1, mask=dm, other=0.0).to(ACC)
            if LIM_F64:
                y = y * zv / (1.0 + tl.exp(-zv))
            else:
                y = y * zv / (1.0 + tl.exp2(zv * -1.4426950408889634))
        tl.store(y_ptr + t * sy0 + d64 * sy1, y.to(y_ptr.dtype.element_ty), mask=dm)
        wv = (zero + wr.to(tl.int32)) != 0
        tl.store(st_ptr + slot * ss0 + tile, s.to(st_ptr.dtype.element_ty), mask=m2 & wv[:, None])


# as the one-token conv kernel: sx_d / sy_d / sb_d stay runtime values, every access in one lane-per-channel layout
@triton.jit(do_not_specialize=["sx_d", "sy_d", "sb_d"])
def _spec_conv_kernel(x_ptr, w_ptr, b_ptr, st_ptr, qsl_ptr, tab_ptr, acc_ptr, y_ptr, D, pad_id,
                      sx_t, sx_d, sw_d, sw_k, sb_d, ss_s, ss_d, ss_k, sy_t, sy_d, st0, st1,
                      S: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SILU: tl.constexpr, ACC: tl.constexpr, I64D: tl.constexpr, FAST: tl.constexpr):
    # one program: row b, channels [pid_d * BD, + BD); the window (K-1 inputs per channel, oldest first) is a
    # tuple of K-1 vectors in registers, shifted by one input per position
    b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    d, dmask, ws, bias = _channels(w_ptr, b_ptr, pid_d, D, sw_d, sw_k, sb_d, K, BD, HAS_BIAS, ACC, I64D)
    start, ntok, init = _row(qsl_ptr, tab_ptr, acc_ptr, b, st0, st1, pad_id, S)
    _zero_padding_row(y_ptr, qsl_ptr, b, start, ntok, d * sy_d, dmask, sy_t)
    lm = tl.where(ntok > 0, dmask, False)
    sb = st_ptr + init * ss_s + d * ss_d
    win = ()
    for k in tl.static_range(K - 1):
        win = win + (tl.load(sb + k * ss_k, mask=lm, other=0.0),)
    for j in tl.static_range(S):
        t, on, wr, slot = _pos(tab_ptr, b, j, start, ntok, st0, st1, pad_id)
        xv = tl.load(x_ptr + t * sx_t + d * sx_d, mask=dmask, other=0.0)
        acc = bias
        for k in tl.static_range(K - 1):
            acc += win[k].to(ACC) * ws[k]
        acc += xv.to(ACC) * ws[K - 1]
        acc = _epilogue(acc, SILU, FAST)
        tl.store(y_ptr + t * sy_t + d * sy_d, acc.to(y_ptr.dtype.element_ty), mask=tl.where(on, dmask, False))
        nw = ()
        for k in tl.static_range(K - 2):
            nw = nw + (win[k + 1],)
        win = nw + (xv.to(st_ptr.dtype.element_ty),)
        sj = st_ptr + slot * ss_s + d * ss_d
        wm = tl.where(on & wr, dmask, False)
        for k in tl.static_range(K - 1):
            tl.store(sj + k * ss_k, win[k].to(st_ptr.dtype.element_ty), mask=wm)


def _plan_ssu(layout, call, dt_softplus):
    """One call's launch (`call`: the validator's arguments, `out=` last) from the validator's answer `layout`:
    (the `Fixed` launch, or None where there is no token or row; the arguments between the tensors and
    pad_slot_id; those after dt_limit's bounds; whether dt_limit is passed as an fp64 tensor)."""
    state, x, dt, A, B, Cm, D, z, dt_bias = call[:9]
    table, out = call[10], call[-1]
    Bsz, S = layout[-2:]
    if x.shape[0] == 0 or Bsz == 0:
        return None, (), (), False
    interp = _INTERPRETED
    acc = _acc(x, state)
    common = dict(S=S, HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None,
                  SOFTPLUS=bool(dt_softplus), ACC=acc, LIM_F64=acc is tl.float64)
    sd = D.stride() if D is not None else _NO_STRIDES
    sz = z.stride() if z is not None else _NO_STRIDES
    sdtb = dt_bias.stride(0) if dt_bias is not None else 0
    sy = (out if out is not None else torch.empty_like(x, device="meta")).stride()  # a new y is empty_like(x)
    st = unit_stride(table)[0].stride()
    if layout[0] == "mamba2":
        _, _, H, P, N, G = layout[:6]
        BP = min(next_power_of_2(P), 16 if interp else CONFIG["m2_bp"])
        fixed = Fixed(_spec_mamba2_kernel, (Bsz, H, cdiv(P, BP)),
                      BP=BP, BN=next_power_of_2(N), D_PER_P=D is not None and D.dim() == 2,
                      num_warps=1 if interp else CONFIG["m2_warps"], **common)
        head = (P, N, H // G)
        tail = (*state.stride(), *x.stride(), *dt.stride(), A.stride(0), *B.stride(), *Cm.stride(),
                sd[0], sd[1] if D is not None and D.dim() == 2 else 0, sz[0], sz[1], sz[2], sdtb, *sy, *st)
    else:
        _, _, Dm, N, G = layout[:5]
        BD = min(next_power_of_2(Dm), 16 if interp else CONFIG["m1_bd"])
        fixed = Fixed(_spec_mamba1_kernel, (Bsz, cdiv(Dm, BD)),
                      BD=BD, BN=next_power_of_2(N), GU=(Dm // G) % BD == 0,
                      FAST=acc is tl.float32 and nvidia_fast(x), num_warps=1 if interp else CONFIG["m1_warps"],
                      **common)
        head = (Dm, N, Dm // G)
        tail = (*state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *Cm.stride(),
                sd[0], sz[0], sz[1], sdtb, *sy, *st)
    return fixed, head, tail, acc is tl.float64


_SSU_PLANS = HostPlans(C.validate_selective_state_update_spec, _plan_ssu, CONFIG)


@provides("triton", "selective_state_update_spec")
def selective_state_update_spec(state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc, state_batch_indices,
                                num_accepted_tokens, *, dt_softplus=True, dt_limit=(0.0, C.INF),
                                pad_slot_id=C.PAD_SLOT_ID, out=None):
    fixed, head, tail, f64 = _SSU_PLANS.plan((state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc,
                                              state_batch_indices, num_accepted_tokens, dt_limit, pad_slot_id, out),
                                             (dt_softplus,))
    y = out if out is not None else torch.empty_like(x)
    if fixed is None:
        return y
    lo, hi, lim = limits(dt_limit, f64, x)
    with device_guard(x):
        launch_fixed(fixed, state, x, dt, A, B, Cm, D if D is not None else x, z if z is not None else x,
                     dt_bias if dt_bias is not None else dt,
                     *unit_stride(query_start_loc, state_batch_indices, num_accepted_tokens), y,
                     *head, pad_slot_id, lo, hi, lim, *tail)
    return y


def _plan_conv(dims, call):
    """One call's launch (`call`: the validator's arguments, `out=` last) from the validator's answer: (the
    `Fixed` launch, or None where there is no token or row; the strides after pad_slot_id)."""
    T, D, K, Bsz, S = dims
    x, conv_states, weight, bias = call[:4]
    table, activation, out = call[5], call[7], call[-1]
    if T == 0 or Bsz == 0:
        return None, (), ()
    if _INTERPRETED:
        bd, warps = min(next_power_of_2(D), 16), 1
    else:
        warps = CONFIG["conv_warps"]
        bd = min(CONFIG["conv_bd"], max(next_power_of_2(D), 32 * warps))
    b = bias if bias is not None else weight
    sx, sw, sb, ss = x.stride(), weight.stride(), b.stride(0), conv_states.stride()
    sy = (out if out is not None else torch.empty_like(x, device="meta")).stride()  # a new y is empty_like(x)
    fixed = Fixed(_spec_conv_kernel, (Bsz, cdiv(D, bd)),
                  S=S, K=K, BD=bd, HAS_BIAS=bias is not None, SILU=activation == "silu", ACC=_conv_acc(x.dtype),
                  I64D=_i64d(D, K, sx[1], sy[1], *sw, sb, ss[1], ss[2]),
                  FAST=x.dtype != torch.float64 and nvidia_fast(x), num_warps=warps)
    return fixed, (D,), (*sx, *sw, sb, *ss, *sy, *unit_stride(table)[0].stride())


_CONV_PLANS = HostPlans(C.validate_causal_conv1d_update_spec, _plan_conv, CONFIG, same=0)  # out= may be x


@provides("triton", "causal_conv1d_update_spec")
def causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens,
                              *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    fixed, head, tail = _CONV_PLANS.plan((x, conv_states, weight, bias, query_start_loc, conv_state_indices,
                                          num_accepted_tokens, activation, pad_slot_id, out))
    y = out if out is not None else torch.empty_like(x)
    if fixed is None:
        return y
    with device_guard(x):
        launch_fixed(fixed, x, weight, bias if bias is not None else weight, conv_states,
                     *unit_stride(query_start_loc, conv_state_indices, num_accepted_tokens), y, *head, pad_slot_id,
                     *tail)
    return y
