"""causal_conv1d_update_spec: the short causal conv of a decode step with speculative tokens (several per row).

causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens,
                          *, activation=None, pad_slot_id=PAD_SLOT_ID, out=None) -> y
    x (T, D): packed tokens; row b has [query_start_loc[b], query_start_loc[b+1]), at most num_spec + 1.
    weight (D, K); bias (D,) | None; conv_states (num_slots, D, K-1), oldest input first.
    conv_state_indices (Bsz, num_spec + 1): slot of row b's conv state after its position j (the last K-1
    inputs up to and including that token; pad_slot_id: not written); live ids distinct over the table.
    num_accepted_tokens (Bsz,), each in 1..num_spec + 1: row b starts from slot
    conv_state_indices[b, num_accepted_tokens[b] - 1], read before anything is written. Padding rows (their
    tokens get y = 0) and untouched slots as in selective_state_update_spec. Semantics: reference.spec_decode. (vLLM's
    causal_conv1d_update with num_accepted_tokens keeps one wider slot of K-1+num_spec columns and slides
    over it instead; the states hold the same inputs.)
"""
from __future__ import annotations

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops import _spec_decode as SD
from harness.ops.causal_conv1d_varlen import _width9, check_conv_params, conv_call_ok, conv_flops
from harness.ops.spec import OpSpec
from reference.validate import check_tensor


def validate_causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices,
                                       num_accepted_tokens, activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """Returns (T, D, K, Bsz, S) with S = num_spec + 1."""
    ok = conv_call_ok(x, weight, bias, conv_states, activation, out)
    if ok is not None:
        T, D, K = ok
        rows = ck.spec_decode_ok(query_start_loc, conv_state_indices, num_accepted_tokens, T, conv_states.shape[0],
                                 pad_slot_id, x.device)
        if rows is not None:
            return T, D, K, rows[0], rows[1]
    return check_rules(x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens,
                       activation, pad_slot_id, out)


def check_rules(x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens,
                activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    check_tensor("x", x, ndim=2, dtypes=ck.ACT_DTYPES)
    T, D = x.shape
    K = check_conv_params(D, weight, bias, conv_states, activation)
    Bsz, S = ck.check_spec_decode(query_start_loc, "conv_state_indices", conv_state_indices, num_accepted_tokens,
                                  T, conv_states.shape[0], pad_slot_id)
    ck.same_device(x=x, weight=weight, bias=bias, conv_states=conv_states, query_start_loc=query_start_loc,
                   conv_state_indices=conv_state_indices, num_accepted_tokens=num_accepted_tokens)
    ck.check_out(out, (T, D), x.dtype, x.device)
    return T, D, K, Bsz, S


def reference(cd, x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens, *,
              activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.spec_decode import spec_conv1d_update
    validate_causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices,
                                       num_accepted_tokens, activation, pad_slot_id, out)
    up = _ref.up

    def run(pool, table):
        return spec_conv1d_update(up(x, cd), pool, up(weight, cd), up(bias, cd), activation=activation,
                                  query_start_loc=query_start_loc, state_indices=table,
                                  num_accepted_tokens=num_accepted_tokens)

    y = SD.run_on_named_slots(run, conv_states, query_start_loc, conv_state_indices, num_accepted_tokens,
                              pad_slot_id, cd)
    return _ref.emit(y, x, out)


def inputs(shape, dtype, device, gen):
    """Shape keys: B rows, D channels, K width, num_spec (and `lens`, `accepted`: see harness.ops._spec_decode)."""
    D, K = shape["D"], shape["K"]
    full = shape.get("optional", True)
    lay = SD.layout(shape, device)
    return dict(x=I.rand(gen, device, lay["T"], D, dtype=dtype),
                conv_states=I.rand(gen, device, lay["num_slots"], D, K - 1,
                                   dtype=I.pool_dtype(shape, dtype, dtype)),
                weight=I.rand(gen, device, D, K, dtype=dtype, scale=0.5),
                bias=I.opt(shape, I.rand(gen, device, D, dtype=dtype, scale=0.1)),
                query_start_loc=lay["query_start_loc"], conv_state_indices=lay["state_indices"],
                num_accepted_tokens=lay["num_accepted_tokens"], activation="silu" if full else None)


def nbytes(inp):
    return (2 * I.nbytes(inp["x"]) + I.nbytes(inp["weight"]) + I.nbytes(inp.get("bias"))
            + I.nbytes(inp["query_start_loc"]) + I.nbytes(inp["conv_state_indices"])
            + I.nbytes(inp["num_accepted_tokens"]) + SD.pool_traffic(inp, "conv_states", "conv_state_indices"))


SPEC = OpSpec(
    name="causal_conv1d_update_spec",
    in_place="x",  # vLLM and SGLang run it in place: their out defaults to x
    args=("x", "conv_states", "weight", "bias", "query_start_loc", "conv_state_indices", "num_accepted_tokens"),
    options=dict(activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None),
    pool="conv_states", index="conv_state_indices",
    validate=validate_causal_conv1d_update_spec, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=conv_flops,
    tokens=SD.tokens,
    shapes={
        "cpu": [dict(B=8, D=64, K=4, num_spec=2)],
        "gpu": [dict(B=64, D=10240, K=4, num_spec=3), dict(B=256, D=10240, K=4, num_spec=1)],
        "contract": [dict(B=2, D=4, K=3, num_spec=2, optional=False)],
        "aot": [dict(B=5, D=96, K=4, num_spec=3), dict(B=5, D=96, K=4, num_spec=3, optional=False)],
    },
    bad_inputs=(("kernel width 9", "weight", _width9),) + SD.bad_inputs("conv_state_indices"),
    doc=__doc__,
)
