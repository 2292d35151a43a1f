"""Mamba-1 selective scan (full-rank A of shape (Dm, N)), as a plain loop over tokens.

Per channel d and state index n, with dt = delta (+ delta_bias) (then softplus if asked):

    h_t[d, n] = exp(dt_t[d] * A[d, n]) * h_{t-1}[d, n] + dt_t[d] * B_t[g(d), n] * u_t[d]
    y_t[d]    = sum_n C_t[g(d), n] * h_t[d, n] + D[d] * u_t[d]
    y_t[d]   *= silu(z_t[d])                      (when z is given)

B and C are (T, G, N) with G groups of channels, channel d in group g(d) = d // (Dm // G) (contiguous
blocks), or (T, N) meaning G = 1.
"""
from __future__ import annotations

import torch

from reference._common import check_float, check_same_device, sequences, silu, softplus, start_state
from reference.validate import check_divides, check_same_dtype, fail

__all__ = ["selective_scan", "selective_state_update"]


def _check_bc(name: str, t, lead: int, N: int | None, Dm: int, lead_name: str) -> tuple[int, int]:
    """B or C: (lead, G, N) or (lead, N). Returns (G, N)."""
    check_float(name, t)
    if t.dim() == 2:
        t_shape = (t.shape[0], 1, t.shape[1])
    elif t.dim() == 3:
        t_shape = tuple(t.shape)
    else:
        fail(name, f"shape ({lead_name}, G, N) or ({lead_name}, N)", f"shape {tuple(t.shape)}")
    if t_shape[0] != lead:
        fail(name, f"dim 0 = {lead} ({lead_name})", f"shape {tuple(t.shape)}")
    if N is not None and t_shape[2] != N:
        fail(name, f"last dim = N = {N} (state size of A)", f"shape {tuple(t.shape)}")
    check_divides(name, t_shape[1], "the channel count Dm (groups of B/C)", Dm)
    return t_shape[1], t_shape[2]


def _per_channel(bc_row: torch.Tensor, Dm: int) -> torch.Tensor:
    """One row of B or C, (G, N) (or (N,) meaning G = 1) -> (Dm, N)."""
    if bc_row.dim() == 1:
        bc_row = bc_row.unsqueeze(0)
    G = bc_row.shape[0]
    return bc_row.repeat_interleave(Dm // G, dim=0)


def selective_scan(u, delta, A, B, C, D=None, z=None, *, delta_bias=None, delta_softplus=False,
                   cu_seqlens=None, initial_states=None):
    """Mamba-1 selective scan over packed sequences.

    Args:
        u, delta: (T, Dm). z: (T, Dm) or None (output gate y *= silu(z)).
        A: (Dm, N). B, C: (T, G, N) with G | Dm, or (T, N) meaning G = 1.
        D: (Dm,) skip or None. delta_bias: (Dm,) or None. delta_softplus: apply softplus to dt.
        cu_seqlens: int (S+1,) offsets or None. initial_states: (S, Dm, N) or None (zeros).

    Returns:
        (y, final_states): y (T, Dm); final_states (S, Dm, N).
    """
    check_float("u", u, ndim=2)
    T, Dm = u.shape
    check_float("delta", delta, shape=(T, Dm))
    check_float("A", A, ndim=2)
    if A.shape[0] != Dm:
        fail("A", f"shape (Dm, N) with Dm = {Dm} (channels of u)", f"shape {tuple(A.shape)}")
    N = A.shape[1]
    _check_bc("B", B, T, N, Dm, "T")
    _check_bc("C", C, T, N, Dm, "T")
    if C.shape != B.shape:
        fail("C", f"the shape of B {tuple(B.shape)}", f"shape {tuple(C.shape)}")
    check_float("D", D, shape=(Dm,), optional=True)
    check_float("z", z, shape=(T, Dm), optional=True)
    check_float("delta_bias", delta_bias, shape=(Dm,), optional=True)
    seqs = sequences(cu_seqlens, T)
    S = len(seqs)
    check_float("initial_states", initial_states, shape=(S, Dm, N), optional=True)
    tensors = dict(delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias, initial_states=initial_states)
    check_same_dtype(u=u, **tensors)
    check_same_device("u", u, **tensors)

    y = torch.empty_like(u)
    final_states = torch.empty((S, Dm, N), dtype=u.dtype, device=u.device)
    for s, (start, end) in enumerate(seqs):
        h = start_state(initial_states, s, (Dm, N), u)
        for t in range(start, end):
            dt = delta[t] if delta_bias is None else delta[t] + delta_bias
            if delta_softplus:
                dt = softplus(dt)
            Bt = _per_channel(B[t], Dm)
            Ct = _per_channel(C[t], Dm)
            h = torch.exp(dt[:, None] * A) * h + (dt * u[t])[:, None] * Bt
            yt = (h * Ct).sum(dim=-1)
            if D is not None:
                yt = yt + D * u[t]
            if z is not None:
                yt = yt * silu(z[t])
            y[t] = yt
        final_states[s] = h
    return y, final_states


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, *, dt_bias=None, dt_softplus=False):
    """One Mamba-1 decode step for a batch of sequences (state is not modified).

    Args:
        state: (Bsz, Dm, N). x, dt: (Bsz, Dm). z: (Bsz, Dm) or None.
        A: (Dm, N). B, C: (Bsz, G, N) with G | Dm, or (Bsz, N) meaning G = 1.
        D: (Dm,) or None. dt_bias: (Dm,) or None. dt_softplus: apply softplus to dt.

    Returns:
        (y, new_state): y (Bsz, Dm); new_state (Bsz, Dm, N).
    """
    check_float("state", state, ndim=3)
    Bsz, Dm, N = state.shape
    check_float("x", x, shape=(Bsz, Dm))
    check_float("dt", dt, shape=(Bsz, Dm))
    check_float("A", A, shape=(Dm, N))
    G, _ = _check_bc("B", B, Bsz, N, Dm, "batch")
    _check_bc("C", C, Bsz, N, Dm, "batch")
    if C.shape != B.shape:
        fail("C", f"the shape of B {tuple(B.shape)}", f"shape {tuple(C.shape)}")
    check_float("D", D, shape=(Dm,), optional=True)
    check_float("z", z, shape=(Bsz, Dm), optional=True)
    check_float("dt_bias", dt_bias, shape=(Dm,), optional=True)
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    check_same_dtype(state=state, **tensors)
    check_same_device("state", state, **tensors)

    Bg = B.reshape(Bsz, G, N).repeat_interleave(Dm // G, dim=1)  # (Bsz, Dm, N)
    Cg = C.reshape(Bsz, G, N).repeat_interleave(Dm // G, dim=1)
    d = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        d = softplus(d)
    new_state = torch.exp(d[:, :, None] * A[None]) * state + (d * x)[:, :, None] * Bg
    y = (new_state * Cg).sum(dim=-1)
    if D is not None:
        y = y + D * x
    if z is not None:
        y = y * silu(z)
    return y, new_state
