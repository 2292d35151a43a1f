"""What the engine's delta-rule mixers (``gdn``, ``kda``) share: the delta rule over a mixed step.

Prefill tokens go through the family's ``*_varlen`` op (reading and writing their slots' states), decode
rows through its ``*_update`` op; both take value-major state pools (num_slots, Hv, V, K) and normalise q
and k themselves (``use_qk_l2norm=True``, scale K ** -0.5). g and beta are handed over in the activation
dtype, as vLLM's Qwen3-Next and Kimi Linear layers do.
"""
from __future__ import annotations

import torch

from harness.engine.attention import paged_attention, token_positions
from harness.engine.families import linear


def delta_step(ops, varlen: str, update: str, md, q, k, v, g, beta, ssm_states):
    """o (T, Hv, V) of a mixed step: `varlen` over the prefill tokens, `update` over the decode rows."""
    P = md.num_prefill_tokens
    outs = []
    if md.num_prefills:
        outs.append(ops[varlen](q[:P], k[:P], v[:P], g[:P], beta[:P], ssm_states, md.prefill_query_start_loc,
                                md.prefill_state_indices, md.prefill_has_initial_states, use_qk_l2norm=True))
    if md.num_decodes:
        outs.append(ops[update](q[P:], k[P:], v[P:], g[P:], beta[P:], ssm_states, md.decode_state_indices,
                                use_qk_l2norm=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class AttentionLayer:
    """What the hybrids' full-attention layers share: weights in the engine dtype and the per-head RMSNorm
    through the ``gated_rms_norm`` op. Subclasses define ``forward(h, md, kv, layer) -> out (T, d_model)``."""

    def __init__(self, cfg, params: dict, ops: dict, *, dtype: torch.dtype, device):
        self.cfg = cfg
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self._params = params

    def weight(self, name: str):
        p = self._params.get(name)
        return None if p is None else p.detach().to(self.device, self.dtype)

    def head_norm(self, x, weight, eps: float):
        """RMSNorm over the last dim of x (T, heads, D) with `weight` (heads * D,) (the weight repeated per head)."""
        T, H, D = x.shape
        y = self.ops["gated_rms_norm"](x.reshape(T, H * D).contiguous(), weight, None, eps=float(eps), group_size=D)
        return y.to(self.dtype).reshape(T, H, D)

    def attend(self, kv, layer, md, q, k, v, scale):
        return paged_attention(kv, layer, md, q, k, v, scale)

    def project(self, x, w, b=None):
        return linear(x, w, b)

    positions = staticmethod(token_positions)


def no_tp(family: str):
    """check_tp of a family whose weights the fast loader cannot split yet: tp_size 1 only."""
    def check_tp(cfg, tp_size: int) -> None:
        if tp_size != 1:
            raise ValueError(f"tp_size: expected 1 (tensor parallelism is not supported for the {family} family "
                             f"yet), got {tp_size}")
    return check_tp
