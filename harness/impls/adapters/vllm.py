"""Adapter for vLLM 0.33.0's Triton kernels (`--impl vllm`).

Where the code comes from: `SOURCE` extracts the kernel files from the vllm==0.33.0 wheel (about 0.4 MB)
behind our stubs (`_vllm_stubs`); where vllm itself is installed, the same module paths import it.

* causal_conv1d_varlen <- mamba.ops.causal_conv1d.causal_conv1d_fn on x as (dim, T) with stride(0) == 1
  (a token-major tensor's transpose, as vLLM's mixers pass it), metadata=None. Cache lines equal to
  `null_block_id` are skipped; vLLM's default null block is slot 0, so the adapter passes our pad id
  (the kernel's own `pad_slot_id` is the sentinel of unused programs, vLLM's PAD_SLOT_ID = -1).
  Without metadata the function copies the sequence lengths to the host to size its grid: vLLM's prefill
  conv is not CUDA-graph capturable (vLLM runs prefills eagerly and builds that metadata on the host).
  Widths 2..4 only (the varlen kernel's token loop handles no other width). Empty sequences launch no
  program, so the slots of empty live requests are set here as the contract says (the initial window,
  or zeros without one); vLLM never schedules an empty prefill.
* causal_conv1d_update <- causal_conv1d_update with conv_state_indices and null_block_id = our pad id
  (widths 2..6).
* selective_state_update <- mamba.ops.mamba_ssm.selective_state_update with null_block_id = our pad id.
  Mamba-2 layout: A, dt, dt_bias, D broadcast over P with stride-0 views (its tie_hdim path); Mamba-1
  layout: state (num_slots, Dm, N) as one head, one group of B/C only. It requires D and dt_bias (zeros
  are passed where the contract's are None). Not supported: dt_limit other than (0, inf) (no clamp), and
  without dt_softplus a negative dt (no clamp at 0).
* selective_state_update_spec <- the same selective_state_update in vLLM's speculative form: cu_seqlens =
  query_start_loc, state_batch_indices = dst_state_batch_indices = our (Bsz, num_spec + 1) slot table,
  num_accepted_tokens as given, null_block_id = our pad id. The kernel reads slot
  table[b, num_accepted_tokens[b] - 1] and stores the state after the row's token j into table[b, j] unless
  that is the null block; a row whose start slot is the null block stores nothing. This is our contract
  exactly (its reference is defined by this call); same limits as the one-token op.
* causal_conv1d_update_spec <- causal_conv1d_update with num_accepted_tokens, query_start_loc and
  max_query_len = num_spec + 1. vLLM keeps one conv slot per request, K - 1 + num_spec columns wide, and
  slides over it (it reads the window at columns a - 1 .., writes the window's newest K - 2 inputs and the
  row's tokens from column 0: the state after token j is columns j .. j + K - 2); our pool keeps each
  position's window in its own (D, K - 1) slot. The adapter builds vLLM's wide slots on the device, one per
  row (the start slot's window placed at columns a - 1 .., zeros where the kernel reads nothing), runs the
  kernel on them (rows that are not live get the null block) and writes window j of each live row into
  table[b, j]. Widths 2..6.
* ssd_varlen <- mamba.ops.ssd_combined.mamba_chunk_scan_combined_varlen with vLLM's per-request chunk
  metadata built on the device: every sequence is cut at multiples of chunk_size from its first token
  (vLLM counts from num_computed_tokens; the op has no prefix length, i.e. 0), giving cu_chunk_seqlens,
  last_chunk_indices (an empty sequence repeats the previous index, so its state passes through) and the
  per-chunk seq_idx. One host read sizes them (the chunk count; vLLM knows it from its CPU-side batch).
  Initial states are gathered as vLLM's Mamba-2 mixer does (torch.where(has_initial_state, pool[slot], 0),
  only when some request has one); the final states go straight into the pool through the kernel's
  final_states_out / final_state_indices when no request is a pad and the pool's (P, N) dims flatten to a
  view, else they come back and are written for the live requests only (the fused write has no pad check).
  chunk_size must be a power of 2. Decays only: it clamps the segment-sum exponents at 0, so A > 0, A = -inf
  or a negative dt_limit low end are declined. fp32 inputs run its tl.dot in TF32 on the GPU (fp32_matmul="tf32").
* gated_rms_norm <- mamba.ops.layernorm_gated.rms_norm_gated.
* gated_delta_rule_varlen <- third_party.flash_linear_attention.ops.chunk_gated_delta_rule (vLLM's copy of
  fla): bf16/fp16 only (it asserts against fp32 inputs).
* gated_delta_rule_update <- fused_recurrent_gated_delta_rule in vLLM's decode form: batch 1, cu_seqlens
  of one token per row, the pool as initial_state with ssm_state_indices and inplace_final_state=True.
* kda_varlen <- models.kimi_k3.nvidia.ops.third_party.kda.chunk_kda (the KDA kernels Kimi-Linear is served
  with in 0.33.0; log-decay gates, no fused gate).
* kda_update <- the same package's fused_recurrent_kda_fwd (use_gate_in_kernel=False), q/k/v as views of
  one packed buffer as vLLM passes them.
* gated_delta_rule_update_spec <- fused_recurrent_gated_delta_rule in vLLM's speculative form (as OLMo's GDN
  mixer calls it; Qwen3-Next's runs the fused-gate fused_sigmoid_gating_delta_rule_update with the same
  index arguments): cu_seqlens = query_start_loc, ssm_state_indices = our (Bsz, num_spec + 1) slot table,
  num_accepted_tokens as given, the pool in place. Per row the kernel reads slot
  table[b, num_accepted_tokens[b] - 1] before anything of the row is stored and stores the state after token
  j into table[b, j] unless that index is <= 0 (every position's state, as our contract). It reads the table
  at b * stride(0) + j (no column stride): a table with stride(1) != 1 is passed as a contiguous copy.
* kda_update_spec <- kimi_k3's fused_recurrent_kda_fwd in the same speculative form (2-D ssm_state_indices
  with stride(1) == 1, num_accepted_tokens; Kimi-K3's speculative path reaches it through fused_recurrent_kda
  with these index arguments and the gate activation fused), q/k/v packed as for kda_update. A row whose
  start index is <= 0 gets a zero output for its first token only.
The recurrent GDN/KDA kernels treat every slot index <= 0 as the null block: a live request on slot 0 (in
the speculative forms: a live row that starts from slot 0 or has a token whose slot is 0) is declined
(NotImplementedError), as is a pad id > 0; pads (index -1) are skipped by the kernels themselves, and their
output rows are left as the kernels leave them: the contract wants them 0, so a kernel that leaves them
unwritten fails the suites' pad-row check (the kernel's behaviour, reported as such). vLLM's own speculative
batches pad with rows of no tokens (null-block slots, num_accepted_tokens 1), which no kernel program runs.
The SSD has no pad ids: pad requests are computed with the others and their tokens' y set to 0 here.
Decode ops (conv update, Mamba state update, GDN / KDA update and their speculative forms) read nothing on the
host inside `harness.ops.no_index_checks()`, so they can be captured in a CUDA graph: the pool and the slot
ids go to the kernels as they are (the speculative conv's wide slots are built and written back with index
tensors of static shape, `harness.impls.adapters._spec_decode`), and the host-side declines that need the
indices or dt are not decided there: a live request on slot 0 is not looked for (live slot ids must be > 0
there, as the benchmark's are: slots 1..B), a batch of pads only reaches the kernels (which skip every row),
and the Mamba state update without dt_softplus is declined (a negative dt cannot be ruled out without
reading it). They index the pool
as dense slots, so a pool whose slots are not contiguous inside is declined. The chunked GDN/KDA prefill
runs the live non-empty sequences with states gathered from and written back to the pool on the device
(as vLLM's mixers do around these kernels), which serves slot 0 too; an empty live request keeps its
initial state (zeros without one). The chunk kernels must not see an empty sequence: the copy's
prepare_chunk_indices gives every later sequence's chunks the wrong sequence (docs/findings.md).
A decode call with no live row (an empty batch, no tokens, or pads only) reaches no kernel: its output is zeros and no
slot is touched (with B = 0 fused_recurrent_kda_fwd's stride asserts on the packed q/k/v views would fail).
Not adapted: selective_scan_varlen (vLLM's Mamba-1 prefill is a compiled _C op).
Under Triton's interpreter (CPU, fp32) only ssd_varlen and gated_rms_norm run; INTERPRETER_LIMITS says why
each other op cannot (interpreter limits, not vLLM bugs), so the Impl leaves those out there.
Every op validates with harness.ops first, so bad input fails as for our kernels.
"""
from __future__ import annotations

