"""SSD stage 3: pass states across the chunks of each sequence.

One program per (sequence, head, block of the P*N state). It starts from the sequence's initial state
(read from the pool at cache_indices[s] when has_initial_state[s] and the request is not a pad, else
zeros), and for each chunk c of the sequence in order stores the state *before* the chunk into
prev_states[c], then h <- exp(dA_cs[c, last]) * h + states[c] (dA_cs[h, c, cs - 1] holds the chunk's
total, see ssd_chunk_cumsum). At the end it writes h into the pool
slot (live requests only; pad requests are neither read nor written; pool strides are honoured, so
page-major views work). A sequence without tokens writes its initial state (or zeros) back.

Each sequence walks its own chunks (seq_first[s] .. + ceil(len/cs)), so the reset at a sequence start
is structural: no chunk mixes two sequences and no state leaks from one request to the next.

The walk takes BLOCK_C chunks at a time: their states and decays are loaded as one [BLOCK_C, BLOCK]
tile (all loads in flight together, instead of one dependent load per chunk), the recurrence over the
tile is an associative scan of (a, s) pairs with (a1, s1).(a2, s2) = (a1 a2, a2 s1 + s2) (the carried
state folded into the first row), and row r of the result is stored as prev_states of chunk r + 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.impls.triton._common import launch, cdiv, interpreting, next_power_of_2

__all__ = ["ssd_state_passing"]


@triton.jit
def _combine(a1, s1, a2, s2):
    """(a1, s1) then (a2, s2) of h <- a * h + s."""
    return a1 * a2, a2 * s1 + s2


@triton.jit
def _state_passing_kernel(states_ptr, dA_ptr, chunk_len_ptr, seq_first_ptr, qsl_ptr, pool_ptr,
                          cache_idx_ptr, has_init_ptr, prev_ptr,
                          P, N, chunk_size, pad_slot_id,
                          stride_s_c, stride_s_h, stride_d_h, stride_d_c,
                          stride_pool_slot, stride_pool_h, stride_pool_p, stride_pool_n,
                          stride_prev_c, stride_prev_h,
                          CD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(2)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    me = e < P * N
    # (scalar flags enter the masks as limits on e: `vector & scalar` masks break the interpreter)
    p = (e // N).to(tl.int64)
    n = (e % N).to(tl.int64)
    q0 = tl.load(qsl_ptr + s).to(tl.int64)
    q1 = tl.load(qsl_ptr + s + 1).to(tl.int64)
    nch = (q1 - q0 + chunk_size - 1) // chunk_size
    slot = tl.load(cache_idx_ptr + s).to(tl.int64)
    live = slot != pad_slot_id
    use_init = live & (tl.load(has_init_ptr + s) != 0)
    slot = tl.where(live, slot, 0)
    pool_off = slot * stride_pool_slot + h * stride_pool_h + p * stride_pool_p + n * stride_pool_n
    st = tl.load(pool_ptr + pool_off, mask=e < tl.where(use_init, P * N, 0), other=0.0).to(CD)
    first = tl.load(seq_first_ptr + s, mask=nch > 0, other=0).to(tl.int64)
    e64 = e.to(tl.int64)
    rows = tl.arange(0, BLOCK_C)
    tl.store(prev_ptr + first * stride_prev_c + h * stride_prev_h + e64, st.to(prev_ptr.dtype.element_ty),
             mask=e < tl.where(nch > 0, P * N, 0))
    # BLOCK_C chunks at a time: every load of the block is in flight at once, and the recurrence
    # h <- exp(dA_cs[c, last]) * h + states[c] over the block is one associative scan (in registers).
    for k0 in range(0, nch, BLOCK_C):
        kr = k0 + rows
        mr = kr < nch
        c = first + kr.to(tl.int64)
        dec = tl.exp(tl.load(dA_ptr + h * stride_d_h + c * stride_d_c + chunk_size - 1, mask=mr, other=0.0))
        sv = tl.load(states_ptr + c[:, None] * stride_s_c + h * stride_s_h + e64[None, :],
                     mask=mr[:, None] & me[None, :], other=0.0).to(CD)
        a = tl.broadcast_to(dec[:, None], (BLOCK_C, BLOCK))  # padding rows: (a, s) = (1, 0), the identity
        sv = tl.where(kr[:, None] == k0, a * st[None, :] + sv, sv)  # the carried state enters at row 0
        _, hs = tl.associative_scan((a, sv), 0, _combine)
        # hs[r] = the state after chunk k0 + r = the state before chunk k0 + r + 1
        tl.store(prev_ptr + (c[:, None] + 1) * stride_prev_c + h * stride_prev_h + e64[None, :],
                 hs.to(prev_ptr.dtype.element_ty), mask=(kr + 1 < nch)[:, None] & me[None, :])
        st = tl.sum(tl.where(rows[:, None] == BLOCK_C - 1, hs, 0.0), 0)
    tl.store(pool_ptr + pool_off, st.to(pool_ptr.dtype.element_ty), mask=e < tl.where(live, P * N, 0))


def ssd_state_passing(states, dA_cs, chunk_len, seq_first, query_start_loc, ssm_states, cache_indices,
                      has_initial_state, chunk_size: int, *, pad_slot_id=-1, prev_dtype=None,
                      block=None, block_c=None, num_warps=4):
    """states (NC, H, P, N) -> prev_states (NC, H, P, N) in `prev_dtype` (default: states' dtype);
    writes each live sequence's final state into ssm_states[cache_indices[s]]. `block` state elements
    and `block_c` chunks per program step (GPU default 1024 = 8 a thread over 4 warps, so the scan over a
    chunk block stays inside each thread, and 8 chunks in flight; the ssd_varlen sweep tries first the settings
    with the fewest values a thread: 8 warps, or 16 chunks of 512 elements over 4)."""
    NC, H, P, N = states.shape
    S = query_start_loc.numel() - 1
    prev = torch.empty((NC, H, P, N), dtype=prev_dtype or states.dtype, device=states.device)
    if S == 0:
        return prev
    grid, args, kw = state_passing_call(states, dA_cs, chunk_len, seq_first, query_start_loc, ssm_states,
                                        cache_indices, has_initial_state.view(torch.int8), prev, chunk_size,
                                        pad_slot_id=pad_slot_id, block=block, block_c=block_c, num_warps=num_warps)
    launch(_state_passing_kernel, grid, *args, **kw)
    return prev


def state_passing_call(states, dA_cs, chunk_len, seq_first, query_start_loc, ssm_states, cache_indices, init, prev,
                       chunk_size: int, *, pad_slot_id=-1, block=None, block_c=None, num_warps=4):
    """`ssd_state_passing`'s launch into `prev` (at least one sequence) as (grid, arguments, keywords); `init`:
    has_initial_state as int8."""
    NC, H, P, N = states.shape
    S = query_start_loc.numel() - 1
    blk = block or (max(16, min(1024, next_power_of_2(P * N))) if interpreting() else 1024)
    bc = block_c or (4 if interpreting() else 8)
    CD = tl.float64 if states.dtype == torch.float64 else tl.float32
    grid = (S, H, cdiv(P * N, blk))
    args = (states, dA_cs, chunk_len, seq_first, query_start_loc, ssm_states, cache_indices, init,
            prev, P, N, chunk_size, pad_slot_id,
            states.stride(0), states.stride(1), dA_cs.stride(0), dA_cs.stride(1),
            *ssm_states.stride(), prev.stride(0), prev.stride(1))
    return grid, args, dict(CD=CD, BLOCK=blk, BLOCK_C=bc, num_warps=num_warps)
