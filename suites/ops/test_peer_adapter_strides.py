"""What the causal-conv1d and mamba_ssm adapters hand their peers' stride checks (harness/impls/adapters/
causal_conv1d.py, mamba_ssm.py), on the CPU: each peer entry point is replaced by a stand-in that enforces
the peer's documented requirement and computes with the reference, so no peer package is needed.

* causal-conv1d 1.7.0's `causal_conv1d_fn` on its channel-last path (which initial states need) requires
  x.stride(0) and x.stride(2) to be multiples of 8 (a RuntimeError otherwise). The engine's x is a view of a
  fused projection (row stride 2 * d_inner + 2 * G * N + H, no multiple of 8); a one-token slice of it counts
  as contiguous, so `contiguous()` keeps that row stride. The adapter gives every sequence rows D apart.
* mamba_ssm 2.3.2's `rms_norm_fn` asserts x.stride(-1) == 1 and residual.stride(-1) == 1, after making a tensor
  contiguous only when that stride is not 1: a (T, 1) view with last stride T (the transpose of a (1, T)
  buffer) stays as it is there. The adapter hands such a view with stride 1 along the size-1 dim.
"""
import types

import pytest
import torch

from harness.impls import registry
from harness.impls.adapters import causal_conv1d as cc_adapter
from harness.impls.adapters import mamba_ssm as ms_adapter
from reference.conv1d import causal_conv1d as ref_conv


def _fake_causal_conv1d(calls):
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        _, D, _ = x.shape
        if x.stride(1) == 1 and x.stride(2) > 1:  # channel-last, as causal-conv1d 1.7.0 tells it apart
            if D % 8:
                raise RuntimeError("causal_conv1d only supports channel dimension divisible by 8 for now")
            if x.stride(2) % 8 or x.stride(0) % 8:
                raise RuntimeError("causal_conv1d with channel last layout requires strides (x.stride(0) and "
                                   "x.stride(2)) to be multiples of 8")
        elif initial_states is not None:
            raise RuntimeError("initial_states is only supported for channel last layout")
        calls.append((tuple(x.shape), x.stride()))
        y, fin = ref_conv(x[0].t(), weight, bias, activation=activation,
                          initial_states=None if initial_states is None else initial_states)
        return (y.t()[None], fin) if return_final_states else y.t()[None]
    return types.SimpleNamespace(causal_conv1d_fn=causal_conv1d_fn)


@pytest.mark.parametrize("lengths", [(1, 3), (4, 1, 2), (1,)], ids=lambda v: "-".join(map(str, v)))
def test_conv_varlen_hands_rows_d_apart(monkeypatch, lengths):
    """x a column slice of a wider buffer (row stride 29): every sequence, one token long too, reaches the peer
    with x.stride(0) and x.stride(2) multiples of 8, and the results are the reference's."""
    calls = []
    fake = _fake_causal_conv1d(calls)
    monkeypatch.setattr(cc_adapter, "import_peer", lambda name: fake)
    g = torch.Generator().manual_seed(0)
    T, D, K, S = sum(lengths), 8, 4, len(lengths)
    x = torch.randn(T, 29, generator=g)[:, 3:3 + D]
    weight, bias = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    idx = torch.arange(S, dtype=torch.int32)
    hi = torch.tensor([i % 2 == 0 for i in range(S)])
    pool0 = torch.randn(S, D, K - 1, generator=g)
    pool, ref_pool = pool0.clone(), pool0.clone()
    y = cc_adapter.causal_conv1d_varlen(x, weight, bias, pool, qsl, idx, hi, activation="silu")
    y_ref = registry.get("reference").ops["causal_conv1d_varlen"](x, weight, bias, ref_pool, qsl, idx, hi,
                                                                   activation="silu")
    assert len(calls) == S
    assert all(st[0] % 8 == 0 and st[2] % 8 == 0 and st[1] == 1 for _, st in calls), calls
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(pool, ref_pool)


def test_add_rms_norm_hands_unit_last_stride(monkeypatch):
    """D = 1, x and the residual as transposes of (1, T) buffers (last stride T): the peer sees stride 1 along
    the size-1 dim, reads the same elements, and y and the residual are the unstrided call's."""
    def rms_norm_fn(x, weight, bias, residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False):
        x = x if x.stride(-1) == 1 else x.contiguous()
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        assert x.stride(-1) == 1 and residual.stride(-1) == 1  # mamba_ssm 2.3.2's _layer_norm_fwd
        s = residual.float() + x.float()
        y = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        return y, s.to(residual.dtype)
    fake = types.SimpleNamespace(rms_norm_fn=rms_norm_fn)
    monkeypatch.setattr(ms_adapter, "import_peer", lambda name: fake)
    g = torch.Generator().manual_seed(0)
    T = 5
    x, residual, weight = torch.randn(T, 1, generator=g), torch.randn(T, 1, generator=g), torch.randn(1, generator=g)
    xt, rt = torch.empty(1, T).t(), torch.empty(1, T).t()
    xt.copy_(x)
    rt.copy_(residual)
    assert xt.stride() == (1, T) and xt.is_contiguous()
    r_plain = residual.clone()
    y = ms_adapter.add_rms_norm(x, r_plain, weight, eps=1e-6)
    yt = ms_adapter.add_rms_norm(xt, rt, weight, eps=1e-6)
    torch.testing.assert_close(yt, y, rtol=0, atol=0)
    torch.testing.assert_close(rt, r_plain, rtol=0, atol=0)
