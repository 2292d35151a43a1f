"""Engine mixers, one module per family, found through a registry keyed by family name.

Every module of this package (not starting with ``_``) is imported on the first lookup and registers an
:class:`EngineFamily` per family name it serves (the names of ``reference.families``). A family brings:

* ``mixer``: the class that runs one layer's mixer over a mixed prefill/decode step through the op
  contract only (``EngineMixer`` subclass; ``harness.engine.backend.MixerBackend`` builds and calls it);
* ``ops``: the op names that mixer calls (prefill and decode); :func:`required_ops` adds the runner's
  own (``RUNNER_OPS``), and a scenario of the family asks an implementation for exactly these;
* tensor-parallel facts (``check_tp``, ``shard_sections``) the fast loader and ``harness.engine.tp`` cut the
  weights by; the mixer itself runs on its rank's shard (``self.tp``; per-rank sizes from :meth:`EngineMixer.local`,
  row-parallel outputs summed over the ranks by :meth:`EngineMixer.out_proj`);
* for hybrid models: ``attention``, the class that runs one full-attention layer of the family over a mixed
  step (its projections around ``harness.engine.attention.paged_attention``), and ``norm_offset`` (the block
  and final RMSNorms scale by norm_offset + weight).

The engine mixers here and the reference mixers in ``reference/families/`` are independent on purpose:
the oracle must not share code with what it checks. Nothing here imports a reference mixer; the two
sides share only configs, parameter names and state specs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from harness.engine.metadata import decode_rows, prefill_rows
from reference.families import Registry

__all__ = ["EngineFamily", "EngineMixer", "RUNNER_OPS", "register", "get", "names", "required_ops", "all_ops",
           "linear", "prefill_rows", "decode_rows", "cast"]

# Ops the model runner calls for every family: the first block's and the final RMSNorm, and each residual add
# fused with the next norm.
RUNNER_OPS = ("gated_rms_norm", "add_rms_norm")

_REGISTRY = Registry(__name__, "engine family")


@dataclass(frozen=True)
class EngineFamily:
    """One family as the engine runs it (see the module doc).

    ``check_tp(cfg, tp_size)`` raises a ValueError naming ``tp_size`` when the family's weights cannot be
    split `tp_size` ways; ``shard_sections(cfg, parameter)`` gives the cut of one mixer parameter
    (name relative to ``layers.{i}.mixer.``) as ``(dim, ((length, sharded), ...))`` (``dim`` None:
    replicated), or None for a name the family does not have. ``attention(cfg, params, ops, dtype=,
    device=)`` builds a full-attention layer (params relative to ``layers.{i}.attn.``) whose
    ``forward(h, md, kv_pool, layer) -> out`` runs a mixed step. ``tp_cases(cfg, tp_size)`` gives variants of a
    config, ``((label, cfg), ...)``, one per way the family's weights split over `tp_size` ranks (the
    tensor-parallel conformance cases; None: the config itself)."""
    name: str
    mixer: type
    ops: tuple
    check_tp: Callable
    shard_sections: Callable
    attention: type | None = None
    norm_offset: float = 0.0
    tp_cases: Callable | None = None


def register(family: EngineFamily) -> EngineFamily:
    return _REGISTRY.register(family, family.mixer.__module__)


def get(name: str, arg: str = "family") -> EngineFamily:
    """The engine family `name`; a ValueError naming `arg` and the known families otherwise."""
    return _REGISTRY.get(name, arg)


def names() -> tuple[str, ...]:
    return _REGISTRY.names()


def required_ops(name: str) -> tuple[str, ...]:
    """Every op an engine running family `name` calls: the mixer's, then the runner's."""
    fam = get(name)
    return tuple(dict.fromkeys(fam.ops + RUNNER_OPS))


def all_ops() -> tuple[str, ...]:
    """The ops of every registered family (the union of `required_ops`)."""
    return tuple(dict.fromkeys(o for n in names() for o in required_ops(n)))


def linear(x, w, b=None):
    """x w^T (+ b): one aten call (torch's linear), as transformers' nn.Linear computes it."""
    return torch.nn.functional.linear(x, w, b)


def cast(t, dtype):
    """`t` in `dtype`: `t` itself when it is already (no call on an eager step's host path)."""
    return t if t.dtype == dtype else t.to(dtype)


class EngineMixer:
    """What the engine's mixers share: weights cast to the engine dtype (A = -exp(A_log), D and dt
    biases in float32, float64 when the engine runs in float64), and the conv step over a mixed batch.

    Subclasses define ``forward(h, md, conv_states, ssm_states) -> out (T, d_model)``: prefill tokens first
    (``md.num_prefill_tokens``), then decode rows; states are the pool views, updated in place.

    Under tensor parallelism (``tp``: a ``harness.engine.tp.TensorParallel``) `params` are this rank's
    shards (cut as the family's ``shard_sections`` says) and the state views this rank's slices."""

    def __init__(self, cfg, params: dict, ops: dict, *, dtype: torch.dtype, device: torch.device, chunk_size: int,
                 tp=None):
        from harness.engine.tp import SINGLE
        self.tp = tp or SINGLE
        self.cfg = cfg
        self.ops = ops
        self.dtype = dtype
        self.device = device
        self.chunk_size = chunk_size
        self._params = params
        self._pdt = torch.float64 if dtype == torch.float64 else torch.float32
        self.in_w, self.in_b = self.weight("in_proj.weight"), self.weight("in_proj.bias")
        self.out_w, self.out_b = self.weight("out_proj.weight"), self.weight("out_proj.bias")
        self.conv_w = self.conv_weight()
        self.conv_b = self.weight("conv1d.bias")

    def local(self, n: int) -> int:
        """This rank's share of `n` channels / heads / groups split over the ranks."""
        return n // self.tp.size

    def out_proj(self, y: torch.Tensor) -> torch.Tensor:
        """The row-parallel output projection: this rank's partial product, summed over the ranks, then
        the (replicated) bias."""
        out = self.tp.all_reduce(linear(cast(y, self.dtype), self.out_w))
        return out + self.out_b if self.out_b is not None else out

    def conv_weight(self) -> torch.Tensor:
        """The depthwise conv weight (conv_dim, K) (a family whose checkpoints split it overrides this)."""
        return self.weight("conv1d.weight")[:, 0, :].contiguous()

    def weight(self, name: str):
        """Parameter `name` in the activation dtype on the device (None when the layer has none)."""
        p = self._params.get(name)
        return None if p is None else p.detach().to(self.device, self.dtype)

    def state_param(self, name: str):
        """Parameter `name` in float32 (float64 for a float64 engine): A, D, dt biases."""
        return self._params[name].detach().to(self.device, self._pdt)

    def conv(self, xbc, md, conv_states):
        """The causal conv of a step: ``causal_conv1d_varlen`` over the prefill tokens (reading and writing
        their slots' windows), ``causal_conv1d_update`` over the decode rows."""
        P = md.num_prefill_tokens
        parts = []
        if md.num_prefills:
            parts.append(self.ops["causal_conv1d_varlen"](
                prefill_rows(xbc, P), self.conv_w, self.conv_b, conv_states, md.prefill_query_start_loc,
                md.prefill_state_indices, md.prefill_has_initial_states, activation="silu"))
        if md.num_decodes:
            parts.append(self.ops["causal_conv1d_update"](
                decode_rows(xbc, P), conv_states, self.conv_w, self.conv_b, md.decode_state_indices,
                activation="silu"))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, h, md, conv_states, ssm_states):  # pragma: no cover - defined by each family
        raise NotImplementedError
