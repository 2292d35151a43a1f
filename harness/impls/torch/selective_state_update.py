"""Vectorized torch decode step (`selective_state_update`), Mamba-1 (Dm, N) and Mamba-2 (H, P, N) layouts."""
from __future__ import annotations

import torch

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.torch._util import (compute_dtype, emit, gather_init, scatter_final, silu, slots, softplus, up,
                                       zero_pad_rows)


def effective_dt(dt, dt_bias, dt_softplus, dt_limit, cd):
    d = dt.to(cd)
    if dt_bias is not None:
        d = d + dt_bias.to(cd)
    if dt_softplus:
        d = softplus(d)
    return d.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))


@provides("torch", "selective_state_update")
def selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
                           dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    layout = C.validate_selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices,
                                               dt_limit, pad_slot_id, out)
    cd = compute_dtype(x.dtype)
    idx, live, safe = slots(state_batch_indices, pad_slot_id)
    st = gather_init(state, safe, live, cd)
    d = effective_dt(dt, dt_bias, dt_softplus, dt_limit, cd)
    y, new = step(layout, st, d, up(x, cd), up(B, cd), up(Cm, cd), up(D, cd), up(z, cd), A.to(cd))
    scatter_final(state, idx, live, new)
    return emit(zero_pad_rows(y, live), x, out)


def step(layout, st, d, xs, Bc, Cc, Dc, zc, A):
    """One decode token per row in the compute dtype: (y, new_state) from the states `st` (rows first),
    the effective dt `d`, x, B, C, D, z, A (already cast)."""
    if layout[0] == "mamba1":
        Dm, G = layout[2], layout[4]
        Bg = Bc.repeat_interleave(Dm // G, dim=1)  # (rows, Dm, N)
        Cg = Cc.repeat_interleave(Dm // G, dim=1)
        new = torch.exp(d[:, :, None] * A) * st + (d * xs)[:, :, None] * Bg
        y = (new * Cg).sum(-1)
        if Dc is not None:
            y = y + Dc * xs
    else:
        H, G = layout[2], layout[5]
        Bh = Bc.repeat_interleave(H // G, dim=1)  # (rows, H, N)
        Ch = Cc.repeat_interleave(H // G, dim=1)
        dA = torch.exp(d * A)  # (rows, H)
        new = dA[:, :, None, None] * st + (d[:, :, None] * xs)[..., None] * Bh[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", new, Ch)
        if Dc is not None:
            y = y + (Dc[:, None] if Dc.dim() == 1 else Dc) * xs
    if zc is not None:
        y = y * silu(zc)
    return y, new
