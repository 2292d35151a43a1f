"""Reference weight loader: config detection, checkpoint-name mapping, checkpoint reading.

Formats
  * Hugging Face checkpoints: `config.json` with a registered family's `model_type` (mamba,
    falcon_mamba, mamba2, ...; or, lacking it, an `architectures` entry naming one of their classes), weights in
    `model.safetensors`, sharded `model.safetensors.index.json`, `pytorch_model.bin` or a sharded
    `pytorch_model.bin.index.json`.
  * Raw state-spaces (mamba_ssm) checkpoints: `config.json` holding only `d_model`, `n_layer`,
    `vocab_size`, `ssm_cfg` (`ssm_cfg.layer == "Mamba2"` selects Mamba-2), `pad_vocab_size_multiple`,
    `tie_embeddings`, ... (no `model_type`, no `architectures`), weights usually `pytorch_model.bin`.
    `ssm_cfg.layer` selects the family.

Every format is normalised into one `ModelConfig` (reference.config); what is family-specific (which
configs a family reads, its fields, its mixer parameters) comes from the family's module in
`reference/families/`. Checkpoint keys map to our parameter names by ANCHORED rules (`NAME_RULES`:
regexes matched against the whole key), never by substring replacement.
Our parameter names (`expected_parameters`):

    embedding.weight                       (vocab_size [padded], d_model)
    layers.{i}.norm.weight                 (d_model,)
    layers.{i}.mixer.<mixer parameter>     shapes from `mixer_parameter_shapes`
    layers.{i}.attn.<attention parameter>  hybrid models: the full-attention layers instead of a mixer
    layers.{i}.mlp_norm.weight, layers.{i}.mlp.<name>   hybrid models: the MLP sublayer
    norm_f.weight                          (d_model,)
    lm_head.weight                         (vocab_size, d_model)   loaded, or tied to embedding.weight

Every parameter is either loaded or explicitly tied; a missing key, an unexpected key, two keys
that map to one parameter, a wrong shape or a non-floating dtype is a ValueError naming the file and
the keys. Nothing is returned half-loaded: all checks run before the result is assembled.

`.bin` files are read only through `torch.load(weights_only=True)`: a pickle that carries code fails.
Shard paths named by an index must stay inside the checkpoint folder as written (no absolute path, no
`..` out of it). Symbolic links are followed alike for every weight file, single or shard: a Hugging
Face cache snapshot links each of its files into the cache's blob store, outside the snapshot folder.
Config values are checked for type and range before anything is allocated (see `reference.config`),
and error messages list at most a few names.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch

from reference import families
from reference.config import (MAX_NAMES, CheckpointError, ModelConfig, err, get_bool, get_str, hf_common, name_list,
                              pad_vocab, short, state_spaces_common)

__all__ = ["CheckpointError", "ModelConfig", "pad_vocab", "detect_config", "load_config", "mixer_parameter_shapes",
           "expected_parameters", "map_name", "is_ignored", "plan_names", "check_parameter", "pad_rows",
           "find_checkpoint_files", "load_bin", "safetensors_keys", "iter_checkpoint_tensors", "check_index_keys",
           "assemble", "load_checkpoint", "LoadedCheckpoint", "CheckpointFiles", "NamePlan"]

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

_err = err


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (empty messages included), cut to `limit` characters."""
    lines = str(e).splitlines()
    return lines[0][:limit] if lines else ""


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def hf_model_types() -> dict[str, str]:
    """HF `model_type` -> family name, over every registered family."""
    return {t: f.name for f in families.families() for t in f.hf_model_types}


def hf_architectures() -> dict[str, str]:
    """HF `architectures` entry -> family name, over every registered family."""
    return {a: f.name for f in families.families() for a in f.hf_architectures}


def state_spaces_layers() -> dict[str, str]:
    """Raw state-spaces `ssm_cfg.layer` -> family name, over every registered family."""
    return {layer: f.name for f in families.families() for layer in f.state_spaces_layers}


