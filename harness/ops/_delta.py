"""Shared validation, reference plumbing, inputs and counts of the gated delta rule ops (Gated DeltaNet and
Kimi Delta Attention): `gated_delta_rule_varlen`, `gated_delta_rule_update`, `gated_delta_rule_update_spec`,
`kda_varlen`, `kda_update`, `kda_update_spec` (each op's module holds its signature and semantics).

The state is value-major: per head (V, K), the layout vLLM and SGLang keep in their pools. q, k, v share one
activation dtype (the output's); g and beta any float dtype (often fp32); pools any float dtype.
"""
from __future__ import annotations

import torch

from functools import partial

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops import _spec_decode as SD
from harness.ops._checks import ACT as _ACT
from harness.ops._checks import ACT_DTYPES as _ACT_DTYPES
from harness.ops._checks import INF as _INF
from harness.ops._checks import PAD_SLOT_ID, check_disjoint_slots, check_flags
from harness.ops._checks import check_indices as _check_indices
from harness.ops._checks import check_out as _check_out
from harness.ops._checks import check_qsl_indices as _check_qsl_indices
from harness.ops._checks import out_ok as _out_ok
from harness.ops._checks import pool_ok as _pool_ok
from harness.ops._checks import same_device as _same_device
from harness.ops._checks import slots_ok as _slots_ok
from harness.ops._checks import varlen_ok as _varlen_ok
from reference.delta_rule import check_options, check_shapes, check_state_shape
from harness.ops.spec import OpSpec
from reference.validate import check_tensor, fail


def _check_qkv(kind: str, q, k, v, g, beta, rows: str):
    """q, k (n, Hk, K); v (n, Hv, V); g per head (GDN) or per key channel (KDA); beta (n, Hv); q, k, v of
    one dtype (g and beta may differ). The shape rules are the reference's."""
    dims = check_shapes(kind, q, k, v, g, beta, rows, dtypes=_ACT_DTYPES)
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(arg, f"dtype {q.dtype} (same as q)", f"dtype {t.dtype}")
    return dims


def _check_pool(ssm_states, Hv: int, V: int, K: int) -> None:
    check_tensor("ssm_states", ssm_states, ndim=4, dtypes=_ACT_DTYPES)
    check_state_shape("ssm_states", ssm_states, (ssm_states.shape[0], Hv, V, K), "num_slots")
    check_disjoint_slots("ssm_states", ssm_states)


def _qkv_ok(kind, q, k, v, g, beta, ssm_states, scale, use_qk_l2norm):
    """`_check_qkv`, `_check_pool` and `check_options` pass with every tensor on q's device: (n, Hk, Hv, K, V),
    else None (the validators' fast path)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(g, torch.Tensor) and isinstance(beta, torch.Tensor)) or q.is_meta \
            or type(use_qk_l2norm) is not bool or not (scale is None or (type(scale) is float and 0.0 < scale < _INF)):
        return None
    dt, dev = q.dtype, q.device
    if dt not in _ACT or k.dtype != dt or v.dtype != dt or g.dtype not in _ACT or beta.dtype not in _ACT \
            or k.device != dev or v.device != dev or g.device != dev or beta.device != dev:
        return None
    qs, vs = q.shape, v.shape
    if len(qs) != 3 or len(vs) != 3 or k.shape != qs or vs[0] != qs[0]:
        return None
    n, Hk, K = qs
    Hv, V = vs[1], vs[2]
    if kind == "kda":
        if Hv != Hk or g.shape != (n, Hv, K):
            return None
    elif Hk <= 0 or Hv % Hk != 0 or g.shape != (n, Hv):
        return None
    if beta.shape != (n, Hv) or not isinstance(ssm_states, torch.Tensor) or ssm_states.shape[1:] != (Hv, V, K) \
            or not _pool_ok(ssm_states, dev):
        return None
    return n, Hk, Hv, K, V


def _validate_varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                     scale, use_qk_l2norm, pad_slot_id, out):
    dims = _qkv_ok(kind, q, k, v, g, beta, ssm_states, scale, use_qk_l2norm)
    if dims is not None:
        T, _, Hv, _, V = dims
        dev = q.device
        if _out_ok(out, (T, Hv, V), v.dtype, dev):
            S = _varlen_ok(query_start_loc, T, cache_indices, has_initial_state, ssm_states.shape[0], pad_slot_id,
                           dev)
            if S is not None:
                return dims + (S,)
    return _check_varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                         scale, use_qk_l2norm, pad_slot_id, out)


def _check_varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                  scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """The varlen validator's rules one by one, the first broken one raising (its slow path)."""
    T, Hk, Hv, K, V = _check_qkv(kind, q, k, v, g, beta, "T")
    _check_pool(ssm_states, Hv, V, K)
    check_options(scale, use_qk_l2norm)
    S = _check_qsl_indices(query_start_loc, T, "cache_indices", cache_indices, ssm_states.shape[0], pad_slot_id)
    check_flags("has_initial_state", has_initial_state, S)
    _same_device(q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, query_start_loc=query_start_loc,
                 cache_indices=cache_indices, has_initial_state=has_initial_state)
    _check_out(out, (T, Hv, V), v.dtype, v.device)
    return T, Hk, Hv, K, V, S


