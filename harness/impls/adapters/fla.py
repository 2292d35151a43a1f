"""Adapter for flash-linear-attention (`fla-core`, a pure-Python wheel of Triton kernels; needs einops).

Impl `fla` (CUDA; on the CPU under Triton's interpreter too, fp32, through `_interpret.interpreted`):
* gated_delta_rule_varlen <- fla.ops.gated_delta_rule.chunk_gated_delta_rule
* gated_delta_rule_update <- fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule
* kda_varlen              <- fla.ops.kda.chunk_kda
* kda_update              <- fla.ops.kda.fused_recurrent_kda
* kda_update_spec         <- fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd in its speculative form
  (taken from vLLM's decode kernel): cu_seqlens, a 2-D ssm_state_indices, num_accepted_tokens,
  inplace_final_state=True, state_v_first=True. Per row it reads slot indices[b, num_accepted_tokens[b] - 1]
  and stores the state after token j into indices[b, j]; it has no pad or null-block test (every index is
  read or written as a slot), so the adapter runs it on a scratch pool of Bsz * (num_spec + 1) fp32 slots
  (row b's at b * (num_spec + 1) + j; its start state, gathered from the pool, at position
  num_accepted_tokens[b] - 1; zeros for a row that is not live) and writes the written positions back into
  table[b, j]; the outputs of rows that are not live are zeroed. The public fused_recurrent_kda does not
  forward these arguments (it takes **kwargs and drops them).
Not provided: gated_delta_rule_update_spec: fla's GDN recurrence (fused_recurrent_gated_delta_rule_fwd) takes
one initial state per sequence and returns one final state: no state per position, no slot indices, no
num_accepted_tokens.
Prefill and one-token decode: fla takes the packed batch as batch 1 with `cu_seqlens` (int64) and one
initial state per sequence; `state_v_first=True` gives our value-major (V, K) state (its default is (K, V)).
The adapter gathers the named slots (zeros where a request has no initial state), runs only the live
non-empty sequences, and writes their final states back; an empty live sequence keeps its initial state
(zeros without one), as the contract says. Decode rows run as a batch of one-token sequences, every row (a
pad row from a zero state): the states are gathered from and written back to the pool on the device and pad
outputs are zeroed by a mask, with no host read of the indices, so a decode call (the speculative one too)
can be captured in a CUDA graph (outside `harness.ops.no_index_checks()` a batch without live rows launches
nothing). The prefill reads the sequence lengths on the host. Every op validates with harness.ops first, so
bad input fails as for our kernels.

fp32 inputs: fla multiplies them in TF32 on GPUs that have it, and the suites judge it at TF32's precision.
`HARNESS_FLA_FP32=ieee` runs its fp32 dots in IEEE fp32 instead and judges them at the fp32 tolerance, which
tells TF32 rounding apart from a defect: Triton's default fp32 dot precision (TRITON_F32_DEFAULT), fla's
triangular solve (FLA_TRIL_PRECISION, read when fla is imported) and its GDN per-chunk solve's merge of the
diagonal blocks' inverses (`chunk_fwd.SOLVE_TRIL_DOT_PRECISION`, TF32 whenever the GPU has it, whatever Triton's
default) are all set to "ieee", for the whole process (every Triton kernel compiled in it afterwards).
`HARNESS_FLA_FP32=tf32` (the default) leaves fla as it ships.
"""
from __future__ import annotations

import contextlib
import os

import torch

from harness import ops as C
from harness.impls.adapters import _spec_decode as SD
from harness.impls.adapters import (gather_slots, host_reads_ok, host_slots, import_peer, mask_rows,
                                    require_kda_gate_floor, scatter_slots)
from harness.impls.adapters._interpret import interpreted, unavailable_here
from harness.impls.adapters._source import PeerWheels
from harness.impls.registry import Impl, register
from harness.impls.triton._common import interpreting

# the wheels scripts/peers_fetch.py downloads into .peers/ (scripts/peers_setup.sh installs them)
SOURCE = PeerWheels(("fla-core==0.6.0", "einops==0.8.2"))

_GDN = "fla.ops.gated_delta_rule"
_KDA = "fla.ops.kda"
_KDA_REC = "fla.ops.kda.fused_recurrent"
_GDN_SOLVE = "fla.ops.gated_delta_rule.chunk_fwd"

FP32_ENV = "HARNESS_FLA_FP32"
FP32_MODES = ("tf32", "ieee")
FP32 = os.environ.get(FP32_ENV, "tf32")
if FP32 == "ieee":  # before fla is imported: its triangular solve reads FLA_TRIL_PRECISION at import
    os.environ["FLA_TRIL_PRECISION"] = "ieee"
    os.environ["TRITON_F32_DEFAULT"] = "ieee"


