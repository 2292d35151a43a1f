"""Triton decode steps of the gated delta rule: `gated_delta_rule_update` (Gated DeltaNet, one log-decay per
value head) and `kda_update` (Kimi Delta Attention, one log-decay per key channel), one kernel for both; and
their multi-token forms for speculative decoding, `gated_delta_rule_update_spec` and `kda_update_spec`, a
second kernel built from the same step.

One program per (batch row, value head, block of BV value rows), on a flat grid whose consecutive programs
walk the value blocks of one head, then the heads of one row (so they stream a slot's contiguous (Hv, V, K)
state in order and share the row's q / k loads). A program holds its (BV, K) tile of the value-major
state in registers, K the contiguous vector axis, and streams it once: read, update in fp32 (fp64 for
fp64 activations), write back in place. Per token t of row b and value head h (key head h // (Hv // Hk)):

    q, k <- l2norm(q), l2norm(k) (optional; x / sqrt(sum x^2 + 1e-6)),  q <- q * scale
    S <- exp(g) S            (g a scalar (GDN) or a K-vector scaling S's columns (KDA))
    u = beta (v - S k),  S <- S + u k^T,  o = S q

One-token decode: token b, the row's slot state_indices[b] read and written; a pad row (index ==
pad_slot_id) reads and writes no slot and its output is stored as 0 (the op contract). Multi-token decode
(layout: reference.spec_decode): the program reads the tile of the row's start slot
state_indices[b, num_accepted_tokens[b] - 1] once, then for each of the row's tokens query_start_loc[b] + j
(at most num_spec + 1) applies the step, stores o and stores the tile to slot state_indices[b, j] (unless it
is the pad id). Slot ids are distinct over the whole table, so a program is the only reader and writer of its
tile in its row's slots, and the start tile is in registers before its first store (a row may write into its
start slot). A row without tokens or whose start slot is the pad id reads and writes no slot and its tokens
get o = 0. The pool may be any strided view (page-major); its strides are used as they are, as are those of
q, k, v, g, beta, o and the slot table. Launch parameters (BV, num_warps per family, and the smallest grid a
small batch is spread to; both forms alike) come from CONFIG (configs/<device>/delta_rule_update.json). No
host synchronisation: the ops can be captured in a CUDA graph (the layout's value checks run in the op's
validation, which `no_index_checks()` skips).
"""
from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from harness import ops as C
from harness.impls.registry import provides
from harness.impls.triton._common import (Fixed, HostPlans, compute_dtype, device_guard, index_type, interpreting,
                                          launch_config, launch_fixed, next_power_of_2, unit_stride)
from harness.impls.triton.spec_decode import _pos, _row, _zero_padding_row
from harness.ops import PAD_SLOT_ID
from reference.delta_rule import L2NORM_EPS

# Launch parameters per family: value rows per program (bv) and warps, from the H200 sweep (bv 32 with one warp
# streams the state at ~3.9 TB/s at batch 64 and 256); min_programs: small batches halve bv (down to 8) until the
# grid has at least this many programs, to spread batch 1 over the SMs. The device's values are in
# configs/<device>/delta_rule_update.json (`harness bench sweep --op gated_delta_rule_update` / `kda_update`).
# The sweeps try first the (bv, warps) pairs with <= 64 state values a thread.
CONFIG = launch_config("delta_rule_update", {"gdn_bv": 32, "gdn_warps": 1, "kda_bv": 32, "kda_warps": 1,
                                              "gdn_spec_bv": 32, "gdn_spec_warps": 1, "kda_spec_bv": 32,
                                              "kda_spec_warps": 1, "min_programs": 512})