import math
import types

import torch

from harness import ops as C
from harness.impls.adapters import _spec_decode as SD
from harness.impls.adapters import (gather_slots, host_reads_ok, host_slots, import_peer, no_live_rows,
                                    zero_pad_tokens)
from harness.impls.adapters._interpret import unavailable_here
from harness.impls.adapters._source import PeerSource
from harness.impls.adapters._vllm_stubs import STUBS
from harness.impls.adapters.fla import _gather, _scatter, _varlen, validate_kda_chunk
from harness.impls.registry import Impl, register
from harness.impls.triton._common import interpreting

_MAMBA = "vllm/model_executor/layers/mamba/ops/"
_FLA = "vllm/third_party/flash_linear_attention/ops/"
_KDA = "vllm/models/kimi_k3/nvidia/ops/third_party/kda/"

SOURCE = PeerSource(
    wheel="vllm==0.33.0",
    files=tuple(_MAMBA + f for f in (
        "causal_conv1d.py", "mamba_ssm.py", "triton_helpers.py", "layernorm_gated.py", "ssd_bmm.py",
        "ssd_chunk_scan.py", "ssd_chunk_state.py", "ssd_combined.py", "ssd_state_passing.py",
        "configs/selective_state_update/*.json")) + tuple(_FLA + f for f in (
        "chunk.py", "chunk_delta_h.py", "chunk_o.py", "chunk_scaled_dot_kkt.py", "cumsum.py", "fused_recurrent.py",
        "index.py", "l2norm.py", "op.py", "solve_tril.py", "utils.py", "wy_fast.py")) + (
        "vllm/third_party/flash_linear_attention/LICENSE", _KDA + "*.py",
        "vllm/triton_utils/__init__.py", "vllm/triton_utils/tensor_descriptor.py",
        "vllm/triton_utils/force_first_config.py", "vllm/utils/math_utils.py",
        "vllm/v1/attention/backends/mamba_attn.py"),
    stubs=STUBS,
    packages=("vllm", "vllm/model_executor", "vllm/model_executor/layers", "vllm/model_executor/layers/mamba",
              "vllm/model_executor/layers/mamba/ops", "vllm/third_party", "vllm/third_party/flash_linear_attention",
              "vllm/third_party/flash_linear_attention/ops", "vllm/models", "vllm/models/kimi_k3",
              "vllm/models/kimi_k3/nvidia", "vllm/models/kimi_k3/nvidia/ops",
              "vllm/models/kimi_k3/nvidia/ops/third_party", "vllm/utils", "vllm/v1", "vllm/v1/attention",
              "vllm/v1/attention/backends"),
)

