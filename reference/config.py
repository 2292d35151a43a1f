"""The normalised model config (`ModelConfig`) and the checked readers its parsers share.

A `ModelConfig` holds the fields every mixer family has (sizes of the residual stream, vocabulary,
block norms, conv width, biases, ...) and, in `mixer`, a frozen dataclass of the family's own fields
(defined by the family's module in `reference/families/`). Attribute access falls through to `mixer`,
so `cfg.d_inner`, `cfg.num_heads`, `cfg.conv_dim` read the family's fields; a field the family does
not have is an AttributeError. A new family adds fields by defining its own dataclass: nothing here
changes.

Config values are read through `get_int` / `get_float` / `get_bool` / `get_str`: each checks the type
and a sane range BEFORE anything is derived from the value (sizes are capped, so a config cannot ask
for terabytes or hours of work), and every message is short (values are shown truncated).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

# Caps on config sizes. Real checkpoints are far below them; a value above is a broken config.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 16          # d_model, heads, ranks, groups
MAX_INNER = 1 << 20          # d_inner (expand * d_model)
MAX_VOCAB = 1 << 22
MAX_STATE = 4096             # d_state, head_dim
MAX_CONV = 64                # conv kernel width
MAX_EXPAND = 16
MAX_PAD_MULTIPLE = 1 << 16
MAX_CHUNK = 1 << 16
MAX_NAMES = 8                # names listed in one message before "... (N more)"

_REQUIRED = object()


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file and the keys."""


def err(path, msg: str) -> CheckpointError:
    return CheckpointError(f"{path}: {msg}")


def short(v, limit: int = 60) -> str:
    """repr(v), cut to `limit` characters."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def name_list(names, limit: int = MAX_NAMES) -> str:
    """At most `limit` names of a list, then how many more there are."""
    names = list(names)
    head = [short(n, 120) for n in names[:limit]]
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return "[" + ", ".join(head) + more + "]"


def _value(raw: dict, key: str, default):
    v = raw.get(key, default)
    return default if v is None else v


def get_int(raw: dict, key: str, where, default=_REQUIRED, *, lo: int = 1, hi: int = MAX_WIDTH,
            prefix: str = "") -> int:
    """An integer config value in [lo, hi] (integral floats such as 16.0 are accepted)."""
    v = _value(raw, key, None if default is _REQUIRED else default)
    ok = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
    if not ok or not lo <= v <= hi:
        raise err(where, f"config key {prefix + key!r}: expected an int in [{lo}, {hi}], got {short(v)}")
    return int(v)


def float_value(v) -> float:
    """A JSON number, including transformers' {"__float__": "Infinity"} encoding; TypeError otherwise."""
    if isinstance(v, dict) and set(v) == {"__float__"} and isinstance(v["__float__"], str):
        return float(v["__float__"])
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(v)
    return float(v)


def get_float(raw: dict, key: str, where, default, *, lo: float = 0.0, hi: float = 1.0, prefix: str = "") -> float:
    """A finite float config value in (lo, hi]."""
    v = _value(raw, key, default)
    try:
        f = float_value(v)
    except (TypeError, ValueError):
        f = math.nan
    if not (math.isfinite(f) and lo < f <= hi):
        raise err(where, f"config key {prefix + key!r}: expected a finite float in ({lo}, {hi}], got {short(v)}")
    return f


def get_bool(raw: dict, key: str, where, default, *, prefix: str = "") -> bool:
    v = _value(raw, key, default)
    if not isinstance(v, bool):
        raise err(where, f"config key {prefix + key!r}: expected a bool, got {short(v)}")
    return v


def get_str(raw: dict, key: str, where, default, choices=None, *, prefix: str = "") -> str:
    v = _value(raw, key, default)
    if not isinstance(v, str) or (choices is not None and v not in choices):
        want = "a string" if choices is None else f"one of {sorted(choices)}"
        raise err(where, f"{prefix + key}: expected {want}, got {short(v)}")
    return v


