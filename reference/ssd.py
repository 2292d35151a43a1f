"""Mamba-2 SSD (state-space duality): scalar A per head, H heads x P head_dim, state (H, P, N).

With dt = softplus(dt + dt_bias) (or dt + dt_bias without softplus), clamped to dt_limit:

    h_t = exp(dt_t[h] * A[h]) * h_{t-1} + dt_t[h] * x_t[h, :] (outer) B_t[g(h), :]     (P x N per head)
    y_t = h_t @ C_t[g(h), :] + D * x_t                                                 (P per head)
    y_t *= silu(z_t)                                                                   (when z is given)

B and C are (T, G, N); head h reads group g(h) = h // (H // G) (`repeat_interleave` of groups to heads,
so with G = 2 and H = 4 heads 0, 1 read group 0). D is (H,) or (H, P).

Two independent formulations, so that each checks the other:
  * `ssd_scan`: the recurrence above, one token at a time;
  * `ssd_chunked`: the chunked "SSD minimal" form - within a chunk the output is a masked,
    decay-weighted attention-like product (C B^T) * L with L[i, j] = exp(sum_{k=j+1..i} dt_k A)
    built from segment sums (-inf above the diagonal, so exp gives exact zeros), plus the carried
    state's contribution; states are passed from chunk to chunk. The chunk grid restarts at every
    sequence start; the last chunk of a sequence may be shorter.
"""
from __future__ import annotations

import torch

from reference._common import (check_dt_limit, check_float, check_same_device, sequences, silu,
                               softplus, start_state)
from reference.validate import check_divides, check_same_dtype, fail

__all__ = ["ssd_scan", "ssd_chunked", "ssd_state_update"]

_NO_LIMIT = (0.0, float("inf"))


def _check_bc(B, C, lead: int, H: int, lead_name: str) -> tuple[int, int]:
    check_float("B", B, ndim=3)
    G, N = B.shape[1], B.shape[2]
    if B.shape[0] != lead:
        fail("B", f"shape ({lead_name}, G, N) with {lead_name} = {lead}", f"shape {tuple(B.shape)}")
    check_divides("B", G, "the head count H (B is (.., G, N), G = n_groups)", H)
    check_float("C", C, ndim=3)
    if C.shape != B.shape:
        fail("C", f"the shape of B {tuple(B.shape)}", f"shape {tuple(C.shape)}")
    return G, N


def _check_D(D, H: int, P: int) -> None:
    check_float("D", D, optional=True)
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        fail("D", f"shape ({H},) or ({H}, {P}) (per head or per head x head_dim)", f"shape {tuple(D.shape)}")


