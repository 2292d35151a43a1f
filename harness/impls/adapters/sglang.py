"""Adapter for SGLang 0.5.23's Triton / PyTorch SSM kernels (the kernel files of the `sglang` wheel).

The wheel is platform-tagged (it carries compiled Rust extensions for the server and the radix tree), but
every kernel used here is a pure Python / Triton file: `SOURCE` extracts only those, with stand-ins for the
engine modules they import (`_sglang_stubs`). Where the `sglang` package itself is installed, it is imported
instead. Not provided: SGLang's CUDA causal conv (`causal_conv1d_fwd` / `_update`, JIT-compiled from
`kernels/jit/csrc/mamba/causal_conv1d.cuh` through tvm-ffi, its default on CUDA): the adapter runs the Triton
conv that SGLang uses elsewhere (`causal_conv1d_triton`).

Impl `sglang` (cuda only: the Triton entry points enter `torch.get_device_module(dev).device(i)`, which torch
has not for CPU, and the causal-conv kernels use masks Triton's interpreter rejects; called with CPU tensors
they validate and then decline. Its PyTorch Mamba-1 prefill runs anywhere: `MAMBA1` below, unregistered,
offers it alone for a CPU run):
* causal_conv1d_varlen   <- kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn on the channel-last
  view x.T, with SGLang's own per-request slot, has_initial_state and pad handling.
* causal_conv1d_update   <- causal_conv1d_triton.causal_conv1d_update (pads skipped by the kernel).
* selective_state_update <- kernels.ops.mamba.triton_ops.mamba_ssm.selective_state_update. Mamba-2: A, dt,
  dt_bias, D broadcast over P with stride-0 views (its tied-head-dim path). Mamba-1: SGLang's own mapping
  (mamba1.py): heads = channels, head dim 1, one group of B/C. None D / dt_bias are passed as zeros (its
  launch unpacks their strides). Not supported: dt_limit other than (0, inf) (no clamp); dt_softplus=False
  with a negative dt (no clamp to the default lower bound 0); Mamba-1 with more than one B/C group.
* causal_conv1d_update_spec, selective_state_update_spec <- SGLang's target verify of speculative decoding as
  MambaMixer2 runs it for a chain of drafts (topk 1: no EAGLE tree, retrieve_* None): causal_conv1d_update
  with `intermediate_conv_window` and selective_state_update with disable_state_update=True and
  `intermediate_states_buffer` (cache_steps = the row length), on rows of one fixed token count, with
  `intermediate_state_indices` = the row. The kernels record the window / state after each token of each row
  in those scratch buffers; SGLang's accept step then copies the accepted one into the request's main slot
  (`fused_mamba_state_scatter_with_mask`), and the next verify starts from that slot. Our contract names a
  slot per position and a start slot per row instead, so the adapter: pads the packed rows to num_spec + 1
  tokens (the padding positions' results are dropped), gives the SSU kernel each row's start slot
  table[b, num_accepted_tokens[b] - 1] (the pad id for a row that is not live) and the conv kernel a scratch
  line holding that slot's window (its conv kernel also rewrites the line it starts from), and writes the
  recorded state / window after position j into table[b, j] for the row's T_b positions, on the device.
  Same limits as the one-token ops (widths 2..5, with the width-5 bug of docs/findings.md; dt_limit (0, inf) only;
  no negative dt without softplus; one B/C group for Mamba-1).
* ssd_varlen             <- triton_ops.ssd_combined.mamba_chunk_scan_combined on the packed batch as batch 1,
  with seq_idx, chunk_indices / chunk_offsets built as SGLang's Mamba2Metadata.prepare_mixed builds them
  (the latter only when a request has an initial state) and the initial states gathered the way
  MambaMixer2 does (`torch.where(has_initial_state, pool[idx], 0)`). Not supported: an empty sequence in a
  batch of tokens (SGLang schedules none; its chunk tables are wrong for one, see docs/findings.md).
* gated_rms_norm         <- kernels.ops.attention.fla.layernorm_gated.rms_norm_gated (CUDA only: it sizes
  its launch by the GPU's SM count).
* gated_delta_rule_varlen <- fla.chunk.chunk_gated_delta_rule; kda_varlen <- fla.kda.chunk_kda. Both take
  the pool and a slot per sequence and write the final states back in place; there is no has_initial_state
  (a slot is read unless its index is negative). Only the live non-empty sequences run (SGLang schedules
  no empty prefill, and its chunk kernels go wrong for a batch that holds one); an empty live request gets
  the contract's result from the adapter (its slot keeps its initial state, zeros without one), pads are
  left out (zero outputs). When every request that runs has an initial state and the pool is one
  contiguous tensor, the adapter runs them in place on the pool (SGLang's serving path). Otherwise it
  runs them on a scratch copy of the named slots (zeros for requests without an initial state) and
  writes the final states back: a request without an initial state must not see its slot's stale state,
  and its slot is written only once, with its final state; SGLang's GDN backend does the same gather for
  strided pools, whose in-place writes its prefill kernels lose. Not supported: float32 / float64
  activations for GDN (chunk_gated_delta_rule asserts bf16 / fp16). chunk_kda writes its output into v:
  the adapter passes a copy.
* gated_delta_rule_update <- fla.fused_recurrent.fused_recurrent_gated_delta_rule_update (the plain g /
  beta form of SGLang's recurrent decode; the serving path fuses the gate activation into it). In place on
  a contiguous pool, through a scratch copy otherwise (its input guard makes every tensor contiguous, so a
  strided pool would be copied and its update lost). Not supported: scale <= 0.
* kda_update             <- fla.kda.fused_recurrent_kda on states gathered from the pool (every row; zeros
  for pads), written back for the live rows; pad outputs are zeroed.
* gated_delta_rule_update_spec <- the same fused_recurrent_gated_delta_rule_update in SGLang's target-verify
  form (the GDN backend's TritonGDNKernel.target_verify passes these arguments to the fused-gate variant,
  kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py): cu_seqlens = query_start_loc,
  disable_state_update=True, `intermediate_states_buffer` (Bsz, num_spec + 1, H, V, K) in the pool's dtype
  with cache_steps = num_spec + 1 and intermediate_state_indices = the row (-1 for a row that is not live),
  retrieve_parent_token None (a chain of drafts). The kernel starts each row from initial_state_indices
  (here the row's start slot table[b, num_accepted_tokens[b] - 1], -1 for a row that is not live: zeros,
  nothing stored) and records the state after each of its tokens; the adapter writes the state after position
  j of each live row into table[b, j] for its T_b positions, on the device (SGLang's accept step copies the
  accepted one into the request's slot instead). A strided pool is read through a scratch copy of the start
  slots. Padding rows' outputs are computed from a zero state, as for the one-token op. Same limits as
  gated_delta_rule_update (scale > 0, no float64).
* Not provided: kda_update_spec. SGLang's KDA verify (srt/layers/attention/linear/kernels/kda_triton.py,
  TritonKDAKernel.target_verify) runs fused_sigmoid_gating_delta_rule_update with is_kda=True, which computes
  the decay (-exp(A_log) * softplus(a + dt_bias), or the lower-bound form) and beta (sigmoid(b)) inside the
  kernel: the contract's g and beta reach it only through inverted activations, not exactly. The plain-gate
  fla.kda.fused_recurrent_kda (kda_update's kernel) stores one final state per sequence: no state per
  position and no start-slot index.
Decode ops (conv update, Mamba state update, GDN / KDA update and the speculative forms) read nothing on the
host inside
`harness.ops.no_index_checks()`, so they can be captured in a CUDA graph: pads go to the kernels as
negative indices or, through a scratch copy, are gathered and scattered on the device
(`harness.impls.adapters.gather_slots` / `scatter_slots`); a batch of pads only is then not recognised and
runs (no slot read or written), and the Mamba state update without dt_softplus is declined (a negative dt
cannot be ruled out without reading it).
* selective_scan_varlen  <- srt.layers.attention.mamba.mamba1.MambaMixer1._selective_scan, SGLang's Mamba-1
  prefill: a PyTorch loop over tokens, per sequence, with the prefill's softplus, D skip and silu gate around
  it as `_forward_prefill` does. Not supported: more than one B/C group.
Pool layouts match the contract: conv (slots, D, K-1); Mamba-2 (slots, H, P, N); delta rule (slots, H, V, K)
value-major, SGLang's own layout; SGLang keeps the Mamba-1 state as (slots, Dm, 1, N), a view of ours.
An empty batch (no tokens, no rows, or pad rows only) reaches no kernel: the adapter returns zeros and gives
the slots of empty live prefill requests the contract's result (SGLang never launches a kernel for one).
Every op validates with harness.ops first, so bad input fails as for our kernels.
"""
from __future__ import annotations

