"""What the delta-rule families (``gdn``: Qwen3-Next's Gated DeltaNet, ``kda``: Kimi Linear's Kimi Delta
Attention) share: the HF config keys of their hybrid models and the layer-type list.

Both checkpoints are hybrids: a ``layer_types`` list says which decoder layers hold the linear-attention
mixer (``"linear_attention"``) and which a full softmax attention (``"full_attention"``). The list is
recorded in the config; only the linear-attention mixer is modelled here.
"""
from __future__ import annotations

from reference.config import MAX_CONV, err, get_float, get_int, short

LAYER_TYPES = ("linear_attention", "full_attention")


def hf_delta_common(raw: dict, common: dict, where) -> dict:
    """`common` with the fields these configs name differently: the conv width (``linear_conv_kernel_dim``),
    the RMSNorm eps (``rms_norm_eps``); their projections and convs have no biases."""
    out = dict(common)
    out["d_conv"] = get_int(raw, "linear_conv_kernel_dim", where, 4, lo=2, hi=MAX_CONV)
    out["norm_eps"] = get_float(raw, "rms_norm_eps", where, 1e-6)
    out["conv_bias"] = False
    out["bias"] = False
    return out


def get_layer_types(raw: dict, where, n_layer: int, default) -> tuple:
    """``layer_types`` of an HF config (a list of n_layer entries of LAYER_TYPES), or `default` (a tuple)
    when the config has none."""
    v = raw.get("layer_types")
    if v is None:
        return tuple(default)
    if not isinstance(v, (list, tuple)) or len(v) != n_layer or any(t not in LAYER_TYPES for t in v):
        raise err(where, f"layer_types: expected a list of {n_layer} entries of {list(LAYER_TYPES)}, got {short(v)}")
    return tuple(v)


def hf_delta_dict(cfg) -> dict:
    """The keys `hf_delta_common` reads, describing `cfg`."""
    return dict(linear_conv_kernel_dim=cfg.d_conv, rms_norm_eps=cfg.norm_eps, layer_types=list(cfg.layer_types),
                chunk_size=cfg.chunk_size)