# Triton decides at import whether its kernels are interpreted; reading the environment once keeps it off the
# per-call path (decode at batch 1 is bound by the host's time per call)
_INTERPRETED = interpreting()
_BV_INTERPRETED = 8  # small value blocks under the interpreter: several blocks per head in tiny tests
_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def _program(pid, HV, HPK, V, K, NV, BV: tl.constexpr, BK: tl.constexpr, IDX: tl.constexpr, EVEN_V: tl.constexpr,
             EVEN_K: tl.constexpr):
    """Program pid's row b, value head h and key head hk (int64; consecutive programs walk the value blocks of
    one head, then the heads of one row), its first value row v0, its key channels kk and value rows vv
    (index type IDX) and their masks."""
    vb = pid % NV
    bh = pid // NV
    h = bh % HV
    kk = tl.arange(0, BK).to(IDX)
    vv = tl.arange(0, BV).to(IDX)
    v0 = vb * BV
    if EVEN_K:  # constant-true masks fold away
        km = tl.full((BK,), 1, tl.int1)
    else:
        km = kk < K
    if EVEN_V:
        vm = tl.full((BV,), 1, tl.int1)
    else:
        vm = (v0 + vv) < V
    return (bh // HV).to(tl.int64), h.to(tl.int64), (h // HPK).to(tl.int64), v0, kk, vv, km, vm


@triton.jit
def _tile(st_ptr, slot, h, v0, vv, kk, ss0, ss1, ss2, ss3):
    """Addresses of the (BV, K) tile of value head h, value rows from v0, in slot `slot` (int64): the slot, head
    and block offsets in int64, the offsets within the tile in the index type of vv and kk."""
    return st_ptr + slot * ss0 + h * ss1 + v0.to(tl.int64) * ss2 + vv[:, None] * ss2 + kk[None, :] * ss3


@triton.jit
def _token(s, t, h, hk, v0, kk, vv, km, vm, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, scale_hi, scale_lo,
           sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1,
           PER_KEY: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr):
    """One step of the recurrence on the (BV, K) tile s (in ACC) by token t (int64): (the new tile, o (BV,))."""
    qv = tl.load(q_ptr + t * sq0 + hk * sq1 + kk * sq2, mask=km, other=0.0).to(ACC)
    kv = tl.load(k_ptr + t * sk0 + hk * sk1 + kk * sk2, mask=km, other=0.0).to(ACC)
    vval = tl.load(v_ptr + t * sv0 + h * sv1 + (v0 + vv) * sv2, mask=vm, other=0.0).to(ACC)
    beta = tl.load(beta_ptr + t * sb0 + h * sb1).to(ACC)
    if L2NORM:
        qv = qv / tl.sqrt(tl.sum(qv * qv, axis=0) + _EPS)
        kv = kv / tl.sqrt(tl.sum(kv * kv, axis=0) + _EPS)
    # scale as an fp32 pair (hi + lo) so fp64 runs get it exactly: float kernel arguments arrive as fp32
    qv = qv * scale_hi + qv * scale_lo

    if PER_KEY:  # KDA: one decay per key channel, scaling the state's columns
        gv = tl.load(g_ptr + t * sg0 + h * sg1 + kk * sg2, mask=km, other=0.0).to(ACC)
        s = s * tl.exp(gv)[None, :]
    else:  # GDN: one decay per value head
        gv = tl.load(g_ptr + t * sg0 + h * sg1).to(ACC)
        s = s * tl.exp(gv)

    u = beta * (vval - tl.sum(s * kv[None, :], axis=1))  # (BV,)
    s = s + u[:, None] * kv[None, :]
    return s, tl.sum(s * qv[None, :], axis=1)


@triton.jit
def _delta_rule_update_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, st_ptr, idx_ptr, o_ptr,
                              HV, HPK, V, K, NV, pad_id, scale_hi, scale_lo,
                              sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1,
                              ss0, ss1, ss2, ss3, so0, so1, so2,
                              BV: tl.constexpr, BK: tl.constexpr, PER_KEY: tl.constexpr, L2NORM: tl.constexpr,
                              ACC: tl.constexpr, IDX: tl.constexpr, EVEN_V: tl.constexpr, EVEN_K: tl.constexpr):
    b, h, hk, v0, kk, vv, km, vm = _program(tl.program_id(0), HV, HPK, V, K, NV, BV, BK, IDX, EVEN_V, EVEN_K)
    # the row's slot; a pad reads as a zero state and writes nothing
    slot = tl.load(idx_ptr + b).to(tl.int64)
    live = (vv * 0 + slot) != pad_id  # as a vector (the interpreter mishandles vector & scalar bools)
    sptr = _tile(st_ptr, tl.where(slot != pad_id, slot, 0), h, v0, vv, kk, ss0, ss1, ss2, ss3)
    smask = (vm & live)[:, None] & km[None, :]
    s = tl.load(sptr, mask=smask, other=0.0).to(ACC)
    s, o = _token(s, b, h, hk, v0, kk, vv, km, vm, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, scale_hi, scale_lo,
                  sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1, PER_KEY, L2NORM, ACC)
    o = tl.where(live, o, 0.0)  # a pad row gets o = 0
    tl.store(o_ptr + b * so0 + h * so1 + (v0 + vv) * so2, o.to(o_ptr.dtype.element_ty), mask=vm)
    tl.store(sptr, s.to(st_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _delta_rule_update_spec_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, st_ptr, qsl_ptr, tab_ptr, acc_ptr, o_ptr,
                                   HV, HPK, V, K, NV, pad_id, scale_hi, scale_lo,
                                   sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1,
                                   ss0, ss1, ss2, ss3, so0, so1, so2, st0, st1,
                                   S: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, PER_KEY: tl.constexpr,
                                   L2NORM: tl.constexpr, ACC: tl.constexpr, IDX: tl.constexpr,
                                   EVEN_V: tl.constexpr, EVEN_K: tl.constexpr):
    # row b's tokens in turn on the tile of its start slot, read once; position j's state stored to its slot j
    b, h, hk, v0, kk, vv, km, vm = _program(tl.program_id(0), HV, HPK, V, K, NV, BV, BK, IDX, EVEN_V, EVEN_K)
    start, ntok, init = _row(qsl_ptr, tab_ptr, acc_ptr, b, st0, st1, pad_id, S)
    zero = vv * 0  # masks are built as vectors (the interpreter mishandles vector & scalar bools)
    tmask = vm[:, None] & km[None, :]
    s = tl.load(_tile(st_ptr, init, h, v0, vv, kk, ss0, ss1, ss2, ss3),
                mask=tmask & ((zero + ntok) > 0)[:, None], other=0.0).to(ACC)
    ooff = h * so1 + (v0 + vv) * so2
    _zero_padding_row(o_ptr, qsl_ptr, b, start, ntok, ooff, vm, so0)
    for j in range(0, ntok):
        t, on, wr, slot = _pos(tab_ptr, b, j, start, ntok, st0, st1, pad_id)
        s, o = _token(s, t, h, hk, v0, kk, vv, km, vm, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, scale_hi, scale_lo,
                      sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1, PER_KEY, L2NORM, ACC)
        tl.store(o_ptr + t * so0 + ooff, o.to(o_ptr.dtype.element_ty), mask=vm)
        wv = (zero + wr.to(tl.int32)) != 0
        tl.store(_tile(st_ptr, slot, h, v0, vv, kk, ss0, ss1, ss2, ss3), s.to(st_ptr.dtype.element_ty),
                 mask=tmask & wv[:, None])


_VALIDATE = {"gdn": C.validate_gated_delta_rule_update, "kda": C.validate_kda_update}
_VALIDATE_SPEC = {"gdn": C.validate_gated_delta_rule_update_spec, "kda": C.validate_kda_update_spec}
# (value rows, warps) per kind and form: the multi-token form ("_spec") has its own (it holds a token's vectors
# beside the tile across a loop: more registers at the same value block)
_CONFIG_KEYS = {(kind, form): (f"{kind}{form}_bv", f"{kind}{form}_warps") for kind in ("gdn", "kda")
                for form in ("", "_spec")}


@functools.lru_cache(maxsize=64)
def _scale_pair(scale: float) -> tuple[float, float]:
    """scale as hi + lo, both exactly representable in fp32 (hi + lo equals scale to ~2^-48 relative)."""
    hi = struct.unpack("f", struct.pack("f", scale))[0]
    return hi, scale - hi


def _plan(dims, call, kind, spec):
    """The launch of one call (`call`: the op's arguments in its validator's order; `spec`: the multi-token form)
    from the validator's answer `dims`: (the `Fixed` launch, or None where there is nothing to compute; the
    arguments between the tensors and pad_slot_id; those after the scale; o's shape; whether the pool is
    addressed (a pool without slots is never addressed: every row is then a pad, and any tensor stands in for
    it); the scale pair of scale=None)."""
    q, k, v, g, beta, ssm_states = call[:6]
    out = call[-1]
    if spec:
        T, Hk, Hv, K, V, rows, S = dims
        extra = dict(S=S)
        index_strides = unit_stride(call[7])[0].stride()
    else:
        T, Hk, Hv, K, V = dims
        rows = T
        extra, index_strides = {}, ()
    oshape = (T, Hv, V)
    default_scale = _scale_pair(K ** -0.5)
    if T == 0 or Hv == 0 or V == 0:
        return None, (), (), oshape, True, default_scale
    interp = _INTERPRETED
    bv_key, warps_key = _CONFIG_KEYS[kind, "_spec" if spec else ""]
    acc = tl.float64 if compute_dtype(q.dtype) == torch.float64 else tl.float32
    BK = next_power_of_2(K)
    BV = min(next_power_of_2(V), _BV_INTERPRETED if interp else CONFIG[bv_key])
    least = CONFIG["min_programs"]
    while BV > 8 and rows * Hv * ((V + BV - 1) // BV) < least:
        BV //= 2
    NV = (V + BV - 1) // BV
    sq, sk, sv, sb, ss = q.stride(), k.stride(), v.stride(), beta.stride(), ssm_states.stride()
    so = (out if out is not None else torch.empty(oshape, device="meta")).stride()
    sg = g.stride()
    sg = sg if len(sg) == 3 else sg + (0,)
    # the largest offset formed in the per-program index type: within one head's (V, K) state tile and along
    # the q / k / g / v / o vectors (rows, tokens, heads and slots are offset in int64; strides are never
    # negative)
    extent = max((V - 1) * ss[2] + (K - 1) * ss[3], (K - 1) * max(sq[2], sk[2], sg[2]), (V - 1) * max(sv[2], so[2]))
    fixed = Fixed(_KERNELS[spec], (rows * Hv * NV,),
                  BV=BV, BK=BK, PER_KEY=kind == "kda", L2NORM=bool(call[-3]), ACC=acc, IDX=index_type(extent),
                  EVEN_V=V % BV == 0, EVEN_K=K == BK, num_warps=1 if interp else CONFIG[warps_key], **extra)
    return (fixed, (Hv, Hv // Hk, V, K, NV), (*sq, *sk, *sv, *sg, *sb, *ss, *so, *index_strides), oshape,
            ssm_states.numel() > 0, default_scale)


def _run(plans, call, index):
    """The op's call `call` (validator order, `out=` last; `index`: the index tensors the kernel takes after the
    pool) through its launch plans `plans`. Returns o (T, Hv, V)."""
    fixed, head, tail, oshape, own_pool, default_scale = plans.plan(call)
    q, k, v, g, beta, ssm_states = call[:6]
    out = call[-1]
    o = out if out is not None else torch.empty(oshape, dtype=v.dtype, device=v.device)
    if fixed is None:
        return o
    scale = call[-4]
    hi, lo = default_scale if scale is None else _scale_pair(float(scale))
    with device_guard(v):
        launch_fixed(fixed, q, k, v, g, beta, ssm_states if own_pool else v, *unit_stride(*index), o, *head,
                     call[-2], hi, lo, *tail)
    return o


_KERNELS = {False: _delta_rule_update_kernel, True: _delta_rule_update_spec_kernel}
_PLANS = {(kind, spec): HostPlans((_VALIDATE_SPEC if spec else _VALIDATE)[kind],
                                  functools.partial(_plan, kind=kind, spec=spec), CONFIG)
          for kind in ("gdn", "kda") for spec in (False, True)}


def _update(kind, q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out):
    return _run(_PLANS[kind, False], (q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id,
                                      out), (state_indices,))


def _update_spec(kind, q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, scale,
                 use_qk_l2norm, pad_slot_id, out):
    return _run(_PLANS[kind, True], (q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                                     scale, use_qk_l2norm, pad_slot_id, out),
                (query_start_loc, state_indices, num_accepted_tokens))


@provides("triton", "gated_delta_rule_update")
def gated_delta_rule_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
                            pad_slot_id=PAD_SLOT_ID, out=None):
    """One Gated DeltaNet decode step per row (see harness.ops)."""
    return _update("gdn", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)


@provides("triton", "kda_update")
def kda_update(q, k, v, g, beta, ssm_states, state_indices, *, scale=None, use_qk_l2norm=False,
               pad_slot_id=PAD_SLOT_ID, out=None):
    """One KDA decode step per row (see harness.ops)."""
    return _update("kda", q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm, pad_slot_id, out)


@provides("triton", "gated_delta_rule_update_spec")
def gated_delta_rule_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                                 *, scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """Gated DeltaNet decode steps over each row's speculative tokens (see harness.ops)."""
    return _update_spec("gdn", q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                        scale, use_qk_l2norm, pad_slot_id, out)


@provides("triton", "kda_update_spec")
def kda_update_spec(q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, *,
                    scale=None, use_qk_l2norm=False, pad_slot_id=PAD_SLOT_ID, out=None):
    """KDA decode steps over each row's speculative tokens (see harness.ops)."""
    return _update_spec("kda", q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens,
                        scale, use_qk_l2norm, pad_slot_id, out)
