"""gated_delta_rule_varlen: Gated DeltaNet (Qwen3-Next) over packed sequences.

gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                        *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, Hv, V)
    q, k (T, Hk, K); v (T, Hv, V) with Hk | Hv (value head h reads key head h // (Hv // Hk)); g (T, Hv)
    log-decays; beta (T, Hv); ssm_states (num_slots, Hv, V, K), value-major. Per token and value head:
    q, k L2-normalised over K if use_qk_l2norm (x / sqrt(sum x^2 + 1e-6)), q *= scale (None = K ** -0.5);
    S <- exp(g) S;  u = beta (v - S k);  S <- S + u k^T;  o = S q.
    Any g (a positive g grows the state) and beta are admitted; the op is exact for any chunking.
"""
from __future__ import annotations

from functools import partial

from harness.ops import _delta as D
from harness.ops import _inputs as I
from harness.ops._checks import PAD_SLOT_ID
from harness.ops.spec import OpSpec


def validate_gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale=None,
                                     use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (T, Hk, Hv, K, V, S)."""
    return D._validate_varlen("gdn", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                              use_qk_l2norm, pad_slot_id, out)


SPEC = OpSpec(
    name="gated_delta_rule_varlen",
    args=("q", "k", "v", "g", "beta", "ssm_states", "query_start_loc", "cache_indices", "has_initial_state"),
    options=dict(scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None),
    pool="ssm_states", index="cache_indices",
    validate=validate_gated_delta_rule_varlen, reference=partial(D.reference_varlen, "gdn"),
    inputs=partial(D.inputs, "gdn", True), bytes=partial(D.nbytes, varlen=True), flops=D.flops,
    tokens=I.tokens_T,
    shapes={
        "cpu": [dict(T=64, Hk=2, Hv=4, K=32, V=32, S=2), dict(T=256, Hk=2, Hv=4, K=32, V=32, S=2)],
        # Qwen3-Next's layer (Hk 16, Hv 32, K = V = 128), batch 1
        "gpu": [dict(T=4096, Hk=16, Hv=32, K=128, V=128, S=1), dict(T=16384, Hk=16, Hv=32, K=128, V=128, S=1)],
        "contract": [dict(T=5, Hk=2, Hv=4, K=3, V=2, S=2, fresh=1, l2norm=False)],
    },
    bad_inputs=D.bad_inputs("gdn"),
    doc=__doc__,
)
