"""Mixer families of the reference: one module per family, found through a registry keyed by family name.

Every module of this package (not starting with ``_``) is imported on the first lookup and registers
its families with :func:`register`; a new family is a new file here (plus its engine mixer in
``harness/engine/families/``), nothing else changes. Registered names are what ``ModelConfig.family``
holds; one module may register variants of one mixer (``mamba1.py``: ``mamba1`` and ``falcon_mamba``).

A family (a :class:`Family` subclass) holds everything the reference knows about its mixer:

* its config fields (a frozen dataclass, ``ModelConfig.mixer``) and how they are read from an HF
  ``config.json`` (``hf_model_types`` / ``hf_architectures`` select the family) or a raw state-spaces one
  (``state_spaces_layers`` selects it by ``ssm_cfg.layer``), and back (``to_hf``);
* its mixer parameters: names (the anchored checkpoint-name rules are built from them) and shapes;
* its per-layer state: the ``reference.cache`` spec an engine's pool allocates;
* its reference mixer (forward over packed varlen tokens and the one-token step);
* config builders for tests and benchmarks (``tiny_config``, ``build_config``).

The reference mixers here and the engine's mixers in ``harness/engine/families/`` are independent on
purpose: the oracle must not share code with what it checks. The engine imports nothing of a reference
mixer's forward; both sides share only configs, parameter names and state specs.
"""
from __future__ import annotations

import importlib
import pkgutil

from reference.validate import fail

__all__ = ["Family", "Registry", "register", "get", "names", "families"]


class Registry:
    """Objects with a ``name`` registered by the modules of one package, discovered on first lookup.

    Every module of `package` whose name does not start with ``_`` is imported once; a module registers
    its objects at import. Order: by module name, then in the order a module registered them."""

    def __init__(self, package: str, what: str):
        self.package = package
        self.what = what
        self._items: dict[str, tuple] = {}
        self._discovered = False

    def register(self, obj, module: str | None = None):
        """Add `obj` under `obj.name`; `module` (default: the module of obj's class) orders the names."""
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            fail(f"{self.what}.name", "a non-empty string", repr(name))
        if name in self._items and self._items[name][2] is not obj:
            fail(f"{self.what}.name", f"a name not registered yet (module {self._items[name][0]} has it)",
                 repr(name))
        module = module or getattr(obj, "__module__", "") or ""
        self._items.setdefault(name, (module, len(self._items), obj))
        return obj

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        pkg = importlib.import_module(self.package)
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            if not m.name.startswith("_"):
                importlib.import_module(f"{self.package}.{m.name}")

    def names(self) -> tuple[str, ...]:
        self._discover()
        return tuple(n for n, _ in sorted(self._items.items(), key=lambda kv: kv[1][:2]))

    def get(self, name: str, arg: str = "family"):
        self._discover()
        if not isinstance(name, str) or name not in self._items:
            fail(arg, f"one of {list(self.names())}", repr(name)[:80])
        return self._items[name][2]

    def all(self) -> list:
        return [self.get(n) for n in self.names()]


_REGISTRY = Registry(__name__, "family")


def register(family: "Family") -> "Family":
    """Add a family (called by the family's module at import)."""
    return _REGISTRY.register(family)


def get(name: str, arg: str = "family") -> "Family":
    """The registered family `name`; a ValueError (naming `arg` and the known ones) otherwise."""
    return _REGISTRY.get(name, arg)


def names() -> tuple[str, ...]:
    """Every registered family name."""
    return _REGISTRY.names()


def families() -> list["Family"]:
    return _REGISTRY.all()


