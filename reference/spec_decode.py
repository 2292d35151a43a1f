"""Multi-token decode for speculative decoding: several draft tokens per row, per-position state slots.

With speculative decoding a decode row carries up to ``num_spec + 1`` tokens (the last verified token
and ``num_spec`` drafts). Every position's state is kept, so that the next step can resume from the state
after whichever position turns out to be the last accepted one. Layout (vLLM's, with one slot table
for reading and writing):

* ``x`` and every per-token tensor are token-major and packed over the rows: ``query_start_loc``
  (int, (Bsz+1,), starts at 0, non-decreasing, ends at T) gives row b the tokens
  ``[query_start_loc[b], query_start_loc[b+1])``, ``T_b <= S`` of them, where ``S = num_spec + 1``.
* ``state_indices`` (int, (Bsz, S)): ``state_indices[b, j]`` is the pool slot that receives row b's state
  after its position j (j < T_b); an entry equal to ``pad_slot_id`` is not written. Live slot ids are
  distinct over the whole table (a request owns its ``S`` slots; ``reference.cache.slots_needed``).
* ``num_accepted_tokens`` (int, (Bsz,), each in 1..S): how many positions of the row's previous step
  were accepted. The row starts from the state in slot ``state_indices[b, num_accepted_tokens[b] - 1]``
  (the state after the last accepted token). A row with no tokens, or whose initial slot is
  ``pad_slot_id``, is padding: nothing of it is read or written, and its output rows are zero
  (``reference.pads``).
* Every read happens before any write: a row may write position j's state into the slot it started
  from. Slots not written (including a start slot at a position >= T_b, and every slot the table does
  not name) keep their contents.

Token t of a row is exactly one plain decode step (`selective_state_update`, `ssd_state_update`,
`causal_conv1d_update`, `gated_delta_rule_update`, `kda_update`) applied to the state after token t-1, so running a step, accepting ``a`` tokens
and running the next step from slot ``a - 1`` is the same as plain one-token decoding over the accepted
tokens. The conv state of a position is its own slot (the last K-1 inputs up to that token); vLLM instead
keeps one conv slot of ``K - 1 + num_spec`` columns and slides a window over it -- the same values, laid
out differently.

The pools here are returned updated as new tensors; the inputs are not modified.
"""
from __future__ import annotations

import math

import torch

from reference._common import check_dt_limit, check_float, softplus
from reference.conv1d import causal_conv1d_update
from reference.delta_rule import UPDATES as DELTA_UPDATES
from reference.selective_scan import selective_state_update
from reference.ssd import ssd_state_update
from reference.validate import check_cu_seqlens, check_tensor, fail

__all__ = ["spec_rows", "written_slots", "spec_state_update", "spec_conv1d_update", "spec_delta_rule_update"]


def spec_rows(query_start_loc, state_indices, num_accepted_tokens, num_tokens: int, num_slots: int,
              pad_slot_id: int = -1, indices_arg: str = "state_indices") -> list[tuple[int, int, int, list[int]]]:
    """Validate the speculative-decode layout (see the module docstring) and return, per row,
    (start, end, initial slot or pad_slot_id for a padding row, the row's S slot ids). Errors about the
    slot table name it `indices_arg`."""
    check_tensor(indices_arg, state_indices, ndim=2, floating=False)
    Bsz, S = state_indices.shape
    if S < 1:
        fail(indices_arg, "shape (Bsz, num_spec + 1) with num_spec + 1 >= 1", f"shape {tuple(state_indices.shape)}")
    check_tensor("query_start_loc", query_start_loc, shape=(Bsz + 1,), floating=False)
    check_tensor("num_accepted_tokens", num_accepted_tokens, shape=(Bsz,), floating=False)
    cu = check_cu_seqlens(query_start_loc, num_tokens, "query_start_loc").tolist()
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if any(n > S for n in lens):
        fail("query_start_loc", f"rows of at most num_spec + 1 = {S} tokens ({indices_arg}.shape[1])",
             f"row lengths {lens}")
    acc = num_accepted_tokens.detach().to("cpu", torch.int64).tolist()
    bad = [a for a in acc if not 1 <= a <= S]
    if bad:
        fail("num_accepted_tokens", f"counts in 1..{S} (num_spec + 1)", acc)
    idx = state_indices.detach().to("cpu", torch.int64).tolist()
    flat = [s for row in idx for s in row]
    out_of_pool = [s for s in flat if s != pad_slot_id and not 0 <= s < num_slots]
    if out_of_pool:
        fail(indices_arg, f"slot ids in [0, {num_slots}) or pad_slot_id={pad_slot_id}", out_of_pool)
    live = [s for s in flat if s != pad_slot_id]
    if len(live) != len(set(live)):
        fail(indices_arg, "distinct slot ids for live entries (over the whole table)", idx)
    rows = []
    for b in range(Bsz):
        init = idx[b][acc[b] - 1] if lens[b] > 0 else pad_slot_id
        rows.append((cu[b], cu[b + 1], init, idx[b]))
    return rows


def written_slots(rows, pad_slot_id: int = -1) -> list[int]:
    """The slots a step writes: each live row's slot of every position it has a token for."""
    return [slots[j] for start, end, init, slots in rows if init != pad_slot_id
            for j in range(end - start) if slots[j] != pad_slot_id]


