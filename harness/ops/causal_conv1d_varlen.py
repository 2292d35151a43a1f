"""causal_conv1d_varlen: the short causal depthwise conv of a prefill over packed sequences.

causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                     *, activation=None, pad_slot_id=PAD_SLOT_ID, out=None) -> y
    x (T, D); weight (D, K), 2 <= K <= 8; bias (D,) | None; conv_states (num_slots, D, K-1);
    activation None | "silu". Per sequence: y = act(bias + causal depthwise conv of x with the carried
    window); the slot receives the last K-1 inputs (oldest first; from the initial window where the
    sequence is shorter than K-1). A pad request (cache_indices[i] == pad_slot_id) reads and writes no
    slot and its tokens get y = 0.
"""
from __future__ import annotations

import torch

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops.spec import OpSpec
from reference.validate import check_tensor, fail


def check_conv_params(D, weight, bias, conv_states, activation) -> int:
    """Shared checks of the two conv ops: weight (D, K), bias, the conv-state pool, activation. Returns K."""
    check_tensor("weight", weight, ndim=2, dtypes=ck.ACT_DTYPES)
    if weight.shape[0] != D or not 2 <= weight.shape[1] <= 8:
        fail("weight", f"shape ({D}, K) with 2 <= K <= 8", f"shape {tuple(weight.shape)}")
    K = weight.shape[1]
    check_tensor("bias", bias, shape=(D,), dtypes=ck.ACT_DTYPES, optional=True)
    check_tensor("conv_states", conv_states, ndim=3, dtypes=ck.ACT_DTYPES)
    if tuple(conv_states.shape[1:]) != (D, K - 1):
        fail("conv_states", f"shape (num_slots, {D}, {K - 1})", f"shape {tuple(conv_states.shape)}")
    ck.check_disjoint_slots("conv_states", conv_states)
    if activation not in (None, "silu"):
        fail("activation", "None or 'silu'", repr(activation))
    return K


def conv_params_ok(D, weight, bias, conv_states, activation, dev) -> int:
    """`check_conv_params` passes and the tensors are on `dev`: K, else 0 (the validators' fast path)."""
    if not (isinstance(weight, torch.Tensor) and isinstance(conv_states, torch.Tensor)) \
            or not (activation is None or (type(activation) is str and activation == "silu")):
        return 0
    ws, ss = weight.shape, conv_states.shape
    if len(ws) != 2 or len(ss) != 3:
        return 0
    K = ws[1]
    if ws[0] != D or not 2 <= K <= 8 or ss[1] != D or ss[2] != K - 1 or weight.device != dev \
            or weight.dtype not in ck.ACT or not ck.pool_ok(conv_states, dev) or not ck.opt_ok(bias, (D,), dev):
        return 0
    return K


def conv_call_ok(x, weight, bias, conv_states, activation, out):
    """(rows of x, D, K) when x, the conv parameters and `out` pass the conv ops' common rules (all on x's
    device), else None: the start of their validators' fast paths."""
    xs = ck.act_shape(x, 2)
    if xs is not None:
        K = conv_params_ok(xs[1], weight, bias, conv_states, activation, x.device)
        if K and ck.out_ok(out, xs, x.dtype, x.device):
            return xs[0], xs[1], K
    return None


def validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                  has_initial_state, activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None):
    ok = conv_call_ok(x, weight, bias, conv_states, activation, out)
    if ok is not None:
        T, D, K = ok
        S = ck.varlen_ok(query_start_loc, T, cache_indices, has_initial_state, conv_states.shape[0], pad_slot_id,
                         x.device)
        if S is not None:
            return T, D, K, S
    return check_rules(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                       pad_slot_id, out)


def check_rules(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation=None,
                pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    check_tensor("x", x, ndim=2, dtypes=ck.ACT_DTYPES)
    T, D = x.shape
    K = check_conv_params(D, weight, bias, conv_states, activation)
    S = ck.check_qsl_indices(query_start_loc, T, "cache_indices", cache_indices, conv_states.shape[0], pad_slot_id)
    ck.check_flags("has_initial_state", has_initial_state, S)
    ck.same_device(x=x, weight=weight, bias=bias, conv_states=conv_states, query_start_loc=query_start_loc,
                   cache_indices=cache_indices, has_initial_state=has_initial_state)
    ck.check_out(out, (T, D), x.dtype, x.device)
    return T, D, K, S


def reference(cd, x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
              *, activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.conv1d import causal_conv1d
    validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                  has_initial_state, activation, pad_slot_id, out)
    idx = _ref.slot_list(cache_indices, pad_slot_id)
    init = _ref.gather(conv_states, idx, has_initial_state.tolist(), cd)
    up = _ref.up
    y, final = causal_conv1d(up(x, cd), up(weight, cd), up(bias, cd), activation=activation,
                             cu_seqlens=query_start_loc.cpu().long(), initial_states=init)
    _ref.scatter(conv_states, idx, final)
    _ref.zero_pads(y, idx, query_start_loc)
    return _ref.emit(y, x, out)


def inputs(shape, dtype, device, gen):
    T, D, K, S = shape["T"], shape["D"], shape["K"], shape.get("S", 1)
    qsl = I.seqs(T, S, device)
    S = qsl.numel() - 1
    idx, init = I.slots(shape, S, device)
    full = shape.get("optional", True)
    return dict(x=I.rand(gen, device, T, D, dtype=dtype), weight=I.rand(gen, device, D, K, dtype=dtype, scale=0.5),
                bias=I.opt(shape, I.rand(gen, device, D, dtype=dtype, scale=0.1)),
                conv_states=I.rand(gen, device, S + 1, D, K - 1, dtype=I.pool_dtype(shape, dtype, dtype)),
                query_start_loc=qsl, cache_indices=idx, has_initial_state=init,
                activation="silu" if full else None)


def nbytes(inp):
    return (2 * I.nbytes(inp["x"]) + I.nbytes(inp["weight"]) + I.nbytes(inp.get("bias"))
            + I.nbytes(inp["query_start_loc"]) + I.nbytes(inp["cache_indices"])
            + I.nbytes(inp.get("has_initial_state"))
            + I.pool_traffic(inp, "conv_states", "cache_indices", "has_initial_state"))


def conv_flops(inp):
    """FLOPs of the conv ops: a multiply-add per tap for every row of x (tokens or decode rows) and channel."""
    rows, D = inp["x"].shape
    return 2 * rows * D * inp["weight"].shape[1]


def _width9(k):
    k["weight"] = torch.randn(k["weight"].shape[0], 9, device=k["weight"].device)


SPEC = OpSpec(
    name="causal_conv1d_varlen",
    args=("x", "weight", "bias", "conv_states", "query_start_loc", "cache_indices", "has_initial_state"),
    options=dict(activation=None, pad_slot_id=ck.PAD_SLOT_ID, out=None),
    pool="conv_states", index="cache_indices",
    validate=validate_causal_conv1d_varlen, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=conv_flops,
    tokens=I.tokens_T,
    shapes={
        "cpu": [dict(T=64, D=64, K=4, S=2), dict(T=256, D=64, K=4, S=2)],
        "gpu": [dict(T=4096, D=10240, K=4, S=1), dict(T=16384, D=10240, K=4, S=1)],
        "contract": [dict(T=5, D=4, K=3, S=2, fresh=1, optional=False)],
        "aot": [dict(T=600, D=96, K=4, S=2, fresh=1), dict(T=600, D=96, K=4, S=2, fresh=1, optional=False)],
    },
    bad_inputs=(("kernel width 9", "weight", _width9),),
    doc=__doc__,
)
