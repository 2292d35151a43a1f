"""Built-in benchmark declarations: input sets per op (shape matrix per device), the `copy` roofline
and a model-level Mamba-2 mixer. Backends come from the impl registry (every implementation with the
op, the `reference` one included) plus any `@register_benchmark` function.

Shapes: on the CPU tiny ones (the run must stay short); on CUDA/XPU the shapes of docs/targets.md.
Inputs follow the op contract (harness.ops): keyword arguments by name, packed tokens, state pools
with `cache_indices`, every request with an initial state (so pools are read and written).
"""
from __future__ import annotations

import math

import torch

from harness.bench.registry import register_benchmark, register_inputs

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def _rand(gen, device, *shape, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale + shift).to(dtype)


def _seqs(T: int, S: int, device) -> torch.Tensor:
    """query_start_loc of S sequences of (nearly) equal length over T tokens."""
    S = max(1, min(S, T))
    base = [round(i * T / S) for i in range(S + 1)]
    return torch.tensor(base, dtype=torch.int32, device=device)


def _slots(S: int, device):
    # pool of S+1 slots, the batch uses slots 1..S (slot 0 stays untouched, as an engine's pad slot would)
    return torch.arange(1, S + 1, dtype=torch.int32, device=device), torch.ones(S, dtype=torch.bool, device=device)


def _tokens_T(shape):
    return shape["T"]


def _tokens_B(shape):
    return shape["B"]


# ------------------------------------------------------------------------------------------- conv1d

@register_inputs("causal_conv1d_varlen", tokens=_tokens_T, positional=('x', 'weight', 'bias', 'conv_states', 'query_start_loc', 'cache_indices', 'has_initial_state'), shapes={
    "cpu": [dict(T=64, D=64, K=4, S=2), dict(T=256, D=64, K=4, S=2)],
    "gpu": [dict(T=4096, D=10240, K=4, S=1), dict(T=16384, D=10240, K=4, S=1)]})
def conv1d_varlen_inputs(shape, dtype, device, gen):
    T, D, K, S = shape["T"], shape["D"], shape["K"], shape.get("S", 1)
    qsl = _seqs(T, S, device)
    S = qsl.numel() - 1
    idx, init = _slots(S, device)
    return dict(x=_rand(gen, device, T, D, dtype=dtype), weight=_rand(gen, device, D, K, dtype=dtype, scale=0.5),
                bias=_rand(gen, device, D, dtype=dtype, scale=0.1),
                conv_states=_rand(gen, device, S + 1, D, K - 1, dtype=dtype), query_start_loc=qsl,
                cache_indices=idx, has_initial_state=init, activation="silu")


@register_inputs("causal_conv1d_update", tokens=_tokens_B, positional=('x', 'conv_states', 'weight', 'bias', 'conv_state_indices'), shapes={
    "cpu": [dict(B=8, D=64, K=4)],
    "gpu": [dict(B=256, D=10240, K=4)]})
def conv1d_update_inputs(shape, dtype, device, gen):
    B, D, K = shape["B"], shape["D"], shape["K"]
    return dict(x=_rand(gen, device, B, D, dtype=dtype), conv_states=_rand(gen, device, B + 1, D, K - 1, dtype=dtype),
                weight=_rand(gen, device, D, K, dtype=dtype, scale=0.5), bias=_rand(gen, device, D, dtype=dtype, scale=0.1),
                conv_state_indices=torch.arange(1, B + 1, dtype=torch.int32, device=device), activation="silu")


# ------------------------------------------------------------------------------------------- Mamba-1

@register_inputs("selective_scan_varlen", tokens=_tokens_T, positional=('u', 'delta', 'A', 'B', 'C', 'D', 'z', 'delta_bias', 'ssm_states', 'query_start_loc', 'cache_indices', 'has_initial_state'), shapes={
    "cpu": [dict(T=64, Dm=32, N=8, G=1, S=2), dict(T=256, Dm=32, N=8, G=1, S=2)],
    "gpu": [dict(T=1024, Dm=8192, N=16, G=1, S=1), dict(T=4096, Dm=8192, N=16, G=1, S=1),
            dict(T=16384, Dm=8192, N=16, G=1, S=1)]})
def selective_scan_inputs(shape, dtype, device, gen):
    T, Dm, N, G, S = shape["T"], shape["Dm"], shape["N"], shape.get("G", 1), shape.get("S", 1)
    qsl = _seqs(T, S, device)
    S = qsl.numel() - 1
    idx, init = _slots(S, device)
    return dict(u=_rand(gen, device, T, Dm, dtype=dtype), delta=_rand(gen, device, T, Dm, dtype=dtype, scale=0.5, shift=-3),
                A=-torch.exp(_rand(gen, device, Dm, N, scale=0.5)), B=_rand(gen, device, T, G, N, dtype=dtype),
                C=_rand(gen, device, T, G, N, dtype=dtype), D=_rand(gen, device, Dm), z=_rand(gen, device, T, Dm, dtype=dtype),
                delta_bias=_rand(gen, device, Dm, scale=0.1), ssm_states=_rand(gen, device, S + 1, Dm, N),
                query_start_loc=qsl, cache_indices=idx, has_initial_state=init, delta_softplus=True)


