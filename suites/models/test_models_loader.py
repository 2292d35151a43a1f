"""Loaders: every checkpoint format loads, the harness loader agrees with the reference loader (tensor by
tensor, tensor-parallel shards re-assembled), every kind of bad checkpoint gets its clear error, and the
name mapping is a bijection between well-formed checkpoint keys and our parameter names.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import example, assume, given, strategies as st

from harness.loader import assemble_shards, load_weights, shard_rule
from reference.loader import (expected_parameters, load_checkpoint, map_name, plan_names, detect_config,
                              CheckpointError)

from models_hf_oracle import Dims, hf_model, quiet_transformers, write_state_spaces

LOADERS = {
    "reference": lambda folder: load_checkpoint(folder).params,
    "harness": lambda folder: load_weights(folder).params,
}


# ------------------------------------------------------------------------------------------------
# checkpoint writers

def _hf_state_dict(model) -> dict:
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _write_hf_bin(model, folder: Path, shards: int = 1, prefix: str = "backbone.") -> Path:
    """An HF-named checkpoint as pytorch_model.bin (or a sharded .bin with an index)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(folder / "config.json"))
    sd = {(prefix + k[len("backbone."):] if k.startswith("backbone.") else k): v
          for k, v in _hf_state_dict(model).items()}
    if shards == 1:
        torch.save(sd, folder / "pytorch_model.bin")
        return folder
    keys = sorted(sd)
    wm = {}
    for i in range(shards):
        part = keys[i::shards]
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: sd[k] for k in part}, folder / name)
        wm.update({k: name for k in part})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return folder


def _reshard_safetensors(folder: Path, shards: int) -> None:
    """Split a single model.safetensors into `shards` files plus the HF index, as save_pretrained would."""
    from safetensors.torch import load_file, save_file
    single = folder / "model.safetensors"
    sd = load_file(str(single))
    keys = sorted(sd)
    wm = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: sd[k].contiguous() for k in part}, str(folder / name), metadata={"format": "pt"})
        wm.update({k: name for k in part})
    single.unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def _write_variant(model, d: Dims, folder: Path, variant: str) -> Path:
    folder = Path(folder)
    if variant == "hf-safetensors":
        model.save_pretrained(str(folder))
    elif variant == "hf-sharded-safetensors":
        model.save_pretrained(str(folder), max_shard_size="8KB")
        if not (folder / "model.safetensors.index.json").is_file():
            _reshard_safetensors(folder, shards=2)  # tiny models fit one 8KB shard: split by hand
        assert (folder / "model.safetensors.index.json").is_file()
    elif variant == "hf-bin":
        _write_hf_bin(model, folder)
    elif variant == "hf-sharded-bin":
        _write_hf_bin(model, folder, shards=3)
    elif variant == "hf-model-prefix-bin":
        _write_hf_bin(model, folder, prefix="model.")
    elif variant == "ss-bin-padded":
        write_state_spaces(model, d, folder, fmt="bin", pad_in_file=True)
    elif variant == "ss-safetensors-unpadded":
        write_state_spaces(model, d, folder, fmt="safetensors", pad_in_file=False)
    else:
        raise AssertionError(variant)
    return folder


VARIANTS = ["hf-safetensors", "hf-sharded-safetensors", "hf-bin", "hf-sharded-bin", "hf-model-prefix-bin",
            "ss-bin-padded", "ss-safetensors-unpadded"]


def _expected_from_model(model, cfg) -> dict:
    """The HF model's own tensors under our names (the ground truth for every variant)."""
    out = {}
    for k, v in model.state_dict().items():
        name = map_name(k)
        if name is not None:
            out[name] = v.detach()
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embedding.weight"]
    return out


@st.composite
def small_dims(draw):
    family = draw(st.sampled_from(["mamba1", "falcon_mamba", "mamba2"]))
    d_model = draw(st.sampled_from([8, 16]))
    kw = dict(family=family, d_model=d_model, n_layer=2, vocab=draw(st.integers(30, 70)),
              d_state=draw(st.sampled_from([2, 4])), d_conv=draw(st.integers(2, 4)), tie=draw(st.booleans()),
              bias=draw(st.booleans()), conv_bias=draw(st.booleans()))
    if family == "mamba2":
        kw.update(head_dim=4, n_groups=draw(st.sampled_from([1, 2, 4])))
    return Dims(**kw)


@given(d=small_dims(), variant=st.sampled_from(VARIANTS), seed=st.integers(0, 1000),
       tp=st.sampled_from([1, 2, 4]))
