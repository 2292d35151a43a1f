"""The op contract: one signature per op, close to what serving engines call.

Every implementation (ours, a peer's adapter, a user's) provides some of these ops in its
`Impl.ops` dict under these names, with exactly these signatures. Adapters translate to the peer's
own calling convention; suites and benchmarks only ever call through this contract.

Conventions for every op
------------------------
* Token-major packed layout: the first dim of per-token tensors is the token index over all
  sequences of the batch concatenated (T tokens). `query_start_loc` (int32/int64, shape (S+1,),
  on the op's device) splits them into S sequences: starts at 0, non-decreasing, ends at T.
* State pools: `*_states` are pools of `num_slots` slots (first dim); they may be strided views
  (e.g. page-major: one buffer per slot holding all layers, each layer a view with a slot stride
  larger than the slot's numel). Implementations must honour strides, never `.contiguous()` a pool
  and copy back.
* `cache_indices[i]` (prefill) / `*_indices[b]` (decode) names the pool slot of sequence i / batch
  row b. `has_initial_state[i]` (bool): read the slot as the initial state, else start from zeros.
  After the op, the slot holds the sequence's final state. A request whose index equals
  `pad_slot_id` (default PAD_SLOT_ID = -1) is padding: its slot is neither read nor written, its
  output rows are unspecified (suites don't compare them). Slots not named by the batch are left
  bit-for-bit unchanged.
* `out=`: an optional preallocated output (suites poison it with NaN before the call); the op writes
  into it and returns it. Without `out`, a new tensor is returned.
* dtypes: activations in fp16/bf16/fp32 (fp64 where an implementation supports it); A, D, dt_bias
  in fp32 (or the activations' dtype); pools in any float dtype (recurrent state usually fp32).
  Implementations accumulate in fp32 at least.
* Bad input — wrong dtypes or layouts, indices outside the pool, query_start_loc inconsistent with
  the token count — raises ValueError (argument, expected, got) *before* any kernel launches: call
  the `validate_<op>` function of this module first. Index range checks read the indices on the
  host; inside `no_index_checks()` (e.g. CUDA-graph capture) they are skipped.

Ops
---
causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                     *, activation=None, pad_slot_id=PAD_SLOT_ID, out=None) -> y
    x (T, D); weight (D, K), 2 <= K <= 8; bias (D,) | None; conv_states (num_slots, D, K-1);
    activation None | "silu". Per sequence: y = act(bias + causal depthwise conv of x with the carried
    window); the slot receives the last K-1 inputs (oldest first; from the initial window where the
    sequence is shorter than K-1).
causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices,
                     *, activation=None, pad_slot_id=PAD_SLOT_ID, out=None) -> y
    x (B, D): one token per row; conv_states (num_slots, D, K-1) updated in place.
selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                      has_initial_state, *, delta_softplus=True, pad_slot_id=PAD_SLOT_ID, out=None) -> y
    Mamba-1. u, delta (T, Dm); A (Dm, N); B, C (T, G, N) with G | Dm (channel d uses group
    d // (Dm // G)); D (Dm,) | None; z (T, Dm) | None; delta_bias (Dm,) | None; ssm_states (num_slots, Dm, N).
selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                       *, dt_softplus=True, dt_limit=(0.0, inf), pad_slot_id=PAD_SLOT_ID, out=None) -> y
    Decode, one token per row, in either layout (chosen by state.dim()):
      Mamba-1: state (num_slots, Dm, N); x, dt, z (B, Dm); A (Dm, N); B, C (B, G, N); D, dt_bias (Dm,).
      Mamba-2: state (num_slots, H, P, N); x, z (B, H, P); dt (B, H); A (H,); B, C (B, G, N) with
               G | H (head h uses group h // (H // G)); D (H,) or (H, P); dt_bias (H,).
    dt_limit clamps dt after bias and softplus (Mamba-2's time_step_limit).
ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
           has_initial_state, *, dt_softplus=True, dt_limit=(0.0, inf), pad_slot_id=PAD_SLOT_ID, out=None) -> y
    Mamba-2 SSD over packed sequences that may start anywhere inside a chunk of the packed stream.
    x (T, H, P); dt (T, H); A (H,); B, C (T, G, N); D (H,) or (H, P) | None; z (T, H, P) | None
    (y *= silu(z)); dt_bias (H,) | None; ssm_states (num_slots, H, P, N).
gated_rms_norm(x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None) -> y
    x, z (T, D); weight (D,). Per group of `group_size` channels (None = D): with z and
    norm_before_gate: rms(x) * weight * silu(z); without norm_before_gate: rms(x * silu(z)) * weight.
"""
from __future__ import annotations