def _validate_update(kind, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out):
    dims = _qkv_ok(kind, q, k, v, g, beta, ssm_states, scale, use_qk_l2norm)
    if dims is not None:
        B, _, Hv, _, V = dims
        dev = q.device
        if _out_ok(out, (B, Hv, V), v.dtype, dev) \
                and _slots_ok(state_indices, B, ssm_states.shape[0], pad_slot_id, dev):
            return dims
    return _check_update(kind, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)


def _check_update(kind, q, k, v, g, beta, ssm_states, state_indices, scale=None, use_qk_l2norm=False,
                  pad_slot_id=PAD_SLOT_ID, out=None):
    """The decode validator's rules one by one, the first broken one raising (its slow path)."""
    B, Hk, Hv, K, V = _check_qkv(kind, q, k, v, g, beta, "B")
    _check_pool(ssm_states, Hv, V, K)
    check_options(scale, use_qk_l2norm)
    _check_indices("state_indices", state_indices, B, ssm_states.shape[0], pad_slot_id)
    _same_device(q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, state_indices=state_indices)
    _check_out(out, (B, Hv, V), v.dtype, v.device)
    return B, Hk, Hv, K, V


def _validate_spec(kind, q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale,
                   use_qk_l2norm, pad_slot_id, out):
    dims = _qkv_ok(kind, q, k, v, g, beta, ssm_states, scale, use_qk_l2norm)
    if dims is not None:
        T, _, Hv, _, V = dims
        dev = q.device
        if _out_ok(out, (T, Hv, V), v.dtype, dev):
            rows = ck.spec_decode_ok(query_start_loc, state_indices, num_accepted_tokens, T, ssm_states.shape[0],
                                     pad_slot_id, dev)
            if rows is not None:
                return dims + rows
    return _check_spec(kind, q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale,
                       use_qk_l2norm, pad_slot_id, out)


