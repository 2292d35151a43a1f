"""Vectorized torch Mamba-1 selective scan over packed sequences (`selective_scan_varlen`).

Sequences are padded to a (S, Lpad) grid (pad positions get log-decay 0, dt = 0 and zero inputs: no
decay, no input, so a sequence's state stays put past its end) and processed all at once, chunk by
chunk. Pad positions read token 0 (any request's); their values are replaced with torch.where, never
multiplied by a zero mask, so a non-finite value in one request cannot reach another (0 * NaN = NaN).
Inside a chunk of Lc tokens the recurrence is evaluated in closed (segment-sum) form, with the
per-token log-decay a_r = dt_r A (exact for dt_r A = -inf too: no 0 * inf at pad positions):

    cum_t      = sum_{r <= t} a_r                        (from the chunk start)
    seg[t, s]  = sum_{s < r <= t} a_r                    (a masked cumsum: no cancellation)
    y_t[d]     = sum_n C_t[n] (exp(cum_t[d,n]) h0[d,n] + sum_{s<=t} exp(seg[t,s,d,n]) dt_s u_s B_s[n])
    h_end      = exp(cum_L) h0 + sum_s exp(seg[L-1, s]) dt_s u_s B_s

so the Python loop runs over chunks, never over tokens. Lc is chosen so the (S, Lc, Lc, Dm, N) decay
tensor stays within a fixed element budget.
"""
from __future__ import annotations

import math

import torch

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.torch._util import (compute_dtype, emit, gather_init, padded_rows, scatter_final, silu, slots,
                                       softplus, token_live, zero_pad_rows)

ELEMENT_BUDGET = 1 << 22
MAX_CHUNK = 64


def _chunk_len(S, Dm, N):
    return max(1, min(MAX_CHUNK, int(math.sqrt(ELEMENT_BUDGET / max(1, S * Dm * N)))))


@provides("torch", "selective_scan_varlen")
def selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                          has_initial_state, *, delta_softplus=True, pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, Dm, N, G, S = C.validate_selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states,
                                                      query_start_loc, cache_indices, has_initial_state,
                                                      pad_slot_id, out)
    cd = compute_dtype(u.dtype)
    dev = u.device
    if S == 0:
        return out if out is not None else torch.empty_like(u)
    idx, live, safe = slots(cache_indices, pad_slot_id)
    h = gather_init(ssm_states, safe, live & has_initial_state, cd)  # (S, Dm, N)
    q = query_start_loc.to(torch.int64)
    lens = (q[1:] - q[:-1])
    Lmax = int(lens.max()) if S else 0
    Lc = max(1, min(_chunk_len(S, Dm, N), Lmax))
    nchunks = -(-Lmax // Lc)
    Lpad = nchunks * Lc
    yp = None
    if Lpad > 0:
        pos = torch.arange(Lpad, device=dev)
        valid = pos[None, :] < lens[:, None]  # (S, Lpad)
        tok = (q[:-1, None] + pos[None, :]).clamp(max=max(T - 1, 0))
        dt = delta.to(cd)
        if delta_bias is not None:
            dt = dt + delta_bias.to(cd)
        if delta_softplus:
            dt = softplus(dt)
        zero = torch.zeros((), dtype=cd, device=dev)

        def gather(t):  # rows of `tok`, zeros (not another request's values) at padding positions
            return padded_rows(t, tok, valid, cd)

        dtp = gather(dt)  # (S, Lpad, Dm)
        xp = dtp * gather(u)  # dt * u
        cpg = Dm // G
        Bp = gather(B)  # (S, Lpad, G, N)
        Cp = gather(Cm)
        Af = A.to(cd)  # (Dm, N)
        yp = torch.empty((S, Lpad, Dm), dtype=cd, device=dev)
        tri = torch.tril(torch.ones(Lc, Lc, dtype=torch.bool, device=dev))  # [t, s]: s <= t
        strict = torch.tril(torch.ones(Lc, Lc, dtype=torch.bool, device=dev), diagonal=-1)  # [r, s]: s < r
        for c in range(nchunks):
            sl = slice(c * Lc, (c + 1) * Lc)
            xc = xp[:, sl]  # (S, Lc, Dm)
            ac = torch.where(valid[:, sl, None, None], dtp[:, sl, :, None] * Af, zero)  # (S, Lc, Dm, N)
            Bd = Bp[:, sl].repeat_interleave(cpg, dim=2)  # (S, Lc, Dm, N)
            Cd = Cp[:, sl].repeat_interleave(cpg, dim=2)
            cum = ac.cumsum(1)  # (S, Lc, Dm, N)
            # seg[t, s] = sum_{s < r <= t} a_r, as a cumsum over r of the masked a (dims: S, r|t, s, Dm, N)
            seg = torch.where(strict[None, :, :, None, None], ac[:, :, None], zero).cumsum(1)
            decay = torch.where(tri[None, :, :, None, None], torch.exp(seg), zero)  # (S, t, s, Dm, N)
            y_intra = ((Cd[:, :, None] * decay * Bd[:, None, :]).sum(-1) * xc[:, None, :, :]).sum(2)
            y_inter = (Cd * torch.exp(cum) * h[:, None]).sum(-1)
            yp[:, sl] = y_intra + y_inter
            tail = seg[:, -1]  # (S, Lc(s), Dm, N): sum_{s < r <= L-1} a_r
            h = torch.exp(cum[:, -1]) * h + (torch.exp(tail) * xc[..., None] * Bd).sum(1)
    y = torch.zeros((T, Dm), dtype=cd, device=dev)
    if yp is not None and T > 0:
        y[tok[valid]] = yp[valid]
    if D is not None:
        y = y + D.to(cd) * u.to(cd)
    if z is not None:
        y = y * silu(z.to(cd))
    scatter_final(ssm_states, idx, live, h)
    return emit(zero_pad_rows(y, token_live(q, live, T)), u, out)