def get_limit(raw: dict, key: str, where, *, prefix: str = "") -> tuple[float, float]:
    """A dt limit [low, high] with 0 <= low <= high (high may be infinite; NaN is refused)."""
    v = raw.get(key)
    if v is None:
        return (0.0, math.inf)
    try:
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise ValueError
        lim = tuple(float_value(x) for x in v)
        if not 0.0 <= lim[0] <= lim[1]:
            raise ValueError
    except (TypeError, ValueError):
        raise err(where, f"{prefix + key}: expected [low, high] with 0 <= low <= high, got {short(v)}") from None
    return lim


def pad_vocab(vocab: int, multiple: int) -> int:
    if multiple <= 1:
        return vocab
    return ((vocab + multiple - 1) // multiple) * multiple


# ----------------------------------------------------------------------------------------------
# ModelConfig

@dataclass(frozen=True)
class ModelConfig:
    """One normalised description of a language model of SSM mixer blocks.

    `vocab_size` is the number of embedding rows (padded to `pad_vocab_size_multiple`);
    `vocab_size_unpadded` is the tokenizer's vocabulary (greedy decoding argmaxes over it).
    `chunk_size` is the chunk length of the family's chunked prefill kernels (the SSD's; carried but
    unused by a family without one). `mixer` holds the family's own fields (see the module doc), e.g.
    Mamba-1's `d_inner`, `dt_rank`, Mamba-2's `num_heads`, `head_dim`, `n_groups`.
    """
    family: str
    d_model: int
    n_layer: int
    vocab_size: int
    vocab_size_unpadded: int
    pad_vocab_size_multiple: int
    d_conv: int
    conv_bias: bool
    bias: bool
    norm_eps: float
    residual_in_fp32: bool
    tie_embeddings: bool
    source: str  # "hf" | "state-spaces"
    mixer: object
    chunk_size: int = 256

    def __getattr__(self, name):
        if name.startswith("__") or name == "mixer":
            raise AttributeError(name)
        try:
            mixer = object.__getattribute__(self, "mixer")
        except AttributeError:
            raise AttributeError(name) from None
        try:
            return getattr(mixer, name)
        except AttributeError:
            raise AttributeError(f"a {self.family} ModelConfig has no field {name!r}") from None

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed; the family's own fields may be named directly."""
        own = {f.name for f in fields(self)}
        mixer_names = {f.name for f in fields(self.mixer)}
        unknown = sorted(set(changes) - own - mixer_names)
        if unknown:
            from reference.validate import fail
            fail("changes", f"fields of a {self.family} ModelConfig", unknown)
        mixer_changes = {k: v for k, v in changes.items() if k in mixer_names and k not in own}
        top = {k: v for k, v in changes.items() if k in own}
        if mixer_changes:
            top["mixer"] = replace(top.get("mixer", self.mixer), **mixer_changes)
        return replace(self, **top)

    def as_dict(self) -> dict:
        """Every field, the family's own ones included, in one flat dict."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "mixer"}
        out.update(asdict(self.mixer))
        return out


def hf_common(raw: dict, where, *, tie_default: bool) -> dict:
    """The family-independent ModelConfig fields of an HF `config.json` (checked, see `get_int`...)."""
    d_model = get_int(raw, "hidden_size", where)
    n_layer = get_int(raw, "num_hidden_layers", where, hi=MAX_LAYERS)
    vocab = get_int(raw, "vocab_size", where, hi=MAX_VOCAB)
    d_conv = get_int(raw, "conv_kernel", where, 4, hi=MAX_CONV)
    multiple = get_int(raw, "pad_vocab_size_multiple", where, 1, lo=0, hi=MAX_PAD_MULTIPLE)
    get_str(raw, "hidden_act", where, "silu", ("silu",))
    return dict(
        d_model=d_model, n_layer=n_layer, vocab_size=pad_vocab(vocab, multiple), vocab_size_unpadded=vocab,
        pad_vocab_size_multiple=max(multiple, 1), d_conv=d_conv,
        conv_bias=get_bool(raw, "use_conv_bias", where, True), bias=get_bool(raw, "use_bias", where, False),
        norm_eps=get_float(raw, "layer_norm_epsilon", where, 1e-5),
        residual_in_fp32=get_bool(raw, "residual_in_fp32", where, True),
        tie_embeddings=get_bool(raw, "tie_word_embeddings", where, tie_default), source="hf")


def hf_common_dict(cfg: ModelConfig) -> dict:
    """The family-independent keys of an HF `config.json` describing `cfg` (inverse of `hf_common`)."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                conv_kernel=cfg.d_conv, use_bias=cfg.bias, use_conv_bias=cfg.conv_bias, hidden_act="silu",
                layer_norm_epsilon=cfg.norm_eps, residual_in_fp32=cfg.residual_in_fp32,
                tie_word_embeddings=cfg.tie_embeddings)


