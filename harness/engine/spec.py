"""Speculative decoding in the engine: draft proposers, greedy verification, the mixers' decode path.

A speculative decode step (``EngineRunner(num_spec=k, proposer=...)``) feeds each decoding request its last
accepted token followed by up to k draft tokens from a proposer, runs the mixers' speculative decode ops
(``causal_conv1d_update_spec``, ``selective_state_update_spec``: every position's state in its own slot of
the request's slot group, the step starting from the slot of the previous step's last accepted position),
computes the logits of every position and verifies greedily (:func:`verify_greedy`): drafts are accepted
while each equals the argmax of the position before it; the step emits the accepted drafts and one more
token (the argmax after the last accepted one). The next step starts from the state after the last
accepted token: nothing is copied back, ``num_accepted_tokens`` names the slot (rollback by slot table).
Greedy verification makes the output exactly plain greedy decoding's, whatever the drafts.

Proposers (anything with ``propose(request_id, tokens, num_drafts) -> sequence of token ids``, at most
`num_drafts` of them, following `tokens` = the request's prompt and outputs so far):

* :class:`NoDrafts` proposes nothing (every step is a one-token step through the speculative ops);
* :class:`RandomProposer` proposes seeded random tokens (rarely accepted);
* :class:`OracleProposer` knows the plain greedy run's tokens and proposes the right one with
  probability ``p`` (else a wrong one), so that acceptance ranges over 0..k.

Families: a family's engine mixer runs speculative decode rows if its class names the ops it uses for them
(``SPEC_OPS``): Mamba-1, Falcon-Mamba and Mamba-2 (:class:`SpecDecodeMixin`: ``causal_conv1d_update_spec``,
``selective_state_update_spec``), Gated DeltaNet and KDA (:class:`SpecConvMixin` and the families' delta step:
``causal_conv1d_update_spec``, ``gated_delta_rule_update_spec`` / ``kda_update_spec``). The hybrids'
full-attention layers run a decode row's tokens like a prefill chunk (causal within the row); their keys and
values stay in the slot group's first slot (``HybridPool.alloc_group`` links the others to it, as the state
moves within the group), and after verification the request's KV length is cut back to the accepted positions
(the rejected drafts' keys and values are overwritten by the next step).
"""
from __future__ import annotations

import random
from typing import Hashable, Mapping, Protocol, Sequence

import torch

from harness.engine.metadata import decode_rows, prefill_rows
from reference.validate import check_int, fail

__all__ = ["DraftProposer", "NoDrafts", "RandomProposer", "OracleProposer", "verify_greedy", "SpecConvMixin",
           "SpecDecodeMixin", "spec_ops"]


class DraftProposer(Protocol):
    def propose(self, request_id: Hashable, tokens: tuple, num_drafts: int) -> Sequence[int]:
        """Up to `num_drafts` token ids to follow `tokens` (prompt + outputs so far)."""


class NoDrafts:
    """Proposes no drafts."""

    def propose(self, request_id, tokens, num_drafts):
        return ()


def _check_vocab(vocab_size) -> int:
    return check_int("vocab_size", vocab_size, 2)


def _rng(seed, request_id, n: int, j: int) -> random.Random:
    """The PRNG of draft j after n tokens of a request: the same scenario proposes the same drafts."""
    return random.Random(f"{seed}/{request_id!r}/{n}/{j}")


