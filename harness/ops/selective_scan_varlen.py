"""selective_scan_varlen: the Mamba-1 selective scan of a prefill over packed sequences.

selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                      has_initial_state, *, delta_softplus=True, pad_slot_id=PAD_SLOT_ID, out=None) -> y
    u, delta (T, Dm); A (Dm, N); B, C (T, G, N) with G | Dm (channel d uses group d // (Dm // G));
    D (Dm,) | None; z (T, Dm) | None; delta_bias (Dm,) | None; ssm_states (num_slots, Dm, N).
    A pad request (cache_indices[i] == pad_slot_id) reads and writes no slot and its tokens get y = 0.
"""
from __future__ import annotations

import torch

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops.spec import OpSpec
from reference.validate import check_tensor, fail


def validate_selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc,
                                   cache_indices, has_initial_state, pad_slot_id=ck.PAD_SLOT_ID, out=None):
    us = ck.act_shape(u, 2)
    if us is not None and isinstance(A, torch.Tensor) and isinstance(ssm_states, torch.Tensor):
        dev = u.device
        T, Dm = us
        As, ps = A.shape, ssm_states.shape
        if len(As) == 2 and As[0] == Dm and A.device == dev and A.dtype in ck.ACT and ck.fits(delta, us, dev) \
                and ck.opt_ok(D, (Dm,), dev) and ck.opt_ok(z, us, dev) and ck.opt_ok(delta_bias, (Dm,), dev) \
                and len(ps) == 3 and ps[1] == Dm and ps[2] == As[1] and ck.pool_ok(ssm_states, dev) \
                and ck.out_ok(out, us, u.dtype, dev):
            G = ck.bc_ok(B, C, T, Dm, As[1], dev)
            if G:
                S = ck.varlen_ok(query_start_loc, T, cache_indices, has_initial_state, ps[0], pad_slot_id, dev)
                if S is not None:
                    return T, Dm, As[1], G, S
    return check_rules(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                       has_initial_state, pad_slot_id, out)


def check_rules(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    check_tensor("u", u, ndim=2, dtypes=ck.ACT_DTYPES)
    T, Dm = u.shape
    check_tensor("delta", delta, shape=(T, Dm), dtypes=ck.ACT_DTYPES)
    check_tensor("A", A, ndim=2, dtypes=ck.ACT_DTYPES)
    if A.shape[0] != Dm:
        fail("A", f"shape ({Dm}, N)", f"shape {tuple(A.shape)}")
    N = A.shape[1]
    G, _ = ck.check_bc(B, C, T, Dm, "Dm", N)
    check_tensor("D", D, shape=(Dm,), dtypes=ck.ACT_DTYPES, optional=True)
    check_tensor("z", z, shape=(T, Dm), dtypes=ck.ACT_DTYPES, optional=True)
    check_tensor("delta_bias", delta_bias, shape=(Dm,), dtypes=ck.ACT_DTYPES, optional=True)
    ck.check_pool("ssm_states", ssm_states, (Dm, N))
    S = ck.check_qsl_indices(query_start_loc, T, "cache_indices", cache_indices, ssm_states.shape[0], pad_slot_id)
    ck.check_flags("has_initial_state", has_initial_state, S)
    ck.same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias, ssm_states=ssm_states,
                   query_start_loc=query_start_loc, cache_indices=cache_indices, has_initial_state=has_initial_state)
    ck.check_out(out, (T, Dm), u.dtype, u.device)
    return T, Dm, N, G, S


def reference(cd, u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
              has_initial_state, *, delta_softplus=True, pad_slot_id=ck.PAD_SLOT_ID, out=None):
    from harness.ops import _ref
    from reference.selective_scan import selective_scan
    validate_selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc,
                                   cache_indices, has_initial_state, pad_slot_id, out)
    idx = _ref.slot_list(cache_indices, pad_slot_id)
    init = _ref.gather(ssm_states, idx, has_initial_state.tolist(), cd)
    up = _ref.up
    y, final = selective_scan(up(u, cd), up(delta, cd), up(A, cd), up(B, cd), up(C, cd), up(D, cd),
                              up(z, cd), delta_bias=up(delta_bias, cd), delta_softplus=delta_softplus,
                              cu_seqlens=query_start_loc.cpu().long(), initial_states=init)
    _ref.scatter(ssm_states, idx, final)
    _ref.zero_pads(y, idx, query_start_loc)
    return _ref.emit(y, u, out)


