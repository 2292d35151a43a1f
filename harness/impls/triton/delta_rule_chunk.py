"""Gated DeltaNet chunked prefill (op `gated_delta_rule_varlen` of harness.ops) in Triton.

The chunk grid is per sequence: chunk k of sequence s covers tokens [q[s] + k*C, min(q[s] + (k+1)*C, q[s+1])),
so every chunk belongs to one sequence and a sequence's last chunk may be shorter. Chunk slots are numbered
sequence by sequence (the chunks of sequence s follow those of sequences 0..s-1); there are at most
T // C + S of them, and every program finds its sequence / chunk slot by counting chunks over
query_start_loc on the device (no host sync; slots past the last chunk exit). Positions of a tile past a
chunk's end are loaded as selected zeros (masked loads, never another request's values times a zero mask),
so they neither decay nor write the state. With G the in-chunk cumulative log-decay (G_i = g_1 + .. + g_i),
value-major state S (V, K) and l2-normalised, scaled q and k, CONFIG["outputs"] picks one of two pipelines.

"parallel" (the default): three launches, only the state recurrence sequential.

1. `_gdn_prep_kernel`, one program per (chunk slot, value head), all chunks in parallel. It forms
       A = strictly-lower(beta_i k_i . k_j exp(G_i - G_j)),   T = (I + A)^-1   (`_unit_lower_inverse`),
       w = T (beta exp(G) k)   (C, K),   u = T (beta v)   (C, V),   kg = exp(G_last - G) k   (C, K)
   and stores w, u, kg and G per token (scratch indexed like the activations, (T, Hv, .)).
   With CONFIG["prep_split"] it stores T (chunk slot, Hv, C, C) in the dtype its products take and the key
   rows' norms instead, and `_gdn_wu_kernel` forms w, u and kg from them, one program per (block of wu_bw key or
   value columns, chunk slot, value head): the same operations on the same values, in programs of fewer
   registers (sm_90, bf16, K = V = 128: 156 and 78 against the fused launch's 254).
2. `_gdn_state_kernel`, one program per (sequence, value head, block of BV value rows), walking the
   sequence's chunks in order with its (BV, K) state tile in registers (fp32; fp64 for fp64 inputs). Per chunk
       S_c = S (stored),   v' = u - w S^T (stored over u),   S <- exp(G_last) S + v'^T kg:
   two dots, no q, no k normalisation, no exponential per element. S_c, the state before chunk c, goes to
   a per-chunk-slot scratch (slot, Hv, V, K).
   With CONFIG["update_keys"] "rows" the prep computes and stores no kg (a write and a read of (T, Hv, K)
   half values saved) and the state kernel loads the chunk's k tile of its key head as stored (k's strides;
   value head h reads key head h // (Hv // Hk)) with the rows' sums of squares, and scales the rows of v'
   instead: S <- exp(G_last) S + (v' * r)^T k with r_i = exp(G_last - G_i) / ||k_i|| (no norm without the
   l2 normalisation) on live rows, exact zeros past the chunk's end (the exponent masked before the exp).
   The v' stored for the output launch is unscaled. The (CH, BV) rows of v' are scaled in place of the
   (CH, K) rows of k; half inputs feed (v' * r) and k to the dot in their dtype with fp32 accumulation.
3. `_gdn_out_kernel`, one program per (chunk slot, value head, block of BV value rows), all in parallel:
       o = (exp(G) q) S_c^T + (lower(q k^T) * exp(G_i - G_j)) v'.
   It loads q and k as stored and l2-normalises them itself: the rows' norms are row and column factors of
   the products, so one pass over K in blocks of CONFIG["out_bk"] columns (0: the whole width as one block)
   accumulates q k^T, q S_c^T and the rows' sums of squares together, and the norms, the scale and the decays
   are applied to the two products after it (no normalised tile is held). Storing normalised copies once per
   key head instead would cost a write and a read of two (T, Hk, K) tensors and, for half inputs, round q
   twice. Blocks of at most 64 columns and one pipeline stage: at two stages Triton 3.6 compiles this loop
   for sm_90 into programs whose outputs vary from run to run at half inputs, with one (64, 128) block per
   operand (off by 10-30 %) and with 64-column blocks too (bf16, T = 4096, K = V = 128: 34,528 outputs
   differ between two runs of one input); docs/findings.md. One stage costs ~4 % at that shape.
   With CONFIG["out_heads"] "key" a program serves the Hv / Hk value heads of one key head instead
   (the kernel's SHARED form): q k^T and the rows' norms depend on the key head only, so they are formed once,
   and each value head then makes its own pass over K for q S_c^T (q read again) before its decays and v'.

"scan": two launches (the prep as above but storing Aqk = lower(q_i . k_j exp(G_i - G_j)) (C, C, diagonal
included) in place of kg; then `_gdn_scan_kernel`, one program per (sequence, value head, BV value rows),
computing per chunk v' = u - w S^T, o = (exp(G) q) S^T + Aqk v', S <- exp(G_last) S + v'^T (exp(G_last - G) k)
with q and k reloaded and renormalised in it; with update_keys "rows" the decays scale the rows of v' instead,
S <- exp(G_last) S + (v' exp(G_last - G))^T k).

Pairwise decays are exponentials of differences masked to i >= j (and to live rows) before the exp, so
decays of any strength give exact zeros, never inf * 0, and a positive g (a growing state) stays exact
where finite. The state starts from the pool slot (cache_indices) where has_initial_state, from zeros
otherwise; a pad request's tokens are stored as o = 0 (the op contract; the parallel pipeline skips its
recurrence); live requests write their final state back in place (an empty live sequence writes its
initial state, zeros without has_initial_state); pads and unnamed slots are never touched. The pool may
be any strided view: it is addressed through its strides.

Dots: fp32 inputs multiply in fp32 ("ieee"), fp64 in fp64; half inputs feed their q / k / v / scratch
and state operands to the tensor cores in their own dtype with fp32 accumulation, and the products with T
in tf32 (CONFIG["t_products"] "tf32"; "half", bf16 inputs only: T rounded to bf16 for the products w = T (..k)
and u = T (beta v), as fla-core stores its solve's output: half the operand bytes and twice the tensor-core rate,
T's rounding in w and u; the inverse itself is formed in fp32 either way). Scratch (w, u / v', kg, Aqk) is in
the half input's dtype, fp32 / fp64 otherwise; the per-chunk states S_c are in the dtype the state operand of
the dots has (the half dtype, fp32 with state_tf32, fp32 / fp64 for fp32 / fp64 inputs), so the output dot
sees exactly the operand the scan would. Token, slot and head offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import ops as C_
from harness.impls.registry import provides
from harness.impls.triton._common import (TORCH_DTYPES, HostPlans, Staged, cdiv, device_guard, launch_config,
                                          next_power_of_2, unit_stride)
from harness.impls.triton.ssd_chunk_cumsum import chunk_table_size, split_limit
from reference.delta_rule import L2NORM_EPS
from reference.validate import fail

__all__ = ["gated_delta_rule_varlen", "CONFIG"]

# outputs: "parallel" (prep, state recurrence, parallel output launch) or "scan" (prep, then outputs inside
# the sequential scan); chunk: tokens per chunk (a power of two >= 16); sub: the diagonal blocks of the
# (I + A)^-1 substitution (a power of two >= 16; chunk or more: one substitution over the whole chunk);
# bv: value rows per scan / state program (a power of two >= 16); out_bv: value rows per output program
# (a power of two >= 16); out_bk / prep_bk: key columns per step of the output / per-chunk launch (0: the
# whole key width at once; else a power of two >= 16); *_warps / *_stages: launch options; state_tf32: half
# inputs multiply the state in tf32 instead of their own dtype; update_keys: "stored" (the state update's key
# operand is the decayed keys exp(G_last - G) k: the parallel prep stores them as kg, the scan forms them) or
# "rows" (the decays and key norms scale the rows of v' and the operand is k as stored); out_heads: the parallel
# output launch's programs per "value" head, or per "key" head over its value heads (q k^T formed once for them
# all); prep_heads: the per-chunk launch's programs likewise ("key": the normalised k tile and k k^T formed once
# for the key head's value heads; whole key width only, prep_bk 0); t_products: half inputs' products with
# T = (I + A)^-1 in "tf32" (T in fp32) or in "half" (bf16; fp16, fp32 and fp64 inputs unaffected); prep_split: the
# per-chunk launch stores T and the key norms, and a second launch (`_gdn_wu_kernel`, blocks of wu_bw columns over
# wu_warps warps) forms w, u and kg from them (prep_heads "value" and prep_bk 0 only); state_major: the parallel
# recurrence holds its state tile as S (BV, K), "value", or as S^T (K, BV), "key". The device's
# values in configs/<device>/delta_rule_chunk.json. Sweep candidates (harness.bench.sweep) lead with the settings of
# fewest registers: chunk 32 for all three parallel launches; at chunk 64, key blocks of 32 over 8 warps in the
# per-chunk and output launches.
CONFIG = launch_config("delta_rule_chunk", {"outputs": "parallel", "chunk": 64, "sub": 16, "bv": 32,
                                            "prep_warps": 4, "scan_warps": 4, "scan_stages": 2, "out_bv": 128,
                                            "out_warps": 8, "out_stages": 1, "out_bk": 64, "prep_bk": 0,
                                            "state_tf32": False, "update_keys": "stored", "out_heads": "key",
                                            "prep_heads": "value", "t_products": "tf32", "prep_split": False,
                                            "wu_bw": 64, "wu_warps": 4, "state_major": "value"})
OUTPUTS = ("parallel", "scan")
UPDATE_KEYS = ("stored", "rows")
HEADS = ("value", "key")
T_PRODUCTS = ("tf32", "half")
CHOICES = {"outputs": OUTPUTS, "update_keys": UPDATE_KEYS, "out_heads": HEADS, "prep_heads": HEADS,
           "t_products": T_PRODUCTS, "state_major": HEADS}  # checked per call
# a chunk's q / k tile offsets (from its first row) are 32-bit below this many elements, 64-bit from it
WIDE_SPAN = 2 ** 31
_L2EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def _locate(c, qsl_ptr, s_qsl, S, CH: tl.constexpr, BLOCK_S: tl.constexpr):
    """(start token, length) of chunk slot c of the per-sequence grid; length 0 for a slot past the last
    chunk. Counts the chunks of the sequences wholly before c (no host-side table)."""
    _, start, length = _locate_seq(c, qsl_ptr, s_qsl, S, CH, BLOCK_S)
    return start, length


@triton.jit
def _chunks_before(s, qsl_ptr, s_qsl, CH: tl.constexpr, BLOCK_S: tl.constexpr):
    """The number of chunks of sequences 0..s-1: the chunk slot of sequence s's first chunk."""
    total = tl.zeros((), dtype=tl.int64)
    for s0 in range(0, s, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        m = offs < s
        a = tl.load(qsl_ptr + offs.to(tl.int64) * s_qsl, mask=m, other=0).to(tl.int64)
        b = tl.load(qsl_ptr + (offs + 1).to(tl.int64) * s_qsl, mask=m, other=0).to(tl.int64)
        total += tl.sum(tl.where(m, (b - a + CH - 1) // CH, 0), 0)
    return total


@triton.jit
def _locate_seq(c, qsl_ptr, s_qsl, S, CH: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, start token, length) of chunk slot c (`_locate`); the sequence is S past the last chunk."""
    seq = tl.zeros((), dtype=tl.int64)
    before = tl.zeros((), dtype=tl.int64)
    carry = tl.zeros((), dtype=tl.int64)
    for s0 in range(0, S, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        m = offs < S
        a = tl.load(qsl_ptr + offs.to(tl.int64) * s_qsl, mask=m, other=0).to(tl.int64)
        b = tl.load(qsl_ptr + (offs + 1).to(tl.int64) * s_qsl, mask=m, other=0).to(tl.int64)
        nch = tl.where(m, (b - a + CH - 1) // CH, 0)
        incl = carry + tl.cumsum(nch, 0)
        done = m & (incl <= c)
        seq += tl.sum(done.to(tl.int64), 0)
        before += tl.sum(tl.where(done, nch, 0), 0)
        carry += tl.sum(nch, 0)
    valid = seq < S
    q0 = tl.load(qsl_ptr + seq * s_qsl, mask=valid, other=0).to(tl.int64)
    q1 = tl.load(qsl_ptr + (seq + 1) * s_qsl, mask=valid, other=0).to(tl.int64)
    start = q0 + (c - before) * CH
    length = tl.where(valid, tl.minimum(q1 - start, CH), 0)
    return seq, start, length


@triton.jit
def _load_qk_norms(ptr, tok, hk, valid, kcol, km, s0, s1, s2, scale, ACC: tl.constexpr, L2NORM: tl.constexpr):
    """A (CH, BK) tile of q or k rows `tok` of key head hk in the compute dtype (zeros off `valid`),
    l2-normalised over K if L2NORM, times `scale`; and the rows' norms sqrt(sum of squares + eps) it was divided
    by (ones without L2NORM)."""
    x = tl.load(ptr + tok[:, None] * s0 + hk * s1 + kcol[None, :] * s2, mask=valid[:, None] & km[None, :],
                other=0.0).to(ACC)
    nrm = tl.full(tok.shape, 1.0, ACC)
    if L2NORM:
        nrm = tl.sqrt(tl.sum(x * x, 1) + _L2EPS)
        x = x / nrm[:, None]
    return x * scale, nrm


@triton.jit
def _load_qk(ptr, tok, hk, valid, kcol, km, s0, s1, s2, scale, ACC: tl.constexpr, L2NORM: tl.constexpr):
    """`_load_qk_norms`' tile alone."""
    x, _ = _load_qk_norms(ptr, tok, hk, valid, kcol, km, s0, s1, s2, scale, ACC, L2NORM)
    return x


@triton.jit
def _unit_lower_inverse(A, rows, n, CH: tl.constexpr, SUB: tl.constexpr, LOG2NB: tl.constexpr, ACC: tl.constexpr,
                        PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower (CH, CH) tile A whose rows and columns past n are zero.

    The NB = CH // SUB diagonal (SUB, SUB) blocks are inverted together by forward substitution, column by
    column (after step j, row j of each block is final and its contribution A[i, j] X[j, :] is gone from the
    rows i > j): SUB - 1 steps on (NB, SUB, SUB) tiles. With D the block-diagonal part of I + A, D^-1 its
    inverse and L the part below the diagonal blocks, M = D^-1 L is nilpotent of index NB, so
    (I + A)^-1 = (I + M)^-1 D^-1 = (I - M)(I + M^2)(I + M^4)..(I + M^(NB/2)) D^-1: 2 log2(NB) dots."""
    NB: tl.constexpr = CH // SUB
    r = tl.arange(0, SUB)
    bi = tl.arange(0, NB)
    same = bi[:, None, None, None] == bi[None, None, :, None]  # (NB, 1, NB, 1)
    A3 = tl.sum(tl.where(same, tl.reshape(A, (NB, SUB, NB, SUB)), 0.0), 2)  # the diagonal blocks
    X3 = tl.zeros((NB, SUB, SUB), dtype=ACC) + tl.where(r[:, None] == r[None, :], 1.0, 0.0).to(ACC)[None, :, :]
    for j in range(0, tl.minimum(n, SUB) - 1):
        col = tl.sum(tl.where(r[None, None, :] == j, A3, 0.0), 2)  # (NB, SUB): A3[:, :, j]
        row = tl.sum(tl.where(r[None, :, None] == j, X3, 0.0), 1)  # (NB, SUB): X3[:, j, :]
        X3 = X3 - col[:, :, None] * row[:, None, :]
    if NB == 1:
        X = tl.reshape(X3, (CH, CH))
    else:
        D = tl.reshape(tl.where(same, X3[:, :, None, :], 0.0), (CH, CH))
        rb = rows // SUB
        L = tl.where(rb[:, None] != rb[None, :], A, 0.0)
        M = tl.dot(D, L, input_precision=PREC, out_dtype=ACC)
        P = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0).to(ACC) - M
        for _ in tl.static_range(LOG2NB - 1):
            M = tl.dot(M, M, input_precision=PREC, out_dtype=ACC)
            P = P + tl.dot(P, M, input_precision=PREC, out_dtype=ACC)
        X = tl.dot(P, D, input_precision=PREC, out_dtype=ACC)
    return X


@triton.jit
def _load_raw(ptr, start, rows, hk, valid, kc, kmb, s0, s1, s2):
    """Columns kc of q or k rows start + `rows` of key head hk as stored (zeros off `valid` and past K). The
    chunk's first row is a scalar 64-bit offset; the tile's offsets from it are in `rows`' integer type
    (`_tile_rows`)."""
    return tl.load(ptr + (start * s0 + hk * s1) + (rows[:, None] * s0 + kc[None, :] * s2),
                   mask=valid[:, None] & kmb[None, :], other=0.0)


@triton.jit
def _tile_rows(rows, WIDE: tl.constexpr):
    """The chunk's row numbers for tile offsets: 32-bit, or 64-bit where a chunk's rows span 2**31 elements
    or more (WIDE: a view with a huge row stride)."""
    if WIDE:
        rows = rows.to(tl.int64)
    return rows


@triton.jit
def _inv_norms(ss, L2NORM: tl.constexpr):
    """1 / sqrt(sum of squares + eps) of rows whose sums of squares are `ss` (ones without L2NORM)."""
    if L2NORM:
        return 1.0 / tl.sqrt(ss + _L2EPS)
    return ss * 0.0 + 1.0


@triton.jit
def _prep_decays(g_ptr, b_ptr, gc_ptr, tok, h, valid, rows, sg0, sg1, sb0, sb1, sgc0, sgc1, ACC: tl.constexpr):
    """Of one chunk and value head: beta, the cumulative log-decay G (stored for the later launches) and
    exp(G_i - G_j) for i >= j, exact zeros above the diagonal (the difference is masked, not the result)."""
    gt = tl.load(g_ptr + tok * sg0 + h * sg1, mask=valid, other=0.0).to(ACC)
    bt = tl.load(b_ptr + tok * sb0 + h * sb1, mask=valid, other=0.0).to(ACC)
    G = tl.cumsum(gt, 0)
    tl.store(gc_ptr + tok * sgc0 + h * sgc1, G.to(gc_ptr.dtype.element_ty), mask=valid)
    dec = tl.exp(tl.where(rows[:, None] >= rows[None, :], G[:, None] - G[None, :], float("-inf")))
    return bt, G, dec


@triton.jit
def _prep_u_block(X, bt, v_ptr, u_ptr, tok, h, valid, vcol, V, sv0, sv1, sv2, su0, su1, ACC: tl.constexpr,
                  TPREC: tl.constexpr):
    """Value columns vcol of u = T (beta v) of one chunk and value head (X = T, in the dtype the products take:
    the operand is cast to it)."""
    m2 = valid[:, None] & (vcol < V)[None, :]
    vt = tl.load(v_ptr + tok[:, None] * sv0 + h * sv1 + vcol[None, :] * sv2, mask=m2, other=0.0).to(ACC)
    u = tl.dot(X, (bt[:, None] * vt).to(X.dtype), input_precision=TPREC, out_dtype=ACC)
    tl.store(u_ptr + tok[:, None] * su0 + h * su1 + vcol[None, :], u.to(u_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _prep_u(X, bt, v_ptr, u_ptr, tok, h, valid, V, sv0, sv1, sv2, su0, su1, BV: tl.constexpr, ACC: tl.constexpr,
            TPREC: tl.constexpr):
    """u = T (beta v) of one chunk and value head, BV value columns at a time."""
    for v0 in range(0, V, BV):
        _prep_u_block(X, bt, v_ptr, u_ptr, tok, h, valid, v0 + tl.arange(0, BV), V, sv0, sv1, sv2, su0, su1, ACC,
                      TPREC)


@triton.jit
def _prep_w_kg(X, kt, rk, bt, G, g_last, w_ptr, kg_ptr, tok, h, valid, kc, kmask, sw0, sw1, skg0, skg1,
               ACC: tl.constexpr, TPREC: tl.constexpr, STORE_KG: tl.constexpr):
    """Columns kc of w = T (beta exp(G) k) and, with STORE_KG (the "parallel" pipeline with update_keys
    "stored"), of the update keys kg = exp(G_last - G) k, from those columns of k as stored (kt, in the
    compute dtype), the rows' inverse norms rk (the l2 normalisation; ones without it) and X = T (in the dtype
    the products take: the operand is cast to it)."""
    m2 = valid[:, None] & kmask[None, :]
    if STORE_KG:
        kg = kt * tl.where(valid, tl.exp(g_last - G) * rk, 0.0)[:, None]
        tl.store(kg_ptr + tok[:, None] * skg0 + h * skg1 + kc[None, :], kg.to(kg_ptr.dtype.element_ty), mask=m2)
    kb = (bt * tl.exp(G) * rk)[:, None] * kt
    w = tl.dot(X, kb.to(X.dtype), input_precision=TPREC, out_dtype=ACC)
    tl.store(w_ptr + tok[:, None] * sw0 + h * sw1 + kc[None, :], w.to(w_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _gdn_prep_blocked(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, a_ptr, kg_ptr, gc_ptr, h, hk, n, start,
                      tok, rows,
                      valid, K, V, scale, sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sb0, sb1,
                      sw0, sw1, su0, su1, sa0, sa1, skg0, skg1, sgc0, sgc1,
                      CH: tl.constexpr, SUB: tl.constexpr, LOG2NB: tl.constexpr, KB: tl.constexpr,
                      BV: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
                      PREC: tl.constexpr, TPREC: tl.constexpr, STORE_AQK: tl.constexpr, STORE_KG: tl.constexpr,
                      WIDE: tl.constexpr, TD: tl.constexpr):
    """`_gdn_prep_kernel`'s chunk with the key dimension in blocks of KB columns: (C, KB) tiles of k (and q)
    live at a time, read once for k k^T and the rows' sums of squares (and once for q k^T), once for w and
    kg."""
    bt, G, dec = _prep_decays(g_ptr, b_ptr, gc_ptr, tok, h, valid, rows, sg0, sg1, sb0, sb1, sgc0, sgc1, ACC)
    r = _tile_rows(rows, WIDE)
    kk = tl.zeros((CH, CH), dtype=ACC)
    ssk = tl.zeros((CH,), dtype=ACC)
    for k0 in range(0, K, KB):
        kc = k0 + tl.arange(0, KB)
        kb = _load_raw(k_ptr, start, r, hk, valid, kc, kc < K, sk0, sk1, sk2)
        if L2NORM:
            kf = kb.to(ACC)
            ssk += tl.sum(kf * kf, 1)
        kk += tl.dot(kb.to(DOT), tl.trans(kb.to(DOT)), input_precision=PREC, out_dtype=ACC)
    rk = _inv_norms(ssk, L2NORM)
    A = tl.where(rows[:, None] > rows[None, :], (bt * rk)[:, None] * kk * rk[None, :] * dec, 0.0)
    X = _unit_lower_inverse(A, rows, n, CH, SUB, LOG2NB, ACC, TPREC).to(TD)
    if STORE_AQK:
        qk = tl.zeros((CH, CH), dtype=ACC)
        ssq = tl.zeros((CH,), dtype=ACC)
        for k0 in range(0, K, KB):
            kc = k0 + tl.arange(0, KB)
            qb = _load_raw(q_ptr, start, r, hk, valid, kc, kc < K, sq0, sq1, sq2)
            kb = _load_raw(k_ptr, start, r, hk, valid, kc, kc < K, sk0, sk1, sk2)
            if L2NORM:
                qf = qb.to(ACC)
                ssq += tl.sum(qf * qf, 1)
            qk += tl.dot(qb.to(DOT), tl.trans(kb.to(DOT)), input_precision=PREC, out_dtype=ACC)
        qk = qk * (_inv_norms(ssq, L2NORM) * scale)[:, None] * rk[None, :] * dec
        tl.store(a_ptr + tok[:, None] * sa0 + h * sa1 + rows[None, :], qk.to(a_ptr.dtype.element_ty),
                 mask=valid[:, None])
    g_last = tl.sum(tl.where(rows == n - 1, G, 0.0), 0)
    for k0 in range(0, K, KB):
        kc = k0 + tl.arange(0, KB)
        kmb = kc < K
        kt = _load_raw(k_ptr, start, r, hk, valid, kc, kmb, sk0, sk1, sk2).to(ACC)
        _prep_w_kg(X, kt, rk, bt, G, g_last, w_ptr, kg_ptr, tok, h, valid, kc, kmb, sw0, sw1, skg0, skg1, ACC, TPREC,
                   STORE_KG)
    _prep_u(X, bt, v_ptr, u_ptr, tok, h, valid, V, sv0, sv1, sv2, su0, su1, BV, ACC, TPREC)


@triton.jit
def _gdn_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, qsl_ptr, w_ptr, u_ptr, a_ptr, kg_ptr, gc_ptr, t_ptr,
                     sn_ptr, S, HPK, K, V, scale_hi, scale_lo,
                     sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sb0, sb1, s_qsl,
                     sw0, sw1, su0, su1, sa0, sa1, skg0, skg1, sgc0, sgc1, st0, st1, ssn0, ssn1,
                     CH: tl.constexpr, SUB: tl.constexpr, LOG2NB: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, BLOCK_S: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr,
                     DOT: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr, STORE_AQK: tl.constexpr,
                     STORE_KG: tl.constexpr, KB: tl.constexpr, WIDE: tl.constexpr, SHARED: tl.constexpr,
                     TD: tl.constexpr, SPLIT: tl.constexpr):
    """w, u, G and Aqk (STORE_AQK: the "scan" pipeline) or kg (STORE_KG: the "parallel" one with update_keys
    "stored") of one chunk and value head. KB = BK: the whole (C, K) tile of k normalised in registers.
    KB < BK: the key dimension in blocks of KB columns (passes over k (and q): the (C, C) products with the
    rows' sums of squares, then w and kg; the l2 normalisation is a row (and column) factor of the products,
    applied after them). SHARED (prep_heads "key", whole width only): the program serves the HPK value heads of
    key head program_id(1): the normalised k tile and k k^T (and q k^T) formed once for them all. SPLIT
    (prep_split, whole width per value head only): T (in its product dtype) and the key rows' norms are stored
    instead of w, u and kg, which `_gdn_wu_kernel` forms from them in programs of their own."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    start, n = _locate(c, qsl_ptr, s_qsl, S, CH, BLOCK_S)
    if SHARED:
        if n > 0:
            rows = tl.arange(0, CH)
            valid = rows < n
            tok = start + rows.to(tl.int64)
            kcol = tl.arange(0, BK)
            km = kcol < K
            kt = _load_qk(k_ptr, tok, h, valid, kcol, km, sk0, sk1, sk2, 1.0, ACC, L2NORM)  # normalised
            rk = tl.full((CH,), 1.0, ACC)
            kd = kt.to(DOT)
            kk = tl.dot(kd, tl.trans(kd), input_precision=PREC, out_dtype=ACC)
            if STORE_AQK:
                scale = tl.cast(scale_hi, ACC) + tl.cast(scale_lo, ACC)
                qt = _load_qk(q_ptr, tok, h, valid, kcol, km, sq0, sq1, sq2, scale, ACC, L2NORM)
                qk = tl.dot(qt.to(DOT), tl.trans(kd), input_precision=PREC, out_dtype=ACC)
            for j in range(0, HPK):
                hv = h * HPK + j
                bt, G, dec = _prep_decays(g_ptr, b_ptr, gc_ptr, tok, hv, valid, rows, sg0, sg1, sb0, sb1, sgc0, sgc1,
                                          ACC)
                A = tl.where(rows[:, None] > rows[None, :], bt[:, None] * kk * dec, 0.0)
                X = _unit_lower_inverse(A, rows, n, CH, SUB, LOG2NB, ACC, TPREC).to(TD)
                if STORE_AQK:
                    tl.store(a_ptr + tok[:, None] * sa0 + hv * sa1 + rows[None, :],
                             (qk * dec).to(a_ptr.dtype.element_ty), mask=valid[:, None])
                g_last = tl.sum(tl.where(rows == n - 1, G, 0.0), 0)
                # k read again (from L2) rather than held through the loop: the tile and k k^T together spill
                kt = _load_qk(k_ptr, tok, h, valid, kcol, km, sk0, sk1, sk2, 1.0, ACC, L2NORM)
                _prep_w_kg(X, kt, rk, bt, G, g_last, w_ptr, kg_ptr, tok, hv, valid, kcol, km, sw0, sw1, skg0, skg1, ACC,
                           TPREC, STORE_KG)
                _prep_u(X, bt, v_ptr, u_ptr, tok, hv, valid, V, sv0, sv1, sv2, su0, su1, BV, ACC, TPREC)
    elif n > 0:
        hk = h // HPK
        rows = tl.arange(0, CH)
        valid = rows < n
        tok = start + rows.to(tl.int64)
        kcol = tl.arange(0, BK)
        km = kcol < K
        scale = tl.cast(scale_hi, ACC) + tl.cast(scale_lo, ACC)
        if KB < BK:
            _gdn_prep_blocked(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, a_ptr, kg_ptr, gc_ptr, h, hk, n, start,
                              tok,
                              rows, valid, K, V, scale, sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sb0,
                              sb1, sw0, sw1, su0, su1, sa0, sa1, skg0, skg1, sgc0, sgc1, CH, SUB, LOG2NB, KB, BV,
                              L2NORM, ACC, DOT, PREC, TPREC, STORE_AQK, STORE_KG, WIDE, TD)
            return
        kt, nrm = _load_qk_norms(k_ptr, tok, hk, valid, kcol, km, sk0, sk1, sk2, 1.0, ACC, L2NORM)  # normalised
        rk = tl.full((CH,), 1.0, ACC)
        bt, G, dec = _prep_decays(g_ptr, b_ptr, gc_ptr, tok, h, valid, rows, sg0, sg1, sb0, sb1, sgc0, sgc1, ACC)
        kd = kt.to(DOT)
        kk = tl.dot(kd, tl.trans(kd), input_precision=PREC, out_dtype=ACC)
        A = tl.where(rows[:, None] > rows[None, :], bt[:, None] * kk * dec, 0.0)
        X = _unit_lower_inverse(A, rows, n, CH, SUB, LOG2NB, ACC, TPREC).to(TD)
        if STORE_AQK:
            qt = _load_qk(q_ptr, tok, hk, valid, kcol, km, sq0, sq1, sq2, scale, ACC, L2NORM)
            qk = tl.dot(qt.to(DOT), tl.trans(kd), input_precision=PREC, out_dtype=ACC) * dec
            tl.store(a_ptr + tok[:, None] * sa0 + h * sa1 + rows[None, :], qk.to(a_ptr.dtype.element_ty),
                     mask=valid[:, None])
        if SPLIT:
            tl.store(t_ptr + c * st0 + h * st1 + (rows[:, None] * CH + rows[None, :]), X)
            if L2NORM:
                tl.store(sn_ptr + tok * ssn0 + h * ssn1, nrm.to(sn_ptr.dtype.element_ty), mask=valid)
        else:
            g_last = tl.sum(tl.where(rows == n - 1, G, 0.0), 0)
            _prep_w_kg(X, kt, rk, bt, G, g_last, w_ptr, kg_ptr, tok, h, valid, kcol, km, sw0, sw1, skg0, skg1, ACC,
                       TPREC, STORE_KG)
            _prep_u(X, bt, v_ptr, u_ptr, tok, h, valid, V, sv0, sv1, sv2, su0, su1, BV, ACC, TPREC)


@triton.jit
def _gdn_wu_kernel(k_ptr, v_ptr, b_ptr, gc_ptr, t_ptr, sn_ptr, qsl_ptr, w_ptr, u_ptr, kg_ptr,
                   S, HPK, K, V, sk0, sk1, sk2, sv0, sv1, sv2, sb0, sb1, sgc0, sgc1, st0, st1, ssn0, ssn1, s_qsl,
                   sw0, sw1, su0, su1, skg0, skg1,
                   CH: tl.constexpr, BW: tl.constexpr, NBK: tl.constexpr, BLOCK_S: tl.constexpr,
                   L2NORM: tl.constexpr, ACC: tl.constexpr, TPREC: tl.constexpr, STORE_KG: tl.constexpr):
    """prep_split's second launch, one program per (block of BW columns, chunk slot, value head): the key
    columns of w and kg (blocks below NBK) or the value columns of u (the rest), from the T and key norms the
    per-chunk launch stored, as `_gdn_prep_kernel` forms them after its inverse (the same operations on the same
    values). The column block is the fastest grid axis, so a chunk's programs read its T together."""
    blk = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    start, n = _locate(c, qsl_ptr, s_qsl, S, CH, BLOCK_S)
    if n > 0:
        rows = tl.arange(0, CH)
        valid = rows < n
        tok = start + rows.to(tl.int64)
        X = tl.load(t_ptr + c * st0 + h * st1 + (rows[:, None] * CH + rows[None, :]))
        bt = tl.load(b_ptr + tok * sb0 + h * sb1, mask=valid, other=0.0).to(ACC)
        if blk < NBK:
            G = tl.load(gc_ptr + tok * sgc0 + h * sgc1, mask=valid, other=0.0).to(ACC)
            g_last = tl.sum(tl.where(rows == n - 1, G, 0.0), 0)
            kc = blk * BW + tl.arange(0, BW)
            km = kc < K
            kt = tl.load(k_ptr + tok[:, None] * sk0 + (h // HPK) * sk1 + kc[None, :] * sk2,
                         mask=valid[:, None] & km[None, :], other=0.0).to(ACC)
            if L2NORM:
                kt = kt / tl.load(sn_ptr + tok * ssn0 + h * ssn1, mask=valid, other=1.0).to(ACC)[:, None]
            _prep_w_kg(X, kt, tl.full((CH,), 1.0, ACC), bt, G, g_last, w_ptr, kg_ptr, tok, h, valid, kc, km, sw0,
                       sw1, skg0, skg1, ACC, TPREC, STORE_KG)
        else:
            _prep_u_block(X, bt, v_ptr, u_ptr, tok, h, valid, (blk - NBK) * BW + tl.arange(0, BW), V, sv0, sv1, sv2,
                          su0, su1, ACC, TPREC)


@triton.jit
def _update_rows(st, vn, kt, rk, G, g_last, valid, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                 KMAJOR: tl.constexpr = False):
    """update_keys "rows": exp(G_last) S + (v' r)^T k, the per-row factors r = exp(G_last - G) rk (rk: the key
    rows' inverse norms) scaling the (CH, BV) rows of v' instead of the (CH, K) rows of k; exact zeros past the
    chunk's end (the exponent is masked, not the result). KMAJOR: the state tile is S^T (K, BV), updated by
    k^T (v' r)."""
    r = tl.exp(tl.where(valid, g_last - G, float("-inf"))) * rk
    return _decayed_update(st, (vn * r[:, None]).to(DOT), kt, g_last, ACC, DOT, PREC, KMAJOR)


@triton.jit
def _decayed_update(st, vk, keys, g_last, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                    KMAJOR: tl.constexpr):
    """The chunk's state update exp(G_last) S + vk^T keys of the (BV, K) tile S, or, KMAJOR, exp(G_last) S^T +
    keys^T vk of the (K, BV) tile S^T (vk: the chunk's (CH, BV) rows of v', scaled or not; keys: its (CH, K)
    update keys)."""
    decayed = st * tl.exp(g_last)
    if KMAJOR:
        upd = tl.dot(tl.trans(keys.to(DOT)), vk, input_precision=PREC, out_dtype=ACC)
    else:
        upd = tl.dot(tl.trans(vk), keys.to(DOT), input_precision=PREC, out_dtype=ACC)
    return decayed + upd


@triton.jit
def _state_tile(st_ptr, slot, h, vb, use, K, V, ss0, ss1, ss2, ss3, BK: tl.constexpr, BV: tl.constexpr,
                ACC: tl.constexpr):
    """The (BV, BK) state tile of value rows vb * BV .. and head h in pool slot `slot`, in ACC (zeros unless
    `use`): its key columns and mask, value rows and mask, pointers and mask (for the store back)."""
    kcol = tl.arange(0, BK)
    km = kcol < K
    vrow = vb * BV + tl.arange(0, BV)
    vm = vrow < V
    # the flag as a vector (the interpreter mishandles vector & scalar bools)
    usev = (vrow * 0 + use.to(tl.int32)) != 0
    sptr = st_ptr + slot * ss0 + h * ss1 + vrow[:, None].to(tl.int64) * ss2 + kcol[None, :] * ss3
    smask = vm[:, None] & km[None, :]
    st = tl.load(sptr, mask=smask & usev[:, None], other=0.0).to(ACC)  # (BV, BK)
    return kcol, km, vrow, vm, sptr, smask, st


@triton.jit
def _gdn_scan_kernel(q_ptr, k_ptr, w_ptr, u_ptr, a_ptr, gc_ptr, o_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr,
                     HPK, K, V, pad_id, scale_hi, scale_lo,
                     sq0, sq1, sq2, sk0, sk1, sk2, sw0, sw1, su0, su1, sa0, sa1, sgc0, sgc1, so0, so1, so2,
                     ss0, ss1, ss2, ss3, s_qsl, s_idx, s_hi,
                     CH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                     ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SDOT: tl.constexpr,
                     SPREC: tl.constexpr, ROWS: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vb = tl.program_id(2)
    hk = h // HPK
    q0 = tl.load(qsl_ptr + s * s_qsl).to(tl.int64)
    q1 = tl.load(qsl_ptr + (s + 1) * s_qsl).to(tl.int64)
    slot = tl.load(idx_ptr + s * s_idx).to(tl.int64)
    live = slot != pad_id
    use = live & (tl.load(hi_ptr + s * s_hi) != 0)
    slot = tl.where(live, slot, 0)
    rows = tl.arange(0, CH)
    kcol, km, vrow, vm, sptr, smask, st = _state_tile(st_ptr, slot, h, vb, use, K, V, ss0, ss1, ss2, ss3, BK, BV,
                                                      ACC)
    livev = (vrow * 0 + live.to(tl.int32)) != 0  # a vector: the interpreter mishandles vector & scalar bools
    scale = tl.cast(scale_hi, ACC) + tl.cast(scale_lo, ACC)
    for t0 in range(q0, q1, CH):
        n = tl.minimum(q1 - t0, CH)
        valid = rows < n
        tok = t0 + rows.to(tl.int64)
        m2 = valid[:, None] & vm[None, :]
        qt = _load_qk(q_ptr, tok, hk, valid, kcol, km, sq0, sq1, sq2, scale, ACC, L2NORM)
        kt = _load_qk(k_ptr, tok, hk, valid, kcol, km, sk0, sk1, sk2, 1.0, ACC, L2NORM)
        G = tl.load(gc_ptr + tok * sgc0 + h * sgc1, mask=valid, other=0.0).to(ACC)
        g_last = tl.sum(tl.where(rows == n - 1, G, 0.0), 0)
        wt = tl.load(w_ptr + tok[:, None] * sw0 + h * sw1 + kcol[None, :], mask=valid[:, None] & km[None, :],
                     other=0.0)
        ut = tl.load(u_ptr + tok[:, None] * su0 + h * su1 + vrow[None, :], mask=m2, other=0.0).to(ACC)
        at = tl.load(a_ptr + tok[:, None] * sa0 + h * sa1 + rows[None, :], mask=valid[:, None], other=0.0)
        sT = tl.trans(st.to(SDOT))  # (BK, BV)
        vn = ut - tl.dot(wt.to(SDOT), sT, input_precision=SPREC, out_dtype=ACC)  # (CH, BV)
        qe = tl.where(valid[:, None], qt * tl.exp(G)[:, None], 0.0)
        o = tl.dot(qe.to(SDOT), sT, input_precision=SPREC, out_dtype=ACC)
        o += tl.dot(at.to(DOT), vn.to(DOT), input_precision=PREC, out_dtype=ACC)
        o = tl.where(livev[None, :], o, 0.0)  # a pad request's tokens get o = 0
        tl.store(o_ptr + tok[:, None] * so0 + h * so1 + vrow[None, :].to(tl.int64) * so2,
                 o.to(o_ptr.dtype.element_ty), mask=m2)
        if ROWS:
            st = _update_rows(st, vn, kt, tl.full((CH,), 1.0, ACC), G, g_last, valid, ACC, DOT, PREC)
        else:
            kend = tl.where(valid[:, None], kt * tl.exp(g_last - G)[:, None], 0.0)
            st = st * tl.exp(g_last) + tl.dot(tl.trans(vn.to(DOT)), kend.to(DOT), input_precision=PREC,
                                              out_dtype=ACC)
    tl.store(sptr, st.to(st_ptr.dtype.element_ty), mask=smask & livev[:, None])


@triton.jit
def _gdn_state_kernel(w_ptr, u_ptr, kg_ptr, k_ptr, gc_ptr, hs_ptr, st_ptr, qsl_ptr, idx_ptr, hi_ptr,
                      HPK, K, V, pad_id,
                      sw0, sw1, su0, su1, skg0, skg1, sk0, sk1, sk2, sgc0, sgc1, sh0, sh1, sh2,
                      ss0, ss1, ss2, ss3, s_qsl, s_idx, s_hi,
                      CH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BLOCK_S: tl.constexpr,
                      ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SDOT: tl.constexpr,
                      SPREC: tl.constexpr, ROWS: tl.constexpr, L2NORM: tl.constexpr, WIDE: tl.constexpr,
                      KMAJOR: tl.constexpr):
    """The state recurrence of one (sequence, value head, BV value rows): per chunk S_c -> hs, v' -> u. The
    update's keys: kg as stored, or (ROWS) the chunk's k tile of key head h // HPK as stored, its rows'
    inverse norms (L2NORM) and decays scaling the rows of v' (`_update_rows`). KMAJOR (state_major "key"): the
    tile held is S^T (K, BV), so the update's product k^T v' has the key width as its rows (K = 128: a shape
    Hopper's warpgroup MMA takes) instead of BV; hs and the pool keep their value-major layout."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vb = tl.program_id(2)
    slot = tl.load(idx_ptr + s * s_idx).to(tl.int64)
    live = slot != pad_id
    if live:  # a pad request's outputs are zeros: its recurrence is not needed
        q0 = tl.load(qsl_ptr + s * s_qsl).to(tl.int64)
        q1 = tl.load(qsl_ptr + (s + 1) * s_qsl).to(tl.int64)
        use = tl.load(hi_ptr + s * s_hi) != 0
        rows = tl.arange(0, CH)
        kcol, km, vrow, vm, sptr, smask, st = _state_tile(st_ptr, slot, h, vb, use, K, V, ss0, ss1, ss2, ss3, BK,
                                                          BV, ACC)
        hptr = hs_ptr + h * sh1 + vrow[:, None].to(tl.int64) * sh2 + kcol[None, :]
        hmask = smask
        if KMAJOR:  # S^T (BK, BV) held; S_c stored through transposed pointers
            st = tl.trans(st)
            hptr = hs_ptr + h * sh1 + vrow[None, :].to(tl.int64) * sh2 + kcol[:, None]
            hmask = km[:, None] & vm[None, :]
        c = _chunks_before(s, qsl_ptr, s_qsl, CH, BLOCK_S)
        for t0 in range(q0, q1, CH):
            n = tl.minimum(q1 - t0, CH)
            valid = rows < n
            tok = t0 + rows.to(tl.int64)
            m2 = valid[:, None] & vm[None, :]
            mk = valid[:, None] & km[None, :]
            tl.store(hptr + c * sh0, st.to(hs_ptr.dtype.element_ty), mask=hmask)
            g_last = tl.load(gc_ptr + (t0 + n - 1) * sgc0 + h * sgc1).to(ACC)
            wt = tl.load(w_ptr + tok[:, None] * sw0 + h * sw1 + kcol[None, :], mask=mk, other=0.0)
            uptr = u_ptr + tok[:, None] * su0 + h * su1 + vrow[None, :]
            ut = tl.load(uptr, mask=m2, other=0.0).to(ACC)
            if KMAJOR:
                vn = ut - tl.dot(wt.to(SDOT), st.to(SDOT), input_precision=SPREC, out_dtype=ACC)  # (CH, BV)
            else:
                vn = ut - tl.dot(wt.to(SDOT), tl.trans(st.to(SDOT)), input_precision=SPREC, out_dtype=ACC)
            vd = vn.to(DOT)
            tl.store(uptr, vd.to(u_ptr.dtype.element_ty), mask=m2)
            if ROWS:
                G = tl.load(gc_ptr + tok * sgc0 + h * sgc1, mask=valid, other=0.0).to(ACC)
                kb = _load_raw(k_ptr, t0, _tile_rows(rows, WIDE), h // HPK, valid, kcol, km, sk0, sk1, sk2)
                ssk = tl.zeros((CH,), dtype=ACC)
                if L2NORM:
                    kf = kb.to(ACC)
                    ssk = tl.sum(kf * kf, 1)
                st = _update_rows(st, vn, kb, _inv_norms(ssk, L2NORM), G, g_last, valid, ACC, DOT, PREC, KMAJOR)
            else:
                kgt = tl.load(kg_ptr + tok[:, None] * skg0 + h * skg1 + kcol[None, :], mask=mk, other=0.0)
                st = _decayed_update(st, vd, kgt, g_last, ACC, DOT, PREC, KMAJOR)
            c += 1
        if KMAJOR:
            st = tl.trans(st)
        tl.store(sptr, st.to(st_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _out_decays(gc_ptr, tok, h, sgc0, sgc1, rows, valid, ACC: tl.constexpr):
    """G of the chunk's rows and exp(G_i - G_j) for live rows i >= j, exact zeros elsewhere (the exponent is
    masked, not the result)."""
    G = tl.load(gc_ptr + tok * sgc0 + h * sgc1, mask=valid, other=0.0).to(ACC)
    keep = (rows[:, None] >= rows[None, :]) & valid[:, None]
    return G, tl.exp(tl.where(keep, G[:, None] - G[None, :], float("-inf")))


@triton.jit
def _out_rows(start, n, vb, V, CH: tl.constexpr, BV: tl.constexpr):
    """An output program's rows (the chunk's CH, live below n, their tokens from `start`) and its value rows
    (block vb of BV, live below V), with the (rows, value rows) mask."""
    rows = tl.arange(0, CH)
    valid = rows < n
    tok = start + rows.to(tl.int64)
    vrow = vb * BV + tl.arange(0, BV)
    vm = vrow < V
    return rows, valid, tok, vrow, vm, valid[:, None] & vm[None, :]


@triton.jit
def _qk_block(q_ptr, k_ptr, start, r, hk, valid, kc, kmb, sq0, sq1, sq2, sk0, sk1, sk2, qk, ssq, ssk,
              L2NORM: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One block of key columns kc of the output launch's pass: q and k of key head hk as stored, q k^T and the
    rows' sums of squares accumulated. Returns the q block too (for the products with S_c)."""
    qb = _load_raw(q_ptr, start, r, hk, valid, kc, kmb, sq0, sq1, sq2)
    kb = _load_raw(k_ptr, start, r, hk, valid, kc, kmb, sk0, sk1, sk2)
    if L2NORM:
        qf = qb.to(ACC)
        kf = kb.to(ACC)
        ssq += tl.sum(qf * qf, 1)
        ssk += tl.sum(kf * kf, 1)
    qk += tl.dot(qb.to(DOT), tl.trans(kb.to(DOT)), input_precision=PREC, out_dtype=ACC)
    return qb, qk, ssq, ssk


@triton.jit
def _hs_dot(o, qb, hs_ptr, c, h, vrow, kc, vm, kmb, sh0, sh1, sh2, ACC: tl.constexpr, SDOT: tl.constexpr,
            SPREC: tl.constexpr):
    """o + q S_c^T over key columns kc: the (BV, KB) block of value head h's state before chunk slot c."""
    hsb = tl.load(hs_ptr + (c * sh0 + h * sh1) + (vrow[:, None] * sh2 + kc[None, :]),
                  mask=vm[:, None] & kmb[None, :], other=0.0)  # (BV, KB)
    return o + tl.dot(qb.to(SDOT), tl.trans(hsb.to(SDOT)), input_precision=SPREC, out_dtype=ACC)


@triton.jit
def _out_finish(o, qk, ssq, ssk, scale_hi, scale_lo, gc_ptr, vn_ptr, tok, h, rows, valid, vrow, m2, sgc0, sgc1,
                svn0, svn1, L2NORM: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """Value head h's o from the pass's products: the norms, the scale and the decays applied to q S_c^T and
    q k^T, then the intra-chunk product with v'."""
    scale = tl.cast(scale_hi, ACC) + tl.cast(scale_lo, ACC)
    rq = _inv_norms(ssq, L2NORM) * scale
    G, dec = _out_decays(gc_ptr, tok, h, sgc0, sgc1, rows, valid, ACC)
    o = o * tl.where(valid, rq * tl.exp(G), 0.0)[:, None]
    qk = qk * dec * rq[:, None] * _inv_norms(ssk, L2NORM)[None, :]
    vn = tl.load(vn_ptr + tok[:, None] * svn0 + h * svn1 + vrow[None, :], mask=m2, other=0.0)
    return o + tl.dot(qk.to(DOT), vn.to(DOT), input_precision=PREC, out_dtype=ACC)


@triton.jit
def _gdn_out_kernel(q_ptr, k_ptr, vn_ptr, gc_ptr, hs_ptr, o_ptr, qsl_ptr, idx_ptr,
                    S, HPK, K, V, pad_id, scale_hi, scale_lo,
                    sq0, sq1, sq2, sk0, sk1, sk2, svn0, svn1, sgc0, sgc1, sh0, sh1, sh2, so0, so1, so2,
                    s_qsl, s_idx,
                    CH: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, BLOCK_S: tl.constexpr,
                    L2NORM: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                    SDOT: tl.constexpr, SPREC: tl.constexpr, WIDE: tl.constexpr, SHARED: tl.constexpr):
    """o of one (chunk slot, value head, BV value rows) from S_c and v': zeros for a pad request.

    One pass over the key dimension in blocks of KB columns (one block when KB covers K): q k^T and q S_c^T
    of the rows as stored, and their sums of squares. The l2 normalisation, the scale and the decays are row
    and column factors of those products, applied after the pass: no normalised tile is ever held, so a
    block's registers are its three loads and the two accumulators.

    SHARED (out_heads "key"): the program serves the HPK value heads of key head program_id(1). q k^T and the
    rows' norms depend on the key head only: one pass over K forms them once; then per value head a pass over
    K for q S_c^T (q read again), its decays, and the product with v'."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vb = tl.program_id(2)
    seq, start, n = _locate_seq(c, qsl_ptr, s_qsl, S, CH, BLOCK_S)
    if n > 0:
        rows, valid, tok, vrow, vm, m2 = _out_rows(start, n, vb, V, CH, BV)
        if SHARED:
            hk = h
            live = tl.load(idx_ptr + seq * s_idx).to(tl.int64) != pad_id
            r = _tile_rows(rows, WIDE)
            qk = tl.zeros((CH, CH), dtype=ACC)
            ssq = tl.zeros((CH,), dtype=ACC)
            ssk = tl.zeros((CH,), dtype=ACC)
            if live:
                for k0 in range(0, K, KB):
                    kc = k0 + tl.arange(0, KB)
                    qb, qk, ssq, ssk = _qk_block(q_ptr, k_ptr, start, r, hk, valid, kc, kc < K, sq0, sq1, sq2, sk0,
                                                 sk1, sk2, qk, ssq, ssk, L2NORM, ACC, DOT, PREC)
            for j in range(0, HPK):
                hv = hk * HPK + j
                o = tl.zeros((CH, BV), dtype=ACC)
                if live:
                    for k0 in range(0, K, KB):
                        kc = k0 + tl.arange(0, KB)
                        kmb = kc < K
                        qb = _load_raw(q_ptr, start, r, hk, valid, kc, kmb, sq0, sq1, sq2)
                        o = _hs_dot(o, qb, hs_ptr, c, hv, vrow, kc, vm, kmb, sh0, sh1, sh2, ACC, SDOT, SPREC)
                    o = _out_finish(o, qk, ssq, ssk, scale_hi, scale_lo, gc_ptr, vn_ptr, tok, hv, rows, valid, vrow,
                                    m2, sgc0, sgc1, svn0, svn1, L2NORM, ACC, DOT, PREC)
                tl.store(o_ptr + tok[:, None] * so0 + hv * so1 + vrow[None, :].to(tl.int64) * so2,
                         o.to(o_ptr.dtype.element_ty), mask=m2)
        else:
            o = tl.zeros((CH, BV), dtype=ACC)
            if tl.load(idx_ptr + seq * s_idx).to(tl.int64) != pad_id:
                hk = h // HPK
                r = _tile_rows(rows, WIDE)
                qk = tl.zeros((CH, CH), dtype=ACC)
                ssq = tl.zeros((CH,), dtype=ACC)
                ssk = tl.zeros((CH,), dtype=ACC)
                for k0 in range(0, K, KB):
                    kc = k0 + tl.arange(0, KB)
                    kmb = kc < K
                    qb, qk, ssq, ssk = _qk_block(q_ptr, k_ptr, start, r, hk, valid, kc, kmb, sq0, sq1, sq2, sk0, sk1,
                                                 sk2, qk, ssq, ssk, L2NORM, ACC, DOT, PREC)
                    o = _hs_dot(o, qb, hs_ptr, c, h, vrow, kc, vm, kmb, sh0, sh1, sh2, ACC, SDOT, SPREC)
                o = _out_finish(o, qk, ssq, ssk, scale_hi, scale_lo, gc_ptr, vn_ptr, tok, h, rows, valid, vrow, m2,
                                sgc0, sgc1, svn0, svn1, L2NORM, ACC, DOT, PREC)
            tl.store(o_ptr + tok[:, None] * so0 + h * so1 + vrow[None, :].to(tl.int64) * so2,
                     o.to(o_ptr.dtype.element_ty), mask=m2)


def _dot_types(dtype: torch.dtype, state_tf32: bool):
    """(compute, operand dtype, precision, state operand dtype, state precision, T-product precision)."""
    if dtype == torch.float64:
        return tl.float64, tl.float64, "ieee", tl.float64, "ieee", "ieee"
    if dtype == torch.float32:
        return tl.float32, tl.float32, "ieee", tl.float32, "ieee", "ieee"
    half = tl.float16 if dtype == torch.float16 else tl.bfloat16
    if state_tf32:
        return tl.float32, half, "ieee", tl.float32, "tf32", "tf32"
    return tl.float32, half, "ieee", half, "ieee", "tf32"


def _pow2(n: int, name: str) -> int:
    n = int(n)
    if n < 16 or n & (n - 1):
        fail(f"delta_rule_chunk CONFIG {name}", "a power of two >= 16", repr(n))
    return n


def _plan(dims, call):
    """One call's launches (`call`: the validator's arguments, `out=` last) from the validator's answer: (the
    `Staged` plan, or None where there is no sequence; o's shape)."""
    T, Hk, Hv, K, V, S = dims
    q, k, v, g, beta, ssm_states = call[:6]
    scale, use_qk_l2norm, pad_slot_id, out = call[9:]
    if S == 0:
        return None, (T, Hv, V)
    for name, allowed in CHOICES.items():
        if CONFIG[name] not in allowed:
            fail(f"delta_rule_chunk CONFIG {name}", f"one of {allowed}", repr(CONFIG[name]))
    parallel = CONFIG["outputs"] == "parallel"
    rows = CONFIG["update_keys"] == "rows"
    out_heads, prep_heads = CONFIG["out_heads"], CONFIG["prep_heads"]
    CH = _pow2(CONFIG["chunk"], "chunk")
    BV = _pow2(CONFIG["bv"], "bv")
    BVO = _pow2(CONFIG["out_bv"], "out_bv")
    KBO = _pow2(CONFIG["out_bk"], "out_bk") if CONFIG["out_bk"] else 0
    KBP = _pow2(CONFIG["prep_bk"], "prep_bk") if CONFIG["prep_bk"] else 0
    SUB = min(CH, _pow2(CONFIG["sub"], "sub"))
    BK = max(16, next_power_of_2(K))
    KBO = min(KBO, BK) if KBO else BK
    KBP = min(KBP, BK) if KBP else BK
    prep_shared = prep_heads == "key"
    if prep_shared and KBP < BK:
        fail("delta_rule_chunk CONFIG prep_heads", '"value" when prep_bk splits the key width', repr(prep_heads))
    split = CONFIG["prep_split"]
    if split not in (True, False):
        fail("delta_rule_chunk CONFIG prep_split", "True or False", repr(split))
    if split and (prep_shared or KBP < BK):
        fail("delta_rule_chunk CONFIG prep_split", 'False unless prep_heads is "value" and prep_bk 0',
             repr(split))
    VP = max(16, next_power_of_2(V))
    BW = min(_pow2(CONFIG["wu_bw"], "wu_bw"), max(BK, VP)) if split else 0  # prep_split's column blocks
    BVP = min(VP, 64)  # value columns per step of the prep's u = T (beta v)
    BVS, BVO = min(BV, VP), min(BVO, VP)
    BLOCK_S = min(1024, max(16, next_power_of_2(S)))
    ACC, DOT, PREC, SDOT, SPREC, TPREC = _dot_types(q.dtype, bool(CONFIG["state_tf32"]))
    # bf16 only: the operands exp(G) k and T reach past fp16's range where the state grows (g > 0)
    TD = DOT if CONFIG["t_products"] == "half" and DOT == tl.bfloat16 else ACC
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    sd = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else cd  # scratch of w, u / v', kg, Aqk
    dev = v.device
    NC = chunk_table_size(T, S, CH)
    st = Staged()
    w = st.buffer("w", (T, Hv, K), sd, dev)
    u = st.buffer("u", (T, Hv, V), sd, dev)
    gc = st.buffer("gc", (T, Hv), cd, dev)
    if parallel:
        if rows:
            st.alias("kg", "w")
            kg = w
        else:
            kg = st.buffer("kg", (T, Hv, K), sd, dev)
        st.alias("aqk", "kg")
        aqk = kg
        hs = st.buffer("hs", (NC, Hv, V, K), sd if SDOT in (tl.float16, tl.bfloat16) else cd, dev)
    else:
        aqk = st.buffer("aqk", (T, Hv, CH), sd, dev)
        st.alias("kg", "aqk")
        kg = aqk
    if split:  # T per chunk slot and value head in its product dtype; the key rows' norms
        tm = st.buffer("tm", (NC, Hv, CH, CH), TORCH_DTYPES[TD], dev)
        if use_qk_l2norm:
            sn = st.buffer("sn", (T, Hv), cd, dev)
        else:
            st.alias("sn", "gc")
            sn = gc
    else:
        st.alias("tm", "w")
        st.alias("sn", "gc")
        tm, sn = w, gc
    # scale > 0 (the contract): equal values of it are equal bits, so the plan may hold its fp32 pair
    sc = float(K ** -0.5 if scale is None else scale)
    span = CH * max(abs(q.stride(0)), abs(k.stride(0))) + K * max(abs(q.stride(2)), abs(k.stride(2)))
    wide = span >= WIDE_SPAN
    sc_hi, sc_lo = split_limit(sc)
    so = (out if out is not None else torch.empty((T, Hv, V), dtype=v.dtype, device="meta")).stride()
    s_qsl, s_idx, s_hi = (t.stride(0) for t in unit_stride(*call[6:9]))
    pad = int(pad_slot_id)
    st.add(_gdn_prep_kernel, (NC, Hk if prep_shared else Hv),
           ("q", "k", "v", "g", "beta", "query_start_loc", "w", "u", "aqk", "kg", "gc", "tm", "sn"),
           (S, Hv // Hk, K, V, sc_hi, sc_lo,
            *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), s_qsl,
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), aqk.stride(0), aqk.stride(1), kg.stride(0),
            kg.stride(1), *gc.stride(), tm.stride(0), tm.stride(1), *sn.stride()),
           CH=CH, SUB=SUB, LOG2NB=(CH // SUB).bit_length() - 1, BK=BK, BV=BVP, BLOCK_S=BLOCK_S,
           L2NORM=bool(use_qk_l2norm), ACC=ACC, DOT=DOT, PREC=PREC, TPREC=TPREC, STORE_AQK=not parallel,
           STORE_KG=parallel and not rows, KB=KBP, WIDE=wide, SHARED=prep_shared, TD=TD, SPLIT=split,
           num_warps=int(CONFIG["prep_warps"]))
    if split:
        nbk = cdiv(K, BW)
        st.add(_gdn_wu_kernel, (nbk + cdiv(V, BW), NC, Hv),
               ("k", "v", "beta", "gc", "tm", "sn", "query_start_loc", "w", "u", "kg"),
               (S, Hv // Hk, K, V, *k.stride(), *v.stride(), *beta.stride(), *gc.stride(), tm.stride(0),
                tm.stride(1), *sn.stride(), s_qsl, w.stride(0), w.stride(1), u.stride(0), u.stride(1),
                kg.stride(0), kg.stride(1)),
               CH=CH, BW=BW, NBK=nbk, BLOCK_S=BLOCK_S, L2NORM=bool(use_qk_l2norm), ACC=ACC, TPREC=TPREC,
               STORE_KG=parallel and not rows, num_warps=int(CONFIG["wu_warps"]))
    if not parallel:
        st.add(_gdn_scan_kernel, (S, Hv, cdiv(V, BVS)),
               ("q", "k", "w", "u", "aqk", "gc", "o", "ssm_states", "query_start_loc", "cache_indices", "hi"),
               (Hv // Hk, K, V, pad, sc_hi, sc_lo,
                *q.stride(), *k.stride(), w.stride(0), w.stride(1), u.stride(0), u.stride(1), aqk.stride(0),
                aqk.stride(1), *gc.stride(), *so, *ssm_states.stride(), s_qsl, s_idx, s_hi),
               CH=CH, BK=BK, BV=BVS, L2NORM=bool(use_qk_l2norm), ACC=ACC, DOT=DOT, PREC=PREC, SDOT=SDOT,
               SPREC=SPREC, ROWS=rows, num_warps=int(CONFIG["scan_warps"]), num_stages=int(CONFIG["scan_stages"]))
        return st, (T, Hv, V)
    st.add(_gdn_state_kernel, (S, Hv, cdiv(V, BVS)),
           ("w", "u", "kg", "k", "gc", "hs", "ssm_states", "query_start_loc", "cache_indices", "hi"),
           (Hv // Hk, K, V, pad,
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), kg.stride(0), kg.stride(1), *k.stride(),
            *gc.stride(), hs.stride(0), hs.stride(1), hs.stride(2), *ssm_states.stride(), s_qsl, s_idx, s_hi),
           CH=CH, BK=BK, BV=BVS, BLOCK_S=BLOCK_S, ACC=ACC, DOT=DOT, PREC=PREC, SDOT=SDOT, SPREC=SPREC,
           # L2NORM and WIDE only matter to the "rows" keys: fixed otherwise (one specialisation, not four)
           ROWS=rows, L2NORM=rows and bool(use_qk_l2norm), WIDE=rows and wide, KMAJOR=CONFIG["state_major"] == "key",
           num_warps=int(CONFIG["scan_warps"]), num_stages=int(CONFIG["scan_stages"]))
    shared = out_heads == "key"
    st.add(_gdn_out_kernel, (NC, Hk if shared else Hv, cdiv(V, BVO)),
           ("q", "k", "u", "gc", "hs", "o", "query_start_loc", "cache_indices"),
           (S, Hv // Hk, K, V, pad, sc_hi, sc_lo,
            *q.stride(), *k.stride(), u.stride(0), u.stride(1), *gc.stride(), hs.stride(0), hs.stride(1),
            hs.stride(2), *so, s_qsl, s_idx),
           CH=CH, BV=BVO, KB=KBO, BLOCK_S=BLOCK_S, L2NORM=bool(use_qk_l2norm), ACC=ACC, DOT=DOT,
           PREC=PREC, SDOT=SDOT, SPREC=SPREC, WIDE=wide, SHARED=shared, num_warps=int(CONFIG["out_warps"]),
           num_stages=int(CONFIG["out_stages"]))
    return st, (T, Hv, V)


_PLANS = HostPlans(C_.validate_gated_delta_rule_varlen, _plan, CONFIG)


def run_varlen(plans, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
               use_qk_l2norm, pad_slot_id, out):
    """A varlen delta rule's call through its launch plans `plans` (`Staged` plans of the tensors by the
    contract's names, the index tensors unit-stride, and of has_initial_state as bytes: "hi"). Returns o."""
    staged, oshape = plans.plan((q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                                 scale, use_qk_l2norm, pad_slot_id, out))
    o = out if out is not None else torch.empty(oshape, dtype=v.dtype, device=v.device)
    if staged is None:
        return o
    query_start_loc, cache_indices, has_initial_state = unit_stride(query_start_loc, cache_indices, has_initial_state)
    with device_guard(v):
        staged.run(dict(q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, query_start_loc=query_start_loc,
                        cache_indices=cache_indices, has_initial_state=has_initial_state,
                        hi=has_initial_state.view(torch.uint8), o=o))
    return o


@provides("triton", "gated_delta_rule_varlen")
def gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                            *, scale=None, use_qk_l2norm=False, pad_slot_id=C_.PAD_SLOT_ID, out=None):
    """Gated DeltaNet over packed sequences (see harness.ops for the contract)."""
    return run_varlen(_PLANS, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                      use_qk_l2norm, pad_slot_id, out)