_CONV = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
_SSU = "vllm.model_executor.layers.mamba.ops.mamba_ssm"
_SSD = "vllm.model_executor.layers.mamba.ops.ssd_combined"
_NORM = "vllm.model_executor.layers.mamba.ops.layernorm_gated"
_GDN_CHUNK = "vllm.third_party.flash_linear_attention.ops.chunk"
_GDN_REC = "vllm.third_party.flash_linear_attention.ops.fused_recurrent"
_KDA_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
_MODULES = (_CONV, _SSU, _SSD, _NORM, _GDN_CHUNK, _GDN_REC, _KDA_OPS)


def _emit(y, out):
    if out is None:
        return y
    if y is not out:
        out.copy_(y)
    return out


def _idle(like, out):
    """The output of a decode call with no live row (an empty batch, or pads only): zeros, in `out` if given.
    Nothing reaches the kernels (vLLM launches none for an empty batch; an empty one trips their asserts)."""
    y = out if out is not None else torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return y.zero_()


# ----------------------------------------------------------------------------------------------- conv


def _segments(query_start_loc, size: int):
    """Cut every sequence of the packed batch into blocks of `size` tokens from its first token (the last
    block of a sequence may be shorter; an empty sequence has none). Returns, on the device of
    query_start_loc: the sequence of each block, its index inside the sequence, the running block count per
    sequence (int64), and the number of blocks (one host read: it sizes the tensors)."""
    q = query_start_loc.to(torch.int64)
    lens = q[1:] - q[:-1]
    n = (lens + size - 1) // size
    ends = torch.cumsum(n, 0)
    total = int(ends[-1]) if ends.numel() else 0
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), n, output_size=total)
    return seq, torch.arange(total, device=q.device) - (ends - n)[seq], ends, total


_CONV_BLOCK_M = 8  # tokens per program of vLLM's varlen conv kernel (BLOCK_M in causal_conv1d_fn)


def conv_metadata(query_start_loc):
    """The `metadata` vLLM's Mamba builders hand causal_conv1d_fn (nums_dict, batch_ptr,
    token_chunk_offset_ptr): one program per BLOCK_M tokens of one sequence, naming the sequence and the
    block inside it. vLLM builds it on the host from the CPU copy of query_start_loc; here it is built on
    the device of query_start_loc."""
    seq, j, _, total = _segments(query_start_loc, _CONV_BLOCK_M)
    batch_ptr, offsets = seq.to(torch.int32), j.to(torch.int32)
    nums = {_CONV_BLOCK_M: dict(tot=total, mlist=batch_ptr, mlist_len=total, offsetlist=offsets,
                                batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)}
    return types.SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)


def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, D, K, S = C.validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                 has_initial_state, activation, pad_slot_id, out)
    if K > 4:
        raise NotImplementedError(f"vllm causal_conv1d_fn: kernel widths 2..4 only, got {K}")
    mod = import_peer(_CONV)
    idx, live = host_slots(cache_indices, pad_slot_id)
    qsl = query_start_loc.detach().cpu().tolist()
    hi = has_initial_state.detach().cpu().tolist()
    y = out if out is not None else torch.empty_like(x)
    if T > 0:
        ys = mod.causal_conv1d_fn(x.t(), weight, bias, conv_states, query_start_loc, cache_indices=cache_indices,
                                  has_initial_state=has_initial_state, activation=activation,
                                  pad_slot_id=mod.PAD_SLOT_ID, null_block_id=pad_slot_id,
                                  metadata=conv_metadata(query_start_loc))
        y.copy_(ys.t())
    empty = [idx[i] for i in live if qsl[i + 1] == qsl[i] and not hi[i]]
    _scatter(conv_states, empty, torch.zeros((), dtype=conv_states.dtype))
    return y


def causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, *, activation=None,
                         pad_slot_id=C.PAD_SLOT_ID, out=None):
    _, _, K = C.validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation,
                                              pad_slot_id, out)
    if K > 6:
        raise NotImplementedError(f"vllm causal_conv1d_update: kernel widths 2..6 only, got {K}")
    if no_live_rows(conv_state_indices, pad_slot_id, conv_states):
        return _idle(x, out)
    y = out if out is not None else torch.empty_like(x)
    res = import_peer(_CONV).causal_conv1d_update(x, conv_states, weight, bias, activation,
                                                  conv_state_indices=conv_state_indices,
                                                  null_block_id=pad_slot_id, out=y)
    return _emit(res, y)


def causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens,
                              *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    """vLLM keeps one conv slot per request, K - 1 + num_spec columns wide, and slides over it: the kernel
    reads the window at columns a - 1 .. a + K - 3 (a = num_accepted_tokens) and rewrites columns
    0 .. K - 3 + T_b with the window's newest K - 2 inputs followed by the row's T_b tokens, so that the
    state after token j is columns j .. j + K - 2. Our pool keeps each position's window in its own slot:
    the adapter builds vLLM's wide slots on the device (one per row: the start slot's window at columns
    a - 1 .., zeros elsewhere, which the kernel does not read), runs vLLM's kernel on them with our
    num_accepted_tokens and query_start_loc (max_query_len = num_spec + 1; rows that are not live get the
    null block -1), and writes window j of each live row into table[b, j] for its T_b positions."""
    T, D, K, Bsz, S = C.validate_causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc,
                                                           conv_state_indices, num_accepted_tokens, activation,
                                                           pad_slot_id, out)
    if K > 6:
        raise NotImplementedError(f"vllm causal_conv1d_update: kernel widths 2..6 only, got {K}")
    if SD.idle(query_start_loc, conv_state_indices, num_accepted_tokens, pad_slot_id, conv_states, T):
        return _idle(x, out)
    lens, start, live = SD.rows(query_start_loc, conv_state_indices, num_accepted_tokens, pad_slot_id)
    acc = num_accepted_tokens.to(torch.int64)
    wide = torch.zeros((Bsz, D, K - 2 + S), dtype=conv_states.dtype, device=x.device)
    cols = ((acc - 1)[:, None] + torch.arange(K - 1, device=x.device)[None, :])[:, None, :].expand(Bsz, D, K - 1)
    wide.scatter_(2, cols, gather_slots(conv_states, start, live))
    lines = torch.where(live, torch.arange(Bsz, device=x.device), -1).to(torch.int32)
    y = out if out is not None else torch.empty_like(x)
    res = import_peer(_CONV).causal_conv1d_update(x, wide, weight, bias, activation, conv_state_indices=lines,
                                                  num_accepted_tokens=num_accepted_tokens,
                                                  query_start_loc=query_start_loc, max_query_len=S, null_block_id=-1,
                                                  out=y)
    windows = wide.unfold(2, K - 1, 1).permute(0, 2, 1, 3)  # (Bsz, S, D, K-1): the state after each position
    SD.scatter_positions(conv_states, conv_state_indices, SD.written(conv_state_indices, lens, live, pad_slot_id),
                         windows)
    return _emit(res, y)


# ------------------------------------------------------------------------------------------- mamba


def _no_dt_clamp(dt, dt_bias, dt_softplus, dt_limit, who):
    if tuple(float(v) for v in dt_limit) != (0.0, math.inf):
        raise NotImplementedError(f"vllm {who}: no dt_limit clamp")
    if not dt_softplus and not host_reads_ok():
        raise NotImplementedError(f"vllm {who}: no clamp of negative dt to 0 without dt_softplus, and inside "
                                  "no_index_checks() dt is not read on the host to rule a negative one out")
    if not dt_softplus and bool(((dt if dt_bias is None else dt + dt_bias) < 0).any()):
        raise NotImplementedError(f"vllm {who}: no clamp of negative dt to 0 (the contract's default dt_limit "
                                  "lower bound) without dt_softplus")


