"""causal_conv1d_update: the short causal conv of one decode token per row.

causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices,
                     *, activation=None, pad_slot_id=PAD_SLOT_ID, out=None) -> y
    x (B, D): one token per row; weight (D, K); bias (D,) | None; conv_states (num_slots, D, K-1),
    the named slots shifted by one token in place. A pad row (conv_state_indices[b] == pad_slot_id)
    reads and writes no slot and gets y[b] = 0.
"""
from __future__ import annotations

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops.causal_conv1d_varlen import _width9, check_conv_params, conv_call_ok, conv_flops
from harness.ops.spec import OpSpec
from reference.validate import check_tensor


def validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation=None,
                                  pad_slot_id=ck.PAD_SLOT_ID, out=None):
    ok = conv_call_ok(x, weight, bias, conv_states, activation, out)
    if ok is not None and ck.slots_ok(conv_state_indices, ok[0], conv_states.shape[0], pad_slot_id, x.device):
        return ok
    return check_rules(x, conv_states, weight, bias, conv_state_indices, activation, pad_slot_id, out)


def check_rules(x, conv_states, weight, bias, conv_state_indices, activation=None, pad_slot_id=ck.PAD_SLOT_ID,
                out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    check_tensor("x", x, ndim=2, dtypes=ck.ACT_DTYPES)
    Bsz, D = x.shape
    K = check_conv_params(D, weight, bias, conv_states, activation)
    ck.check_indices("conv_state_indices", conv_state_indices, Bsz, conv_states.shape[0], pad_slot_id)
    ck.same_device(x=x, weight=weight, bias=bias, conv_states=conv_states, conv_state_indices=conv_state_indices)
    ck.check_out(out, (Bsz, D), x.dtype, x.device)
    return Bsz, D, K


def reference(cd, x, conv_states, weight, bias, conv_state_indices, *, activation=None,
              pad_slot_id=ck.PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.conv1d import causal_conv1d_update
    validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation, pad_slot_id, out)
    idx = _ref.slot_list(conv_state_indices, pad_slot_id)
    st = _ref.gather(conv_states, idx, [True] * len(idx), cd)
    up = _ref.up
    y, new = causal_conv1d_update(up(x, cd), st, up(weight, cd), up(bias, cd), activation=activation)
    _ref.scatter(conv_states, idx, new)
    _ref.zero_pads(y, idx)
    return _ref.emit(y, x, out)


def inputs(shape, dtype, device, gen):
    B, D, K = shape["B"], shape["D"], shape["K"]
    full = shape.get("optional", True)
    return dict(x=I.rand(gen, device, B, D, dtype=dtype),
                conv_states=I.rand(gen, device, B + 1, D, K - 1, dtype=I.pool_dtype(shape, dtype, dtype)),
                weight=I.rand(gen, device, D, K, dtype=dtype, scale=0.5),
                bias=I.opt(shape, I.rand(gen, device, D, dtype=dtype, scale=0.1)),
                conv_state_indices=I.slots(shape, B, device)[0], activation="silu" if full else None)


def nbytes(inp):
    return (2 * I.nbytes(inp["x"]) + I.nbytes(inp["weight"]) + I.nbytes(inp.get("bias"))
            + I.nbytes(inp["conv_state_indices"]) + I.pool_traffic(inp, "conv_states", "conv_state_indices", None))


SPEC = OpSpec(
    name="causal_conv1d_update",
    in_place="x",  # vLLM and SGLang run it in place: their out defaults to x
    args=("x", "conv_states", "weight", "bias", "conv_state_indices"),
    options=dict(activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None),
    pool="conv_states", index="conv_state_indices",
    validate=validate_causal_conv1d_update, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=conv_flops,
    tokens=I.tokens_B,
    shapes={
        "cpu": [dict(B=8, D=64, K=4)],
        "gpu": [dict(B=64, D=10240, K=4), dict(B=256, D=10240, K=4)],
        "contract": [dict(B=2, D=4, K=3, optional=False)],
        "aot": [dict(B=5, D=96, K=4), dict(B=5, D=96, K=4, optional=False)],
    },
    bad_inputs=(("kernel width 9", "weight", _width9),),
    doc=__doc__,
)