# Regression (CI, 2026-11-29): a model smaller than one 8KB shard was saved unsharded.
@example(d=Dims(family="mamba1", d_model=8, n_layer=2, vocab=30, d_state=2, d_conv=2, tie=False, bias=False,
                conv_bias=False), variant="hf-sharded-safetensors", seed=0, tp=1)
def test_models_loader_formats_agree(d, variant, seed, tp):
    """Property: every checkpoint format (HF safetensors single/sharded, HF .bin single/sharded,
    `model.` prefix, state-spaces .bin with padded vocab, state-spaces safetensors with unpadded vocab)
    loads with the reference loader to exactly the transformers model's tensors (vocab rows padded
    with zeros, lm_head tied where configured); the harness loader gives bit-identical tensors, and
    its tensor-parallel shards re-assemble to them for every valid TP size."""
    assume(not (d.family == "falcon_mamba" and variant.startswith("ss-")))
    quiet_transformers()
    model = hf_model(d, seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = _write_variant(model, d, Path(tmp) / "ck", variant)
        ref = load_checkpoint(folder)
        cfg = ref.config
        expected = _expected_from_model(model, cfg)
        assert set(ref.params) == set(expected_parameters(cfg))
        for name, t in ref.params.items():
            e = expected[name]
            if t.shape[0] != e.shape[0] and name in ("embedding.weight", "lm_head.weight"):
                assert variant.startswith("ss-") and t.shape[0] == cfg.vocab_size
                assert torch.equal(t[e.shape[0]:], torch.zeros_like(t[e.shape[0]:])), f"{name}: padding not zero"
                t = t[: e.shape[0]]
            assert torch.equal(t, e), f"{variant}: {name} differs from the transformers model's tensor"
        if cfg.tie_embeddings:
            assert ref.params["lm_head.weight"] is ref.params["embedding.weight"]
        fast = load_weights(folder)
        assert set(fast.params) == set(ref.params)
        for name in ref.params:
            assert torch.equal(fast.params[name], ref.params[name]), f"harness loader: {name} differs"
        heads = cfg.num_heads if cfg.family == "mamba2" else cfg.d_inner
        if heads % tp == 0 and (cfg.family != "mamba2" or cfg.n_groups % tp == 0 or cfg.n_groups == 1):
            shards = [load_weights(folder, tp_rank=r, tp_size=tp) for r in range(tp)]
            for name in ref.params:
                rule = shard_rule(cfg, name)
                pieces = [s.params[name] for s in shards]
                if rule.dim is not None and tp > 1:
                    assert pieces[0].shape[rule.dim] < ref.params[name].shape[rule.dim], f"{name} not sharded"
                assert torch.equal(assemble_shards(pieces, rule), ref.params[name]), f"TP {tp}: {name}"
        else:
            with pytest.raises(ValueError, match="tp_size"):
                load_weights(folder, tp_rank=0, tp_size=tp)


def test_models_loader_dtype_and_device():
    """Property: the harness loader converts every tensor to the requested dtype on the requested device."""
    quiet_transformers()
    d = Dims(family="mamba2", d_model=16, vocab=40, head_dim=4, n_groups=2)
    model = hf_model(d, 0)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        w = load_weights(tmp, device="cpu", dtype=torch.bfloat16)
        ref = load_checkpoint(tmp, dtype=torch.bfloat16)
    for name, t in w.params.items():
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu", name
        assert torch.equal(t, ref.params[name]), name


# ------------------------------------------------------------------------------------------------
# bad checkpoints: one test each, both loaders

@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    quiet_transformers()
    d = Dims(family="mamba2", d_model=16, vocab=40, head_dim=4, n_groups=2, tie=False)
    model = hf_model(d, 1)
    root = tmp_path_factory.mktemp("good")
    model.save_pretrained(str(root / "hf"))
    write_state_spaces(model, d, root / "ss", fmt="bin", pad_in_file=True)
    return root


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _rewrite_safetensors(folder: Path, fn):
    from safetensors.torch import load_file, save_file
    sd = load_file(str(folder / "model.safetensors"))
    fn(sd)
    save_file(sd, str(folder / "model.safetensors"))


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_missing_key(loader, good_checkpoint, tmp_path):
    """Bad input: a checkpoint lacking a parameter fails naming the file and the missing parameter."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    _rewrite_safetensors(f, lambda sd: sd.pop("backbone.layers.1.mixer.dt_bias"))
    with pytest.raises(ValueError, match=r"(?s)ck.*missing parameters.*layers\.1\.mixer\.dt_bias"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_unexpected_key(loader, good_checkpoint, tmp_path):
    """Bad input: a key no rule maps (or one for a layer the config doesn't have) is an error, never dropped."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    _rewrite_safetensors(f, lambda sd: sd.update({"backbone.layers.2.norm.weight": torch.ones(16),
                                                 "backbone.extra_embeddings.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected keys.*backbone\.extra_embeddings\.weight.*backbone\.layers\.2\.norm\.weight"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_wrong_shape(loader, good_checkpoint, tmp_path):
    """Bad input: a tensor of the wrong shape fails naming the key, the expected and the actual shape."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    _rewrite_safetensors(f, lambda sd: sd.update({"backbone.layers.0.mixer.A_log": torch.zeros(7)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: key 'backbone\.layers\.0\.mixer\.A_log'.*expected shape \(8,\), got \(7,\)"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_wrong_dtype(loader, good_checkpoint, tmp_path):
    """Bad input: an integer tensor where a floating-point weight belongs fails naming the key and dtype."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    _rewrite_safetensors(f, lambda sd: sd.update({"backbone.norm_f.weight": torch.ones(16, dtype=torch.int32)}))
    with pytest.raises(ValueError, match=r"key 'backbone\.norm_f\.weight': expected a floating-point tensor, got dtype torch\.int32"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_truncated_safetensors(loader, good_checkpoint, tmp_path):
    """Bad input: a truncated safetensors file fails naming the file."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"ck/model\.safetensors: not a readable safetensors file"):
        LOADERS[loader](f)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_code_carrying_pickle(loader, good_checkpoint, tmp_path):
    """Bad input: a .bin whose pickle carries code is refused by weights_only loading, with a clear error."""
    f = _copy(good_checkpoint / "ss", tmp_path / "ck")
    sd = torch.load(f / "pytorch_model.bin", weights_only=True)
    sd["evil"] = _Evil()
    torch.save(sd, f / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: cannot be read as a weights-only torch checkpoint"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_shard_outside_folder(loader, good_checkpoint, tmp_path):
    """Bad input: an index naming a shard outside the checkpoint folder is refused."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    (tmp_path / "outside.safetensors").write_bytes((f / "model.safetensors").read_bytes())
    from safetensors import safe_open
    with safe_open(str(f / "model.safetensors"), "pt") as s:
        keys = list(s.keys())
    (f / "model.safetensors").unlink()
    (f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "../outside.safetensors" for k in keys}}))
    with pytest.raises(ValueError, match=r"index\.json: shard path '\.\./outside\.safetensors' escapes the checkpoint folder"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_unknown_config(loader, good_checkpoint, tmp_path):
    """Bad input: a config that is neither an HF Mamba config nor a raw state-spaces one fails clearly."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    (f / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    with pytest.raises(ValueError, match=r"config\.json: model_type: expected one of .*got 'llama'"):
        LOADERS[loader](f)
    (f / "config.json").write_text(json.dumps({"hidden_dim": 16, "layers": 2}))
    with pytest.raises(ValueError, match=r"config\.json: not a known Mamba config"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_unexplained_vocab(loader, good_checkpoint, tmp_path):
    """Bad input: embedding rows that vocab padding cannot explain fail naming the key and the numbers."""
    f = _copy(good_checkpoint / "ss", tmp_path / "ck")
    cfg = json.loads((f / "config.json").read_text())
    cfg["vocab_size"] = 30  # padded to 32, but the file has 40 rows
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"key 'backbone\.embedding\.weight': vocabulary of 40 rows cannot be explained by vocab_size 30 padded to a multiple of 8 \(= 32\)"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_two_keys_one_parameter(loader, good_checkpoint, tmp_path):
    """Bad input: two keys that map to one parameter (`backbone.` and `model.` prefixes mixed) fail
    naming both keys rather than one silently winning."""
    f = _copy(good_checkpoint / "hf", tmp_path / "ck")
    _rewrite_safetensors(f, lambda sd: sd.update({"model.norm_f.weight": sd["backbone.norm_f.weight"] * 2}))
    with pytest.raises(ValueError, match=r"'backbone\.norm_f\.weight' and 'model\.norm_f\.weight' -> 'norm_f\.weight'"):
        LOADERS[loader](f)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_models_loader_tied_head_differs(loader, good_checkpoint, tmp_path):
    """Bad input: a config that ties lm_head while the checkpoint carries a different lm_head fails."""
    f = _copy(good_checkpoint / "ss", tmp_path / "ck")
    cfg = json.loads((f / "config.json").read_text())
    cfg["tie_embeddings"] = True
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"key 'lm_head\.weight': the config ties lm_head to the embedding"):
        LOADERS[loader](f)


# ------------------------------------------------------------------------------------------------
# the name mapping

_PREFIXES = ("", "backbone.", "model.")
_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
          "dt_proj.bias", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight", "out_proj.bias")


def _spellings(name: str) -> set[str]:
    """Every well-formed checkpoint key for one of our names (written independently of the loader)."""
    if name == "lm_head.weight":
        return {"lm_head.weight"}
    if name == "embedding.weight":
        return {p + e + ".weight" for p in _PREFIXES for e in ("embedding", "embeddings")}
    return {p + name for p in _PREFIXES}


def _our_names(max_layer=12):
    layer = st.integers(0, max_layer)
    return st.one_of(
        st.sampled_from(["embedding.weight", "norm_f.weight", "lm_head.weight"]),
        layer.map(lambda i: f"layers.{i}.norm.weight"),
        st.tuples(layer, st.sampled_from(_MIXER)).map(lambda t: f"layers.{t[0]}.mixer.{t[1]}"))


_JUNK = ["embeddings", "embedding", "norm_f", "backbone.", "model.", ".", "_", "x", "layers.", "0", "01",
         "mixer.", "weight", "lm_head.", "A_log", "D", ".bias", " "]


@st.composite
def mangled_keys(draw):
    name = draw(_our_names())
    key = draw(st.sampled_from(sorted(_spellings(name))))
    op = draw(st.sampled_from(["insert", "delete", "replace", "concat"]))
    if op == "concat":
        other = draw(st.sampled_from(sorted(_spellings(draw(_our_names())))))
        return key + draw(st.sampled_from(["", ".", "_"])) + other
    pos = draw(st.integers(0, len(key)))
    if op == "insert":
        return key[:pos] + draw(st.sampled_from(_JUNK)) + key[pos:]
    if op == "delete":
        n = draw(st.integers(1, 4))
        return key[:pos] + key[pos + n:]
    return key[:pos] + draw(st.sampled_from(_JUNK)) + key[pos + draw(st.integers(1, 6)):]


@given(name=_our_names())
def test_models_loader_mapping_accepts_every_spelling(name):
    """Property: every well-formed spelling of a parameter (any prefix `backbone.`/`model.`/none,
    `embedding`/`embeddings`) maps to exactly that parameter."""
    for key in _spellings(name):
        assert map_name(key) == name, f"{key!r} -> {map_name(key)!r}, expected {name!r}"


@given(key=mangled_keys())
def test_models_loader_mapping_never_mangles(key):
    """Property: a key maps to a parameter only if it is exactly one of that parameter's well-formed
    spellings; a key containing a valid name by substring accident (e.g. `embeddings` in the middle,
    `norm_f` inside another word, a second prefix, a mixer name with a suffix) maps to nothing."""
    name = map_name(key)
    assert name is None or key in _spellings(name), f"{key!r} was mapped to {name!r} by substring accident"


_PLAN_CFG = {"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 3, "vocab_size": 32,
             "use_bias": True, "tie_word_embeddings": False}


@st.composite
def key_sets(draw):
    """A complete checkpoint (each parameter under a random spelling) plus 0..4 extra keys."""
    cfg = detect_config(_PLAN_CFG)
    keys = {draw(st.sampled_from(sorted(_spellings(n)))) for n in expected_parameters(cfg)}
    extra = draw(st.lists(st.one_of(mangled_keys(), _our_names(4).flatmap(lambda n: st.sampled_from(sorted(_spellings(n))))),
                          max_size=4))
    return sorted(keys | set(extra))


@given(keys=key_sets())
def test_models_loader_plan_is_injective(keys):
    """Property: for any set of checkpoint keys, name planning never sends two keys to one parameter:
    it either raises naming every colliding pair and every unexpected key, or maps each parameter
    from exactly one key (and then every key was used)."""
    cfg = detect_config(_PLAN_CFG)
    expected = expected_parameters(cfg)
    names = [map_name(k) for k in keys]
    try:
        plan = plan_names(cfg, keys, "ck")
    except CheckpointError as e:
        msg = str(e)
        dups = {n for n in names if n is not None and names.count(n) > 1 and n in expected}
        for n in dups:
            assert f"-> {n!r}" in msg, f"collision on {n!r} not named: {msg}"
        for k, n in zip(keys, names):
            if n is None or n not in expected:
                assert repr(k) in msg, f"unexpected key {k!r} not named: {msg}"
        assert dups or any(n is None or n not in expected for n in names), f"raised without a cause: {msg}"
        return
    assert sorted(plan.mapping.values()) == sorted(keys)
    assert set(plan.mapping) == set(expected)
    for name, key in plan.mapping.items():
        assert map_name(key) == name
