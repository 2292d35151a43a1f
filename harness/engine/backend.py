"""Mixer backend: one SSM layer's forward over a MIXED batch, through the op contract only.

A step's tokens are packed prefill-first (``md.num_prefill_tokens`` prefill tokens of
``md.num_prefills`` requests, then ``md.num_decodes`` decode rows of one token each), described by a
:class:`harness.engine.metadata.MambaMetadata`. The backend calls ONLY the ops of one
:class:`harness.impls.Impl` (see ``harness.ops``) plus torch matmuls for the projections:

==========================  ===================================  =================================
part                        prefill tokens                       decode rows
==========================  ===================================  =================================
conv                        ``causal_conv1d_varlen``             ``causal_conv1d_update``
Mamba-1 scan                ``selective_scan_varlen``            ``selective_state_update`` (3-D)
Mamba-2 SSD                 ``ssd_varlen``                       ``selective_state_update`` (4-D)
Falcon-Mamba B/C/dt norms   ``gated_rms_norm`` (weight = ones, z = None, eps = ``mixer_rms_eps``)
Mamba-2 gated norm          ``gated_rms_norm`` (group_size = d_inner / n_groups, norm_before_gate)
==========================  ===================================  =================================

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
"""
from __future__ import annotations

import torch

from reference.validate import fail

__all__ = ["MixerBackend", "make_backend"]


def _linear(x, w, b=None):
    y = x @ w.t()
    return y + b if b is not None else y


