"""Op contract of the gated delta rule ops (Gated DeltaNet and Kimi Delta Attention): validators.

Conventions as in `harness.ops` (token-major packed tensors, `query_start_loc`, state pools indexed by
slot and possibly strided, `has_initial_state`, pad slot, `out=`, ValueError before anything is written).
The state is value-major: per head (V, K), the layout vLLM and SGLang keep in their pools.

gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                        *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, Hv, V)
    Gated DeltaNet. q, k (T, Hk, K); v (T, Hv, V) with Hk | Hv (value head h reads key head
    h // (Hv // Hk)); g (T, Hv) log-decays; beta (T, Hv); ssm_states (num_slots, Hv, V, K). Per token:
    q, k L2-normalised over K if use_qk_l2norm (x / sqrt(sum x^2 + 1e-6)), q *= scale (None = K ** -0.5);
    S <- exp(g) S; u = beta (v - S k); S <- S + u k^T; o = S q.
gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices,
                        *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (B, Hv, V)
    One decode token per row: q, k (B, Hk, K); v (B, Hv, V); g, beta (B, Hv); the slot of row b is
    updated in place.
kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
           *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, H, V)
    Kimi Delta Attention: as GDN with one head count H for q, k, v and g (T, H, K) one log-decay per key
    channel: S <- S diag(exp(g)). ssm_states (num_slots, H, V, K).
kda_update(q, k, v, g, beta, ssm_states, state_indices, *, ...) -> o (B, H, V);  g (B, H, K)

dtypes: q, k, v one activation dtype (the output's); g and beta any float dtype (often fp32); pools any
float dtype.
"""
from __future__ import annotations

import torch

from harness.ops import (_ACT_DTYPES, PAD_SLOT_ID, _check_indices, _check_out, _check_qsl, _same_device)
from reference.delta_rule import check_options, check_shapes, check_state_shape
from reference.validate import check_tensor, fail

__all__ = ["DELTA_OP_NAMES", "validate_gated_delta_rule_varlen", "validate_gated_delta_rule_update",
           "validate_kda_varlen", "validate_kda_update"]

DELTA_OP_NAMES = ("gated_delta_rule_varlen", "gated_delta_rule_update", "kda_varlen", "kda_update")


def _check_qkv(kind: str, q, k, v, g, beta, rows: str):
    """q, k (n, Hk, K); v (n, Hv, V); g per head (GDN) or per key channel (KDA); beta (n, Hv); q, k, v of
    one dtype (g and beta may differ)."""
    dims = check_shapes(kind, q, k, v, g, beta, rows, dtypes=_ACT_DTYPES)
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(arg, f"dtype {q.dtype} (same as q)", f"dtype {t.dtype}")
    return dims


def _check_pool(ssm_states, Hv: int, V: int, K: int) -> None:
    check_tensor("ssm_states", ssm_states, ndim=4, dtypes=_ACT_DTYPES)
    check_state_shape("ssm_states", ssm_states, (ssm_states.shape[0], Hv, V, K), "num_slots")


def _validate_varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                     scale, use_qk_l2norm, pad_slot_id, out):
    T, Hk, Hv, K, V = _check_qkv(kind, q, k, v, g, beta, "T")
    _check_pool(ssm_states, Hv, V, K)
    check_options(scale, use_qk_l2norm)
    S = _check_qsl(query_start_loc, T)
    _check_indices("cache_indices", cache_indices, S, ssm_states.shape[0], pad_slot_id)
    check_tensor("has_initial_state", has_initial_state, shape=(S,), dtypes=(torch.bool,))
    _same_device(q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, query_start_loc=query_start_loc,
                 cache_indices=cache_indices, has_initial_state=has_initial_state)
    _check_out(out, (T, Hv, V), v.dtype, v.device)
    return T, Hk, Hv, K, V, S


def _validate_update(kind, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out):
    B, Hk, Hv, K, V = _check_qkv(kind, q, k, v, g, beta, "B")
    _check_pool(ssm_states, Hv, V, K)
    check_options(scale, use_qk_l2norm)
    _check_indices("state_indices", state_indices, B, ssm_states.shape[0], pad_slot_id)
    _same_device(q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, state_indices=state_indices)
    _check_out(out, (B, Hv, V), v.dtype, v.device)
    return B, Hk, Hv, K, V


def validate_gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices,
                                     has_initial_state, scale=None, use_qk_l2norm=False,
                                     pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (T, Hk, Hv, K, V, S)."""
    return _validate_varlen("gdn", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices,
                            has_initial_state, scale, use_qk_l2norm, pad_slot_id, out)


def validate_gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, scale=None,
                                     use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (B, Hk, Hv, K, V)."""
    return _validate_update("gdn", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm,
                            pad_slot_id, out)


def validate_kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                        scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (T, H, H, K, V, S)."""
    return _validate_varlen("kda", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices,
                            has_initial_state, scale, use_qk_l2norm, pad_slot_id, out)


def validate_kda_update(q, k, v, g, beta, ssm_states, state_indices, scale=None, use_qk_l2norm=False,
                        pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (B, H, H, K, V)."""
    return _validate_update("kda", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm,
                            pad_slot_id, out)
