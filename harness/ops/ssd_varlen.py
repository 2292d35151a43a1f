"""ssd_varlen: the Mamba-2 SSD prefill over packed sequences.

ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
           has_initial_state, *, dt_softplus=True, dt_limit=(0.0, inf), pad_slot_id=PAD_SLOT_ID, out=None) -> y
    Sequences may start anywhere inside a chunk of the packed stream.
    x (T, H, P); dt (T, H); A (H,); B, C (T, G, N); D (H,) or (H, P) | None; z (T, H, P) | None
    (y *= silu(z)); dt_bias (H,) | None; ssm_states (num_slots, H, P, N).
    A pad request (cache_indices[i] == pad_slot_id) reads and writes no slot and its tokens get y = 0.
"""
from __future__ import annotations

import torch

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops.spec import OpSpec
from reference.validate import check_tensor, fail


def validate_ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
                        has_initial_state, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None):
    xs = ck.act_shape(x, 3)
    if xs is not None and isinstance(B, torch.Tensor) and isinstance(ssm_states, torch.Tensor) \
            and type(chunk_size) is int and chunk_size >= 1 and ck.limit_ok(dt_limit):
        dev = x.device
        T, H, P = xs
        bs, ps = B.shape, ssm_states.shape
        if len(bs) == 3 and ck.fits(dt, (T, H), dev) and ck.fits(A, (H,), dev) \
                and ck.param_ok(D, ((H,), (H, P)), dev) and ck.opt_ok(z, xs, dev) and ck.opt_ok(dt_bias, (H,), dev) \
                and ps[1:] == (H, P, bs[2]) and ck.pool_ok(ssm_states, dev) and ck.out_ok(out, xs, x.dtype, dev):
            G = ck.bc_ok(B, C, T, H, None, dev)
            if G:
                S = ck.varlen_ok(query_start_loc, T, cache_indices, has_initial_state, ps[0], pad_slot_id, dev)
                if S is not None:
                    return T, H, P, bs[2], G, S
    return check_rules(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
                       has_initial_state, dt_limit, pad_slot_id, out)


def check_rules(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
                has_initial_state, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    check_tensor("x", x, ndim=3, dtypes=ck.ACT_DTYPES)
    T, H, P = x.shape
    check_tensor("dt", dt, shape=(T, H), dtypes=ck.ACT_DTYPES)
    check_tensor("A", A, shape=(H,), dtypes=ck.ACT_DTYPES)
    G, NB = ck.check_groups("B", B, T, H, "H")
    GC, NC = ck.check_groups("C", C, T, H, "H")
    if NC != NB or GC != G:
        fail("C", f"shape ({T}, {G}, {NB}) like B", f"shape {tuple(C.shape)}")
    N = NB
    ck.check_chunk_size(chunk_size)
    ck.check_param("D", D, [(H,), (H, P)])
    check_tensor("z", z, shape=(T, H, P), dtypes=ck.ACT_DTYPES, optional=True)
    check_tensor("dt_bias", dt_bias, shape=(H,), dtypes=ck.ACT_DTYPES, optional=True)
    ck.check_pool("ssm_states", ssm_states, (H, P, N))
    ck.check_dt_limit(dt_limit)
    S = ck.check_qsl_indices(query_start_loc, T, "cache_indices", cache_indices, ssm_states.shape[0], pad_slot_id)
    ck.check_flags("has_initial_state", has_initial_state, S)
    ck.same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states,
                   query_start_loc=query_start_loc, cache_indices=cache_indices, has_initial_state=has_initial_state)
    ck.check_out(out, (T, H, P), x.dtype, x.device)
    return T, H, P, N, G, S


def reference(cd, x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
              has_initial_state, *, dt_softplus=True, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID,
              out=None):
    from harness.ops import _ref
    from reference.ssd import ssd_scan
    validate_ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc,
                        cache_indices, has_initial_state, dt_limit, pad_slot_id, out)
    idx = _ref.slot_list(cache_indices, pad_slot_id)
    init = _ref.gather(ssm_states, idx, has_initial_state.tolist(), cd)
    up = _ref.up
    y, final = ssd_scan(up(x, cd), up(dt, cd), up(A, cd), up(B, cd), up(C, cd), up(D, cd), up(z, cd),
                        dt_bias=up(dt_bias, cd), dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                        cu_seqlens=query_start_loc.cpu().long(), initial_states=init)
    _ref.scatter(ssm_states, idx, final)
    _ref.zero_pads(y, idx, query_start_loc)
    return _ref.emit(y, x, out)