import contextlib
import math

import torch

from reference.validate import check_cu_seqlens, check_tensor, fail

PAD_SLOT_ID = -1
INF = math.inf

OP_NAMES = (
    "causal_conv1d_varlen",
    "causal_conv1d_update",
    "selective_scan_varlen",
    "selective_state_update",
    "ssd_varlen",
    "gated_rms_norm",
)

_INDEX_CHECKS = [True]


@contextlib.contextmanager
def no_index_checks():
    """Skip the host-side index range checks (they synchronise; illegal under CUDA-graph capture)."""
    _INDEX_CHECKS.append(False)
    try:
        yield
    finally:
        _INDEX_CHECKS.pop()


def _index_checks_on() -> bool:
    return _INDEX_CHECKS[-1]


_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


def _same_device(**tensors):
    dev = None
    first = None
    for k, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev, first = t.device, k
        elif t.device != dev:
            fail(k, f"a tensor on {dev} (same device as {first})", f"a tensor on {t.device}")


def _check_qsl(query_start_loc, num_tokens, arg="query_start_loc"):
    check_tensor(arg, query_start_loc, ndim=1, dtypes=_INT_DTYPES)
    if _index_checks_on():
        check_cu_seqlens(query_start_loc, num_tokens, arg)  # starts at 0, non-decreasing, ends at T
    elif query_start_loc.numel() < 2:
        fail(arg, "at least 2 entries [0, ..., T]", f"{query_start_loc.numel()} entries")
    return query_start_loc.numel() - 1


def _check_indices(arg, idx, n, num_slots, pad_slot_id):
    check_tensor(arg, idx, shape=(n,), dtypes=_INT_DTYPES)
    if _index_checks_on() and n:
        i = idx.detach().to("cpu", torch.int64)
        bad = (i != pad_slot_id) & ((i < 0) | (i >= num_slots))
        if bool(bad.any()):
            fail(arg, f"slot ids in [0, {num_slots}) or pad_slot_id={pad_slot_id}",
                 f"{i[bad].tolist()} at positions {bad.nonzero().flatten().tolist()}")
        live = i[i != pad_slot_id]
        if live.numel() != live.unique().numel():
            fail(arg, "distinct slot ids for live requests", i.tolist())


def _check_out(out, shape, dtype, device):
    if out is None:
        return
    check_tensor("out", out, shape=shape)
    if out.dtype != dtype:
        fail("out", f"dtype {dtype}", f"dtype {out.dtype}")
    if out.device != device:
        fail("out", f"a tensor on {device}", f"a tensor on {out.device}")


def _check_groups(arg, t, rows, channels, what):
    check_tensor(arg, t, ndim=3, dtypes=_ACT_DTYPES)
    if t.shape[0] != rows:
        fail(arg, f"shape ({rows}, G, N)", f"shape {tuple(t.shape)}")
    G = t.shape[1]
    if G <= 0 or channels % G != 0:
        fail(arg, f"a group count G dividing {what}={channels}", f"G={G} (shape {tuple(t.shape)})")
    return G, t.shape[2]


def _check_conv_params(D, weight, bias, conv_states, activation) -> int:
    """Shared checks of the two conv ops: weight (D, K), bias, the conv-state pool, activation. Returns K."""
    check_tensor("weight", weight, ndim=2, dtypes=_ACT_DTYPES)
    if weight.shape[0] != D or not 2 <= weight.shape[1] <= 8:
        fail("weight", f"shape ({D}, K) with 2 <= K <= 8", f"shape {tuple(weight.shape)}")
    K = weight.shape[1]
    check_tensor("bias", bias, shape=(D,), dtypes=_ACT_DTYPES, optional=True)
    check_tensor("conv_states", conv_states, ndim=3, dtypes=_ACT_DTYPES)
    if tuple(conv_states.shape[1:]) != (D, K - 1):
        fail("conv_states", f"shape (num_slots, {D}, {K - 1})", f"shape {tuple(conv_states.shape)}")
    if activation not in (None, "silu"):
        fail("activation", "None or 'silu'", repr(activation))
    return K


def validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                  has_initial_state, activation=None, pad_slot_id=PAD_SLOT_ID, out=None):
    check_tensor("x", x, ndim=2, dtypes=_ACT_DTYPES)
    T, D = x.shape
    K = _check_conv_params(D, weight, bias, conv_states, activation)
    S = _check_qsl(query_start_loc, T)
    _check_indices("cache_indices", cache_indices, S, conv_states.shape[0], pad_slot_id)
    check_tensor("has_initial_state", has_initial_state, shape=(S,), dtypes=(torch.bool,))
    _same_device(x=x, weight=weight, bias=bias, conv_states=conv_states, query_start_loc=query_start_loc,
                 cache_indices=cache_indices, has_initial_state=has_initial_state)
    _check_out(out, (T, D), x.dtype, x.device)
    return T, D, K, S


def validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation=None,
                                  pad_slot_id=PAD_SLOT_ID, out=None):
    check_tensor("x", x, ndim=2, dtypes=_ACT_DTYPES)
    Bsz, D = x.shape
    K = _check_conv_params(D, weight, bias, conv_states, activation)
    _check_indices("conv_state_indices", conv_state_indices, Bsz, conv_states.shape[0], pad_slot_id)
    _same_device(x=x, weight=weight, bias=bias, conv_states=conv_states, conv_state_indices=conv_state_indices)
    _check_out(out, (Bsz, D), x.dtype, x.device)
    return Bsz, D, K


def validate_selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc,
                                   cache_indices, has_initial_state, pad_slot_id=PAD_SLOT_ID, out=None):
    check_tensor("u", u, ndim=2, dtypes=_ACT_DTYPES)
    T, Dm = u.shape
    check_tensor("delta", delta, shape=(T, Dm), dtypes=_ACT_DTYPES)
    check_tensor("A", A, ndim=2, dtypes=_ACT_DTYPES)
    if A.shape[0] != Dm:
        fail("A", f"shape ({Dm}, N)", f"shape {tuple(A.shape)}")
    N = A.shape[1]
    G, NB = _check_groups("B", B, T, Dm, "Dm")
    GC, NC = _check_groups("C", C, T, Dm, "Dm")
    if NB != N or NC != N or GC != G:
        fail("B/C", f"shape ({T}, G, {N}) with the same G", f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    check_tensor("D", D, shape=(Dm,), dtypes=_ACT_DTYPES, optional=True)
    check_tensor("z", z, shape=(T, Dm), dtypes=_ACT_DTYPES, optional=True)
    check_tensor("delta_bias", delta_bias, shape=(Dm,), dtypes=_ACT_DTYPES, optional=True)
    check_tensor("ssm_states", ssm_states, ndim=3, dtypes=_ACT_DTYPES)
    if tuple(ssm_states.shape[1:]) != (Dm, N):
        fail("ssm_states", f"shape (num_slots, {Dm}, {N})", f"shape {tuple(ssm_states.shape)}")
    S = _check_qsl(query_start_loc, T)
    _check_indices("cache_indices", cache_indices, S, ssm_states.shape[0], pad_slot_id)
    check_tensor("has_initial_state", has_initial_state, shape=(S,), dtypes=(torch.bool,))
    _same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias, ssm_states=ssm_states,
                 query_start_loc=query_start_loc, cache_indices=cache_indices, has_initial_state=has_initial_state)
    _check_out(out, (T, Dm), u.dtype, u.device)
    return T, Dm, N, G, S


