"""Mixer backend: one SSM layer's forward over a MIXED batch, through the op contract only.

A step's tokens are packed prefill-first (``md.num_prefill_tokens`` prefill tokens of
``md.num_prefills`` requests, then ``md.num_decodes`` decode rows of one token each), described by a
:class:`harness.engine.metadata.MambaMetadata`. The backend calls ONLY the ops of one
:class:`harness.impls.Impl` (see ``harness.ops``) plus torch matmuls for the projections. Which ops a
family's mixer calls, and how, is its module's business in ``harness/engine/families/`` (e.g. Mamba-1:
``causal_conv1d_varlen`` / ``causal_conv1d_update``, ``selective_scan_varlen`` for prefill tokens and
``selective_state_update`` for decode rows); this module is the family-independent contract.

The state pools of the layer (``pool.conv(layer)`` (num_slots, conv_dim, K-1) and
``pool.recurrent(layer)`` (num_slots, ...), possibly strided page-major views) are handed to the
ops as they are: the ops read the slot named by ``md.state_indices`` where ``has_initial_states``
says so and write the final states back in place; pad rows (PAD_SLOT_ID) are skipped by the ops.

Return contract (the engine's 3-tuple, bug class 2)::

    out, conv_states, ssm_states = backend.forward(hidden, md, conv_states, ssm_states)

``out`` (T, d_model) in the activation dtype; ``conv_states`` / ``ssm_states`` are the SAME pool
views that came in, updated in place (returned so the caller can rebind them, as engines do).
The caller must unpack exactly three values.

Weights come from a reference mixer's params dict (names relative to ``layers.{i}.mixer.``, as in
``reference.loader.mixer_parameter_shapes``) and are cast to the backend's dtype; A = -exp(A_log),
D, dt_bias stay in float32 (float64 when the backend runs in float64).

Tensor parallelism (``tp``, a ``harness.engine.tp.TensorParallel`` of size > 1): the layer's parameters may
come whole (this rank's shard is cut here) or already cut for the rank; the states are the rank's slices
(``reference.cache`` specs with ``tp_size``); ``out`` is whole on every rank (the row-parallel output is
summed over the ranks).
"""
from __future__ import annotations

import torch

from harness.engine import families
from reference.validate import fail

__all__ = ["MixerBackend", "make_backend"]


class MixerBackend:
    """One layer's mixer forward over a mixed prefill/decode batch (see module doc).

    Args:
      cfg: a ``reference.loader.ModelConfig`` of a registered family.
      params: the layer's mixer parameters (names as ``reference.loader.mixer_parameter_shapes``).
      impl: an ``Impl`` providing the ops the family needs (``harness.engine.families.required_ops``).
      dtype: activation / weight dtype.
      device: where the weights go.
      chunk_size: the SSD chunk size passed to chunked prefill ops (default ``cfg.chunk_size``).
      tp: a ``harness.engine.tp.TensorParallel`` (default: one rank).
    """

    def __init__(self, cfg, params: dict, impl, *, dtype=torch.float32, device="cpu", chunk_size: int | None = None,
                 tp=None):
        from harness.engine.tp import SINGLE, TensorParallel, shard_mixer_params
        from reference.loader import mixer_parameter_shapes
        family = families.get(cfg.family, "cfg.family")
        tp = SINGLE if tp is None else tp
        if not isinstance(tp, TensorParallel):
            fail("tp", "None or a harness.engine.tp.TensorParallel", type(tp).__name__)
        family.check_tp(cfg, tp.size)
        if tp.size > 1:
            params, shapes = shard_mixer_params(cfg, params, tp)
        else:
            shapes = mixer_parameter_shapes(cfg)
        missing = sorted(set(shapes) - set(params))
        if missing:
            fail("params", f"the mixer parameters {sorted(shapes)}", f"missing {missing}")
        for k, s in shapes.items():
            if tuple(params[k].shape) != s:
                fail(f"params[{k!r}]", f"shape {s}", f"shape {tuple(params[k].shape)}")
        need = list(families.required_ops(cfg.family))
        lacking = [o for o in need if o not in impl.ops]
        if lacking:
            fail("impl", f"an implementation providing {need}", f"{impl.name!r} lacks {lacking}")
        self.cfg = cfg
        self.impl = impl
        self.ops = impl.ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.chunk_size = int(chunk_size or cfg.chunk_size or 256)
        self.tp = tp
        kw = {"tp": tp} if tp.size > 1 else {}
        self.mixer = family.mixer(cfg, params, self.ops, dtype=dtype, device=self.device, chunk_size=self.chunk_size,
                                  **kw)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, md, conv_states: torch.Tensor, ssm_states: torch.Tensor):
        """-> (out (T, d_model), conv_states, ssm_states); see the module doc for the contract."""
        if hidden.dim() != 2 or hidden.shape[1] != self.cfg.d_model:
            fail("hidden", f"a (T, d_model={self.cfg.d_model}) tensor", f"shape {tuple(hidden.shape)}")
        if hidden.shape[0] != md.num_tokens:
            fail("hidden", f"{md.num_tokens} rows (the metadata's token count)", f"{hidden.shape[0]} rows")
        out = self.mixer.forward(families.cast(hidden, self.dtype), md, conv_states, ssm_states)
        return out, conv_states, ssm_states

    def __call__(self, hidden, md, conv_states, ssm_states):
        return self.forward(hidden, md, conv_states, ssm_states)


def make_backend(cfg, params: dict, impl, **kw) -> MixerBackend:
    """The backend for one layer (a hook point: the selftest and third parties swap in their own)."""
    return MixerBackend(cfg, params, impl, **kw)