import math

import torch

from harness import ops as C
from harness.impls.adapters import _spec_decode as SD
from harness.impls.adapters import (gather_slots, host_reads_ok, host_slots, import_peer, mask_rows, no_live_rows,
                                    require_kda_gate_floor, scatter_slots, unavailable_reason, zero_pad_tokens)
from harness.impls.adapters._sglang_stubs import STUBS
from harness.impls.adapters._source import PeerSource
from harness.impls.registry import Impl, register

_FLA = "sglang/kernels/ops/attention/fla/"
SOURCE = PeerSource(
    wheel="sglang==0.5.23",
    files=(
        "sglang/kernels/ops/mamba/causal_conv1d_triton.py",
        "sglang/kernels/ops/mamba/triton_ops/*.py",
        *(_FLA + f + ".py" for f in (
            "chunk", "chunk_delta_h", "chunk_fwd", "chunk_intra", "chunk_intra_token_parallel", "chunk_o",
            "cumsum", "fused_norm_gate", "fused_recurrent", "index", "kda", "l2norm", "layernorm_gated", "op",
            "utils", "wy_fast")),
        "sglang/srt/layers/attention/mamba/mamba2_metadata.py",
        "sglang/srt/layers/attention/mamba/mamba1.py",
    ),
    stubs=STUBS,
    packages=("sglang", "sglang/kernels", "sglang/kernels/jit", "sglang/kernels/ops",
              "sglang/kernels/ops/mamba", "sglang/kernels/ops/attention", "sglang/kernels/ops/attention/fla",
              "sglang/srt", "sglang/srt/layers", "sglang/srt/layers/attention",
              "sglang/srt/layers/attention/mamba", "sglang/srt/layers/quantization", "sglang/srt/model_executor",
              "sglang/srt/model_loader"),
)