def validate_selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                                    dt_limit=(0.0, INF), pad_slot_id=PAD_SLOT_ID, out=None):
    """Returns ("mamba1", Bsz, Dm, N, G) or ("mamba2", Bsz, H, P, N, G)."""
    check_tensor("state", state, dtypes=_ACT_DTYPES)
    if state.dim() == 3:
        _, Dm, N = state.shape
        check_tensor("x", x, ndim=2, dtypes=_ACT_DTYPES)
        Bsz = x.shape[0]
        check_tensor("x", x, shape=(Bsz, Dm))
        check_tensor("dt", dt, shape=(Bsz, Dm), dtypes=_ACT_DTYPES)
        check_tensor("A", A, shape=(Dm, N), dtypes=_ACT_DTYPES)
        chans, what = Dm, "Dm"
        check_tensor("D", D, shape=(Dm,), dtypes=_ACT_DTYPES, optional=True)
        check_tensor("z", z, shape=(Bsz, Dm), dtypes=_ACT_DTYPES, optional=True)
        check_tensor("dt_bias", dt_bias, shape=(Dm,), dtypes=_ACT_DTYPES, optional=True)
        layout = ("mamba1", Bsz, Dm, N)
    elif state.dim() == 4:
        _, H, P, N = state.shape
        check_tensor("x", x, ndim=3, dtypes=_ACT_DTYPES)
        Bsz = x.shape[0]
        check_tensor("x", x, shape=(Bsz, H, P))
        check_tensor("dt", dt, shape=(Bsz, H), dtypes=_ACT_DTYPES)
        check_tensor("A", A, shape=(H,), dtypes=_ACT_DTYPES)
        chans, what = H, "H"
        if D is not None and tuple(D.shape) not in ((H,), (H, P)):
            fail("D", f"shape ({H},) or ({H}, {P})", f"shape {tuple(D.shape)}")
        check_tensor("z", z, shape=(Bsz, H, P), dtypes=_ACT_DTYPES, optional=True)
        check_tensor("dt_bias", dt_bias, shape=(H,), dtypes=_ACT_DTYPES, optional=True)
        layout = ("mamba2", Bsz, H, P, N)
    else:
        fail("state", "a pool of shape (num_slots, Dm, N) (Mamba-1) or (num_slots, H, P, N) (Mamba-2)",
             f"shape {tuple(state.shape)}")
    G, NB = _check_groups("B", B, Bsz, chans, what)
    GC, NC = _check_groups("C", C, Bsz, chans, what)
    if NB != N or NC != N or GC != G:
        fail("B/C", f"shape ({Bsz}, G, {N}) with the same G", f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        fail("dt_limit", "(lo, hi) with lo <= hi", dt_limit)
    _check_indices("state_batch_indices", state_batch_indices, Bsz, state.shape[0], pad_slot_id)
    _same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                 state_batch_indices=state_batch_indices)
    _check_out(out, tuple(x.shape), x.dtype, x.device)
    return layout + (G,)


def validate_ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
                        has_initial_state, dt_limit=(0.0, INF), pad_slot_id=PAD_SLOT_ID, out=None):
    check_tensor("x", x, ndim=3, dtypes=_ACT_DTYPES)
    T, H, P = x.shape
    check_tensor("dt", dt, shape=(T, H), dtypes=_ACT_DTYPES)
    check_tensor("A", A, shape=(H,), dtypes=_ACT_DTYPES)
    G, NB = _check_groups("B", B, T, H, "H")
    GC, NC = _check_groups("C", C, T, H, "H")
    if NC != NB or GC != G:
        fail("C", f"shape ({T}, {G}, {NB}) like B", f"shape {tuple(C.shape)}")
    N = NB
    if not isinstance(chunk_size, int) or chunk_size < 1:
        fail("chunk_size", "a positive int", repr(chunk_size))
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        fail("D", f"shape ({H},) or ({H}, {P})", f"shape {tuple(D.shape)}")
    check_tensor("z", z, shape=(T, H, P), dtypes=_ACT_DTYPES, optional=True)
    check_tensor("dt_bias", dt_bias, shape=(H,), dtypes=_ACT_DTYPES, optional=True)
    check_tensor("ssm_states", ssm_states, ndim=4, dtypes=_ACT_DTYPES)
    if tuple(ssm_states.shape[1:]) != (H, P, N):
        fail("ssm_states", f"shape (num_slots, {H}, {P}, {N})", f"shape {tuple(ssm_states.shape)}")
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        fail("dt_limit", "(lo, hi) with lo <= hi", dt_limit)
    S = _check_qsl(query_start_loc, T)
    _check_indices("cache_indices", cache_indices, S, ssm_states.shape[0], pad_slot_id)
    check_tensor("has_initial_state", has_initial_state, shape=(S,), dtypes=(torch.bool,))
    _same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states,
                 query_start_loc=query_start_loc, cache_indices=cache_indices, has_initial_state=has_initial_state)
    _check_out(out, (T, H, P), x.dtype, x.device)
    return T, H, P, N, G, S


def validate_gated_rms_norm(x, weight, z, eps=1e-6, group_size=None, out=None):
    check_tensor("x", x, ndim=2, dtypes=_ACT_DTYPES)
    T, Dd = x.shape
    check_tensor("weight", weight, shape=(Dd,), dtypes=_ACT_DTYPES)
    check_tensor("z", z, shape=(T, Dd), dtypes=_ACT_DTYPES, optional=True)
    gs = Dd if group_size is None else group_size
    if not isinstance(gs, int) or gs <= 0 or Dd % gs != 0:
        fail("group_size", f"a positive divisor of D={Dd} (or None)", repr(group_size))
    if not eps > 0:
        fail("eps", "a positive float", eps)
    _same_device(x=x, weight=weight, z=z)
    _check_out(out, (T, Dd), x.dtype, x.device)
    return T, Dd, gs
