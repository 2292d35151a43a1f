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
``lm_head.weight``) map by exact names per layer type.

MLP layers that are mixtures of experts (``mlp_layer_types[i] == "sparse"``: Qwen3-Next with
``num_experts > 0``, Kimi Linear after its ``first_k_dense_replace`` dense layers) are described by a
:class:`MoESpec` (the config field ``moe``) and computed, per token, as transformers' sparse MoE blocks do::

    logits   = router(x)                                        (num_experts,)
    top-k    softmax router (Qwen3-Next): p = softmax(logits); the k largest p, divided by their sum when
                 norm_topk_prob
             sigmoid router (Kimi Linear): s = sigmoid(logits); the k largest s + bias (e_score_correction_bias)
                 among the topk_group best of n_group expert groups (a group's score: the sum of its two
                 largest s + bias); weights s of the chosen, divided by their sum (+ 1e-20) when
                 norm_topk_prob, times routed_scaling_factor
    y        = sum over the chosen experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x))
             + shared(x)                       (a SwiGLU MLP; Qwen3-Next scales it by sigmoid(shared_gate(x)))

Our names under ``layers.{i}.mlp.``: ``router.weight`` (E, d), ``router.bias`` (E,) (sigmoid router only),
``experts.{e}.{gate,up,down}_proj.weight``, ``shared.{gate,up,down}_proj.weight`` and ``shared_gate.weight``
(1, d) (Qwen3-Next). The checkpoints store every expert under its own keys (as transformers' save_pretrained
writes them; its in-memory fused ``experts.gate_up_proj`` is not a checkpoint name): see each family's
``moe_names``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from reference.attention import gated_mlp
from reference.config import MAX_CONV, MAX_INNER, ROUTERS, MoESpec, err, get_float, get_int, short
from reference.families import Family
from reference.validate import fail

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")
PROJ = ("gate_proj", "up_proj", "down_proj")


# Where a list, every `route` call appends its margin: the smallest gap, in the scores the choice is made on,
# between a chosen expert and an unchosen one (and between a kept group and a dropped one). A gap of rounding's
# size means another precision may route the token to other experts: a tie, after which two precisions' outputs
# part (the model oracle reads these).
ROUTE_MARGINS: list | None = None


def _gap(values, k: int) -> float:
    """The k-th largest of `values` (a tensor or a list; its finite entries) less the (k+1)-th; inf if none."""
    v = sorted((float(x) for x in values if abs(float(x)) != float("inf")), reverse=True)
    return v[k - 1] - v[k] if len(v) > k else float("inf")


def route(logits: torch.Tensor, moe: MoESpec, bias=None) -> list:
    """[(expert, weight), ...] of ONE token's router logits (num_experts,), as the module doc says."""
    if moe.router == "softmax":
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, moe.top_k)
        chosen, weights = top.indices, top.values
        if ROUTE_MARGINS is not None:
            ROUTE_MARGINS.append(_gap(probs, moe.top_k))
    else:
        scores = torch.sigmoid(logits)
        choice = scores + bias
        if moe.n_group > 1:
            size = moe.num_experts // moe.n_group
            group_score = [float(torch.topk(choice[g * size:(g + 1) * size], 2).values.sum())
                           for g in range(moe.n_group)]
            keep = sorted(range(moe.n_group), key=lambda g: -group_score[g])[:moe.topk_group]
            masked = torch.full_like(choice, float("-inf"))
            for g in keep:
                masked[g * size:(g + 1) * size] = choice[g * size:(g + 1) * size]
            choice = masked
        chosen = torch.topk(choice, moe.top_k).indices
        weights = scores[chosen]
        if ROUTE_MARGINS is not None:
            groups = [_gap(group_score, moe.topk_group)] if moe.n_group > 1 else []
            ROUTE_MARGINS.append(min([_gap(choice, moe.top_k)] + groups))
    if moe.norm_topk_prob:
        weights = weights / (weights.sum() + (1e-20 if moe.router == "sigmoid" else 0.0))
    weights = weights * moe.scaling
    return [(int(e), w) for e, w in zip(chosen, weights)]


def moe_mlp(x: torch.Tensor, p: dict, moe: MoESpec) -> torch.Tensor:
    """The MoE MLP of rows x (n, d) with parameters `p` (our names relative to ``layers.{i}.mlp.``): one token
    at a time, each of its chosen experts a SwiGLU MLP, their weighted sum plus the (gated) shared expert."""
    out = torch.zeros_like(x)
    logits = x @ p["router.weight"].t()
    for t in range(x.shape[0]):
        row = x[t:t + 1]
        for e, w in route(logits[t], moe, p.get("router.bias")):
            out[t] += w * gated_mlp(row, *(p[f"experts.{e}.{n}.weight"] for n in PROJ))[0]
    if moe.shared_inter:
        shared = gated_mlp(x, *(p[f"shared.{n}.weight"] for n in PROJ))
        if moe.shared_gate:
            shared = torch.sigmoid(x @ p["shared_gate.weight"].t()) * shared
        out = out + shared
    return out


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


