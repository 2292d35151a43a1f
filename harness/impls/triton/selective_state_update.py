"""Triton decode step (`selective_state_update`) for both state layouts.

Mamba-2 (num_slots, H, P, N): one program per (batch row, head, block of P rows); it streams its
(BP, N) tile of the state once (read, update in fp32, write), with dt/A/D per head as scalars and
the group's B/C rows as N-vectors. Mamba-1 (num_slots, Dm, N): one program per (block of BD channels,
TILES x ROWS batch rows); each (ROWS, BD, N) tile's state is one contiguous BD*N run per row in a dense pool,
loaded and stored as a (ROWS, BD*N) block in 16-byte vectors, A/D/dt_bias once per program, fp32 math via
exp2 (A pre-scaled by log2 e). Pad rows touch nothing. Offsets are int64 (indices int32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import (Fixed, HostPlans, cdiv, device_guard, interpreting, launch_config,
                                          launch_fixed, next_power_of_2, nvidia_fast, softplus_fast, unit_stride)

# Launch parameters (m2_*: defaults from the H200 sweep, 2026-11-29; m1_*: the offline sm_90 compile's pick, to be
# confirmed by `harness bench sweep --op selective_state_update`; the device's values in
# configs/<device>/selective_state_update.json). m1: bd channels x rows batch rows per tile, tiles tiles per
# program (looped, the next tile prefetched), dfirst: channel blocks on grid axis 0. m2: bp head-dim rows per
# program, pfirst: head-dim blocks on grid axis 0 (consecutive programs read consecutive blocks of one slot's
# head) instead of batch rows.
CONFIG = launch_config("selective_state_update", {"m2_bp": 16, "m2_warps": 4, "m2_pfirst": 0, "m1_bd": 64,
                                                  "m1_warps": 2, "m1_rows": 2, "m1_tiles": 1, "m1_dfirst": 1})

# Triton decides at import whether its kernels are interpreted; reading the environment once keeps it off the
# per-call path (decode is bound by the host's time per call)
_INTERPRETED = interpreting()
_NO_Z = (0, 0, 0)


@triton.jit
def _softplus(x):
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _clamp(v, lo, hi, lim_ptr, LIM_F64: tl.constexpr):
    # float kernel arguments arrive as fp32; fp64 runs read exact fp64 limits from a tensor instead
    if LIM_F64:
        lo = tl.load(lim_ptr)
        hi = tl.load(lim_ptr + 1)
    return tl.minimum(tl.maximum(v, lo), hi)


@triton.jit
def _ssu_mamba2_kernel(st_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, idx_ptr, y_ptr,
                       P, N, HPG, pad_id, dt_lo, dt_hi, lim_ptr,
                       ss0, ss1, ss2, ss3, sx0, sx1, sx2, sdt0, sdt1, sb0, sb1, sb2, sc0, sc1, sc2,
                       sd0, sd1, sz0, sz1, sz2, sy0, sy1, sy2,
                       BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, D_PER_P: tl.constexpr,
                       HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, ACC: tl.constexpr,
                       LIM_F64: tl.constexpr, PFIRST: tl.constexpr):
    if PFIRST:  # consecutive programs: consecutive head-dim blocks of the same slot and head
        pb = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
    else:
        b = tl.program_id(0).to(tl.int64)
        pb = tl.program_id(2)
    h = tl.program_id(1).to(tl.int64)
    g = h // HPG
    p = pb.to(tl.int64) * BP + tl.arange(0, BP).to(tl.int64)
    n = tl.arange(0, BN).to(tl.int64)
    pm = p < P
    nm = n < N
    slot = tl.load(idx_ptr + b).to(tl.int64)
    live = (p * 0 + slot) != pad_id  # as a vector (the interpreter mishandles vector & scalar bools)
    slot = tl.where(slot != pad_id, slot, 0)
    sptr = st_ptr + slot * ss0 + h * ss1 + p[:, None] * ss2 + n[None, :] * ss3
    smask = (pm & live)[:, None] & nm[None, :]
    s = tl.load(sptr, mask=smask, other=0.0).to(ACC)
    xv = tl.load(x_ptr + b * sx0 + h * sx1 + p * sx2, mask=pm, other=0.0).to(ACC)
    dtv = tl.load(dt_ptr + b * sdt0 + h * sdt1).to(ACC)
    if HAS_DTB:
        dtv += tl.load(dtb_ptr + h).to(ACC)
    if SOFTPLUS:
        dtv = _softplus(dtv)
    dtv = _clamp(dtv, dt_lo, dt_hi, lim_ptr, LIM_F64)
    a = tl.load(a_ptr + h).to(ACC)
    dA = tl.exp(dtv * a)
    bv = tl.load(b_ptr + b * sb0 + g * sb1 + n * sb2, mask=nm, other=0.0).to(ACC)
    cv = tl.load(c_ptr + b * sc0 + g * sc1 + n * sc2, mask=nm, other=0.0).to(ACC)
    s = s * dA + (xv * dtv)[:, None] * bv[None, :]
    y = tl.sum(s * cv[None, :], axis=1)
    if HAS_D:
        if D_PER_P:
            dv = tl.load(d_ptr + h * sd0 + p * sd1, mask=pm, other=0.0).to(ACC)
        else:
            dv = tl.load(d_ptr + h * sd0).to(ACC)
        y += dv * xv
    if HAS_Z:
        zv = tl.load(z_ptr + b * sz0 + h * sz1 + p * sz2, mask=pm, other=0.0).to(ACC)
        y = y * zv / (1.0 + tl.exp(-zv))
    y = tl.where(live, y, 0.0)  # a pad row gets y = 0
    tl.store(y_ptr + b * sy0 + h * sy1 + p * sy2, y.to(y_ptr.dtype.element_ty), mask=pm)
    tl.store(sptr, s.to(st_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _m1_state_ptrs(st_ptr, slot, live, pd, d64, n64, m2, Dm, ss0, ss1, ss2, BD: tl.constexpr, BN: tl.constexpr,
                   DENSE: tl.constexpr, EVEN_D: tl.constexpr):
    # pointers / mask of a tile's state: (ROWS, BD*BN) when DENSE (the slot rows are (Dm, N) row-major with
    # N == BN: one contiguous BD*BN run per row), else (ROWS, BD, BN)
    if DENSE:
        f = tl.arange(0, BD * BN)
        sptr = (st_ptr + slot * ss0 + pd.to(tl.int64) * (BD * BN))[:, None] + f[None, :]
        if EVEN_D:
            smask = live[:, None] & tl.full((BD * BN,), 1, tl.int1)[None, :]
        else:
            smask = live[:, None] & ((pd * (BD * BN) + f) < Dm * BN)[None, :]
    else:
        sptr = (st_ptr + slot[:, None, None] * ss0) + (d64[:, None] * ss1 + n64[None, :] * ss2)[None, :, :]
        smask = live[:, None, None] & m2[None, :, :]
    return sptr, smask


@triton.jit
def _m1_load(st_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, idx_ptr, b, b_hi, pd, d64, n64, dm, nm, m2, g0, g,
             Dm, pad_id, ss0, ss1, ss2, sx0, sx1, sdt0, sdt1, sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1,
             BD: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, GU: tl.constexpr, HAS_Z: tl.constexpr,
             DENSE: tl.constexpr, EVEN_B: tl.constexpr, EVEN_D: tl.constexpr):
    # the loads of one (ROWS, BD, BN) tile (rows b, those >= b_hi masked off), values left in their storage dtypes
    b64 = b.to(tl.int64)
    if EVEN_B:  # constant-true masks fold away
        rowm = tl.full((ROWS,), 1, tl.int1)
    else:
        rowm = b < b_hi
    m_rd = rowm[:, None] & dm[None, :]  # (ROWS, BD)
    slot = tl.load(idx_ptr + b, mask=rowm, other=pad_id).to(tl.int64)  # (ROWS,)
    live = slot != pad_id  # masked-off rows read as pads
    slot = tl.where(live, slot, 0)
    sptr, smask = _m1_state_ptrs(st_ptr, slot, live, pd, d64, n64, m2, Dm, ss0, ss1, ss2, BD, BN, DENSE, EVEN_D)
    s = tl.load(sptr, mask=smask, other=0.0)
    if DENSE:
        s = tl.reshape(s, (ROWS, BD, BN))
    xv = tl.load((x_ptr + b64 * sx0)[:, None] + (d64 * sx1)[None, :], mask=m_rd, other=0.0)
    dtv = tl.load((dt_ptr + b64 * sdt0)[:, None] + (d64 * sdt1)[None, :], mask=m_rd, other=0.0)
    if HAS_Z:
        zv = tl.load((z_ptr + b64 * sz0)[:, None] + (d64 * sz1)[None, :], mask=m_rd, other=0.0)
    else:
        zv = xv
    if GU:  # all channels of the block read one group: the B/C rows as (ROWS, 1, BN)
        m_rn = rowm[:, None] & nm[None, :]
        bv = tl.load((b_ptr + b64 * sb0 + g0 * sb1)[:, None] + (n64 * sb2)[None, :], mask=m_rn, other=0.0)
        cv = tl.load((c_ptr + b64 * sc0 + g0 * sc1)[:, None] + (n64 * sc2)[None, :], mask=m_rn, other=0.0)
        bv = bv[:, None, :]
        cv = cv[:, None, :]
    else:
        m3 = rowm[:, None, None] & m2[None, :, :]
        bv = tl.load((b_ptr + b64 * sb0)[:, None, None] + (g[:, None] * sb1 + n64[None, :] * sb2)[None, :, :],
                     mask=m3, other=0.0)
        cv = tl.load((c_ptr + b64 * sc0)[:, None, None] + (g[:, None] * sc1 + n64[None, :] * sc2)[None, :, :],
                     mask=m3, other=0.0)
    return slot, live, s, xv, dtv, zv, bv, cv, b64, m_rd


@triton.jit
def _m1_step(st_ptr, y_ptr, slot, live, s, xv, dtv, zv, bv, cv, b64, m_rd, a, dtb, dsk, pd, d64, n64, m2, Dm,
             ss0, ss1, ss2, sy0, sy1, dt_lo, dt_hi, lim_ptr, EVEN_D: tl.constexpr, HAS_D: tl.constexpr,
             HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr,
             SOFTPLUS: tl.constexpr, ACC: tl.constexpr, LIM_F64: tl.constexpr, DENSE: tl.constexpr,
             FAST: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    # update one loaded tile, write y and the state back
    s = s.to(ACC)
    xv = xv.to(ACC)
    dtv = dtv.to(ACC)
    if HAS_DTB:
        dtv += dtb[None, :]
    if LIM_F64:
        if SOFTPLUS:
            dtv = _softplus(dtv)
        dtv = _clamp(dtv, dt_lo, dt_hi, lim_ptr, LIM_F64)
        dA = tl.exp(dtv[:, :, None] * a[None, :, :])
    else:  # a holds A * log2(e): exp(dt*A) = exp2(dt * a), one FMUL + one MUFU.EX2 per state element
        if SOFTPLUS:
            dtv = softplus_fast(dtv, FAST)
        dtv = _clamp(dtv, dt_lo, dt_hi, lim_ptr, LIM_F64)
        dA = tl.exp2(dtv[:, :, None] * a[None, :, :])
    s = s * dA + (xv * dtv)[:, :, None] * bv.to(ACC)
    y = tl.sum(s * cv.to(ACC), axis=2)  # (ROWS, BD)
    if HAS_D:
        y += dsk[None, :] * xv
    if HAS_Z:
        zv = zv.to(ACC)
        if LIM_F64:
            y = y * zv / (1.0 + tl.exp(-zv))
        else:
            y = y * zv / (1.0 + tl.exp2(zv * -1.4426950408889634))
    y = tl.where(live[:, None], y, 0.0)  # a pad row gets y = 0
    tl.store((y_ptr + b64 * sy0)[:, None] + (d64 * sy1)[None, :], y.to(y_ptr.dtype.element_ty), mask=m_rd)
    sptr, smask = _m1_state_ptrs(st_ptr, slot, live, pd, d64, n64, m2, Dm, ss0, ss1, ss2, BD, BN, DENSE, EVEN_D)
    if DENSE:
        tl.store(sptr, tl.reshape(s.to(st_ptr.dtype.element_ty), (ROWS, BD * BN)), mask=smask)
    else:
        tl.store(sptr, s.to(st_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _ssu_mamba1_kernel(st_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, idx_ptr, y_ptr,
                       Bsz, Dm, N, CPG, pad_id, dt_lo, dt_hi, lim_ptr,
                       ss0, ss1, ss2, sx0, sx1, sdt0, sdt1, sa0, sa1, sb0, sb1, sb2, sc0, sc1, sc2,
                       sd0, sz0, sz1, sy0, sy1,
                       BD: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, GU: tl.constexpr,
                       HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
                       ACC: tl.constexpr, LIM_F64: tl.constexpr, DFIRST: tl.constexpr, DENSE: tl.constexpr,
                       FAST: tl.constexpr, EVEN_B: tl.constexpr, EVEN_D: tl.constexpr, EVEN_N: tl.constexpr):
    # one program: BD channels x TILES*ROWS batch rows, as TILES (ROWS, BD, BN) tiles. A tile's state is loaded
    # and stored as one block (a contiguous BD*N run per row in a dense pool: 16-byte vectors); with TILES > 1
    # the program loops over its tiles, issuing tile t+1's loads before tile t is updated and stored. A, D and
    # dt_bias are loaded once per program.
    if DFIRST:  # consecutive programs: consecutive channel blocks of the same rows
        pd = tl.program_id(0)
        pid_b = tl.program_id(1)
    else:
        pid_b = tl.program_id(0)
        pd = tl.program_id(1)
    # channel / row / state indices fit int32; int64 only where they scale a stride (per row or channel vectors)
    d = pd * BD + tl.arange(0, BD)  # (BD,)
    n = tl.arange(0, BN)  # (BN,)
    d64 = d.to(tl.int64)
    n64 = n.to(tl.int64)
    if EVEN_D:  # constant-true masks fold away
        dm = tl.full((BD,), 1, tl.int1)
    else:
        dm = d < Dm
    if EVEN_N:
        nm = tl.full((BN,), 1, tl.int1)
    else:
        nm = n < N
    m2 = dm[:, None] & nm[None, :]  # (BD, BN)
    g0 = (pd * BD) // CPG
    g = (d // CPG).to(tl.int64)
    b_lo = pid_b * (ROWS * TILES)
    b_hi = tl.minimum(b_lo + ROWS * TILES, Bsz)
    b = b_lo + tl.arange(0, ROWS)  # (ROWS,)
    slot, live, s, xv, dtv, zv, bv, cv, b64, m_rd = _m1_load(
        st_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, idx_ptr, b, b_hi, pd, d64, n64, dm, nm, m2, g0, g,
        Dm, pad_id, ss0, ss1, ss2, sx0, sx1, sdt0, sdt1, sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1,
        BD, BN, ROWS, GU, HAS_Z, DENSE, EVEN_B, EVEN_D)
    a = tl.load(a_ptr + d64[:, None] * sa0 + n64[None, :] * sa1, mask=m2, other=0.0).to(ACC)
    if not LIM_F64:
        a = a * 1.4426950408889634
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + d64, mask=dm, other=0.0).to(ACC)
    else:
        dtb = tl.zeros((BD,), ACC)
    if HAS_D:
        dsk = tl.load(d_ptr + d64 * sd0, mask=dm, other=0.0).to(ACC)
    else:
        dsk = tl.zeros((BD,), ACC)
    if TILES == 1:
        _m1_step(st_ptr, y_ptr, slot, live, s, xv, dtv, zv, bv, cv, b64, m_rd, a, dtb, dsk, pd, d64, n64, m2, Dm,
                 ss0, ss1, ss2, sy0, sy1, dt_lo, dt_hi, lim_ptr, EVEN_D, HAS_D, HAS_Z, HAS_DTB, SOFTPLUS, ACC,
                 LIM_F64, DENSE, FAST, ROWS, BD, BN)
    else:
        for t in range(TILES):  # a loop (not unrolled): registers for one tile in flight plus one being updated
            n_slot, n_live, n_s, n_xv, n_dtv, n_zv, n_bv, n_cv, n_b64, n_m_rd = _m1_load(
                st_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, idx_ptr, b + (t + 1) * ROWS, b_hi, pd, d64, n64, dm,
                nm, m2, g0, g, Dm, pad_id, ss0, ss1, ss2, sx0, sx1, sdt0, sdt1, sb0, sb1, sb2, sc0, sc1, sc2,
                sz0, sz1, BD, BN, ROWS, GU, HAS_Z, DENSE, False, EVEN_D)  # the last prefetch is all masked off
            _m1_step(st_ptr, y_ptr, slot, live, s, xv, dtv, zv, bv, cv, b64, m_rd, a, dtb, dsk, pd, d64, n64, m2,
                     Dm, ss0, ss1, ss2, sy0, sy1, dt_lo, dt_hi, lim_ptr, EVEN_D, HAS_D, HAS_Z, HAS_DTB, SOFTPLUS,
                     ACC, LIM_F64, DENSE, FAST, ROWS, BD, BN)
            slot, live, s, xv, dtv, zv, bv, cv, b64, m_rd = (n_slot, n_live, n_s, n_xv, n_dtv, n_zv, n_bv,
                                                             n_cv, n_b64, n_m_rd)


def _acc(x, state):
    """The accumulator type: triton.language's float64 or float32 object itself (launchers compare it with
    `is`; a tl.dtype's == runs Python code on every launch)."""
    return tl.float64 if x.dtype == torch.float64 or state.dtype == torch.float64 else tl.float32


