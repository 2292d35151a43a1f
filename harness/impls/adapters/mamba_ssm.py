"""Adapters for mamba_ssm 2.3.x kernels.

Impl `mamba_ssm` (its Triton ops, importable from source with a placeholder `selective_scan_cuda`; on the CPU
under Triton's interpreter too, fp32, through `_interpret.interpreted`):
* selective_state_update <- mamba_ssm.ops.triton.selective_state_update.selective_state_update.
  Mamba-2 layout: A, dt, dt_bias, D are broadcast over P with stride-0 views (its "tie_hdim" path).
  Not supported by 2.3.2: dt_limit other than (0, inf) (no clamp; raises NotImplementedError);
  a non-negative pad_slot_id (it skips rows whose index is < 0). Its pad rows get y = 0.
* ssd_varlen <- mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined on the packed batch as
  batch 1 with seq_idx (per-token sequence id), cu_seqlens and return_varlen_states=True.
  Not supported: an initial state for any sequence but the first (it takes one initial state per batch
  row) -> NotImplementedError; the peer has no pad ids: pad requests are computed with the others, their
  slots are not written and their tokens' y is set to 0 here.
* gated_rms_norm <- mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn.
* add_rms_norm <- mamba_ssm.ops.triton.layer_norm.rms_norm_fn with residual=, prenorm=True (the fused add + norm
  of mamba_ssm's Block); residual_in_fp32 for a float32 residual. It returns the sum as a new tensor (copied into
  the residual here) and normalises the float32 sum itself, where the contract normalises the sum rounded to x's
  dtype (as transformers' blocks do): one rounding of a half x apart. A residual in another dtype is declined.
  x and the residual go with stride 1 along a last dim of size 1, which its stride asserts need.
Impl `mamba_ssm_cuda` (needs the compiled `selective_scan_cuda`):
* selective_scan_varlen <- mamba_ssm.ops.selective_scan_interface.selective_scan_fn, one call per
  live sequence (it has no varlen mode). Not supported: has_initial_state (2.3.2 takes no initial
  state) -> NotImplementedError. Pad requests are not run; their tokens' y is set to 0 here.
Every op validates with harness.ops first, so bad input fails the same way as for our kernels.
"""
from __future__ import annotations

import math

import torch

from harness import ops as C
from harness.impls.adapters import host_slots, import_peer, unavailable_reason, zero_pad_tokens
from harness.impls.adapters._interpret import interpreted, unavailable_here
from harness.impls.adapters._source import PeerSdist
from harness.impls.registry import Impl, register
from harness.impls.triton._common import interpreting

# the source archive scripts/peers_fetch.py downloads; scripts/gpu.sh builds its CUDA extensions
SOURCE = PeerSdist("mamba-ssm==2.3.2.post1")

_SSU = "mamba_ssm.ops.triton.selective_state_update"
_SSD = "mamba_ssm.ops.triton.ssd_combined"
_NORM = "mamba_ssm.ops.triton.layernorm_gated"
_LN = "mamba_ssm.ops.triton.layer_norm"
_SCAN = "mamba_ssm.ops.selective_scan_interface"


def _emit(y, out):
    if out is None:
        return y
    out.copy_(y)
    return out


def selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
                           dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    layout = C.validate_selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices,
                                               dt_limit, pad_slot_id, out)
    if tuple(float(v) for v in dt_limit) != (0.0, math.inf):
        raise NotImplementedError("mamba_ssm selective_state_update: no dt_limit clamp (2.3.x)")
    if pad_slot_id >= 0:
        raise NotImplementedError("mamba_ssm selective_state_update: pads must be negative slot ids")
    if not dt_softplus and bool(((dt if dt_bias is None else dt + dt_bias[None]) < 0).any()):
        raise NotImplementedError("mamba_ssm selective_state_update: no clamp of negative dt to 0 "
                                  "(the contract's default dt_limit lower bound)")
    ssu = import_peer(_SSU).selective_state_update
    # 2.3.2 raises TypeError for dt_bias=None or D=None (it unpacks `*(strides) if t is not None else 0`):
    # zeros are the same arithmetic
    nd = x.shape[1] if layout[0] == "mamba1" else A.shape[0]
    if dt_bias is None:
        dt_bias = torch.zeros(nd, dtype=dt.dtype, device=dt.device)
    if D is None:
        D = torch.zeros(nd, dtype=torch.float32, device=x.device)
    if layout[0] == "mamba2":
        _, Bsz, H, P, N, G = layout
        A3 = A[:, None, None].expand(H, P, N)
        dt3 = dt[:, :, None].expand(Bsz, H, P)
        db3 = dt_bias[:, None].expand(H, P)
        D3 = D[:, None].expand(H, P) if D.dim() == 1 else D
        y = ssu(state, x, dt3, A3, B, Cm, D3, z, db3, dt_softplus=bool(dt_softplus),
                state_batch_indices=state_batch_indices)
    else:
        _, Bsz, Dm, N, G = layout
        if G != 1:
            raise NotImplementedError("mamba_ssm selective_state_update (Mamba-1 layout): one group of B/C only")
        y = ssu(state, x, dt, A, B[:, 0], Cm[:, 0], D, z, dt_bias, dt_softplus=bool(dt_softplus),
                state_batch_indices=state_batch_indices)
    return _emit(y, out)


def ssd_varlen(x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
               has_initial_state, *, dt_softplus=True, dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, H, P, N, G, S = C.validate_ssd_varlen(x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states,
                                             query_start_loc, cache_indices, has_initial_state, dt_limit,
                                             pad_slot_id, out)
    idx, live = host_slots(cache_indices, pad_slot_id)
    hi = has_initial_state.detach().cpu().tolist()
    if any(hi[i] for i in live if i > 0):
        raise NotImplementedError("mamba_ssm mamba_chunk_scan_combined: only the first packed sequence can "
                                  "start from a state (one initial state per batch row)")
    if T == 0:
        raise NotImplementedError("mamba_ssm mamba_chunk_scan_combined: no empty batch")
    mcsc = import_peer(_SSD).mamba_chunk_scan_combined
    q = query_start_loc.to(torch.int64)
    lens = q[1:] - q[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(S, device=x.device, dtype=torch.int32), lens)[None]
    init = None
    if S and 0 in live and hi[0]:
        init = ssm_states[idx[0]][None].to(torch.float32)
    y, states = mcsc(x[None], dt[None], A, B[None], Cm[None], chunk_size, D=D, z=None if z is None else z[None],
                     dt_bias=dt_bias, initial_states=init, seq_idx=seq_idx, cu_seqlens=query_start_loc,
                     dt_softplus=bool(dt_softplus), dt_limit=tuple(dt_limit), return_varlen_states=True)
    for i in live:
        ssm_states[idx[i]] = states[i].to(ssm_states.dtype)
    return zero_pad_tokens(_emit(y[0], out), query_start_loc, cache_indices, pad_slot_id)


def gated_rms_norm(x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None):
    C.validate_gated_rms_norm(x, weight, z, eps, group_size, out)
    rms = import_peer(_NORM).rmsnorm_fn
    y = rms(x, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    return _emit(y, out)


def _unit_last_stride(t):
    """`t` with stride 1 along a last dim of size 1 (the same elements). layer_norm.py's `_layer_norm_fwd` asserts
    x.stride(-1) == 1 and residual.stride(-1) == 1 (bare asserts); its wrapper makes a tensor contiguous when
    that stride is not 1, but torch's `contiguous()` keeps a (T, 1) view whose last stride is T (the transpose of
    a (1, T) buffer), since a size-1 dim's stride does not count for contiguity."""
    if t.shape[-1] == 1 and t.stride(-1) != 1:
        return t.as_strided(t.shape, (*t.stride()[:-1], 1), t.storage_offset())
    return t


def add_rms_norm(x, residual, weight, *, eps=1e-6, out=None):
    T, _ = C.validate_add_rms_norm(x, residual, weight, eps, out)
    if residual.dtype not in (torch.float32, x.dtype):
        raise NotImplementedError("mamba_ssm rms_norm_fn: a residual in float32 (residual_in_fp32) or in x's dtype "
                                  "only")
    if T == 0:
        return out if out is not None else torch.empty_like(x)
    fn = import_peer(_LN).rms_norm_fn
    y, res = fn(_unit_last_stride(x), weight, None, residual=_unit_last_stride(residual), eps=eps, prenorm=True,
                residual_in_fp32=residual.dtype == torch.float32)
    residual.copy_(res)  # it returns the sum in a new tensor; the contract updates the residual in place
    return _emit(y, out)


def selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                          has_initial_state, *, delta_softplus=True, pad_slot_id=C.PAD_SLOT_ID, out=None):
    T, Dm, N, G, S = C.validate_selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states,
                                                      query_start_loc, cache_indices, has_initial_state,
                                                      pad_slot_id, out)
    idx, live = host_slots(cache_indices, pad_slot_id)
    hi = has_initial_state.detach().cpu().tolist()
    if any(hi[i] for i in live):
        raise NotImplementedError("mamba_ssm selective_scan_fn (2.3.x) takes no initial state")
    fn = import_peer(_SCAN).selective_scan_fn
    q = query_start_loc.detach().cpu().tolist()
    y = zero_pad_tokens(out if out is not None else torch.empty_like(u), query_start_loc, cache_indices, pad_slot_id)
    for i in live:
        a, b = q[i], q[i + 1]
        if b == a:
            ssm_states[idx[i]] = 0
            continue
        t = lambda v: v[a:b].t()[None]  # (1, Dm, L), channel-first as selective_scan_fn expects
        bc = lambda v: v[a:b].permute(1, 2, 0)[None]  # (1, G, N, L)
        ys, last = fn(t(u).contiguous(), t(delta).contiguous(), A, bc(B).contiguous(), bc(Cm).contiguous(),
                      D, None if z is None else t(z).contiguous(), delta_bias=delta_bias,
                      delta_softplus=bool(delta_softplus), return_last_state=True)
        y[a:b] = ys[0].t()
        ssm_states[idx[i]] = last[0].to(ssm_states.dtype)
    return y


