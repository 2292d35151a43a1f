"""Triton chunked prefill for Kimi Delta Attention (op `kda_varlen`): two launches.

The chunk grid is per sequence: chunk c of sequence s covers tokens [q[s] + c*BT, min(q[s] + (c+1)*BT, q[s+1])),
so every chunk belongs to one sequence and a sequence's last chunk may be shorter. Rows of a tile past a
chunk's end load as zeros (q = k = v = g = beta = 0), so they neither decay nor write the state, and are not
stored. Per chunk, with G (BT, K) the cumulative log-decay (inclusive, from the chunk start, in log2 units)
and S the key-major (K, V) state before the chunk (the pool holds it value-major):

    Qk_ij = sum_c q_ic k_jc exp(G_ic - G_jc)  (i >= j)      A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)  (i > j)
    T = (I + A)^-1,  w = T (beta exp(G) k),  u = T (beta v),  v' = u - w S
    o = (q exp(G)) S + Qk v' = q' S + Qk u   with q' = q exp(G) - Qk w
    S <- diag(exp(G_last)) S + (k exp(G_last - G))^T v'

1. `_kda_prep_kernel`, one program per (chunk slot, head), all chunks in parallel: the number of chunks is
   at most T // BT + sequences; each program finds its chunk by counting chunks over query_start_loc on
   the device (no host sync; slots past the last chunk exit). Everything that does not depend on S is
   formed here and stored to scratch indexed like the activations: w, q', kg = k exp(G_last - G) (T, H, K),
   u, ou = Qk u (T, H, V), and the chunk's decay exp(G_last) (chunk slot, H, K).
   The pairwise decays exp(G_i - G_j) are per key channel and cannot be split into exp(G_i) exp(-G_j) over
   a chunk in general. When every |G - G_m| of the chunk (G_m: the cumulative decay at its middle, the chunk
   start included) stays within FAST_THR (log2 units), they are split at that reference,
   exp(G_i - G_m) exp(G_m - G_j), each factor below 2**FAST_THR, and Qk / A come from two tensor-core dots;
   otherwise (|g| above ~66 / (BT / 2) per token on average over half a chunk, either sign: ~8 in 16-token
   chunks, ~2 in 64-token ones) the chunk takes the exact path: every pair's exponent formed and masked
   before the exponential, as the float64 reference does. T comes from the Gated DeltaNet prefill's solve
   (`delta_rule_chunk._unit_lower_inverse`): forward substitution inside the 16-row diagonal blocks (fp32
   elementwise, exact), then a product series over the blocks below them (2 log2(BT / 16) dots).
2. `_kda_scan_kernel`, one program per (sequence, head, block of BV value channels), walking the sequence's
   chunks in order with its (K, BV) state tile in registers (fp32; fp64 for fp64 inputs): per chunk the two
   products with the state, v' = u - w S and o = ou + q' S, and the update
   S <- diag(exp(G_last)) S + kg^T v'. Pads' tokens are stored as o = 0 (the op contract) and their slots
   never touched; a live request reads its slot when
   has_initial_state (zeros otherwise) and writes the final state back in place, honouring the pool's
   strides (an empty sequence writes its initial state).

Dots: bf16 inputs feed q / k and the scratch (stored in bf16) and the state to the tensor cores in bf16,
the products with T, Qk w and Qk u in tf32 (CONFIG["t_products"] "half": in bf16 too); fp16 inputs run everything
in tf32 with fp32 scratch (the split factors reach 2**96, and a growing state's exp(G) passes fp16's range); fp32 /
fp64 exactly ("ieee"). No host synchronisation: the grids are sized from T // BT upper bounds and the chunk and
sequence counts are read on the device. Token, slot and head offsets are int64, but for the per-chunk stage's
tiles: their offsets from the chunk's first token (a 64-bit scalar) are 32-bit (64-bit where a chunk's rows span
2**31 elements or more).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import (HostPlans, Staged, cdiv, compute_dtype, launch_config, next_power_of_2,
                                          unit_stride)
from harness.impls.triton.delta_rule_chunk import _chunks_before, _locate, _tile_rows, _unit_lower_inverse
from harness.impls.triton import delta_rule_chunk as _gdn
from harness.impls.triton.ssd_chunk_cumsum import chunk_table_size
from harness.ops import PAD_SLOT_ID

__all__ = ["kda_varlen", "CONFIG"]

# bt: chunk length (16, 32 or 64), bv: value channels per scan program, prep_bv: value channels per step
# of the per-chunk stage's u / Qk u, prep_warps / scan_warps / scan_stages: the launches' num_warps and the
# scan's load pipelining, fast_thr: the split-factor bound of the fast intra-chunk path (log2 units; below 0:
# always the exact path), t_products: bf16 inputs' products with T, Qk w and Qk u in "tf32" (T and Qk in fp32)
# or in "half" (bf16, as fla-core stores its solve's output; fp16 and fp32 / fp64 inputs are unaffected), prep_bk:
# key channels per block of the per-chunk stage (0: the whole width at once; 16, 32 or 64: two passes over the
# blocks, `_kda_prep_blocked`). The device's values in configs/<device>/kda_chunk.json.
# Sweep candidates lead with the settings of fewest registers: bt 16 (both launches), or bt 32 with bv 16 over 8
# scan warps (the scan).
CONFIG = launch_config("kda_chunk", {"bt": 64, "bv": 32, "prep_bv": 64, "prep_warps": 8, "scan_warps": 4,
                                     "scan_stages": 2, "fast_thr": 96.0, "t_products": "tf32", "prep_bk": 0})
T_PRODUCTS = _gdn.T_PRODUCTS  # the Gated DeltaNet prefill's choices, the same meaning


@triton.jit
def _dot(a, b, DOT: tl.constexpr, PREC: tl.constexpr, CD: tl.constexpr):
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC, out_dtype=CD)


@triton.jit
def _kda_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, qsl_ptr, scale_ptr,
                     w_ptr, qp_ptr, kg_ptr, u_ptr, ou_ptr, dl_ptr,
                     S, K, V, scale,
                     sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1, s_qsl,
                     sw0, sw1, su0, su1, sdl0, sdl1,
                     BT: tl.constexpr, SUB: tl.constexpr, LOG2NB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     BLOCK_S: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                     TDOT: tl.constexpr, TPREC: tl.constexpr, L2NORM: tl.constexpr, SCALE_T: tl.constexpr,
                     FAST_THR: tl.constexpr, WIDE: tl.constexpr, KB: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    start, n = _locate(c, qsl_ptr, s_qsl, S, BT, BLOCK_S)
    if n > 0:
        if SCALE_T:
            qscale = tl.load(scale_ptr).to(CD)
        else:
            qscale = scale
        rows = tl.arange(0, BT)
        ck = tl.arange(0, BK)
        km = ck < K
        tm = rows < n
        r = _tile_rows(rows, WIDE)  # tile offsets from the chunk's first row (a scalar 64-bit offset)
        if KB < BK:
            bt = tl.load(b_ptr + (start * sb0 + h * sb1) + r * sb0, mask=tm, other=0.0).to(CD)
            _kda_prep_blocked(q_ptr, k_ptr, g_ptr, w_ptr, qp_ptr, kg_ptr, dl_ptr, v_ptr, u_ptr, ou_ptr, c, h, start,
                              n, r, rows, tm, bt, qscale, K, V, sq0, sq1, sq2, sk0, sk1, sk2, sg0, sg1, sg2, sv0, sv1,
                              sv2, sw0, sw1, su0, su1, sdl0, sdl1, BT, SUB, LOG2NB, BV, CD, DOT, PREC, TDOT, TPREC,
                              L2NORM, FAST_THR, KB)
            return
        m2 = tm[:, None] & km[None, :]
        qv = tl.load(q_ptr + (start * sq0 + h * sq1) + (r[:, None] * sq0 + ck[None, :] * sq2), mask=m2,
                     other=0.0).to(CD)
        kv = tl.load(k_ptr + (start * sk0 + h * sk1) + (r[:, None] * sk0 + ck[None, :] * sk2), mask=m2,
                     other=0.0).to(CD)
        gv = tl.load(g_ptr + (start * sg0 + h * sg1) + (r[:, None] * sg0 + ck[None, :] * sg2), mask=m2,
                     other=0.0).to(CD)
        bt = tl.load(b_ptr + (start * sb0 + h * sb1) + r * sb0, mask=tm, other=0.0).to(CD)
        if L2NORM:
            qv = qv / tl.sqrt(tl.sum(qv * qv, axis=1) + 1e-6)[:, None]
            kv = kv / tl.sqrt(tl.sum(kv * kv, axis=1) + 1e-6)[:, None]
        qv = qv * qscale
        G = tl.cumsum(gv * 1.4426950408889634, axis=0)  # log2 units
        g_last = tl.sum(tl.where(rows[:, None] == BT - 1, G, 0.0), axis=0)  # (BK,): flat past the end
        g_mid = tl.sum(tl.where(rows[:, None] == BT // 2 - 1, G, 0.0), axis=0)
        spread = tl.maximum(tl.max(tl.abs(G - g_mid[None, :])), tl.max(tl.abs(g_mid)))
        if spread <= FAST_THR:
            # split at the middle: every factor within 2**FAST_THR
            fa = tl.exp2(G - g_mid[None, :])
            fb = tl.exp2(g_mid[None, :] - G)
            kb = kv * fb
            qk = _dot(qv * fa, tl.trans(kb), DOT, PREC, CD)
            kk = _dot(kv * fa, tl.trans(kb), DOT, PREC, CD)
            fa = fa * tl.exp2(g_mid)[None, :]  # exp(G): from the chunk start
            qg = qv * fa
            ke = kv * fa
            kg = kb * tl.exp2(g_last - g_mid)[None, :]  # k exp(G_last - G): to the chunk end
        else:
            # exact: each pair's exponent masked to j <= i before the exponential
            qk, kk = _kda_exact_pairs(qv, kv, G, rows, BT, CD)
            fa = tl.exp2(G)
            qg = qv * fa
            ke = kv * fa
            kg = kv * tl.exp2(g_last[None, :] - G)
        qk = tl.where(rows[:, None] >= rows[None, :], qk, 0.0)
        A = tl.where(rows[:, None] > rows[None, :], kk * bt[:, None], 0.0)
        Tm = _unit_lower_inverse(A, rows, n, BT, SUB, LOG2NB, CD, TPREC)
        w = _dot(Tm, ke * bt[:, None], TDOT, TPREC, CD)
        qp = qg - _dot(qk, w, TDOT, TPREC, CD)
        kt_off = (start * sw0 + h * sw1) + (r[:, None] * sw0 + ck[None, :])
        tl.store(w_ptr + kt_off, w.to(w_ptr.dtype.element_ty), mask=m2)
        tl.store(qp_ptr + kt_off, qp.to(qp_ptr.dtype.element_ty), mask=m2)
        tl.store(kg_ptr + kt_off, kg.to(kg_ptr.dtype.element_ty), mask=m2)
        tl.store(dl_ptr + c * sdl0 + h * sdl1 + ck, tl.exp2(g_last).to(dl_ptr.dtype.element_ty), mask=km)
        _kda_prep_values(Tm, qk, bt, v_ptr, u_ptr, ou_ptr, start, h, r, tm, V, sv0, sv1, sv2, su0, su1, BV, CD, TDOT,
                         TPREC)


@triton.jit
def _kda_exact_pairs(qv, kv, G, rows, BT: tl.constexpr, CD: tl.constexpr):
    """The exact path's Qk_ij = sum_c q_ic k_jc exp(G_ic - G_jc) and k k's, i >= j, over the key channels of the
    (BT, .) tiles given, one column j at a time: each pair's exponent masked to j <= i before the exponential."""
    qk = tl.zeros((BT, BT), dtype=CD)
    kk = tl.zeros((BT, BT), dtype=CD)
    for j in range(BT):
        sel = rows[:, None] == j
        kj = tl.sum(tl.where(sel, kv, 0.0), axis=0)
        gj = tl.sum(tl.where(sel, G, 0.0), axis=0)
        low = (rows >= j)[:, None]
        dec = tl.where(low, tl.exp2(tl.where(low, G - gj[None, :], 0.0)), 0.0)
        kjd = kj[None, :] * dec
        col = rows[None, :] == j
        qk = tl.where(col, tl.sum(qv * kjd, axis=1)[:, None], qk)
        kk = tl.where(col, tl.sum(kv * kjd, axis=1)[:, None], kk)
    return qk, kk