def _ssu_args(layout, x, dt, A, B, Cm, D, z, dt_bias):
    """vLLM's selective_state_update arguments for our layouts (the batch dim of x, dt, B, C, z as given):
    Mamba-2 with A, dt, dt_bias (and a per-head D) broadcast over P as stride-0 views (its tie_hdim path);
    Mamba-1 as one head, one group of B/C only. Zeros stand for a missing D or dt_bias (it requires both)."""
    if layout[0] == "mamba1" and layout[4] != 1:
        raise NotImplementedError("vllm selective_state_update (Mamba-1 layout): one group of B/C only")
    f32 = dict(dtype=torch.float32, device=x.device)
    if layout[0] == "mamba2":
        _, n, H, P, N, G = layout[:6]
        db = dt_bias if dt_bias is not None else torch.zeros(H, **f32)
        Dv = D if D is not None else torch.zeros(H, **f32)
        return (x, dt[:, :, None].expand(n, H, P), A[:, None, None].expand(H, P, N), B, Cm,
                Dv[:, None].expand(H, P) if Dv.dim() == 1 else Dv, db[:, None].expand(H, P), z)
    Dm = layout[2]
    return (x, dt, A, B, Cm, D if D is not None else torch.zeros(Dm, **f32),
            dt_bias if dt_bias is not None else torch.zeros(Dm, **f32), z)


def selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
                           dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    layout = C.validate_selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices,
                                               dt_limit, pad_slot_id, out)
    args = _ssu_args(layout, x, dt, A, B, Cm, D, z, dt_bias)
    if no_live_rows(state_batch_indices, pad_slot_id, state):
        return _idle(x, out)
    _no_dt_clamp(dt, None if dt_bias is None else dt_bias[None], dt_softplus, dt_limit, "selective_state_update")
    y = out if out is not None else torch.empty_like(x)
    xx, dd, AA, BB, CC, DD, db, zz = args
    import_peer(_SSU).selective_state_update(state, xx, dd, AA, BB, CC, DD, db, z=zz, dt_softplus=bool(dt_softplus),
                                             state_batch_indices=state_batch_indices, null_block_id=pad_slot_id,
                                             out=y)
    return y


def selective_state_update_spec(state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc, state_batch_indices,
                                num_accepted_tokens, *, dt_softplus=True, dt_limit=(0.0, C.INF),
                                pad_slot_id=C.PAD_SLOT_ID, out=None):
    """vLLM's speculative form of the same kernel: cu_seqlens = query_start_loc, state_batch_indices and
    dst_state_batch_indices both our slot table, num_accepted_tokens as given, null_block_id = our pad id.
    The kernel reads slot table[b, num_accepted_tokens[b] - 1] and stores the state after each token t of
    the row into table[b, t] unless that is the null block; a row whose start slot is the null block reads
    zeros and stores nothing (its outputs are computed from zeros, as the kernel leaves them)."""
    layout = C.validate_selective_state_update_spec(state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc,
                                                    state_batch_indices, num_accepted_tokens, dt_limit, pad_slot_id,
                                                    out)
    args = _ssu_args(layout, x, dt, A, B, Cm, D, z, dt_bias)
    if SD.idle(query_start_loc, state_batch_indices, num_accepted_tokens, pad_slot_id, state, x.shape[0]):
        return _idle(x, out)  # no kernel runs, so none of its limits applies
    _no_dt_clamp(dt, None if dt_bias is None else dt_bias[None], dt_softplus, dt_limit, "selective_state_update")
    y = out if out is not None else torch.empty_like(x)
    xx, dd, AA, BB, CC, DD, db, zz = args
    import_peer(_SSU).selective_state_update(
        state, xx, dd, AA, BB, CC, DD, db, z=zz, dt_softplus=bool(dt_softplus),
        state_batch_indices=state_batch_indices, dst_state_batch_indices=state_batch_indices,
        null_block_id=pad_slot_id, out=y, num_accepted_tokens=num_accepted_tokens, cu_seqlens=query_start_loc)
    return y


def chunk_metadata(query_start_loc, chunk_size: int):
    """vLLM's per-request SSD chunk grid for sequences that start at position 0, on the device of
    query_start_loc: (cu_chunk_seqlens (C+1,), last_chunk_indices (S,), seq_idx (C,)), int32. Chunks end
    at multiples of chunk_size from each sequence's start and at its end; an empty sequence has no chunk
    and repeats the previous sequence's last index (-1 for none)."""
    seq, j, ends, _ = _segments(query_start_loc, chunk_size)
    q = query_start_loc.to(torch.int64)
    cu = torch.cat([q[:-1][seq] + j * chunk_size, q[-1:]]).to(torch.int32)
    return cu, (ends - 1).to(torch.int32), seq.to(torch.int32)