_CONV = "sglang.kernels.ops.mamba.causal_conv1d_triton"
_SSU = "sglang.kernels.ops.mamba.triton_ops.mamba_ssm"
_SSD = "sglang.kernels.ops.mamba.triton_ops.ssd_combined"
_META = "sglang.srt.layers.attention.mamba.mamba2_metadata"
_NORM = "sglang.kernels.ops.attention.fla.layernorm_gated"
_GDN = "sglang.kernels.ops.attention.fla.chunk"
_REC = "sglang.kernels.ops.attention.fla.fused_recurrent"
_KDA = "sglang.kernels.ops.attention.fla.kda"
_M1 = "sglang.srt.layers.attention.mamba.mamba1"
MODULES = (_CONV, _SSU, _SSD, _META, _NORM, _GDN, _REC, _KDA, _M1)


def _on_gpu(t, what):
    """SGLang's Triton entry points run on CUDA tensors only: they enter `torch.get_device_module(dev).device(i)`
    (torch's CPU module has none) and the causal-conv kernels use masks Triton's interpreter rejects."""
    if t.device.type != "cuda":
        raise NotImplementedError(f"sglang {what}: CUDA only (its Triton launch does not run on {t.device.type} "
                                  "tensors, not even under Triton's interpreter)")


def _emit(y, out):
    if out is None:
        return y
    out.copy_(y)
    return out


def _idle(shape, like, out):
    """The output of a call with nothing to run (an empty batch, or pads only): zeros, in `out` if given.
    Nothing reaches the kernels (SGLang never launches them for an empty batch)."""
    y = out if out is not None else torch.empty(shape, dtype=like.dtype, device=like.device)
    return y.zero_()


def _reset_fresh(pool, slots):
    """Slots of live requests with no tokens and no initial state: zeros, as the contract says (one with an
    initial state keeps it, untouched)."""
    if slots:
        pool[torch.tensor(slots, device=pool.device)] = 0


def _reset_empty(pool, cache_indices, has_initial_state, pad_slot_id, lens=None):
    """The slots of the live requests of no tokens (every live request where `lens` is None) that have no
    initial state: zeros (`_reset_fresh`)."""
    idx, live = host_slots(cache_indices, pad_slot_id)
    hi = [bool(h) for h in has_initial_state.detach().cpu().tolist()]
    _reset_fresh(pool, [idx[i] for i in live if not hi[i] and (lens is None or lens[i] == 0)])


def _empty_prefill(x_shape, like, pool, cache_indices, has_initial_state, pad_slot_id, out):
    """A prefill of no tokens: every live request is empty (its slot keeps its initial state, zeros without
    one); the output is empty."""
    _reset_empty(pool, cache_indices, has_initial_state, pad_slot_id)
    return _idle(x_shape, like, out)


# ---- causal conv -------------------------------------------------------------------------------------------

def _conv_width(weight):
    """The kernels hold the window in named registers for widths 2..5 (a wider one does not compile)."""
    if weight.shape[1] > 5:
        raise NotImplementedError(f"sglang causal_conv1d (Triton): kernel widths 2..5, got {weight.shape[1]}")


def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                    has_initial_state, activation, pad_slot_id, out)
    _on_gpu(x, "causal_conv1d_fn")
    _conv_width(weight)
    if x.shape[0] == 0:
        return _empty_prefill(x.shape, x, conv_states, cache_indices, has_initial_state, pad_slot_id, out)
    fn = import_peer(_CONV).causal_conv1d_fn
    lens = (query_start_loc[1:] - query_start_loc[:-1]).cpu().tolist()
    # an empty request among others: the kernel returns before storing its slot, which keeps what it held
    # (docs/findings.md); SGLang schedules none, and the contract gives one without an initial state zeros
    if 0 in lens:
        _reset_empty(conv_states, cache_indices, has_initial_state, pad_slot_id, lens)
    xs = x if x.stride(1) == 1 else x.contiguous()
    y = fn(xs.t(), weight, bias, conv_states, query_start_loc.to(torch.int32), lens,
           cache_indices=cache_indices.to(torch.int32), has_initial_state=has_initial_state.to(torch.bool),
           activation=activation, pad_slot_id=pad_slot_id)
    return _emit(y.t(), out)


def causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, *, activation=None,
                         pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation, pad_slot_id, out)
    _on_gpu(x, "causal_conv1d_update")
    _conv_width(weight)
    if no_live_rows(conv_state_indices, pad_slot_id, conv_states):
        return _idle(x.shape, x, out)
    upd = import_peer(_CONV).causal_conv1d_update
    y = upd(x, conv_states, weight, bias, activation, conv_state_indices=conv_state_indices.to(torch.int32),
            pad_slot_id=pad_slot_id)
    return _emit(y, out)


def causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc, conv_state_indices, num_accepted_tokens,
                              *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    """SGLang's target-verify conv (MambaMixer2, topk 1): causal_conv1d_update on rows of a fixed token
    count with `intermediate_conv_window`, which receives the window after each token of each row. Here the
    rows are num_spec + 1 tokens long (a shorter row is padded with other tokens; what they give is
    dropped), each row's start window is gathered into a scratch line (SGLang runs on the request's main
    slot, which the kernel also overwrites with the last window; its accept step then copies the accepted
    window back), and window j of each live row goes to table[b, j] for its T_b positions."""
    T, D, K, Bsz, S = C.validate_causal_conv1d_update_spec(x, conv_states, weight, bias, query_start_loc,
                                                           conv_state_indices, num_accepted_tokens, activation,
                                                           pad_slot_id, out)
    _on_gpu(x, "causal_conv1d_update")
    _conv_width(weight)
    if SD.idle(query_start_loc, conv_state_indices, num_accepted_tokens, pad_slot_id, conv_states, T):
        return _idle(x.shape, x, out)
    lens, start, live = SD.rows(query_start_loc, conv_state_indices, num_accepted_tokens, pad_slot_id)
    lines = gather_slots(conv_states, start, live)  # (Bsz, D, K-1)
    windows = torch.zeros((Bsz, S, D, K - 1), dtype=conv_states.dtype, device=x.device)
    rows = torch.arange(Bsz, dtype=torch.int32, device=x.device)
    yd = import_peer(_CONV).causal_conv1d_update(
        SD.dense_tokens(x, query_start_loc, S).transpose(1, 2), lines, weight, bias, activation,
        conv_state_indices=torch.where(live, rows, -1), intermediate_conv_window=windows,
        intermediate_state_indices=rows, pad_slot_id=-1)
    SD.scatter_positions(conv_states, conv_state_indices, SD.written(conv_state_indices, lens, live, pad_slot_id),
                         windows)
    return _emit(SD.packed(yd.transpose(1, 2), query_start_loc, T), out)


# ---- Mamba decode and SSD prefill --------------------------------------------------------------------------

def _ssu_checks(layout, dt, dt_bias, dt_softplus, dt_limit):
    if layout[0] == "mamba1" and layout[4] != 1:
        raise NotImplementedError("sglang selective_state_update (Mamba-1 layout): one group of B/C only")
    if tuple(float(v) for v in dt_limit) != (0.0, math.inf):
        raise NotImplementedError("sglang selective_state_update: no dt_limit clamp")
    if not dt_softplus and not host_reads_ok():
        raise NotImplementedError("sglang selective_state_update: no clamp of negative dt to 0 without "
                                  "dt_softplus, and inside no_index_checks() dt is not read on the host to rule "
                                  "a negative one out")
    if not dt_softplus and bool(((dt if dt_bias is None else dt + dt_bias[None]) < 0).any()):
        raise NotImplementedError("sglang selective_state_update: no clamp of negative dt to 0 "
                                  "(the contract's default dt_limit lower bound)")


def _ssu_args(layout, state, x, dt, A, B, Cm, D, z, dt_bias):
    """SGLang's selective_state_update arguments for our layouts, the leading dims of x, dt, B, C, z kept
    (one token per row, or rows of tokens): Mamba-2 with A, dt, dt_bias (and a per-head D) broadcast over P
    as stride-0 views (its tied-head-dim path); Mamba-1 as SGLang's mamba1.py maps it (heads = channels,
    head dim 1, state (slots, Dm, 1, N)). Zeros stand for a missing D or dt_bias (its launch unpacks their
    strides). Returns (state, x, dt, A, B, C, D, z, dt_bias, the output's view of an x-shaped tensor)."""
    f32 = dict(dtype=torch.float32, device=x.device)
    if layout[0] == "mamba2":
        H, P, N = layout[2:5]
        db = dt_bias if dt_bias is not None else torch.zeros(H, **f32)
        D2 = torch.zeros((H, P), **f32) if D is None else (D[:, None].expand(H, P) if D.dim() == 1 else D)
        return (state, x, dt[..., None].expand(*dt.shape, P), A[:, None, None].expand(H, P, N), B, Cm, D2, z,
                db[:, None].expand(H, P), lambda y: y)
    Dm = layout[2]
    db = dt_bias if dt_bias is not None else torch.zeros(Dm, **f32)
    D1 = D if D is not None else torch.zeros(Dm, **f32)
    return (state.unsqueeze(2), x[..., None], dt[..., None], A[:, None, :], B, Cm, D1[:, None],
            None if z is None else z[..., None], db[:, None], lambda y: y[..., None])


def selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
                           dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    layout = C.validate_selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices,
                                               dt_limit, pad_slot_id, out)
    _on_gpu(x, "selective_state_update")
    if no_live_rows(state_batch_indices, pad_slot_id, state):
        return _idle(x.shape, x, out)
    _ssu_checks(layout, dt, dt_bias, dt_softplus, dt_limit)
    st, xx, dd, AA, BB, CC, DD, zz, db, view = _ssu_args(layout, state, x, dt, A, B, Cm, D, z, dt_bias)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    import_peer(_SSU).selective_state_update(st, xx, dd, AA, BB, CC, DD, zz, db, dt_softplus=bool(dt_softplus),
                                             state_batch_indices=state_batch_indices, pad_slot_id=pad_slot_id,
                                             out=view(y))
    return _emit(y, out)