class Family:
    """The interface of a family module (see the package doc). Subclasses set the class attributes and
    implement the methods; an instance is registered per family name."""

    name: str = ""
    fields: type = object                 # frozen dataclass of the family's own config fields
    hf_model_types: tuple = ()            # HF config.json `model_type` values of this family
    hf_architectures: tuple = ()          # HF config.json `architectures` entries of this family
    hf_tie_default: bool = True           # tie_word_embeddings when the HF config does not say
    state_spaces_layers: tuple = ()       # raw state-spaces `ssm_cfg.layer` values of this family
    state_spaces_keys: frozenset = frozenset()  # `ssm_cfg` keys understood (others are refused)
    mixer_parameter_names: tuple = ()     # every mixer parameter name a checkpoint may hold
    ignored_mixer_names: tuple = ()       # mixer keys checkpoints carry that are not parameters
    typical_vocab_size: int = 32768       # vocabulary of the family's best-known checkpoints
    build_fields: tuple = ()              # the family's keyword fields `build_config` accepts
    whole_models: bool = True             # the reference builds whole language models of this family
    norm_offset: float = 0.0              # the block and final RMSNorms scale by (norm_offset + weight)
    own_names: bool = False               # checkpoint keys map through `map_key` (else the loader's rules)

    # config ----------------------------------------------------------------------------------
    def from_hf(self, raw: dict, common: dict, where):
        """The ModelConfig of an HF config dict; `common` holds the checked family-independent fields."""
        raise NotImplementedError

    def from_state_spaces(self, raw: dict, ssm: dict, common: dict, where):
        """The ModelConfig of a raw state-spaces config dict (`ssm` is its `ssm_cfg`)."""
        raise NotImplementedError

    def to_hf(self, cfg) -> dict:
        """An HF config.json dict describing `cfg` (`model_type` and `architectures` included)."""
        raise NotImplementedError

    def build_config(self, *, d_model: int, n_layer: int, vocab: int, d_conv: int = 4, expand: int = 2,
                     chunk_size: int = 256, pad_vocab_size_multiple: int = 1, tie_embeddings: bool = False,
                     **fields):
        """A ModelConfig from sizes (the family's `build_fields` as keywords; unset ones take the
        defaults of the family's published checkpoints)."""
        raise NotImplementedError

    def tiny_config(self, *, d_model: int = 16, n_layer: int = 2, vocab: int = 60, d_state: int | None = None,
                    d_conv: int = 4, chunk_size: int = 8):
        """A tiny model config for tests (vocab padded to a multiple of 8, so padding rows exist)."""
        raise NotImplementedError

    def summary(self, cfg) -> dict:
        """The family's own sizes of `cfg`, for records and reports."""
        raise NotImplementedError

    # parameters and state ----------------------------------------------------------------------
    def parameter_shapes(self, cfg) -> dict[str, tuple]:
        """Shapes of one layer's mixer parameters, named as in HF / state-spaces checkpoints."""
        raise NotImplementedError

    def state_spec(self, cfg, *, conv_dtype, recurrent_dtype, tp_size: int = 1):
        """The `reference.cache` spec of one layer's state."""
        raise NotImplementedError

    # decoder layers (hybrid models) -------------------------------------------------------------
    def layer_kinds(self, cfg) -> tuple:
        """Per decoder layer: ``"mixer"`` (the family's mixer, with conv and recurrent state) or
        ``"attention"`` (a full causal softmax attention with a KV cache). Default: mixers only."""
        return ("mixer",) * cfg.n_layer

    def layer_parameter_shapes(self, cfg, layer: int) -> dict[str, tuple]:
        """Shapes of decoder layer `layer`'s parameters, names relative to ``layers.{layer}.``. Default: the
        block norm and the mixer (``norm.weight``, ``mixer.<name>``). A hybrid family adds ``attn.<name>``
        for attention layers and ``mlp_norm.weight`` / ``mlp.<name>`` for its MLP sublayers."""
        return {"norm.weight": (cfg.d_model,), **{f"mixer.{k}": s for k, s in self.parameter_shapes(cfg).items()}}

    def map_key(self, cfg, key: str) -> str | None:
        """Our parameter name of checkpoint key `key` (families with ``own_names``), None when no rule
        matches the whole key."""
        raise NotImplementedError

    def ignored_key(self, cfg, key: str) -> bool:
        """A checkpoint key that is no parameter of the model (families with ``own_names``)."""
        return False

    def kv_spec(self, cfg, dtype):
        """The `reference.cache.KVSpec` of the family's attention layers (None: no attention layers)."""
        return None

    def make_attention(self, cfg, params: dict, *, dtype, ops, device):
        """The reference attention of one layer (params keyed relative to `layers.{i}.attn.`)."""
        raise NotImplementedError

    # reference mixer ----------------------------------------------------------------------------
    def make_mixer(self, cfg, params: dict, *, dtype, ops, device):
        """The reference mixer of one layer (params keyed relative to `layers.{i}.mixer.`)."""
        raise NotImplementedError


def common_fields(*, d_model: int, n_layer: int, vocab: int, d_conv: int, pad_vocab_size_multiple: int,
                  tie_embeddings: bool, chunk_size: int, conv_bias: bool = True, bias: bool = False,
                  norm_eps: float = 1e-5) -> dict:
    """The family-independent ModelConfig fields of a built (not parsed) config."""
    from reference.config import pad_vocab
    return dict(d_model=d_model, n_layer=n_layer, vocab_size=pad_vocab(vocab, pad_vocab_size_multiple),
                vocab_size_unpadded=vocab, pad_vocab_size_multiple=max(pad_vocab_size_multiple, 1), d_conv=d_conv,
                conv_bias=conv_bias, bias=bias, norm_eps=norm_eps, residual_in_fp32=True,
                tie_embeddings=tie_embeddings, source="hf", chunk_size=chunk_size)


def add_bias_shapes(cfg, shapes: dict, projections=("in_proj", "out_proj")) -> dict:
    """`conv1d.bias` (when `cfg.conv_bias`) and the projections' biases (when `cfg.bias`)."""
    if cfg.conv_bias:
        shapes["conv1d.bias"] = (cfg.conv_dim,)
    if cfg.bias:
        for p in projections:
            shapes[f"{p}.bias"] = (shapes[f"{p}.weight"][0],)
    return shapes
