"""SSD stage 2: the state each chunk adds on its own (as if it started from zero).

states[c, h] = sum_{j in chunk c} exp(dA_cs[last] - dA_cs[j]) * dt[j] * x[j, h, :] (outer) B[j, g(h), :]

(P x N per head, compute dtype). One program per (chunk slot, HB heads of one group, block of P x N);
unused chunk slots (length 0) write nothing. The HB heads are stacked as the rows of one dot,
[HB * BLOCK_P, tokens] . [tokens, BLOCK_N] (rows (head, p) are adjacent in x and in states), so the B
tile is read once for all of them; the per-token weight scales the x^T operand (fed from registers),
the B tile goes to the tensor cores as loaded. The exponent is selected to 0 for the chunk's last
token (exactly, also when the cumulative sum is -inf: A = -inf) and is never clamped, so dt * A > 0 (a
growing system, which the contract accepts) is exact. Chunk / head bases in int64, in-tile offsets in
int32 when they fit (OFF64 otherwise).

With `front=...` (FRONT) the program first does ssd_chunk_cumsum's work for its chunk slot and heads
(chunk_front: table entry, dt, dA_cs, stored), so ssd_varlen needs no separate cumsum launch.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from harness.impls.triton._common import launch, cdiv, interpreting, launch_config, next_power_of_2
from harness.impls.triton.ssd_chunk_cumsum import chunk_front, front_args, front_buffers

__all__ = ["ssd_chunk_state", "dot_types", "default_block"]


_I32_MAX = 2**31 - 1


def default_block(n: int, cap: int = 64, interp=None) -> int:
    """Default tile size along a dim of size n: `cap` on a GPU (one compiled variant for every small
    shape), the smallest power of two >= n (at least 16, for tl.dot) under the interpreter."""
    if not (interpreting() if interp is None else interp):
        return cap
    return max(16, min(cap, next_power_of_2(n)))


def dot_types(dtype: torch.dtype, compute_dtype: torch.dtype):
    """(operand dtype, input_precision) of tl.dot for activations of `dtype`: half types feed the tensor
    cores as they are; fp32/fp64 stay exact ("ieee": no tf32 rounding)."""
    if dtype in (torch.float16, torch.bfloat16):
        return (tl.float16 if dtype == torch.float16 else tl.bfloat16), None  # Triton's default
    return (tl.float64 if compute_dtype == torch.float64 else tl.float32), "ieee"


@triton.jit
def _chunk_state_kernel(x_ptr, B_ptr, dt_ptr, dA_ptr, chunk_start_ptr, chunk_len_ptr, states_ptr,
                        P, N, heads_per_group,
                        stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n,
                        stride_d_h, stride_d_c, stride_s_c, stride_s_h, stride_s_p, stride_s_n,
                        # the fused front (FRONT): ssd_chunk_cumsum's inputs and outputs
                        dt_in_ptr, bias_ptr, A_ptr, qsl_ptr, chunk_seq_ptr, seq_first_ptr,
                        H, S, chunk_size, lo_hi, lo_lo, hi_hi, hi_lo, stride_dt_t, stride_dt_h,
                        CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, OFF64: tl.constexpr,
                        HB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FRONT: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    h0 = hq.to(tl.int64) * HB  # HB heads of one group: one B tile feeds all of them
    pid = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pp = pid // num_n
    pn = pid % num_n
    if FRONT:
        # ssd_chunk_cumsum's work for this chunk slot and these heads, in this launch: the table entry
        # (first program of the slot), dt / dA_cs of the heads (every program of the slot writes the same
        # values), read back below by this program's own threads after the barrier.
        start, length = chunk_front(c, h0 + tl.arange(0, HB), (hq == 0) & (pid == 0), dt_in_ptr, bias_ptr, A_ptr,
                                    qsl_ptr, dt_ptr, dA_ptr, chunk_seq_ptr, chunk_start_ptr, chunk_len_ptr,
                                    seq_first_ptr, H, S, chunk_size, lo_hi, lo_lo, hi_hi, hi_lo,
                                    stride_dt_t, stride_dt_h, stride_d_h, stride_d_c,
                                    CD, HAS_BIAS, SOFTPLUS, BLOCK_S, BLOCK_L)
        length = length.to(tl.int32)
        tl.debug_barrier()
    else:
        length = tl.load(chunk_len_ptr + c)
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
    if length > 0:
        g = h0 // heads_per_group
        # rows of the tile: (head h0 + r // BLOCK_P, dim pp * BLOCK_P + r % BLOCK_P)
        rows = tl.arange(0, HB * BLOCK_P)
        offs_p = pp * BLOCK_P + rows % BLOCK_P
        hh = rows // BLOCK_P
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mp = offs_p < P
        mn = offs_n < N
        if OFF64:
            row_x = hh.to(tl.int64) * stride_x_h + offs_p.to(tl.int64) * stride_x_p
            on = offs_n.to(tl.int64)
        else:
            row_x = hh * stride_x_h + offs_p * stride_x_p
            on = offs_n
        heads = tl.arange(0, HB)
        d_base = (h0 + heads.to(tl.int64)) * stride_d_h + c * stride_d_c  # [HB]
        last = tl.load(dA_ptr + d_base + length - 1)
        x_c = x_ptr + start * stride_x_t + h0 * stride_x_h
        b_c = B_ptr + start * stride_b_t + g * stride_b_g
        acc = tl.zeros((HB * BLOCK_P, BLOCK_N), dtype=CD)
        for k0 in range(0, length, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < length
            if OFF64:
                ok = offs_k.to(tl.int64)
            else:
                ok = offs_k
            xt = tl.load(x_c + row_x[:, None] + ok[None, :] * stride_x_t, mask=mp[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_c + ok[:, None] * stride_b_t + on[None, :] * stride_b_n, mask=mk[:, None] & mn[None, :],
                        other=0.0)
            dA_k = tl.load(dA_ptr + d_base[:, None] + offs_k[None, :], mask=mk[None, :], other=0.0)  # [HB, BK]
            dt_k = tl.load(dt_ptr + d_base[:, None] + offs_k[None, :], mask=mk[None, :], other=0.0)
            # exponent last - dA_j selected before exp (0 for the last token and past it), never clamped;
            # a cumulative -inf (A = -inf) gives -inf, not -inf - (-inf)
            seg = tl.where(offs_k[None, :] < length - 1, last[:, None] - tl.where(dA_k > float("-inf"), dA_k, 0.0),
                           0.0)
            w = tl.where(mk[None, :], tl.exp(seg) * dt_k, 0.0)
            w = tl.reshape(tl.broadcast_to(w[:, None, :], (HB, BLOCK_P, BLOCK_K)), (HB * BLOCK_P, BLOCK_K))
            # the per-token weight scales the x^T operand (fed from registers); the B tile goes to the
            # tensor cores as loaded
            xw = (xt.to(CD) * w).to(DOT)
            acc += tl.dot(xw, b.to(DOT), input_precision=PREC, out_dtype=CD)
        s_ptr = (states_ptr + c * stride_s_c + h0 * stride_s_h
                 + (hh.to(tl.int64) * stride_s_h + offs_p.to(tl.int64) * stride_s_p)[:, None]
                 + offs_n[None, :].to(tl.int64) * stride_s_n)
        tl.store(s_ptr, acc, mask=mp[:, None] & mn[None, :])


def _heads_per_program(hb: int, heads_per_group: int) -> int:
    """The largest power of two <= hb dividing heads_per_group (the heads of a program share B)."""
    hb = max(1, int(hb))
    while hb > 1 and heads_per_group % hb:
        hb //= 2
    return hb


# Launch defaults on a GPU, taken as one set when no tunable is given (shape classes "half" and "fma" of
# configs/<device>/ssd_chunk_state.json; `harness bench sweep --op ssd_varlen` tunes them through ssd.TUNING): the
# whole P x N state of two heads of a group per program (M = 2 * 64 rows, the B tile read once for
# both), 64-token steps, 8 warps, two stages; 128 registers (capped: the fused front would take ~150)
# and 64 KiB shared keep two CTAs on an SM.
GPU_DEFAULTS = launch_config("ssd_chunk_state", dict(block_p=64, block_n=128, block_k=64, heads=2, num_warps=8,
                                                     num_stages=2, maxnreg=128), "half")
# fp32 / fp64 (dots on the FMA units): tiles that do not spill.
FMA_DEFAULTS = launch_config("ssd_chunk_state", dict(block_p=64, block_n=64, block_k=32, heads=1, num_warps=4,
                                                     num_stages=2, maxnreg=None), "fma")


def ssd_chunk_state(x, B, dt_out, dA_cs, chunk_start, chunk_len, *, compute_dtype=torch.float32,
                    block_p=None, block_n=None, block_k=None, heads=None, num_warps=None, num_stages=None,
                    maxnreg=None, front=None):
    """x (T, H, P), B (T, G, N), dt_out/dA_cs (H, NC, cs) -> states (NC, H, P, N) in compute dtype.
    `heads`: heads per program (a power of two dividing H // G; they share the B tiles). Tunables left
    None: GPU_DEFAULTS (FMA_DEFAULTS for fp32 / fp64) when none is given, else the plain defaults.

    front: None, or a dict of ssd_chunk_cumsum's arguments (dt, A, dt_bias, query_start_loc, chunk_size,
    dt_softplus, dt_limit, num_chunks): then that stage runs inside this launch (dt_out, dA_cs,
    chunk_start, chunk_len are ignored, pass None) and the return value is
    (states, dt_out, dA_cs, chunk_seq, chunk_start, chunk_len, seq_first)."""
    T, H, P = x.shape
    bufs = None
    if front is not None:
        cs = front["chunk_size"]
        bufs = front_buffers(front["dt"], front["query_start_loc"], cs, compute_dtype, front.get("num_chunks"))
        dt_out, dA_cs, _, chunk_start, chunk_len, _ = bufs
    NC = chunk_len.numel()
    states = torch.empty((NC, H, P, B.shape[2]), dtype=compute_dtype, device=x.device)
    if NC == 0:
        return states if front is None else (states, *bufs)
    grid, args, kw = chunk_state_call(x, B, dt_out, dA_cs, chunk_start, chunk_len, states,
                                      compute_dtype=compute_dtype, block_p=block_p, block_n=block_n, block_k=block_k,
                                      heads=heads, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg,
                                      front=front, bufs=bufs)
    launch(_chunk_state_kernel, grid, *args, **kw)
    return states if front is None else (states, *bufs)


def chunk_state_call(x, B, dt_out, dA_cs, chunk_start, chunk_len, states, *, compute_dtype=torch.float32,
                     block_p=None, block_n=None, block_k=None, heads=None, num_warps=None, num_stages=None,
                     maxnreg=None, front=None, bufs=None):
    """`ssd_chunk_state`'s launch into `states` (at least one chunk slot) as (grid, arguments, keywords): `front`
    as there, with `bufs` its `front_buffers`."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    NC = chunk_len.numel()
    cs = dt_out.shape[2]
    interp = interpreting()
    if not interp and all(v is None for v in (block_p, block_n, block_k, heads, num_warps, num_stages, maxnreg)):
        d = GPU_DEFAULTS if x.dtype in (torch.float16, torch.bfloat16) else FMA_DEFAULTS
        block_p, block_n, block_k, heads, num_warps, num_stages, maxnreg = (
            d["block_p"], d["block_n"], d["block_k"], d["heads"], d["num_warps"], d["num_stages"], d["maxnreg"])
    bp = block_p or default_block(P, interp=interp)
    bn = block_n or default_block(N, interp=interp)
    bk = block_k or default_block(cs, interp=interp)
    # (the interpreter, i.e. CI, runs 2 heads a program where possible: both code paths stay tested)
    hb = _heads_per_program(heads or (2 if interp else 1), H // G)
    DOT, PREC = dot_types(x.dtype, compute_dtype)
    CD = tl.float64 if compute_dtype == torch.float64 else tl.float32
    sxt, sxh, sxp = x.stride()
    sbt, sbg, sbn = B.stride()
    ek = cdiv(cs, bk) * bk
    off64 = (ek * abs(sxt) + hb * abs(sxh) + cdiv(P, bp) * bp * abs(sxp) > _I32_MAX
             or ek * abs(sbt) + cdiv(N, bn) * bn * abs(sbn) > _I32_MAX)
    if front is not None:
        fa, fc = front_args(front["dt"], front["dt_bias"], front["A"], front["query_start_loc"], cs, bufs,
                            front.get("dt_softplus", True), front.get("dt_limit", (0.0, math.inf)), compute_dtype)
        # (dt_in, bias, A, qsl, chunk_seq, seq_first, H, S, chunk_size, limits, dt strides)
        extra = (*fa[0:4], fa[6], fa[9], *fa[10:19])
        fconst = dict(FRONT=True, HAS_BIAS=fc["HAS_BIAS"], SOFTPLUS=fc["SOFTPLUS"], BLOCK_S=fc["BLOCK_S"],
                      BLOCK_L=fc["BLOCK_L"])
    else:
        extra = (x, x, x, chunk_len, chunk_len, chunk_len, H, 1, cs, 0.0, 0.0, 0.0, 0.0, 0, 0)
        fconst = dict(FRONT=False, HAS_BIAS=False, SOFTPLUS=False, BLOCK_S=16, BLOCK_L=16)
    grid = (NC, H // hb, cdiv(P, bp) * cdiv(N, bn))
    args = (x, B, dt_out, dA_cs, chunk_start, chunk_len, states, P, N, H // G,
            sxt, sxh, sxp, sbt, sbg, sbn,
            dt_out.stride(0), dt_out.stride(1), *states.stride(), *extra)
    kw = dict(CD=CD, DOT=DOT, PREC=PREC, OFF64=off64, HB=hb, BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=bk, **fconst,
              num_warps=num_warps or 4, num_stages=num_stages or 2,
              **({"maxnreg": maxnreg} if maxnreg and x.device.type != "xpu" and torch.version.hip is None else {}))
    return grid, args, kw