def selective_state_update_spec(state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc, state_batch_indices,
                                num_accepted_tokens, *, dt_softplus=True, dt_limit=(0.0, C.INF),
                                pad_slot_id=C.PAD_SLOT_ID, out=None):
    """SGLang's target verify (MambaMixer2, topk 1): selective_state_update on rows of a fixed token count
    with disable_state_update=True and `intermediate_states_buffer` (one line of cache_steps states per
    row, intermediate_state_indices = the row), which receives the state after each token; the start state
    is read from the pool through state_batch_indices. Here the rows are num_spec + 1 tokens long (a shorter
    row is padded with other tokens; what they give is dropped), state_batch_indices is each row's start
    slot table[b, num_accepted_tokens[b] - 1] (the pad id for a row that is not live, which the kernel
    skips), and the state after position j of each live row goes to table[b, j] for its T_b positions
    (SGLang's accept step copies the accepted one into the request's main slot instead)."""
    layout = C.validate_selective_state_update_spec(state, x, dt, A, B, Cm, D, z, dt_bias, query_start_loc,
                                                    state_batch_indices, num_accepted_tokens, dt_limit, pad_slot_id,
                                                    out)
    _on_gpu(x, "selective_state_update")
    T, (Bsz, S) = x.shape[0], layout[-2:]
    if SD.idle(query_start_loc, state_batch_indices, num_accepted_tokens, pad_slot_id, state, T):
        return _idle(x.shape, x, out)  # no kernel runs, so none of its limits below applies
    _ssu_checks(layout, dt, dt_bias, dt_softplus, dt_limit)
    lens, start, live = SD.rows(query_start_loc, state_batch_indices, num_accepted_tokens, pad_slot_id)
    xd, dtd, Bd, Cd, zd = (SD.dense_tokens(t, query_start_loc, S) for t in (x, dt, B, Cm, z))
    st, xx, dd, AA, BB, CC, DD, zz, db, view = _ssu_args(layout, state, xd, dtd, A, Bd, Cd, D, zd, dt_bias)
    states = torch.empty((Bsz, S) + tuple(state.shape[1:]), dtype=state.dtype, device=x.device)
    yd = torch.empty(xd.shape, dtype=x.dtype, device=x.device)
    import_peer(_SSU).selective_state_update(
        st, xx, dd, AA, BB, CC, DD, zz, db, dt_softplus=bool(dt_softplus),
        state_batch_indices=torch.where(live, start, pad_slot_id), pad_slot_id=pad_slot_id, out=view(yd),
        disable_state_update=True, intermediate_states_buffer=states, cache_steps=S,
        intermediate_state_indices=torch.arange(Bsz, dtype=torch.int32, device=x.device))
    SD.scatter_positions(state, state_batch_indices, SD.written(state_batch_indices, lens, live, pad_slot_id),
                         states)
    return _emit(SD.packed(yd, query_start_loc, T), out)


def ssd_chunk_metadata(query_start_loc, has_initial_state, chunk_size):
    """(seq_idx (1, T), chunk_indices, chunk_offsets) as SGLang's Mamba2Metadata.prepare_mixed builds them:
    the chunk tables only when some request has an initial state (None otherwise)."""
    meta = import_peer(_META).Mamba2Metadata
    T = int(query_start_loc[-1])
    S = query_start_loc.numel() - 1
    seq_idx = torch.repeat_interleave(torch.arange(S, dtype=torch.int32, device=query_start_loc.device),
                                      query_start_loc.diff(), output_size=T)[None]
    ci = co = None
    if bool(has_initial_state.any()):
        ci, co = meta._query_start_loc_to_chunk_indices_offsets(query_start_loc, chunk_size, T)
    return seq_idx, ci, co


