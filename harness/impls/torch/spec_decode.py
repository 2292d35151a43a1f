"""Vectorized torch multi-token decode (speculative decoding): `selective_state_update_spec`,
`causal_conv1d_update_spec`, `gated_delta_rule_update_spec` and `kda_update_spec`.

All rows advance together, one position at a time (a loop over the num_spec + 1 positions, not over
tokens or rows): position j of every row that has a j-th token runs the one-token decode step, its state is
written to the row's slot j. Start states are gathered before anything is written. The state stays in the
compute dtype from position to position (only the per-position slots are rounded to the pool's dtype), as
serving kernels keep it in registers.
"""
from __future__ import annotations

import torch

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.torch import delta_rule as DR
from harness.impls.torch._util import compute_dtype, emit, gather_init, scatter_final, silu
from harness.impls.torch.selective_state_update import effective_dt, step


def _rows(query_start_loc, table, num_accepted_tokens, pad_slot_id):
    """(start, lens, table int64, live rows, safe start slots): a row is live when it has tokens and its
    start slot table[b, num_accepted_tokens[b] - 1] is not the pad id."""
    q = query_start_loc.to(torch.int64)
    start, lens = q[:-1], q[1:] - q[:-1]
    tab = table.to(torch.int64)
    first = (num_accepted_tokens.to(torch.int64) - 1).clamp(0, tab.shape[1] - 1)
    init = tab.gather(1, first[:, None])[:, 0]
    live = (lens > 0) & (init != pad_slot_id)
    return start, lens, tab, live, torch.where(live, init, torch.zeros_like(init))


def _positions(pool, x, query_start_loc, table, num_accepted_tokens, pad_slot_id, cd, advance):
    """Run `advance(h, tok) -> (y_rows, new_h)` for every position; returns y (T, ...) in `cd`."""
    T = x.shape[0]
    start, lens, tab, live, safe = _rows(query_start_loc, table, num_accepted_tokens, pad_slot_id)
    h = gather_init(pool, safe, live, cd)
    y = torch.zeros((T + 1,) + tuple(x.shape[1:]), dtype=cd, device=x.device)  # row T: sink of idle rows
    if T == 0:
        return y[:T]
    for j in range(tab.shape[1]):
        valid = live & (lens > j)
        tok = torch.where(valid, start + j, torch.zeros_like(start))
        yj, new = advance(h, tok)
        keep = valid.reshape((-1,) + (1,) * (new.dim() - 1))
        h = torch.where(keep, new, h)
        y.index_copy_(0, torch.where(valid, tok, torch.full_like(tok, T)), yj)
        slot = tab[:, j]
        scatter_final(pool, slot, valid & (slot != pad_slot_id), h)
    return y[:T]


@provides("torch", "selective_state_update_spec")
def selective_state_update_spec(state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc, state_batch_indices,
                                num_accepted_tokens, *, dt_softplus=True, dt_limit=(0.0, C.INF),
                                pad_slot_id=C.PAD_SLOT_ID, out=None):
    lay = C.validate_selective_state_update_spec(state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc,
                                                 state_batch_indices, num_accepted_tokens, dt_limit, pad_slot_id, out)
    cd = compute_dtype(x.dtype)
    layout = lay[:-2]
    d = effective_dt(dt, dt_bias, dt_softplus, dt_limit, cd)
    xs, Bc, Cc, zc = x.to(cd), B.to(cd), Cm.to(cd), None if z is None else z.to(cd)
    Dc, Ac = None if D is None else D.to(cd), A.to(cd)

    def advance(h, tok):
        return step(layout, h, d[tok], xs[tok], Bc[tok], Cc[tok], Dc, None if zc is None else zc[tok], Ac)

    y = _positions(state, x, query_start_loc, state_batch_indices, num_accepted_tokens, pad_slot_id, cd, advance)
    return emit(y, x, out)


@provides("torch", "causal_conv1d_update_spec")
def causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens,
                              *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices,
                                         num_accepted_tokens, activation, pad_slot_id, out)
    cd = compute_dtype(x.dtype)
    xs, w = x.to(cd), weight.to(cd)
    bc = None if bias is None else bias.to(cd)

    def advance(h, tok):
        win = torch.cat([h, xs[tok][:, :, None]], dim=2)  # (Bsz, D, K), oldest first
        yj = (win * w).sum(-1)
        if bc is not None:
            yj = yj + bc
        if activation in ("silu", "swish"):
            yj = silu(yj)
        return yj, win[:, :, 1:]

    y = _positions(conv_states, x, query_start_loc, conv_state_indices, num_accepted_tokens, pad_slot_id, cd,
                   advance)
    return emit(y, x, out)


_VALIDATE_DELTA = {"gdn": C.validate_gated_delta_rule_update_spec, "kda": C.validate_kda_update_spec}


def _delta_spec(kind, q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale,
                use_qk_l2norm, pad_slot_id, out):
    _, Hk, H = _VALIDATE_DELTA[kind](q, k, v, g, beta, ssm_states, query_start_loc, state_indices,
                                     num_accepted_tokens, scale, use_qk_l2norm, pad_slot_id, out)[:3]
    cd = compute_dtype(q.dtype)
    qp, kp = DR._prep_qk(q, k, scale, use_qk_l2norm, H // Hk, cd)
    vs, gs, bs = v.to(cd), g.to(cd), beta.to(cd)

    def advance(h, tok):
        return DR.step(kind, h, qp[tok], kp[tok], vs[tok], gs[tok], bs[tok])

    y = _positions(ssm_states, v, query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, cd, advance)
    return emit(y, v, out)


@provides("torch", "gated_delta_rule_update_spec")
def gated_delta_rule_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                                 *, scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _delta_spec("gdn", q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                       scale, use_qk_l2norm, pad_slot_id, out)


@provides("torch", "kda_update_spec")
def kda_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, *, scale=None,
                    use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _delta_spec("kda", q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                       scale, use_qk_l2norm, pad_slot_id, out)
