"""kda_update_spec: Kimi Delta Attention decode with speculative tokens (several per row).

kda_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, H, V)
    As `kda_update` (q, k (T, H, K); v (T, H, V); g (T, H, K); beta (T, H)) over T packed tokens, with the
    rows, slot table and num_accepted_tokens of `gated_delta_rule_update_spec`: row b starts from slot
    state_indices[b, num_accepted_tokens[b] - 1] and writes its state after position j to
    state_indices[b, j]; padding rows read and write nothing and get o = 0. Semantics:
    reference.spec_decode.
"""
from __future__ import annotations

import torch

from harness.ops import _delta as D

SPEC = D.make_spec("kda", "spec", "kda_update_spec", __doc__, shapes={
    "cpu": [dict(B=8, H=4, K=32, V=32, num_spec=2)],
    "gpu": [dict(B=64, H=32, K=128, V=128, num_spec=3), dict(B=256, H=32, K=128, V=128, num_spec=1)],
    "contract": [dict(B=2, H=2, K=3, V=2, num_spec=2, l2norm=False)],
    "aot": [dict(B=5, H=4, K=128, V=128, num_spec=3, l2norm=l2, pool_dtype=p)
            for l2 in (True, False) for p in (torch.float32, "act")],
})
validate_kda_update_spec = SPEC.validate
