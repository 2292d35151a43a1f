"""Gated DeltaNet and KDA (ops `gated_delta_rule_varlen`, `gated_delta_rule_update`, `kda_varlen`,
`kda_update` of harness.ops), vectorized torch.

Prefill runs the chunked WY (UT-transform) form, device-agnostic, no per-token Python loop:

* chunk grid per sequence (harness.impls.torch.ssd.chunk_table): every chunk belongs to one sequence and
  the cumulative log-decay b restarts at each chunk; all chunks are gathered into a (num_chunks, Lc)
  grid whose padding has q = k = v = beta = g = 0, so it neither decays nor writes a state;
* per chunk, all at once: pairwise decays exp(b_t - b_j) (masked to the causal triangle before the exp,
  so strong decays give zeros, never inf * 0), the unit lower-triangular system
  (I + A) with A[t, j] = beta_t k_t . exp(b_t - b_j) k_j (j < t), and its solutions
  W = (I + A)^-1 beta (exp(b) k) and U0 = (I + A)^-1 beta v;
* state passing loops over the chunk position inside a sequence (at most max chunks per sequence
  steps), vectorized over sequences: with S the state before the chunk (value-major (V, K)),
  U = U0 - W S^T, o = (exp(b) q) S^T + (q . exp(b_t - b_j) k, j <= t) U,
  S <- S diag(exp(b_last)) + U^T (exp(b_last - b) k).

GDN's decay is a scalar per head (b of shape (.., Lc)); KDA's is per key channel, whose pairwise decays
(.., Lc, Lc, K) are built for a block of chunks at a time to bound memory. Decode is the recurrence for
one token, batched over rows. Computes in float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch

from harness.impls.registry import provides
from harness import ops as C
from harness.impls.torch._util import (chunk_grid, compute_dtype, emit, gather_init, padded_rows, scatter_final, slots,
                                       token_live, zero_pad_rows)
from harness.impls.torch.ssd import chunk_table
from harness.ops import PAD_SLOT_ID
from reference.delta_rule import L2NORM_EPS

__all__ = ["gated_delta_rule_varlen", "gated_delta_rule_update", "kda_varlen", "kda_update"]

CHUNK_SIZE = {"gdn": 64, "kda": 32}
_BLOCK_ELEMS = 1 << 24  # elements of one block of KDA's pairwise decays (nb, H, Lc, Lc, K)
_VALIDATE_VARLEN = {"gdn": C.validate_gated_delta_rule_varlen, "kda": C.validate_kda_varlen}
_VALIDATE_UPDATE = {"gdn": C.validate_gated_delta_rule_update, "kda": C.validate_kda_update}


def _prep_qk(q, k, scale, use_qk_l2norm, heads_per_key, cd):
    """q, k in the compute dtype: l2norm (optional), q * scale, heads repeated to the value heads."""
    q, k = q.to(cd), k.to(cd)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * (q.shape[-1] ** -0.5 if scale is None else float(scale))
    return q.repeat_interleave(heads_per_key, dim=1), k.repeat_interleave(heads_per_key, dim=1)


def _initial(pool, safe, use, cd):
    """Initial states per request (zeros where not `use`); a pool without slots holds none to read."""
    if pool.shape[0] == 0:
        return torch.zeros((safe.shape[0],) + tuple(pool.shape[1:]), dtype=cd, device=pool.device)
    return gather_init(pool, safe, use, cd)


def _pairwise(kind, qs, ks, b, causal):
    """(q_t . exp(b_t - b_j) k_j, k_t . exp(b_t - b_j) k_j) for j <= t, zero above: (nc, H, Lc, Lc) each.
    qs, ks (nc, H, Lc, K); b (nc, H, Lc) (GDN) or (nc, H, Lc, K) (KDA)."""
    if kind == "gdn":
        seg = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf"))
        decay = torch.exp(seg)
        return (qs @ ks.transpose(-1, -2)) * decay, (ks @ ks.transpose(-1, -2)) * decay
    nc, H, Lc, K = ks.shape
    qk = torch.empty((nc, H, Lc, Lc), dtype=ks.dtype, device=ks.device)
    kk = torch.empty_like(qk)
    nb = max(1, _BLOCK_ELEMS // max(1, H * Lc * Lc * K))
    for c0 in range(0, nc, nb):
        c = slice(c0, c0 + nb)
        seg = (b[c][:, :, :, None, :] - b[c][:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
        decay = torch.exp(seg)  # (nb, H, t, j, K)
        kj = ks[c][:, :, None, :, :] * decay
        qk[c] = torch.einsum("chtk,chtjk->chtj", qs[c], kj)
        kk[c] = torch.einsum("chtk,chtjk->chtj", ks[c], kj)
    return qk, kk


def _varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
            use_qk_l2norm, pad_slot_id, out):
    T, Hk, H, K, V, S = _VALIDATE_VARLEN[kind](q, k, v, g, beta, ssm_states, query_start_loc, cache_indices,
                                              has_initial_state, scale, use_qk_l2norm, pad_slot_id, out)
    dev = v.device
    cd = compute_dtype(q.dtype)
    idx, live, safe = slots(cache_indices, pad_slot_id)
    h = _initial(ssm_states, safe, live & has_initial_state, cd)  # (S, H, V, K)
    o = torch.zeros((T, H, V), dtype=cd, device=dev)
    starts, lens, seq, pos = chunk_table(query_start_loc, CHUNK_SIZE[kind])
    nc = len(starts)
    if nc:
        Lc = max(lens)
        _, tok, valid = chunk_grid(starts, lens, dev)  # (nc, Lc) each

        qp, kp = _prep_qk(q, k, scale, use_qk_l2norm, H // Hk, cd)

        def grid(t):  # (nc, H, Lc, ..): rows of `tok`, zeros (selected, not another request's values) at padding
            return padded_rows(t, tok, valid, cd).transpose(1, 2)
        qs, ks, vs = grid(qp), grid(kp), grid(v)
        bt = grid(beta)  # (nc, H, Lc)
        gs = grid(g)  # (nc, H, Lc) or (nc, H, Lc, K); 0 on padding: b stays flat there
        b = torch.cumsum(gs, dim=2)
        bk = b if kind == "kda" else b[..., None]  # broadcastable over K
        E = torch.exp(bk)  # (nc, H, Lc, K|1)
        last = bk[:, :, -1:]  # the cumulative decay at the chunk end (flat over padding)
        causal = torch.tril(torch.ones(Lc, Lc, dtype=torch.bool, device=dev))

        qk, kk = _pairwise(kind, qs, ks, b, causal)
        A = bt[..., :, None] * kk  # strictly lower part read by the solve (unit diagonal implied)
        rhs = torch.cat([bt[..., None] * E * ks, bt[..., None] * vs], dim=-1)
        sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        W, U0 = sol[..., :K], sol[..., K:]  # (nc, H, Lc, K), (nc, H, Lc, V)
        qE = qs * E
        k_to_end = ks * torch.exp(last - bk)  # (nc, H, Lc, K)
        decay_end = torch.exp(last[:, :, 0])  # (nc, H, K|1)

        seq_t = torch.tensor(seq, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        oc = torch.empty((nc, H, Lc, V), dtype=cd, device=dev)
        for p in range(max(pos) + 1):
            ck = (pos_t == p).nonzero().flatten()  # chunks at position p (one per sequence at most)
            sk = seq_t[ck]
            S0t = h[sk].transpose(-1, -2)  # (n, H, K, V)
            U = U0[ck] - W[ck] @ S0t
            oc[ck] = qE[ck] @ S0t + qk[ck] @ U
            h[sk] = h[sk] * decay_end[ck][:, :, None, :] + U.transpose(-1, -2) @ k_to_end[ck]
        o[tok[valid]] = oc.transpose(1, 2)[valid]

    scatter_final(ssm_states, idx, live, h)
    return emit(zero_pad_rows(o, token_live(query_start_loc, live, T)), v, out)


def step(kind, S, qp, kp, v, g, beta):
    """One token of the recurrence for a batch of rows, in the compute dtype: S (B, H, V, K) the states before,
    qp, kp (B, H, K) prepared (`_prep_qk`), v (B, H, V), g (B, H) or (B, H, K), beta (B, H). Returns (o (B, H, V),
    the states after)."""
    decay = torch.exp(g)
    S = S * (decay[:, :, None, :] if kind == "kda" else decay[:, :, None, None])
    u = beta[..., None] * (v - (S @ kp[..., None])[..., 0])  # (B, H, V)
    S = S + u[..., :, None] * kp[:, :, None, :]
    return (S @ qp[..., None])[..., 0], S


def _update(kind, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out):
    B, Hk, H, K, V = _VALIDATE_UPDATE[kind](q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm,
                                            pad_slot_id, out)
    cd = compute_dtype(q.dtype)
    idx, live, safe = slots(state_indices, pad_slot_id)
    S = _initial(ssm_states, safe, live, cd)  # (B, H, V, K)
    qp, kp = _prep_qk(q, k, scale, use_qk_l2norm, H // Hk, cd)
    o, S = step(kind, S, qp, kp, v.to(cd), g.to(cd), beta.to(cd))
    scatter_final(ssm_states, idx, live, S)
    return emit(zero_pad_rows(o, live), v, out)


@provides("torch", "gated_delta_rule_varlen")
def gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                            *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Gated DeltaNet over packed sequences (see harness.ops for the contract)."""
    return _varlen("gdn", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                   use_qk_l2norm, pad_slot_id, out)


@provides("torch", "gated_delta_rule_update")
def gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
                            pad_slot_id=PAD_SLOT_ID, out=None):
    """One Gated DeltaNet decode step per row (see harness.ops)."""
    return _update("gdn", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)


@provides("torch", "kda_varlen")
def kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *, scale=None,
               use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Kimi Delta Attention over packed sequences (see harness.ops)."""
    return _varlen("kda", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                   use_qk_l2norm, pad_slot_id, out)


@provides("torch", "kda_update")
def kda_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
               pad_slot_id=PAD_SLOT_ID, out=None):
    """One KDA decode step per row (see harness.ops)."""
    return _update("kda", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)
