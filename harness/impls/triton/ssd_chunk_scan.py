"""SSD stage 5: the outputs.

For token i of chunk c (head h, group g = h // (H // G)):

    y_i = exp(dA_cs[i]) * C_i . prev_states[c, h]                                  (carried state)
        + sum_{j <= i in chunk} CB[c, g, i, j] * exp(dA_cs[i] - dA_cs[j]) * dt[j] * x_j   (intra-chunk)
        + D * x_i                                                                   (D (H,) or (H, P))
    y_i *= silu(z_i)                                                                (when z is given)

One program per (chunk slot, 1 or 2 heads of a group, block of tokens, block of P), flattened into a
1-D grid ordered (chunk, head, token block heaviest first) so that the programs that share a chunk's
C / B / x run together; writes into `out` (any strides).

Per program and head: a [BLOCK_M, BLOCK_P] fp32 accumulator. A loop over source blocks k up to the
diagonal one (causal: blocks past it are never visited) adds
(CB tile * exp(dA_i - dA_j) * dt_j masked to j <= i, cast to the activations' dtype) . x_k with fp32
accumulation (tensor-core dots for half types, the CB-weight operand fed from registers). The CB tile is
either read from `cb` (ssd_bmm's output, the stage API) or, when `cb` is None and B is given, formed in
place as C_m . B_k^T from the program's C tile ([BLOCK_M, N], loaded once, kept in shared memory) and
the B tile (one tensor-core dot: no CB round trip through memory and no bmm launch; the same fp32
values). After the loop the carried state joins as one more dot, C_m . prev[c, h] over N (scaled per
row by exp(dA_i)), then the D skip and the z gate. With 2 heads a program, the C tile and each CB tile
serve both. The decay exponent is selected to the strict lower triangle (j < i) before exp, 0 on and
above the diagonal, and the upper triangle selected away after it, so masked entries never overflow (bug
class 6); it is never clamped, so dt * A > 0 (a growing system, which the contract accepts) is exact. A
cumulative exponent of -inf (A = -inf: the state is wiped at every token) gives exp(-inf) = 0 below the
diagonal and 1 on it, never -inf - (-inf).

Addressing: chunk / head / token bases in int64 scalars (bug class 12); offsets inside a chunk tile
in int32 when they provably fit (OFF64 otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.impls.triton._common import launch, exp2_fast, interpreting, launch_config, next_power_of_2, nvidia_fast
from harness.impls.triton.ssd_chunk_state import default_block, dot_types

__all__ = ["ssd_chunk_scan", "fused_cb_ok"]

_I32_MAX = 2**31 - 1


@triton.jit
def _exp(v, FAST: tl.constexpr):
    """exp(v). FAST (fp32 on an NVIDIA GPU): ex2.approx.ftz of v * log2(e), the instruction tl.exp
    lowers to, without its fix-up for results below 2^-126 (flushed to 0 here: a decay or a sigmoid
    term that small weighs nothing): the same values otherwise, three instructions fewer an element."""
    if FAST:
        return exp2_fast(v * 1.4426950408889634, FAST)
    else:
        return tl.exp(v)


@triton.jit
def _intra_update(acc, s, dA_m, d_h, dA_ptr, dt_ptr, x_h, offs_m, offs_k, ok, op, mk, mp, stride_x_t, stride_x_p,
                  CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, FAST_EXP: tl.constexpr):
    """acc + (s * exp(dA_m - dA_k) * dt_k, masked to j <= i and to the chunk) . x_k for one head."""
    dA_k = tl.load(dA_ptr + d_h + offs_k, mask=mk, other=0.0)
    dt_k = tl.load(dt_ptr + d_h + offs_k, mask=mk, other=0.0)
    # exponent dA_i - dA_j selected before exp: j < i only (0 on the diagonal and above it), never clamped
    # (dt * A > 0 is legitimate); a cumulative -inf (A = -inf) stays -inf without forming -inf - (-inf)
    dA_k = tl.where(dA_k > float("-inf"), dA_k, 0.0)
    seg = tl.where(offs_m[:, None] > offs_k[None, :], dA_m[:, None] - dA_k[None, :], 0.0)
    w = s * _exp(seg, FAST_EXP) * dt_k[None, :]
    # (j <= i suffices: a source past the chunk's end has s = dt = 0 or a row past it, never stored)
    w = tl.where(offs_m[:, None] >= offs_k[None, :], w, 0.0)
    xk = tl.load(x_h + ok[:, None] * stride_x_t + op[None, :] * stride_x_p, mask=mk[:, None] & mp[None, :], other=0.0)
    return acc + tl.dot(w.to(DOT), xk.to(DOT), input_precision=PREC, out_dtype=CD)


@triton.jit
def _epilogue_loads(prev_h, x_h, z_h, D_h, om, op, on, m2, mn, mp, stride_prev_n, stride_prev_p,
                    stride_x_t, stride_x_p, stride_z_t, stride_z_p, stride_D_p, CD: tl.constexpr,
                    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, LOAD_PV: tl.constexpr):
    """One head's carried state [N, P] (LOAD_PV: the whole state dim in one tile) and its epilogue
    operands (x rows and D, z rows)."""
    if LOAD_PV:
        pv = tl.load(prev_h + on[:, None] * stride_prev_n + op[None, :] * stride_prev_p,
                     mask=mn[:, None] & mp[None, :], other=0.0)
    else:
        pv = 0.0
    if HAS_D:
        xm = tl.load(x_h + om[:, None] * stride_x_t + op[None, :] * stride_x_p, mask=m2, other=0.0)
        Dv = tl.load(D_h + op * stride_D_p, mask=mp, other=0.0).to(CD)
    else:
        xm = 0.0
        Dv = 0.0
    if HAS_Z:
        zv = tl.load(z_h + om[:, None] * stride_z_t + op[None, :] * stride_z_p, mask=m2, other=0.0)
    else:
        zv = 0.0
    return pv, xm, Dv, zv


@triton.jit
def _tile_offsets(k0, BLOCK: tl.constexpr, OFF64: tl.constexpr):
    """Offsets k0 + [0, BLOCK) of a tile (int32, for masks) and the same in the address type (int64 when
    OFF64)."""
    offs = k0 + tl.arange(0, BLOCK)
    if OFF64:
        return offs, offs.to(tl.int64)
    else:
        return offs, offs


@triton.jit
def _state_dot(C_c, prev_h, om, op, mm, mp, N, stride_c_t, stride_c_n, stride_prev_n, stride_prev_p,
               CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, OFF64: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """C_i . prev[c, h] over the state dim in BLOCK_N steps (the path without a whole-N C tile)."""
    st = tl.zeros((BLOCK_M, BLOCK_P), dtype=CD)
    for n0 in range(0, N, BLOCK_N):
        offs_n, on = _tile_offsets(n0, BLOCK_N, OFF64)
        mn = offs_n < N
        cmn = tl.load(C_c + om[:, None] * stride_c_t + on[None, :] * stride_c_n, mask=mm[:, None] & mn[None, :],
                      other=0.0)
        pvn = tl.load(prev_h + on[:, None] * stride_prev_n + op[None, :] * stride_prev_p,
                      mask=mn[:, None] & mp[None, :], other=0.0)
        st += tl.dot(cmn.to(DOT), pvn.to(DOT), input_precision=PREC, out_dtype=CD)
    return st


@triton.jit
def _finish(acc, st, dA_m, xm, Dv, zv, o_h, om, op, m2, stride_o_t, stride_o_p,
            CD: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, FAST_EXP: tl.constexpr):
    """Adds the carried state exp(dA_i) * (C_i . prev), the D skip, the z gate; stores."""
    acc += st * tl.exp(dA_m)[:, None]
    if HAS_D:
        acc += xm.to(CD) * Dv[None, :]
    if HAS_Z:
        zf = zv.to(CD)
        acc = acc * zf * (1 / (1 + _exp(-zf, FAST_EXP)))  # silu: tl.sigmoid's formula
    tl.store(o_h + om[:, None] * stride_o_t + op[None, :] * stride_o_p, acc.to(o_h.dtype.element_ty), mask=m2)


@triton.jit
def _chunk_scan_kernel(x_ptr, z_ptr, C_ptr, B_ptr, D_ptr, out_ptr, cb_ptr, dt_ptr, dA_ptr, prev_ptr,
                       chunk_start_ptr, chunk_len_ptr, H, P, N, heads_per_group,
                       stride_x_t, stride_x_h, stride_x_p, stride_z_t, stride_z_h, stride_z_p,
                       stride_o_t, stride_o_h, stride_o_p, stride_c_t, stride_c_g, stride_c_n,
                       stride_b_t, stride_b_g, stride_b_n,
                       stride_D_h, stride_D_p, stride_cb_c, stride_cb_g, stride_cb_i, stride_cb_j,
                       stride_d_h, stride_d_c, stride_prev_c, stride_prev_h, stride_prev_p, stride_prev_n,
                       CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                       HAS_D: tl.constexpr, HAS_Z: tl.constexpr, FUSED_CB: tl.constexpr, OFF64: tl.constexpr,
                       EARLY_EPI: tl.constexpr, HB: tl.constexpr, FAST_EXP: tl.constexpr,
                       NUM_M: tl.constexpr, NUM_P: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    j = pid % (NUM_M * NUM_P)
    ch = pid // (NUM_M * NUM_P)
    hq = ch % (H // HB)
    c = ch // (H // HB)
    pm = NUM_M - 1 - j // NUM_P  # the heaviest token block (most source blocks) first
    pp = j % NUM_P
    length = tl.load(chunk_len_ptr + c)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)  # issued with `length`: one latency, not two
    if pm * BLOCK_M < length:
        c64 = c.to(tl.int64)
        h0 = hq.to(tl.int64) * HB  # HB heads of one group: they share the C tile and each CB tile
        g64 = h0 // heads_per_group
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_p = pp * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        if OFF64:
            om = offs_m.to(tl.int64)
            op = offs_p.to(tl.int64)
            on = offs_n.to(tl.int64)
        else:
            om = offs_m
            op = offs_p
            on = offs_n
        mm = offs_m < length
        mp = offs_p < P
        mn = offs_n < N
        m2 = mm[:, None] & mp[None, :]
        # int64 scalar bases of this chunk / head / group
        x_0 = x_ptr + start * stride_x_t + h0 * stride_x_h
        z_0 = z_ptr + start * stride_z_t + h0 * stride_z_h
        o_0 = out_ptr + start * stride_o_t + h0 * stride_o_h
        D_0 = D_ptr + h0 * stride_D_h
        prev_0 = prev_ptr + c64 * stride_prev_c + h0 * stride_prev_h
        d_0 = h0 * stride_d_h + c64 * stride_d_c
        C_c = C_ptr + start * stride_c_t + g64 * stride_c_g

        # Reads outside the loop: the C tile and the decay of the rows up front; the carried state and the
        # epilogue's x / z / D either up front too (EARLY_EPI: their latency hides behind the loop, at the
        # cost of registers and shared memory held through it) or together right after the loop.
        if FUSED_CB:
            cm = tl.load(C_c + om[:, None] * stride_c_t + on[None, :] * stride_c_n, mask=mm[:, None] & mn[None, :],
                         other=0.0).to(DOT)
        dA_m0 = tl.load(dA_ptr + d_0 + offs_m, mask=mm, other=0.0)
        if HB == 2:
            dA_m1 = tl.load(dA_ptr + d_0 + stride_d_h + offs_m, mask=mm, other=0.0)
        if EARLY_EPI:
            pv0, xm0, Dv0, zv0 = _epilogue_loads(prev_0, x_0, z_0, D_0, om, op, on, m2, mn, mp, stride_prev_n,
                                                 stride_prev_p, stride_x_t, stride_x_p, stride_z_t, stride_z_p,
                                                 stride_D_p, CD, HAS_D, HAS_Z, FUSED_CB)
            if HB == 2:
                pv1, xm1, Dv1, zv1 = _epilogue_loads(prev_0 + stride_prev_h, x_0 + stride_x_h, z_0 + stride_z_h,
                                                     D_0 + stride_D_h, om, op, on, m2, mn, mp, stride_prev_n,
                                                     stride_prev_p, stride_x_t, stride_x_p, stride_z_t, stride_z_p,
                                                     stride_D_p, CD, HAS_D, HAS_Z, FUSED_CB)

        # Intra-chunk, causal: source blocks up to the diagonal one (blocks past it are never visited).
        hi = tl.minimum(length, (pm + 1) * BLOCK_M)
        if FUSED_CB:
            B_c = B_ptr + start * stride_b_t + g64 * stride_b_g
        else:
            cb_c = cb_ptr + c64 * stride_cb_c + g64 * stride_cb_g
        acc0 = tl.zeros((BLOCK_M, BLOCK_P), dtype=CD)
        acc1 = tl.zeros((BLOCK_M, BLOCK_P), dtype=CD)
        for k0 in range(0, hi, BLOCK_K):
            offs_k, ok = _tile_offsets(k0, BLOCK_K, OFF64)
            mk = offs_k < hi
            if FUSED_CB:
                bt = tl.load(B_c + ok[None, :] * stride_b_t + on[:, None] * stride_b_n,
                             mask=mn[:, None] & mk[None, :], other=0.0)
                s = tl.dot(cm, bt.to(DOT), input_precision=PREC, out_dtype=CD)
            else:
                s = tl.load(cb_c + om[:, None] * stride_cb_i + ok[None, :] * stride_cb_j,
                            mask=mm[:, None] & mk[None, :], other=0.0).to(CD)
            acc0 = _intra_update(acc0, s, dA_m0, d_0, dA_ptr, dt_ptr, x_0, offs_m, offs_k, ok, op, mk, mp,
                                 stride_x_t, stride_x_p, CD, DOT, PREC, FAST_EXP)
            if HB == 2:
                acc1 = _intra_update(acc1, s, dA_m1, d_0 + stride_d_h, dA_ptr, dt_ptr, x_0 + stride_x_h, offs_m,
                                     offs_k, ok, op, mk, mp, stride_x_t, stride_x_p, CD, DOT, PREC, FAST_EXP)

        if not EARLY_EPI:
            pv0, xm0, Dv0, zv0 = _epilogue_loads(prev_0, x_0, z_0, D_0, om, op, on, m2, mn, mp, stride_prev_n,
                                                 stride_prev_p, stride_x_t, stride_x_p, stride_z_t, stride_z_p,
                                                 stride_D_p, CD, HAS_D, HAS_Z, FUSED_CB)
            if HB == 2:
                pv1, xm1, Dv1, zv1 = _epilogue_loads(prev_0 + stride_prev_h, x_0 + stride_x_h, z_0 + stride_z_h,
                                                     D_0 + stride_D_h, om, op, on, m2, mn, mp, stride_prev_n,
                                                     stride_prev_p, stride_x_t, stride_x_p, stride_z_t, stride_z_p,
                                                     stride_D_p, CD, HAS_D, HAS_Z, FUSED_CB)
        if FUSED_CB:
            st0 = tl.dot(cm, pv0.to(DOT), input_precision=PREC, out_dtype=CD)
        else:
            st0 = _state_dot(C_c, prev_0, om, op, mm, mp, N, stride_c_t, stride_c_n, stride_prev_n, stride_prev_p,
                             CD, DOT, PREC, OFF64, BLOCK_M, BLOCK_P, BLOCK_N)
        _finish(acc0, st0, dA_m0, xm0, Dv0, zv0, o_0, om, op, m2, stride_o_t, stride_o_p, CD, HAS_D, HAS_Z,
                FAST_EXP)
        if HB == 2:
            if FUSED_CB:
                st1 = tl.dot(cm, pv1.to(DOT), input_precision=PREC, out_dtype=CD)
            else:
                st1 = _state_dot(C_c, prev_0 + stride_prev_h, om, op, mm, mp, N, stride_c_t, stride_c_n,
                                 stride_prev_n, stride_prev_p, CD, DOT, PREC, OFF64, BLOCK_M, BLOCK_P, BLOCK_N)
            _finish(acc1, st1, dA_m1, xm1, Dv1, zv1, o_0 + stride_o_h, om, op, m2, stride_o_t, stride_o_p,
                    CD, HAS_D, HAS_Z, FAST_EXP)


def fused_cb_ok(N: int) -> bool:
    """Whether the scan can form CB in place (one C tile of the full state size per program)."""
    return next_power_of_2(N) <= 256


# Launch defaults on a GPU, taken as one set when no tunable is given (shape classes "half" and "fma" of
# configs/<device>/ssd_chunk_scan.json; ssd_varlen passes ssd.TUNING's, which `harness bench sweep --op
# ssd_varlen` tunes): 128-token blocks over 8 warps (two warpgroups of wgmma rows), 64-token source
# blocks, two stages; 128 registers a thread keeps two such CTAs resident on an SM (without the cap
# ptxas takes ~170).
# The ssd_varlen sweep tries first the fused scan with the fewest registers: block_m 128 over 8 warps, 3 stages, no
# register cap.
GPU_DEFAULTS = launch_config("ssd_chunk_scan", dict(block_m=128, block_p=64, block_k=64, block_n=64, heads=1,
                                                    num_warps=8, num_stages=2, maxnreg=128, early_epilogue=False),
                             "half")
# fp32 / fp64 (dots on the FMA units, `cb` path): small tiles that do not spill.
FMA_DEFAULTS = launch_config("ssd_chunk_scan", dict(block_m=32, block_p=64, block_k=32, block_n=32, heads=1,
                                                    num_warps=4, num_stages=2, maxnreg=None, early_epilogue=False),
                             "fma")


def ssd_chunk_scan(x, z, C, D, cb, dt_out, dA_cs, prev_states, chunk_start, chunk_len, out, *,
                   compute_dtype=torch.float32, B=None, block_m=None, block_p=None, block_k=None, block_n=None,
                   heads=None, num_warps=None, num_stages=None, maxnreg=None, early_epilogue=None):
    """Writes y (T, H, P) into `out` (see the module docstring); returns `out`.

    `cb` (NC, G, cs, cs) from ssd_bmm, or None with `B` (T, G, N) given: CB formed in place (no CB
    round trip through memory). Tunables (None: GPU_DEFAULTS (FMA_DEFAULTS for fp32 / fp64) when none
    is given, else the stage's plain defaults): block_m / block_k (tokens; block_m a multiple of
    block_k, both capped at the chunk), block_p, heads (1 or 2 heads of a group per program, sharing the
    C and CB tiles), num_warps, num_stages, maxnreg (register cap, None: none; NVIDIA only),
    early_epilogue (read prev / x / z before the loop), block_n (the state-dim step of the
    carried-state dot on the `cb` path; fused: the whole N)."""
    if chunk_len.numel() == 0:
        return out
    grid, args, kw = chunk_scan_call(x, z, C, D, cb, dt_out, dA_cs, prev_states, chunk_start, chunk_len, out,
                                     compute_dtype=compute_dtype, B=B, block_m=block_m, block_p=block_p,
                                     block_k=block_k, block_n=block_n, heads=heads, num_warps=num_warps,
                                     num_stages=num_stages, maxnreg=maxnreg, early_epilogue=early_epilogue)
    launch(_chunk_scan_kernel, grid, *args, **kw)
    return out


def chunk_scan_call(x, z, C, D, cb, dt_out, dA_cs, prev_states, chunk_start, chunk_len, out, *,
                    compute_dtype=torch.float32, B=None, block_m=None, block_p=None, block_k=None, block_n=None,
                    heads=None, num_warps=None, num_stages=None, maxnreg=None, early_epilogue=None):
    """`ssd_chunk_scan`'s launch (at least one chunk slot) as (grid, arguments, keywords)."""
    T, H, P = x.shape
    G, N = C.shape[1], C.shape[2]
    NC = chunk_len.numel()
    fused = cb is None
    # (ssd_varlen passes cb=None for half types, whose dots run on the tensor cores)
    if fused and (B is None or not fused_cb_ok(N)):
        raise ValueError("ssd_chunk_scan: cb=None needs B and a state size N <= 256")
    cs = dt_out.shape[2]
    interp = interpreting()
    tun = (block_m, block_p, block_k, block_n, heads, num_warps, num_stages, maxnreg, early_epilogue)
    if not interp and all(v is None for v in tun):
        d = GPU_DEFAULTS if x.dtype in (torch.float16, torch.bfloat16) else FMA_DEFAULTS
        block_m, block_p, block_k, block_n, heads = (d["block_m"], d["block_p"], d["block_k"], d["block_n"],
                                                     d["heads"])
        num_warps, num_stages, maxnreg, early_epilogue = (d["num_warps"], d["num_stages"], d["maxnreg"],
                                                          d["early_epilogue"])
    cs2 = max(16, next_power_of_2(cs))
    bm = min(block_m or default_block(cs, interp=interp), cs2)
    bk = min(block_k or default_block(cs, interp=interp), bm)
    bp = block_p or default_block(P, interp=interp)
    if bm % bk:
        raise ValueError(f"ssd_chunk_scan: block_m ({bm}) must be a multiple of block_k ({bk})")
    # fused: the C tile covers the whole state dim (one dot over N, reused by every CB tile)
    bn = max(16, next_power_of_2(N)) if fused else min(block_n or default_block(N, interp=interp),
                                                       max(16, next_power_of_2(N)))
    DOT, PREC = dot_types(x.dtype, compute_dtype)
    CD = tl.float64 if compute_dtype == torch.float64 else tl.float32
    if D is not None:
        sDh, sDp = (D.stride(0), 0) if D.dim() == 1 else (D.stride(0), D.stride(1))
    else:
        sDh, sDp = 0, 0
    zz = z if z is not None else x
    BB = B if B is not None else C
    cbt = cb if cb is not None else dt_out
    cb_strides = cb.stride() if cb is not None else (0, 0, 0, 0)
    sx, sz, so, sc, sb, sp = x.stride(), zz.stride(), out.stride(), C.stride(), BB.stride(), prev_states.stride()
    num_m = -(-cs // bm)
    num_p = -(-P // bp)
    # int32 offsets inside a tile when every tile's reach fits (a bound over the padded extents)
    ext = max(num_m * bm, num_p * bp, bn)
    tok = max(abs(sx[0]), abs(sz[0]), abs(so[0]), abs(sc[0]), abs(sb[0]), abs(cb_strides[2]))
    inner = max(abs(sx[2]), abs(sz[2]), abs(so[2]), abs(sc[2]), abs(sb[2]), abs(cb_strides[3]), abs(sp[2]),
                abs(sp[3]), abs(sDp))
    off64 = ext * (tok + 2 * inner) > _I32_MAX
    # (the interpreter, i.e. CI, runs 2 heads a program where possible: both code paths stay tested)
    hb = 2 if (heads or (2 if interp else 1)) >= 2 and (H // G) % 2 == 0 else 1
    grid = (NC * (H // hb) * num_m * num_p,)
    # PTX inline asm and maxnreg are for NVIDIA GPUs only (not ROCm, not XPU)
    nvidia = x.device.type != "xpu" and torch.version.hip is None
    opts = {"num_warps": num_warps or 4, "num_stages": num_stages or 2}
    if maxnreg and nvidia:
        opts["maxnreg"] = maxnreg
    args = (x, zz, C, BB, D if D is not None else x, out, cbt, dt_out, dA_cs, prev_states, chunk_start, chunk_len,
            H, P, N, H // G, sx[0], sx[1], sx[2], sz[0], sz[1], sz[2], so[0], so[1], so[2], sc[0], sc[1], sc[2],
            sb[0], sb[1], sb[2], sDh, sDp, *cb_strides, dt_out.stride(0), dt_out.stride(1), *sp)
    kw = dict(CD=CD, DOT=DOT, PREC=PREC, HAS_D=D is not None, HAS_Z=z is not None, FUSED_CB=fused, OFF64=off64,
              EARLY_EPI=bool(early_epilogue), HB=hb, FAST_EXP=nvidia_fast(x) and CD == tl.float32,
              NUM_M=num_m, NUM_P=num_p, BLOCK_M=bm, BLOCK_P=bp, BLOCK_K=bk, BLOCK_N=bn, **opts)
    return grid, args, kw
