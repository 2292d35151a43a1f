"""SSD stage 1: the chunk table and dt processing.

One program per (chunk slot, block of heads). The chunk grid is per sequence: chunk k of sequence s
covers tokens [q[s] + k*cs, min(q[s] + (k+1)*cs, q[s+1])), so no chunk ever holds two sequences and
the cumulative dA inside a chunk starts at the sequence start (first chunk) or at a chunk start of the
same sequence (bug classes 4 and 5 cannot happen). The number of chunks is at most T // cs + S; each
program finds its (sequence, position) by counting chunks over query_start_loc on the device (no host
sync), and the programs of the first head block write the chunk table the other stages read:

    chunk_seq[c]   sequence of chunk slot c, -1 for an unused slot
    chunk_start[c] first token of the chunk
    chunk_len[c]   its number of tokens (0 for an unused slot)
    seq_first[s]   the first chunk of sequence s (written only for sequences with tokens)

Per token: dt = clamp(softplus(dt + dt_bias), lo, hi) (softplus optional), dA = dt * A; stored as
dt_out[h, c, l] and dA_cs[h, c, l] = cumsum of dA over the chunk's tokens l' <= l (compute dtype).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from harness.impls.triton._common import launch, cdiv, next_power_of_2

__all__ = ["chunk_front", "chunk_table_size", "front_args", "front_buffers", "split_limit", "ssd_chunk_cumsum"]


@triton.jit
def softplus_exact(v):
    """log(1 + exp(v)) without a linear cut-off: max(v, 0) + log1p(exp(-|v|)), log1p by series when tiny."""
    u = tl.exp(-tl.abs(v))
    l1p = tl.where(u < 1e-3, u * (1.0 - u * (0.5 - u * (1.0 / 3.0))), tl.log(1.0 + u))
    return tl.maximum(v, 0.0) + l1p


@triton.jit
def chunk_front(c, offs_h, write_table, dt_ptr, bias_ptr, A_ptr, qsl_ptr, dt_out_ptr, dA_ptr,
                chunk_seq_ptr, chunk_start_ptr, chunk_len_ptr, seq_first_ptr,
                H, S, chunk_size, lo_hi, lo_lo, hi_hi, hi_lo,
                stride_dt_t, stride_dt_h, stride_o_h, stride_o_c,
                CD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    """Chunk slot c: its table entry (stored when `write_table`), dt and dA_cs of heads `offs_h`
    (stored); returns (start, length) of the chunk (length 0 for an unused slot). Shared by the
    cumsum kernel and the fused front of ssd_chunk_state."""
    # Which sequence owns chunk slot c: the number of sequences whose chunks all lie before c.
    seq = tl.zeros((), dtype=tl.int32)
    before = tl.zeros((), dtype=tl.int64)
    carry = tl.zeros((), dtype=tl.int64)
    for s0 in range(0, S, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        m = offs < S
        a = tl.load(qsl_ptr + offs, mask=m, other=0).to(tl.int64)
        b = tl.load(qsl_ptr + offs + 1, mask=m, other=0).to(tl.int64)
        nch = tl.where(m, (b - a + chunk_size - 1) // chunk_size, 0)
        incl = carry + tl.cumsum(nch, 0)
        done = m & (incl <= c)
        seq += tl.sum(done.to(tl.int32), 0).to(tl.int32)
        before += tl.sum(tl.where(done, nch, 0), 0)
        carry += tl.sum(nch, 0)
    valid = seq < S
    k = c - before
    q0 = tl.load(qsl_ptr + seq, mask=valid, other=0).to(tl.int64)
    q1 = tl.load(qsl_ptr + seq + 1, mask=valid, other=0).to(tl.int64)
    start = q0 + k * chunk_size
    length = tl.where(valid, tl.minimum(q1 - start, chunk_size), 0)
    tl.store(chunk_seq_ptr + c, tl.where(valid, seq, -1).to(tl.int32), mask=write_table)
    tl.store(chunk_start_ptr + c, tl.where(valid, start, 0).to(tl.int32), mask=write_table)
    tl.store(chunk_len_ptr + c, length.to(tl.int32), mask=write_table)
    tl.store(seq_first_ptr + seq, c.to(tl.int32), mask=write_table & valid & (k == 0))

    offs_l = tl.arange(0, BLOCK_L)
    mh = offs_h < H
    ml = offs_l < length
    m2 = ml[:, None] & mh[None, :]
    tok = start + offs_l.to(tl.int64)
    d = tl.load(dt_ptr + tok[:, None] * stride_dt_t + offs_h[None, :].to(tl.int64) * stride_dt_h,
                mask=m2, other=0.0).to(CD)
    if HAS_BIAS:
        d += tl.load(bias_ptr + offs_h, mask=mh, other=0.0).to(CD)[None, :]
    if SOFTPLUS:
        d = softplus_exact(d)
    lo = tl.cast(lo_hi, CD) + tl.cast(lo_lo, CD)
    hi = tl.cast(hi_hi, CD) + tl.cast(hi_lo, CD)
    d = tl.minimum(tl.maximum(d, lo), hi)
    d = tl.where(m2, d, 0.0)
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(CD)
    dA = tl.cumsum(tl.where(m2, d * A[None, :], 0.0), 0)  # (selected: 0 * A is NaN for A = -inf)
    o = offs_h[None, :].to(tl.int64) * stride_o_h + c.to(tl.int64) * stride_o_c + offs_l[:, None]
    # Positions past the chunk's length hold dt = 0 and the chunk's total dA, so that
    # dA_cs[h, c, cs - 1] is the chunk's decay exponent for every slot (0 for unused slots).
    mfull = (offs_l < chunk_size)[:, None] & mh[None, :]
    tl.store(dt_out_ptr + o, d, mask=mfull)
    tl.store(dA_ptr + o, dA, mask=mfull)
    return start, length


@triton.jit
def _chunk_cumsum_kernel(dt_ptr, bias_ptr, A_ptr, qsl_ptr, dt_out_ptr, dA_ptr,
                         chunk_seq_ptr, chunk_start_ptr, chunk_len_ptr, seq_first_ptr,
                         H, S, chunk_size, lo_hi, lo_lo, hi_hi, hi_lo,
                         stride_dt_t, stride_dt_h, stride_o_h, stride_o_c,
                         CD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr):
    c = tl.program_id(0)
    pid_h = tl.program_id(1)
    chunk_front(c, pid_h * BLOCK_H + tl.arange(0, BLOCK_H), pid_h == 0, dt_ptr, bias_ptr, A_ptr, qsl_ptr,
                dt_out_ptr, dA_ptr, chunk_seq_ptr, chunk_start_ptr, chunk_len_ptr, seq_first_ptr,
                H, S, chunk_size, lo_hi, lo_lo, hi_hi, hi_lo, stride_dt_t, stride_dt_h, stride_o_h, stride_o_c,
                CD, HAS_BIAS, SOFTPLUS, BLOCK_S, BLOCK_L)


def chunk_table_size(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Upper bound on the number of chunks of the per-sequence grid: sum ceil(l_s/cs) <= T//cs + S."""
    return num_tokens // chunk_size + num_seqs


