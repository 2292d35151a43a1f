"""gated_delta_rule_update_spec: Gated DeltaNet decode with speculative tokens (several per row).

gated_delta_rule_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                             *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (T, Hv, V)
    As `gated_delta_rule_update` (same per-token shapes and pool), with the batch dim of q, k, v, g, beta
    replaced by T packed tokens: row b has the tokens [query_start_loc[b], query_start_loc[b+1]), at most
    num_spec + 1 of them (the last verified token and its drafts).
    state_indices (Bsz, num_spec + 1): the slot that receives row b's state after its position j
    (pad_slot_id: not written); live ids distinct over the whole table.
    num_accepted_tokens (Bsz,), each in 1..num_spec + 1: row b starts from the state in slot
    state_indices[b, num_accepted_tokens[b] - 1], read before anything is written. A row without tokens, or
    whose start slot is pad_slot_id, is padding (nothing read or written, its tokens get o = 0). Slots not
    written keep their contents. Semantics: reference.spec_decode (vLLM's fused_recurrent_gated_delta_rule with
    cu_seqlens, a two-dimensional ssm_state_indices and num_accepted_tokens, written in place).
"""
from __future__ import annotations

import torch

from harness.ops import _delta as D

SPEC = D.make_spec("gdn", "spec", "gated_delta_rule_update_spec", __doc__, shapes={
    "cpu": [dict(B=8, Hk=2, Hv=4, K=32, V=32, num_spec=2)],
    "gpu": [dict(B=64, Hk=16, Hv=32, K=128, V=128, num_spec=3),
            dict(B=256, Hk=16, Hv=32, K=128, V=128, num_spec=1)],
    "contract": [dict(B=2, Hk=2, Hv=4, K=3, V=2, num_spec=2, l2norm=False)],
    "aot": [dict(B=5, Hk=2, Hv=4, K=128, V=128, num_spec=3, l2norm=l2, pool_dtype=p)
            for l2 in (True, False) for p in (torch.float32, "act")],
})
validate_gated_delta_rule_update_spec = SPEC.validate