def _cuda_scan_unavailable():
    r = unavailable_reason("mamba_ssm", _SCAN)
    if r:
        return r
    import sys
    if getattr(sys.modules.get("selective_scan_cuda"), "__harness_placeholder__", False):
        return "package mamba_ssm: its CUDA extension selective_scan_cuda is not built (placeholder installed)"
    return None


_TRITON_OPS = {"selective_state_update": selective_state_update, "ssd_varlen": ssd_varlen,
               "gated_rms_norm": gated_rms_norm, "add_rms_norm": add_rms_norm}
register(Impl(name="mamba_ssm", reads_host=True, devices=("cuda", "cpu"),
              dtypes=(torch.float32,) if interpreting() else (torch.float32, torch.float16, torch.bfloat16),
              fp32_matmul="tf32",  # the chunked SSD's tl.dot runs fp32 inputs in TF32
              ops={k: interpreted("mamba_ssm.", f) if interpreting() else f for k, f in _TRITON_OPS.items()},
              unavailable=lambda: unavailable_here("mamba_ssm's", "mamba_ssm", _SSU, _SSD, _NORM, _LN),
              description="mamba_ssm 2.3.x Triton kernels (state update, chunked SSD, gated RMSNorm, fused "
                          "residual add + RMSNorm)"))
register(Impl(name="mamba_ssm_cuda", reads_host=True,
              devices=("cuda",), dtypes=(torch.float32, torch.float16, torch.bfloat16),
              ops={"selective_scan_varlen": selective_scan_varlen}, unavailable=_cuda_scan_unavailable,
              # selective_scan_fn's CUDA kernel walks a sequence in chunks of 2048 tokens, carrying the state
              tiles={"selective_scan_varlen": (2048,)},
              description="mamba_ssm CUDA selective_scan_fn, one call per sequence"))
