"""kda_update: one Kimi Delta Attention decode token per row.

kda_update(q, k, v, g, beta, ssm_states, state_indices,
           *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (B, H, V)
    q, k (B, H, K); v (B, H, V); g (B, H, K); beta (B, H); the slot of row b takes one step in place.
    A pad row (state_indices[b] == pad_slot_id) reads and writes no slot and gets o[b] = 0.
"""
from __future__ import annotations

import torch

from harness.ops import _delta as D

SPEC = D.make_spec("kda", "update", "kda_update", __doc__, shapes={
    "cpu": [dict(B=8, H=4, K=32, V=32)],
    "gpu": [dict(B=1, H=32, K=128, V=128), dict(B=64, H=32, K=128, V=128), dict(B=256, H=32, K=128, V=128)],
    "contract": [dict(B=2, H=2, K=3, V=2, l2norm=False)],
    "aot": [dict(B=5, H=4, K=128, V=128, l2norm=l2, pool_dtype=p)
            for l2 in (True, False) for p in (torch.float32, "act")],
})
validate_kda_update = SPEC.validate
