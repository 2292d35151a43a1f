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
from harness.impls.triton._common import launch, device_guard, interpreting, launch_config, unit_stride
from harness.impls.triton.ssd_bmm import ssd_bmm
from harness.impls.triton.ssd_chunk_cumsum import chunk_table_size, ssd_chunk_cumsum
from harness.impls.triton.ssd_chunk_scan import fused_cb_ok, ssd_chunk_scan
from harness.impls.triton.ssd_chunk_state import ssd_chunk_state
from harness.impls.triton.ssd_state_passing import ssd_state_passing

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


@provides("triton", "ssd_varlen")
def ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
               has_initial_state, *, dt_softplus=True, dt_limit=(0.0, math.inf), pad_slot_id=C_.PAD_SLOT_ID,
               out=None):
    """Mamba-2 SSD over packed sequences (see harness.ops for the contract)."""
    T, H, P, N, G, S = C_.validate_ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states,
                                               query_start_loc, cache_indices, has_initial_state, dt_limit,
                                               pad_slot_id, out)
    query_start_loc, cache_indices, has_initial_state = unit_stride(query_start_loc, cache_indices, has_initial_state)
    y = out if out is not None else torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    if S == 0:
        return y
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    prev_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else cd
    NC = chunk_table_size(T, S, chunk_size)
    with device_guard(x):
        if TUNING.get("fuse_front", True):
            front = dict(dt=dt, A=A, dt_bias=dt_bias, query_start_loc=query_start_loc, chunk_size=chunk_size,
                         dt_softplus=dt_softplus, dt_limit=dt_limit, num_chunks=NC)
            states, dt_out, dA, _, chunk_start, chunk_len, seq_first = ssd_chunk_state(
                x, B, None, None, None, None, compute_dtype=cd, front=front, **TUNING["chunk_state"])
        else:
            dt_out, dA, _, chunk_start, chunk_len, seq_first = ssd_chunk_cumsum(
                dt, A, dt_bias, query_start_loc, chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit,
                compute_dtype=cd, num_chunks=NC, **TUNING["cumsum"])
            states = ssd_chunk_state(x, B, dt_out, dA, chunk_start, chunk_len, compute_dtype=cd,
                                     **TUNING["chunk_state"])
        prev = ssd_state_passing(states, dA, chunk_len, seq_first, query_start_loc, ssm_states, cache_indices,
                                 has_initial_state, chunk_size, pad_slot_id=pad_slot_id, prev_dtype=prev_dtype,
                                 **TUNING["state_passing"])
        # CB in place for half types (tensor cores); fp32 / fp64 keep ssd_bmm on a GPU, but take the
        # in-place path under the interpreter too, so that CI runs it (the stage suite runs the other)
        fused = (TUNING.get("fused_cb", True) and fused_cb_ok(N)
                 and (x.dtype in (torch.float16, torch.bfloat16) or interpreting()))
        cb = None if fused else ssd_bmm(C, B, chunk_start, chunk_len, chunk_size, compute_dtype=cd, **TUNING["bmm"])
        ssd_chunk_scan(x, z, C, D, cb, dt_out, dA, prev, chunk_start, chunk_len, y, compute_dtype=cd, B=B,
                       **TUNING["chunk_scan"])
        if T:
            blk = min(1024, triton.next_power_of_2(H * P))
            launch(_zero_pad_tokens_kernel, (S,), y, query_start_loc, cache_indices, int(pad_slot_id), H * P, P,
                                          y.stride(0), y.stride(1), y.stride(2), BLOCK=blk)
    return y
