"""gated_delta_rule_varlen: Gated DeltaNet (Qwen3-Next) over packed sequences.

gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                        *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, Hv, V)
    q, k (T, Hk, K); v (T, Hv, V) with Hk | Hv (value head h reads key head h // (Hv // Hk)); g (T, Hv)
    log-decays; beta (T, Hv); ssm_states (num_slots, Hv, V, K), value-major. Per token and value head:
    q, k L2-normalised over K if use_qk_l2norm (x / sqrt(sum x^2 + 1e-6)), q *= scale (None = K ** -0.5);
    S <- exp(g) S;  u = beta (v - S k);  S <- S + u k^T;  o = S q.
    Any g (a positive g grows the state) and beta are admitted; the op is exact for any chunking.
    A pad request (cache_indices[i] == pad_slot_id) reads and writes no slot and its tokens get o = 0.
"""
from __future__ import annotations

import torch

from harness.ops import _delta as D

SPEC = D.make_spec("gdn", "varlen", "gated_delta_rule_varlen", __doc__, shapes={
    "cpu": [dict(T=64, Hk=2, Hv=4, K=32, V=32, S=2), dict(T=256, Hk=2, Hv=4, K=32, V=32, S=2)],
    # Qwen3-Next's layer (Hk 16, Hv 32, K = V = 128), batch 1
    "gpu": [dict(T=4096, Hk=16, Hv=32, K=128, V=128, S=1), dict(T=16384, Hk=16, Hv=32, K=128, V=128, S=1)],
    "contract": [dict(T=5, Hk=2, Hv=4, K=3, V=2, S=2, fresh=1, l2norm=False)],
    # the Triton launch variants: l2norm on and off, fp32 and activation-dtype pools
    "aot": [dict(T=200, Hk=2, Hv=4, K=128, V=128, S=2, fresh=1, l2norm=l2, pool_dtype=p)
            for l2 in (True, False) for p in (torch.float32, "act")],
})
validate_gated_delta_rule_varlen = SPEC.validate
