"""What the engine's delta-rule mixers (``gdn``, ``kda``) share: the delta rule over a mixed step.

Prefill tokens go through the family's ``*_varlen`` op (reading and writing their slots' states), decode
rows through its ``*_update`` op; both take value-major state pools (num_slots, Hv, V, K) and normalise q
and k themselves (``use_qk_l2norm=True``, scale K ** -0.5). g and beta are handed over in the activation
dtype, as vLLM's Qwen3-Next and Kimi Linear layers do.
"""
from __future__ import annotations

import torch


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


def no_tp(family: str):
    """check_tp of a family whose weights the fast loader cannot split yet: tp_size 1 only."""
    def check_tp(cfg, tp_size: int) -> None:
        if tp_size != 1:
            raise ValueError(f"tp_size: expected 1 (tensor parallelism is not supported for the {family} family "
                             f"yet), got {tp_size}")
    return check_tp