def ssd_varlen(x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
               has_initial_state, *, dt_softplus=True, dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, H, P, N, G, S = C.validate_ssd_varlen(x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states,
                                             query_start_loc, cache_indices, has_initial_state, dt_limit,
                                             pad_slot_id, out)
    _on_gpu(x, "mamba_chunk_scan_combined")
    if z is not None and x.stride(-1) != 1 and x.stride(0) == 1:
        raise NotImplementedError("sglang mamba_chunk_scan_combined: with a gate z, x contiguous in its last dim "
                                  "only (a token-contiguous x is kept, and _chunk_scan_fwd asserts that "
                                  "empty_like(x) has the strides of the output)")
    if T == 0:
        return _empty_prefill(x.shape, x, ssm_states, cache_indices, has_initial_state, pad_slot_id, out)
    if bool((query_start_loc.diff() == 0).any()):
        raise NotImplementedError("sglang Mamba2Metadata: prefill requests of >= 1 token only (its chunk tables "
                                  "are wrong for an empty one)")
    mcsc = import_peer(_SSD).mamba_chunk_scan_combined
    idx, live = host_slots(cache_indices, pad_slot_id)
    qsl = query_start_loc.to(torch.int32)
    live_t = cache_indices != pad_slot_id
    has = has_initial_state.to(torch.bool) & live_t
    seq_idx, ci, co = ssd_chunk_metadata(qsl, has, chunk_size)
    init = None
    if ci is not None:
        safe = torch.where(live_t, cache_indices, torch.zeros_like(cache_indices)).long()
        init = torch.where(has[:, None, None, None], ssm_states[safe], 0)
    y = torch.empty((1, T, H, P), dtype=x.dtype, device=x.device)
    states = mcsc(x[None], dt[None], A, B[None], Cm[None], chunk_size, D=D, z=None if z is None else z[None],
                  dt_bias=dt_bias, seq_idx=seq_idx, chunk_indices=ci, chunk_offsets=co, cu_seqlens=qsl,
                  initial_states=init, return_varlen_states=True, dt_softplus=bool(dt_softplus),
                  dt_limit=tuple(float(v) for v in dt_limit), out=y, state_dtype=ssm_states.dtype)
    if live:
        rows = torch.tensor(live, device=x.device)
        ssm_states[torch.tensor([idx[i] for i in live], device=x.device)] = states[rows].to(ssm_states.dtype)
    zero_pad_tokens(y[0], query_start_loc, cache_indices, pad_slot_id)  # no pad ids: computed like the rest
    return _emit(y[0], out)


def gated_rms_norm(x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None):
    C.validate_gated_rms_norm(x, weight, z, eps, group_size, out)
    _on_gpu(x, "rms_norm_gated")
    rms = import_peer(_NORM).rms_norm_gated
    y = rms(x=x, weight=weight, bias=None, z=z, eps=eps, group_size=group_size,
            norm_before_gate=bool(norm_before_gate), is_rms_norm=True)
    return _emit(y, out)


# ---- Gated DeltaNet / KDA ----------------------------------------------------------------------------------

def _in_place_ok(pool, kind):
    """The kernels index slots by the pool's slot stride but assume contiguous (H, V, K) inside a slot; the
    GDN entry points also make every tensor contiguous first (a strided pool would be copied)."""
    if kind == "gdn":
        return pool.is_contiguous()
    H, V, K = pool.shape[1:]
    return tuple(pool.stride()[1:]) == (V * K, K, 1)


def _states_for(pool, slots, use, in_place):
    """(state tensor, int32 index per kernel sequence) for a delta-rule kernel, given the slot of each
    sequence (None for a pad): the pool itself with the slot ids (-1 for pads), or a scratch copy with one
    row per sequence (zeros where not `use`) and the row ids (-1 for pads)."""
    dev = pool.device
    if in_place:
        return pool, torch.tensor([-1 if s is None else s for s in slots], dtype=torch.int32, device=dev)
    scratch = torch.zeros((len(slots),) + tuple(pool.shape[1:]), dtype=pool.dtype, device=dev)
    rows = [r for r, s in enumerate(slots) if s is not None and use[r]]
    if rows:
        scratch[torch.tensor(rows, device=dev)] = pool[torch.tensor([slots[r] for r in rows], device=dev)]
    return scratch, torch.tensor([-1 if s is None else r for r, s in enumerate(slots)], dtype=torch.int32,
                                 device=dev)


def _write_back(pool, states, slots):
    """pool[slot] = the final state of each non-pad sequence (nothing when the kernel ran on the pool)."""
    rows = [r for r, s in enumerate(slots) if s is not None]
    if states is pool or not rows:
        return
    dev = pool.device
    pool[torch.tensor([slots[r] for r in rows], device=dev)] = states[torch.tensor(rows, device=dev)]


def _delta_varlen(kind, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                  use_qk_l2norm, pad_slot_id, out):
    """Runs the live non-empty sequences only: SGLang schedules no empty prefill, and its chunk kernels
    give wrong outputs and states for the other sequences of a batch that holds one (docs/findings.md).
    An empty live sequence gets the contract's result here (its slot keeps its initial state, zeros without
    one); pads are left out (their outputs are zero, their slots untouched)."""
    idx, live = host_slots(cache_indices, pad_slot_id)
    hi = [bool(h) for h in has_initial_state.detach().cpu().tolist()]
    qsl = [int(t) for t in query_start_loc.detach().cpu().tolist()]
    T, Hv, V = v.shape
    run = [i for i in live if qsl[i + 1] > qsl[i]]
    fresh = [idx[i] for i in live if qsl[i + 1] == qsl[i] and not hi[i]]
    if not run:
        _reset_fresh(ssm_states, fresh)
        return _idle((T, Hv, V), v, out)
    dev = v.device
    if len(run) == len(qsl) - 1:  # every sequence live and non-empty: the packed batch as it is
        tok = None
        qq, kk, vv, gg, bb = q, k, v, g, beta
        cu = query_start_loc.to(torch.int64)
    else:
        tok = torch.cat([torch.arange(qsl[i], qsl[i + 1], device=dev) for i in run])
        qq, kk, vv, gg, bb = q[tok], k[tok], v[tok], g[tok], beta[tok]
        cu = torch.tensor([0] + [qsl[i + 1] - qsl[i] for i in run], device=dev).cumsum(0)
    slots = [idx[i] for i in run]
    use = [hi[i] for i in run]
    states, sidx = _states_for(ssm_states, slots, use, all(use) and _in_place_ok(ssm_states, kind))
    if kind == "gdn":
        o, _, _ = import_peer(_GDN).chunk_gated_delta_rule(
            qq[None], kk[None], vv[None], gg[None], bb[None], scale=scale, initial_state=states,
            initial_state_indices=sidx, cu_seqlens=cu, use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
    else:  # chunk_kda writes its output into v: it gets a copy
        o = import_peer(_KDA).chunk_kda(
            qq[None], kk[None], vv[None].clone() if tok is None else vv[None], gg[None], bb[None], scale=scale,
            initial_state=states, initial_state_indices=sidx, use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
            cu_seqlens=cu)
    _write_back(ssm_states, states, slots)
    _reset_fresh(ssm_states, fresh)
    if tok is None:
        return _emit(o[0].to(v.dtype), out)
    y = _idle((T, Hv, V), v, out)
    y[tok] = o[0].to(y.dtype)
    return y


def gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *,
                            scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices,
                                       has_initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                       pad_slot_id=pad_slot_id, out=out)
    _on_gpu(q, "chunk_gated_delta_rule")
    if q.dtype in (torch.float32, torch.float64):
        raise NotImplementedError("sglang chunk_gated_delta_rule: bf16/fp16 activations only (asserts not float32)")
    return _delta_varlen("gdn", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                         scale, use_qk_l2norm, pad_slot_id, out)


def kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *, scale=None,
               use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                          scale=scale, use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id, out=out)
    _on_gpu(q, "chunk_kda")
    if q.dtype == torch.float64:
        raise NotImplementedError("sglang chunk_kda: no float64")
    require_kda_gate_floor(g, "sglang chunk_kda")
    return _delta_varlen("kda", q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
                         scale, use_qk_l2norm, pad_slot_id, out)


def gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
                            pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, scale=scale,
                                       use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id, out=out)
    _on_gpu(q, "fused_recurrent_gated_delta_rule_update")
    if scale is not None and not scale > 0:
        raise NotImplementedError("sglang fused_recurrent_gated_delta_rule_update: scale must be positive")
    if q.dtype == torch.float64:
        raise NotImplementedError("sglang fused_recurrent_gated_delta_rule_update: no float64")
    if no_live_rows(state_indices, pad_slot_id, ssm_states):  # an empty batch, or pads only
        return _idle(v.shape, v, out)
    live = state_indices != pad_slot_id
    if _in_place_ok(ssm_states, "gdn"):  # the pool itself, pads as -1 (the kernel skips negative indices)
        states, sidx = ssm_states, torch.where(live, state_indices, -1).to(torch.int32)
    else:  # a scratch copy of the named slots, one row per batch row
        states = gather_slots(ssm_states, state_indices, live)
        rows = torch.arange(state_indices.shape[0], dtype=torch.int32, device=q.device)
        sidx = torch.where(live, rows, -1)
    o = import_peer(_REC).fused_recurrent_gated_delta_rule_update(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
        initial_state_source=states, initial_state_indices=sidx, use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
    if states is not ssm_states:
        scatter_slots(ssm_states, state_indices, live, states)
    return _emit(o[:, 0].to(v.dtype), out)


def kda_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
               pad_slot_id=C.PAD_SLOT_ID, out=None):
    C.validate_kda_update(q, k, v, g, beta, ssm_states, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm,
                          pad_slot_id=pad_slot_id, out=out)
    _on_gpu(q, "fused_recurrent_kda")
    if q.dtype == torch.float64:
        raise NotImplementedError("sglang fused_recurrent_kda: no float64")
    if no_live_rows(state_indices, pad_slot_id, ssm_states):  # an empty batch, or pads only
        return _idle(v.shape, v, out)
    live = state_indices != pad_slot_id
    h = gather_slots(ssm_states, state_indices, live)  # every row; zeros for pads
    o, hT = import_peer(_KDA).fused_recurrent_kda(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale, initial_state=h,
        inplace_final_state=True, use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
    scatter_slots(ssm_states, state_indices, live, hT)
    y = out if out is not None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return y.copy_(mask_rows(o[:, 0], live))


def gated_delta_rule_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                                 *, scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    """SGLang's GDN target verify (chain drafts, retrieve_parent_token None) with the plain g / beta kernel:
    fused_recurrent_gated_delta_rule_update on the packed rows (cu_seqlens = query_start_loc) with
    disable_state_update=True and `intermediate_states_buffer` (one line of cache_steps = num_spec + 1 states
    per row, intermediate_state_indices = the row, -1 for a row that is not live), which receives the state
    after each token of the row; the start state is read through initial_state_indices. Here that index is
    each row's start slot table[b, num_accepted_tokens[b] - 1] (-1 for a row that is not live: the kernel
    starts it from zeros and stores nothing), on the pool itself when it is contiguous, else on a scratch
    copy of the start slots (the input guard would copy a strided pool); the state after position j of each
    live row goes to table[b, j] for its T_b positions (SGLang's accept step copies the accepted one into the
    request's slot instead)."""
    T, _, Hv, K, V, Bsz, S = C.validate_gated_delta_rule_update_spec(
        q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale=scale,
        use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id, out=out)
    who = "fused_recurrent_gated_delta_rule_update"
    _on_gpu(q, who)
    if scale is not None and not scale > 0:
        raise NotImplementedError(f"sglang {who}: scale must be positive")
    if q.dtype == torch.float64:
        raise NotImplementedError(f"sglang {who}: no float64")
    if SD.idle(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, ssm_states, T):
        return _idle(v.shape, v, out)
    lens, start, live = SD.rows(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id)
    rows = torch.arange(Bsz, dtype=torch.int32, device=q.device)
    if _in_place_ok(ssm_states, "gdn"):
        src, sidx = ssm_states, torch.where(live, start, -1).to(torch.int32)
    else:
        src, sidx = gather_slots(ssm_states, start, live), torch.where(live, rows, -1)
    states = torch.empty((Bsz, S, Hv, V, K), dtype=ssm_states.dtype, device=q.device)
    o = import_peer(_REC).fused_recurrent_gated_delta_rule_update(
        q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state_source=src,
        initial_state_indices=sidx, cu_seqlens=query_start_loc, use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
        disable_state_update=True, intermediate_states_buffer=states,
        intermediate_state_indices=torch.where(live, rows, -1), cache_steps=S)
    SD.scatter_positions(ssm_states, state_indices, SD.written(state_indices, lens, live, pad_slot_id), states)
    return _emit(o[0].to(v.dtype), out)


# ---- Mamba-1 prefill ---------------------------------------------------------------------------------------

def selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                          has_initial_state, *, delta_softplus=True, pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, Dm, N, G, S = C.validate_selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states,
                                                      query_start_loc, cache_indices, has_initial_state,
                                                      pad_slot_id, out)
    if G != 1:
        raise NotImplementedError("sglang MambaMixer1 prefill: one group of B/C only")
    scan = import_peer(_M1).MambaMixer1._selective_scan
    idx, live = host_slots(cache_indices, pad_slot_id)
    hi = [bool(h) for h in has_initial_state.detach().cpu().tolist()]
    q = query_start_loc.detach().cpu().tolist()
    y = out if out is not None else torch.empty_like(u)
    zero_pad_tokens(y, query_start_loc, cache_indices, pad_slot_id)  # pad requests are not run
    Af = A.float()
    for i in live:
        a, b = q[i], q[i + 1]
        h = ssm_states[idx[i]].float() if hi[i] else torch.zeros((Dm, N), dtype=torch.float32, device=u.device)
        if b > a:
            dt = delta[a:b].float() + (0 if delta_bias is None else delta_bias.float()[None])
            if delta_softplus:
                dt = torch.nn.functional.softplus(dt)
            xs = u[a:b].float()
            h, ys = scan(x=xs, dt=dt, A=Af, B=B[a:b, 0].float(), C=Cm[a:b, 0].float(), h0=h)
            if D is not None:
                ys = ys + xs * D.float()[None, :]
            if z is not None:
                ys = ys * torch.nn.functional.silu(z[a:b].float())
            y[a:b] = ys.to(y.dtype)
        ssm_states[idx[i]] = h.to(ssm_states.dtype)
    return y