def build_mlp_types(n_layer: int, moe, mlp_layer_types=None) -> tuple:
    """`mlp_layer_types` of a built config (default: all "sparse" with a MoESpec `moe`, else all "dense");
    "sparse" layers need `moe`."""
    types = tuple(mlp_layer_types) if mlp_layer_types is not None else ("sparse" if moe else "dense",) * n_layer
    if len(types) != n_layer or any(t not in MLP_TYPES for t in types):
        fail("mlp_layer_types", f"{n_layer} entries of {list(MLP_TYPES)}", list(types))
    if moe is not None and not isinstance(moe, MoESpec):
        fail("moe", "a MoESpec or None", type(moe).__name__)
    if "sparse" in types and moe is None:
        fail("moe", "a MoESpec (mlp_layer_types has 'sparse' layers)", None)
    return types


def get_alias(raw: dict, names: tuple) -> str:
    """The first of `names` (one config value's spellings) that `raw` has, else the first."""
    return next((n for n in names if raw.get(n) is not None), names[0])


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

    def moe_names(self, cfg) -> dict:
        """Checkpoint name (relative to ``layers.{i}.``) -> ours of an MoE layer's parameters ({}: the config
        has no MoE layers)."""
        raise NotImplementedError

    def mlp_shapes(self, cfg, layer: int) -> dict:
        d = cfg.d_model
        if cfg.mlp_layer_types[layer] == "sparse":
            if cfg.moe is None:
                fail("cfg.moe", f"a MoESpec (cfg.mlp_layer_types[{layer}] is 'sparse')", None)
            return {"mlp_norm.weight": (d,), **{f"mlp.{k}": s for k, s in cfg.moe.shapes(d).items()}}
        inner = cfg.intermediate_size
        return {"mlp_norm.weight": (d,), "mlp.gate_proj.weight": (inner, d), "mlp.up_proj.weight": (inner, d),
                "mlp.down_proj.weight": (d, inner)}

    def make_mlp(self, cfg, layer: int, params: dict):
        """The MLP of decoder layer `layer` as a function of its normed rows (n, d); `params`: its weights
        (our names relative to ``layers.{i}.mlp.``, in the model's dtype)."""
        if cfg.mlp_layer_types[layer] == "sparse":
            return lambda x: moe_mlp(x, params, cfg.moe)
        return lambda x: gated_mlp(x, params["gate_proj.weight"], params["up_proj.weight"],
                                   params["down_proj.weight"])

    def layer_parameter_shapes(self, cfg, layer: int) -> dict:
        shapes = {"norm.weight": (cfg.d_model,)}
        if self.layer_kinds(cfg)[layer] == "mixer":
            shapes.update({f"mixer.{k}": s for k, s in self.parameter_shapes(cfg).items()})
        else:
            shapes.update({f"attn.{k}": s for k, s in self.attention_shapes(cfg).items()})
        shapes.update(self.mlp_shapes(cfg, layer))
        return shapes

    def _layer_names(self, cfg, kind: str) -> dict:
        """Checkpoint name (relative to ``layers.{i}.``) -> ours, for a layer of `kind` (its MLP dense or MoE:
        the names of the other form are not expected in a layer, so the loader reports them)."""
        names = {"input_layernorm.weight": "norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight"}
        names.update({f"{m}.{p}.weight": f"mlp.{p}.weight" for m in self.mlp_modules for p in PROJ})
        names.update(self.moe_names(cfg))
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
            known = {**self._layer_names(cfg, "mixer"), **self._layer_names(cfg, "attention")}
            return f"layers.{i}.{known[name]}" if name in known else None
        ours = self._layer_names(cfg, kinds[i]).get(name)
        if ours is None:  # e.g. an attention parameter in a linear-attention layer: unexpected, not ignored
            other = self._layer_names(cfg, "attention" if kinds[i] == "mixer" else "mixer").get(name)
            return None if other is None else f"layers.{i}.{other}"
        return f"layers.{i}.{ours}"

    def ignored_key(self, cfg, key: str) -> bool:
        return any(re.fullmatch(p, key) for p in self.ignored_patterns)
