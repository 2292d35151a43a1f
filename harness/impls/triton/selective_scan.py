"""Triton Mamba-1 selective scan over packed sequences (`selective_scan_varlen`).

Parallel over (chunk of a sequence) x (block of BD channels); each program keeps its (BD, N) state
in registers (fp32) and loops over its chunk's tokens, prefetching the next token's inputs while it
computes the current one (CONFIG["deep"]: four tokens ahead). Three launches when a sequence can span several chunks:

  1. local:   every chunk runs from a zero state; stores its end state and sum(dt) per channel.
  2. combine: per (sequence, channel block), a loop over the sequence's chunks:
              h_init[c] = h;  h = exp(A * sum_dt[c]) * h + h_local[c]   (chunk decay = exp(A sum dt))
              starting from the pool slot (has_initial_state, not pad) or zero; writes the final state
              to the slot.
  3. output:  every chunk reruns from its true initial state and writes y.

When every sequence fits one chunk (T <= chunk length) a single launch does it all. The chunk table
(chunks per sequence, prefix sums) is built on the device, so no host sync is needed. Offsets int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.triton._common import launch_config, cdiv, device_guard, interpreting, next_power_of_2

# Launch parameters (defaults from the H200 sweep of scripts/gpu_ops_bench.py, 2026-11-29).
CONFIG = launch_config("selective_scan", {"bd": 64, "warps": 2, "chunk": 128, "stages": 1, "deep": False,
                                                  "dfirst": False})


@triton.jit
def _softplus(x):
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _find(tab_ptr, S, v, NSTEPS: tl.constexpr):
    """Largest s in [0, S) with tab[s] <= v (tab non-decreasing, tab[0] = 0)."""
    lo = v * 0
    hi = lo + S
    for _ in tl.static_range(NSTEPS):
        mid = (lo + hi) // 2
        go = tl.load(tab_ptr + mid).to(tl.int64) <= v
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _load_bc(ptr, t, g, n, s0, s1, s2, rowmask, mask2, nmask, GU: tl.constexpr):
    """Row t of B or C: an (N,) vector when the block's channels share one group (GU), else (BD, N)."""
    if GU:
        g0 = tl.max(g, axis=0)
        any_row = (n * 0 + tl.max(rowmask.to(tl.int32), axis=0)) > 0  # as a vector (interpreter)
        return tl.load(ptr + t * s0 + g0 * s1 + n * s2, mask=nmask & any_row, other=0.0)
    else:
        return tl.load(ptr + t * s0 + g[:, None] * s1 + n[None, :] * s2, mask=mask2, other=0.0)


@triton.jit
def _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t, t1, d, dm, g, n, nm, zd, su0, su1, sl0, sl1, sb0, sb1, sb2,
        sc0, sc1, sc2, sz0, sz1, GU: tl.constexpr, NEED_C: tl.constexpr, HAS_Z: tl.constexpr):
    """Inputs of token t (masked off past t1): u, delta, B row, C row, z (C/z = B/u when unused)."""
    qm = dm & ((zd + t) < t1)
    qm2 = qm[:, None] & nm[None, :]
    uv = tl.load(u_ptr + t * su0 + d * su1, mask=qm, other=0.0)
    dv = tl.load(dl_ptr + t * sl0 + d * sl1, mask=qm, other=0.0)
    bv = _load_bc(b_ptr, t, g, n, sb0, sb1, sb2, qm, qm2, nm, GU)
    if NEED_C:
        cv = _load_bc(c_ptr, t, g, n, sc0, sc1, sc2, qm, qm2, nm, GU)
    else:
        cv = bv
    if HAS_Z:
        zv = tl.load(z_ptr + t * sz0 + d * sz1, mask=qm, other=0.0)
    else:
        zv = uv
    return uv, dv, bv, cv, zv


@triton.jit
def _bc2d(v, GU: tl.constexpr):
    if GU:
        return v[None, :]
    else:
        return v