def _check_spec(kind, q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale=None,
                use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """The multi-token decode validator's rules one by one, the first broken one raising (its slow path)."""
    T, Hk, Hv, K, V = _check_qkv(kind, q, k, v, g, beta, "T")
    _check_pool(ssm_states, Hv, V, K)
    check_options(scale, use_qk_l2norm)
    rows = ck.check_spec_decode(query_start_loc, "state_indices", state_indices, num_accepted_tokens, T,
                                ssm_states.shape[0], pad_slot_id)
    _same_device(q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, query_start_loc=query_start_loc,
                 state_indices=state_indices, num_accepted_tokens=num_accepted_tokens)
    _check_out(out, (T, Hv, V), v.dtype, v.device)
    return (T, Hk, Hv, K, V) + rows


# ------------------------------------------------------------------------------ reference plumbing

def reference_varlen(kind, cd, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                     *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.delta_rule import gated_delta_rule, kda
    _validate_varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                     scale, use_qk_l2norm, pad_slot_id, out)
    idx = _ref.slot_list(cache_indices, pad_slot_id)
    init = _ref.gather(ssm_states, idx, has_initial_state.tolist(), cd)
    up = _ref.up
    fn = gated_delta_rule if kind == "gdn" else kda
    y, final = fn(up(q, cd), up(k, cd), up(v, cd), up(g, cd), up(beta, cd), scale=scale,
                  use_qk_l2norm=use_qk_l2norm, cu_seqlens=query_start_loc.cpu().long(), initial_states=init)
    _ref.scatter(ssm_states, idx, final)
    _ref.zero_pads(y, idx, query_start_loc)
    return _ref.emit(y, v, out)


def reference_update(kind, cd, q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
                     pad_slot_id=PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.delta_rule import gated_delta_rule_update, kda_update
    _validate_update(kind, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)
    idx = _ref.slot_list(state_indices, pad_slot_id)
    st = _ref.gather(ssm_states, idx, [True] * len(idx), cd)
    up = _ref.up
    fn = gated_delta_rule_update if kind == "gdn" else kda_update
    y, new = fn(up(q, cd), up(k, cd), up(v, cd), up(g, cd), up(beta, cd), st, scale=scale,
                use_qk_l2norm=use_qk_l2norm)
    _ref.scatter(ssm_states, idx, new)
    _ref.zero_pads(y, idx)
    return _ref.emit(y, v, out)


def reference_spec(kind, cd, q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, *,
                   scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.spec_decode import spec_delta_rule_update
    _validate_spec(kind, q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale,
                   use_qk_l2norm, pad_slot_id, out)
    up = _ref.up

    def run(pool, table):
        return spec_delta_rule_update(kind, up(q, cd), up(k, cd), up(v, cd), up(g, cd), up(beta, cd), pool,
                                      scale=scale, use_qk_l2norm=use_qk_l2norm, query_start_loc=query_start_loc,
                                      state_indices=table, num_accepted_tokens=num_accepted_tokens)

    y = SD.run_on_named_slots(run, ssm_states, query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, cd)
    return _ref.emit(y, v, out)


# ------------------------------------------------------------------------------ inputs and counts

def inputs(kind, form, shape, dtype, device, gen):
    """Shape keys: T (varlen) or B (decode; with num_spec, and optionally lens and accepted, the multi-token
    decode's rows: harness.ops._spec_decode), Hk, Hv (GDN; KDA uses H), K, V, S, fresh, l2norm."""
    lay = SD.layout(shape, device) if form == "spec" else None
    n = shape["T"] if form == "varlen" else lay["T"] if lay else shape["B"]
    Hk = shape.get("Hk", shape.get("H"))
    Hv = shape.get("Hv", shape.get("H"))
    K, V = shape["K"], shape["V"]
    gshape = (n, Hv) if kind == "gdn" else (n, Hv, K)
    d = dict(q=I.rand(gen, device, n, Hk, K, dtype=dtype), k=I.rand(gen, device, n, Hk, K, dtype=dtype),
             v=I.rand(gen, device, n, Hv, V, dtype=dtype),
             # log-decays in (-1, 0), write strengths in (0, 1), as the mixers produce them
             g=-torch.sigmoid(I.rand(gen, device, *gshape)) * 0.5,
             beta=torch.sigmoid(I.rand(gen, device, n, Hv)),
             use_qk_l2norm=bool(shape.get("l2norm", True)))
    if lay:
        d.update(ssm_states=I.rand(gen, device, lay["num_slots"], Hv, V, K,
                                   dtype=I.pool_dtype(shape, torch.float32, dtype), scale=0.1),
                 query_start_loc=lay["query_start_loc"], state_indices=lay["state_indices"],
                 num_accepted_tokens=lay["num_accepted_tokens"])
    elif form == "varlen":
        qsl = I.seqs(n, shape.get("S", 1), device)
        S = qsl.numel() - 1
        idx, init = I.slots(shape, S, device)
        d.update(ssm_states=I.rand(gen, device, S + 1, Hv, V, K, dtype=I.pool_dtype(shape, torch.float32, dtype),
                                   scale=0.1),
                 query_start_loc=qsl, cache_indices=idx, has_initial_state=init)
    else:
        d.update(ssm_states=I.rand(gen, device, n + 1, Hv, V, K, dtype=I.pool_dtype(shape, torch.float32, dtype),
                                   scale=0.1),
                 state_indices=I.slots(shape, n, device)[0])
    return d


def nbytes(inp, form):
    acts = sum(I.nbytes(inp[a]) for a in ("q", "k", "v", "g", "beta")) + I.nbytes(inp["v"])  # o written
    if form == "spec":
        return (acts + I.nbytes(inp["query_start_loc"]) + I.nbytes(inp["state_indices"])
                + I.nbytes(inp["num_accepted_tokens"]) + SD.pool_traffic(inp, "ssm_states", "state_indices"))
    if form == "varlen":
        return (acts + I.nbytes(inp["query_start_loc"]) + I.nbytes(inp["cache_indices"])
                + I.nbytes(inp["has_initial_state"])
                + I.pool_traffic(inp, "ssm_states", "cache_indices", "has_initial_state"))
    return acts + I.nbytes(inp["state_indices"]) + I.pool_traffic(inp, "ssm_states", "state_indices", None)


def flops(inp):
    """The recurrence per token and head: decay, S k, the rank-1 write, S q: about 8 V K flops."""
    n, Hv, V = inp["v"].shape
    return 8 * n * Hv * V * inp["q"].shape[2]


def bad_inputs(kind):
    """Malformed inputs particular to these ops: (what, argument named, mutate)."""
    def key_major(k):
        s = k["ssm_states"]
        k["ssm_states"] = torch.zeros(s.shape[0], s.shape[1], s.shape[3] + 1, s.shape[2], dtype=s.dtype,
                                      device=s.device)

    def g_other_rank(k):
        g = k["g"]
        k["g"] = g[..., None].expand(*g.shape, k["q"].shape[2]).contiguous() if g.dim() == 2 else g[..., 0]

    def bad_scale(k):
        k["scale"] = float("nan")

    m = [("state pool in the key-major layout", "ssm_states", key_major),
         ("g of the other family's rank", "g", g_other_rank),
         ("scale NaN", "scale", bad_scale)]
    if kind == "gdn":
        def heads(k):
            k["v"] = torch.cat([k["v"], k["v"][:, :1]], dim=1)
        m.append(("value heads not a multiple of key heads", "k", heads))
    return tuple(m)


# ------------------------------------------------------------------------------ the six specs

VARLEN_ARGS = ("q", "k", "v", "g", "beta", "ssm_states", "query_start_loc", "cache_indices", "has_initial_state")
UPDATE_ARGS = ("q", "k", "v", "g", "beta", "ssm_states", "state_indices")
SPEC_ARGS = ("q", "k", "v", "g", "beta", "ssm_states", "query_start_loc", "state_indices", "num_accepted_tokens")
FORMS = ("varlen", "update", "spec")


def make_spec(kind: str, form: str, name: str, doc: str, shapes: dict) -> OpSpec:
    """The spec of one of the six ops: `kind` "gdn" or "kda"; `form` "varlen" (prefill), "update" (one decode
    token per row) or "spec" (several decode tokens per row: speculative decoding)."""
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    if form == "varlen":
        def validate(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale=None,
                     use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
            """Returns (T, Hk, Hv, K, V, S)."""
            return _validate_varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices,
                                    has_initial_state, scale, use_qk_l2norm, pad_slot_id, out)
        args, index, checks, ref, tokens = VARLEN_ARGS, "cache_indices", _check_varlen, reference_varlen, I.tokens_T
        bad = bad_inputs(kind)
    elif form == "update":
        def validate(q, k, v, g, beta, ssm_states, state_indices, scale=None, use_qk_l2norm=False,
                     pad_slot_id=PAD_SLOT_ID, out=None):
            """Returns (B, Hk, Hv, K, V)."""
            return _validate_update(kind, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm,
                                    pad_slot_id, out)
        args, index, checks, ref, tokens = UPDATE_ARGS, "state_indices", _check_update, reference_update, I.tokens_B
        bad = bad_inputs(kind)
    else:
        def validate(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale=None,
                     use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
            """Returns (T, Hk, Hv, K, V, Bsz, num_spec + 1)."""
            return _validate_spec(kind, q, k, v, g, beta, ssm_states, query_start_loc, state_indices,
                                  num_accepted_tokens, scale, use_qk_l2norm, pad_slot_id, out)
        args, index, checks, ref, tokens = SPEC_ARGS, "state_indices", _check_spec, reference_spec, SD.tokens
        bad = bad_inputs(kind) + SD.bad_inputs("state_indices")
    validate.__name__ = validate.__qualname__ = f"validate_{name}"
    return OpSpec(
        name=name, args=args,
        options=dict(scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None),
        pool="ssm_states", index=index, validate=validate, checks=partial(checks, kind),
        reference=partial(ref, kind), inputs=partial(inputs, kind, form), bytes=partial(nbytes, form=form),
        flops=flops, tokens=tokens, shapes=shapes, bad_inputs=bad, doc=doc)
