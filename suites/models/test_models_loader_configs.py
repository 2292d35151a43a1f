"""Loader configs and files: every config value is checked for type and range before anything is allocated
or derived from it, error messages stay short whatever the input, an empty weight file gets a clear error,
and symbolic links are treated alike for every weight file (both loaders)."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from harness.loader import load_weights
from reference.loader import CheckpointError, detect_config, expected_parameters, load_checkpoint

LOADERS = {
    "reference": lambda folder: load_checkpoint(folder).params,
    "harness": lambda folder: load_weights(folder).params,
}
MAX_MESSAGE = 600  # characters; a message must name the problem, not echo the input

HF_M1 = {"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 32,
         "tie_word_embeddings": False}
HF_M2 = {"model_type": "mamba2", "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 32, "num_heads": 8,
         "head_dim": 4, "n_groups": 2, "state_size": 4}
SS_M2 = {"d_model": 16, "n_layer": 2, "vocab_size": 32, "ssm_cfg": {"layer": "Mamba2", "d_state": 4, "headdim": 4,
                                                                     "ngroups": 2}}


def _with(base: dict, **changes) -> dict:
    out = json.loads(json.dumps(base))
    out.update(changes)
    return out


def _refused(cfg: dict, pattern: str) -> str:
    """detect_config refuses `cfg` quickly with a short ValueError matching `pattern`."""
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=pattern) as e:
        detect_config(cfg)
    assert time.perf_counter() - t0 < 1.0
    msg = str(e.value)
    assert len(msg) <= MAX_MESSAGE, f"{len(msg)} characters: {msg[:200]}..."
    return msg


@pytest.mark.parametrize("cfg", [_with(HF_M2, chunk_size=0), _with(HF_M2, chunk_size=-4),
                                 _with(SS_M2, ssm_cfg={**SS_M2["ssm_cfg"], "chunk_size": 0})],
                         ids=["hf-zero", "hf-negative", "state-spaces-zero"])
def test_models_loader_config_chunk_size_positive(cfg):
    """Bad input: a chunk size of 0 or less (the SSD would loop forever or divide by zero) is refused."""
    _refused(cfg, r"chunk_size'?: expected an int in \[1, ")


@pytest.mark.parametrize("eps", [-1.0, math.nan, math.inf, 0.0, "1e-5", True])
def test_models_loader_config_epsilon_finite_positive(eps):
    """Bad input: a layer-norm epsilon that is negative, NaN, infinite, zero or not a number is refused."""
    _refused(_with(HF_M1, layer_norm_epsilon=eps), r"layer_norm_epsilon'?: expected a finite float")


def test_models_loader_config_integral_sizes():
    """Bad input: a fractional size (intermediate_size 32.7) is refused rather than truncated; an integral
    float (32.0) is a size."""
    _refused(_with(HF_M1, intermediate_size=32.7), r"intermediate_size'?: expected an int")
    assert detect_config(_with(HF_M1, intermediate_size=32.0)).d_inner == 32


@pytest.mark.parametrize("cfg, pattern", [
    (_with(HF_M1, model_type=["mamba"]), r"model_type: expected one of"),
    (_with({k: v for k, v in HF_M1.items() if k != "model_type"}, architectures=[["MambaForCausalLM"]]),
     r"architectures: expected a list of strings"),
    (_with({k: v for k, v in HF_M1.items() if k != "model_type"}, architectures="MambaForCausalLM"),
     r"architectures: expected a list of strings"),
    (_with(HF_M1, hidden_act=["silu"]), r"hidden_act: expected one of \['silu'\]"),
    (_with(HF_M1, time_step_rank=["auto"]), r"time_step_rank'?: expected an int"),
    (_with(SS_M2, ssm_cfg={**SS_M2["ssm_cfg"], "layer": ["Mamba2"]}), r"ssm_cfg.layer: expected one of"),
], ids=["model_type", "architectures-nested", "architectures-string", "hidden_act", "time_step_rank", "ssm-layer"])
def test_models_loader_config_list_where_string_belongs(cfg, pattern):
    """Bad input: a list (or a string) where the other belongs is a ValueError naming the key, not a
    TypeError from a dict lookup."""
    _refused(cfg, pattern)


def test_models_loader_config_sizes_capped():
    """Bad input: sizes no real checkpoint has are refused before anything is derived from them: a vocabulary
    padding multiple of 1e12 (a 64 TB embedding) and 10^7 or 10^5 layers (minutes of name planning, a
    message of megabytes)."""
    _refused(_with(HF_M1, pad_vocab_size_multiple=10**12), r"pad_vocab_size_multiple'?: expected an int in")
    _refused(_with(SS_M2, pad_vocab_size_multiple=1e12), r"pad_vocab_size_multiple'?: expected an int in")
    for n in (10**7, 10**5):
        _refused(_with(HF_M1, num_hidden_layers=n), r"num_hidden_layers'?: expected an int in \[1, ")
        _refused(_with(SS_M2, n_layer=n), r"n_layer'?: expected an int in \[1, ")
    _refused(_with(HF_M1, hidden_size=1 << 40), r"hidden_size'?: expected an int in")
    _refused(_with(HF_M1, vocab_size=1 << 40), r"vocab_size'?: expected an int in")


@pytest.mark.parametrize("cfg", [_with(HF_M1, hidden_size=list(range(100000))),
                                 _with(HF_M1, model_type="x" * 100000),
                                 _with(SS_M2, ssm_cfg={**SS_M2["ssm_cfg"], **{f"k{i}": 1 for i in range(10000)}}),
                                 {f"key{i}": i for i in range(100000)}],
                         ids=["huge-list-value", "huge-string", "many-unknown-ssm-keys", "many-keys"])
def test_models_loader_config_messages_bounded(cfg):
    """Bad input: whatever the size of the offending value, the error message stays short."""
    _refused(cfg, r".")


# ------------------------------------------------------------------------------------------------
# checkpoints on disk

def _params(cfg_dict: dict, seed: int = 0) -> dict:
    cfg = detect_config(cfg_dict)
    g = torch.Generator().manual_seed(seed)
    return {("lm_head.weight" if n == "lm_head.weight" else
             "backbone." + n.replace("embedding.weight", "embeddings.weight")): torch.randn(s, generator=g)
            for n, s in expected_parameters(cfg).items()}


def _write(folder: Path, cfg_dict: dict, shards: int = 1) -> Path:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    sd = _params(cfg_dict)
    if shards == 1:
        save_file(sd, str(folder / "model.safetensors"))
        return folder
    keys, wm = sorted(sd), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in keys[i::shards]}, str(folder / name))
        wm.update({k: name for k in keys[i::shards]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return folder


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_config_layers_message_bounded(loader, tmp_path):
    """Bad input: a checkpoint of 2 layers under a config of 10^5 layers, and one of 1000 layers (a size
    the config allows), fail quickly with a short message (the missing names are listed, up to a few)."""
    folder = _write(tmp_path / "ck", HF_M1)
    for n, pattern in ((10**5, r"num_hidden_layers"), (1000, r"missing parameters \[.*\.\.\. \(\d+ more\)\]")):
        (folder / "config.json").write_text(json.dumps(_with(HF_M1, num_hidden_layers=n)))
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=pattern) as e:
            LOADERS[loader](folder)
        assert time.perf_counter() - t0 < 10.0
        assert len(str(e.value)) <= 2 * MAX_MESSAGE, f"{len(str(e.value))} characters"


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_empty_bin(loader, tmp_path):
    """Bad input: an empty pytorch_model.bin fails with the file's CheckpointError, not an IndexError
    from the message code."""
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_M1))
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot be read as a weights-only torch"):
        LOADERS[loader](folder)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_symlinks_alike_for_every_weight_file(loader, tmp_path):
    """Symbolic links are treated alike for a single weight file and for shards: a checkpoint folder whose
    files link outside it (as a Hugging Face cache snapshot links into its blob store) loads the same
    tensors either way; an index path that leaves the folder as written is still refused."""
    ref = load_checkpoint(_write(tmp_path / "plain", HF_M2)).params
    for shards in (1, 2):
        blobs = _write(tmp_path / f"blobs{shards}", HF_M2, shards)
        snap = tmp_path / f"snapshot{shards}"
        snap.mkdir()
        for f in blobs.iterdir():
            os.symlink(f.resolve(), snap / f.name)
        got = LOADERS[loader](snap)
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
    idx = tmp_path / "snapshot2" / "model.safetensors.index.json"
    wm = json.loads(idx.read_text())["weight_map"]
    idx.unlink()
    idx.write_text(json.dumps({"weight_map": {k: "../blobs2/" + v for k, v in wm.items()}}))
    with pytest.raises(ValueError, match=r"shard path '\.\./blobs2/model-0000\d-of-00002\.safetensors' escapes"):
        LOADERS[loader](tmp_path / "snapshot2")
