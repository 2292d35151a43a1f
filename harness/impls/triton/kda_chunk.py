"""Triton chunked prefill for Kimi Delta Attention (op `kda_varlen`): one fused kernel.

One program per (sequence, head, block of BV value channels) walks its sequence's chunks of BT tokens
with the (K, BV) slice of the state in registers (fp32; fp64 for fp64 inputs). The chunk grid restarts at
every sequence start; rows past the sequence's end load as zeros (q = k = v = g = beta = 0), so they
neither decay nor write the state, and are not stored. Per chunk, with G (BT, K) the cumulative log-decay
(inclusive, from the chunk start, in log2 units) and S the state before the chunk:

    Qk_ij = sum_c q_ic k_jc exp(G_ic - G_jc)  (i >= j)      A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)  (i > j)
    T = (I + A)^-1,  w = T (beta exp(G) k),  u = T (beta v),  v' = u - w S
    o = (q exp(G)) S + Qk v',   S <- diag(exp(G_last)) S + (k exp(G_last - G))^T v'

(S here is the key-major (K, BV) tile; the pool holds it value-major.) The pairwise decays exp(G_i - G_j)
are per key channel and cannot be split into exp(G_i) exp(-G_j) over a chunk in general. When every
|G - G_m| of the chunk (G_m: the cumulative decay at its middle, the chunk start included) stays within
FAST_THR (log2 units), they are split at that reference, exp(G_i - G_m) exp(G_m - G_j), each factor below
2**FAST_THR, and Qk / A come from two tensor-core dots; otherwise (|g| above ~8 per token on average over
half of a 16-token chunk, either sign) the chunk takes the exact path: every pair's exponent formed and
masked before the exponential, as the float64 reference does. T comes from recursive block inversion
(blocks of 1, 2, 4, ... BT/2: T21 = -T22 A21 T11 for all blocks of a level at once, two dots per level,
in fp32 "ieee").

Dots on activations run in bf16 for bf16 inputs, tf32 for fp16 inputs (the split factors reach 2**96,
past fp16's range), exactly ("ieee") for fp32 / fp64. Pads' tokens are computed from a zero state (as the
torch implementation does) and their slots never touched; a live request reads its slot when
has_initial_state (zeros otherwise) and writes the final state back in place, honouring the pool's
strides (an empty sequence writes its initial state). No host synchronisation: the grid is
(sequences, heads, value blocks), the chunk count is read on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import cdiv, compute_dtype, device_guard, launch_config, next_power_of_2
from harness.ops import PAD_SLOT_ID

__all__ = ["kda_varlen", "CONFIG"]

# bt: chunk length (16 or 32), bv: value channels per program, warps / stages: the launch's num_warps /
# num_stages, fast_thr: the split-factor bound of the fast intra-chunk path (log2 units; below 0: always
# the exact path). The device's values in configs/<device>/kda_chunk.json.
CONFIG = launch_config("kda_chunk", {"bt": 16, "bv": 32, "warps": 8, "stages": 2, "fast_thr": 96.0})

@triton.jit
def _dot(a, b, DOT: tl.constexpr, PREC: tl.constexpr, CD: tl.constexpr):
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC, out_dtype=CD)


@triton.jit
def _unit_lower_inverse(A, rows, BT: tl.constexpr, LOG2BT: tl.constexpr, CD: tl.constexpr):
    """(I + A)^-1 for A (BT, BT) strictly lower triangular, by recursive block inversion: with the
    inverses of the diagonal blocks of size s in T (block diagonal), each pair of blocks of a 2s-block gets
    its lower off-diagonal block T21 = -T22 A21 T11 (all at once: T A_off T with A_off the masked A)."""
    T = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0).to(CD)
    for lvl in tl.static_range(LOG2BT):
        ri = rows[:, None] >> lvl
        cj = rows[None, :] >> lvl
        off = (ri == cj + 1) & ((ri >> 1) == (cj >> 1))
        a_off = tl.where(off, A, 0.0)
        T = T - _dot(_dot(T, a_off, CD, "ieee", CD), T, CD, "ieee", CD)
    return T


@triton.jit
def _kda_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr, o_ptr, scale_ptr,
                      scale, K, V, pad_id,
                      sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1,
                      ss0, ss1, ss2, ss3, so0, so1, so2,
                      BT: tl.constexpr, LOG2BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, L2NORM: tl.constexpr,
                      SCALE_T: tl.constexpr, FAST_THR: tl.constexpr, STAGES: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    vb = tl.program_id(2)
    bos = tl.load(qsl_ptr + n).to(tl.int64)
    eos = tl.load(qsl_ptr + n + 1).to(tl.int64)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    init = tl.load(hi_ptr + n).to(tl.int32)
    live = slot != pad_id
    slot = tl.where(live, slot, 0)
    if SCALE_T:
        qscale = tl.load(scale_ptr).to(CD)
    else:
        qscale = scale

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

    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    nc = tl.cdiv(eos - bos, BT)
    for c in tl.range(0, nc, num_stages=STAGES):
        t = bos + c * BT + rows
        tm = t < eos
        m2 = tm[:, None] & km[None, :]
        qv = tl.load(q_ptr + t[:, None] * sq0 + h * sq1 + ck[None, :] * sq2, mask=m2, other=0.0).to(CD)
        kv = tl.load(k_ptr + t[:, None] * sk0 + h * sk1 + ck[None, :] * sk2, mask=m2, other=0.0).to(CD)
        gv = tl.load(g_ptr + t[:, None] * sg0 + h * sg1 + ck[None, :] * sg2, mask=m2, other=0.0).to(CD)
        bt = tl.load(b_ptr + t * sb0 + h * sb1, mask=tm, other=0.0).to(CD)
        vt = tl.load(v_ptr + t[:, None] * sv0 + h * sv1 + vv[None, :] * sv2, mask=tm[:, None] & vm[None, :],
                     other=0.0).to(CD)
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
            fa = tl.exp2(G)
            qg = qv * fa
            ke = kv * fa
            kg = kv * tl.exp2(g_last[None, :] - G)
        qk = tl.where(causal, qk, 0.0)
        A = tl.where(strict, kk * bt[:, None], 0.0)
        Tm = _unit_lower_inverse(A, rows, BT, LOG2BT, CD)
        w = _dot(Tm, ke * bt[:, None], DOT, PREC, CD)
        u = _dot(Tm, vt * bt[:, None], DOT, PREC, CD)
        sd = S.to(DOT)
        vn = u - _dot(w, sd, DOT, PREC, CD)
        o = _dot(qg, sd, DOT, PREC, CD) + _dot(qk, vn, DOT, PREC, CD)
        tl.store(o_ptr + t[:, None] * so0 + h * so1 + vv[None, :] * so2, o.to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])
        S = S * tl.exp2(g_last)[:, None] + _dot(tl.trans(kg), vn, DOT, PREC, CD)

    lv = (ck * 0 + live.to(tl.int32)) != 0
    tl.store(sptr, S.to(st_ptr.dtype.element_ty), mask=smask & lv[:, None])


def _dot_types(dtype: torch.dtype, cd: torch.dtype):
    """(operand dtype, input_precision) of the activation dots: bf16 as is; fp16 through tf32 (fp32
    operands: the split factors exceed fp16's range); fp32 / fp64 exactly."""
    if dtype == torch.bfloat16:
        return tl.bfloat16, None
    if dtype == torch.float16:
        return tl.float32, "tf32"
    return (tl.float64 if cd == torch.float64 else tl.float32), "ieee"


@provides("triton", "kda_varlen")
def kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *, scale=None,
               use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Kimi Delta Attention over packed sequences (see harness.ops for the contract)."""
    T, _, H, K, V, S = C.validate_kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices,
                                             has_initial_state, scale, use_qk_l2norm, pad_slot_id, out)
    o = out if out is not None else torch.empty((T, H, V), dtype=v.dtype, device=v.device)
    if S == 0 or H == 0:
        return o
    cd = compute_dtype(q.dtype)
    dot, prec = _dot_types(q.dtype, cd)
    bt = int(CONFIG["bt"])
    if bt not in (16, 32, 64):
        raise ValueError(f"kda_chunk config bt: expected 16, 32 or 64, got {bt}")
    BK = max(16, next_power_of_2(K))
    BV = max(16, min(int(CONFIG["bv"]), next_power_of_2(V)))
    sc = float(K ** -0.5 if scale is None else scale)
    scale_t = cd == torch.float64
    # fp64 runs read the exact scale from a tensor (float arguments arrive as fp32); filled on the device
    sct = torch.full((1,), sc, dtype=cd, device=q.device) if scale_t else o
    pool = ssm_states
    with device_guard(q):
        _kda_chunk_kernel[(S, H, cdiv(V, BV))](
            q, k, v, g, beta, pool, query_start_loc, cache_indices, has_initial_state, o, sct,
            sc, K, V, int(pad_slot_id),
            *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
            *pool.stride(), *o.stride(),
            BT=bt, LOG2BT=bt.bit_length() - 1, BK=BK, BV=BV, CD=tl.float64 if cd == torch.float64 else tl.float32,
            DOT=dot, PREC=prec, L2NORM=bool(use_qk_l2norm), SCALE_T=scale_t, FAST_THR=float(CONFIG["fast_thr"]),
            STAGES=int(CONFIG["stages"]), num_warps=int(CONFIG["warps"]))
    return o
