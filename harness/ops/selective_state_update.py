"""selective_state_update: the decode step of Mamba-1 and Mamba-2, one token per row.

selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                       *, dt_softplus=True, dt_limit=(0.0, inf), pad_slot_id=PAD_SLOT_ID, out=None) -> y
    In either layout (chosen by state.dim()):
      Mamba-1: state (num_slots, Dm, N); x, dt, z (B, Dm); A (Dm, N); B, C (B, G, N); D, dt_bias (Dm,).
      Mamba-2: state (num_slots, H, P, N); x, z (B, H, P); dt (B, H); A (H,); B, C (B, G, N) with
               G | H (head h uses group h // (H // G)); D (H,) or (H, P); dt_bias (H,).
    dt_limit clamps dt after bias and softplus (Mamba-2's time_step_limit).
    A pad row (state_batch_indices[b] == pad_slot_id) reads and writes no slot and gets y[b] = 0.
"""
from __future__ import annotations

import torch

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops.selective_scan_varlen import _bad_groups
from harness.ops.spec import OpSpec
from reference.validate import check_tensor, fail


def validate_selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                                    dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """Returns ("mamba1", Bsz, Dm, N, G) or ("mamba2", Bsz, H, P, N, G)."""
    layout = layout_ok(state, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    if layout is not None:
        dev = x.device
        if ck.out_ok(out, x.shape, x.dtype, dev) \
                and ck.slots_ok(state_batch_indices, layout[1], state.shape[0], pad_slot_id, dev):
            return layout
    return check_rules(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_limit, pad_slot_id, out)


def check_rules(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_limit=(0.0, ck.INF),
                pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    layout = check_layout(state, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    ck.check_indices("state_batch_indices", state_batch_indices, layout[1], state.shape[0], pad_slot_id)
    ck.same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                   state_batch_indices=state_batch_indices)
    ck.check_out(out, tuple(x.shape), x.dtype, x.device)
    return layout


def layout_ok(state, x, dt, A, B, C, D, z, dt_bias, dt_limit):
    """`check_layout` passes with every tensor on x's device: the layout it returns, else None (the
    validators' fast path)."""
    xs = ck.act_shape(x, 3 if isinstance(state, torch.Tensor) and state.dim() == 4 else 2)  # the layout's x
    if xs is None or not (isinstance(dt, torch.Tensor) and isinstance(A, torch.Tensor)) or not ck.limit_ok(dt_limit):
        return None
    dev = x.device
    if not ck.pool_ok(state, dev) or dt.device != dev or A.device != dev or dt.dtype not in ck.ACT \
            or A.dtype not in ck.ACT:
        return None
    ss = state.shape
    Bsz = xs[0]
    if len(ss) == 3:
        _, Dm, N = ss
        if xs[1] != Dm or dt.shape != xs or A.shape != (Dm, N) or not ck.opt_ok(D, (Dm,), dev) \
                or not ck.opt_ok(z, xs, dev) or not ck.opt_ok(dt_bias, (Dm,), dev):
            return None
        G = ck.bc_ok(B, C, Bsz, Dm, N, dev)
        return ("mamba1", Bsz, Dm, N, G) if G else None
    if len(ss) != 4:
        return None
    _, H, P, N = ss
    if xs[1] != H or xs[2] != P or dt.shape != (Bsz, H) or A.shape != (H,) or not ck.param_ok(D, ((H,), (H, P)), dev) \
            or not ck.opt_ok(z, xs, dev) or not ck.opt_ok(dt_bias, (H,), dev):
        return None
    G = ck.bc_ok(B, C, Bsz, H, N, dev)
    return ("mamba2", Bsz, H, P, N, G) if G else None


def check_layout(state, x, dt, A, B, C, D, z, dt_bias, dt_limit):
    """The state pool and the per-row tensors (first dim: rows, or packed tokens for the multi-token
    decode) of either layout. Returns ("mamba1", rows, Dm, N, G) or ("mamba2", rows, H, P, N, G)."""
    check_tensor("state", state, dtypes=ck.ACT_DTYPES)
    if state.dim() == 3:
        _, Dm, N = state.shape
        check_tensor("x", x, ndim=2, dtypes=ck.ACT_DTYPES)
        Bsz = x.shape[0]
        check_tensor("x", x, shape=(Bsz, Dm))
        check_tensor("dt", dt, shape=(Bsz, Dm), dtypes=ck.ACT_DTYPES)
        check_tensor("A", A, shape=(Dm, N), dtypes=ck.ACT_DTYPES)
        chans, what = Dm, "Dm"
        check_tensor("D", D, shape=(Dm,), dtypes=ck.ACT_DTYPES, optional=True)
        check_tensor("z", z, shape=(Bsz, Dm), dtypes=ck.ACT_DTYPES, optional=True)
        check_tensor("dt_bias", dt_bias, shape=(Dm,), dtypes=ck.ACT_DTYPES, optional=True)
        layout = ("mamba1", Bsz, Dm, N)
    elif state.dim() == 4:
        _, H, P, N = state.shape
        check_tensor("x", x, ndim=3, dtypes=ck.ACT_DTYPES)
        Bsz = x.shape[0]
        check_tensor("x", x, shape=(Bsz, H, P))
        check_tensor("dt", dt, shape=(Bsz, H), dtypes=ck.ACT_DTYPES)
        check_tensor("A", A, shape=(H,), dtypes=ck.ACT_DTYPES)
        chans, what = H, "H"
        ck.check_param("D", D, [(H,), (H, P)])
        check_tensor("z", z, shape=(Bsz, H, P), dtypes=ck.ACT_DTYPES, optional=True)
        check_tensor("dt_bias", dt_bias, shape=(H,), dtypes=ck.ACT_DTYPES, optional=True)
        layout = ("mamba2", Bsz, H, P, N)
    else:
        fail("state", "a pool of shape (num_slots, Dm, N) (Mamba-1) or (num_slots, H, P, N) (Mamba-2)",
             f"shape {tuple(state.shape)}")
    ck.check_disjoint_slots("state", state)
    G, _ = ck.check_bc(B, C, Bsz, chans, what, N)
    ck.check_dt_limit(dt_limit)
    return layout + (G,)


def reference(cd, state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
              dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.selective_scan import selective_state_update
    from reference.ssd import ssd_state_update
    layout = validate_selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                                             dt_limit, pad_slot_id, out)
    idx = _ref.slot_list(state_batch_indices, pad_slot_id)
    st = _ref.gather(state, idx, [True] * len(idx), cd)
    up = _ref.up
    if layout[0] == "mamba1":
        dtc = up(dt, cd)
        if dt_bias is not None:
            dtc = dtc + up(dt_bias, cd)
        if dt_softplus:
            dtc = torch.nn.functional.softplus(dtc)
        dtc = dtc.clamp(dt_limit[0], dt_limit[1])
        y, new = selective_state_update(st, up(x, cd), dtc, up(A, cd), up(B, cd), up(C, cd), up(D, cd),
                                        up(z, cd), dt_bias=None, dt_softplus=False)
    else:
        y, new = ssd_state_update(st, up(x, cd), up(dt, cd), up(A, cd), up(B, cd), up(C, cd), up(D, cd),
                                  up(z, cd), dt_bias=up(dt_bias, cd), dt_softplus=dt_softplus,
                                  dt_limit=tuple(dt_limit))
    _ref.scatter(state, idx, new)
    _ref.zero_pads(y, idx)
    return _ref.emit(y, x, out)


def state_update_tensors(shape, dtype, device, gen, rows: int, num_slots: int) -> dict:
    """The pool and per-token tensors of a state update in the shape's layout, for `rows` tokens and a pool of
    `num_slots` slots (shared with selective_state_update_spec, which adds its own slot layout)."""
    N, G = shape["N"], shape.get("G", 1)
    pdt = I.pool_dtype(shape, dtype, dtype)
    if shape["layout"] == "mamba1":
        heads = per_token = (shape["Dm"],)
        a_shape = (shape["Dm"], N)
    else:
        heads, per_token = (shape["H"],), (shape["H"], shape["P"])
        a_shape = heads
    return dict(B=I.rand(gen, device, rows, G, N, dtype=dtype), C=I.rand(gen, device, rows, G, N, dtype=dtype),
                dt_softplus=shape.get("optional", True),
                state=I.rand(gen, device, num_slots, *per_token, N, dtype=pdt),
                x=I.rand(gen, device, rows, *per_token, dtype=dtype),
                dt=I.rand(gen, device, rows, *heads, dtype=dtype, scale=0.5, shift=-3),
                A=-torch.exp(I.rand(gen, device, *a_shape, scale=0.5)), D=I.opt(shape, I.rand(gen, device, *heads)),
                z=I.opt(shape, I.rand(gen, device, rows, *per_token, dtype=dtype)),
                dt_bias=I.opt(shape, I.rand(gen, device, *heads, scale=0.1)))


def inputs(shape, dtype, device, gen):
    B = shape["B"]
    return dict(state_update_tensors(shape, dtype, device, gen, B, B + 1),
                state_batch_indices=I.slots(shape, B, device)[0])


def nbytes(inp):
    return (2 * I.nbytes(inp["x"]) + I.nbytes(inp["dt"]) + I.nbytes(inp["A"]) + I.nbytes(inp["B"])
            + I.nbytes(inp["C"]) + I.nbytes(inp.get("D")) + I.nbytes(inp.get("z")) + I.nbytes(inp.get("dt_bias"))
            + I.nbytes(inp["state_batch_indices"])
            + I.pool_traffic(inp, "state", "state_batch_indices", None))


def flops(inp):
    """6 flops per state element and row (decay, write, read-out)."""
    return 6 * inp["x"].shape[0] * inp["state"][0].numel()


def _five_dims(k):
    st = k["state"]
    k["state"] = st.reshape(*st.shape, *([1] * (5 - st.dim())))


def _bad_d(k):
    if k["state"].dim() == 4:
        k["D"] = torch.randn(5, device=k["x"].device)
    else:
        k["D"] = torch.randn(k["x"].shape[1] + 1, device=k["x"].device)


SPEC = OpSpec(
    name="selective_state_update",
    args=("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices"),
    options=dict(dt_softplus=True, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None),
    pool="state", index="state_batch_indices",
    validate=validate_selective_state_update, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=flops,
    tokens=I.tokens_B,
    shapes={
        "cpu": [dict(layout="mamba1", B=8, Dm=64, N=8, G=1), dict(layout="mamba2", B=8, H=4, P=16, N=16, G=1)],
        "gpu": [dict(layout="mamba2", B=64, H=128, P=64, N=128, G=8),
                dict(layout="mamba2", B=256, H=128, P=64, N=128, G=8),
                dict(layout="mamba1", B=256, Dm=8192, N=16, G=1)],
        "contract": [dict(layout="mamba2", B=2, H=2, P=3, N=4, G=1, optional=False),
                     dict(layout="mamba1", B=2, Dm=4, N=3, G=1, optional=False)],
        "aot": [dict(layout="mamba1", B=5, Dm=64, N=16, G=1, optional=o) for o in (True, False)]
        + [dict(layout="mamba2", B=5, H=8, P=16, N=32, G=2, optional=o) for o in (True, False)],
    },
    bad_inputs=(("B with a group count not dividing", "B", _bad_groups),
                ("state with 5 dims", "state", _five_dims),
                ("D of wrong shape", "D", _bad_d)),
    doc=__doc__,
)
