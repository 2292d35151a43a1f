"""gated_delta_rule_update: one Gated DeltaNet decode token per row.

gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices,
                        *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (B, Hv, V)
    q, k (B, Hk, K); v (B, Hv, V); g, beta (B, Hv); ssm_states (num_slots, Hv, V, K): the slot of row b
    takes one step of the recurrence of gated_delta_rule_varlen, in place.
"""
from __future__ import annotations

from functools import partial

from harness.ops import _delta as D
from harness.ops import _inputs as I
from harness.ops._checks import PAD_SLOT_ID
from harness.ops.spec import OpSpec


def validate_gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, scale=None, use_qk_l2norm=False,
                                     pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (B, Hk, Hv, K, V)."""
    return D._validate_update("gdn", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)


SPEC = OpSpec(
    name="gated_delta_rule_update",
    args=("q", "k", "v", "g", "beta", "ssm_states", "state_indices"),
    options=dict(scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None),
    pool="ssm_states", index="state_indices",
    validate=validate_gated_delta_rule_update, reference=partial(D.reference_update, "gdn"),
    inputs=partial(D.inputs, "gdn", False), bytes=partial(D.nbytes, varlen=False), flops=D.flops,
    tokens=I.tokens_B,
    shapes={
        "cpu": [dict(B=8, Hk=2, Hv=4, K=32, V=32)],
        "gpu": [dict(B=1, Hk=16, Hv=32, K=128, V=128), dict(B=64, Hk=16, Hv=32, K=128, V=128),
                dict(B=256, Hk=16, Hv=32, K=128, V=128)],
        "contract": [dict(B=2, Hk=2, Hv=4, K=3, V=2, l2norm=False)],
    },
    bad_inputs=D.bad_inputs("gdn"),
    doc=__doc__,
)
