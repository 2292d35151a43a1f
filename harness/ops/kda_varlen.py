"""kda_varlen: Kimi Delta Attention (Kimi-Linear) over packed sequences.

kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
           *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, H, V)
    As gated_delta_rule_varlen with one head count H for q, k and v, and g (T, H, K): one log-decay per key
    channel, S <- S diag(exp(g)). ssm_states (num_slots, H, V, K), value-major (engines keep it in fp32).
"""
from __future__ import annotations

from functools import partial

from harness.ops import _delta as D
from harness.ops import _inputs as I
from harness.ops._checks import PAD_SLOT_ID
from harness.ops.spec import OpSpec


def validate_kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale=None,
                        use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (T, Hk, Hv, K, V, S)."""
    return D._validate_varlen("kda", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                              use_qk_l2norm, pad_slot_id, out)


SPEC = OpSpec(
    name="kda_varlen",
    args=("q", "k", "v", "g", "beta", "ssm_states", "query_start_loc", "cache_indices", "has_initial_state"),
    options=dict(scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None),
    pool="ssm_states", index="cache_indices",
    validate=validate_kda_varlen, reference=partial(D.reference_varlen, "kda"),
    inputs=partial(D.inputs, "kda", True), bytes=partial(D.nbytes, varlen=True), flops=D.flops,
    tokens=I.tokens_T,
    shapes={
        "cpu": [dict(T=64, H=4, K=32, V=32, S=2), dict(T=256, H=4, K=32, V=32, S=2)],
        # Kimi-Linear's layer (H 32, K = V = 128), batch 1
        "gpu": [dict(T=4096, H=32, K=128, V=128, S=1), dict(T=16384, H=32, K=128, V=128, S=1)],
        "contract": [dict(T=5, H=2, K=3, V=2, S=2, fresh=1, l2norm=False)],
    },
    bad_inputs=D.bad_inputs("kda"),
    doc=__doc__,
)
