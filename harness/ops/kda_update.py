"""kda_update: one Kimi Delta Attention decode token per row.

kda_update(q, k, v, g, beta, ssm_states, state_indices,
           *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None) -> o (B, H, V)
    q, k (B, H, K); v (B, H, V); g (B, H, K); beta (B, H); the slot of row b takes one step in place.
"""
from __future__ import annotations

from functools import partial

from harness.ops import _delta as D
from harness.ops import _inputs as I
from harness.ops._checks import PAD_SLOT_ID
from harness.ops.spec import OpSpec


def validate_kda_update(q, k, v, g, beta, ssm_states, state_indices, scale=None, use_qk_l2norm=False,
                        pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns (B, Hk, Hv, K, V)."""
    return D._validate_update("kda", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)


SPEC = OpSpec(
    name="kda_update",
    args=("q", "k", "v", "g", "beta", "ssm_states", "state_indices"),
    options=dict(scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None),
    pool="ssm_states", index="state_indices",
    validate=validate_kda_update, reference=partial(D.reference_update, "kda"),
    inputs=partial(D.inputs, "kda", False), bytes=partial(D.nbytes, varlen=False), flops=D.flops,
    tokens=I.tokens_B,
    shapes={
        "cpu": [dict(B=8, H=4, K=32, V=32)],
        "gpu": [dict(B=1, H=32, K=128, V=128), dict(B=64, H=32, K=128, V=128), dict(B=256, H=32, K=128, V=128)],
        "contract": [dict(B=2, H=2, K=3, V=2, l2norm=False)],
    },
    bad_inputs=D.bad_inputs("kda"),
    doc=__doc__,
)
