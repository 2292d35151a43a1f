"""The gated delta rule: Gated DeltaNet (GDN, Qwen3-Next) and Kimi Delta Attention (KDA, Kimi Linear).

Per head, with a value-major state S of shape (V, K) (the layout serving engines keep in their pools),
for each token t:

    q_t, k_t <- l2norm(q_t), l2norm(k_t)          (if use_qk_l2norm; x / sqrt(sum x^2 + 1e-6) over K)
    q_t      <- q_t * scale                        (scale defaults to K ** -0.5)
    GDN:  S <- exp(g_t) * S                        g_t one log-decay per value head, g (T, Hv)
    KDA:  S <- S diag(exp(g_t))                    g_t one log-decay per key channel, g (T, H, K)
    u_t = beta_t * (v_t - S k_t)                   (read with the decayed state)
    S   <- S + u_t k_t^T
    o_t = S q_t

GDN has Hv value heads and Hk key heads, Hk | Hv; value head h reads key head h // (Hv // Hk)
(`repeat_interleave` of the q/k heads, so with Hk = 2 and Hv = 4 heads 0, 1 read key head 0). beta is
(T, Hv). KDA has H heads for q, k and v. States are (S, Hv, V, K): sequence, value head, value, key.

Three independent formulations, so that each checks the others:
  * `gated_delta_rule` / `kda`: the recurrence above, one token at a time;
  * `gated_delta_rule_chunked` / `kda_chunked`: the chunked WY (UT-transform) form. With
    b_t = sum_{s <= t} g_s inside a chunk (per key channel; GDN's scalar broadcast over K) and
    Gamma_t = diag(exp(b_t)), the state after token t of the chunk is
        S_t = S_0 Gamma_t + sum_{j <= t} u_j k_j^T Gamma_t Gamma_j^-1,
    so the u_t of the chunk solve the unit lower-triangular system
        u_t + beta_t sum_{j < t} (k_t . exp(b_t - b_j) k_j) u_j = beta_t (v_t - S_0 (exp(b_t) k_t)),
    solved by forward substitution; then o_t = S_0 (exp(b_t) q_t) + sum_{j <= t} (q_t . exp(b_t - b_j) k_j) u_j
    and S_L = S_0 Gamma_L + sum_j u_j (exp(b_L - b_j) k_j)^T. The chunk grid restarts at every sequence
    start and a sequence's last chunk is simply shorter: no token is padded, so no padding can decay or
    write the state. Pairwise decays are exponentials of masked differences (-inf above the diagonal),
    never ratios of exponentials, so strong decays give exact zeros instead of inf * 0;
  * `gated_delta_rule_update` / `kda_update`: one decode step for a batch of rows in the Householder
    form S' = S D (I - beta k k^T) + beta v k^T, o = S' q (D the decay), the state batch (B, Hv, V, K).
"""
from __future__ import annotations

import math

import torch

from reference._common import check_float, check_same_device, sequences, start_state
from reference.validate import check_same_dtype, check_tensor, fail

__all__ = ["gated_delta_rule", "gated_delta_rule_chunked", "gated_delta_rule_update",
           "kda", "kda_chunked", "kda_update", "l2norm", "L2NORM_EPS", "check_shapes", "check_options",
           "check_state_shape"]

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, as FLA and transformers do)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------------
# argument checks