@register_inputs("selective_state_update", tokens=_tokens_B, positional=('state', 'x', 'dt', 'A', 'B', 'C', 'D', 'z', 'dt_bias', 'state_batch_indices'), shapes={
    "cpu": [dict(layout="mamba1", B=8, Dm=64, N=8, G=1), dict(layout="mamba2", B=8, H=4, P=16, N=16, G=1)],
    "gpu": [dict(layout="mamba2", B=64, H=128, P=64, N=128, G=8), dict(layout="mamba2", B=256, H=128, P=64, N=128, G=8),
            dict(layout="mamba1", B=256, Dm=8192, N=16, G=1)]})
def state_update_inputs(shape, dtype, device, gen):
    B, N, G = shape["B"], shape["N"], shape.get("G", 1)
    idx = torch.arange(1, B + 1, dtype=torch.int32, device=device)
    common = dict(B=_rand(gen, device, B, G, N, dtype=dtype), C=_rand(gen, device, B, G, N, dtype=dtype),
                  state_batch_indices=idx, dt_softplus=True)
    if shape["layout"] == "mamba1":
        Dm = shape["Dm"]
        return dict(state=_rand(gen, device, B + 1, Dm, N, dtype=dtype), x=_rand(gen, device, B, Dm, dtype=dtype),
                    dt=_rand(gen, device, B, Dm, dtype=dtype, scale=0.5, shift=-3),
                    A=-torch.exp(_rand(gen, device, Dm, N, scale=0.5)), D=_rand(gen, device, Dm),
                    z=_rand(gen, device, B, Dm, dtype=dtype), dt_bias=_rand(gen, device, Dm, scale=0.1), **common)
    H, P = shape["H"], shape["P"]
    return dict(state=_rand(gen, device, B + 1, H, P, N, dtype=dtype), x=_rand(gen, device, B, H, P, dtype=dtype),
                dt=_rand(gen, device, B, H, dtype=dtype, scale=0.5, shift=-3), A=-torch.exp(_rand(gen, device, H, scale=0.5)),
                D=_rand(gen, device, H), z=_rand(gen, device, B, H, P, dtype=dtype), dt_bias=_rand(gen, device, H, scale=0.1),
                **common)


# ------------------------------------------------------------------------------------------- Mamba-2

@register_inputs("ssd_varlen", tokens=_tokens_T, positional=('x', 'dt', 'A', 'B', 'C', 'chunk_size', 'D', 'z', 'dt_bias', 'ssm_states', 'query_start_loc', 'cache_indices', 'has_initial_state'), shapes={
    "cpu": [dict(T=64, H=4, P=16, G=1, N=16, S=2, chunk=32), dict(T=256, H=4, P=16, G=1, N=16, S=2, chunk=32)],
    "gpu": [dict(T=4096, H=128, P=64, G=8, N=128, S=1, chunk=256), dict(T=16384, H=128, P=64, G=8, N=128, S=1, chunk=256)]})
def ssd_inputs(shape, dtype, device, gen):
    T, H, P, G, N, S = shape["T"], shape["H"], shape["P"], shape["G"], shape["N"], shape.get("S", 1)
    qsl = _seqs(T, S, device)
    S = qsl.numel() - 1
    idx, init = _slots(S, device)
    return dict(x=_rand(gen, device, T, H, P, dtype=dtype), dt=_rand(gen, device, T, H, dtype=dtype, scale=0.5, shift=-3),
                A=-torch.exp(_rand(gen, device, H, scale=0.5)), B=_rand(gen, device, T, G, N, dtype=dtype),
                C=_rand(gen, device, T, G, N, dtype=dtype), chunk_size=shape.get("chunk", 256), D=_rand(gen, device, H),
                z=_rand(gen, device, T, H, P, dtype=dtype), dt_bias=_rand(gen, device, H, scale=0.1),
                ssm_states=_rand(gen, device, S + 1, H, P, N), query_start_loc=qsl, cache_indices=idx,
                has_initial_state=init, dt_softplus=True)


@register_inputs("gated_rms_norm", tokens=_tokens_T, positional=('x', 'weight', 'z'), shapes={
    "cpu": [dict(T=64, D=128, group=64), dict(T=256, D=128, group=64)],
    "gpu": [dict(T=4096, D=8192, group=1024), dict(T=16384, D=8192, group=1024)]})