@triton.jit
def _scan_kernel(u_ptr, dl_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, db_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr,
                 y_ptr, cs_ptr, hb_ptr, sdt_ptr,
                 Dm, N, CPG, S, L, pad_id,
                 su0, su1, sl0, sl1, sa0, sa1, sb0, sb1, sb2, sc0, sc1, sc2, sd0, sz0, sz1, sdb0,
                 ss0, ss1, ss2, sy0, sy1,
                 MODE: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, NSTEPS: tl.constexpr,
                 GU: tl.constexpr, DEEP: tl.constexpr, DFIRST: tl.constexpr,
                 HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr,
                 ACC: tl.constexpr):
    # MODE 0: single pass (one chunk per sequence; pool in, pool out, y)
    # MODE 1: local pass (zero state; store end state + sum dt)
    # MODE 2: output pass (state from hb; y)
    if DFIRST:  # channel blocks vary fastest: programs running together stream the same tokens
        pid = tl.program_id(1).to(tl.int64)
        pd = tl.program_id(0)
    else:
        pid = tl.program_id(0).to(tl.int64)
        pd = tl.program_id(1)
    d = pd.to(tl.int64) * BD + tl.arange(0, BD).to(tl.int64)
    n = tl.arange(0, BN).to(tl.int64)
    dm = d < Dm
    nm = n < N
    m2 = dm[:, None] & nm[None, :]
    g = d // CPG
    if GU:  # every channel of this block reads the same group: load B/C rows as N-vectors
        g = g * 0 + (pd.to(tl.int64) * BD) // CPG
    zd = d * 0  # scalar conditions become vectors (the interpreter mishandles vector & scalar bools)
    if MODE == 0:
        s = pid
        t0 = tl.load(qsl_ptr + s).to(tl.int64)
        t1 = tl.load(qsl_ptr + s + 1).to(tl.int64)
        valid = zd == 0
    else:
        total = tl.load(cs_ptr + S).to(tl.int64)
        valid = (zd + pid) < total
        s = _find(cs_ptr, S, pid, NSTEPS)
        j = pid - tl.load(cs_ptr + s).to(tl.int64)
        t0 = tl.load(qsl_ptr + s).to(tl.int64) + j * L
        t1 = tl.minimum(t0 + L, tl.load(qsl_ptr + s + 1).to(tl.int64))
        t1 = tl.where(pid < total, t1, t0)
    a = tl.load(a_ptr + d[:, None] * sa0 + n[None, :] * sa1, mask=m2, other=0.0).to(ACC)
    if HAS_DB:
        dbias = tl.load(db_ptr + d * sdb0, mask=dm, other=0.0).to(ACC)
    if HAS_D:
        dskip = tl.load(d_ptr + d * sd0, mask=dm, other=0.0).to(ACC)
    hb_off = pid * Dm * N + d[:, None] * N + n[None, :]
    if MODE == 0:
        slot = tl.load(idx_ptr + s).to(tl.int64)
        live = (zd + slot) != pad_id
        use = live & ((zd + tl.load(hi_ptr + s).to(tl.int64)) != 0)
        slot = tl.where(slot != pad_id, slot, 0)
        sptr = st_ptr + slot * ss0 + d[:, None] * ss1 + n[None, :] * ss2
        h = tl.load(sptr, mask=(dm & use)[:, None] & nm[None, :], other=0.0).to(ACC)
    elif MODE == 1:
        h = tl.zeros((BD, BN), dtype=ACC)
        sdt = tl.zeros((BD,), dtype=ACC)
    else:
        h = tl.load(hb_ptr + hb_off, mask=(dm & valid)[:, None] & nm[None, :], other=0.0).to(ACC)
    # inputs of token t are loaded PF tokens ahead (loop-carried registers), so up to PF loads per
    # stream are in flight while the recurrence runs (Triton does not software-pipeline these loads)
    NEED_C: tl.constexpr = MODE != 1
    uv, dv, bv, cv, zv = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0, t1, d, dm, g, n, nm, zd, su0, su1, sl0, sl1,
                             sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1, GU, NEED_C, HAS_Z)
    if DEEP:
        u1, d1, b1, c1, z1 = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0 + 1, t1, d, dm, g, n, nm, zd, su0, su1, sl0,
                                 sl1, sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1, GU, NEED_C, HAS_Z)
        u2, d2, b2, c2, z2 = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0 + 2, t1, d, dm, g, n, nm, zd, su0, su1, sl0,
                                 sl1, sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1, GU, NEED_C, HAS_Z)
        u3, d3, b3, c3, z3 = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0 + 3, t1, d, dm, g, n, nm, zd, su0, su1, sl0,
                                 sl1, sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1, GU, NEED_C, HAS_Z)
    for t in range(t0, t1):
        if DEEP:
            tn = t + 4
        else:
            tn = t + 1
        un, dn, bn, cn, zn = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, tn, t1, d, dm, g, n, nm, zd, su0, su1, sl0, sl1,
                                 sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1, GU, NEED_C, HAS_Z)
        dtv = dv.to(ACC)
        if HAS_DB:
            dtv += dbias
        if SOFTPLUS:
            dtv = _softplus(dtv)
        uf = uv.to(ACC)
        h = tl.exp(dtv[:, None] * a) * h + (dtv * uf)[:, None] * _bc2d(bv, GU).to(ACC)
        if MODE == 1:
            sdt += dtv
        else:
            y = tl.sum(h * _bc2d(cv, GU).to(ACC), axis=1)
            if HAS_D:
                y += dskip * uf
            if HAS_Z:
                zf = zv.to(ACC)
                y = y * zf / (1.0 + tl.exp(-zf))
            tl.store(y_ptr + t * sy0 + d * sy1, y.to(y_ptr.dtype.element_ty), mask=dm)
        if DEEP:
            uv, dv, bv, cv, zv = u1, d1, b1, c1, z1
            u1, d1, b1, c1, z1 = u2, d2, b2, c2, z2
            u2, d2, b2, c2, z2 = u3, d3, b3, c3, z3
            u3, d3, b3, c3, z3 = un, dn, bn, cn, zn
        else:
            uv, dv, bv, cv, zv = un, dn, bn, cn, zn
    if MODE == 0:
        tl.store(sptr, h.to(st_ptr.dtype.element_ty), mask=(dm & live)[:, None] & nm[None, :])
    elif MODE == 1:
        tl.store(hb_ptr + hb_off, h, mask=(dm & valid)[:, None] & nm[None, :])
        tl.store(sdt_ptr + pid * Dm + d, sdt, mask=dm & valid)


