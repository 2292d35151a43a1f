"""selective_state_update_spec: the Mamba-1 / Mamba-2 decode step with speculative tokens (several per row).

selective_state_update_spec(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_batch_indices,
                            num_accepted_tokens, *, dt_softplus=True, dt_limit=(0.0, inf),
                            pad_slot_id=PAD_SLOT_ID, out=None) -> y
    As `selective_state_update` (same layouts, chosen by state.dim()), with the batch dim of x, dt, B, C, z
    replaced by T packed tokens: row b has the tokens [query_start_loc[b], query_start_loc[b+1]), at most
    num_spec + 1 of them (the last verified token and its drafts).
    state_batch_indices (Bsz, num_spec + 1): slot of row b's state after its position j (pad_slot_id: not
    written); live ids distinct over the whole table.
    num_accepted_tokens (Bsz,), each in 1..num_spec + 1: row b starts from the state in slot
    state_batch_indices[b, num_accepted_tokens[b] - 1] (the state after its last accepted token of the
    previous step), read before anything is written. A row without tokens, or whose start slot is
    pad_slot_id, is padding (nothing read or written, its tokens get y = 0). Slots not written keep their
    contents. Semantics: reference.spec_decode (vLLM's selective_state_update with num_accepted_tokens,
    cu_seqlens and dst_state_batch_indices == state_batch_indices).
"""
from __future__ import annotations

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops import _spec_decode as SD
from harness.ops.selective_scan_varlen import _bad_groups
from harness.ops.selective_state_update import _bad_d, check_layout, layout_ok, state_update_tensors
from harness.ops.spec import OpSpec


def validate_selective_state_update_spec(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_batch_indices,
                                         num_accepted_tokens, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID,
                                         out=None):
    """Returns ("mamba1", T, Dm, N, G, Bsz, S) or ("mamba2", T, H, P, N, G, Bsz, S) with S = num_spec + 1."""
    layout = layout_ok(state, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    if layout is not None:
        dev = x.device
        if ck.out_ok(out, x.shape, x.dtype, dev):
            rows = ck.spec_decode_ok(query_start_loc, state_batch_indices, num_accepted_tokens, layout[1],
                                     state.shape[0], pad_slot_id, dev)
            if rows is not None:
                return layout + rows
    return check_rules(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_batch_indices,
                       num_accepted_tokens, dt_limit, pad_slot_id, out)


def check_rules(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_batch_indices, num_accepted_tokens,
                dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    layout = check_layout(state, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    Bsz, S = ck.check_spec_decode(query_start_loc, "state_batch_indices", state_batch_indices, num_accepted_tokens,
                                  x.shape[0], state.shape[0], pad_slot_id)
    ck.same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                   query_start_loc=query_start_loc, state_batch_indices=state_batch_indices,
                   num_accepted_tokens=num_accepted_tokens)
    ck.check_out(out, tuple(x.shape), x.dtype, x.device)
    return layout + (Bsz, S)


def reference(cd, state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_batch_indices, num_accepted_tokens,
              *, dt_softplus=True, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.spec_decode import spec_state_update
    validate_selective_state_update_spec(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_batch_indices,
                                         num_accepted_tokens, dt_limit, pad_slot_id, out)
    up = _ref.up

    def run(pool, table):
        return spec_state_update(pool, up(x, cd), up(dt, cd), up(A, cd), up(B, cd), up(C, cd), up(D, cd), up(z, cd),
                                 dt_bias=up(dt_bias, cd), dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                                 query_start_loc=query_start_loc, state_indices=table,
                                 num_accepted_tokens=num_accepted_tokens)

    y = SD.run_on_named_slots(run, state, query_start_loc, state_batch_indices, num_accepted_tokens, pad_slot_id, cd)
    return _ref.emit(y, x, out)


def inputs(shape, dtype, device, gen):
    """Shape keys: the layout's (as selective_state_update's), `B` rows, `num_spec`; `lens` (optional) the
    rows' token counts and `accepted` their num_accepted_tokens (default: every row full, varied counts)."""
    lay = SD.layout(shape, device)
    return dict(state_update_tensors(shape, dtype, device, gen, lay["T"], lay["num_slots"]),
                query_start_loc=lay["query_start_loc"], state_batch_indices=lay["state_indices"],
                num_accepted_tokens=lay["num_accepted_tokens"])


def nbytes(inp):
    return (2 * I.nbytes(inp["x"]) + I.nbytes(inp["dt"]) + I.nbytes(inp["A"]) + I.nbytes(inp["B"])
            + I.nbytes(inp["C"]) + I.nbytes(inp.get("D")) + I.nbytes(inp.get("z")) + I.nbytes(inp.get("dt_bias"))
            + I.nbytes(inp["query_start_loc"]) + I.nbytes(inp["state_batch_indices"])
            + I.nbytes(inp["num_accepted_tokens"]) + SD.pool_traffic(inp, "state", "state_batch_indices"))


def flops(inp):
    """6 flops per state element and token (decay, write, read-out)."""
    return 6 * inp["x"].shape[0] * inp["state"][0].numel()


SPEC = OpSpec(
    name="selective_state_update_spec",
    args=("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "query_start_loc", "state_batch_indices",
          "num_accepted_tokens"),
    options=dict(dt_softplus=True, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None),
    pool="state", index="state_batch_indices",
    validate=validate_selective_state_update_spec, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=flops,
    tokens=SD.tokens,
    shapes={
        "cpu": [dict(layout="mamba1", B=8, Dm=64, N=8, G=1, num_spec=2),
                dict(layout="mamba2", B=8, H=4, P=16, N=16, G=1, num_spec=2)],
        "gpu": [dict(layout="mamba2", B=64, H=128, P=64, N=128, G=8, num_spec=3),
                dict(layout="mamba2", B=256, H=128, P=64, N=128, G=8, num_spec=1),
                dict(layout="mamba1", B=256, Dm=8192, N=16, G=1, num_spec=3)],
        "contract": [dict(layout="mamba2", B=2, H=2, P=3, N=4, G=1, num_spec=2, optional=False),
                     dict(layout="mamba1", B=2, Dm=4, N=3, G=1, num_spec=2, optional=False)],
        "aot": [dict(layout="mamba1", B=5, Dm=64, N=16, G=1, num_spec=3, optional=o) for o in (True, False)]
        + [dict(layout="mamba2", B=5, H=8, P=16, N=32, G=2, num_spec=3, optional=o) for o in (True, False)],
    },
    bad_inputs=(("B with a group count not dividing", "B", _bad_groups),
                ("D of wrong shape", "D", _bad_d)) + SD.bad_inputs("state_batch_indices"),
    doc=__doc__,
)