def inputs(shape, dtype, device, gen):
    T, Dm, N, G, S = shape["T"], shape["Dm"], shape["N"], shape.get("G", 1), shape.get("S", 1)
    qsl = I.seqs(T, S, device)
    S = qsl.numel() - 1
    idx, init = I.slots(shape, S, device)
    full = shape.get("optional", True)
    return dict(u=I.rand(gen, device, T, Dm, dtype=dtype),
                delta=I.rand(gen, device, T, Dm, dtype=dtype, scale=0.5, shift=-3),
                A=-torch.exp(I.rand(gen, device, Dm, N, scale=0.5)), B=I.rand(gen, device, T, G, N, dtype=dtype),
                C=I.rand(gen, device, T, G, N, dtype=dtype), D=I.opt(shape, I.rand(gen, device, Dm)),
                z=I.opt(shape, I.rand(gen, device, T, Dm, dtype=dtype)),
                delta_bias=I.opt(shape, I.rand(gen, device, Dm, scale=0.1)),
                ssm_states=I.rand(gen, device, S + 1, Dm, N, dtype=I.pool_dtype(shape, torch.float32, dtype)),
                query_start_loc=qsl, cache_indices=idx, has_initial_state=init, delta_softplus=full)


def nbytes(inp):
    u = inp["u"]
    per_token = 2 * I.nbytes(u) + I.nbytes(inp["delta"]) + I.nbytes(inp.get("z"))  # u, delta, z read; y written
    return (per_token + I.nbytes(inp["B"]) + I.nbytes(inp["C"]) + I.nbytes(inp["A"]) + I.nbytes(inp.get("D"))
            + I.nbytes(inp.get("delta_bias")) + I.nbytes(inp["query_start_loc"]) + I.nbytes(inp["cache_indices"])
            + I.nbytes(inp.get("has_initial_state"))
            + I.pool_traffic(inp, "ssm_states", "cache_indices", "has_initial_state"))


def flops(inp):
    """Per token, channel and state: decay x state + dt*B*u (2 multiply-adds), C . state (1): 6 flops
    (the exponential is counted apart, on the MUFU)."""
    T, Dm = inp["u"].shape
    return 6 * T * Dm * inp["A"].shape[1]


def _bad_groups(k):
    k["B"] = torch.cat([k["B"]] * 3, dim=1)


SPEC = OpSpec(
    name="selective_scan_varlen",
    args=("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "ssm_states", "query_start_loc",
          "cache_indices", "has_initial_state"),
    options=dict(delta_softplus=True, pad_slot_id=ck.PAD_SLOT_ID, out=None),
    pool="ssm_states", index="cache_indices",
    validate=validate_selective_scan_varlen, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=flops,
    tokens=I.tokens_T,
    shapes={
        "cpu": [dict(T=64, Dm=32, N=8, G=1, S=2), dict(T=256, Dm=32, N=8, G=1, S=2)],
        "gpu": [dict(T=1024, Dm=8192, N=16, G=1, S=1), dict(T=4096, Dm=8192, N=16, G=1, S=1),
                dict(T=16384, Dm=8192, N=16, G=1, S=1)],
        "contract": [dict(T=5, Dm=4, N=3, G=1, S=2, fresh=1, optional=False)],
        # one piece and several pieces of the scan's sequence split
        "aot": [dict(T=T, Dm=64, N=16, G=1, S=2, fresh=1, optional=o) for T in (200, 600) for o in (True, False)],
    },
    bad_inputs=(("B with a group count not dividing", "B", _bad_groups),),
    doc=__doc__,
)