def detect_config(cfg: dict, where: str | os.PathLike = "config.json") -> ModelConfig:
    """Normalise a config dict (HF or raw state-spaces) into a `ModelConfig`.

    Every value is checked for type and range before anything is derived from it (see reference.config)."""
    if not isinstance(cfg, dict):
        raise _err(where, f"expected a JSON object, got {type(cfg).__name__}")
    types = hf_model_types()
    family = None
    if cfg.get("model_type") is not None:
        family = types[get_str(cfg, "model_type", where, None, types)]
    elif cfg.get("architectures"):
        archs = cfg["architectures"]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise _err(where, f"architectures: expected a list of strings, got {short(archs)}")
        by_arch = hf_architectures()
        known = [by_arch[a] for a in archs if a in by_arch]
        if not known:
            raise _err(where, f"architectures: expected one of {sorted(by_arch)}, got {short(archs)}")
        family = known[0]
    if family is not None:
        fam = families.get(family)
        return fam.from_hf(cfg, hf_common(cfg, where, tie_default=fam.hf_tie_default), where)
    if all(k in cfg for k in ("d_model", "n_layer", "vocab_size")):
        return _state_spaces_config(cfg, where)
    raise _err(where, "not a known Mamba config: expected an HF config with model_type in "
                      f"{sorted(types)}, or a state-spaces config with d_model, n_layer, "
                      f"vocab_size; got keys {name_list(sorted(map(str, cfg)), 12)}")


def _state_spaces_config(cfg: dict, where) -> ModelConfig:
    ssm = cfg.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise _err(where, f"ssm_cfg: expected an object, got {short(ssm)}")
    if cfg.get("d_intermediate", 0) or cfg.get("attn_layer_idx"):
        raise _err(where, "d_intermediate / attn_layer_idx: MLP and attention layers are not supported "
                          f"(got d_intermediate={short(cfg.get('d_intermediate'))}, "
                          f"attn_layer_idx={short(cfg.get('attn_layer_idx'))})")
    if not get_bool(cfg, "rms_norm", where, True):
        raise _err(where, "rms_norm: expected true (LayerNorm blocks are not supported), got false")
    layers = state_spaces_layers()
    layer = get_str(ssm, "layer", where, "Mamba1", layers, prefix="ssm_cfg.")
    fam = families.get(layers[layer])
    unknown = sorted(set(map(str, ssm)) - fam.state_spaces_keys)
    if unknown:
        raise _err(where, f"ssm_cfg: unsupported keys {name_list(unknown)} for layer {layer}")
    return fam.from_state_spaces(cfg, ssm, state_spaces_common(cfg, ssm, where), where)


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
    """Shapes of one layer's mixer parameters, named as in HF / state-spaces checkpoints (by the family)."""
    return families.get(cfg.family, "cfg.family").parameter_shapes(cfg)


def expected_parameters(cfg: ModelConfig) -> dict[str, tuple]:
    """Every parameter of the model (our names) with its shape; `lm_head.weight` included even if tied."""
    out = {"embedding.weight": (cfg.vocab_size, cfg.d_model)}
    fam = families.get(cfg.family, "cfg.family")
    for i in range(cfg.n_layer):
        for k, s in fam.layer_parameter_shapes(cfg, i).items():
            out[f"layers.{i}.{k}"] = s
    out["norm_f.weight"] = (cfg.d_model,)
    out["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    return out


# Anchored name rules: (regex matched with fullmatch, our name template). The optional model prefix is
# `backbone.` (HF and state-spaces) or `model.`; the embedding is `embeddings` (HF) or `embedding`
# (state-spaces). Mixer parameter names are listed one by one (every registered family's
# `mixer_parameter_names`): nothing is renamed by substring.
_PREFIX = r"(?:backbone\.|model\.)?"
_LAYER = r"layers\.(0|[1-9][0-9]*)"


def _alternatives(names) -> str:
    return "|".join(re.escape(n) for n in sorted(set(names)))


_MIXER_ALT = _alternatives(n for f in families.families() for n in f.mixer_parameter_names)
NAME_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(rf"{_PREFIX}(?:embeddings|embedding)\.weight"), "embedding.weight"),
    (re.compile(rf"{_PREFIX}{_LAYER}\.norm\.weight"), "layers.{0}.norm.weight"),
    (re.compile(rf"{_PREFIX}{_LAYER}\.mixer\.({_MIXER_ALT})"), "layers.{0}.mixer.{1}"),
    (re.compile(rf"{_PREFIX}norm_f\.weight"), "norm_f.weight"),
    (re.compile(r"lm_head\.weight"), "lm_head.weight"),
)