def split_limit(v: float) -> tuple[float, float]:
    """v as an fp32 pair (hi, lo) with hi + lo == v to ~1e-15 (kernel float args are fp32)."""
    if math.isinf(v) or v == 0.0:
        return float(v), 0.0
    hi = float(torch.tensor(v, dtype=torch.float32))
    return hi, float(v - hi)


def front_buffers(dt, query_start_loc, chunk_size: int, compute_dtype, num_chunks=None, device=None):
    """(dt_out, dA_cs, chunk_seq, chunk_start, chunk_len, seq_first) allocated for the stage's outputs (on `device`,
    default dt's)."""
    T, H = dt.shape
    S = query_start_loc.numel() - 1
    NC = num_chunks if num_chunks is not None else chunk_table_size(T, S, chunk_size)
    dev = device or dt.device
    meta = torch.empty(3 * NC + max(S, 1), dtype=torch.int32, device=dev)
    dtA = torch.empty((2, H, NC, chunk_size), dtype=compute_dtype, device=dev)
    return dtA[0], dtA[1], meta[:NC], meta[NC:2 * NC], meta[2 * NC:3 * NC], meta[3 * NC:3 * NC + S]


def front_args(dt, dt_bias, A, query_start_loc, chunk_size: int, bufs, dt_softplus, dt_limit, compute_dtype):
    """(positional args, constexpr kwargs) of `chunk_front` for the buffers `bufs` (front_buffers)."""
    dt_out, dA, chunk_seq, chunk_start, chunk_len, seq_first = bufs
    S = query_start_loc.numel() - 1
    lo_hi, lo_lo = split_limit(float(dt_limit[0]))
    hi_hi, hi_lo = split_limit(float(dt_limit[1]))
    args = (dt, dt_bias if dt_bias is not None else dt, A, query_start_loc, dt_out, dA,
            chunk_seq, chunk_start, chunk_len, seq_first,
            dt.shape[1], S, chunk_size, lo_hi, lo_lo, hi_hi, hi_lo,
            dt.stride(0), dt.stride(1), dt_out.stride(0), dt_out.stride(1))
    consts = dict(CD=tl.float64 if compute_dtype == torch.float64 else tl.float32, HAS_BIAS=dt_bias is not None,
                  SOFTPLUS=bool(dt_softplus), BLOCK_S=max(16, min(256, next_power_of_2(S))),
                  BLOCK_L=max(16, next_power_of_2(chunk_size)))
    return args, consts


