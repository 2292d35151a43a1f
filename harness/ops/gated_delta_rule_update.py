"""gated_delta_rule_update: one Gated DeltaNet decode token per row.

gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices,
                        *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (B, Hv, V)
    q, k (B, Hk, K); v (B, Hv, V); g, beta (B, Hv); ssm_states (num_slots, Hv, V, K): the slot of row b
    takes one step of the recurrence of gated_delta_rule_varlen, in place. A pad row (state_indices[b] ==
    pad_slot_id) reads and writes no slot and gets o[b] = 0.
"""
from __future__ import annotations

import torch

from harness.ops import _delta as D

SPEC = D.make_spec("gdn", "update", "gated_delta_rule_update", __doc__, shapes={
    "cpu": [dict(B=8, Hk=2, Hv=4, K=32, V=32)],
    "gpu": [dict(B=1, Hk=16, Hv=32, K=128, V=128), dict(B=64, Hk=16, Hv=32, K=128, V=128),
            dict(B=256, Hk=16, Hv=32, K=128, V=128)],
    "contract": [dict(B=2, Hk=2, Hv=4, K=3, V=2, l2norm=False)],
    "aot": [dict(B=5, Hk=2, Hv=4, K=128, V=128, l2norm=l2, pool_dtype=p)
            for l2 in (True, False) for p in (torch.float32, "act")],
})
validate_gated_delta_rule_update = SPEC.validate
