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
    """What the hybrids' full-attention layers share: weights in the engine dtype, the per-head RMSNorm
    through the ``gated_rms_norm`` op, and tensor parallelism (``tp``: a ``harness.engine.tp.TensorParallel``;
    `params` come whole and each rank keeps its heads: :meth:`heads` cuts a column-parallel projection,
    :meth:`out` runs the row-parallel output projection, summed over the ranks). Subclasses define
    ``forward(h, md, kv, layer) -> out (T, d_model)``."""

    def __init__(self, cfg, params: dict, ops: dict, *, dtype: torch.dtype, device, tp=None):
        from harness.engine.tp import SINGLE
        self.cfg = cfg
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp or SINGLE
        self._params = params

    def weight(self, name: str):
        p = self._params.get(name)
        return None if p is None else p.detach().to(self.device, self.dtype)

    def heads(self, name: str, num_heads: int, *, dim: int = 0, kv: bool = False):
        """Parameter `name` cut to this rank's heads along `dim` (``num_heads`` equal blocks; ``kv``: key/value
        heads, replicated when fewer than the ranks), contiguous; None when the layer has none."""
        from harness.engine.tp import split_heads
        w = split_heads(self.weight(name), num_heads, self.tp, dim=dim, kv=kv)
        return None if w is None else w.contiguous()

    def local(self, num_heads: int, *, kv: bool = False) -> int:
        """How many of `num_heads` (query, or key/value with ``kv``) heads this rank holds."""
        from harness.engine.tp import kv_heads_of_rank
        if kv:
            return kv_heads_of_rank(num_heads, self.tp.rank, self.tp.size)[1]
        return num_heads // self.tp.size

    def head_norm(self, x, weight, eps: float):
        """RMSNorm over the last dim of x (T, heads, D) with `weight` (heads * D,) (the weight repeated per head)."""
        T, H, D = x.shape
        y = self.ops["gated_rms_norm"](x.reshape(T, H * D).contiguous(), weight, None, eps=float(eps), group_size=D)
        return y.to(self.dtype).reshape(T, H, D)

    def attend(self, kv, layer, md, q, k, v, scale):
        return paged_attention(kv, layer, md, q, k, v, scale)

    def project(self, x, w, b=None):
        return linear(x, w, b)

    def out(self, x, w, b=None):
        """The row-parallel output projection: this rank's partial product (`w`: its columns) summed over
        the ranks, then the (replicated) bias."""
        y = self.tp.all_reduce(self.project(x, w))
        return y + b if b is not None else y

    positions = staticmethod(token_positions)


def check_tp(family: str, tp_size: int, divisible: dict, kv_heads: int | None = None) -> None:
    """check_tp of a hybrid family: `tp_size` must divide every count of `divisible` ({field name: count}) and
    divide or be a multiple of `kv_heads` (attention key/value heads, replicated when fewer than the ranks;
    None: no such heads); else a ValueError naming ``tp_size``."""
    for name, n in divisible.items():
        if n % tp_size:
            raise ValueError(f"tp_size: expected a divisor of {name} = {n} ({family}), got {tp_size}")
    if kv_heads is not None and kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tp_size: expected a divisor or a multiple of attn_kv_heads = {kv_heads} ({family}), "
                         f"got {tp_size}")