def check_shapes(kind: str, q, k, v, g, beta, rows: str, **tensor_kw) -> tuple[int, int, int, int, int]:
    """Shapes of (q, k, v, g, beta) for `kind` "gdn" or "kda", `rows` naming their first dim ("T" or "B");
    `tensor_kw` are the dtype rules passed to `check_tensor` (e.g. floating=True). Returns (n, Hk, Hv, K, V).
    Shared with the op contract (harness.delta_contract)."""
    check_tensor("q", q, ndim=3, **tensor_kw)
    n, Hk, K = q.shape
    check_tensor("k", k, shape=(n, Hk, K), **tensor_kw)
    check_tensor("v", v, ndim=3, **tensor_kw)
    if v.shape[0] != n:
        fail("v", f"shape ({rows}, Hv, V) with {rows} = {n} (as q)", f"shape {tuple(v.shape)}")
    Hv, V = v.shape[1], v.shape[2]
    if kind == "kda":
        if Hv != Hk:
            fail("v", f"shape ({rows}, {Hk}, V): KDA has as many value heads as q/k heads ({Hk})",
                 f"shape {tuple(v.shape)}")
        if isinstance(g, torch.Tensor) and g.dim() != 3:
            fail("g", f"3 dims of shape ({rows}, H, K) = ({n}, {Hv}, {K}): one log-decay per key channel "
                 "(a per-head g is GDN's)", f"shape {tuple(g.shape)}")
        check_tensor("g", g, shape=(n, Hv, K), **tensor_kw)
    else:
        if Hk <= 0 or Hv % Hk != 0:
            fail("k", f"a key head count Hk dividing the value head count Hv = {Hv} (v is ({rows}, Hv, V))",
                 f"Hk = {Hk} (shape {tuple(k.shape)})")
        if isinstance(g, torch.Tensor) and g.dim() != 2:
            fail("g", f"2 dims of shape ({rows}, Hv) = ({n}, {Hv}): one log-decay per value head "
                 "(a per-key-channel g is KDA's)", f"shape {tuple(g.shape)}")
        check_tensor("g", g, shape=(n, Hv), **tensor_kw)
    check_tensor("beta", beta, shape=(n, Hv), **tensor_kw)
    return n, Hk, Hv, K, V


def check_options(scale, use_qk_l2norm) -> None:
    """scale: None or a finite number > 0; use_qk_l2norm: a bool. Shared with the op contract."""
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not math.isfinite(scale) or scale <= 0):
        fail("scale", "None or a finite number > 0", repr(scale))
    if not isinstance(use_qk_l2norm, bool):
        fail("use_qk_l2norm", "a bool", repr(use_qk_l2norm))


def check_state_shape(arg: str, states, want: tuple, lead: str) -> None:
    """A 4-dim state batch or pool of value-major shape `want` = (lead, Hv, V, K); a key-major
    (.., K, V) one is named as such. Shared with the op contract."""
    if tuple(states.shape) != tuple(want):
        _, Hv, V, K = want
        got = f"shape {tuple(states.shape)}"
        if tuple(states.shape[1:]) == (Hv, K, V) and K != V:
            got += " (the key-major (.., K, V) layout; pass states.transpose(-1, -2))"
        fail(arg, f"value-major shape ({lead}, Hv, V, K) = {tuple(want)}", got)


def _check_inputs(kind: str, q, k, v, g, beta, scale, use_qk_l2norm, rows: str) -> tuple[int, ...]:
    """Shapes, dtypes and devices of (q, k, v, g, beta) and the options. Returns (n, Hk, Hv, K, V)."""
    dims = check_shapes(kind, q, k, v, g, beta, rows, floating=True)
    check_options(scale, use_qk_l2norm)
    check_same_dtype(q=q, k=k, v=v, g=g, beta=beta)
    check_same_device("q", q, k=k, v=v, g=g, beta=beta)
    return dims


def _check_states(arg: str, states, n: int, lead: str, Hv: int, V: int, K: int, ref, optional: bool) -> None:
    """A value-major state batch (n, Hv, V, K); a key-major (n, Hv, K, V) one gets its own message."""
    check_float(arg, states, ndim=4, optional=optional)
    if states is None:
        return
    check_state_shape(arg, states, (n, Hv, V, K), lead)
    check_same_dtype(q=ref, **{arg: states})
    check_same_device("q", ref, **{arg: states})


def _check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        fail("chunk_size", "a positive int", repr(chunk_size))


def _prepare_qk(q, k, scale, use_qk_l2norm, heads_per_key):
    """l2norm (optional), then q * scale, then the q/k heads repeated to the value heads."""
    K = q.shape[-1]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (K ** -0.5 if scale is None else scale)
    return q.repeat_interleave(heads_per_key, dim=1), k.repeat_interleave(heads_per_key, dim=1)