def _dt(dt, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    """The effective step size: dt (+ dt_bias), softplus if asked, clamped to dt_limit (always)."""
    lo, hi = dt_limit
    d = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        d = softplus(d)
    return d.clamp(min=lo, max=hi)


def _skip_and_gate(y, x, D, z):
    """y + D * x (D per head (H,) or per head x dim (H, P)), then * silu(z)."""
    if D is not None:
        y = y + (D[:, None] if D.dim() == 1 else D) * x
    if z is not None:
        y = y * silu(z)
    return y


def _check_ssd(x, dt, A, B, C, D, z, dt_bias, dt_limit, cu_seqlens, initial_states):
    check_float("x", x, ndim=3)
    T, H, P = x.shape
    check_float("dt", dt, shape=(T, H))
    check_float("A", A, shape=(H,))
    G, N = _check_bc(B, C, T, H, "T")
    _check_D(D, H, P)
    check_float("z", z, shape=(T, H, P), optional=True)
    check_float("dt_bias", dt_bias, shape=(H,), optional=True)
    limit = check_dt_limit(dt_limit)
    seqs = sequences(cu_seqlens, T)
    check_float("initial_states", initial_states, shape=(len(seqs), H, P, N), optional=True)
    tensors = dict(dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)
    check_same_dtype(x=x, **tensors)
    check_same_device("x", x, **tensors)
    return (T, H, P, G, N), limit, seqs


def ssd_scan(x, dt, A, B, C, D=None, z=None, *, dt_bias=None, dt_softplus=True,
             dt_limit=_NO_LIMIT, cu_seqlens=None, initial_states=None):
    """Mamba-2 SSD as the plain recurrence, one token at a time.

    Args:
        x: (T, H, P). dt: (T, H). A: (H,). B, C: (T, G, N) with G | H.
        D: (H,), (H, P) or None. z: (T, H, P) or None. dt_bias: (H,) or None.
        dt_softplus: softplus(dt + dt_bias). dt_limit: (lo, hi) clamp of the effective dt.
        cu_seqlens: int (S+1,) offsets or None. initial_states: (S, H, P, N) or None (zeros).

    Returns:
        (y, final_states): y (T, H, P); final_states (S, H, P, N).
    """
    (T, H, P, G, N), limit, seqs = _check_ssd(x, dt, A, B, C, D, z, dt_bias, dt_limit, cu_seqlens,
                                               initial_states)
    dts = _dt(dt, dt_bias, dt_softplus, limit)  # (T, H)
    heads_per_group = H // G
    y = torch.empty_like(x)
    final_states = torch.empty((len(seqs), H, P, N), dtype=x.dtype, device=x.device)
    for s, (start, end) in enumerate(seqs):
        h = start_state(initial_states, s, (H, P, N), x)
        for t in range(start, end):
            Bt = B[t].repeat_interleave(heads_per_group, dim=0)  # (H, N)
            Ct = C[t].repeat_interleave(heads_per_group, dim=0)
            decay = torch.exp(dts[t] * A)  # (H,)
            h = decay[:, None, None] * h + (dts[t][:, None] * x[t])[:, :, None] * Bt[:, None, :]
            yt = (h * Ct[:, None, :]).sum(dim=-1)  # (H, P)
            y[t] = _skip_and_gate(yt, x[t], D, None if z is None else z[t])
        final_states[s] = h
    return y, final_states


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Segment sums of `a` (..., L) -> (..., L, L): out[..., i, j] = sum_{k=j+1}^{i} a[..., k] for i >= j
    (0 on the diagonal) and -inf for i < j, so that exp(out) is the causal decay matrix with exact
    zeros above the diagonal. Built by masked cumulative sums (no differences of large prefix sums)."""
    L = a.shape[-1]
    rep = a.unsqueeze(-1).expand(*a.shape, L)  # rep[..., k, j] = a[..., k]
    strictly_below = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    rep = rep.masked_fill(~strictly_below, 0)  # keep a[k] only where k > j
    out = torch.cumsum(rep, dim=-2)  # out[..., i, j] = sum_{j < k <= i} a[k]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~causal, float("-inf"))


def _ssd_chunk(x, dt, A, B, C, h):
    """One chunk of one sequence. x (l, H, P), dt (l, H), A (H,), B, C (l, H, N) already per head,
    h (H, P, N) the state before the chunk. Returns (y (l, H, P), state after the chunk)."""
    a = (dt * A).transpose(0, 1)  # (H, l): log-decay of each token
    seg = segsum(a)  # (H, l, l)
    decay = torch.exp(seg)  # causal decay matrix, exact zeros above the diagonal
    # Intra-chunk ("diagonal block"): y_i = sum_{j <= i} (C_i . B_j) * decay[i, j] * dt_j * x_j
    scores = torch.einsum("ihn,jhn->hij", C, B) * decay
    y_diag = torch.einsum("hij,jh,jhp->ihp", scores, dt, x)
    # Contribution of the carried state: y_i += exp(sum_{k<=i} a_k) * C_i . h
    prefix = torch.cumsum(a, dim=-1)  # (H, l)
    y_state = torch.einsum("ihn,hpn->ihp", C, h) * torch.exp(prefix).transpose(0, 1)[:, :, None]
    # State after the chunk: decayed old state + each token's contribution decayed to the chunk end.
    to_end = torch.exp(seg[:, -1, :])  # (H, l): exp(sum_{k=j+1}^{l-1} a_k)
    h_new = torch.exp(prefix[:, -1])[:, None, None] * h + torch.einsum("hj,jh,jhp,jhn->hpn", to_end, dt, x, B)
    return y_diag + y_state, h_new


def ssd_chunked(x, dt, A, B, C, D=None, z=None, *, dt_bias=None, dt_softplus=True,
                dt_limit=_NO_LIMIT, cu_seqlens=None, initial_states=None, chunk_size=64):
    """Mamba-2 SSD in the chunked form (see the module docstring); same contract as `ssd_scan`.

    `chunk_size` (positive int) only changes how the work is split; the chunk grid starts at each
    sequence's first token.
    """
    (T, H, P, G, N), limit, seqs = _check_ssd(x, dt, A, B, C, D, z, dt_bias, dt_limit, cu_seqlens,
                                               initial_states)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        fail("chunk_size", "a positive int", repr(chunk_size))
    dts = _dt(dt, dt_bias, dt_softplus, limit)
    Bh = B.repeat_interleave(H // G, dim=1)  # (T, H, N)
    Ch = C.repeat_interleave(H // G, dim=1)
    y = torch.empty_like(x)
    final_states = torch.empty((len(seqs), H, P, N), dtype=x.dtype, device=x.device)
    for s, (start, end) in enumerate(seqs):
        h = start_state(initial_states, s, (H, P, N), x)
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            yc, h = _ssd_chunk(x[c0:c1], dts[c0:c1], A, Bh[c0:c1], Ch[c0:c1], h)
            y[c0:c1] = _skip_and_gate(yc, x[c0:c1], D, None if z is None else z[c0:c1])
        final_states[s] = h
    return y, final_states


def ssd_state_update(state, x, dt, A, B, C, D=None, z=None, *, dt_bias=None, dt_softplus=True,
                     dt_limit=_NO_LIMIT):
    """One Mamba-2 decode step for a batch of sequences (state is not modified).

    Args:
        state: (Bsz, H, P, N). x: (Bsz, H, P). dt: (Bsz, H). A: (H,). B, C: (Bsz, G, N), G | H.
        D: (H,), (H, P) or None. z: (Bsz, H, P) or None. dt_bias: (H,) or None.

    Returns:
        (y, new_state): y (Bsz, H, P); new_state (Bsz, H, P, N).
    """
    check_float("state", state, ndim=4)
    Bsz, H, P, N = state.shape
    check_float("x", x, shape=(Bsz, H, P))
    check_float("dt", dt, shape=(Bsz, H))
    check_float("A", A, shape=(H,))
    G, NB = _check_bc(B, C, Bsz, H, "batch")
    if NB != N:
        fail("B", f"last dim = N = {N} (state size of state)", f"shape {tuple(B.shape)}")
    _check_D(D, H, P)
    check_float("z", z, shape=(Bsz, H, P), optional=True)
    check_float("dt_bias", dt_bias, shape=(H,), optional=True)
    limit = check_dt_limit(dt_limit)
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    check_same_dtype(state=state, **tensors)
    check_same_device("state", state, **tensors)

    d = _dt(dt, dt_bias, dt_softplus, limit)  # (Bsz, H)
    Bh = B.repeat_interleave(H // G, dim=1)  # (Bsz, H, N)
    Ch = C.repeat_interleave(H // G, dim=1)
    new_state = (torch.exp(d * A)[:, :, None, None] * state
                 + (d[:, :, None] * x)[:, :, :, None] * Bh[:, :, None, :])
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    return _skip_and_gate(y, x, D, z), new_state