# Keys that checkpoints carry but that are not parameters (non-persistent buffers saved by older
# tools; every family's `ignored_mixer_names`). They are dropped by an anchored rule too, never by substring.
_IGNORED = [n for f in families.families() for n in f.ignored_mixer_names]
IGNORED_RULES: tuple[re.Pattern, ...] = (
    (re.compile(rf"{_PREFIX}{_LAYER}\.mixer\.(?:{_alternatives(_IGNORED)})"),) if _IGNORED else ())


def map_name(key: str, cfg: ModelConfig | None = None) -> str | None:
    """Our parameter name for a checkpoint key, or None when no rule matches the whole key. With `cfg`
    of a family that names its checkpoints itself (``own_names``: the hybrid models, whose key names
    depend on each layer's type), the family's rules decide."""
    if cfg is not None:
        fam = families.get(cfg.family, "cfg.family")
        if fam.own_names:
            return fam.map_key(cfg, key)
    for pattern, template in NAME_RULES:
        m = pattern.fullmatch(key)
        if m:
            return template.format(*m.groups())
    return None


def is_ignored(key: str, cfg: ModelConfig | None = None) -> bool:
    if cfg is not None:
        fam = families.get(cfg.family, "cfg.family")
        if fam.own_names:
            return fam.ignored_key(cfg, key)
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
        name = map_name(key, cfg)
        if name is None:
            if is_ignored(key, cfg):
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
        shown = "; ".join(f"{a!r} and {b!r} -> {n!r}" for a, b, n in dup[:MAX_NAMES])
        more = f"; ... ({len(dup) - MAX_NAMES} more)" if len(dup) > MAX_NAMES else ""
        problems.append("keys mapping to the same parameter: " + shown + more)
    if unexpected:
        problems.append(f"unexpected keys {name_list(unexpected)}")
    tied: dict[str, str] = {}
    redundant: list[str] = []
    if cfg.tie_embeddings:
        tied["lm_head.weight"] = "embedding.weight"
        if "lm_head.weight" in mapping:
            redundant.append(mapping.pop("lm_head.weight"))
    missing = [n for n in expected if n not in mapping and n not in tied]
    if missing:
        problems.append(f"missing parameters {name_list(missing)}")
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
    """The shard an index names: a relative path that stays inside `folder` as written (symbolic links are
    then followed, as for every weight file; see the module doc)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise _err(index, f"shard path {short(rel)}: expected a relative file name inside {folder}")
    norm = os.path.normpath(rel)
    if norm in (os.curdir, os.pardir) or norm.startswith(os.pardir + os.sep):
        raise _err(index, f"shard path {short(rel)} escapes the checkpoint folder {folder}")
    p = folder / norm
    if not p.is_file():
        raise _err(index, f"shard {short(rel)} not found in {folder}")
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
                         f"(torch.load(weights_only=True) refused it: {type(e).__name__}: {_first_line(e)})") from None
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
        raise _err(path, f"not a readable safetensors file (truncated or corrupt?): {type(e).__name__}: "
                         f"{_first_line(e)}") from None


def iter_checkpoint_tensors(files: CheckpointFiles) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, key, tensor) for every tensor of a checkpoint (reference path: plain full reads)."""
    for path, keys in files.files.items():
        if files.format == "safetensors":
            from safetensors.torch import load_file
            safetensors_keys(path)  # raises a clear error on a corrupt file
            try:
                sd = load_file(str(path))
            except Exception as e:
                raise _err(path, f"not a readable safetensors file: {type(e).__name__}: {_first_line(e)}") from None
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
        raise _err(path, f"keys listed in the index but absent from the shard: {name_list(sorted(listed - present))}")
    if present - listed:
        raise _err(path, f"keys in the shard that the index does not list: {name_list(sorted(present - listed))}")


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