def ssd_varlen(x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
               has_initial_state, *, dt_softplus=True, dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, H, P, N, G, S = C.validate_ssd_varlen(x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states,
                                             query_start_loc, cache_indices, has_initial_state, dt_limit,
                                             pad_slot_id, out)
    if chunk_size & (chunk_size - 1):
        raise NotImplementedError(f"vllm mamba_chunk_scan_combined_varlen: chunk_size a power of 2, got {chunk_size}")
    if float(dt_limit[0]) < 0 or not bool(((A <= 0) & torch.isfinite(A)).all()):
        raise NotImplementedError("vllm mamba_chunk_scan_combined_varlen: decays only (finite A <= 0, dt >= 0): "
                                  "it clamps segment-sum exponents at 0")
    idx, live = host_slots(cache_indices, pad_slot_id)
    y = out if out is not None and out.is_contiguous() else torch.empty_like(x)
    slots = cache_indices.to(torch.int64)
    is_live = slots != pad_slot_id
    use_init = has_initial_state.to(torch.bool) & is_live
    if T == 0:  # nothing to launch: every live request keeps its initial state (zeros without one)
        if live:
            rows = torch.tensor(live, device=x.device)
            keep = use_init[rows][:, None, None, None]
            ssm_states[slots[rows]] = torch.where(keep, ssm_states[slots[rows]], 0).to(ssm_states.dtype)
        return _emit(y, out)
    init = None
    if bool(use_init.any()):
        init = torch.where(use_init[:, None, None, None], ssm_states[torch.where(is_live, slots, 0)], 0)
    cu_chunk, last_chunk, seq_idx = chunk_metadata(query_start_loc, chunk_size)
    fused = len(live) == S and ssm_states.stride(-2) == ssm_states.shape[-1] * ssm_states.stride(-1)
    states = import_peer(_SSD).mamba_chunk_scan_combined_varlen(
        x, dt, A, B, Cm, chunk_size, query_start_loc, cu_chunk, last_chunk, seq_idx, y, D=D, z=z, dt_bias=dt_bias,
        initial_states=init, dt_softplus=bool(dt_softplus), dt_limit=tuple(float(v) for v in dt_limit),
        state_dtype=ssm_states.dtype, final_states_out=ssm_states if fused else None,
        final_state_indices=cache_indices if fused else None)
    zero_pad_tokens(y, query_start_loc, cache_indices, pad_slot_id)  # it has no pad ids: computed like the rest
    if not fused and live:  # states[i] = states of chunk last_chunk_indices[i]: not the state of an empty one
        rows = torch.tensor(live, device=x.device)
        q = query_start_loc.to(torch.int64)
        ran = (q[1:] - q[:-1])[rows] > 0
        kept = torch.where(use_init[rows][:, None, None, None], ssm_states[slots[rows]], 0)
        ssm_states[slots[rows]] = torch.where(ran[:, None, None, None], states[rows], kept).to(ssm_states.dtype)
    return _emit(y, out)


def gated_rms_norm(x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None):
    C.validate_gated_rms_norm(x, weight, z, eps, group_size, out)
    y = import_peer(_NORM).rms_norm_gated(x, weight, None, z=z, eps=eps, group_size=group_size,
                                          norm_before_gate=norm_before_gate)
    return _emit(y, out)


# ------------------------------------------------------------------------------------------ GDN / KDA


def _check_pool(pool, who):
    V, K = pool.shape[-2:]
    if tuple(pool.stride()[1:]) != (V * K, K, 1):
        raise NotImplementedError(f"vllm {who}: indexes the pool as dense slots (slot interior not contiguous)")


def _decline_slot0(indices, pad_slot_id, who):
    """The recurrent kernels skip every row whose slot index is <= 0 (the null block). Where the host may read
    the indices a live request on slot 0 is declined; inside `no_index_checks()` (CUDA-graph capture, the
    benchmark loop) it is not looked for: there live slot ids must be > 0, as the benchmark's are (slots
    1..B), or that row's output is unspecified and its state is not updated."""
    if pad_slot_id > 0:
        raise NotImplementedError(f"vllm {who}: pads must be slot ids <= 0 (its null block), got {pad_slot_id}")
    if not host_reads_ok():
        return
    idx, live = host_slots(indices, pad_slot_id)
    if any(idx[i] == 0 for i in live):
        raise NotImplementedError(f"vllm {who}: slot index <= 0 is its null block (a live request on slot 0)")


def _chunked(fn):
    """fla-style chunked call of vLLM's copy (no state_v_first: its states are value-major already)."""
    def call(q, k, v, *, state_v_first, cu_seqlens, **kw):
        return fn()(q, k, v, cu_seqlens=cu_seqlens.to(torch.int32), **kw)
    return call


def _validate_gdn_varlen(q, *args, **kw):
    """The contract's validation, then vLLM's dtype limit: both before the adapter writes any slot."""
    C.validate_gated_delta_rule_varlen(q, *args, **kw)
    if q.dtype == torch.float32:
        raise NotImplementedError("vllm chunk_gated_delta_rule: no float32 inputs (it asserts bf16/fp16)")


def gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *,
                            scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _varlen(_chunked(lambda: import_peer(_GDN_CHUNK).chunk_gated_delta_rule), _validate_gdn_varlen,
                   q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                   use_qk_l2norm, pad_slot_id, out)


def kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *, scale=None,
               use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _varlen(_chunked(lambda: import_peer(_KDA_OPS).chunk_kda), validate_kda_chunk("vllm chunk_kda"), q, k,
                   v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale, use_qk_l2norm,
                   pad_slot_id, out)


def gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
                            pad_slot_id=C.PAD_SLOT_ID, out=None):
    Bsz, Hk, Hv, K, V = C.validate_gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, scale=scale,
                                                           use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id,
                                                           out=out)
    who = "fused_recurrent_gated_delta_rule"
    _decline_slot0(state_indices, pad_slot_id, who)
    _check_pool(ssm_states, who)
    if scale is not None and scale <= 0:
        raise NotImplementedError(f"vllm {who}: scale > 0 only (it asserts), got {scale}")
    if no_live_rows(state_indices, pad_slot_id, ssm_states):
        return _idle(v, out)
    cu = torch.arange(Bsz + 1, dtype=torch.int32, device=q.device)
    o, _ = import_peer(_GDN_REC).fused_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=ssm_states,
        inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=state_indices,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
    return _emit(o[0], out)