def _plan(layout, call, dt_softplus):
    """One call's launch (`call`: the validator's arguments, `out=` last) from the validator's answer `layout`:
    (the `Fixed` launch, or None where there is no row; the arguments between the tensors and pad_slot_id; those
    after dt_limit's bounds; whether dt_limit is passed as an fp64 tensor)."""
    state, x, dt, A, B, Cm, D, z, dt_bias = call[:9]
    out = call[-1]
    if x.shape[0] == 0:
        return None, (), (), False
    interp = _INTERPRETED
    acc = _acc(x, state)
    common = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None,
                  SOFTPLUS=bool(dt_softplus), ACC=acc, LIM_F64=acc is tl.float64)
    sd = D.stride() if D is not None else _NO_Z
    sz = z.stride() if z is not None else _NO_Z
    sy = (out if out is not None else torch.empty_like(x, device="meta")).stride()  # a new y is empty_like(x)
    if layout[0] == "mamba2":
        _, Bsz, H, P, N, G = layout
        BN = next_power_of_2(N)
        BP = min(next_power_of_2(P), 16 if interp else CONFIG["m2_bp"])
        pfirst = bool(CONFIG["m2_pfirst"]) and Bsz <= 65535  # grid dims 1, 2 are limited to 65535
        fixed = Fixed(_ssu_mamba2_kernel, (cdiv(P, BP), H, Bsz) if pfirst else (Bsz, H, cdiv(P, BP)),
                      BP=BP, BN=BN, D_PER_P=D is not None and D.dim() == 2, PFIRST=pfirst,
                      num_warps=1 if interp else CONFIG["m2_warps"], **common)
        head = (P, N, H // G)
        tail = (*state.stride(), *x.stride(), *dt.stride(), *B.stride(), *Cm.stride(),
                sd[0], sd[1] if len(sd) == 2 else 0, sz[0], sz[1], sz[2], *sy)
    else:
        _, Bsz, Dm, N, G = layout
        BN = next_power_of_2(N)
        BD = min(next_power_of_2(Dm), 16 if interp else CONFIG["m1_bd"])
        rows = min(next_power_of_2(Bsz), 2 if interp else CONFIG["m1_rows"])
        tiles = max(1, min(cdiv(Bsz, rows), 2 if interp else CONFIG["m1_tiles"]))
        nb, nd = cdiv(Bsz, rows * tiles), cdiv(Dm, BD)
        dfirst = bool(CONFIG["m1_dfirst"]) and nb <= 65535  # grid dims 1, 2 are limited to 65535
        fixed = Fixed(_ssu_mamba1_kernel, (nd, nb) if dfirst else (nb, nd),
                      BD=BD, BN=BN, ROWS=rows, TILES=tiles, GU=(Dm // G) % BD == 0, DFIRST=dfirst,
                      DENSE=N == BN and state.stride(2) == 1 and state.stride(1) == N,
                      FAST=acc is tl.float32 and nvidia_fast(x),
                      EVEN_B=tiles == 1 and Bsz % rows == 0, EVEN_D=Dm % BD == 0, EVEN_N=N == BN,
                      num_warps=1 if interp else CONFIG["m1_warps"], **common)
        head = (Bsz, Dm, N, Dm // G)
        tail = (*state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *Cm.stride(),
                sd[0], sz[0], sz[1], *sy)
    return fixed, head, tail, acc is tl.float64


_PLANS = HostPlans(C.validate_selective_state_update, _plan, CONFIG)


def limits(dt_limit, f64: bool, like):
    """dt_limit's bounds as two floats, and the tensor the kernels read them from in fp64 (`like` where they
    take the float arguments)."""
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    return lo, hi, torch.tensor([lo, hi], dtype=torch.float64, device=like.device) if f64 else like


@provides("triton", "selective_state_update")
def selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
                           dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    fixed, head, tail, f64 = _PLANS.plan((state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, dt_limit,
                                          pad_slot_id, out), (dt_softplus,))
    y = out if out is not None else torch.empty_like(x)
    if fixed is None:
        return y
    lo, hi, lim = limits(dt_limit, f64, x)
    with device_guard(x):
        launch_fixed(fixed, state, x, dt, A, B, Cm, D if D is not None else x, z if z is not None else x,
                     dt_bias if dt_bias is not None else dt, unit_stride(state_batch_indices)[0], y,
                     *head, pad_slot_id, lo, hi, lim, *tail)
    return y