def gated_rms_norm_inputs(shape, dtype, device, gen):
    T, D = shape["T"], shape["D"]
    return dict(x=_rand(gen, device, T, D, dtype=dtype), weight=_rand(gen, device, D, dtype=dtype, scale=0.1, shift=1.0),
                z=_rand(gen, device, T, D, dtype=dtype), eps=1e-6, group_size=shape.get("group"), norm_before_gate=False)


# ------------------------------------------------------------------------------------------- roofline

@register_inputs("copy", tokens=lambda shape: None, dtypes={"cpu": (torch.uint8,), "gpu": (torch.uint8,)}, shapes={
    "cpu": [dict(bytes=16 * MIB)],
    "gpu": [dict(bytes=1 * GIB)]})
def copy_inputs(shape, dtype, device, gen):
    n = shape["bytes"]
    return dict(src=torch.empty(n, dtype=torch.uint8, device=device).fill_(1),
                dst=torch.empty(n, dtype=torch.uint8, device=device))


@register_benchmark(op="copy", impl="torch", peer=False)
def copy_torch(inputs):
    src, dst = inputs["src"], inputs["dst"]
    return lambda: dst.copy_(src)


# ------------------------------------------------------------------------------------------- model level

def mamba2_mixer(ops: dict):
    """Compose the layer from an implementation's ops (the model-level backend of that implementation)."""
    conv, ssd, norm = ops["causal_conv1d_varlen"], ops["ssd_varlen"], ops["gated_rms_norm"]

    def backend(inp):
        d = inp["dims"]
        di, G, N, H, P = d["di"], d["G"], d["N"], d["H"], d["P"]
        T = inp["hidden"].shape[0]

        def call():
            zxbcdt = inp["hidden"] @ inp["w_in"]
            z, xBC, dt = torch.split(zxbcdt, [di, di + 2 * G * N, H], dim=-1)
            xBC = conv(xBC.contiguous(), inp["w_conv"], inp["w_conv_bias"], inp["conv_states"], inp["query_start_loc"],
                       inp["cache_indices"], inp["has_initial_state"], activation="silu")
            x, B, C = torch.split(xBC, [di, G * N, G * N], dim=-1)
            y = ssd(x.reshape(T, H, P), dt.contiguous(), inp["w_A"], B.reshape(T, G, N), C.reshape(T, G, N), d["chunk"],
                    inp["w_D"], None, inp["w_dt_bias"], inp["ssm_states"], inp["query_start_loc"], inp["cache_indices"],
                    inp["has_initial_state"], dt_softplus=True)
            y = norm(y.reshape(T, di), inp["w_norm"], z.contiguous(), eps=1e-5, group_size=di // G, norm_before_gate=False)
            return y @ inp["w_out"]
        return call
    return backend



@register_inputs("mamba2_mixer", tokens=_tokens_T, level="model",
                 requires=("causal_conv1d_varlen", "ssd_varlen", "gated_rms_norm"), compose=mamba2_mixer, shapes={
    "cpu": [dict(T=64, d_model=64, H=4, P=32, G=1, N=16, K=4, chunk=32),
            dict(T=256, d_model=64, H=4, P=32, G=1, N=16, K=4, chunk=32)],
    "gpu": [dict(T=1024, d_model=4096, H=128, P=64, G=8, N=128, K=4, chunk=256),
            dict(T=4096, d_model=4096, H=128, P=64, G=8, N=128, K=4, chunk=256)]})
def mamba2_mixer_inputs(shape, dtype, device, gen):
    """One Mamba-2 layer's prefill (Codestral's shape on GPU): in_proj, conv, SSD, gated norm, out_proj."""
    T, dm, H, P, G, N, K = (shape[k] for k in ("T", "d_model", "H", "P", "G", "N", "K"))
    di = H * P
    conv_dim = di + 2 * G * N
    s = 1 / math.sqrt(dm)
    qsl = _seqs(T, 1, device)
    idx, init = _slots(1, device)
    return dict(hidden=_rand(gen, device, T, dm, dtype=dtype),
                w_in=_rand(gen, device, dm, 2 * di + 2 * G * N + H, dtype=dtype, scale=s),
                w_conv=_rand(gen, device, conv_dim, K, dtype=dtype, scale=0.5), w_conv_bias=_rand(gen, device, conv_dim, dtype=dtype, scale=0.1),
                w_A=-torch.exp(_rand(gen, device, H, scale=0.5)), w_D=_rand(gen, device, H), w_dt_bias=_rand(gen, device, H, scale=0.1),
                w_norm=_rand(gen, device, di, dtype=dtype, scale=0.1, shift=1.0),
                w_out=_rand(gen, device, di, dm, dtype=dtype, scale=1 / math.sqrt(di)),
                conv_states=_rand(gen, device, 2, conv_dim, K - 1, dtype=dtype), ssm_states=_rand(gen, device, 2, H, P, N),
                query_start_loc=qsl, cache_indices=idx, has_initial_state=init,
                dims=dict(di=di, G=G, N=N, H=H, P=P, chunk=shape["chunk"]))
