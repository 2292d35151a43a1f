"""Mamba-2 SSD over packed varlen sequences (op `ssd_varlen` of harness.ops) as a Triton pipeline.

Stages (one file each, each testable alone, mirroring mamba_ssm's split):
  ssd_chunk_cumsum   chunk table (per-sequence chunk grid, built on the device) + dt processing, dA cumsum
  ssd_chunk_state    each chunk's own state contribution
  ssd_state_passing  states across the chunks of each sequence, initial states from / final states to the pool
  ssd_bmm            C . B^T per chunk and group
  ssd_chunk_scan     outputs: carried state + intra-chunk + D skip, z gate

ssd_varlen launches three kernels by default (TUNING["fuse_front"], TUNING["fused_cb"]): chunk_state
with the cumsum stage in its front, state_passing, and chunk_scan forming C . B^T in place (half types;
fp32 / fp64 keep ssd_bmm, their dots run on the FMA units). When the batch may hold a pad request (its
slot ids are not known on the host: CUDA-graph safe), a fourth small launch stores y = 0 over the pad
requests' tokens (the op contract); a program per request, live requests exit at once.

Accumulation in fp32 (fp64 for fp64 inputs). Intermediates: dt/dA (H, NC, cs), per-chunk states
(NC, H, P, N) in the compute dtype, states before each chunk in the activations' dtype for half types
(the compute dtype otherwise), CB (NC, G, cs, cs) in the compute dtype (when ssd_bmm runs).
NC <= T // cs + S. Chunk / head / token bases are formed in int64 (bug class 12); offsets inside a
tile in int32 only where the stage proves they fit.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from harness import ops as C_
from harness.impls.registry import provides
from harness.impls.triton import ssd_bmm as _bmm, ssd_chunk_cumsum as _cumsum, ssd_chunk_scan as _scan
from harness.impls.triton import ssd_chunk_state as _state, ssd_state_passing as _passing
from harness.impls.triton._common import HostPlans, Staged, device_guard, interpreting, launch_config, unit_stride
# the stages (each testable alone) are importable from here
from harness.impls.triton.ssd_bmm import bmm_call, ssd_bmm  # noqa: F401
from harness.impls.triton.ssd_chunk_cumsum import (chunk_table_size, cumsum_call, front_buffers,  # noqa: F401
                                                   ssd_chunk_cumsum)
from harness.impls.triton.ssd_chunk_scan import chunk_scan_call, fused_cb_ok, ssd_chunk_scan  # noqa: F401
from harness.impls.triton.ssd_chunk_state import ssd_chunk_state  # noqa: F401
from harness.impls.triton.ssd_state_passing import ssd_state_passing, state_passing_call  # noqa: F401

__all__ = ["ssd_varlen"]


@triton.jit
def _zero_pad_tokens_kernel(y_ptr, qsl_ptr, idx_ptr, pad_id, HP, P, sy_t, sy_h, sy_p, BLOCK: tl.constexpr):
    # one program per request: a pad request's tokens get y = 0 (all H * P values of each); others exit
    s = tl.program_id(0).to(tl.int64)
    if tl.load(idx_ptr + s).to(tl.int64) == pad_id:
        t0 = tl.load(qsl_ptr + s).to(tl.int64)
        t1 = tl.load(qsl_ptr + s + 1).to(tl.int64)
        e = tl.arange(0, BLOCK).to(tl.int64)
        for t in range(t0, t1):
            for c in range(0, HP, BLOCK):
                f = c + e
                tl.store(y_ptr + t * sy_t + (f // P) * sy_h + (f % P) * sy_p,
                         tl.zeros((BLOCK,), dtype=y_ptr.dtype.element_ty), mask=f < HP)

# Launch parameters per stage (block sizes, warps); None = the stage's default. Benchmarks may set them.
# "fused_cb": half-precision inputs skip ssd_bmm and form CB inside ssd_chunk_scan (tensor-core dots;
# no CB round trip through memory, one launch fewer); False restores the bmm + CB-reading scan.
# "fuse_front": ssd_chunk_cumsum's work runs inside ssd_chunk_state's launch (one launch fewer).
# chunk_scan: the end-to-end best on the H200 (`harness bench sweep --op ssd_varlen`): 0.436 ms at L=4096 and
# 1.33 ms at L=16384 against 0.577 / 2.19 ms for the stage's own default (block_m 128, 8 warps, 2 stages).
# The device's values in configs/<device>/ssd.json.
TUNING: dict = launch_config("ssd", {"cumsum": {}, "chunk_state": {}, "state_passing": {}, "bmm": {},
                                     "chunk_scan": {"block_m": 128, "block_k": 64, "num_warps": 4, "num_stages": 3},
                                     "fused_cb": True, "fuse_front": True})


_FRONT = ("dt_out", "dA", "chunk_seq", "chunk_start", "chunk_len", "seq_first")
# every launch-parameter table the plan reads: TUNING and the stages' GPU defaults (sweeps set them in place)
_CONFIGS = (TUNING, _state.GPU_DEFAULTS, _state.FMA_DEFAULTS, _scan.GPU_DEFAULTS, _scan.FMA_DEFAULTS)


def _plan(dims, call, dt_softplus, limit_repr):
    """One call's launches (`call`: the validator's arguments, `out=` last) from the validator's answer: (the
    `Staged` plan, or None where there is no sequence; y's shape). The stage functions' own launch builders
    (`*_call`) make the launches, on stand-ins of the call's tensors (named as in the signature; the index
    tensors unit-stride, has_initial_state as int8 "init8") and of the scratch. `limit_repr`: dt_limit's repr, a
    key of the plan beside its value (the plan holds the bounds' fp32 pairs, and -0.0 == 0.0)."""
    T, H, P, N, G, S = dims
    x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states = call[:10]
    dt_limit, pad_slot_id, out = call[13:]
    if S == 0:
        return None, (T, H, P)
    st = Staged()
    q, idx, hist = unit_stride(*call[10:13])
    xs, dts, As, Bs, Cs, pool, qs, idxs = (
        st.stand_in(n, t) for n, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("ssm_states", ssm_states),
                                       ("query_start_loc", q), ("cache_indices", idx)))
    Ds, zs, dtbs = (None if t is None else st.stand_in(n, t) for n, t in (("D", D), ("z", z), ("dt_bias", dt_bias)))
    init8 = st.stand_in("init8", hist.view(torch.int8))
    ys = st.stand_in("y", out if out is not None else torch.empty((T, H, P), dtype=x.dtype, device="meta"))
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    prev_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else cd
    NC = chunk_table_size(T, S, chunk_size)
    dev = x.device
    bufs = st.adopt(_FRONT, front_buffers(dts, qs, chunk_size, cd, NC, device="meta"), dev)
    dt_out, dA, _, chunk_start, chunk_len, seq_first = bufs
    states = st.buffer("states", (NC, H, P, N), cd, dev)
    if TUNING.get("fuse_front", True):
        front = dict(dt=dts, A=As, dt_bias=dtbs, query_start_loc=qs, chunk_size=chunk_size, dt_softplus=dt_softplus,
                     dt_limit=dt_limit, num_chunks=NC)
        grid, args, kw = _state.chunk_state_call(xs, Bs, dt_out, dA, chunk_start, chunk_len, states,
                                                 compute_dtype=cd, front=front, bufs=bufs, **TUNING["chunk_state"])
        st.add_call(_state._chunk_state_kernel, grid, args, **kw)
    else:
        grid, args, kw = cumsum_call(dts, dtbs, As, qs, chunk_size, bufs, dt_softplus, dt_limit, cd,
                                     **TUNING["cumsum"])
        st.add_call(_cumsum._chunk_cumsum_kernel, grid, args, **kw)
        grid, args, kw = _state.chunk_state_call(xs, Bs, dt_out, dA, chunk_start, chunk_len, states,
                                                 compute_dtype=cd, **TUNING["chunk_state"])
        st.add_call(_state._chunk_state_kernel, grid, args, **kw)
    prev = st.buffer("prev", (NC, H, P, N), prev_dtype, dev)
    grid, args, kw = state_passing_call(states, dA, chunk_len, seq_first, qs, pool, idxs, init8, prev, chunk_size,
                                        pad_slot_id=pad_slot_id, **TUNING["state_passing"])
    st.add_call(_passing._state_passing_kernel, grid, args, **kw)
    # CB in place for half types (tensor cores); fp32 / fp64 keep ssd_bmm on a GPU, but take the
    # in-place path under the interpreter too, so that CI runs it (the stage suite runs the other)
    fused = (TUNING.get("fused_cb", True) and fused_cb_ok(N)
             and (x.dtype in (torch.float16, torch.bfloat16) or interpreting()))
    cb = None
    if not fused:
        tb = dict(TUNING["bmm"])
        cb = st.buffer("cb", (NC, G, chunk_size, chunk_size), tb.pop("out_dtype", None) or cd, dev)
        grid, args, kw = bmm_call(Cs, Bs, chunk_start, chunk_len, cb, chunk_size, compute_dtype=cd, **tb)
        st.add_call(_bmm._bmm_kernel, grid, args, **kw)
    grid, args, kw = chunk_scan_call(xs, zs, Cs, Ds, cb, dt_out, dA, prev, chunk_start, chunk_len, ys,
                                     compute_dtype=cd, B=Bs, **TUNING["chunk_scan"])
    st.add_call(_scan._chunk_scan_kernel, grid, args, **kw)
    if T:
        blk = min(1024, triton.next_power_of_2(H * P))
        st.add_call(_zero_pad_tokens_kernel, (S,),
                    (ys, qs, idxs, int(pad_slot_id), H * P, P, ys.stride(0), ys.stride(1), ys.stride(2)), BLOCK=blk)
    return st.built(), (T, H, P)


_PLANS = HostPlans(C_.validate_ssd_varlen, _plan, _CONFIGS)


@provides("triton", "ssd_varlen")
def ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
               has_initial_state, *, dt_softplus=True, dt_limit=(0.0, math.inf), pad_slot_id=C_.PAD_SLOT_ID,
               out=None):
    """Mamba-2 SSD over packed sequences (see harness.ops for the contract)."""
    staged, yshape = _PLANS.plan((x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc,
                                  cache_indices, has_initial_state, dt_limit, pad_slot_id, out),
                                 (dt_softplus, repr(dt_limit)))
    y = out if out is not None else torch.empty(yshape, dtype=x.dtype, device=x.device)
    if staged is None:
        return y
    query_start_loc, cache_indices, has_initial_state = unit_stride(query_start_loc, cache_indices, has_initial_state)
    with device_guard(x):
        staged.run(dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states,
                        query_start_loc=query_start_loc, cache_indices=cache_indices,
                        init8=has_initial_state.view(torch.int8), y=y))
    return y