def _packed_qkv(q, k, v):
    """q, k, v (n, H, K / V) as views (1, n, H, ...) of one packed projection, one token stride for all three,
    as vLLM passes them to the KDA kernels."""
    n, H, K = q.shape
    V = v.shape[2]
    W = 2 * H * K + H * V
    qkv = torch.cat([q.reshape(n, H * K), k.reshape(n, H * K), v.reshape(n, H * V)], dim=1)
    # explicit strides: a view would give a size-1 token dim its own stride (kimi_k3's launcher asserts that
    # q, k and v share stride(1), also for one token)
    return (qkv.as_strided((1, n, H, K), (n * W, W, K, 1), qkv.storage_offset()),
            qkv.as_strided((1, n, H, K), (n * W, W, K, 1), qkv.storage_offset() + H * K),
            qkv.as_strided((1, n, H, V), (n * W, W, V, 1), qkv.storage_offset() + 2 * H * K))


def kda_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
               pad_slot_id=C.PAD_SLOT_ID, out=None):
    Bsz, H, _, K, V = C.validate_kda_update(q, k, v, g, beta, ssm_states, state_indices, scale=scale,
                                            use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id, out=out)
    who = "fused_recurrent_kda"
    _decline_slot0(state_indices, pad_slot_id, who)
    _check_pool(ssm_states, who)
    # (B = 0 would also fail its stride asserts on the packed views)
    if no_live_rows(state_indices, pad_slot_id, ssm_states):
        return _idle(v, out)
    qv, kv, vv = _packed_qkv(q, k, v)
    cu = torch.arange(Bsz + 1, dtype=torch.int32, device=q.device)
    o, _ = import_peer(_KDA_OPS).fused_recurrent_kda_fwd(
        qv, kv, vv, g.contiguous()[None], beta.contiguous()[None], scale=scale, initial_state=ssm_states,
        inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=state_indices,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm), use_gate_in_kernel=False)
    return _emit(o[0], out)


def _spec_table(table):
    """The slot table as the recurrent kernels read it: row b at b * stride(0), position j at + j (they take no
    column stride; kimi_k3's KDA launcher asserts stride(1) == 1)."""
    return table if table.stride(1) == 1 else table.clone(memory_format=torch.contiguous_format)


def _decline_spec_slot0(query_start_loc, table, num_accepted_tokens, pad_slot_id, who):
    """The speculative form skips a row whose start slot is <= 0 (the null block) and does not store a
    position whose slot is <= 0. Where the host may read the indices a live row that starts from slot 0, or
    has a token whose slot is 0, is declined; inside `no_index_checks()` it is not looked for (live slot ids
    must be > 0 there)."""
    if pad_slot_id > 0:
        raise NotImplementedError(f"vllm {who}: pads must be slot ids <= 0 (its null block), got {pad_slot_id}")
    if not host_reads_ok():
        return
    lens, start, live = SD.rows(query_start_loc, table, num_accepted_tokens, pad_slot_id)
    written = SD.written(table, lens, live, pad_slot_id)
    if bool((live & (start == 0)).any()) or bool((written & (table == 0)).any()):
        raise NotImplementedError(f"vllm {who}: slot index <= 0 is its null block (a live row reads or writes "
                                  "slot 0)")


def gated_delta_rule_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                                 *, scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    """fused_recurrent_gated_delta_rule in vLLM's speculative form (OLMo's GDN mixer): the packed rows as
    batch 1 with cu_seqlens = query_start_loc, the pool as initial_state with inplace_final_state=True,
    ssm_state_indices = our (Bsz, num_spec + 1) slot table, num_accepted_tokens as given. Per row the kernel
    reads slot table[b, num_accepted_tokens[b] - 1] and stores the state after token j into table[b, j]
    unless that index is <= 0; a row whose start index is <= 0 returns at once (its outputs unwritten)."""
    C.validate_gated_delta_rule_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices,
                                            num_accepted_tokens, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                            pad_slot_id=pad_slot_id, out=out)
    who = "fused_recurrent_gated_delta_rule"
    _decline_spec_slot0(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, who)
    _check_pool(ssm_states, who)
    if scale is not None and scale <= 0:
        raise NotImplementedError(f"vllm {who}: scale > 0 only (it asserts), got {scale}")
    if SD.idle(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, ssm_states, q.shape[0]):
        return _idle(v, out)
    o, _ = import_peer(_GDN_REC).fused_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=ssm_states,
        inplace_final_state=True, cu_seqlens=query_start_loc.contiguous(),
        ssm_state_indices=_spec_table(state_indices), num_accepted_tokens=num_accepted_tokens.contiguous(),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
    return _emit(o[0], out)


