"""Built-in benchmark declarations: every op of the contract (input builder, shapes and token count
from its spec in harness.ops), the `copy` roofline and a model-level Mamba-2 mixer. Backends come from
the impl registry (every implementation with the op, the `reference` one included) plus any
`@register_benchmark` function.

Shapes: on the CPU tiny ones (the run must stay short); on CUDA/XPU the layer shapes of the models
engines serve (docs/targets.md). Inputs follow the op contract: keyword arguments by name, packed
tokens, state pools with `cache_indices`, every request with an initial state (so pools are read and
written).
"""
from __future__ import annotations

import math

import torch

from harness.bench.registry import register_benchmark, register_inputs
from harness.ops import SPECS
from harness.ops import _inputs as I
from harness.ops._inputs import GIB, MIB

# ------------------------------------------------------------------------------------------- contract ops

for _spec in SPECS.values():  # every op of the contract, with its spec's builder, shapes and token count
    register_inputs(_spec.name, tokens=_spec.tokens, positional=_spec.args,
                    shapes={k: v for k, v in _spec.shapes.items() if k in ("cpu", "gpu")})(_spec.inputs)


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



@register_inputs("mamba2_mixer", tokens=I.tokens_T, level="model",
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
    qsl = I.seqs(T, 1, device)
    idx, init = I.slots({}, 1, device)
    return dict(hidden=I.rand(gen, device, T, dm, dtype=dtype),
                w_in=I.rand(gen, device, dm, 2 * di + 2 * G * N + H, dtype=dtype, scale=s),
                w_conv=I.rand(gen, device, conv_dim, K, dtype=dtype, scale=0.5), w_conv_bias=I.rand(gen, device, conv_dim, dtype=dtype, scale=0.1),
                w_A=-torch.exp(I.rand(gen, device, H, scale=0.5)), w_D=I.rand(gen, device, H), w_dt_bias=I.rand(gen, device, H, scale=0.1),
                w_norm=I.rand(gen, device, di, dtype=dtype, scale=0.1, shift=1.0),
                w_out=I.rand(gen, device, di, dm, dtype=dtype, scale=1 / math.sqrt(di)),
                conv_states=I.rand(gen, device, 2, conv_dim, K - 1, dtype=dtype), ssm_states=I.rand(gen, device, 2, H, P, N),
                query_start_loc=qsl, cache_indices=idx, has_initial_state=init,
                dims=dict(di=di, G=G, N=N, H=H, P=P, chunk=shape["chunk"]))
