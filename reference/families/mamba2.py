"""Mamba-2 (family ``mamba2``).

Reference mixer (as transformers' Mamba2Mixer / mamba_ssm's Mamba2)::

    z, xBC, dt = split(in_proj(h), [d_inner, d_inner + 2*G*N, H])
    xBC    = silu(conv1d(xBC) + conv_bias);  x, B, C = split(xBC, [d_inner, G*N, G*N])
    y      = ssd(x as (H, P), dt, -exp(A_log), B as (G, N), C as (G, N), D, dt_bias, softplus,
                 dt_limit = time_step_limit)
    y      = gated_rms_norm(y, norm.weight, z, group_size = d_inner / G, norm_before_gate)
    out    = out_proj(y)

The decode step applies `time_step_limit` too (prefill/decode split invariance); transformers'
and mamba_ssm's decode paths skip the clamp, which only matters for a non-default limit.
SSM state (S, num_heads, head_dim, d_state); conv state (S, d_inner + 2*G*N, K-1). Config sources: HF
``model_type`` ``mamba2`` (or its CausalLM / Model architectures) and raw state-spaces configs with
``ssm_cfg.layer == "Mamba2"``. This mixer is independent of the engine's Mamba-2 mixer
(``harness/engine/families/mamba2.py``) on purpose: the oracle shares no code with what it checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reference.cache import Mamba2Spec
from reference.config import (MAX_CHUNK, MAX_EXPAND, MAX_STATE, ModelConfig, err, get_bool, get_int, get_limit,
                              hf_common_dict)
from reference.families import Family, add_bias_shapes, common_fields, register
from reference.mixers import Mixer, cast, linear
from reference.validate import fail


@dataclass(frozen=True)
class Mamba2Fields:
    """Mamba-2's own config fields (`mixer_norm_eps`: the gated RMSNorm's eps)."""
    d_state: int
    expand: int
    d_inner: int
    n_groups: int
    head_dim: int
    num_heads: int
    time_step_limit: tuple = (0.0, math.inf)
    mixer_norm_eps: float = 1e-5
    norm_before_gate: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state


_SS_KEYS = frozenset({"layer", "d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_limit",
                      "conv_bias", "bias", "rmsnorm", "norm_before_gate", "d_ssm", "D_has_hdim", "dt_min", "dt_max",
                      "dt_init_floor", "A_init_range", "conv_init", "use_mem_eff_path"})


class Mamba2Family(Family):
    name = "mamba2"
    fields = Mamba2Fields
    hf_model_types = ("mamba2",)
    hf_architectures = ("Mamba2ForCausalLM", "Mamba2Model")
    hf_tie_default = False
    state_spaces_layers = ("Mamba2",)
    state_spaces_keys = _SS_KEYS
    mixer_parameter_names = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log",
                             "D", "norm.weight", "out_proj.weight", "out_proj.bias")
    typical_vocab_size = 32768
    build_fields = ("d_state", "head_dim", "n_groups")

    # config ----------------------------------------------------------------------------------
    def from_hf(self, raw, common, where):
        expand = get_int(raw, "expand", where, 2, hi=MAX_EXPAND)
        d_state = get_int(raw, "state_size", where, 128, hi=MAX_STATE)
        num_heads = get_int(raw, "num_heads", where, 128)
        head_dim = get_int(raw, "head_dim", where, 64, hi=MAX_STATE)
        n_groups = get_int(raw, "n_groups", where, 8)
        chunk_size = get_int(raw, "chunk_size", where, 256, hi=MAX_CHUNK)
        lim = get_limit(raw, "time_step_limit", where)
        d_inner = expand * common["d_model"]
        if num_heads * head_dim != d_inner:
            raise err(where, f"num_heads * head_dim: expected hidden_size * expand = {d_inner}, "
                             f"got {num_heads} * {head_dim} = {num_heads * head_dim}")
        if num_heads % n_groups:
            raise err(where, f"n_groups: expected a divisor of num_heads = {num_heads}, got {n_groups}")
        return ModelConfig(family=self.name, mixer=Mamba2Fields(
            d_state=d_state, expand=expand, d_inner=d_inner, n_groups=n_groups, head_dim=head_dim,
            num_heads=num_heads, time_step_limit=lim, mixer_norm_eps=common["norm_eps"], norm_before_gate=False),
            chunk_size=chunk_size, **common)

    def from_state_spaces(self, raw, ssm, common, where):
        p = "ssm_cfg."
        expand = get_int(ssm, "expand", where, 2, hi=MAX_EXPAND, prefix=p)
        d_state = get_int(ssm, "d_state", where, 128, hi=MAX_STATE, prefix=p)
        head_dim = get_int(ssm, "headdim", where, 64, hi=MAX_STATE, prefix=p)
        n_groups = get_int(ssm, "ngroups", where, 1, prefix=p)
        chunk_size = get_int(ssm, "chunk_size", where, 256, hi=MAX_CHUNK, prefix=p)
        norm_before_gate = get_bool(ssm, "norm_before_gate", where, False, prefix=p)
        lim = get_limit(ssm, "dt_limit", where, prefix=p)
        d_inner = expand * common["d_model"]
        if ssm.get("d_ssm") not in (None, d_inner):
            raise err(where, f"ssm_cfg.d_ssm: only d_ssm = d_inner = {d_inner} is supported, got {ssm['d_ssm']!r:.60}")
        if get_bool(ssm, "D_has_hdim", where, False, prefix=p):
            raise err(where, "ssm_cfg.D_has_hdim: expected false (per-channel D is not supported), got true")
        if not get_bool(ssm, "rmsnorm", where, True, prefix=p):
            raise err(where, "ssm_cfg.rmsnorm: expected true, got false")
        if d_inner % head_dim:
            raise err(where, f"ssm_cfg.headdim: expected a divisor of d_inner = {d_inner}, got {head_dim}")
        num_heads = d_inner // head_dim
        if num_heads % n_groups:
            raise err(where, f"ssm_cfg.ngroups: expected a divisor of nheads = {num_heads}, got {n_groups}")
        return ModelConfig(family=self.name, mixer=Mamba2Fields(
            d_state=d_state, expand=expand, d_inner=d_inner, n_groups=n_groups, head_dim=head_dim,
            num_heads=num_heads, time_step_limit=lim, mixer_norm_eps=1e-5, norm_before_gate=norm_before_gate),
            chunk_size=chunk_size, **common)

    def to_hf(self, cfg) -> dict:
        if cfg.norm_before_gate or cfg.mixer_norm_eps != cfg.norm_eps:
            fail("cfg", "a Mamba-2 config transformers can express (norm after the gate, mixer_norm_eps == norm_eps)",
                 f"norm_before_gate={cfg.norm_before_gate}, mixer_norm_eps={cfg.mixer_norm_eps}")
        return dict(model_type=self.hf_model_types[0], architectures=[self.hf_architectures[0]], **hf_common_dict(cfg),
                    state_size=cfg.d_state, expand=cfg.expand, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                    n_groups=cfg.n_groups, chunk_size=cfg.chunk_size, time_step_limit=tuple(cfg.time_step_limit))

    def build_config(self, *, d_model, n_layer, vocab, d_conv=4, expand=2, chunk_size=256,
                     pad_vocab_size_multiple=1, tie_embeddings=False, d_state=None, head_dim=64, n_groups=8):
        d_inner = expand * d_model
        if d_inner % head_dim or (d_inner // head_dim) % n_groups:
            fail("head_dim/n_groups", f"divisors of d_inner={d_inner} and of its head count",
                 f"head_dim={head_dim}, n_groups={n_groups}")
        common = common_fields(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv,
                               pad_vocab_size_multiple=pad_vocab_size_multiple, tie_embeddings=tie_embeddings,
                               chunk_size=chunk_size)
        return ModelConfig(family=self.name, mixer=Mamba2Fields(
            d_state=d_state or 128, expand=expand, d_inner=d_inner, n_groups=n_groups, head_dim=head_dim,
            num_heads=d_inner // head_dim), **common)

    def tiny_config(self, *, d_model=16, n_layer=2, vocab=60, d_state=None, d_conv=4, chunk_size=8):
        return self.build_config(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv, chunk_size=chunk_size,
                                 pad_vocab_size_multiple=8, d_state=d_state or 8, head_dim=8, n_groups=2)

    def summary(self, cfg) -> dict:
        return dict(d_inner=cfg.d_inner, d_state=cfg.d_state, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                    n_groups=cfg.n_groups, chunk_size=cfg.chunk_size)

    # parameters and state ----------------------------------------------------------------------
    def parameter_shapes(self, cfg) -> dict:
        D, N, K, H = cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.num_heads
        shapes = {"in_proj.weight": (2 * D + 2 * cfg.n_groups * N + H, cfg.d_model),
                  "conv1d.weight": (cfg.conv_dim, 1, K), "dt_bias": (H,), "A_log": (H,), "D": (H,),
                  "norm.weight": (D,), "out_proj.weight": (cfg.d_model, D)}
        return add_bias_shapes(cfg, shapes)

    def state_spec(self, cfg, *, conv_dtype, recurrent_dtype, tp_size=1):
        return Mamba2Spec(num_heads=cfg.num_heads, head_dim=cfg.head_dim, state_size=cfg.d_state,
                          n_groups=cfg.n_groups, conv_kernel=cfg.d_conv, tp_size=tp_size, conv_dtype=conv_dtype,
                          recurrent_dtype=recurrent_dtype)

    def make_mixer(self, cfg, params, *, dtype=torch.float64, ops=None, device=None):
        return Mamba2Mixer(cfg, params, dtype=dtype, ops=ops, device=device)


class Mamba2Mixer(Mixer):
    """Mamba-2 mixer (SSD, n_groups broadcast by repeat_interleave, gated RMSNorm per group)."""

    def ssm_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.num_heads, self.cfg.head_dim, self.cfg.d_state)

    def _split_in(self, h):
        cfg = self.cfg
        zxbcdt = linear(h, self.p["in_proj.weight"], self.p.get("in_proj.bias"))
        z, xBC, dt = torch.split(zxbcdt, [cfg.d_inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        return z.contiguous(), xBC.contiguous(), dt.contiguous()

    def _split_xbc(self, xBC):
        cfg = self.cfg
        GN = cfg.n_groups * cfg.d_state
        x, B, C = torch.split(xBC, [cfg.d_inner, GN, GN], dim=-1)
        n = xBC.shape[0]
        return (x.reshape(n, cfg.num_heads, cfg.head_dim), B.reshape(n, cfg.n_groups, cfg.d_state),
                C.reshape(n, cfg.n_groups, cfg.d_state))

    def _out(self, y, z):
        cfg = self.cfg
        y = self.ops.gated_rms_norm(y.reshape(y.shape[0], cfg.d_inner), self.p["norm.weight"], z,
                                    eps=cfg.mixer_norm_eps, group_size=cfg.d_inner // cfg.n_groups,
                                    norm_before_gate=cfg.norm_before_gate)
        return linear(y, self.p["out_proj.weight"], self.p.get("out_proj.bias"))

    def forward(self, hidden, cu_seqlens=None, conv_states_in=None, ssm_states_in=None):
        h = self._check_hidden(hidden)
        z, xBC, dt = self._split_in(h)
        xBC, conv_out = self.ops.causal_conv1d(xBC, self.conv_w, self.conv_b, activation="silu",
                                               cu_seqlens=cu_seqlens, initial_states=cast(conv_states_in, self.dtype))
        x, B, C = self._split_xbc(xBC)
        y, ssm_out = self.ops.ssd(x, dt, self.A, B, C, self.p["D"], None, dt_bias=self.p["dt_bias"],
                                  dt_softplus=True, dt_limit=tuple(self.cfg.time_step_limit), cu_seqlens=cu_seqlens,
                                  initial_states=cast(ssm_states_in, self.dtype))
        return self._out(y, z), conv_out, ssm_out

    def step(self, hidden, conv_state, ssm_state):
        h = self._check_hidden(hidden)
        z, xBC, dt = self._split_in(h)
        xBC, new_conv = self.ops.causal_conv1d_update(xBC, cast(conv_state, self.dtype), self.conv_w, self.conv_b,
                                                      activation="silu")
        x, B, C = self._split_xbc(xBC)
        y, new_ssm = self.ops.ssd_state_update(cast(ssm_state, self.dtype), x, dt, self.A, B, C, self.p["D"], None,
                                               dt_bias=self.p["dt_bias"], dt_softplus=True,
                                               dt_limit=tuple(self.cfg.time_step_limit))
        return self._out(y, z), new_conv, new_ssm


register(Mamba2Family())