def _run(pool, rows, pad_slot_id, y, step):
    """Apply `step(h, t) -> (y_t, h)` token by token from each live row's initial slot; the state after
    position j goes to the row's slot j. Reads come from `pool` (unchanged); writes go to the copy returned."""
    new = pool.clone()
    for start, end, init, slots in rows:
        if init == pad_slot_id:
            continue
        h = pool[init].clone()
        for j, t in enumerate(range(start, end)):
            y[t], h = step(h, t)
            if slots[j] != pad_slot_id:
                new[slots[j]] = h
    return new


def spec_state_update(state, x, dt, A, B, C, D=None, z=None, *, dt_bias=None, dt_softplus=True,
                      dt_limit=(0.0, math.inf), query_start_loc, state_indices, num_accepted_tokens,
                      pad_slot_id=-1):
    """Multi-token Mamba-1 / Mamba-2 decode (layout by state.dim(), as `selective_state_update` /
    `ssd_state_update` take it, with the batch dim replaced by the packed tokens).

    Args:
        state: pool (num_slots, Dm, N) (Mamba-1) or (num_slots, H, P, N) (Mamba-2).
        x, dt, B, C, z: per token (T, ...). dt is clamped to dt_limit after bias and softplus.
        query_start_loc, state_indices, num_accepted_tokens, pad_slot_id: see the module docstring.

    Returns:
        (y, new_state): y (T, ...) like x; new_state the pool after the step (a new tensor).
    """
    check_float("state", state)
    check_float("x", x)
    lo, hi = check_dt_limit(dt_limit)
    rows = spec_rows(query_start_loc, state_indices, num_accepted_tokens, x.shape[0], state.shape[0], pad_slot_id)
    y = torch.zeros_like(x)
    one = lambda t, v: None if v is None else v[t:t + 1]  # noqa: E731

    if state.dim() == 3:
        def step(h, t):
            d = dt[t:t + 1] if dt_bias is None else dt[t:t + 1] + dt_bias
            if dt_softplus:
                d = softplus(d)
            yt, h1 = selective_state_update(h[None], x[t:t + 1], d.clamp(lo, hi), A, one(t, B), one(t, C), D,
                                            one(t, z))
            return yt[0], h1[0]
    elif state.dim() == 4:
        def step(h, t):
            yt, h1 = ssd_state_update(h[None], x[t:t + 1], dt[t:t + 1], A, one(t, B), one(t, C), D, one(t, z),
                                      dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=(lo, hi))
            return yt[0], h1[0]
    else:
        fail("state", "a pool (num_slots, Dm, N) or (num_slots, H, P, N)", f"shape {tuple(state.shape)}")
    return y, _run(state, rows, pad_slot_id, y, step)


def spec_conv1d_update(x, conv_states, weight, bias=None, *, activation=None, query_start_loc, state_indices,
                       num_accepted_tokens, pad_slot_id=-1):
    """Multi-token causal conv1d decode.

    Args:
        x: (T, D) packed tokens. conv_states: pool (num_slots, D, K-1), oldest input first.
        weight: (D, K); bias: (D,) or None; activation: None or "silu".
        query_start_loc, state_indices, num_accepted_tokens, pad_slot_id: see the module docstring.

    Returns:
        (y, new_conv_states): y (T, D); the pool after the step (a new tensor); slot j of a row holds the
        last K-1 inputs up to and including the row's token j.
    """
    check_float("x", x, ndim=2)
    check_float("conv_states", conv_states, ndim=3)
    rows = spec_rows(query_start_loc, state_indices, num_accepted_tokens, x.shape[0], conv_states.shape[0],
                     pad_slot_id)
    y = torch.zeros_like(x)

    def step(h, t):
        yt, h1 = causal_conv1d_update(x[t:t + 1], h[None], weight, bias, activation=activation)
        return yt[0], h1[0]

    return y, _run(conv_states, rows, pad_slot_id, y, step)


def spec_delta_rule_update(kind: str, q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False, query_start_loc,
                           state_indices, num_accepted_tokens, pad_slot_id=-1):
    """Multi-token Gated DeltaNet or KDA decode (`kind`: a key of reference.delta_rule.UPDATES).

    Args:
        q, k: (T, Hk, K); v: (T, Hv, V); g: (T, Hv) (GDN) or (T, H, K) (KDA); beta: (T, Hv) -- packed tokens.
        state: pool (num_slots, Hv, V, K), value-major.
        scale, use_qk_l2norm: as `gated_delta_rule_update` / `kda_update`.
        query_start_loc, state_indices, num_accepted_tokens, pad_slot_id: see the module docstring.

    Returns:
        (o, new_state): o (T, Hv, V) like v; new_state the pool after the step (a new tensor).
    """
    update = DELTA_UPDATES.get(kind)
    if update is None:
        fail("kind", f"one of {sorted(DELTA_UPDATES)}", repr(kind))
    check_float("state", state, ndim=4)
    check_float("v", v, ndim=3)
    rows = spec_rows(query_start_loc, state_indices, num_accepted_tokens, v.shape[0], state.shape[0], pad_slot_id)
    o = torch.zeros_like(v)

    def step(h, t):
        ot, h1 = update(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], h[None], scale=scale,
                        use_qk_l2norm=use_qk_l2norm)
        return ot[0], h1[0]

    return o, _run(state, rows, pad_slot_id, o, step)