def state_spaces_common(raw: dict, ssm: dict, where) -> dict:
    """The family-independent ModelConfig fields of a raw state-spaces `config.json` and its `ssm_cfg`."""
    d_model = get_int(raw, "d_model", where)
    n_layer = get_int(raw, "n_layer", where, hi=MAX_LAYERS)
    vocab = get_int(raw, "vocab_size", where, hi=MAX_VOCAB)
    multiple = get_int(raw, "pad_vocab_size_multiple", where, 8, hi=MAX_PAD_MULTIPLE)
    return dict(
        d_model=d_model, n_layer=n_layer, vocab_size=pad_vocab(vocab, multiple), vocab_size_unpadded=vocab,
        pad_vocab_size_multiple=multiple, d_conv=get_int(ssm, "d_conv", where, 4, hi=MAX_CONV, prefix="ssm_cfg."),
        conv_bias=get_bool(ssm, "conv_bias", where, True, prefix="ssm_cfg."),
        bias=get_bool(ssm, "bias", where, False, prefix="ssm_cfg."),
        norm_eps=get_float(raw, "norm_epsilon", where, 1e-5),
        residual_in_fp32=get_bool(raw, "residual_in_fp32", where, True),
        tie_embeddings=get_bool(raw, "tie_embeddings", where, True), source="state-spaces")


# mixture-of-experts MLPs (the hybrid families' sparse layers)
ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (see the module doc): `num_experts` SwiGLU experts of `inter` channels, `top_k`
    of them per token chosen by a `router` of ROUTERS (``sigmoid``: with a score-correction bias, expert
    groups `n_group` / `topk_group`); the chosen weights renormalised when `norm_topk_prob`, scaled by
    `scaling`; a shared expert of `shared_inter` channels (0: none), gated by sigmoid(shared_gate(x)) when
    `shared_gate`."""
    num_experts: int
    top_k: int
    inter: int
    router: str = "softmax"
    norm_topk_prob: bool = True
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_inter: int = 0
    shared_gate: bool = False

    def __post_init__(self):
        from reference.validate import fail
        if self.router not in ROUTERS:
            fail("moe.router", f"one of {list(ROUTERS)}", repr(self.router))
        if not 1 <= self.top_k <= self.num_experts:
            fail("moe.top_k", f"an int in [1, num_experts = {self.num_experts}]", self.top_k)
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            fail("moe.n_group", f"a divisor of num_experts = {self.num_experts} with topk_group in [1, n_group]",
                 f"n_group {self.n_group}, topk_group {self.topk_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            fail("moe.n_group", f"groups of >= 2 experts (num_experts = {self.num_experts})", self.n_group)
        if self.n_group > 1 and self.router != "sigmoid":
            fail("moe.n_group", "1 with a softmax router", self.n_group)
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            fail("moe.top_k", f"at most the experts of topk_group = {self.topk_group} groups", self.top_k)

    def shapes(self, d_model: int) -> dict:
        """Parameter shapes of one MoE layer (names relative to ``layers.{i}.mlp.``)."""
        E, I, d = self.num_experts, self.inter, d_model
        shapes = {"router.weight": (E, d)}
        if self.router == "sigmoid":
            shapes["router.bias"] = (E,)
        for e in range(E):
            shapes.update({f"experts.{e}.gate_proj.weight": (I, d), f"experts.{e}.up_proj.weight": (I, d),
                           f"experts.{e}.down_proj.weight": (d, I)})
        if self.shared_inter:
            S = self.shared_inter
            shapes.update({"shared.gate_proj.weight": (S, d), "shared.up_proj.weight": (S, d),
                           "shared.down_proj.weight": (d, S)})
        if self.shared_gate:
            shapes["shared_gate.weight"] = (1, d)
        return shapes