def fp32_mode_problem() -> str | None:
    """Why HARNESS_FLA_FP32 cannot be used (the variable, what it takes, what it holds), or None."""
    if FP32 not in FP32_MODES:
        return f"{FP32_ENV}: expected one of {', '.join(FP32_MODES)}, got {FP32!r}"
    return None


def ieee_solve(module) -> None:
    """HARNESS_FLA_FP32=ieee: fla's GDN per-chunk solve `module` (fla.ops.gated_delta_rule.chunk_fwd) merges its
    diagonal blocks' inverses in IEEE fp32 (it sets TF32 itself where the GPU has it). Before its kernel
    compiles: called at every GDN prefill, it changes nothing after the first."""
    import triton.language as tl
    if FP32 == "ieee" and str(getattr(module, "SOLVE_TRIL_DOT_PRECISION", "ieee")) != str(tl.constexpr("ieee")):
        module.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")


def _chunk_gdn(*a, **kw):
    if FP32 == "ieee":  # (fla releases without this module run as they ship under the default)
        ieee_solve(import_peer(_GDN_SOLVE))
    return import_peer(_GDN).chunk_gated_delta_rule(*a, **kw)


def _gather(pool, slots, use):
    """fp32 initial states of the requests in `slots` (zeros where not `use`), gathered on the device."""
    init = torch.zeros((len(slots),) + tuple(pool.shape[1:]), dtype=torch.float32, device=pool.device)
    rows = [i for i, u in enumerate(use) if u]
    if rows:
        init[torch.tensor(rows, device=pool.device)] = pool[torch.tensor([slots[i] for i in rows],
                                                                        device=pool.device)].float()
    return init


def _scatter(pool, slots, states):
    """pool[slots] = states, in one indexed write through the (possibly strided) pool view."""
    if slots:
        pool[torch.tensor(slots, device=pool.device)] = states.to(pool.dtype)


def _varlen(fn, validate, q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state,
            scale, use_qk_l2norm, pad_slot_id, out):
    validate(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale=scale,
             use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id, out=out)
    idx, live = host_slots(cache_indices, pad_slot_id)
    qsl = [int(t) for t in query_start_loc.cpu().tolist()]
    init_flags = [bool(h) for h in has_initial_state.cpu().tolist()]
    T, Hv, V = v.shape
    y = out if out is not None else torch.empty((T, Hv, V), dtype=v.dtype, device=v.device)
    y.zero_()
    run = [i for i in live if qsl[i + 1] > qsl[i]]
    _scatter(ssm_states, [idx[i] for i in live if qsl[i + 1] == qsl[i] and not init_flags[i]], torch.zeros(()))
    if not run:
        return y
    tok = torch.cat([torch.arange(qsl[i], qsl[i + 1], device=q.device) for i in run])
    cu = torch.tensor([0] + [qsl[i + 1] - qsl[i] for i in run], device=q.device).cumsum(0)
    h0 = _gather(ssm_states, [idx[i] for i in run], [init_flags[i] for i in run])
    o, hT = fn(q[tok][None], k[tok][None], v[tok][None], g=g[tok][None], beta=beta[tok][None], scale=scale,
               initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
               state_v_first=True, cu_seqlens=cu.long())
    y[tok] = o[0].to(y.dtype)
    _scatter(ssm_states, [idx[i] for i in run], hT)
    return y


def _update(fn, validate, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out):
    validate(q, k, v, g, beta, ssm_states, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm,
             pad_slot_id=pad_slot_id, out=out)
    Bsz, Hv, V = v.shape
    y = out if out is not None else torch.empty((Bsz, Hv, V), dtype=v.dtype, device=v.device)
    if Bsz == 0 or ssm_states.shape[0] == 0 or (host_reads_ok() and not host_slots(state_indices, pad_slot_id)[1]):
        return y.zero_()  # no live row (an empty pool holds none)
    live = state_indices != pad_slot_id
    h0 = gather_slots(ssm_states, state_indices, live, torch.float32)
    o, hT = fn(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=scale, initial_state=h0,
               output_final_state=True, use_qk_l2norm_in_kernel=bool(use_qk_l2norm), state_v_first=True)
    y.copy_(mask_rows(o[:, 0], live))
    scatter_slots(ssm_states, state_indices, live, hT)
    return y


def gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *,
                            scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _varlen(_chunk_gdn,
                   C.validate_gated_delta_rule_varlen, q, k, v, g, beta, ssm_states, query_start_loc,
                   cache_indices, has_initial_state, scale, use_qk_l2norm, pad_slot_id, out)


def gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
                            pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _update(lambda *a, **kw: import_peer(_GDN).fused_recurrent_gated_delta_rule(*a, **kw),
                   C.validate_gated_delta_rule_update, q, k, v, g, beta, ssm_states, state_indices, scale,
                   use_qk_l2norm, pad_slot_id, out)


def validate_kda_chunk(who: str):
    """The contract's kda_varlen validator, then the fla lineage's gate floor (`require_kda_gate_floor`)."""
    def validate(q, k, v, g, *rest, **kw):
        C.validate_kda_varlen(q, k, v, g, *rest, **kw)
        require_kda_gate_floor(g, who)
    return validate


def kda_varlen(q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, *, scale=None,
               use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _varlen(lambda *a, **kw: import_peer(_KDA).chunk_kda(*a, **kw), validate_kda_chunk("fla chunk_kda"),
                   q, k, v, g, beta, ssm_states, query_start_loc, cache_indices, has_initial_state, scale,
                   use_qk_l2norm, pad_slot_id, out)


def kda_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
               pad_slot_id=C.PAD_SLOT_ID, out=None):
    return _update(lambda *a, **kw: import_peer(_KDA).fused_recurrent_kda(*a, **kw), C.validate_kda_update,
                   q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)


def kda_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, *,
                    scale=None, use_qk_l2norm=False, pad_slot_id=C.PAD_SLOT_ID, out=None):
    """fused_recurrent_kda_fwd's speculative form on a scratch pool: row b's slots are scratch rows
    b * S .. b * S + S - 1 (S = num_spec + 1), its start state (gathered from the pool; zeros for a row that is
    not live) at position num_accepted_tokens[b] - 1; after the kernel, position j's state goes to
    table[b, j] for the live rows' T_b positions. No host read: every row runs (a row that is not live from
    zeros, its outputs masked to zero)."""
    T, H, _, K, V, Bsz, S = C.validate_kda_update_spec(q, k, v, g, beta, ssm_states, query_start_loc,
                                                       state_indices, num_accepted_tokens, scale=scale,
                                                       use_qk_l2norm=use_qk_l2norm, pad_slot_id=pad_slot_id,
                                                       out=out)
    y = out if out is not None else torch.empty((T, H, V), dtype=v.dtype, device=v.device)
    if SD.idle(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id, ssm_states, T):
        return y.zero_()
    lens, start, live = SD.rows(query_start_loc, state_indices, num_accepted_tokens, pad_slot_id)
    dev = q.device
    scratch = torch.zeros((Bsz, S, H, V, K), dtype=torch.float32, device=dev)
    scratch[torch.arange(Bsz, device=dev), num_accepted_tokens.to(torch.int64) - 1] = \
        gather_slots(ssm_states, start, live, torch.float32)
    table = torch.arange(Bsz * S, dtype=torch.int32, device=dev).reshape(Bsz, S)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        o, _ = import_peer(_KDA_REC).fused_recurrent_kda_fwd(
            q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g.contiguous()[None],
            beta.contiguous()[None], scale=scale, initial_state=scratch.view(Bsz * S, H, V, K),
            inplace_final_state=True, state_v_first=True, cu_seqlens=query_start_loc.contiguous(),
            ssm_state_indices=table, num_accepted_tokens=num_accepted_tokens.contiguous(),
            use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
    y.copy_(SD.mask_tokens(o[0], query_start_loc, live))
    SD.scatter_positions(ssm_states, state_indices, SD.written(state_indices, lens, live, pad_slot_id), scratch)
    return y


_OPS = {"gated_delta_rule_varlen": gated_delta_rule_varlen, "gated_delta_rule_update": gated_delta_rule_update,
        "kda_varlen": kda_varlen, "kda_update": kda_update, "kda_update_spec": kda_update_spec}
register(Impl(name="fla", reads_host=True, devices=("cuda", "cpu"),
              ops={k: interpreted("fla.", f) if interpreting() else f for k, f in _OPS.items()},
              dtypes=(torch.float32,) if interpreting() else (torch.float32, torch.float16, torch.bfloat16),
              fp32_matmul="ieee" if FP32 == "ieee" else "tf32",
              unavailable=lambda: fp32_mode_problem() or unavailable_here("fla-core's", "fla-core", _GDN, _KDA,
                                                                          _KDA_REC),
              description="flash-linear-attention (fla-core) Triton kernels: GDN and KDA (prefill, decode; "
                          "KDA's speculative decode)"))