def kda_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, *,
                    scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    """kimi_k3's fused_recurrent_kda_fwd in its speculative form (Kimi-K3's verify step): as the one-token op
    (q, k, v as views of one packed buffer, use_gate_in_kernel=False, the pool in place) with cu_seqlens =
    query_start_loc, ssm_state_indices = our slot table (stride(1) == 1, asserted) and num_accepted_tokens.
    Start slot and stores as in gated_delta_rule_update_spec; a row whose start index is <= 0 gets a zero
    output for its first token only (its later tokens' outputs are left unwritten)."""
    C.validate_kda_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                               scale=scale, use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id, out=out)
    who = "fused_recurrent_kda"
    _decline_spec_slot0(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, who)
    _check_pool(ssm_states, who)
    if SD.idle(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, ssm_states, q.shape[0]):
        return _idle(v, out)
    qv, kv, vv = _packed_qkv(q, k, v)
    o, _ = import_peer(_KDA_OPS).fused_recurrent_kda_fwd(
        qv, kv, vv, g.contiguous()[None], beta.contiguous()[None], scale=scale, initial_state=ssm_states,
        inplace_final_state=True, cu_seqlens=query_start_loc.contiguous(),
        ssm_state_indices=_spec_table(state_indices), num_accepted_tokens=num_accepted_tokens.contiguous(),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm), use_gate_in_kernel=False)
    return _emit(o[0], out)


# Ops whose kernels Triton's interpreter cannot run (so under TRITON_INTERPRET=1 the Impl leaves them out and
# the suites skip them with "does not provide"); the GPU runs them all.
INTERPRETER_LIMITS = {
    "causal_conv1d_varlen": "its launch-grid function stores the program tables into the launch arguments, "
                            "which the interpreter then hands the kernel as host tensors",
    "causal_conv1d_update": "a masked load whose mask combines a tensor with a scalar (its null-block test) "
                            "fails there ('mask has unsupported dtype')",
    "selective_state_update": "the same scalar-and-tensor mask (its null-block test)",
    "causal_conv1d_update_spec": "the scalar-and-tensor mask of causal_conv1d_update (its cache-line bound)",
    "selective_state_update_spec": "the scalar-and-tensor mask of selective_state_update (its null-block test)",
    "gated_delta_rule_varlen": "vLLM's fla copy calls tl.exp / tl.log through module aliases, which the "
                               "interpreter does not patch ('Did you forget to add @triton.jit ?')",
    "gated_delta_rule_update": "the same tl.exp aliases", "kda_varlen": "the same tl.exp aliases",
    "kda_update": "the same tl.exp aliases", "gated_delta_rule_update_spec": "the same tl.exp aliases",
    "kda_update_spec": "the same tl.exp aliases",
}

OPS = {"causal_conv1d_varlen": causal_conv1d_varlen, "causal_conv1d_update": causal_conv1d_update,
       "causal_conv1d_update_spec": causal_conv1d_update_spec, "selective_state_update": selective_state_update,
       "selective_state_update_spec": selective_state_update_spec, "ssd_varlen": ssd_varlen,
       "gated_rms_norm": gated_rms_norm,
       "gated_delta_rule_varlen": gated_delta_rule_varlen, "gated_delta_rule_update": gated_delta_rule_update,
       "gated_delta_rule_update_spec": gated_delta_rule_update_spec, "kda_varlen": kda_varlen,
       "kda_update": kda_update, "kda_update_spec": kda_update_spec}


def _unavailable():
    return unavailable_here("vLLM's", "vllm (or its extracted kernels: python scripts/peers_fetch.py vllm)",
                            *_MODULES)


register(Impl(name="vllm", reads_host=True, devices=("cuda", "cpu"),
              ops={k: f for k, f in OPS.items() if not (interpreting() and k in INTERPRETER_LIMITS)},
              dtypes=(torch.float32,) if interpreting() else (torch.float32, torch.float16, torch.bfloat16),
              fp32_matmul="tf32", unavailable=_unavailable,
              description="vLLM 0.33.0 Triton kernels (conv, Mamba state update, GDN / KDA decode and their "
                          "speculative forms, chunked SSD, gated RMSNorm, GDN / KDA prefill); cpu via "
                          "TRITON_INTERPRET=1: fp32 ssd_varlen and gated_rms_norm only"))
