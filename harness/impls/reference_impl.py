"""The reference run through the op contract (`--impl reference`), and the float64 oracle.

`oracle(op_name, *args, **kwargs)` evaluates any op of `harness.ops` in float64 on copies of its
inputs with the plain-loop reference ops, and returns `(y, pool)`: the float64 output and the float64
pool after the op (pad and unnamed slots unchanged). Suites compare implementations against it.

The `reference` implementation does the same in the inputs' precision (fp32 for half types) and
writes into the real pool and `out`, so the suites exercise their own plumbing on any machine.
"""
from __future__ import annotations

import torch

from harness import ops as C
from harness.impls.registry import Impl, register


def _up(t, dtype):
    return None if t is None else t.detach().to(dtype)


def _slot_list(indices, pad_slot_id):
    """Host list of slot ids with the caller's pad id normalised to PAD_SLOT_ID."""
    return [C.PAD_SLOT_ID if s == pad_slot_id else s for s in indices.tolist()]


def _gather(pool, idx, has_init, dtype):
    """Initial states for each sequence: the slot if has_initial_state and not pad, else zeros."""
    shape = (len(idx),) + tuple(pool.shape[1:])
    init = torch.zeros(shape, dtype=dtype, device=pool.device)
    for i, (s, h) in enumerate(zip(idx, has_init)):
        if s != C.PAD_SLOT_ID and h:
            init[i] = pool[s].to(dtype)
    return init


def _scatter(pool, idx, final):
    for i, s in enumerate(idx):
        if s != C.PAD_SLOT_ID:
            pool[s] = final[i].to(pool.dtype)


def _conv_varlen(cd, x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                 *, activation=None, pad_slot_id=C.PAD_SLOT_ID, out=None):
    from reference.conv1d import causal_conv1d
    C.validate_causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                    has_initial_state, activation, pad_slot_id, out)
    idx = _slot_list(cache_indices, pad_slot_id)
    init = _gather(conv_states, idx, has_initial_state.tolist(), cd)
    y, final = causal_conv1d(_up(x, cd), _up(weight, cd), _up(bias, cd), activation=activation,
                             cu_seqlens=query_start_loc.cpu().long(), initial_states=init)
    _scatter(conv_states, idx, final)
    return _emit(y, x, out)


def _conv_update(cd, x, conv_states, weight, bias, conv_state_indices, *, activation=None,
                 pad_slot_id=C.PAD_SLOT_ID, out=None):
    from reference.conv1d import causal_conv1d_update
    C.validate_causal_conv1d_update(x, conv_states, weight, bias, conv_state_indices, activation,
                                    pad_slot_id, out)
    idx = _slot_list(conv_state_indices, pad_slot_id)
    st = _gather(conv_states, idx, [True] * len(idx), cd)
    y, new = causal_conv1d_update(_up(x, cd), st, _up(weight, cd), _up(bias, cd), activation=activation)
    _scatter(conv_states, idx, new)
    return _emit(y, x, out)


def _scan_varlen(cd, u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc, cache_indices,
                 has_initial_state, *, delta_softplus=True, pad_slot_id=C.PAD_SLOT_ID, out=None):
    from reference.selective_scan import selective_scan
    C.validate_selective_scan_varlen(u, delta, A, B, Cm, D, z, delta_bias, ssm_states, query_start_loc,
                                     cache_indices, has_initial_state, pad_slot_id, out)
    idx = _slot_list(cache_indices, pad_slot_id)
    init = _gather(ssm_states, idx, has_initial_state.tolist(), cd)
    y, final = selective_scan(_up(u, cd), _up(delta, cd), _up(A, cd), _up(B, cd), _up(Cm, cd), _up(D, cd),
                              _up(z, cd), delta_bias=_up(delta_bias, cd), delta_softplus=delta_softplus,
                              cu_seqlens=query_start_loc.cpu().long(), initial_states=init)
    _scatter(ssm_states, idx, final)
    return _emit(y, u, out)