OPS = {"causal_conv1d_varlen": causal_conv1d_varlen, "causal_conv1d_update": causal_conv1d_update,
       "causal_conv1d_update_spec": causal_conv1d_update_spec, "selective_state_update": selective_state_update,
       "selective_state_update_spec": selective_state_update_spec, "ssd_varlen": ssd_varlen,
       "gated_rms_norm": gated_rms_norm, "gated_delta_rule_varlen": gated_delta_rule_varlen,
       "gated_delta_rule_update": gated_delta_rule_update,
       "gated_delta_rule_update_spec": gated_delta_rule_update_spec, "kda_varlen": kda_varlen,
       "kda_update": kda_update, "selective_scan_varlen": selective_scan_varlen}

register(Impl(name="sglang", reads_host=True, devices=("cuda",), ops=OPS,
              dtypes=(torch.float32, torch.float16, torch.bfloat16), fp32_matmul="tf32",
              unavailable=lambda: unavailable_reason("sglang", *MODULES),
              description="SGLang 0.5.23 Triton kernels (causal conv, SSU, GDN decode and their speculative-verify "
                          "forms, SSD, gated norm, GDN prefill, KDA) and its PyTorch Mamba-1 prefill loop"))

# SGLang's Mamba-1 prefill alone, which is PyTorch and runs anywhere: not registered (the `sglang` Impl has it
# on CUDA); for the CPU run of its op suite:
#   pytest suites/ops/test_ops_selective_scan.py --device cpu --impl harness.impls.adapters.sglang:MAMBA1
MAMBA1 = Impl(name="sglang-mamba1", reads_host=True,
              devices=("cpu", "cuda"), ops={"selective_scan_varlen": selective_scan_varlen},
              dtypes=(torch.float32, torch.float16, torch.bfloat16),
              unavailable=lambda: unavailable_reason("sglang", _M1),
              description="SGLang 0.5.23 Mamba-1 prefill (MambaMixer1._selective_scan, a PyTorch loop over tokens)")
