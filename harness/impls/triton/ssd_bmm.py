"""SSD stage 4: CB[c, g, i, j] = C[start_c + i, g, :] . B[start_c + j, g, :] per chunk and group.

One program per (chunk slot, group, (i-block, j-block)). Blocks strictly above the diagonal (every
j > every i) are skipped: the chunk scan never reads them (causal). Entries with i or j past the chunk
length are not written. Output in the compute dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.impls.triton._common import launch, cdiv
from harness.impls.triton.ssd_chunk_state import default_block, dot_types

__all__ = ["ssd_bmm"]


@triton.jit
def _bmm_kernel(C_ptr, B_ptr, chunk_start_ptr, chunk_len_ptr, cb_ptr, N, chunk_size,
                stride_c_t, stride_c_g, stride_c_n, stride_b_t, stride_b_g, stride_b_n,
                stride_cb_c, stride_cb_g, stride_cb_i, stride_cb_j,
                CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(2)
    num_j = tl.cdiv(chunk_size, BLOCK_N)
    pm = pid // num_j
    pn = pid % num_j
    length = tl.load(chunk_len_ptr + c)
    needed = (pm * BLOCK_M < length) & (pn * BLOCK_N < length)
    if CAUSAL:
        needed = needed & (pn * BLOCK_N <= pm * BLOCK_M + BLOCK_M - 1)
    if needed:
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mm = offs_m < length
        mn = offs_n < length
        c_base = C_ptr + g * stride_c_g + (start + offs_m[:, None].to(tl.int64)) * stride_c_t
        b_base = B_ptr + g * stride_b_g + (start + offs_n[None, :].to(tl.int64)) * stride_b_t
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=CD)
        for k0 in range(0, N, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < N
            a = tl.load(c_base + offs_k[None, :].to(tl.int64) * stride_c_n, mask=mm[:, None] & mk[None, :],
                        other=0.0)
            b = tl.load(b_base + offs_k[:, None].to(tl.int64) * stride_b_n, mask=mk[:, None] & mn[None, :],
                        other=0.0)
            acc += tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC, out_dtype=CD)
        o = (cb_ptr + c * stride_cb_c + g * stride_cb_g + offs_m[:, None].to(tl.int64) * stride_cb_i
             + offs_n[None, :].to(tl.int64) * stride_cb_j)
        tl.store(o, acc.to(cb_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def ssd_bmm(C, B, chunk_start, chunk_len, chunk_size: int, *, compute_dtype=torch.float32, causal=True,
            out_dtype=None, block_m=None, block_n=None, block_k=None, num_warps=4, num_stages=2):
    """C, B (T, G, N) -> CB (NC, G, cs, cs) (`out_dtype`, default the compute dtype); blocks above the
    diagonal left unset when `causal`."""
    T, G, N = C.shape
    NC = chunk_len.numel()
    cb = torch.empty((NC, G, chunk_size, chunk_size), dtype=out_dtype or compute_dtype, device=C.device)
    if NC == 0:
        return cb
    grid, args, kw = bmm_call(C, B, chunk_start, chunk_len, cb, chunk_size, compute_dtype=compute_dtype,
                              causal=causal, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                              num_stages=num_stages)
    launch(_bmm_kernel, grid, *args, **kw)
    return cb


def bmm_call(C, B, chunk_start, chunk_len, cb, chunk_size: int, *, compute_dtype=torch.float32, causal=True,
             block_m=None, block_n=None, block_k=None, num_warps=4, num_stages=2):
    """`ssd_bmm`'s launch into `cb` (at least one chunk slot) as (grid, arguments, keywords)."""
    N = C.shape[2]
    NC = chunk_len.numel()
    bm = block_m or default_block(chunk_size)
    bn = block_n or default_block(chunk_size)
    bk = block_k or default_block(N)
    DOT, PREC = dot_types(C.dtype, compute_dtype)
    CD = tl.float64 if compute_dtype == torch.float64 else tl.float32
    grid = (NC, C.shape[1], cdiv(chunk_size, bm) * cdiv(chunk_size, bn))
    args = (C, B, chunk_start, chunk_len, cb, N, chunk_size,
            C.stride(0), C.stride(1), C.stride(2), B.stride(0), B.stride(1), B.stride(2), *cb.stride())
    return grid, args, dict(CD=CD, DOT=DOT, PREC=PREC, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                            num_warps=num_warps, num_stages=num_stages)
