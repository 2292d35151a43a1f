"""Fast weight loader: safetensors memory-mapped straight into the target device and dtype,
sharded checkpoints, `.bin` through torch.load(weights_only=True), tensor-parallel sharding of the
mixer weights.

Config detection, the checkpoint-name -> parameter-name mapping, the shape/dtype checks, vocabulary
padding and tying all come from `reference.loader` (harness imports reference, never the reverse), so
the two loaders cannot disagree on what a checkpoint means. All metadata is checked before a single
tensor is read: a bad checkpoint fails with the same ValueError as in the reference loader and nothing
is returned half-loaded.

Tensor parallelism (rank r of T; as vLLM's mixers shard them). Every mixer parameter is cut along one
dim (`shard_rule`) into sections; a sharded section of length L gives rank r its rows
[r*L/T, (r+1)*L/T), a replicated section is copied whole. Each family's cuts are listed in its engine
module (harness/engine/families/). Embedding, block norms, norm_f, lm_head: replicated.

    w = load_weights(folder, device="cuda:0", dtype=torch.bfloat16, tp_rank=0, tp_size=2)
    w.config, w.params["layers.0.mixer.in_proj.weight"], w.tied
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reference.loader import (CheckpointError, CheckpointFiles, ModelConfig, check_index_keys, check_parameter,
                              find_checkpoint_files, load_bin, load_config, pad_rows, plan_names, safetensors_keys)

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
for _n, _a in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _a):
        _ST_DTYPES[_n] = getattr(torch, _a)


@dataclass(frozen=True)
class ShardRule:
    """How one parameter is cut for tensor parallelism: along `dim`, in `sections` of (length, sharded).
    `dim=None`: replicated."""
    dim: int | None
    sections: tuple = ()

    def ranges(self, rank: int, size: int) -> list[tuple[int, int]]:
        """[start, stop) ranges along `dim` that rank `rank` of `size` holds, in order."""
        out, off = [], 0
        for length, sharded in self.sections:
            if sharded:
                per = length // size
                out.append((off + rank * per, off + (rank + 1) * per))
            else:
                out.append((off, off + length))
            off += length
        return out


def check_tp(cfg: ModelConfig, tp_size: int, tp_rank: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size: expected a positive int, got {tp_size!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: expected an int in [0, {tp_size}), got {tp_rank!r}")
    from harness.engine import families
    families.get(cfg.family, "cfg.family").check_tp(cfg, tp_size)


def shard_rule(cfg: ModelConfig, name: str) -> ShardRule:
    """The tensor-parallel cut of one parameter (our name), as the family's engine module gives it."""
    if not name.startswith("layers.") or ".mixer." not in name:
        return ShardRule(None)
    from harness.engine import families
    cut = families.get(cfg.family, "cfg.family").shard_sections(cfg, name.split(".mixer.", 1)[1])
    if cut is None:
        raise ValueError(f"name: expected a mixer parameter of a {cfg.family} model, got {name!r}")
    return ShardRule(*cut)