class RandomProposer:
    """Seeded random draft tokens in [0, vocab_size)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = _check_vocab(vocab_size)
        self.seed = seed

    def propose(self, request_id, tokens, num_drafts):
        n = len(tokens)
        return [_rng(self.seed, request_id, n, j).randrange(self.vocab_size) for j in range(num_drafts)]


class OracleProposer:
    """Proposes, for position n + j after n tokens, the token the plain greedy run has there with probability
    `p`, else another token (uniform over the rest of the vocabulary); past the end of that run, random
    tokens.

    Args:
      streams: request id -> its plain run's token stream (prompt + generated tokens); see :meth:`from_results`.
      vocab_size: tokens are drawn from [0, vocab_size).
      p: probability of proposing the right token, in [0, 1].
      seed: the PRNG seed (drafts depend on it, the request and the position only).
    """

    def __init__(self, streams: Mapping, vocab_size: int, p: float, seed: int = 0):
        if not isinstance(streams, Mapping):
            fail("streams", "a dict request id -> token stream", type(streams).__name__)
        self.vocab_size = _check_vocab(vocab_size)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            fail("p", "a probability in [0, 1]", repr(p))
        self.streams = {rid: tuple(int(t) for t in s) for rid, s in streams.items()}
        self.p = float(p)
        self.seed = seed

    @classmethod
    def from_results(cls, results: Mapping, vocab_size: int, p: float, seed: int = 0) -> "OracleProposer":
        """From an engine run's results ({request id: Result}): each request's prompt + generated tokens."""
        return cls({rid: tuple(r.prompt) + tuple(r.tokens) for rid, r in results.items()}, vocab_size, p, seed)

    def propose(self, request_id, tokens, num_drafts):
        stream = self.streams.get(request_id, ())
        n = len(tokens)
        out = []
        for j in range(num_drafts):
            rng = _rng(self.seed, request_id, n, j)
            if n + j >= len(stream):
                out.append(rng.randrange(self.vocab_size))
                continue
            right = stream[n + j]
            if rng.random() < self.p:
                out.append(right)
            else:
                wrong = rng.randrange(self.vocab_size - 1)
                out.append(wrong + (wrong >= right))
        return out


def verify_greedy(drafts: Sequence[int], choices: Sequence[int]) -> int:
    """How many of `drafts` greedy verification accepts: draft j is accepted while it equals ``choices[j]``
    (the argmax at the position before it) and every earlier draft was accepted. ``choices`` has one entry
    per fed position (``len(drafts) + 1``); the step emits ``choices[:accepted + 1]``."""
    if len(choices) != len(drafts) + 1:
        fail("choices", f"{len(drafts) + 1} argmax tokens (one per fed position)", len(choices))
    a = 0
    while a < len(drafts) and drafts[a] == choices[a]:
        a += 1
    return a


def spec_ops(mixer_class) -> tuple:
    """The ops a family's engine mixer calls for speculative decode rows (empty: it has none)."""
    return tuple(getattr(mixer_class, "SPEC_OPS", ()))


class SpecConvMixin:
    """The conv of speculative decode rows (mixed in before ``harness.engine.families.EngineMixer``): when the
    step's metadata has ``num_spec`` > 0, the decode rows' conv goes through ``causal_conv1d_update_spec`` with
    the metadata's slot table, ``num_accepted_tokens`` and the decode rows' ``spec_query_start_loc``; prefill
    tokens are unchanged."""

    SPEC_OPS = ("causal_conv1d_update_spec",)

    def conv(self, xbc, md, conv_states):
        if not getattr(md, "num_spec", 0) or not md.num_decodes:
            return super().conv(xbc, md, conv_states)
        P = md.num_prefill_tokens
        dec = self.ops["causal_conv1d_update_spec"](
            decode_rows(xbc, P), conv_states, self.conv_w, self.conv_b, md.spec_query_start_loc,
            md.spec_state_indices, md.num_accepted_tokens, activation="silu")
        if not md.num_prefills:
            return dec
        pre = self.ops["causal_conv1d_varlen"](
            prefill_rows(xbc, P), self.conv_w, self.conv_b, conv_states, md.prefill_query_start_loc,
            md.prefill_state_indices, md.prefill_has_initial_states, activation="silu")
        return torch.cat([pre, dec])



class SpecDecodeMixin(SpecConvMixin):
    """Speculative decode rows for an engine mixer of the Mamba families: the conv of :class:`SpecConvMixin`,
    and the decode rows' state update through ``selective_state_update_spec`` (:meth:`state_update`)."""

    SPEC_OPS = ("causal_conv1d_update_spec", "selective_state_update_spec")

    def state_update(self, md, ssm_states, x, dt, A, B, C, D, z, dt_bias, **kw):
        """The decode rows' state update: ``selective_state_update`` (one token per row, slot
        ``md.decode_state_indices``) or, in a speculative step, ``selective_state_update_spec``."""
        if getattr(md, "num_spec", 0):
            return self.ops["selective_state_update_spec"](
                ssm_states, x, dt, A, B, C, D, z, dt_bias, md.spec_query_start_loc, md.spec_state_indices,
                md.num_accepted_tokens, **kw)
        return self.ops["selective_state_update"](ssm_states, x, dt, A, B, C, D, z, dt_bias,
                                                  md.decode_state_indices, **kw)