def _state_update(cd, state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices, *, dt_softplus=True,
                  dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID, out=None):
    from reference.selective_scan import selective_state_update
    from reference.ssd import ssd_state_update
    layout = C.validate_selective_state_update(state, x, dt, A, B, Cm, D, z, dt_bias, state_batch_indices,
                                               dt_limit, pad_slot_id, out)
    idx = _slot_list(state_batch_indices, pad_slot_id)
    st = _gather(state, idx, [True] * len(idx), cd)
    if layout[0] == "mamba1":
        dtc = _up(dt, cd)
        if dt_bias is not None:
            dtc = dtc + _up(dt_bias, cd)
        if dt_softplus:
            dtc = torch.nn.functional.softplus(dtc)
        dtc = dtc.clamp(dt_limit[0], dt_limit[1])
        y, new = selective_state_update(st, _up(x, cd), dtc, _up(A, cd), _up(B, cd), _up(Cm, cd), _up(D, cd),
                                        _up(z, cd), dt_bias=None, dt_softplus=False)
    else:
        y, new = ssd_state_update(st, _up(x, cd), _up(dt, cd), _up(A, cd), _up(B, cd), _up(Cm, cd), _up(D, cd),
                                  _up(z, cd), dt_bias=_up(dt_bias, cd), dt_softplus=dt_softplus,
                                  dt_limit=tuple(dt_limit))
    _scatter(state, idx, new)
    return _emit(y, x, out)


def _ssd_varlen(cd, x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
                has_initial_state, *, dt_softplus=True, dt_limit=(0.0, C.INF), pad_slot_id=C.PAD_SLOT_ID,
                out=None):
    from reference.ssd import ssd_scan
    C.validate_ssd_varlen(x, dt, A, B, Cm, chunk_size, D, z, dt_bias, ssm_states, query_start_loc,
                          cache_indices, has_initial_state, dt_limit, pad_slot_id, out)
    idx = _slot_list(cache_indices, pad_slot_id)
    init = _gather(ssm_states, idx, has_initial_state.tolist(), cd)
    y, final = ssd_scan(_up(x, cd), _up(dt, cd), _up(A, cd), _up(B, cd), _up(Cm, cd), _up(D, cd), _up(z, cd),
                        dt_bias=_up(dt_bias, cd), dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                        cu_seqlens=query_start_loc.cpu().long(), initial_states=init)
    _scatter(ssm_states, idx, final)
    return _emit(y, x, out)


def _gated_norm(cd, x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None):
    from reference.norms import gated_rms_norm
    C.validate_gated_rms_norm(x, weight, z, eps, group_size, out)
    y = gated_rms_norm(_up(x, cd), _up(weight, cd), _up(z, cd), eps=eps, group_size=group_size,
                       norm_before_gate=norm_before_gate)
    return _emit(y, x, out)


def _emit(y, like, out):
    """Write `y` into `out` if given; else return it in the activations' dtype (the `reference` impl) or
    as computed (float64, when `oracle` is evaluating)."""
    if out is not None:
        out.copy_(y.to(out.dtype))
        return out
    return y if _ORACLE[-1] else y.to(like.dtype)


_ORACLE = [False]  # a stack: True while `oracle` evaluates (keeps float64 outputs)

_IMPLS = {
    "causal_conv1d_varlen": _conv_varlen,
    "causal_conv1d_update": _conv_update,
    "selective_scan_varlen": _scan_varlen,
    "selective_state_update": _state_update,
    "ssd_varlen": _ssd_varlen,
    "gated_rms_norm": _gated_norm,
}


def _compute_dtype(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return torch.float64 if a.dtype == torch.float64 else torch.float32
    return torch.float32


def _bind(name):
    fn = _IMPLS[name]

    def op(*args, **kwargs):
        return fn(_compute_dtype(args, kwargs), *args, **kwargs)
    op.__name__ = f"reference_{name}"
    op.__doc__ = f"The reference for `{name}` (see harness.ops), in the inputs' precision (fp32 for half types)."
    return op


POOL_ARG = {  # which positional argument is the state pool, per op
    "causal_conv1d_varlen": 3, "causal_conv1d_update": 1, "selective_scan_varlen": 8,
    "selective_state_update": 0, "ssd_varlen": 9,
}


def oracle(name: str, *args, **kwargs):
    """Float64 evaluation of op `name` on copies of the inputs. Returns (y, pool_after or None)."""
    if name not in _IMPLS:
        raise ValueError(f"name: expected one of {sorted(_IMPLS)}, got {name!r}")
    args = list(args)
    pool = None
    if name in POOL_ARG:
        p = POOL_ARG[name]
        pool = args[p].detach().to(torch.float64).clone()
        args[p] = pool
    kwargs = dict(kwargs)
    kwargs.pop("out", None)
    _ORACLE.append(True)
    try:
        y = _IMPLS[name](torch.float64, *args, **kwargs)
    finally:
        _ORACLE.pop()
    return y, pool


register(Impl(name="reference", ops={n: _bind(n) for n in _IMPLS}, devices=("cpu", "cuda", "xpu"),
              description="reference/ plain loops run through the op contract (fp32 for half inputs)"))
