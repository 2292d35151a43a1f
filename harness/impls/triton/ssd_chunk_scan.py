"""SSD stage 5: the outputs.

For token i of chunk c (head h, group g = h // (H // G)):

    y_i = exp(dA_cs[i]) * C_i . prev_states[c, h]                                  (carried state)
        + sum_{j <= i in chunk} CB[c, g, i, j] * exp(min(dA_cs[i] - dA_cs[j], 0)) * dt[j] * x_j   (intra-chunk)
        + D * x_i                                                                   (D (H,) or (H, P))
    y_i *= silu(z_i)                                                                (when z is given)

One program per (chunk slot, head, (block of tokens, block of P)); writes into `out` (any strides).
The decay exponent is masked to j <= i and clamped at 0 before exp, so neither the masked upper
triangle nor rounding can overflow (bug class 6).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.impls.triton._common import cdiv
from harness.impls.triton.ssd_chunk_state import default_block, dot_types

__all__ = ["ssd_chunk_scan"]


@triton.jit
def _chunk_scan_kernel(x_ptr, z_ptr, C_ptr, D_ptr, out_ptr, cb_ptr, dt_ptr, dA_ptr, prev_ptr,
                       chunk_start_ptr, chunk_len_ptr, P, N, heads_per_group, chunk_size,
                       stride_x_t, stride_x_h, stride_x_p, stride_z_t, stride_z_h, stride_z_p,
                       stride_o_t, stride_o_h, stride_o_p, stride_c_t, stride_c_g, stride_c_n,
                       stride_D_h, stride_D_p, stride_cb_c, stride_cb_g, stride_cb_i, stride_cb_j,
                       stride_d_h, stride_d_c, stride_prev_c, stride_prev_h, stride_prev_p, stride_prev_n,
                       CD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                       HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(2)
    num_p = tl.cdiv(P, BLOCK_P)
    pm = pid // num_p
    pp = pid % num_p
    length = tl.load(chunk_len_ptr + c)
    if pm * BLOCK_M < length:
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        g = h // heads_per_group
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_p = pp * BLOCK_P + tl.arange(0, BLOCK_P)
        mm = offs_m < length
        mp = offs_p < P
        tok_m = start + offs_m.to(tl.int64)
        d_base = h * stride_d_h + c * stride_d_c
        dA_m = tl.load(dA_ptr + d_base + offs_m, mask=mm, other=0.0)

        # Carried state: exp(dA_cs[i]) * C_i . prev[c, h]
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=CD)
        prev_base = (prev_ptr + c * stride_prev_c + h * stride_prev_h
                     + offs_p[None, :].to(tl.int64) * stride_prev_p)
        c_base = C_ptr + g * stride_c_g + tok_m[:, None] * stride_c_t
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mn = offs_n < N
            cm = tl.load(c_base + offs_n[None, :].to(tl.int64) * stride_c_n, mask=mm[:, None] & mn[None, :],
                         other=0.0)
            pv = tl.load(prev_base + offs_n[:, None].to(tl.int64) * stride_prev_n,
                         mask=mn[:, None] & mp[None, :], other=0.0)
            acc += tl.dot(cm.to(DOT), pv.to(DOT), input_precision=PREC, out_dtype=CD)
        acc = acc * tl.exp(tl.minimum(dA_m, 0.0))[:, None]

        # Intra-chunk, causal: j <= i.
        hi = tl.minimum(length, (pm + 1) * BLOCK_M)
        cb_base = cb_ptr + c * stride_cb_c + g * stride_cb_g + offs_m[:, None].to(tl.int64) * stride_cb_i
        x_base = x_ptr + h * stride_x_h + offs_p[None, :].to(tl.int64) * stride_x_p
        for k0 in range(0, hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < hi
            causal = (offs_m[:, None] >= offs_k[None, :]) & mm[:, None] & mk[None, :]
            cb = tl.load(cb_base + offs_k[None, :].to(tl.int64) * stride_cb_j, mask=causal, other=0.0).to(CD)
            dA_k = tl.load(dA_ptr + d_base + offs_k, mask=mk, other=0.0)
            dt_k = tl.load(dt_ptr + d_base + offs_k, mask=mk, other=0.0)
            w = cb * tl.exp(tl.minimum(dA_m[:, None] - dA_k[None, :], 0.0)) * dt_k[None, :]
            w = tl.where(causal, w, 0.0)
            xk = tl.load(x_base + (start + offs_k[:, None].to(tl.int64)) * stride_x_t,
                         mask=mk[:, None] & mp[None, :], other=0.0)
            acc += tl.dot(w.to(DOT), xk.to(DOT), input_precision=PREC, out_dtype=CD)

        m2 = mm[:, None] & mp[None, :]
        if HAS_D:
            xm = tl.load(x_base + tok_m[:, None] * stride_x_t, mask=m2, other=0.0).to(CD)
            Dv = tl.load(D_ptr + h * stride_D_h + offs_p.to(tl.int64) * stride_D_p, mask=mp, other=0.0).to(CD)
            acc += xm * Dv[None, :]
        if HAS_Z:
            zv = tl.load(z_ptr + tok_m[:, None] * stride_z_t + h * stride_z_h
                         + offs_p[None, :].to(tl.int64) * stride_z_p, mask=m2, other=0.0).to(CD)
            acc = acc * zv * tl.sigmoid(zv)
        o = out_ptr + tok_m[:, None] * stride_o_t + h * stride_o_h + offs_p[None, :].to(tl.int64) * stride_o_p
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m2)


def ssd_chunk_scan(x, z, C, D, cb, dt_out, dA_cs, prev_states, chunk_start, chunk_len, out, *,
                   compute_dtype=torch.float32, block_m=None, block_p=None, block_k=None, block_n=None,
                   num_warps=4, num_stages=2):
    """Writes y (T, H, P) into `out` (see the module docstring); returns `out`."""
    T, H, P = x.shape
    G, N = C.shape[1], C.shape[2]
    NC = chunk_len.numel()
    if NC == 0:
        return out
    cs = dt_out.shape[2]
    bm = block_m or default_block(cs)
    bp = block_p or default_block(P)
    bk = block_k or default_block(cs)
    bn = block_n or default_block(N)
    DOT, PREC = dot_types(x.dtype, compute_dtype)
    CD = tl.float64 if compute_dtype == torch.float64 else tl.float32
    if D is not None:
        sDh, sDp = (D.stride(0), 0) if D.dim() == 1 else (D.stride(0), D.stride(1))
    else:
        sDh, sDp = 0, 0
    zz = z if z is not None else x
    grid = (NC, H, cdiv(cs, bm) * cdiv(P, bp))
    _chunk_scan_kernel[grid](
        x, zz, C, D if D is not None else x, out, cb, dt_out, dA_cs, prev_states, chunk_start, chunk_len,
        P, N, H // G, cs,
        x.stride(0), x.stride(1), x.stride(2), zz.stride(0), zz.stride(1), zz.stride(2),
        out.stride(0), out.stride(1), out.stride(2), C.stride(0), C.stride(1), C.stride(2),
        sDh, sDp, *cb.stride(), dt_out.stride(0), dt_out.stride(1), *prev_states.stride(),
        CD=CD, DOT=DOT, PREC=PREC, HAS_D=D is not None, HAS_Z=z is not None,
        BLOCK_M=bm, BLOCK_P=bp, BLOCK_K=bk, BLOCK_N=bn, num_warps=num_warps, num_stages=num_stages)
    return out
