"""Mamba-1 (family ``mamba1``) and its Falcon-Mamba variant (family ``falcon_mamba``).

Reference mixer (as transformers' MambaMixer / FalconMambaMixer and mamba_ssm's Mamba)::

    x, z   = split(in_proj(h), [d_inner, d_inner])
    x      = silu(conv1d(x) + conv_bias)
    dt_low, B, C = split(x_proj(x), [dt_rank, d_state, d_state])
    Falcon-Mamba only: dt_low, B, C = rms(dt_low), rms(B), rms(C)   (weightless, eps = mixer_rms_eps,
                       dt normalised over its dt_rank channels, before dt_proj)
    dt     = dt_proj.weight @ dt_low           (dt_proj.bias is the scan's delta_bias, softplus after)
    y      = selective_scan(x, dt, -exp(A_log), B, C, D, z)
    out    = out_proj(y)

SSM state (S, d_inner, d_state); conv state (S, d_inner, K-1). Config sources: HF ``model_type``
``mamba`` / ``falcon_mamba`` (or their CausalLM / Model architectures) and raw state-spaces configs with
``ssm_cfg.layer == "Mamba1"`` (the default). This mixer is independent of the engine's Mamba-1 mixer
(``harness/engine/families/mamba1.py``) on purpose: the oracle shares no code with what it checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reference.cache import Mamba1Spec
from reference.config import MAX_EXPAND, MAX_INNER, MAX_STATE, ModelConfig, get_float, get_int
from reference.families import Family, add_bias_shapes, common_fields, register
from reference.mixers import Mixer, cast, linear


@dataclass(frozen=True)
class Mamba1Fields:
    """Mamba-1's own config fields; `mixer_rms_eps` is Falcon-Mamba's B/C/dt RMSNorm eps (None for Mamba-1)."""
    d_state: int
    expand: int
    d_inner: int
    dt_rank: int
    mixer_rms_eps: float | None = None

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: x only."""
        return self.d_inner


_SS_KEYS = frozenset({"layer", "d_state", "d_conv", "expand", "dt_rank", "conv_bias", "bias", "dt_min", "dt_max",
                      "dt_init", "dt_scale", "dt_init_floor", "use_fast_path"})


def _dt_rank(raw: dict, key: str, d_model: int, where, prefix: str = "") -> int:
    rank = raw.get(key, "auto")
    if rank is None or rank == "auto":
        return math.ceil(d_model / 16)
    return get_int(raw, key, where, prefix=prefix)