class MixerBackend:
    """One layer's mixer forward over a mixed prefill/decode batch (see module doc).

    Args:
      cfg: a ``reference.loader.ModelConfig`` (family mamba1, falcon_mamba or mamba2).
      params: the layer's mixer parameters (names as ``reference.loader.mixer_parameter_shapes``).
      impl: an ``Impl`` providing the ops listed in the module doc.
      dtype: activation / weight dtype.
      device: where the weights go.
      chunk_size: the SSD chunk size passed to ``ssd_varlen`` (default ``cfg.chunk_size``).
    """

    def __init__(self, cfg, params: dict, impl, *, dtype=torch.float32, device="cpu", chunk_size: int | None = None):
        from reference.loader import mixer_parameter_shapes
        if cfg.family not in ("mamba1", "falcon_mamba", "mamba2"):
            fail("cfg.family", "one of mamba1, falcon_mamba, mamba2", repr(cfg.family))
        shapes = mixer_parameter_shapes(cfg)
        missing = sorted(set(shapes) - set(params))
        if missing:
            fail("params", f"the mixer parameters {sorted(shapes)}", f"missing {missing}")
        for k, s in shapes.items():
            if tuple(params[k].shape) != s:
                fail(f"params[{k!r}]", f"shape {s}", f"shape {tuple(params[k].shape)}")
        need = ["causal_conv1d_varlen", "causal_conv1d_update", "selective_state_update", "gated_rms_norm",
                "ssd_varlen" if cfg.family == "mamba2" else "selective_scan_varlen"]
        lacking = [o for o in need if o not in impl.ops]
        if lacking:
            fail("impl", f"an implementation providing {need}", f"{impl.name!r} lacks {lacking}")
        self.cfg = cfg
        self.impl = impl
        self.ops = impl.ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.chunk_size = int(chunk_size or cfg.chunk_size or 256)
        pdt = torch.float64 if dtype == torch.float64 else torch.float32
        w = lambda k: None if k not in params else params[k].detach().to(self.device, dtype)  # noqa: E731
        f = lambda k: params[k].detach().to(self.device, pdt)  # noqa: E731
        self.in_w, self.in_b = w("in_proj.weight"), w("in_proj.bias")
        self.out_w, self.out_b = w("out_proj.weight"), w("out_proj.bias")
        self.conv_w = w("conv1d.weight")[:, 0, :].contiguous()
        self.conv_b = w("conv1d.bias")
        self.A = -torch.exp(f("A_log"))
        self.D = f("D")
        if cfg.family == "mamba2":
            self.dt_bias = f("dt_bias")
            self.norm_w = w("norm.weight")
        else:
            self.x_proj = w("x_proj.weight")
            self.dt_proj = w("dt_proj.weight")
            self.dt_bias = f("dt_proj.bias")
            if cfg.family == "falcon_mamba":
                self._ones_dt = torch.ones(cfg.dt_rank, dtype=dtype, device=self.device)
                self._ones_n = torch.ones(cfg.d_state, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ pieces (patchable)
    def falcon_norm(self, t: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        """Falcon-Mamba's weightless RMSNorm of B / C / dt_low with eps = cfg.mixer_rms_eps."""
        return self.ops["gated_rms_norm"](t.contiguous(), ones, None, eps=float(self.cfg.mixer_rms_eps))

    def _conv(self, xbc, md, conv_states):
        P = md.num_prefill_tokens
        parts = []
        if md.num_prefills:
            parts.append(self.ops["causal_conv1d_varlen"](
                xbc[:P].contiguous(), self.conv_w, self.conv_b, conv_states, md.prefill_query_start_loc,
                md.prefill_state_indices, md.prefill_has_initial_states, activation="silu"))
        if md.num_decodes:
            parts.append(self.ops["causal_conv1d_update"](
                xbc[P:].contiguous(), conv_states, self.conv_w, self.conv_b, md.decode_state_indices,
                activation="silu"))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, md, conv_states: torch.Tensor, ssm_states: torch.Tensor):
        """-> (out (T, d_model), conv_states, ssm_states); see the module doc for the contract."""
        if hidden.dim() != 2 or hidden.shape[1] != self.cfg.d_model:
            fail("hidden", f"a (T, d_model={self.cfg.d_model}) tensor", f"shape {tuple(hidden.shape)}")
        if hidden.shape[0] != md.num_tokens:
            fail("hidden", f"{md.num_tokens} rows (the metadata's token count)", f"{hidden.shape[0]} rows")
        h = hidden.to(self.dtype)
        if self.cfg.family == "mamba2":
            out = self._forward_mamba2(h, md, conv_states, ssm_states)
        else:
            out = self._forward_mamba1(h, md, conv_states, ssm_states)
        return out, conv_states, ssm_states

    def _forward_mamba1(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        Dm, N, R = cfg.d_inner, cfg.d_state, cfg.dt_rank
        P = md.num_prefill_tokens
        xz = _linear(h, self.in_w, self.in_b)
        x, z = xz[:, :Dm].contiguous(), xz[:, Dm:].contiguous()
        x = self._conv(x, md, conv_states)
        x_dbl = x @ self.x_proj.t()
        dt_low, B, C = torch.split(x_dbl, [R, N, N], dim=-1)
        if cfg.family == "falcon_mamba":
            dt_low = self.falcon_norm(dt_low, self._ones_dt)
            B = self.falcon_norm(B, self._ones_n)
            C = self.falcon_norm(C, self._ones_n)
        dt = (dt_low @ self.dt_proj.t()).contiguous()
        B = B.unsqueeze(1).contiguous()
        C = C.unsqueeze(1).contiguous()
        ys = []
        if md.num_prefills:
            ys.append(self.ops["selective_scan_varlen"](
                x[:P], dt[:P], self.A, B[:P], C[:P], self.D, z[:P], self.dt_bias, ssm_states,
                md.prefill_query_start_loc, md.prefill_state_indices, md.prefill_has_initial_states,
                delta_softplus=True))
        if md.num_decodes:
            ys.append(self.ops["selective_state_update"](
                ssm_states, x[P:], dt[P:], self.A, B[P:], C[P:], self.D, z[P:], self.dt_bias,
                md.decode_state_indices, dt_softplus=True))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return _linear(y.to(self.dtype), self.out_w, self.out_b)

    def _forward_mamba2(self, h, md, conv_states, ssm_states):
        cfg = self.cfg
        Di, G, N, H, Pd = cfg.d_inner, cfg.n_groups, cfg.d_state, cfg.num_heads, cfg.head_dim
        T = h.shape[0]
        P = md.num_prefill_tokens
        zxbcdt = _linear(h, self.in_w, self.in_b)
        z, xBC, dt = torch.split(zxbcdt, [Di, cfg.conv_dim, H], dim=-1)
        z, dt = z.contiguous(), dt.contiguous()
        xBC = self._conv(xBC.contiguous(), md, conv_states)
        x, B, C = torch.split(xBC, [Di, G * N, G * N], dim=-1)
        x = x.reshape(T, H, Pd).contiguous()
        B = B.reshape(T, G, N).contiguous()
        C = C.reshape(T, G, N).contiguous()
        lim = tuple(float(v) for v in cfg.time_step_limit)
        ys = []
        if md.num_prefills:
            ys.append(self.ops["ssd_varlen"](
                x[:P], dt[:P], self.A, B[:P], C[:P], self.chunk_size, self.D, None, self.dt_bias, ssm_states,
                md.prefill_query_start_loc, md.prefill_state_indices, md.prefill_has_initial_states,
                dt_softplus=True, dt_limit=lim))
        if md.num_decodes:
            ys.append(self.ops["selective_state_update"](
                ssm_states, x[P:], dt[P:], self.A, B[P:], C[P:], self.D, None, self.dt_bias,
                md.decode_state_indices, dt_softplus=True, dt_limit=lim))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        y = self.ops["gated_rms_norm"](y.reshape(T, Di).to(self.dtype).contiguous(), self.norm_w, z,
                                       eps=float(cfg.mixer_norm_eps), group_size=Di // G,
                                       norm_before_gate=bool(cfg.norm_before_gate))
        return _linear(y.to(self.dtype), self.out_w, self.out_b)

    def __call__(self, hidden, md, conv_states, ssm_states):
        return self.forward(hidden, md, conv_states, ssm_states)


def make_backend(cfg, params: dict, impl, **kw) -> MixerBackend:
    """The backend for one layer (a hook point: the selftest and third parties swap in their own)."""
    return MixerBackend(cfg, params, impl, **kw)