# ----------------------------------------------------------------------------------------------
# the recurrence

def _decayed(S: torch.Tensor, g_t: torch.Tensor) -> torch.Tensor:
    """S (..., V, K) decayed by g_t: (...,) scalar per head (GDN) or (..., K) per key channel (KDA)."""
    if g_t.dim() == S.dim() - 2:
        return torch.exp(g_t)[..., None, None] * S
    return S * torch.exp(g_t)[..., None, :]


def _recurrence(kind, q, k, v, g, beta, scale, use_qk_l2norm, cu_seqlens, initial_states):
    T, Hk, Hv, K, V = _check_inputs(kind, q, k, v, g, beta, scale, use_qk_l2norm, "T")
    seqs = sequences(cu_seqlens, T)
    _check_states("initial_states", initial_states, len(seqs), "S", Hv, V, K, q, optional=True)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm, Hv // Hk)
    o = torch.empty((T, Hv, V), dtype=v.dtype, device=v.device)
    final_states = torch.empty((len(seqs), Hv, V, K), dtype=v.dtype, device=v.device)
    for s, (start, end) in enumerate(seqs):
        S = start_state(initial_states, s, (Hv, V, K), v)
        for t in range(start, end):
            S = _decayed(S, g[t])
            u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))  # (Hv, V)
            S = S + u[:, :, None] * k[t][:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", S, q[t])
        final_states[s] = S
    return o, final_states


def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, cu_seqlens=None,
                     initial_states=None):
    """Gated DeltaNet as the plain recurrence, one token at a time.

    Args:
        q, k: (T, Hk, K). v: (T, Hv, V) with Hk | Hv. g: (T, Hv) log-decays. beta: (T, Hv).
        scale: q's scale (None = K ** -0.5). use_qk_l2norm: L2-normalise q and k over K first.
        cu_seqlens: int (S+1,) offsets or None. initial_states: (S, Hv, V, K) or None (zeros).

    Returns:
        (o, final_states): o (T, Hv, V); final_states (S, Hv, V, K).
    """
    return _recurrence("gdn", q, k, v, g, beta, scale, use_qk_l2norm, cu_seqlens, initial_states)


def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, cu_seqlens=None, initial_states=None):
    """Kimi Delta Attention as the plain recurrence: as `gated_delta_rule` with q, k, v (T, H, .) of one
    head count and g (T, H, K), one log-decay per key channel."""
    return _recurrence("kda", q, k, v, g, beta, scale, use_qk_l2norm, cu_seqlens, initial_states)


# ----------------------------------------------------------------------------------------------
# the chunked (WY / UT-transform) form

def _chunk(q, k, v, gk, beta, S0):
    """One chunk of one sequence, all tokens real (no padding). q, k, gk (L, H, K) with gk per key
    channel; v (L, H, V); beta (L, H); S0 (H, V, K) the state before the chunk.
    Returns (o (L, H, V), the state after the chunk)."""
    q, k, v, gk = (x.transpose(0, 1) for x in (q, k, v, gk))  # (H, L, .)
    beta = beta.transpose(0, 1)  # (H, L)
    L = q.shape[1]
    b = torch.cumsum(gk, dim=1)  # (H, L, K): log-decay from the chunk start through token t
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device))
    diff = b[:, :, None, :] - b[:, None, :, :]  # (H, t, j, K): b_t - b_j
    decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))  # exact zeros for j > t
    kk = torch.einsum("htk,hjk,htjk->htj", k, k, decay)  # k_t . exp(b_t - b_j) k_j
    qk = torch.einsum("htk,hjk,htjk->htj", q, k, decay)  # q_t . exp(b_t - b_j) k_j, j <= t
    A = beta[:, :, None] * torch.tril(kk, diagonal=-1)
    E = torch.exp(b)
    rhs = beta[:, :, None] * (v - torch.einsum("htk,hvk->htv", E * k, S0))
    U = torch.empty_like(rhs)  # (I + A) U = rhs, A strictly lower triangular: forward substitution
    for t in range(L):
        U[:, t] = rhs[:, t] - torch.einsum("hj,hjv->hv", A[:, t, :t], U[:, :t])
    o = torch.einsum("htk,hvk->htv", E * q, S0) + torch.einsum("htj,hjv->htv", qk, U)
    to_end = torch.exp(b[:, -1:, :] - b)  # (H, L, K): exp(b_L - b_j)
    S1 = S0 * E[:, -1][:, None, :] + torch.einsum("hjv,hjk->hvk", U, to_end * k)
    return o.transpose(0, 1), S1


