"""Triton decode step (`selective_state_update`) for both state layouts.

Mamba-2 (num_slots, H, P, N): one program per (batch row, head, block of P rows); it streams its
(BP, N) tile of the state once (read, update in fp32, write), with dt/A/D per head as scalars and
the group's B/C rows as N-vectors. Mamba-1 (num_slots, Dm, N): one program per (batch row, block of
channels), a (BD, N) tile. Pad rows touch nothing. Offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.triton._common import launch_config, cdiv, device_guard, interpreting, next_power_of_2

# Launch parameters (defaults from the H200 sweep of scripts/gpu_ops_bench.py, 2026-11-29).
CONFIG = launch_config("selective_state_update", {"m2_bp": 16, "m2_warps": 4, "m1_bd": 32, "m1_warps": 4, "m1_rows": 8})


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
                       LIM_F64: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pb = tl.program_id(2)
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
    tl.store(y_ptr + b * sy0 + h * sy1 + p * sy2, y.to(y_ptr.dtype.element_ty), mask=pm)
    tl.store(sptr, s.to(st_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _ssu_mamba1_kernel(st_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, idx_ptr, y_ptr,
                       Bsz, Dm, N, CPG, pad_id, dt_lo, dt_hi, lim_ptr,
                       ss0, ss1, ss2, sx0, sx1, sdt0, sdt1, sa0, sa1, sb0, sb1, sb2, sc0, sc1, sc2,
                       sd0, sz0, sz1, sy0, sy1,
                       BD: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, GU: tl.constexpr, HAS_D: tl.constexpr,
                       HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, ACC: tl.constexpr,
                       LIM_F64: tl.constexpr):
    # one program: ROWS batch rows x BD channels (A, D and dt_bias are loaded once for all rows)
    pid_b = tl.program_id(0).to(tl.int64)
    pd = tl.program_id(1)
    d = pd.to(tl.int64) * BD + tl.arange(0, BD).to(tl.int64)
    n = tl.arange(0, BN).to(tl.int64)
    dm = d < Dm
    nm = n < N
    g = d // CPG
    m2 = dm[:, None] & nm[None, :]
    a = tl.load(a_ptr + d[:, None] * sa0 + n[None, :] * sa1, mask=m2, other=0.0).to(ACC)
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + d, mask=dm, other=0.0).to(ACC)
    if HAS_D:
        dsk = tl.load(d_ptr + d * sd0, mask=dm, other=0.0).to(ACC)
    for r in tl.static_range(ROWS):
        b = pid_b * ROWS + r
        rowm = dm & ((d * 0 + b) < Bsz)  # vectors, not scalars (interpreter: vector & scalar bools)
        bq = tl.minimum(b, Bsz - 1)
        slot = tl.load(idx_ptr + bq).to(tl.int64)
        live = rowm & ((d * 0 + slot) != pad_id)
        slot = tl.where(slot != pad_id, slot, 0)
        sptr = st_ptr + slot * ss0 + d[:, None] * ss1 + n[None, :] * ss2
        smask = live[:, None] & nm[None, :]
        s = tl.load(sptr, mask=smask, other=0.0).to(ACC)
        xv = tl.load(x_ptr + bq * sx0 + d * sx1, mask=dm, other=0.0).to(ACC)
        dtv = tl.load(dt_ptr + bq * sdt0 + d * sdt1, mask=dm, other=0.0).to(ACC)
        if HAS_DTB:
            dtv += dtb
        if SOFTPLUS:
            dtv = _softplus(dtv)
        dtv = _clamp(dtv, dt_lo, dt_hi, lim_ptr, LIM_F64)
        if GU:  # all channels of the block read one group: load the B/C rows as N-vectors
            g0 = (pd.to(tl.int64) * BD) // CPG
            bv = tl.load(b_ptr + bq * sb0 + g0 * sb1 + n * sb2, mask=nm, other=0.0).to(ACC)[None, :]
            cv = tl.load(c_ptr + bq * sc0 + g0 * sc1 + n * sc2, mask=nm, other=0.0).to(ACC)[None, :]
        else:
            bv = tl.load(b_ptr + bq * sb0 + g[:, None] * sb1 + n[None, :] * sb2, mask=m2, other=0.0).to(ACC)
            cv = tl.load(c_ptr + bq * sc0 + g[:, None] * sc1 + n[None, :] * sc2, mask=m2, other=0.0).to(ACC)
        s = s * tl.exp(dtv[:, None] * a) + (xv * dtv)[:, None] * bv
        y = tl.sum(s * cv, axis=1)
        if HAS_D:
            y += dsk * xv
        if HAS_Z:
            zv = tl.load(z_ptr + bq * sz0 + d * sz1, mask=dm, other=0.0).to(ACC)
            y = y * zv / (1.0 + tl.exp(-zv))
        tl.store(y_ptr + bq * sy0 + d * sy1, y.to(y_ptr.dtype.element_ty), mask=rowm)
        tl.store(sptr, s.to(st_ptr.dtype.element_ty), mask=smask)


def _acc(*ts):
    return tl.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else tl.float32


def _s(t, i):
    return 0 if t is None else t.stride(i)


def selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
                           dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    layout = C.validate_selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices,
                                               dt_limit, pad_slot_id, out)
    y = out if out is not None else torch.empty_like(x)
    if x.shape[0] == 0:
        return y
    interp = interpreting()
    acc = _acc(x, state)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    common = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None,
                  SOFTPLUS=bool(dt_softplus), ACC=acc, LIM_F64=acc == tl.float64)
    lim = torch.tensor([lo, hi], dtype=torch.float64, device=x.device) if acc == tl.float64 else x
    dp, zp, bp = (D if D is not None else x), (z if z is not None else x), (dt_bias if dt_bias is not None else dt)
    with device_guard(x):
        if layout[0] == "mamba2":
            _, Bsz, H, P, N, G = layout
            BN = next_power_of_2(N)
            BP = min(next_power_of_2(P), 16 if interp else CONFIG["m2_bp"])
            _ssu_mamba2_kernel[(Bsz, H, cdiv(P, BP))](
                state, x, dt, A, B, Cm, dp, zp, bp, state_batch_indices, y,
                P, N, H // G, pad_slot_id, lo, hi, lim,
                *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *Cm.stride(),
                _s(D, 0), _s(D, 1) if D is not None and D.dim() == 2 else 0,
                _s(z, 0), _s(z, 1), _s(z, 2), *y.stride(),
                BP=BP, BN=BN, D_PER_P=D is not None and D.dim() == 2, num_warps=1 if interp else CONFIG["m2_warps"],
                **common)
        else:
            _, Bsz, Dm, N, G = layout
            BN = next_power_of_2(N)
            BD = min(next_power_of_2(Dm), 16 if interp else CONFIG["m1_bd"])
            rows = 2 if interp else CONFIG["m1_rows"]
            _ssu_mamba1_kernel[(cdiv(Bsz, rows), cdiv(Dm, BD))](
                state, x, dt, A, B, Cm, dp, zp, bp, state_batch_indices, y,
                Bsz, Dm, N, Dm // G, pad_slot_id, lo, hi, lim,
                *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *Cm.stride(),
                _s(D, 0), _s(z, 0), _s(z, 1), *y.stride(),
                BD=BD, BN=BN, ROWS=rows, GU=(Dm // G) % BD == 0, num_warps=1 if interp else CONFIG["m1_warps"], **common)
    return y