def ssd_chunk_cumsum(dt, A, dt_bias, query_start_loc, chunk_size: int, *, dt_softplus=True,
                     dt_limit=(0.0, math.inf), compute_dtype=torch.float32, num_chunks=None,
                     block_h=None, num_warps=4):
    """dt (T, H) -> (dt_out, dA_cs, chunk_seq, chunk_start, chunk_len, seq_first).

    dt_out, dA_cs: (H, NC, chunk_size) in `compute_dtype`; past a chunk's length dt_out is 0 and dA_cs
    holds the chunk's total, so dA_cs[:, c, -1] is chunk c's decay exponent (0 for unused slots);
    chunk_* (NC,) int32; seq_first (S,) int32. NC = `num_chunks` or chunk_table_size(T, S, cs).
    (ssd_varlen runs this stage inside ssd_chunk_state's launch, see ssd_chunk_state(front=...).)
    """
    bufs = front_buffers(dt, query_start_loc, chunk_size, compute_dtype, num_chunks)
    NC = bufs[2].numel()
    if NC == 0:
        return bufs
    grid, args, kw = cumsum_call(dt, dt_bias, A, query_start_loc, chunk_size, bufs, dt_softplus, dt_limit,
                                 compute_dtype, block_h, num_warps)
    launch(_chunk_cumsum_kernel, grid, *args, **kw)
    return bufs


def cumsum_call(dt, dt_bias, A, query_start_loc, chunk_size: int, bufs, dt_softplus, dt_limit, compute_dtype,
                block_h=None, num_warps=4):
    """`ssd_chunk_cumsum`'s launch into `bufs` (`front_buffers`, at least one chunk slot) as (grid, arguments,
    keywords)."""
    H = dt.shape[1]
    args, consts = front_args(dt, dt_bias, A, query_start_loc, chunk_size, bufs, dt_softplus, dt_limit,
                              compute_dtype)
    if block_h is None:
        block_h = max(1, min(next_power_of_2(H), max(1, 2048 // consts["BLOCK_L"])))
    return (bufs[2].numel(), cdiv(H, block_h)), args, dict(consts, BLOCK_H=block_h, num_warps=num_warps)