def inputs(shape, dtype, device, gen):
    T, H, P, G, N, S = shape["T"], shape["H"], shape["P"], shape["G"], shape["N"], shape.get("S", 1)
    qsl = I.seqs(T, S, device)
    S = qsl.numel() - 1
    idx, init = I.slots(shape, S, device)
    Dshape = (H, P) if shape.get("D_per_channel") else (H,)
    return dict(x=I.rand(gen, device, T, H, P, dtype=dtype),
                dt=I.rand(gen, device, T, H, dtype=dtype, scale=0.5, shift=-3),
                A=-torch.exp(I.rand(gen, device, H, scale=0.5)), B=I.rand(gen, device, T, G, N, dtype=dtype),
                C=I.rand(gen, device, T, G, N, dtype=dtype), chunk_size=shape.get("chunk", 256),
                D=I.opt(shape, I.rand(gen, device, *Dshape)), z=I.opt(shape, I.rand(gen, device, T, H, P, dtype=dtype)),
                dt_bias=I.opt(shape, I.rand(gen, device, H, scale=0.1)),
                ssm_states=I.rand(gen, device, S + 1, H, P, N, dtype=I.pool_dtype(shape, torch.float32, dtype)),
                query_start_loc=qsl, cache_indices=idx, has_initial_state=init, dt_softplus=True,
                **({"dt_limit": tuple(shape["dt_limit"])} if "dt_limit" in shape else {}))


def nbytes(inp):
    return (2 * I.nbytes(inp["x"]) + I.nbytes(inp.get("z")) + I.nbytes(inp["dt"]) + I.nbytes(inp["A"])
            + I.nbytes(inp["B"]) + I.nbytes(inp["C"]) + I.nbytes(inp.get("D")) + I.nbytes(inp.get("dt_bias"))
            + I.nbytes(inp["query_start_loc"]) + I.nbytes(inp["cache_indices"])
            + I.nbytes(inp.get("has_initial_state"))
            + I.pool_traffic(inp, "ssm_states", "cache_indices", "has_initial_state"))


def flops(inp):
    """The chunked form: C B^T and its causal product with x inside each chunk (half the square each),
    chunk states and their read-out (2 T H P N multiply-adds)."""
    T, H, P = inp["x"].shape
    G, N = inp["B"].shape[1:]
    L = min(int(inp["chunk_size"]), max(T, 1))
    return T * L * (N * G + P * H) + 4 * T * H * P * N


def _bad_groups(k):
    k["B"] = torch.cat([k["B"]] * 3, dim=1)


SPEC = OpSpec(
    name="ssd_varlen",
    args=("x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "ssm_states", "query_start_loc",
          "cache_indices", "has_initial_state"),
    options=dict(dt_softplus=True, dt_limit=(0.0, ck.INF), pad_slot_id=ck.PAD_SLOT_ID, out=None),
    pool="ssm_states", index="cache_indices",
    validate=validate_ssd_varlen, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=flops,
    tokens=I.tokens_T,
    shapes={
        "cpu": [dict(T=64, H=4, P=16, G=1, N=16, S=2, chunk=32), dict(T=256, H=4, P=16, G=1, N=16, S=2, chunk=32)],
        "gpu": [dict(T=4096, H=128, P=64, G=8, N=128, S=1, chunk=256),
                dict(T=16384, H=128, P=64, G=8, N=128, S=1, chunk=256)],
        "contract": [dict(T=5, H=2, P=3, G=1, N=4, S=2, chunk=4, fresh=1, optional=False)],
        # the pipeline with an fp32 pool (and every optional input) and with a pool in the activations' dtype
        "aot": [dict(T=600, H=8, P=64, G=2, N=128, S=2, chunk=256, fresh=1, D_per_channel=True,
                     dt_limit=(0.001, 0.1)),
                dict(T=600, H=8, P=64, G=2, N=128, S=2, chunk=256, fresh=1, optional=False, pool_dtype="act",
                     dt_limit=(0.001, 0.1))],
    },
    bad_inputs=(("B with a group count not dividing", "B", _bad_groups),),
    doc=__doc__,
)
