"""Triton Mamba-1 selective scan over packed sequences (`selective_scan_varlen`).

Parallel over (piece of a sequence) x (block of BD channels). In "loop" mode (the default) each program
keeps its state as an (N, BD) fp32 tile in registers, N on the first axis so that a warp's lanes run along
channels: the reduction over N for y stays inside a thread (or two), and per-channel work (softplus, D skip,
z gate) is not repeated per state column. Per token: dA = exp2(dt * A log2(e)), h = dA h + dt u B,
y = C . h. The inputs of token t + PF are loaded in iteration t (PF in {1, 2, 4}: a register ring, since
Triton does not software-pipeline these small loads), and y of token t is stored one iteration later, after
the next token's exponentials have been issued, so neither load latency nor the y reduction stalls the loop.

Long sequences can be cut into pieces (CONFIG "chunk"; 0 = pick from the problem size) so that enough
programs run; then three launches:
  1. local:   every piece runs from a zero state; stores its end state and sum(dt) per channel.
  2. combine: per (sequence, channel block), a loop over the sequence's pieces:
              h_init[c] = h;  h = exp(A * sum_dt[c]) * h + h_local[c]   (piece decay = exp(A sum dt))
              starting from the pool slot (has_initial_state, not pad) or zero; writes the final state.
  3. output:  every piece reruns from its true initial state and writes y (0 for a pad request's tokens).
When every sequence fits one piece a single launch does it all (pool in, pool out, y). The piece table
(pieces per sequence, prefix sums) is built on the device, so no host sync is needed. Index math is int32
when every offset fits (`index_type`), int64 otherwise.

Two ways to walk a piece's tokens (CONFIG "mode"; same launches, pieces and contract either way):
  "loop":  token by token as above: one dependent exp + multiply-add chain per token (latency-bound).
  "assoc": blocks of BT tokens (CONFIG "bt"). Per block the program loads u, dt, z as (BT, BD) and B, C as
           (BT, N) (one group for the channel block) or (BT, N, BD), forms dA = exp2(dt A log2 e) and
           dBu = dt u B for every (token, state, channel) at once, and runs tl.associative_scan over the
           block's tokens with (a1, b1), (a2, b2) -> (a1 a2, a2 b1 + b2): then h_t = b_t + a_t h, with h
           the state carried into the block, y = C . h_t over N for the whole block (D skip and z gate as
           in "loop"), and the block's last row is carried on. Tokens past the piece's end get dt = 0
           (a = 1, b = 0), so that last row is the state after the piece's last token. The exponentials
           are independent of each other and the time axis is parallel inside a program: the tile is
           (BT, N, BD) per tensor, so bd and warps go with bt (the "assoc" sweep group sets all three).
           Triton lays that tile out from the loads: B/C rows of one group as (BT, N, 1) give lanes along
           N and warps along the tokens (the scan crosses warps); CONFIG "bc_full" broadcasts them to
           (BT, N, BD) first, which gives lanes along N and channels and the tokens in-thread.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import (HostPlans, Staged, launch_config, cdiv, compute_dtype, device_guard,
                                          exp2_fast, index_type, interpreting, next_power_of_2, nvidia_fast,
                                          silu_fast, softplus_fast, unit_stride)
from reference.validate import fail

# Launch parameters (H200 sweep, `harness bench sweep --op selective_scan_varlen`: best of 36 at D=8192 N=16
# L=4096; the device's values in configs/<device>/selective_scan.json).
# chunk: tokens per program (0: single pass when the sequences x channel blocks give at least `programs`
# programs, else pieces sized to give about that many).
# mode: "loop" (token by token; pf used) or "assoc" (blocks of bt tokens through an associative scan; bt and
# bc_full used: B/C rows broadcast over the channel block, a different register layout of the block's tiles).
CONFIG = launch_config("selective_scan", {"mode": "loop", "bd": 32, "warps": 1, "chunk": 256, "programs": 1024,
                                          "pf": 2, "dfirst": False, "bt": 16, "bc_full": False})


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
def _load_bc(ptr, t, goff, n, s0, s2, qm, nm, BD: tl.constexpr, GU: tl.constexpr):
    """Row t of B or C as an (BN, BD) tile. With one group for the whole block (GU) every column reads the
    same N contiguous values: the tile's layout then keeps each thread's N-run contiguous (one vector
    load, broadcast across the lanes of a channel block) and the state tile takes the same layout."""
    if GU:
        p = tl.broadcast_to(ptr + t * s0 + goff + n[:, None] * s2, (n.shape[0], BD))
        return tl.load(p, mask=nm[:, None] & qm[None, :], other=0.0)
    else:
        return tl.load(ptr + t * s0 + goff[None, :] + n[:, None] * s2, mask=nm[:, None] & qm[None, :], other=0.0)


@triton.jit
def _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t, t1, uo, lo, bo, co, zo, dm, n, nm, zd, su0, sl0, sb0, sb2,
        sc0, sc2, sz0, BD: tl.constexpr, GU: tl.constexpr, NEED_C: tl.constexpr, HAS_Z: tl.constexpr):
    """Inputs of token t (masked off past t1): u, delta, B, C, z (C/z = B/u when unused)."""
    qm = dm & ((zd + t) < t1)
    uv = tl.load(u_ptr + t * su0 + uo, mask=qm, other=0.0)
    dv = tl.load(dl_ptr + t * sl0 + lo, mask=qm, other=0.0)
    bv = _load_bc(b_ptr, t, bo, n, sb0, sb2, qm, nm, BD, GU)
    if NEED_C:
        cv = _load_bc(c_ptr, t, co, n, sc0, sc2, qm, nm, BD, GU)
    else:
        cv = bv
    if HAS_Z:
        zv = tl.load(z_ptr + t * sz0 + zo, mask=qm, other=0.0)
    else:
        zv = uv
    return uv, dv, bv, cv, zv


@triton.jit
def _dt(dv, dbias, ok, FAST: tl.constexpr, ACC: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr):
    """dt = softplus(delta + bias) elementwise (any shape whose last axis is the channel block); 0 where `ok`
    is false (a token past the piece's end: the state is left unchanged)."""
    dtv = dv.to(ACC)
    if HAS_DB:
        dtv += dbias
    if SOFTPLUS:
        dtv = softplus_fast(dtv, FAST)
    return tl.where(ok, dtv, 0.0)


@triton.jit
def _gate(y, uf, zv, dskip, FAST: tl.constexpr, ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """y + D u, times silu(z) (elementwise; the last axis is the channel block)."""
    if HAS_D:
        y += dskip * uf
    if HAS_Z:
        y = y * silu_fast(zv.to(ACC), FAST)
    return y


@triton.jit
def _step(h, a2, uv, dv, bv, cv, zv, dbias, dskip, ok, FAST: tl.constexpr, ACC: tl.constexpr, HAS_DB: tl.constexpr,
          SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, NEED_Y: tl.constexpr):
    """One token: returns the new state, dt (for sum dt) and y (unused when NEED_Y is off). Where `ok` is
    false (a token past the piece's end) dt is 0, so the state is unchanged."""
    dtv = _dt(dv, dbias, ok, FAST, ACC, HAS_DB, SOFTPLUS)
    uf = uv.to(ACC)
    h = exp2_fast(dtv[None, :] * a2, FAST) * h + (dtv * uf)[None, :] * bv.to(ACC)
    if NEED_Y:
        y = _gate(tl.sum(h * cv.to(ACC), axis=0), uf, zv, dskip, FAST, ACC, HAS_D, HAS_Z)
    else:
        y = dtv
    return h, dtv, y


@triton.jit
def _sub(h, ypend, yl, sdt, a2, dbias, dskip, uv, dv, bv, cv, zv, tt, t0, t1, PF: tl.constexpr, u_ptr, dl_ptr, b_ptr,
         c_ptr, z_ptr, y_ptr, uo, lo, bo, co, zo, yo, dm, n, nm, zd, su0, sl0, sb0, sb2, sc0, sc2, sz0, sy0,
         BD: tl.constexpr, GU: tl.constexpr, FAST: tl.constexpr, ACC: tl.constexpr, HAS_DB: tl.constexpr,
         SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, NEED_Y: tl.constexpr):
    """Token tt (a no-op past t1) from its slot, then the slot refilled with token tt + PF; y of the token
    before tt is stored now (one step late, so the store does not wait on this token's reduction). `yl`
    false: a pad request's token, whose y stays 0."""
    ok = (zd + tt) < t1
    h, dtv, y = _step(h, a2, uv, dv, bv, cv, zv, dbias, dskip, ok, FAST, ACC, HAS_DB, SOFTPLUS, HAS_D, HAS_Z, NEED_Y)
    uv, dv, bv, cv, zv = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, tt + PF, t1, uo, lo, bo, co, zo, dm, n, nm, zd,
                             su0, sl0, sb0, sb2, sc0, sc2, sz0, BD, GU, NEED_Y, HAS_Z)
    if NEED_Y:
        tl.store(y_ptr + (tt - 1) * sy0 + yo, ypend.to(y_ptr.dtype.element_ty),
                 mask=dm & ((zd + tt) > t0) & ((zd + tt) <= t1))
        ypend = tl.where(ok & yl, y, ypend)
    else:
        sdt += dtv
    return h, ypend, sdt, uv, dv, bv, cv, zv


@triton.jit
def _load_bc_blk(ptr, tt, okr, qm, goff, n, nm, s0, s2, GU: tl.constexpr, BC_FULL: tl.constexpr):
    """Rows tt (a block of BT tokens; `okr` the rows before the piece's end, `qm` that and the channel mask)
    of B or C: with one group for the whole channel block (GU) an (BT, BN, 1) tile, or with BC_FULL the
    same rows broadcast over the block's channels, (BT, BN, BD) (the layout Triton then gives the block's
    tiles puts lanes along N and channels and keeps the tokens in-thread); else (BT, BN, BD)."""
    if GU and BC_FULL:
        p = tl.broadcast_to(ptr + tt[:, None, None] * s0 + goff + n[None, :, None] * s2,
                            (tt.shape[0], n.shape[0], qm.shape[1]))
        return tl.load(p, mask=qm[:, None, :] & nm[None, :, None], other=0.0)
    elif GU:
        return tl.load(ptr + tt[:, None, None] * s0 + goff + n[None, :, None] * s2,
                       mask=okr[:, None, None] & nm[None, :, None], other=0.0)
    else:
        return tl.load(ptr + tt[:, None, None] * s0 + goff[None, None, :] + n[None, :, None] * s2,
                       mask=qm[:, None, :] & nm[None, :, None], other=0.0)


@triton.jit
def _combine(a1, b1, a2, b2):
    """Two consecutive spans of the recurrence h -> a h + b, the earlier one first."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _blocks(h, sdt, a2, dbias, dskip, yl, t0, t1, u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, y_ptr, uo, lo, bo, co, zo, yo,
            dm, n, nm, su0, sl0, sb0, sb2, sc0, sc2, sz0, sy0, BT: tl.constexpr, IDX: tl.constexpr,
            GU: tl.constexpr, BC_FULL: tl.constexpr, FAST: tl.constexpr, ACC: tl.constexpr, HAS_DB: tl.constexpr,
            SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, NEED_Y: tl.constexpr):
    """Tokens [t0, t1) in blocks of BT ("assoc" mode): per block, (dA, dBu) of every (token, state, channel)
    at once, an associative scan over the block's tokens, h_t = b_t + a_t h (h: the state carried in), y
    stored for the whole block; rows past t1 have dt = 0 (a = 1, b = 0), so the last row is the carried
    state. Returns the state after t1 - 1 and sum(dt) per channel (accumulated only when NEED_Y is off)."""
    r = tl.arange(0, BT).to(IDX)
    last = (r == BT - 1)[:, None, None]
    for tb in range(t0, t1, BT):
        tt = tb + r
        okr = tt < t1
        qm = okr[:, None] & dm[None, :]
        dv = tl.load(dl_ptr + tt[:, None] * sl0 + lo[None, :], mask=qm, other=0.0)
        uf = tl.load(u_ptr + tt[:, None] * su0 + uo[None, :], mask=qm, other=0.0).to(ACC)
        bv = _load_bc_blk(b_ptr, tt, okr, qm, bo, n, nm, sb0, sb2, GU, BC_FULL).to(ACC)
        dtv = _dt(dv, dbias[None, :], qm, FAST, ACC, HAS_DB, SOFTPLUS)
        da = exp2_fast(dtv[:, None, :] * a2[None, :, :], FAST)
        db = (dtv * uf)[:, None, :] * bv
        aa, bb = tl.associative_scan((da, db), 0, _combine)
        hs = bb + aa * h[None, :, :]
        if NEED_Y:
            cv = _load_bc_blk(c_ptr, tt, okr, qm, co, n, nm, sc0, sc2, GU, BC_FULL).to(ACC)
            if HAS_Z:
                zv = tl.load(z_ptr + tt[:, None] * sz0 + zo[None, :], mask=qm, other=0.0)
            else:
                zv = uf
            y = _gate(tl.sum(hs * cv, axis=1), uf, zv, dskip[None, :], FAST, ACC, HAS_D, HAS_Z)
            y = tl.where(yl[None, :], y, 0.0)
            tl.store(y_ptr + tt[:, None] * sy0 + yo[None, :], y.to(y_ptr.dtype.element_ty), mask=qm)
        else:
            sdt += tl.sum(dtv, axis=0)
        h = tl.sum(tl.where(last, hs, 0.0), axis=0)
    return h, sdt


@triton.jit
def _scan_kernel(u_ptr, dl_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, db_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr,
                 y_ptr, cs_ptr, hb_ptr, sdt_ptr,
                 Dm, N, CPG, S, L, pad_id,
                 su0, su1, sl0, sl1, sa0, sa1, sb0, sb1, sb2, sc0, sc1, sc2, sd0, sz0, sz1, sdb0,
                 ss0, ss1, ss2, sy0, sy1,
                 MODE: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, NSTEPS: tl.constexpr,
                 ASSOC: tl.constexpr, BT: tl.constexpr, BC_FULL: tl.constexpr, GU: tl.constexpr, PF: tl.constexpr,
                 DFIRST: tl.constexpr, IDX: tl.constexpr, FAST: tl.constexpr,
                 HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr,
                 ACC: tl.constexpr):
    # MODE 0: single pass (one piece per sequence; pool in, pool out, y)
    # MODE 1: local pass (zero state; store end state + sum dt)
    # MODE 2: output pass (state from hb; y)
    if DFIRST:  # channel blocks vary fastest: programs running together stream the same tokens
        pid = tl.program_id(1).to(IDX)
        pd = tl.program_id(0)
    else:
        pid = tl.program_id(0).to(IDX)
        pd = tl.program_id(1)
    d = pd.to(IDX) * BD + tl.arange(0, BD).to(IDX)
    n = tl.arange(0, BN).to(IDX)
    dm = d < Dm
    nm = n < N
    m2 = nm[:, None] & dm[None, :]
    zd = d * 0  # scalar conditions become vectors (the interpreter mishandles vector & scalar bools)
    if MODE == 0:
        s = pid
        t0 = tl.load(qsl_ptr + s).to(IDX)
        t1 = tl.load(qsl_ptr + s + 1).to(IDX)
        valid = zd == 0
    else:
        total = tl.load(cs_ptr + S).to(IDX)
        valid = (zd + pid) < total
        s = _find(cs_ptr, S, pid, NSTEPS)
        j = pid - tl.load(cs_ptr + s).to(IDX)
        t0 = tl.load(qsl_ptr + s).to(IDX) + j * L
        t1 = tl.minimum(t0 + L, tl.load(qsl_ptr + s + 1).to(IDX))
        t1 = tl.where(pid < total, t1, t0)
    a2 = tl.load(a_ptr + d[None, :] * sa0 + n[:, None] * sa1, mask=m2, other=0.0).to(ACC) * 1.4426950408889634
    dbias = zd.to(ACC)
    dskip = zd.to(ACC)
    if HAS_DB:
        dbias = tl.load(db_ptr + d * sdb0, mask=dm, other=0.0).to(ACC)
    if HAS_D:
        dskip = tl.load(d_ptr + d * sd0, mask=dm, other=0.0).to(ACC)
    # per-channel parts of the input offsets (loop-invariant)
    uo = d * su1
    lo = d * sl1
    zo = d * sz1
    if GU:  # every channel of this block reads the same group: B/C rows are N-vectors
        g0 = (pd.to(IDX) * BD) // CPG
        bo = g0 * sb1
        co = g0 * sc1
    else:
        g = d // CPG
        bo = g * sb1
        co = g * sc1
    hb_off = pid * Dm * N + d[None, :] * N + n[:, None]
    if MODE == 0:
        slot = tl.load(idx_ptr + s).to(IDX)
        live = (zd + slot) != pad_id
        use = live & ((zd + tl.load(hi_ptr + s).to(IDX)) != 0)
        slot = tl.where(slot != pad_id, slot, 0)
        sptr = st_ptr + slot * ss0 + d[None, :] * ss1 + n[:, None] * ss2
        h = tl.load(sptr, mask=nm[:, None] & (dm & use)[None, :], other=0.0).to(ACC)
    elif MODE == 1:
        h = tl.zeros((BN, BD), dtype=ACC)
    else:
        h = tl.load(hb_ptr + hb_off, mask=nm[:, None] & (dm & valid)[None, :], other=0.0).to(ACC)
    sdt = zd.to(ACC)
    NEED_Y: tl.constexpr = MODE != 1
    if ASSOC:
        yo = d * sy1
        yl = (zd + tl.load(idx_ptr + s).to(IDX)) != pad_id  # a pad request's tokens get y = 0
        h, sdt = _blocks(h, sdt, a2, dbias, dskip, yl, t0, t1, u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, y_ptr, uo, lo, bo,
                         co, zo, yo, dm, n, nm, su0, sl0, sb0, sb2, sc0, sc2, sz0, sy0, BT, IDX, GU, BC_FULL, FAST, ACC,
                         HAS_DB, SOFTPLUS, HAS_D, HAS_Z, NEED_Y)
    else:
        # slot i holds the inputs of token tb + i; after step i uses it, it is refilled with token tb + PF + i
        u0, d0, b0, c0, z0 = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0, t1, uo, lo, bo, co, zo, dm, n, nm, zd,
                                 su0, sl0, sb0, sb2, sc0, sc2, sz0, BD, GU, NEED_Y, HAS_Z)
        if PF >= 2:
            u1, d1, b1, c1, z1 = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0 + 1, t1, uo, lo, bo, co, zo, dm, n, nm, zd,
                                     su0, sl0, sb0, sb2, sc0, sc2, sz0, BD, GU, NEED_Y, HAS_Z)
        if PF >= 4:
            u2, d2, b2, c2, z2 = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0 + 2, t1, uo, lo, bo, co, zo, dm, n, nm, zd,
                                     su0, sl0, sb0, sb2, sc0, sc2, sz0, BD, GU, NEED_Y, HAS_Z)
            u3, d3, b3, c3, z3 = _ld(u_ptr, dl_ptr, b_ptr, c_ptr, z_ptr, t0 + 3, t1, uo, lo, bo, co, zo, dm, n, nm, zd,
                                     su0, sl0, sb0, sb2, sc0, sc2, sz0, BD, GU, NEED_Y, HAS_Z)
        yo = d * sy1
        ypend = zd.to(ACC)  # y of the last valid token processed, stored one step late
        yl = (zd + tl.load(idx_ptr + s).to(IDX)) != pad_id  # a pad request's tokens get y = 0
        for tb in range(t0, t1, PF):
            h, ypend, sdt, u0, d0, b0, c0, z0 = _sub(
                h, ypend, yl, sdt, a2, dbias, dskip, u0, d0, b0, c0, z0, tb, t0, t1, PF, u_ptr, dl_ptr, b_ptr,
                c_ptr, z_ptr, y_ptr, uo, lo, bo, co, zo, yo, dm, n, nm, zd, su0, sl0, sb0, sb2, sc0, sc2, sz0, sy0,
                BD, GU, FAST, ACC, HAS_DB, SOFTPLUS, HAS_D, HAS_Z, NEED_Y)
            if PF >= 2:
                h, ypend, sdt, u1, d1, b1, c1, z1 = _sub(
                    h, ypend, yl, sdt, a2, dbias, dskip, u1, d1, b1, c1, z1, tb + 1, t0, t1, PF, u_ptr, dl_ptr, b_ptr,
                    c_ptr, z_ptr, y_ptr, uo, lo, bo, co, zo, yo, dm, n, nm, zd, su0, sl0, sb0, sb2, sc0, sc2, sz0, sy0,
                    BD, GU, FAST, ACC, HAS_DB, SOFTPLUS, HAS_D, HAS_Z, NEED_Y)
            if PF >= 4:
                h, ypend, sdt, u2, d2, b2, c2, z2 = _sub(
                    h, ypend, yl, sdt, a2, dbias, dskip, u2, d2, b2, c2, z2, tb + 2, t0, t1, PF, u_ptr, dl_ptr, b_ptr,
                    c_ptr, z_ptr, y_ptr, uo, lo, bo, co, zo, yo, dm, n, nm, zd, su0, sl0, sb0, sb2, sc0, sc2, sz0, sy0,
                    BD, GU, FAST, ACC, HAS_DB, SOFTPLUS, HAS_D, HAS_Z, NEED_Y)
                h, ypend, sdt, u3, d3, b3, c3, z3 = _sub(
                    h, ypend, yl, sdt, a2, dbias, dskip, u3, d3, b3, c3, z3, tb + 3, t0, t1, PF, u_ptr, dl_ptr, b_ptr,
                    c_ptr, z_ptr, y_ptr, uo, lo, bo, co, zo, yo, dm, n, nm, zd, su0, sl0, sb0, sb2, sc0, sc2, sz0, sy0,
                    BD, GU, FAST, ACC, HAS_DB, SOFTPLUS, HAS_D, HAS_Z, NEED_Y)
        if NEED_Y:  # the last token's y (the loop stored up to the token before it)
            tl.store(y_ptr + (t1 - 1) * sy0 + yo, ypend.to(y_ptr.dtype.element_ty), mask=dm & ((zd + t1) > t0))
    if MODE == 0:
        tl.store(sptr, h.to(st_ptr.dtype.element_ty), mask=nm[:, None] & (dm & live)[None, :])
    elif MODE == 1:
        tl.store(hb_ptr + hb_off, h, mask=nm[:, None] & (dm & valid)[None, :])
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


def _plan(dims, call, delta_softplus, chunk_size):
    """One call's launches (`call`: the validator's arguments, `out=` last) from the validator's answer: (the
    `Staged` plan, or None where there is no sequence; the piece length L where the sequences are cut into
    pieces, whose table the call computes on the device from query_start_loc, else None)."""
    T, Dm, N, G, S = dims
    u, delta, A, B, Cm, D, z, delta_bias, ssm_states = call[:9]
    pad_slot_id, out = call[-2:]
    if S == 0:
        return None, None
    interp = interpreting()
    BN = next_power_of_2(N)
    BD = min(next_power_of_2(Dm), 16 if interp else CONFIG["bd"])
    nD = cdiv(Dm, BD)
    if chunk_size:
        L = int(chunk_size)
    elif interp:
        L = 8
    elif CONFIG["chunk"]:
        L = int(CONFIG["chunk"])
    elif S * nD >= CONFIG["programs"]:
        L = T  # one pass per sequence already gives enough programs
    else:  # cut the tokens into pieces so that about `programs` programs run
        L = max(64, cdiv(T * nD, CONFIG["programs"]))
    acc_t = compute_dtype(u.dtype)
    ACC = tl.float64 if acc_t == torch.float64 else tl.float32
    warps = 1 if interp else CONFIG["warps"]
    # under the interpreter (CPU suites) every prefetch depth gets exercised, chosen by the token count
    pf = int(CONFIG["pf"]) if not interp else (1, 2, 4)[T % 3]
    if pf not in (1, 2, 4):
        fail("selective_scan CONFIG['pf']", "1, 2 or 4", pf)
    mode = CONFIG["mode"]
    if mode not in ("loop", "assoc"):
        fail("selective_scan CONFIG['mode']", "'loop' or 'assoc'", repr(mode))
    bt = int(CONFIG["bt"])
    if bt < 1 or bt & (bt - 1):
        fail("selective_scan CONFIG['bt']", "a power of 2", bt)
    if interp:  # under the interpreter, several blocks to a piece
        bt = min(bt, 4)
    dfirst = bool(CONFIG["dfirst"]) if not interp else T % 2 == 0
    NC = cdiv(T, L) + S  # bound on the piece count
    y = out if out is not None else torch.empty_like(u, device="meta")  # a new y is empty_like(u)
    idx_t = index_type(u, delta, z, B, Cm, y, ssm_states, NC * Dm * N)
    fast = nvidia_fast(u) and acc_t == torch.float32
    opt = dict(ASSOC=mode == "assoc", BT=bt, BC_FULL=bool(CONFIG["bc_full"]), GU=(Dm // G) % BD == 0, PF=pf,
               DFIRST=dfirst, IDX=idx_t, FAST=fast, HAS_D=D is not None, HAS_Z=z is not None,
               HAS_DB=delta_bias is not None, SOFTPLUS=bool(delta_softplus), ACC=ACC, BD=BD, BN=BN, num_warps=warps)
    strides = (u.stride(0), u.stride(1), delta.stride(0), delta.stride(1), A.stride(0), A.stride(1),
               *B.stride(), *Cm.stride(), _st(D, 0), _st(z, 0), _st(z, 1), _st(delta_bias, 0),
               *ssm_states.stride(), y.stride(0), y.stride(1))
    st = Staged()
    ins = ("u", "delta", "A", "B", "Cm", "D" if D is not None else "u", "z" if z is not None else "u",
           "delta_bias" if delta_bias is not None else "u", "ssm_states", "query_start_loc", "cache_indices", "hi",
           "y")
    if T <= L:
        st.add(_scan_kernel, (nD, S) if dfirst else (S, nD), ins + ("query_start_loc", "u", "u"),
               (Dm, N, Dm // G, S, L, pad_slot_id, *strides), MODE=0, NSTEPS=1, **opt)
        return st, None
    dev = u.device
    st.buffer("hb", (NC, Dm, N), acc_t, dev)
    st.buffer("sdt", (NC, Dm), acc_t, dev)
    nsteps = max(1, int(S).bit_length())
    grid = (nD, NC) if dfirst else (NC, nD)
    values = (Dm, N, Dm // G, S, L, pad_slot_id, *strides)
    st.add(_scan_kernel, grid, ins + ("cs", "hb", "sdt"), values, MODE=1, NSTEPS=nsteps, **opt)
    st.add(_scan_combine_kernel, (S, nD), ("A", "ssm_states", "cache_indices", "hi", "cs", "hb", "sdt"),
           (Dm, N, pad_slot_id, A.stride(0), A.stride(1), *ssm_states.stride()),
           BD=BD, BN=BN, ACC=ACC, num_warps=warps)
    st.add(_scan_kernel, grid, ins + ("cs", "hb", "sdt"), values, MODE=2, NSTEPS=nsteps, **opt)
    return st, L


_PLANS = HostPlans(C.validate_selective_scan_varlen, _plan, CONFIG)


@provides("triton", "selective_scan_varlen")
def selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                          has_initial_state, *, delta_softplus=True, pad_slot_id=C.PAD_SLOT_ID, out=None,
                          chunk_size=None):
    staged, L = _PLANS.plan((u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                             has_initial_state, pad_slot_id, out), (delta_softplus, chunk_size))
    y = out if out is not None else torch.empty_like(u)
    if staged is None:
        return y
    query_start_loc, cache_indices, has_initial_state = unit_stride(query_start_loc, cache_indices, has_initial_state)
    tensors = dict(u=u, delta=delta, A=A, B=B, Cm=Cm, D=D, z=z, delta_bias=delta_bias, ssm_states=ssm_states,
                   query_start_loc=query_start_loc, cache_indices=cache_indices,
                   hi=has_initial_state.view(torch.uint8), y=y)
    with device_guard(u):
        if L is not None:  # each sequence's first piece, on the device from the offsets (no synchronisation)
            q = query_start_loc.to(torch.int64)
            nch = (q[1:] - q[:-1] + (L - 1)) // L
            cs = tensors["cs"] = torch.zeros(q.shape[0], dtype=torch.int64, device=u.device)
            torch.cumsum(nch, 0, out=cs[1:])
        staged.run(tensors)
    return y