class Mamba1Family(Family):
    fields = Mamba1Fields
    state_spaces_keys = _SS_KEYS
    mixer_parameter_names = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight",
                             "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight", "out_proj.bias")
    # non-persistent B/C/dt norm buffers that some converted checkpoints saved
    ignored_mixer_names = ("b_layernorm.weight", "c_layernorm.weight", "dt_layernorm.weight")
    hf_tie_default = True
    typical_vocab_size = 65024
    build_fields = ("d_state", "dt_rank")

    def __init__(self, name: str, *, falcon: bool, hf_model_types: tuple, hf_architectures: tuple,
                 state_spaces_layers: tuple = ()):
        self.name = name
        self.falcon = falcon
        self.hf_model_types = hf_model_types
        self.hf_architectures = hf_architectures
        self.state_spaces_layers = state_spaces_layers

    # config ----------------------------------------------------------------------------------
    def _config(self, common: dict, *, d_state, expand, d_inner, dt_rank, mixer_rms_eps, chunk_size=None):
        extra = {} if chunk_size is None else dict(chunk_size=chunk_size)
        return ModelConfig(family=self.name, mixer=Mamba1Fields(
            d_state=d_state, expand=expand, d_inner=d_inner, dt_rank=dt_rank,
            mixer_rms_eps=mixer_rms_eps if self.falcon else None), **common, **extra)

    def from_hf(self, raw, common, where):
        expand = get_int(raw, "expand", where, 2, hi=MAX_EXPAND)
        d_state = get_int(raw, "state_size", where, 16, hi=MAX_STATE)
        d_inner = expand * common["d_model"]
        if raw.get("intermediate_size") is not None:
            d_inner = get_int(raw, "intermediate_size", where, hi=MAX_INNER)
        dt_rank = _dt_rank(raw, "time_step_rank", common["d_model"], where)
        eps = get_float(raw, "mixer_rms_eps", where, 1e-6) if self.falcon else None
        return self._config(common, d_state=d_state, expand=expand, d_inner=d_inner, dt_rank=dt_rank,
                            mixer_rms_eps=eps)

    def from_state_spaces(self, raw, ssm, common, where):
        expand = get_int(ssm, "expand", where, 2, hi=MAX_EXPAND, prefix="ssm_cfg.")
        d_state = get_int(ssm, "d_state", where, 16, hi=MAX_STATE, prefix="ssm_cfg.")
        dt_rank = _dt_rank(ssm, "dt_rank", common["d_model"], where, prefix="ssm_cfg.")
        return self._config(common, d_state=d_state, expand=expand, d_inner=expand * common["d_model"],
                            dt_rank=dt_rank, mixer_rms_eps=None)

    def to_hf(self, cfg) -> dict:
        from reference.config import hf_common_dict
        from reference.validate import fail
        if cfg.d_inner != cfg.expand * cfg.d_model:
            fail("cfg.d_inner", f"expand * d_model = {cfg.expand * cfg.d_model} (transformers derives it)",
                 cfg.d_inner)
        out = dict(model_type=self.hf_model_types[0], architectures=[self.hf_architectures[0]],
                   **hf_common_dict(cfg), state_size=cfg.d_state, expand=cfg.expand, time_step_rank=cfg.dt_rank)
        if self.falcon:
            out["mixer_rms_eps"] = cfg.mixer_rms_eps
        return out

    def build_config(self, *, d_model, n_layer, vocab, d_conv=4, expand=2, chunk_size=256,
                     pad_vocab_size_multiple=1, tie_embeddings=False, d_state=None, dt_rank=None):
        common = common_fields(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv,
                               pad_vocab_size_multiple=pad_vocab_size_multiple, tie_embeddings=tie_embeddings,
                               chunk_size=chunk_size)
        return self._config(common, d_state=d_state or 16, expand=expand, d_inner=expand * d_model,
                            dt_rank=dt_rank or math.ceil(d_model / 16), mixer_rms_eps=1e-6)

    def tiny_config(self, *, d_model=16, n_layer=2, vocab=60, d_state=None, d_conv=4, chunk_size=8):
        return self.build_config(d_model=d_model, n_layer=n_layer, vocab=vocab, d_conv=d_conv, chunk_size=chunk_size,
                                 pad_vocab_size_multiple=8, d_state=d_state or 4, dt_rank=4)

    def summary(self, cfg) -> dict:
        return dict(d_inner=cfg.d_inner, d_state=cfg.d_state, dt_rank=cfg.dt_rank)

    # parameters and state ----------------------------------------------------------------------
    def parameter_shapes(self, cfg) -> dict:
        D, N, K, R = cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.dt_rank
        shapes = {"in_proj.weight": (2 * D, cfg.d_model), "conv1d.weight": (D, 1, K), "x_proj.weight": (R + 2 * N, D),
                  "dt_proj.weight": (D, R), "dt_proj.bias": (D,), "A_log": (D, N), "D": (D,),
                  "out_proj.weight": (cfg.d_model, D)}
        return add_bias_shapes(cfg, shapes)

    def state_spec(self, cfg, *, conv_dtype, recurrent_dtype, tp_size=1):
        return Mamba1Spec(intermediate_size=cfg.d_inner, state_size=cfg.d_state, conv_kernel=cfg.d_conv,
                          tp_size=tp_size, conv_dtype=conv_dtype, recurrent_dtype=recurrent_dtype)

    def make_mixer(self, cfg, params, *, dtype=torch.float64, ops=None, device=None):
        return Mamba1Mixer(cfg, params, dtype=dtype, ops=ops, device=device, falcon=self.falcon)


