"""Reference weight loader: config detection, checkpoint-name mapping, checkpoint reading.

Formats
  * Hugging Face checkpoints: `config.json` with `model_type` in {mamba, falcon_mamba, mamba2}
    (or, lacking it, an `architectures` entry naming one of their CausalLM classes), weights in
    `model.safetensors`, sharded `model.safetensors.index.json`, `pytorch_model.bin` or a sharded
    `pytorch_model.bin.index.json`.
  * Raw state-spaces (mamba_ssm) checkpoints: `config.json` holding only `d_model`, `n_layer`,
    `vocab_size`, `ssm_cfg` (`ssm_cfg.layer == "Mamba2"` selects Mamba-2), `pad_vocab_size_multiple`,
    `tie_embeddings`, ... (no `model_type`, no `architectures`), weights usually `pytorch_model.bin`.

Every format is normalised into one `ModelConfig`. Checkpoint keys map to our parameter names by
ANCHORED rules (`NAME_RULES`: regexes matched against the whole key), never by substring replacement.
Our parameter names (`expected_parameters`):

    embedding.weight                       (vocab_size [padded], d_model)
    layers.{i}.norm.weight                 (d_model,)
    layers.{i}.mixer.<mixer parameter>     shapes from `mixer_parameter_shapes`
    norm_f.weight                          (d_model,)
    lm_head.weight                         (vocab_size, d_model)   loaded, or tied to embedding.weight

Every parameter is either loaded or explicitly tied; a missing key, an unexpected key, two keys
that map to one parameter, a wrong shape or a non-floating dtype is a ValueError naming the file and
the keys. Nothing is returned half-loaded: all checks run before the result is assembled.

`.bin` files are read only through `torch.load(weights_only=True)`: a pickle that carries code fails.
Shard paths named by an index must stay inside the checkpoint folder.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

FAMILIES = ("mamba1", "falcon_mamba", "mamba2")

HF_MODEL_TYPES = {"mamba": "mamba1", "falcon_mamba": "falcon_mamba", "mamba2": "mamba2"}
HF_ARCHITECTURES = {"MambaForCausalLM": "mamba1", "MambaModel": "mamba1",
                    "FalconMambaForCausalLM": "falcon_mamba", "FalconMambaModel": "falcon_mamba",
                    "Mamba2ForCausalLM": "mamba2", "Mamba2Model": "mamba2"}

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file and the keys."""


def _err(path, msg: str) -> CheckpointError:
    return CheckpointError(f"{path}: {msg}")


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    """One normalised description of a Mamba-1 / Falcon-Mamba / Mamba-2 language model.

    `vocab_size` is the number of embedding rows (padded to `pad_vocab_size_multiple`);
    `vocab_size_unpadded` is the tokenizer's vocabulary (greedy decoding argmaxes over it).
    Mamba-1 fields: `dt_rank`, `mixer_rms_eps` (Falcon-Mamba's weightless B/C/dt RMSNorm; None for
    plain Mamba-1). Mamba-2 fields: `n_groups`, `head_dim`, `num_heads`, `chunk_size`,
    `time_step_limit`, `mixer_norm_eps` (the gated RMSNorm), `norm_before_gate`.
    """
    family: str
    d_model: int
    n_layer: int
    vocab_size: int
    vocab_size_unpadded: int
    pad_vocab_size_multiple: int
    d_state: int
    d_conv: int
    expand: int
    d_inner: int
    conv_bias: bool
    bias: bool
    norm_eps: float
    residual_in_fp32: bool
    tie_embeddings: bool
    source: str  # "hf" | "state-spaces"
    # Mamba-1 / Falcon-Mamba
    dt_rank: int = 0
    mixer_rms_eps: float | None = None
    # Mamba-2
    n_groups: int = 1
    head_dim: int = 0
    num_heads: int = 0
    chunk_size: int = 256
    time_step_limit: tuple = (0.0, math.inf)
    mixer_norm_eps: float = 1e-5
    norm_before_gate: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv (Mamba-1: d_inner; Mamba-2: d_inner + 2 * n_groups * d_state)."""
        if self.family == "mamba2":
            return self.d_inner + 2 * self.n_groups * self.d_state
        return self.d_inner

    def as_dict(self) -> dict:
        return asdict(self)


def _get(cfg: dict, key: str, default, kind: Callable, where: str):
    v = cfg.get(key, default)
    if v is None:
        v = default
    try:
        if kind is bool:
            if not isinstance(v, bool):
                raise TypeError
            return v
        if kind is int:
            if isinstance(v, bool) or int(v) != v:
                raise TypeError
            return int(v)
        return kind(v)
    except (TypeError, ValueError):
        raise _err(where, f"config key {key!r}: expected {kind.__name__}, got {v!r}") from None


def _float_value(v):
    """JSON floats, including transformers' {"__float__": "Infinity"} encoding."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _positive(where, **values):
    for k, v in values.items():
        if v <= 0:
            raise _err(where, f"config {k}: expected a positive integer, got {v}")