def take_shard(t: torch.Tensor, rule: ShardRule, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece of a full tensor (used for .bin and for tests)."""
    if rule.dim is None or size == 1:
        return t
    pieces = [t.narrow(rule.dim, a, b - a) for a, b in rule.ranges(rank, size)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=rule.dim)


def assemble_shards(shards: list[torch.Tensor], rule: ShardRule) -> torch.Tensor:
    """Inverse of `take_shard` over all ranks: sharded sections concatenated, replicated ones taken
    from rank 0 (and required to be equal on every rank)."""
    size = len(shards)
    if rule.dim is None or size == 1:
        for s in shards[1:]:
            if not torch.equal(s, shards[0]):
                raise ValueError("shards: a replicated parameter differs between ranks")
        return shards[0]
    out, pos = [], 0
    for length, sharded in rule.sections:
        n = length // size if sharded else length
        pieces = [s.narrow(rule.dim, pos, n) for s in shards]
        if sharded:
            out.append(torch.cat(pieces, dim=rule.dim))
        else:
            for p in pieces[1:]:
                if not torch.equal(p, pieces[0]):
                    raise ValueError("shards: a replicated section differs between ranks")
            out.append(pieces[0])
        pos += n
    return torch.cat(out, dim=rule.dim)


@dataclass
class LoadedWeights:
    config: ModelConfig
    params: dict                 # our names -> tensors on `device` (tied ones share storage)
    tied: dict
    files: CheckpointFiles
    tp_rank: int = 0
    tp_size: int = 1
    bytes_read: int = 0
    seconds: float = 0.0
    ignored: list = field(default_factory=list)


def _st_dtype(path, key, s: str) -> torch.dtype:
    if s not in _ST_DTYPES:
        raise CheckpointError(f"{path}: key {key!r}: unsupported safetensors dtype {s}")
    return _ST_DTYPES[s]


def _safe_device(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else (f"{device.type}:{device.index or 0}" if device.type == "cuda" else "cpu")


def load_weights(folder, *, device="cpu", dtype: torch.dtype | None = None, tp_rank: int = 0,
                 tp_size: int = 1) -> LoadedWeights:
    """Load a checkpoint folder's weights onto `device` (optionally converting to `dtype`), keeping
    only rank `tp_rank`'s shard of every mixer parameter. Raises (naming file and keys) before any
    tensor is read if the checkpoint does not match its config."""
    t0 = time.perf_counter()
    folder = Path(folder)
    cfg = load_config(folder)
    check_tp(cfg, tp_size, tp_rank)
    device = torch.device(device)
    files = find_checkpoint_files(folder)

    # 1. metadata only: every key, its file, shape and dtype; check everything before reading
    meta: dict[str, tuple] = {}
    bin_cache: dict[Path, dict] = {}
    for path, listed in files.files.items():
        if files.format == "safetensors":
            keys = safetensors_keys(path)
            check_index_keys(path, listed, keys)
            items = {k: (shape, _st_dtype(path, k, dt)) for k, (shape, dt) in keys.items()}
        else:
            sd = _load_bin_mmap(path)
            check_index_keys(path, listed, sd.keys())
            bin_cache[path] = sd
            items = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
        for k, (shape, dt) in items.items():
            if k in meta:
                raise CheckpointError(f"{path}: key {k!r} appears in two files ({meta[k][0].name} and {path.name})")
            meta[k] = (path, shape, dt)
    plan = plan_names(cfg, meta.keys(), folder)
    how = {name: check_parameter(cfg, name, key, meta[key][1], meta[key][2], meta[key][0])
           for name, key in plan.mapping.items()}

    # 2. read: safetensors slices straight to the device (mmap), one file open at a time
    by_file: dict[Path, list[str]] = {}
    for name, key in plan.mapping.items():
        by_file.setdefault(meta[key][0], []).append(name)
    params: dict[str, torch.Tensor] = {}
    nbytes = 0
    for path, names in by_file.items():
        if files.format == "safetensors":
            from safetensors import safe_open
            try:
                with safe_open(str(path), framework="pt", device=_safe_device(device)) as f:
                    for name in names:
                        key = plan.mapping[name]
                        t = _read_st(f, key, shard_rule(cfg, name), tp_rank, tp_size, device.type == "cpu")
                        params[name] = _finish(t, device, dtype)
                        nbytes += t.numel() * t.element_size()
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path}: reading failed: {type(e).__name__}: {e}") from None
        else:
            sd = bin_cache[path]
            for name in names:
                t = take_shard(sd[plan.mapping[name]], shard_rule(cfg, name), tp_rank, tp_size)
                params[name] = _finish(t, device, dtype)
                nbytes += t.numel() * t.element_size()
    for name, h in how.items():
        if h == "pad-vocab":
            params[name] = pad_rows(params[name], cfg.vocab_size)
    for key in plan.redundant_tied:
        path = meta[key][0]
        other = _read_full(files, path, key, bin_cache).to(device)
        emb = params["embedding.weight"]
        if tuple(other.shape) != tuple(emb.shape) and tuple(other.shape) != (cfg.vocab_size_unpadded, cfg.d_model):
            raise CheckpointError(f"{path}: key {key!r}: tied lm_head has shape {tuple(other.shape)}, "
                                  f"the embedding {tuple(emb.shape)}")
        if not torch.equal(other.to(emb.dtype), emb[: other.shape[0]]):
            raise CheckpointError(f"{path}: key {key!r}: the config ties lm_head to the embedding, but the "
                                  f"checkpoint's lm_head differs from {plan.mapping['embedding.weight']!r}")
    for name, src in plan.tied.items():
        params[name] = params[src]
    return LoadedWeights(config=cfg, params=params, tied=plan.tied, files=files, tp_rank=tp_rank, tp_size=tp_size,
                         bytes_read=nbytes, seconds=time.perf_counter() - t0, ignored=plan.ignored)


def _load_bin_mmap(path: Path) -> dict:
    """weights_only torch.load, memory-mapped when the file is in the zip format."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return load_bin(path)  # legacy format or a refused pickle: the reference path names the problem
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{path}: expected a dict of name -> tensor, got {type(sd).__name__}")
    return sd


def _read_st(f, key: str, rule: ShardRule, rank: int, size: int, on_cpu: bool = True) -> torch.Tensor:
    if rule.dim is None or size == 1:
        return f.get_tensor(key)
    if on_cpu:  # the full tensor is a zero-copy mmap view on CPU: narrow it, copy only this rank's rows
        return take_shard(f.get_tensor(key), rule, rank, size).contiguous()
    sl = f.get_slice(key)
    pieces = []
    for a, b in rule.ranges(rank, size):
        pieces.append(sl[a:b] if rule.dim == 0 else sl[:, a:b])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=rule.dim)


def _read_full(files: CheckpointFiles, path: Path, key: str, bin_cache: dict) -> torch.Tensor:
    if files.format == "safetensors":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)
    return bin_cache[path][key]


def _finish(t: torch.Tensor, device: torch.device, dtype) -> torch.Tensor:
    if dtype is not None and t.dtype != dtype:
        t = t.to(device=device, dtype=dtype)
    elif t.device != device:
        t = t.to(device)
    return t.contiguous() if not t.is_contiguous() else t
