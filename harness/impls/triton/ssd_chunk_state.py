"""SSD stage 2: the state each chunk adds on its own (as if it started from zero).

states[c, h] = sum_{j in chunk c} exp(min(dA_cs[last] - dA_cs[j], 0)) * dt[j] * x[j, h, :] (outer) B[j, g(h), :]

(P x N per head, compute dtype). One program per (chunk slot, head, block of P x N); unused chunk slots
(length 0) write nothing. The exponent is clamped at 0 so that rounding of the cumulative sums never
makes it positive (bug class 6).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.impls.triton._common import cdiv, interpreting, next_power_of_2

__all__ = ["ssd_chunk_state", "dot_types", "default_block"]


def default_block(n: int, cap: int = 64) -> int:
    """Default tile size along a dim of size n: `cap` on a GPU (one compiled variant for every small
    shape), the smallest power of two >= n (at least 16, for tl.dot) under the interpreter."""
    if not interpreting():
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
                        CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pp = pid // num_n
    pn = pid % num_n
    length = tl.load(chunk_len_ptr + c)
    if length > 0:
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        g = h // heads_per_group
        offs_p = pp * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mp = offs_p < P
        mn = offs_n < N
        d_base = h * stride_d_h + c * stride_d_c
        last = tl.load(dA_ptr + d_base + length - 1)
        x_base = x_ptr + h * stride_x_h + offs_p[:, None].to(tl.int64) * stride_x_p
        b_base = B_ptr + g * stride_b_g + offs_n[None, :].to(tl.int64) * stride_b_n
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=CD)
        for k0 in range(0, length, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < length
            tok = start + offs_k.to(tl.int64)
            xt = tl.load(x_base + tok[None, :] * stride_x_t, mask=mp[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_base + tok[:, None] * stride_b_t, mask=mk[:, None] & mn[None, :], other=0.0)
            dA_k = tl.load(dA_ptr + d_base + offs_k, mask=mk, other=0.0)
            dt_k = tl.load(dt_ptr + d_base + offs_k, mask=mk, other=0.0)
            w = tl.where(mk, tl.exp(tl.minimum(last - dA_k, 0.0)) * dt_k, 0.0)
            bw = (b.to(CD) * w[:, None]).to(DOT)
            acc += tl.dot(xt.to(DOT), bw, input_precision=PREC, out_dtype=CD)
        s_ptr = (states_ptr + c * stride_s_c + h * stride_s_h + offs_p[:, None].to(tl.int64) * stride_s_p
                 + offs_n[None, :].to(tl.int64) * stride_s_n)
        tl.store(s_ptr, acc, mask=mp[:, None] & mn[None, :])


def ssd_chunk_state(x, B, dt_out, dA_cs, chunk_start, chunk_len, *, compute_dtype=torch.float32,
                    block_p=None, block_n=None, block_k=None, num_warps=4, num_stages=2):
    """x (T, H, P), B (T, G, N), dt_out/dA_cs (H, NC, cs) -> states (NC, H, P, N) in compute dtype."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    NC = chunk_len.numel()
    states = torch.empty((NC, H, P, N), dtype=compute_dtype, device=x.device)
    if NC == 0:
        return states
    cs = dt_out.shape[2]
    bp = block_p or default_block(P)
    bn = block_n or default_block(N)
    bk = block_k or default_block(cs)
    DOT, PREC = dot_types(x.dtype, compute_dtype)
    CD = tl.float64 if compute_dtype == torch.float64 else tl.float32
    grid = (NC, H, cdiv(P, bp) * cdiv(N, bn))
    _chunk_state_kernel[grid](
        x, B, dt_out, dA_cs, chunk_start, chunk_len, states, P, N, H // G,
        x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
        dt_out.stride(0), dt_out.stride(1), *states.stride(),
        CD=CD, DOT=DOT, PREC=PREC, BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=num_warps, num_stages=num_stages)
    return states