def pad_vocab(vocab: int, multiple: int) -> int:
    if multiple <= 1:
        return vocab
    return ((vocab + multiple - 1) // multiple) * multiple


def detect_config(cfg: dict, where: str | os.PathLike = "config.json") -> ModelConfig:
    """Normalise a config dict (HF or raw state-spaces) into a `ModelConfig`."""
    if not isinstance(cfg, dict):
        raise _err(where, f"expected a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    family = HF_MODEL_TYPES.get(model_type) if model_type is not None else None
    if model_type is not None and family is None:
        raise _err(where, f"model_type: expected one of {sorted(HF_MODEL_TYPES)}, got {model_type!r}")
    if family is None and cfg.get("architectures"):
        archs = cfg["architectures"]
        known = [HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES]
        if not known:
            raise _err(where, f"architectures: expected one of {sorted(HF_ARCHITECTURES)}, got {archs!r}")
        family = known[0]
    if family is not None:
        return _hf_config(cfg, family, where)
    if all(k in cfg for k in ("d_model", "n_layer", "vocab_size")):
        return _state_spaces_config(cfg, where)
    raise _err(where, "not a known Mamba config: expected an HF config with model_type in "
                      f"{sorted(HF_MODEL_TYPES)}, or a state-spaces config with d_model, n_layer, "
                      f"vocab_size; got keys {sorted(cfg)[:12]}")


def _hf_config(cfg: dict, family: str, where) -> ModelConfig:
    d_model = _get(cfg, "hidden_size", None, int, where)
    n_layer = _get(cfg, "num_hidden_layers", None, int, where)
    vocab = _get(cfg, "vocab_size", None, int, where)
    expand = _get(cfg, "expand", 2, int, where)
    d_state = _get(cfg, "state_size", 128 if family == "mamba2" else 16, int, where)
    d_conv = _get(cfg, "conv_kernel", 4, int, where)
    _positive(where, hidden_size=d_model, num_hidden_layers=n_layer, vocab_size=vocab, expand=expand,
              state_size=d_state, conv_kernel=d_conv)
    multiple = _get(cfg, "pad_vocab_size_multiple", 1, int, where)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _err(where, f"hidden_act: expected 'silu', got {act!r}")
    common = dict(
        d_model=d_model, n_layer=n_layer, vocab_size=pad_vocab(vocab, multiple), vocab_size_unpadded=vocab,
        pad_vocab_size_multiple=max(multiple, 1), d_state=d_state, d_conv=d_conv, expand=expand,
        conv_bias=_get(cfg, "use_conv_bias", True, bool, where), bias=_get(cfg, "use_bias", False, bool, where),
        norm_eps=_get(cfg, "layer_norm_epsilon", 1e-5, float, where),
        residual_in_fp32=_get(cfg, "residual_in_fp32", True, bool, where), source="hf")
    if family in ("mamba1", "falcon_mamba"):
        d_inner = int(cfg.get("intermediate_size") or expand * d_model)
        rank = cfg.get("time_step_rank", "auto")
        dt_rank = math.ceil(d_model / 16) if rank in (None, "auto") else _get(cfg, "time_step_rank", 0, int, where)
        _positive(where, time_step_rank=dt_rank, intermediate_size=d_inner)
        return ModelConfig(
            family=family, d_inner=d_inner, dt_rank=dt_rank,
            tie_embeddings=_get(cfg, "tie_word_embeddings", True, bool, where),
            mixer_rms_eps=(_get(cfg, "mixer_rms_eps", 1e-6, float, where) if family == "falcon_mamba" else None),
            **common)
    num_heads = _get(cfg, "num_heads", 128, int, where)
    head_dim = _get(cfg, "head_dim", 64, int, where)
    n_groups = _get(cfg, "n_groups", 8, int, where)
    _positive(where, num_heads=num_heads, head_dim=head_dim, n_groups=n_groups)
    d_inner = expand * d_model
    if num_heads * head_dim != d_inner:
        raise _err(where, f"num_heads * head_dim: expected hidden_size * expand = {d_inner}, "
                          f"got {num_heads} * {head_dim} = {num_heads * head_dim}")
    if num_heads % n_groups:
        raise _err(where, f"n_groups: expected a divisor of num_heads = {num_heads}, got {n_groups}")
    lim = cfg.get("time_step_limit", (0.0, math.inf))
    try:
        lim = tuple(_float_value(v) for v in lim)
        if len(lim) != 2 or not lim[0] <= lim[1]:
            raise ValueError
    except (TypeError, ValueError):
        raise _err(where, f"time_step_limit: expected [low, high] with low <= high, got {cfg.get('time_step_limit')!r}") from None
    return ModelConfig(
        family="mamba2", d_inner=d_inner, n_groups=n_groups, head_dim=head_dim, num_heads=num_heads,
        chunk_size=_get(cfg, "chunk_size", 256, int, where), time_step_limit=lim,
        mixer_norm_eps=common["norm_eps"], norm_before_gate=False,
        tie_embeddings=_get(cfg, "tie_word_embeddings", False, bool, where), **common)


# Keys of a state-spaces ssm_cfg we understand; anything else is refused rather than ignored.
_SS_MAMBA1_KEYS = {"layer", "d_state", "d_conv", "expand", "dt_rank", "conv_bias", "bias", "dt_min", "dt_max",
                   "dt_init", "dt_scale", "dt_init_floor", "use_fast_path"}
_SS_MAMBA2_KEYS = {"layer", "d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_limit",
                   "conv_bias", "bias", "rmsnorm", "norm_before_gate", "d_ssm", "D_has_hdim", "dt_min", "dt_max",
                   "dt_init_floor", "A_init_range", "conv_init", "use_mem_eff_path"}


def _state_spaces_config(cfg: dict, where) -> ModelConfig:
    d_model = _get(cfg, "d_model", None, int, where)
    n_layer = _get(cfg, "n_layer", None, int, where)
    vocab = _get(cfg, "vocab_size", None, int, where)
    multiple = _get(cfg, "pad_vocab_size_multiple", 8, int, where)
    _positive(where, d_model=d_model, n_layer=n_layer, vocab_size=vocab, pad_vocab_size_multiple=multiple)
    ssm = cfg.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise _err(where, f"ssm_cfg: expected an object, got {ssm!r}")
    if cfg.get("d_intermediate", 0) or cfg.get("attn_layer_idx"):
        raise _err(where, "d_intermediate / attn_layer_idx: MLP and attention layers are not supported "
                          f"(got d_intermediate={cfg.get('d_intermediate')}, attn_layer_idx={cfg.get('attn_layer_idx')})")
    if not cfg.get("rms_norm", True):
        raise _err(where, "rms_norm: expected true (LayerNorm blocks are not supported), got false")
    layer = ssm.get("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise _err(where, f"ssm_cfg.layer: expected 'Mamba1' or 'Mamba2', got {layer!r}")
    allowed = _SS_MAMBA2_KEYS if layer == "Mamba2" else _SS_MAMBA1_KEYS
    unknown = sorted(set(ssm) - allowed)
    if unknown:
        raise _err(where, f"ssm_cfg: unsupported keys {unknown} for layer {layer}")
    expand = _get(ssm, "expand", 2, int, where)
    d_conv = _get(ssm, "d_conv", 4, int, where)
    d_inner = expand * d_model
    common = dict(
        d_model=d_model, n_layer=n_layer, vocab_size=pad_vocab(vocab, multiple), vocab_size_unpadded=vocab,
        pad_vocab_size_multiple=multiple, d_conv=d_conv, expand=expand, d_inner=d_inner,
        conv_bias=_get(ssm, "conv_bias", True, bool, where), bias=_get(ssm, "bias", False, bool, where),
        norm_eps=_get(cfg, "norm_epsilon", 1e-5, float, where),
        residual_in_fp32=_get(cfg, "residual_in_fp32", True, bool, where),
        tie_embeddings=_get(cfg, "tie_embeddings", True, bool, where), source="state-spaces")
    if layer == "Mamba1":
        d_state = _get(ssm, "d_state", 16, int, where)
        rank = ssm.get("dt_rank", "auto")
        dt_rank = math.ceil(d_model / 16) if rank in (None, "auto") else _get(ssm, "dt_rank", 0, int, where)
        _positive(where, d_state=d_state, d_conv=d_conv, expand=expand, dt_rank=dt_rank)
        return ModelConfig(family="mamba1", d_state=d_state, dt_rank=dt_rank, **common)
    d_state = _get(ssm, "d_state", 128, int, where)
    head_dim = _get(ssm, "headdim", 64, int, where)
    n_groups = _get(ssm, "ngroups", 1, int, where)
    _positive(where, d_state=d_state, d_conv=d_conv, expand=expand, headdim=head_dim, ngroups=n_groups)
    if ssm.get("d_ssm") not in (None, d_inner):
        raise _err(where, f"ssm_cfg.d_ssm: only d_ssm = d_inner = {d_inner} is supported, got {ssm['d_ssm']}")
    if ssm.get("D_has_hdim", False):
        raise _err(where, "ssm_cfg.D_has_hdim: expected false (per-channel D is not supported), got true")
    if not ssm.get("rmsnorm", True):
        raise _err(where, "ssm_cfg.rmsnorm: expected true, got false")
    if d_inner % head_dim:
        raise _err(where, f"ssm_cfg.headdim: expected a divisor of d_inner = {d_inner}, got {head_dim}")
    num_heads = d_inner // head_dim
    if num_heads % n_groups:
        raise _err(where, f"ssm_cfg.ngroups: expected a divisor of nheads = {num_heads}, got {n_groups}")
    lim = ssm.get("dt_limit", (0.0, math.inf))
    try:
        lim = tuple(_float_value(v) for v in lim)
        if len(lim) != 2 or not lim[0] <= lim[1]:
            raise ValueError
    except (TypeError, ValueError):
        raise _err(where, f"ssm_cfg.dt_limit: expected [low, high], got {ssm.get('dt_limit')!r}") from None
    return ModelConfig(family="mamba2", d_state=d_state, n_groups=n_groups, head_dim=head_dim, num_heads=num_heads,
                       chunk_size=_get(ssm, "chunk_size", 256, int, where), time_step_limit=lim,
                       mixer_norm_eps=1e-5, norm_before_gate=_get(ssm, "norm_before_gate", False, bool, where),
                       **common)


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read `config.json` from a checkpoint folder (or the file itself) and normalise it."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise _err(p, "config file not found")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _err(p, f"not valid JSON: {e}") from None
    return detect_config(raw, p)


# ----------------------------------------------------------------------------------------------
# Parameter names and shapes
# ----------------------------------------------------------------------------------------------

def mixer_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Shapes of one layer's mixer parameters, named as in HF / state-spaces checkpoints."""
    D, N, K = cfg.d_inner, cfg.d_state, cfg.d_conv
    shapes: dict[str, tuple] = {}
    if cfg.family in ("mamba1", "falcon_mamba"):
        R = cfg.dt_rank
        shapes["in_proj.weight"] = (2 * D, cfg.d_model)
        shapes["conv1d.weight"] = (D, 1, K)
        shapes["x_proj.weight"] = (R + 2 * N, D)
        shapes["dt_proj.weight"] = (D, R)
        shapes["dt_proj.bias"] = (D,)
        shapes["A_log"] = (D, N)
        shapes["D"] = (D,)
        shapes["out_proj.weight"] = (cfg.d_model, D)
    else:
        H = cfg.num_heads
        shapes["in_proj.weight"] = (2 * D + 2 * cfg.n_groups * N + H, cfg.d_model)
        shapes["conv1d.weight"] = (cfg.conv_dim, 1, K)
        shapes["dt_bias"] = (H,)
        shapes["A_log"] = (H,)
        shapes["D"] = (H,)
        shapes["norm.weight"] = (D,)
        shapes["out_proj.weight"] = (cfg.d_model, D)
    if cfg.conv_bias:
        shapes["conv1d.bias"] = (cfg.conv_dim,)
    if cfg.bias:
        shapes["in_proj.bias"] = (shapes["in_proj.weight"][0],)
        shapes["out_proj.bias"] = (cfg.d_model,)
    return shapes


def expected_parameters(cfg: ModelConfig) -> dict[str, tuple]:
    """Every parameter of the model (our names) with its shape; `lm_head.weight` included even if tied."""
    out = {"embedding.weight": (cfg.vocab_size, cfg.d_model)}
    mixer = mixer_parameter_shapes(cfg)
    for i in range(cfg.n_layer):
        out[f"layers.{i}.norm.weight"] = (cfg.d_model,)
        for k, s in mixer.items():
            out[f"layers.{i}.mixer.{k}"] = s
    out["norm_f.weight"] = (cfg.d_model,)
    out["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    return out


# Anchored name rules: (regex matched with fullmatch, our name template). The optional model prefix is
# `backbone.` (HF and state-spaces) or `model.`; the embedding is `embeddings` (HF) or `embedding`
# (state-spaces). Mixer parameter names are listed one by one: nothing is renamed by substring.
_PREFIX = r"(?:backbone\.|model\.)?"
_MIXER_NAMES = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight",
                "dt_proj.weight", "dt_proj.bias", "A_log", "D", "dt_bias", "norm.weight",
                "out_proj.weight", "out_proj.bias")
_MIXER_ALT = "|".join(re.escape(n) for n in _MIXER_NAMES)
NAME_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(rf"{_PREFIX}(?:embeddings|embedding)\.weight"), "embedding.weight"),
    (re.compile(rf"{_PREFIX}layers\.(0|[1-9][0-9]*)\.norm\.weight"), "layers.{0}.norm.weight"),
    (re.compile(rf"{_PREFIX}layers\.(0|[1-9][0-9]*)\.mixer\.({_MIXER_ALT})"), "layers.{0}.mixer.{1}"),
    (re.compile(rf"{_PREFIX}norm_f\.weight"), "norm_f.weight"),
    (re.compile(r"lm_head\.weight"), "lm_head.weight"),
)

# Keys that checkpoints carry but that are not parameters (non-persistent buffers saved by older
# tools). They are dropped by an anchored rule too, never by substring.
IGNORED_RULES: tuple[re.Pattern, ...] = (
    re.compile(rf"{_PREFIX}layers\.(0|[1-9][0-9]*)\.mixer\.(?:b_layernorm|c_layernorm|dt_layernorm)\.weight"),
)


def map_name(key: str) -> str | None:
    """Our parameter name for a checkpoint key, or None when no rule matches the whole key."""
    for pattern, template in NAME_RULES:
        m = pattern.fullmatch(key)
        if m:
            return template.format(*m.groups())
    return None


def is_ignored(key: str) -> bool:
    return any(p.fullmatch(key) for p in IGNORED_RULES)


@dataclass
class NamePlan:
    """The result of mapping a checkpoint's keys: what loads where, what is tied, what is ignored."""
    mapping: dict[str, str]            # our name -> checkpoint key
    tied: dict[str, str]               # our name -> our name it is tied to
    ignored: list[str]                 # checkpoint keys dropped by IGNORED_RULES
    redundant_tied: list[str] = field(default_factory=list)  # checkpoint keys of tied params (checked equal)


def plan_names(cfg: ModelConfig, keys: Iterable[str], where) -> NamePlan:
    """Map checkpoint keys onto the expected parameters; raise naming every bad key.

    Errors: keys that no rule maps (unexpected), keys that map to a parameter the config doesn't
    have (unexpected, e.g. layer index >= n_layer or `x_proj` in a Mamba-2), two keys mapping to one
    parameter, and expected parameters no key provides (missing) unless tied.
    """
    expected = expected_parameters(cfg)
    mapping: dict[str, str] = {}
    unexpected, ignored, dup = [], [], []
    for key in sorted(keys):
        name = map_name(key)
        if name is None:
            if is_ignored(key):
                ignored.append(key)
            else:
                unexpected.append(key)
            continue
        if name not in expected:
            unexpected.append(key)
            continue
        if name in mapping:
            dup.append((mapping[name], key, name))
            continue
        mapping[name] = key
    problems = []
    if dup:
        problems.append("keys mapping to the same parameter: " +
                        "; ".join(f"{a!r} and {b!r} -> {n!r}" for a, b, n in dup))
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    tied: dict[str, str] = {}
    redundant: list[str] = []
    if cfg.tie_embeddings:
        tied["lm_head.weight"] = "embedding.weight"
        if "lm_head.weight" in mapping:
            redundant.append(mapping.pop("lm_head.weight"))
    missing = [n for n in expected if n not in mapping and n not in tied]
    if missing:
        problems.append(f"missing parameters {missing}")
    if problems:
        raise _err(where, f"checkpoint does not match the {cfg.family} config: " + "; ".join(problems))
    return NamePlan(mapping=mapping, tied=tied, ignored=ignored, redundant_tied=redundant)


def check_parameter(cfg: ModelConfig, name: str, key: str, shape: tuple, dtype: torch.dtype, where) -> str:
    """Check one tensor's shape/dtype against the config. Returns "ok" or "pad-vocab" (rows to pad).

    Embedding and untied lm_head may come with `vocab_size_unpadded` rows; they are padded with zero
    rows to `vocab_size`. Any other row count is an error that padding cannot explain.
    """
    want = expected_parameters(cfg)[name]
    if not (dtype.is_floating_point):
        raise _err(where, f"key {key!r}: expected a floating-point tensor, got dtype {dtype}")
    shape = tuple(shape)
    if shape == want:
        return "ok"
    if name in ("embedding.weight", "lm_head.weight") and len(shape) == 2 and shape[1] == want[1]:
        if shape[0] == cfg.vocab_size_unpadded and cfg.vocab_size_unpadded < cfg.vocab_size:
            return "pad-vocab"
        raise _err(where, f"key {key!r}: vocabulary of {shape[0]} rows cannot be explained by vocab_size "
                          f"{cfg.vocab_size_unpadded} padded to a multiple of {cfg.pad_vocab_size_multiple} "
                          f"(= {cfg.vocab_size})")
    raise _err(where, f"key {key!r} ({name}): expected shape {want}, got {shape}")


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


# ----------------------------------------------------------------------------------------------
# Checkpoint files
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckpointFiles:
    """Where a checkpoint's tensors live: `format` ("safetensors" | "bin") and file -> keys (None = all)."""
    folder: Path
    format: str
    files: dict  # Path -> list[str] | None (None: every key in the file)


def _inside(folder: Path, rel: str, index: Path) -> Path:
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise _err(index, f"shard path {rel!r}: expected a relative file name inside {folder}")
    p = (folder / rel).resolve()
    try:
        p.relative_to(folder.resolve())
    except ValueError:
        raise _err(index, f"shard path {rel!r} escapes the checkpoint folder {folder}") from None
    if not p.is_file():
        raise _err(index, f"shard {rel!r} not found in {folder}")
    return p


def _read_index(folder: Path, name: str) -> dict:
    index = folder / name
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _err(index, f"not valid JSON: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise _err(index, "expected a non-empty 'weight_map' object")
    files: dict[Path, list[str]] = {}
    for key, rel in wm.items():
        files.setdefault(_inside(folder, rel, index), []).append(key)
    return files


def find_checkpoint_files(path: str | os.PathLike) -> CheckpointFiles:
    """Locate the weight files of a checkpoint folder (safetensors preferred over .bin)."""
    folder = Path(path)
    if not folder.is_dir():
        raise _err(folder, "checkpoint folder not found")
    if (folder / SAFETENSORS_INDEX).is_file():
        return CheckpointFiles(folder, "safetensors", _read_index(folder, SAFETENSORS_INDEX))
    if (folder / SAFETENSORS_FILE).is_file():
        return CheckpointFiles(folder, "safetensors", {folder / SAFETENSORS_FILE: None})
    if (folder / BIN_INDEX).is_file():
        return CheckpointFiles(folder, "bin", _read_index(folder, BIN_INDEX))
    if (folder / BIN_FILE).is_file():
        return CheckpointFiles(folder, "bin", {folder / BIN_FILE: None})
    raise _err(folder, f"no weights found: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {BIN_FILE} or {BIN_INDEX}")


def load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A `.bin` state dict through torch.load(weights_only=True); code-carrying pickles fail clearly."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError (truncated zip), EOFError, ...
        raise _err(path, f"cannot be read as a weights-only torch checkpoint "
                         f"(torch.load(weights_only=True) refused it: {type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise _err(path, f"expected a dict of name -> tensor, got {type(sd).__name__}")
    return sd


def safetensors_keys(path: Path) -> dict[str, tuple]:
    """Key -> (shape, dtype string) of a safetensors file, without reading tensors; clear error if corrupt."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
            return out
    except Exception as e:  # SafetensorError: truncated header, incomplete file, bad JSON ...
        raise _err(path, f"not a readable safetensors file (truncated or corrupt?): {type(e).__name__}: {e}") from None


def iter_checkpoint_tensors(files: CheckpointFiles) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, key, tensor) for every tensor of a checkpoint (reference path: plain full reads)."""
    for path, keys in files.files.items():
        if files.format == "safetensors":
            from safetensors.torch import load_file
            safetensors_keys(path)  # raises a clear error on a corrupt file
            try:
                sd = load_file(str(path))
            except Exception as e:
                raise _err(path, f"not a readable safetensors file: {type(e).__name__}: {e}") from None
        else:
            sd = load_bin(path)
        check_index_keys(path, keys, sd.keys())
        for k in sorted(sd):
            yield path, k, sd[k]


def check_index_keys(path: Path, listed: list[str] | None, present: Iterable[str]) -> None:
    """An index's weight_map and the shard's actual keys must agree exactly."""
    if listed is None:
        return
    present = set(present)
    listed = set(listed)
    if listed - present:
        raise _err(path, f"keys listed in the index but absent from the shard: {sorted(listed - present)}")
    if present - listed:
        raise _err(path, f"keys in the shard that the index does not list: {sorted(present - listed)}")


# ----------------------------------------------------------------------------------------------
# The reference load
# ----------------------------------------------------------------------------------------------

@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    params: dict[str, torch.Tensor]   # our names; tied parameters share storage with their source
    tied: dict[str, str]
    files: CheckpointFiles


def assemble(cfg: ModelConfig, tensors: dict[str, tuple[Path, torch.Tensor]], where,
             dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], NamePlan]:
    """Map, check, pad and tie a full key -> (file, tensor) dict. Raises before returning anything."""
    plan = plan_names(cfg, tensors.keys(), where)
    params: dict[str, torch.Tensor] = {}
    for name, key in plan.mapping.items():
        path, t = tensors[key]
        how = check_parameter(cfg, name, key, tuple(t.shape), t.dtype, path)
        if how == "pad-vocab":
            t = pad_rows(t, cfg.vocab_size)
        params[name] = t if dtype is None else t.to(dtype)
    for key in plan.redundant_tied:
        path, t = tensors[key]
        emb = tensors[plan.mapping["embedding.weight"]][1]
        if tuple(t.shape) != tuple(emb.shape) or not torch.equal(t.to(emb.dtype), emb):
            raise _err(path, f"key {key!r}: the config ties lm_head to the embedding, but the checkpoint's "
                             f"lm_head differs from {plan.mapping['embedding.weight']!r}")
    for name, src in plan.tied.items():
        params[name] = params[src]
    return params, plan


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None) -> LoadedCheckpoint:
    """Load a checkpoint folder completely into CPU memory: config, every parameter under our names.

    `dtype` converts every parameter (None keeps the checkpoint's dtypes).
    """
    folder = Path(path)
    cfg = load_config(folder)
    files = find_checkpoint_files(folder)
    tensors: dict[str, tuple[Path, torch.Tensor]] = {}
    for file, key, t in iter_checkpoint_tensors(files):
        if key in tensors:
            raise _err(file, f"key {key!r} appears in two files ({tensors[key][0].name} and {file.name})")
        tensors[key] = (file, t)
    params, plan = assemble(cfg, tensors, folder, dtype)
    return LoadedCheckpoint(config=cfg, params=params, tied=plan.tied, files=files)