def _chunked(kind, q, k, v, g, beta, scale, use_qk_l2norm, cu_seqlens, initial_states, chunk_size):
    T, Hk, Hv, K, V = _check_inputs(kind, q, k, v, g, beta, scale, use_qk_l2norm, "T")
    seqs = sequences(cu_seqlens, T)
    _check_states("initial_states", initial_states, len(seqs), "S", Hv, V, K, q, optional=True)
    _check_chunk_size(chunk_size)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm, Hv // Hk)
    gk = g if kind == "kda" else g[:, :, None].expand(T, Hv, K)
    o = torch.empty((T, Hv, V), dtype=v.dtype, device=v.device)
    final_states = torch.empty((len(seqs), Hv, V, K), dtype=v.dtype, device=v.device)
    for s, (start, end) in enumerate(seqs):
        S = start_state(initial_states, s, (Hv, V, K), v)
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)  # the sequence's last chunk may be shorter
            o[c0:c1], S = _chunk(q[c0:c1], k[c0:c1], v[c0:c1], gk[c0:c1], beta[c0:c1], S)
        final_states[s] = S
    return o, final_states


def gated_delta_rule_chunked(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, cu_seqlens=None,
                             initial_states=None, chunk_size=64):
    """Gated DeltaNet in the chunked WY form (see the module docstring); same contract as
    `gated_delta_rule`. `chunk_size` (positive int) only changes how the work is split."""
    return _chunked("gdn", q, k, v, g, beta, scale, use_qk_l2norm, cu_seqlens, initial_states, chunk_size)


def kda_chunked(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, cu_seqlens=None, initial_states=None,
                chunk_size=64):
    """Kimi Delta Attention in the chunked WY form; same contract as `kda`."""
    return _chunked("kda", q, k, v, g, beta, scale, use_qk_l2norm, cu_seqlens, initial_states, chunk_size)


# ----------------------------------------------------------------------------------------------
# one decode step

def _update(kind, q, k, v, g, beta, state, scale, use_qk_l2norm):
    B, Hk, Hv, K, V = _check_inputs(kind, q, k, v, g, beta, scale, use_qk_l2norm, "B")
    _check_states("state", state, B, "B", Hv, V, K, q, optional=False)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm, Hv // Hk)  # (B, Hv, K)
    decayed = _decayed(state, g)
    eye = torch.eye(K, dtype=state.dtype, device=state.device)
    bkk = beta[:, :, None, None] * k[:, :, :, None] * k[:, :, None, :]  # (B, Hv, K, K)
    new_state = decayed @ (eye - bkk) + beta[:, :, None, None] * v[:, :, :, None] * k[:, :, None, :]
    o = torch.einsum("bhvk,bhk->bhv", new_state, q)
    return o, new_state


def gated_delta_rule_update(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """One Gated DeltaNet decode step for a batch of rows (state is not modified).

    Args:
        q, k: (B, Hk, K). v: (B, Hv, V), Hk | Hv. g, beta: (B, Hv). state: (B, Hv, V, K).

    Returns:
        (o, new_state): o (B, Hv, V); new_state (B, Hv, V, K).
    """
    return _update("gdn", q, k, v, g, beta, state, scale, use_qk_l2norm)


def kda_update(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """One KDA decode step: q, k, v (B, H, .), g (B, H, K), beta (B, H), state (B, H, V, K)."""
    return _update("kda", q, k, v, g, beta, state, scale, use_qk_l2norm)


# the one-token decode step of each kind of delta rule (reference.spec_decode runs it token by token)
UPDATES = {"gdn": gated_delta_rule_update, "kda": kda_update}