@triton.jit
def _kda_prep_values(Tm, qk, bt, v_ptr, u_ptr, ou_ptr, start, h, r, tm, V, sv0, sv1, sv2, su0, su1, BV: tl.constexpr,
                     CD: tl.constexpr, TDOT: tl.constexpr, TPREC: tl.constexpr):
    """u = T (beta v) and ou = Qk u of one chunk and head, BV value channels at a time."""
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        mv = tm[:, None] & (vv < V)[None, :]
        vt = tl.load(v_ptr + (start * sv0 + h * sv1) + (r[:, None] * sv0 + vv[None, :] * sv2), mask=mv,
                     other=0.0).to(CD)
        u = _dot(Tm, vt * bt[:, None], TDOT, TPREC, CD)
        ou = _dot(qk, u, TDOT, TPREC, CD)
        vt_off = (start * su0 + h * su1) + (r[:, None] * su0 + vv[None, :])
        tl.store(u_ptr + vt_off, u.to(u_ptr.dtype.element_ty), mask=mv)
        tl.store(ou_ptr + vt_off, ou.to(ou_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _kda_block_loads(q_ptr, k_ptr, g_ptr, start, h, r, tm, ck, km, sq0, sq1, sq2, sk0, sk1, sk2, sg0, sg1, sg2,
                     CD: tl.constexpr):
    """Key channels ck of the chunk's q, k (as stored) and G (the cumulative log2-decay from the chunk start)."""
    m2 = tm[:, None] & km[None, :]
    qv = tl.load(q_ptr + (start * sq0 + h * sq1) + (r[:, None] * sq0 + ck[None, :] * sq2), mask=m2, other=0.0).to(CD)
    kv = tl.load(k_ptr + (start * sk0 + h * sk1) + (r[:, None] * sk0 + ck[None, :] * sk2), mask=m2, other=0.0).to(CD)
    gv = tl.load(g_ptr + (start * sg0 + h * sg1) + (r[:, None] * sg0 + ck[None, :] * sg2), mask=m2, other=0.0).to(CD)
    return qv, kv, tl.cumsum(gv * 1.4426950408889634, axis=0)


@triton.jit
def _kda_prep_blocked(q_ptr, k_ptr, g_ptr, w_ptr, qp_ptr, kg_ptr, dl_ptr, v_ptr, u_ptr, ou_ptr, c, h, start, n, r,
                      rows, tm, bt, qscale, K, V, sq0, sq1, sq2, sk0, sk1, sk2, sg0, sg1, sg2, sv0, sv1, sv2, sw0, sw1,
                      su0, su1, sdl0, sdl1, BT: tl.constexpr, SUB: tl.constexpr, LOG2NB: tl.constexpr,
                      BV: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, TDOT: tl.constexpr,
                      TPREC: tl.constexpr, L2NORM: tl.constexpr, FAST_THR: tl.constexpr, KB: tl.constexpr):
    """`_kda_prep_kernel`'s chunk with the key channels in blocks of KB (prep_bk): (BT, KB) tiles of q, k and G
    live at a time. Pass 1 accumulates Qk and A's k k products over the blocks (each block split at its own
    middle where its spread allows, else exact) and the rows' sums of squares; the l2 normalisation and the
    scale are row and column factors applied after it. Pass 2 reloads each block for w, q' and kg (exp(G) and
    exp(G_last - G) formed directly, as the exact path does) and the chunk's decay."""
    qk = tl.zeros((BT, BT), dtype=CD)
    kk = tl.zeros((BT, BT), dtype=CD)
    ssq = tl.zeros((BT,), dtype=CD)
    ssk = tl.zeros((BT,), dtype=CD)
    for k0 in range(0, K, KB):
        ck = k0 + tl.arange(0, KB)
        km = ck < K
        qv, kv, G = _kda_block_loads(q_ptr, k_ptr, g_ptr, start, h, r, tm, ck, km, sq0, sq1, sq2, sk0, sk1, sk2,
                                     sg0, sg1, sg2, CD)
        if L2NORM:
            ssq += tl.sum(qv * qv, axis=1)
            ssk += tl.sum(kv * kv, axis=1)
        g_mid = tl.sum(tl.where(rows[:, None] == BT // 2 - 1, G, 0.0), axis=0)
        spread = tl.maximum(tl.max(tl.abs(G - g_mid[None, :])), tl.max(tl.abs(g_mid)))
        if spread <= FAST_THR:
            fa = tl.exp2(G - g_mid[None, :])
            kb = kv * tl.exp2(g_mid[None, :] - G)
            qk += _dot(qv * fa, tl.trans(kb), DOT, PREC, CD)
            kk += _dot(kv * fa, tl.trans(kb), DOT, PREC, CD)
        else:
            dq, dk = _kda_exact_pairs(qv, kv, G, rows, BT, CD)
            qk += dq
            kk += dk
    rq = tl.full((BT,), 1.0, CD)
    rk = tl.full((BT,), 1.0, CD)
    if L2NORM:
        rq = 1.0 / tl.sqrt(ssq + 1e-6)
        rk = 1.0 / tl.sqrt(ssk + 1e-6)
    rq = rq * qscale
    qk = tl.where(rows[:, None] >= rows[None, :], qk * rq[:, None] * rk[None, :], 0.0)
    A = tl.where(rows[:, None] > rows[None, :], kk * (bt * rk)[:, None] * rk[None, :], 0.0)
    Tm = _unit_lower_inverse(A, rows, n, BT, SUB, LOG2NB, CD, TPREC)
    for k0 in range(0, K, KB):
        ck = k0 + tl.arange(0, KB)
        km = ck < K
        qv, kv, G = _kda_block_loads(q_ptr, k_ptr, g_ptr, start, h, r, tm, ck, km, sq0, sq1, sq2, sk0, sk1, sk2,
                                     sg0, sg1, sg2, CD)
        kv = kv * rk[:, None]
        g_last = tl.sum(tl.where(rows[:, None] == BT - 1, G, 0.0), axis=0)  # (KB,): flat past the end
        fa = tl.exp2(G)
        w = _dot(Tm, kv * fa * bt[:, None], TDOT, TPREC, CD)
        qp = qv * rq[:, None] * fa - _dot(qk, w, TDOT, TPREC, CD)
        kt_off = (start * sw0 + h * sw1) + (r[:, None] * sw0 + ck[None, :])
        m2 = tm[:, None] & km[None, :]
        tl.store(w_ptr + kt_off, w.to(w_ptr.dtype.element_ty), mask=m2)
        tl.store(qp_ptr + kt_off, qp.to(qp_ptr.dtype.element_ty), mask=m2)
        tl.store(kg_ptr + kt_off, (kv * tl.exp2(g_last[None, :] - G)).to(kg_ptr.dtype.element_ty), mask=m2)
        tl.store(dl_ptr + c * sdl0 + h * sdl1 + ck, tl.exp2(g_last).to(dl_ptr.dtype.element_ty), mask=km)
    _kda_prep_values(Tm, qk, bt, v_ptr, u_ptr, ou_ptr, start, h, r, tm, V, sv0, sv1, sv2, su0, su1, BV, CD, TDOT,
                     TPREC)


@triton.jit
def _kda_scan_kernel(w_ptr, qp_ptr, kg_ptr, u_ptr, ou_ptr, dl_ptr, o_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr,
                     K, V, pad_id,
                     sw0, sw1, su0, su1, sdl0, sdl1, so0, so1, so2, ss0, ss1, ss2, ss3, s_qsl, s_idx, s_hi,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BLOCK_S: tl.constexpr,
                     CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vb = tl.program_id(2)
    bos = tl.load(qsl_ptr + n * s_qsl).to(tl.int64)
    eos = tl.load(qsl_ptr + (n + 1) * s_qsl).to(tl.int64)
    slot = tl.load(idx_ptr + n * s_idx).to(tl.int64)
    init = tl.load(hi_ptr + n * s_hi).to(tl.int32)
    live = slot != pad_id
    slot = tl.where(live, slot, 0)
    c0 = _chunks_before(n, qsl_ptr, s_qsl, BT, BLOCK_S)

    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    km = ck < K
    vm = vv < V
    # the state tile, key-major (BK, BV): zeros unless a live request with an initial state
    sptr = st_ptr + slot * ss0 + h * ss1 + vv[None, :].to(tl.int64) * ss2 + ck[:, None].to(tl.int64) * ss3
    smask = km[:, None] & vm[None, :]
    use = (ck * 0 + tl.where(live, init, 0)) != 0  # as a vector (the interpreter mishandles vector & scalar bools)
    S = tl.load(sptr, mask=smask & use[:, None], other=0.0).to(CD)

    lvo = (vv * 0 + live.to(tl.int32)) != 0  # a pad request's tokens get o = 0
    nc = tl.cdiv(eos - bos, BT)
    for c in tl.range(0, nc, num_stages=STAGES):
        t = bos + c * BT + rows
        tm = t < eos
        mk = tm[:, None] & km[None, :]
        mv = tm[:, None] & vm[None, :]
        kt_off = t[:, None] * sw0 + h * sw1 + ck[None, :]
        vt_off = t[:, None] * su0 + h * su1 + vv[None, :]
        wt = tl.load(w_ptr + kt_off, mask=mk, other=0.0)
        qt = tl.load(qp_ptr + kt_off, mask=mk, other=0.0)
        kt = tl.load(kg_ptr + kt_off, mask=mk, other=0.0)
        ut = tl.load(u_ptr + vt_off, mask=mv, other=0.0).to(CD)
        out = tl.load(ou_ptr + vt_off, mask=mv, other=0.0).to(CD)
        dl = tl.load(dl_ptr + (c0 + c) * sdl0 + h * sdl1 + ck, mask=km, other=0.0).to(CD)
        sd = S.to(DOT)
        vn = ut - _dot(wt, sd, DOT, PREC, CD)
        o = tl.where(lvo[None, :], out + _dot(qt, sd, DOT, PREC, CD), 0.0)
        tl.store(o_ptr + t[:, None] * so0 + h * so1 + vv[None, :] * so2, o.to(o_ptr.dtype.element_ty), mask=mv)
        S = S * dl[:, None] + _dot(tl.trans(kt), vn, DOT, PREC, CD)

    lv = (ck * 0 + live.to(tl.int32)) != 0
    tl.store(sptr, S.to(st_ptr.dtype.element_ty), mask=smask & lv[:, None])


def _dot_types(dtype: torch.dtype, cd: torch.dtype):
    """(operand dtype, input_precision) of the activation and state dots, the same of the products with T,
    Qk w and Qk u, and the scratch dtype: bf16 as is (T products in tf32); fp16 through tf32 with fp32
    scratch (the split factors and a growing exp(G) exceed fp16's range); fp32 / fp64 exactly."""
    if dtype == torch.bfloat16:
        return tl.bfloat16, None, tl.float32, "tf32", torch.bfloat16
    if dtype == torch.float16:
        return tl.float32, "tf32", tl.float32, "tf32", torch.float32
    exact = tl.float64 if cd == torch.float64 else tl.float32
    return exact, "ieee", exact, "ieee", cd


# shared memory a scan program may take for its pipelined chunk tiles (the H200 has 227 KiB per block; the
# rest is left to the compiler's layout conversions)
SCAN_SMEM_BYTES = 200 * 1024


def scan_stages(stages: int, operand_bytes: int, bt: int, bk: int, bv: int) -> int:
    """The scan loop's pipeline depth: the configured one, lowered until its stages of chunk tiles (w, Qk
    and k-gate rows of (bt, bk), u and Qk u rows of (bt, bv)) fit in SCAN_SMEM_BYTES (fp16 inputs run the
    dots on fp32 operands: at K = 128 two stages would not fit)."""
    per_stage = (3 * bt * bk + 2 * bt * bv) * operand_bytes
    while stages > 1 and stages * per_stage > SCAN_SMEM_BYTES:
        stages -= 1
    return stages


def _block(value, name: str, allowed) -> int:
    value = int(value)
    if value not in allowed:
        raise ValueError(f"kda_chunk config {name}: expected one of {sorted(allowed)}, got {value}")
    return value


def _plan(dims, call):
    """One call's launches (`call`: the validator's arguments, `out=` last) from the validator's answer: (the
    `Staged` plan, or None where there is no sequence or head; o's shape)."""
    T, _, H, K, V, S = dims
    q, k, v, g, beta, ssm_states = call[:6]
    scale, use_qk_l2norm, pad_slot_id, out = call[9:]
    if S == 0 or H == 0:
        return None, (T, H, V)
    cd = compute_dtype(q.dtype)
    CD = tl.float64 if cd == torch.float64 else tl.float32
    if CONFIG["t_products"] not in T_PRODUCTS:
        raise ValueError(f"kda_chunk config t_products: expected one of {list(T_PRODUCTS)}, "
                         f"got {CONFIG['t_products']!r}")
    dot, prec, tdot, tprec, sdt = _dot_types(q.dtype, cd)
    if CONFIG["t_products"] == "half" and q.dtype == torch.bfloat16:
        tdot = tl.bfloat16
    bt = _block(CONFIG["bt"], "bt", (16, 32, 64))
    sub = 16
    BK = max(16, next_power_of_2(K))
    VP = max(16, next_power_of_2(V))
    BV = min(_block(CONFIG["bv"], "bv", (16, 32, 64, 128)), VP)
    BVP = min(_block(CONFIG["prep_bv"], "prep_bv", (16, 32, 64, 128)), VP)
    KB = min(_block(CONFIG["prep_bk"], "prep_bk", (0, 16, 32, 64)) or BK, BK)
    # scale > 0 (the contract): equal values of it are equal bits, so the plan may hold it
    sc = float(K ** -0.5 if scale is None else scale)
    scale_t = cd == torch.float64
    dev = v.device
    st = Staged()
    # fp64 runs read the exact scale from a tensor (float arguments arrive as fp32): filled on the device per call
    if scale_t:
        st.filled("sct", sc, cd, dev)
    else:
        st.alias("sct", "o")
    NC = chunk_table_size(T, S, bt)
    w = st.buffer("w", (T, H, K), sdt, dev)
    for name in ("qp", "kg"):
        st.buffer(name, (T, H, K), sdt, dev)
    u = st.buffer("u", (T, H, V), sdt, dev)
    st.buffer("ou", (T, H, V), sdt, dev)
    dl = st.buffer("dl", (NC, H, K), cd, dev)
    BLOCK_S = min(1024, max(16, next_power_of_2(S)))
    so = (out if out is not None else torch.empty((T, H, V), dtype=v.dtype, device="meta")).stride()
    s_qsl, s_idx, s_hi = (t.stride(0) for t in unit_stride(*call[6:9]))
    rows_span = bt * max(abs(x.stride(0)) for x in (q, k, v, g, beta, w, u))
    wide = rows_span + max(K, V) * max(abs(x.stride(2)) for x in (q, k, v, g)) >= _gdn.WIDE_SPAN
    st.add(_kda_prep_kernel, (NC, H),
           ("q", "k", "v", "g", "beta", "query_start_loc", "sct", "w", "qp", "kg", "u", "ou", "dl"),
           (S, K, V, sc,
            *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), s_qsl,
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), dl.stride(0), dl.stride(1)),
           BT=bt, SUB=sub, LOG2NB=(bt // sub).bit_length() - 1, BK=BK, BV=BVP, BLOCK_S=BLOCK_S, CD=CD,
           DOT=dot, PREC=prec, TDOT=tdot, TPREC=tprec, L2NORM=bool(use_qk_l2norm), SCALE_T=scale_t,
           FAST_THR=float(CONFIG["fast_thr"]), WIDE=wide, KB=KB, num_warps=int(CONFIG["prep_warps"]))
    st.add(_kda_scan_kernel, (S, H, cdiv(V, BV)),
           ("w", "qp", "kg", "u", "ou", "dl", "o", "ssm_states", "query_start_loc", "cache_indices",
            "has_initial_state"),
           (K, V, int(pad_slot_id),
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), dl.stride(0), dl.stride(1), *so,
            *ssm_states.stride(), s_qsl, s_idx, s_hi),
           BT=bt, BK=BK, BV=BV, BLOCK_S=BLOCK_S, CD=CD, DOT=dot, PREC=prec,
           STAGES=scan_stages(int(CONFIG["scan_stages"]), w.element_size(), bt, BK, BV),
           num_warps=int(CONFIG["scan_warps"]))
    return st, (T, H, V)


_PLANS = HostPlans(C.validate_kda_varlen, _plan, CONFIG)


@provides("triton", "kda_varlen")
def kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *, scale=None,
               use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Kimi Delta Attention over packed sequences (see harness.ops for the contract)."""
    return _gdn.run_varlen(_PLANS, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                           scale, use_qk_l2norm, pad_slot_id, out)