@triton.jit
def _scan_combine_kernel(a_ptr, st_ptr, idx_ptr, hi_ptr, cs_ptr, hb_ptr, sdt_ptr, Dm, N, pad_id,
                         sa0, sa1, ss0, ss1, ss2,
                         BD: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    pd = tl.program_id(1)
    d = pd.to(tl.int64) * BD + tl.arange(0, BD).to(tl.int64)
    n = tl.arange(0, BN).to(tl.int64)
    dm = d < Dm
    m2 = dm[:, None] & (n < N)[None, :]
    zd = d * 0  # scalar conditions become vectors (the interpreter mishandles vector & scalar bools)
    slot = tl.load(idx_ptr + s).to(tl.int64)
    live = (zd + slot) != pad_id
    use = live & ((zd + tl.load(hi_ptr + s).to(tl.int64)) != 0)
    slot = tl.where(slot != pad_id, slot, 0)
    sptr = st_ptr + slot * ss0 + d[:, None] * ss1 + n[None, :] * ss2
    h = tl.load(sptr, mask=(dm & use)[:, None] & (n < N)[None, :], other=0.0).to(ACC)
    a = tl.load(a_ptr + d[:, None] * sa0 + n[None, :] * sa1, mask=m2, other=0.0).to(ACC)
    c0 = tl.load(cs_ptr + s).to(tl.int64)
    c1 = tl.load(cs_ptr + s + 1).to(tl.int64)
    for c in range(c0, c1):
        off = c * Dm * N + d[:, None] * N + n[None, :]
        hl = tl.load(hb_ptr + off, mask=m2, other=0.0)
        sd = tl.load(sdt_ptr + c * Dm + d, mask=dm, other=0.0)
        tl.store(hb_ptr + off, h, mask=m2)
        h = tl.exp(sd[:, None] * a) * h + hl
    tl.store(sptr, h.to(st_ptr.dtype.element_ty), mask=(dm & live)[:, None] & (n < N)[None, :])


def _st(t, i):
    return 0 if t is None else t.stride(i)


def selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                          has_initial_state, *, delta_softplus=True, pad_slot_id=C.PAD_SLOT_ID, out=None,
                          chunk_size=None):
    T, Dm, N, G, S = C.validate_selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states,
                                                      query_start_loc, cache_indices, has_initial_state,
                                                      pad_slot_id, out)
    y = out if out is not None else torch.empty_like(u)
    if S == 0:
        return y
    interp = interpreting()
    L = int(chunk_size or (8 if interp else CONFIG["chunk"]))
    BN = next_power_of_2(N)
    BD = min(next_power_of_2(Dm), 16 if interp else CONFIG["bd"])
    acc_t = torch.float64 if u.dtype == torch.float64 else torch.float32
    ACC = tl.float64 if acc_t == torch.float64 else tl.float32
    hi = has_initial_state.view(torch.uint8)
    nD = cdiv(Dm, BD)
    warps = 1 if interp else CONFIG["warps"]
    # under the interpreter (CPU suites) both prefetch depths get exercised, chosen by token-count parity
    deep = bool(CONFIG["deep"]) if not interp else T % 2 == 0
    dfirst = bool(CONFIG["dfirst"]) if not interp else T % 3 == 0
    opt = dict(GU=(Dm // G) % BD == 0, DEEP=deep, DFIRST=dfirst, HAS_D=D is not None, HAS_Z=z is not None,
               HAS_DB=delta_bias is not None, SOFTPLUS=bool(delta_softplus), ACC=ACC, BD=BD, BN=BN, num_warps=warps)
    if not interp and CONFIG["stages"] > 1:
        opt["num_stages"] = CONFIG["stages"]
    Dp = D if D is not None else u
    zp = z if z is not None else u
    dbp = delta_bias if delta_bias is not None else u
    strides = (u.stride(0), u.stride(1), delta.stride(0), delta.stride(1), A.stride(0), A.stride(1),
               *B.stride(), *Cm.stride(), _st(D, 0), _st(z, 0), _st(z, 1), _st(delta_bias, 0),
               *ssm_states.stride(), y.stride(0), y.stride(1))
    with device_guard(u):
        if T <= L:
            _scan_kernel[(nD, S) if dfirst else (S, nD)](u, delta, A, B, Cm, Dp, zp, dbp, ssm_states, query_start_loc, cache_indices, hi,
                                  y, query_start_loc, u, u, Dm, N, Dm // G, S, L, pad_slot_id, *strides,
                                  MODE=0, NSTEPS=1, **opt)
            return y
        q = query_start_loc.to(torch.int64)
        nch = (q[1:] - q[:-1] + (L - 1)) // L
        cs = torch.zeros(S + 1, dtype=torch.int64, device=u.device)
        torch.cumsum(nch, 0, out=cs[1:])
        NC = cdiv(T, L) + S  # bound on the chunk count
        hb = torch.empty((NC, Dm, N), dtype=acc_t, device=u.device)
        sdt = torch.empty((NC, Dm), dtype=acc_t, device=u.device)
        nsteps = max(1, int(S).bit_length())
        args = (u, delta, A, B, Cm, Dp, zp, dbp, ssm_states, query_start_loc, cache_indices, hi, y, cs, hb, sdt,
                Dm, N, Dm // G, S, L, pad_slot_id, *strides)
        grid = (nD, NC) if dfirst else (NC, nD)
        _scan_kernel[grid](*args, MODE=1, NSTEPS=nsteps, **opt)
        _scan_combine_kernel[(S, nD)](A, ssm_states, cache_indices, hi, cs, hb, sdt, Dm, N, pad_slot_id,
                                      A.stride(0), A.stride(1), *ssm_states.stride(),
                                      BD=BD, BN=BN, ACC=ACC, num_warps=warps)
        _scan_kernel[grid](*args, MODE=2, NSTEPS=nsteps, **opt)
    return y
