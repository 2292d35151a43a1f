"""Plain full-attention pieces of the hybrid models' reference (Qwen3-Next, Kimi Linear): causal softmax
attention of one request against its whole key/value history, the rotary embedding, the gated MLP.

Everything here is the textbook formula, one request at a time, in the caller's dtype::

    scores[i, j] = scale * q[i] . k[j]            key/value head of query head h: h // (H / H_kv)
    scores[i, j] = -inf  where j > past + i       (query i sits at position past + i)
    out[i]       = softmax(scores[i]) @ v

    rotary (rotate-half form, on the first `rotary_dim` channels of each head; the rest pass through):
        inv_freq = theta ** -(arange(0, rotary_dim, 2) / rotary_dim)
        angle    = position * cat(inv_freq, inv_freq)
        x_rot    = x * cos(angle) + cat(-x[half:], x[:half]) * sin(angle)

    mlp(x) = down(silu(gate(x)) * up(x))

:class:`Attention` is what a family's reference attention layer shares: its parameter checks, the loop
over the requests of a packed step and the key/value history per request (explicit, like a mixer's
state: ``past`` is a list of (keys (L, H_kv, Dk), values (L, H_kv, Dv)) per request, never modified).
"""
from __future__ import annotations

import torch

from reference.validate import fail

__all__ = ["Attention", "causal_attention", "rotary", "gated_mlp"]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """q (n, H, Dk) of the request's tokens past .. past+n-1; k (past+n, H_kv, Dk), v (past+n, H_kv, Dv) of
    every token so far -> (n, H, Dv)."""
    n, H, _ = q.shape
    L, Hkv, _ = k.shape
    if L != past + n or v.shape[0] != L:
        fail("k, v", f"{past + n} positions (past {past} + {n} new)", f"{L} keys, {v.shape[0]} values")
    if H % Hkv:
        fail("q", f"a multiple of the {Hkv} key/value heads", f"{H} heads")
    group = H // Hkv
    out = torch.empty((n, H, v.shape[-1]), dtype=q.dtype, device=q.device)
    allowed = torch.arange(L, device=q.device)[None, :] <= (past + torch.arange(n, device=q.device))[:, None]
    for h in range(H):
        scores = (q[:, h] @ k[:, h // group].t()) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def rotary(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x (n, heads, D) at `positions` (n,) with the rotary embedding on its first `rotary_dim` channels."""
    if rotary_dim == 0:
        return x
    if rotary_dim % 2 or rotary_dim > x.shape[-1]:
        fail("rotary_dim", f"an even number <= the head size {x.shape[-1]}", rotary_dim)
    half = rotary_dim // 2
    inv_freq = theta ** -(torch.arange(0, rotary_dim, 2, dtype=x.dtype, device=x.device) / rotary_dim)
    angle = positions.to(x.dtype)[:, None] * torch.cat([inv_freq, inv_freq])[None, :]  # (n, rotary_dim)
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    r, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    turned = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
    return torch.cat([r * cos + turned * sin, rest], dim=-1)


def gated_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with bias-free projections (weights as nn.Linear stores them)."""
    return (torch.nn.functional.silu(x @ gate_w.t()) * (x @ up_w.t())) @ down_w.t()


class Attention:
    """One full-attention layer of a hybrid reference model (see the module doc). Subclasses (one per
    family module) set `scale` and define ``project(h, positions) -> (q (n, H, Dk), k (n, H_kv, Dk),
    v (n, H_kv, Dv), extra)`` and ``output(o (n, H, Dv), extra) -> (n, d_model)``."""

    scale: float = 1.0

    def __init__(self, cfg, params: dict, shapes: dict, *, dtype: torch.dtype = torch.float64, ops=None,
                 device=None):
        from reference.mixers import checked_params, reference_ops
        self.cfg = cfg
        self.dtype = dtype
        self.ops = ops or reference_ops()
        self.p = checked_params(params, shapes, "attention", dtype, device)

    def project(self, h, positions):  # pragma: no cover - defined by each family
        raise NotImplementedError

    def output(self, o, extra):  # pragma: no cover - defined by each family
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, cu_seqlens=None, past=None):
        """hidden (T, d_model) of S packed requests (cu_seqlens (S+1,); None: one request), `past` their
        key/value histories (None: empty) -> (out (T, d_model), the histories extended by the new tokens)."""
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != self.cfg.d_model:
            fail("hidden", f"a (tokens, d_model={self.cfg.d_model}) tensor",
                 f"shape {tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
        h = hidden.to(self.dtype)
        cu = [0, h.shape[0]] if cu_seqlens is None else [int(c) for c in cu_seqlens]
        S = len(cu) - 1
        if past is not None and len(past) != S:
            fail("past", f"key/value histories of {S} requests", len(past))
        out, new_past = [], []
        for r in range(S):
            rows = h[cu[r]:cu[r + 1]]
            k0, v0 = (None, None) if past is None else past[r]
            start = 0 if k0 is None else int(k0.shape[0])
            positions = start + torch.arange(rows.shape[0], device=h.device)
            q, k, v, extra = self.project(rows, positions)
            if k0 is not None:
                k, v = torch.cat([k0.to(self.dtype), k]), torch.cat([v0.to(self.dtype), v])
            out.append(self.output(causal_attention(q, k, v, start, self.scale), extra))
            new_past.append((k, v))
        return torch.cat(out), new_past

    def step(self, hidden: torch.Tensor, past):
        """One token per request: hidden (B, d_model) -> (out (B, d_model), extended histories)."""
        return self.forward(hidden, torch.arange(hidden.shape[0] + 1), past)