class Mamba1Mixer(Mixer):
    """Mamba-1 mixer; with `falcon`, Falcon-Mamba's weightless B/C/dt RMSNorm (eps `cfg.mixer_rms_eps`)."""

    def __init__(self, cfg, params, *, dtype=torch.float64, ops=None, device=None, falcon: bool = False):
        super().__init__(cfg, params, dtype=dtype, ops=ops, device=device)
        self.falcon = falcon

    def ssm_state_shape(self, batch: int) -> tuple:
        return (batch, self.cfg.d_inner, self.cfg.d_state)

    def _ssm_inputs(self, x):
        cfg = self.cfg
        x_dbl = x @ self.p["x_proj.weight"].t()
        dt_low, B, C = torch.split(x_dbl, [cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        if self.falcon:
            eps = cfg.mixer_rms_eps
            dt_low = self.ops.rms_norm(dt_low.contiguous(), None, eps)
            B = self.ops.rms_norm(B.contiguous(), None, eps)
            C = self.ops.rms_norm(C.contiguous(), None, eps)
        dt = dt_low @ self.p["dt_proj.weight"].t()
        # B, C as (tokens, 1 group, N)
        return dt, B.unsqueeze(1).contiguous(), C.unsqueeze(1).contiguous()

    def forward(self, hidden, cu_seqlens=None, conv_states_in=None, ssm_states_in=None):
        h = self._check_hidden(hidden)
        D = self.cfg.d_inner
        xz = linear(h, self.p["in_proj.weight"], self.p.get("in_proj.bias"))
        x, z = xz[:, :D].contiguous(), xz[:, D:].contiguous()
        x, conv_out = self.ops.causal_conv1d(x, self.conv_w, self.conv_b, activation="silu",
                                             cu_seqlens=cu_seqlens, initial_states=cast(conv_states_in, self.dtype))
        dt, B, C = self._ssm_inputs(x)
        y, ssm_out = self.ops.selective_scan(x, dt.contiguous(), self.A, B, C, self.p["D"], z,
                                             delta_bias=self.p["dt_proj.bias"], delta_softplus=True,
                                             cu_seqlens=cu_seqlens, initial_states=cast(ssm_states_in, self.dtype))
        out = linear(y, self.p["out_proj.weight"], self.p.get("out_proj.bias"))
        return out, conv_out, ssm_out

    def step(self, hidden, conv_state, ssm_state):
        h = self._check_hidden(hidden)
        D = self.cfg.d_inner
        xz = linear(h, self.p["in_proj.weight"], self.p.get("in_proj.bias"))
        x, z = xz[:, :D].contiguous(), xz[:, D:].contiguous()
        x, new_conv = self.ops.causal_conv1d_update(x, cast(conv_state, self.dtype), self.conv_w, self.conv_b,
                                                    activation="silu")
        dt, B, C = self._ssm_inputs(x)
        y, new_ssm = self.ops.selective_state_update(cast(ssm_state, self.dtype), x, dt.contiguous(), self.A, B, C,
                                                     self.p["D"], z, dt_bias=self.p["dt_proj.bias"], dt_softplus=True)
        out = linear(y, self.p["out_proj.weight"], self.p.get("out_proj.bias"))
        return out, new_conv, new_ssm


register(Mamba1Family("mamba1", falcon=False, hf_model_types=("mamba",),
                      hf_architectures=("MambaForCausalLM", "MambaModel"), state_spaces_layers=("Mamba1",)))
register(Mamba1Family("falcon_mamba", falcon=True, hf_model_types=("falcon_mamba",),
                      hf_architectures=("FalconMambaForCausalLM", "FalconMambaModel")))
