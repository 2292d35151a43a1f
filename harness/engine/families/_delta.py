"""What the engine's delta-rule mixers (``gdn``, ``kda``) share: the delta rule over a mixed step.

Prefill tokens go through the family's ``*_varlen`` op (reading and writing their slots' states), decode
rows through its ``*_update`` op; both take value-major state pools (num_slots, Hv, V, K) and normalise q
and k themselves (``use_qk_l2norm=True``, scale K ** -0.5). g and beta are handed over in the activation
dtype, as vLLM's Qwen3-Next and Kimi Linear layers do.

The hybrids' MLPs (:func:`make_mlp`, built by the runner per decoder layer): dense SwiGLU
(:class:`DenseMLP`) or a mixture of experts (:class:`MoEMLP`, the config's ``moe``: Qwen3-Next's softmax router
and sigmoid-gated shared expert, Kimi Linear's grouped sigmoid router with score-correction bias, routed
scaling and ungated shared experts). The MoE routes all tokens at once (router logits in the engine dtype,
scores and top-k in float32 at least), sorts the (token, expert) pairs by expert and runs each hit expert once
over its tokens (gate and up projections fused per expert), scattering the weighted outputs back. Under tensor
parallelism every rank holds its cut of each expert's (and the shared expert's) intermediate channels, as
vLLM's fused MoE does (``harness.engine.tp.TensorParallel.shard_mlp``); the router is replicated, and the
MLP's output is a partial sum the runner all-reduces.
"""
from __future__ import annotations

import torch

from harness.engine.attention import paged_attention, token_positions
from harness.engine.families import decode_rows, linear, prefill_rows

PROJ = ("gate_proj", "up_proj", "down_proj")


def delta_step(ops, varlen: str, update: str, md, q, k, v, g, beta, ssm_states):
    """o (T, Hv, V) of a mixed step: `varlen` over the prefill tokens, `update` over the decode rows (in a
    speculative step, ``<update>_spec`` over the decode rows' tokens: ``harness.engine.spec``)."""
    P = md.num_prefill_tokens
    outs = []
    if md.num_prefills:
        outs.append(ops[varlen](*(prefill_rows(t, P) for t in (q, k, v, g, beta)), ssm_states,
                                md.prefill_query_start_loc, md.prefill_state_indices, md.prefill_has_initial_states,
                                use_qk_l2norm=True))
    if md.num_decodes and getattr(md, "num_spec", 0):
        outs.append(ops[update + "_spec"](*(decode_rows(t, P) for t in (q, k, v, g, beta)), ssm_states,
                                          md.spec_query_start_loc, md.spec_state_indices, md.num_accepted_tokens,
                                          use_qk_l2norm=True))
    elif md.num_decodes:
        outs.append(ops[update](*(decode_rows(t, P) for t in (q, k, v, g, beta)), ssm_states, md.decode_state_indices,
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


class DenseMLP:
    """down(silu(gate(x)) * up(x)) with the weights (names relative to ``layers.{i}.mlp.``, after `prefix`) in
    the engine dtype."""

    def __init__(self, params: dict, *, dtype: torch.dtype, device, prefix: str = ""):
        self.gate, self.up, self.down = (params[f"{prefix}{n}.weight"].detach().to(device, dtype) for n in PROJ)

    def __call__(self, h):
        return linear(torch.nn.functional.silu(linear(h, self.gate)) * linear(h, self.up), self.down)


class MoEMLP:
    """A mixture-of-experts MLP (see the module doc; `moe` a ``reference.config.MoESpec``) over
    rows h (T, d_model)."""

    def __init__(self, moe, params: dict, *, dtype: torch.dtype, device):
        self.moe = moe
        self.dtype = dtype
        self.score_dtype = torch.promote_types(dtype, torch.float32)
        w = lambda n: params[n].detach().to(device, dtype)  # noqa: E731
        self.router = w("router.weight")
        bias = params.get("router.bias")
        self.bias = None if bias is None else bias.detach().to(device, self.score_dtype)
        self.gate_up = torch.stack([torch.cat([w(f"experts.{e}.gate_proj.weight"), w(f"experts.{e}.up_proj.weight")])
                                    for e in range(moe.num_experts)]).contiguous()       # (E, 2 * I, d)
        self.down = torch.stack([w(f"experts.{e}.down_proj.weight")
                                 for e in range(moe.num_experts)]).contiguous()          # (E, d, I)
        self.shared = DenseMLP(params, dtype=dtype, device=device, prefix="shared.") if moe.shared_inter else None
        self.shared_gate = w("shared_gate.weight") if moe.shared_gate else None

    def route(self, h):
        """(expert ids (T, top_k), weights (T, top_k) in the score dtype) of rows h."""
        moe = self.moe
        logits = linear(h, self.router).to(self.score_dtype)
        if moe.router == "softmax":
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), moe.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            choice = scores + self.bias
            if moe.n_group > 1:
                T, G = choice.shape[0], moe.n_group
                grouped = choice.view(T, G, -1)
                best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), moe.topk_group, dim=-1).indices
                keep = torch.zeros(T, G, dtype=torch.bool, device=h.device).scatter_(1, best, True)
                choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, -1)
            ids = torch.topk(choice, moe.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if moe.router == "sigmoid" else 0.0))
        return ids, weights * moe.scaling

    def __call__(self, h):
        ids, weights = self.route(h)
        k = self.moe.top_k
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        weights = weights.reshape(-1)
        out = torch.zeros_like(h)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            pairs = order[start:start + c]
            start += c
            tokens = pairs // k
            gate, up = linear(h[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = linear(torch.nn.functional.silu(gate) * up, self.down[e])
            out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
        if self.shared is not None:
            shared = self.shared(h)
            if self.shared_gate is not None:
                shared = torch.sigmoid(linear(h, self.shared_gate)) * shared
            out = out + shared
        return out


def make_mlp(cfg, layer: int, params: dict, *, dtype: torch.dtype, device):
    """The MLP of hybrid decoder layer `layer` (`params`: its weights relative to ``layers.{i}.mlp.``, the rank's
    shard under tensor parallelism): a callable h (T, d_model) -> (T, d_model)."""
    if cfg.mlp_layer_types[layer] == "sparse":
        return MoEMLP(cfg.moe, params, dtype=dtype, device=device)
    return DenseMLP(params, dtype=dtype, device=device)
