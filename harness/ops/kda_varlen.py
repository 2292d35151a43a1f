"""kda_varlen: Kimi Delta Attention (Kimi-Linear) over packed sequences.

kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
           *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, H, V)
    As gated_delta_rule_varlen with one head count H for q, k and v, and g (T, H, K): one log-decay per key
    channel, S <- S diag(exp(g)). ssm_states (num_slots, H, V, K), value-major (engines keep it in fp32).
    A pad request (cache_indices[i] == pad_slot_id) reads and writes no slot and its tokens get o = 0.
"""
from __future__ import annotations

from harness.ops import _delta as D

SPEC = D.make_spec("kda", "varlen", "kda_varlen", __doc__, shapes={
    "cpu": [dict(T=64, H=4, K=32, V=32, S=2), dict(T=256, H=4, K=32, V=32, S=2)],
    # Kimi-Linear's layer (H 32, K = V = 128), batch 1
    "gpu": [dict(T=4096, H=32, K=128, V=128, S=1), dict(T=16384, H=32, K=128, V=128, S=1)],
    "contract": [dict(T=5, H=2, K=3, V=2, S=2, fresh=1, l2norm=False)],
    # the layer's head sizes (K = V = 128), with and without the q/k l2norm
    "aot": [dict(T=40, H=2, K=128, V=128, S=2, fresh=1, l2norm=l2) for l2 in (True, False)],
})
validate_kda_varlen = SPEC.validate
