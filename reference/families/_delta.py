"""What the delta-rule families (``gdn``: Qwen3-Next's Gated DeltaNet, ``kda``: Kimi Linear's Kimi Delta
Attention) share: the HF config keys of their hybrid models, the layer-type list, and the decoder layers
around the mixer.

Both checkpoints are hybrids: a ``layer_types`` list says which decoder layers hold the linear-attention
mixer (``"linear_attention"``) and which a full softmax attention (``"full_attention"``; its form is the
family's: Qwen3-Next's gated attention with partial rotary embedding, Kimi Linear's latent attention).
Every decoder layer is::

    h = h + token_mixer(rms_norm(h, input_layernorm))        (the mixer or the attention)
    h = h + mlp(rms_norm(h, post_attention_layernorm))       (down(silu(gate(x)) * up(x)))

Our names: ``layers.{i}.norm.weight``, ``layers.{i}.mixer.*`` or ``layers.{i}.attn.*``,
``layers.{i}.mlp_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``; the checkpoints' keys
(``model.layers.{i}.input_layernorm.weight``, ``...linear_attn.*`` / ``...self_attn.*``,
``...post_attention_layernorm.weight``, ``...mlp.*``, ``model.embed_tokens.weight``, ``model.norm.weight``,
``lm_head.weight``) map by exact names per layer type. MLP layers that are mixtures of experts (Qwen3-Next
with ``num_experts > 0``, Kimi Linear's ``sparse`` layers) are recorded in the config but not modelled:
asking for their parameters is a ValueError.
"""
from __future__ import annotations

import re

from reference.config import MAX_CONV, MAX_INNER, err, get_float, get_int, short
from reference.families import Family
from reference.validate import fail

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")


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


def get_mlp_layer_types(raw: dict, where, n_layer: int, default) -> tuple:
    """``mlp_layer_types`` of an HF config (n_layer entries of MLP_TYPES), or `default` when it has none."""
    v = raw.get("mlp_layer_types")
    if v is None:
        return tuple(default)
    if not isinstance(v, (list, tuple)) or len(v) != n_layer or any(t not in MLP_TYPES for t in v):
        raise err(where, f"mlp_layer_types: expected a list of {n_layer} entries of {list(MLP_TYPES)}, got {short(v)}")
    return tuple(v)


def get_intermediate_size(raw: dict, where, default: int) -> int:
    return get_int(raw, "intermediate_size", where, default, hi=MAX_INNER)


_LAYER_KEY = re.compile(r"layers\.(0|[1-9][0-9]*)\.(.+)")


class HybridFamily(Family):
    """A delta-rule family's whole hybrid model (see the module doc). Subclasses set `mixer_module` (the
    checkpoint's module name of the mixer in a linear-attention layer), `attention_parameter_names`, and
    implement `attention_shapes`, `kv_spec` and `make_attention`."""

    own_names = True
    mixer_module: str = ""
    attention_parameter_names: tuple = ()
    ignored_patterns: tuple = ()          # regexes of checkpoint keys that are no parameters
    mlp_modules: tuple = ("mlp",)         # the checkpoints' module names of the MLP (either one holds it)

    def layer_kinds(self, cfg) -> tuple:
        return tuple("mixer" if t == "linear_attention" else "attention" for t in cfg.layer_types)

    def attention_shapes(self, cfg) -> dict:
        """Shapes of one attention layer's parameters (names relative to ``layers.{i}.attn.``)."""
        raise NotImplementedError

    def mlp_shapes(self, cfg, layer: int) -> dict:
        if cfg.mlp_layer_types[layer] != "dense":
            fail(f"cfg.mlp_layer_types[{layer}]", "'dense' (mixture-of-experts MLP layers are not modelled yet)",
                 repr(cfg.mlp_layer_types[layer]))
        d, inner = cfg.d_model, cfg.intermediate_size
        return {"mlp_norm.weight": (d,), "mlp.gate_proj.weight": (inner, d), "mlp.up_proj.weight": (inner, d),
                "mlp.down_proj.weight": (d, inner)}

    def layer_parameter_shapes(self, cfg, layer: int) -> dict:
        shapes = {"norm.weight": (cfg.d_model,)}
        if self.layer_kinds(cfg)[layer] == "mixer":
            shapes.update({f"mixer.{k}": s for k, s in self.parameter_shapes(cfg).items()})
        else:
            shapes.update({f"attn.{k}": s for k, s in self.attention_shapes(cfg).items()})
        shapes.update(self.mlp_shapes(cfg, layer))
        return shapes

    def _layer_names(self, kind: str) -> dict:
        """Checkpoint name (relative to ``layers.{i}.``) -> ours, for a layer of `kind`."""
        names = {"input_layernorm.weight": "norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight"}
        names.update({f"{m}.{p}.weight": f"mlp.{p}.weight" for m in self.mlp_modules
                      for p in ("gate_proj", "up_proj", "down_proj")})
        if kind == "mixer":
            names.update({f"{self.mixer_module}.{n}": f"mixer.{n}" for n in self.mixer_parameter_names})
        else:
            names.update({f"self_attn.{n}": f"attn.{n}" for n in self.attention_parameter_names})
        return names

    def map_key(self, cfg, key: str):
        if key == "lm_head.weight":
            return key
        rest = key[len("model."):] if key.startswith("model.") else key
        top = {"embed_tokens.weight": "embedding.weight", "norm.weight": "norm_f.weight"}
        if rest in top:
            return top[rest]
        m = _LAYER_KEY.fullmatch(rest)
        if m is None:
            return None
        i, name = int(m.group(1)), m.group(2)
        kinds = self.layer_kinds(cfg)
        if i >= len(kinds):  # a layer the config does not have: the loader reports the key as unexpected
            known = {**self._layer_names("mixer"), **self._layer_names("attention")}
            return f"layers.{i}.{known[name]}" if name in known else None
        ours = self._layer_names(kinds[i]).get(name)
        if ours is None:  # e.g. an attention parameter in a linear-attention layer: unexpected, not ignored
            other = self._layer_names("attention" if kinds[i] == "mixer" else "mixer").get(name)
            return None if other is None else f"layers.{i}.{other}"
        return f"layers.{i}.{ours}"

    def ignored_key(self, cfg, key: str) -> bool:
        return any(re.fullmatch(p, key) for p in self.ignored_patterns)
