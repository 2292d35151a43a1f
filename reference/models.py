"""Reference language models: Mamba-1 / Falcon-Mamba / Mamba-2 causal LMs built from the reference mixers.

    x        = embedding[tokens]
    residual = x                                   (float32 at least when residual_in_fp32)
    for each layer:  residual = residual + mixer(rms_norm(residual, layers.i.norm.weight))
    logits   = rms_norm(residual, norm_f.weight) @ lm_head.weight^T   (lm_head tied or loaded)

State is explicit and per request: a `ModelState` holds, per layer, the conv states (S, conv_dim, K-1)
and the SSM states (S, ...) of S requests. Nothing is cached inside the model, so a whole generation
can be computed in float64, split anywhere, batched in any order.

    model = ReferenceLM.from_pretrained(folder, dtype=torch.float64)
    logits, state = model.prefill([[1, 2, 3], [4, 5]])        # logits: list of (L_i, vocab_size)
    logits, state = model.decode([7, 9], state)               # logits: (2, vocab_size)
    result = model.greedy_generate([1, 2, 3], 32)             # result.tokens, result.logits

`prefill` accepts a previous state (chunked prefill: continue each request from it). The mixer ops
come from an `ops` object (`reference.mixers.MixerOps`; default: the reference ops), so a model
runner can swap kernels in without changing this file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from reference.mixers import MixerOps, make_mixer, reference_ops
from reference.validate import fail


@dataclass
class ModelState:
    """Per-layer conv and SSM states of a batch of requests (request index first)."""
    conv: list
    ssm: list

    @property
    def batch(self) -> int:
        return int(self.conv[0].shape[0]) if self.conv else 0

    def select(self, indices: Sequence[int]) -> "ModelState":
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return ModelState([c.index_select(0, idx.to(c.device)) for c in self.conv],
                          [s.index_select(0, idx.to(s.device)) for s in self.ssm])

    @staticmethod
    def concat(states: Sequence["ModelState"]) -> "ModelState":
        n = len(states[0].conv)
        return ModelState([torch.cat([s.conv[i] for s in states]) for i in range(n)],
                          [torch.cat([s.ssm[i] for s in states]) for i in range(n)])

    def clone(self) -> "ModelState":
        return ModelState([c.clone() for c in self.conv], [s.clone() for s in self.ssm])


@dataclass
class Generation:
    tokens: list          # the n generated tokens
    logits: torch.Tensor  # (n, vocab_size): logits that chose token i (before it was appended)


class ReferenceLM:
    """A Mamba-family causal LM in plain PyTorch with explicit per-request state."""

    def __init__(self, cfg, params: dict, *, dtype: torch.dtype = torch.float64, ops: MixerOps | None = None,
                 device=None):
        from reference.loader import expected_parameters
        want = expected_parameters(cfg)
        missing = sorted(set(want) - set(params))
        extra = sorted(set(params) - set(want))
        if missing or extra:
            fail("params", "every model parameter (lm_head may be the embedding tensor)",
                 f"missing {missing}, unexpected {extra}")
        for k, s in want.items():
            if tuple(params[k].shape) != s:
                fail(f"params[{k!r}]", f"shape {s}", f"shape {tuple(params[k].shape)}")
        self.cfg = cfg
        self.dtype = dtype
        self.ops = ops or reference_ops()
        dev = device if device is not None else params["embedding.weight"].device
        self.device = torch.device(dev)
        cast = lambda t: t.detach().to(device=self.device, dtype=dtype)  # noqa: E731
        self.embedding = cast(params["embedding.weight"])
        self.lm_head = self.embedding if cfg.tie_embeddings else cast(params["lm_head.weight"])
        self.norm_f = cast(params["norm_f.weight"])
        self.norms = [cast(params[f"layers.{i}.norm.weight"]) for i in range(cfg.n_layer)]
        self.mixers = []
        for i in range(cfg.n_layer):
            pre = f"layers.{i}.mixer."
            mp = {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}
            self.mixers.append(make_mixer(cfg, mp, dtype=dtype, ops=self.ops, device=self.device))
        low = dtype in (torch.float16, torch.bfloat16)
        self.residual_dtype = torch.float32 if (cfg.residual_in_fp32 and low) else dtype

    @classmethod
    def from_pretrained(cls, folder, *, dtype: torch.dtype = torch.float64, ops: MixerOps | None = None,
                        device=None) -> "ReferenceLM":
        from reference.loader import load_checkpoint
        ck = load_checkpoint(folder)
        return cls(ck.config, ck.params, dtype=dtype, ops=ops, device=device)

    @property
    def params(self) -> dict:
        """Every parameter under our names, in the model's dtype (lm_head is the embedding when tied)."""
        out = {"embedding.weight": self.embedding,
               "lm_head.weight": self.embedding if self.cfg.tie_embeddings else self.lm_head,
               "norm_f.weight": self.norm_f}
        for i, (n, m) in enumerate(zip(self.norms, self.mixers)):
            out[f"layers.{i}.norm.weight"] = n
            out.update({f"layers.{i}.mixer.{k}": v for k, v in m.p.items()})
        return out

    # ------------------------------------------------------------------------------------------
    def zero_state(self, batch: int) -> ModelState:
        conv, ssm = [], []
        for m in self.mixers:
            c, s = m.zero_states(batch, self.device)
            conv.append(c)
            ssm.append(s)
        return ModelState(conv, ssm)

    def _tokens(self, tokens, arg: str) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.cfg.vocab_size):
            fail(arg, f"token ids in [0, {self.cfg.vocab_size})", f"ids in [{int(t.min())}, {int(t.max())}]")
        return t

    def _logits(self, residual: torch.Tensor) -> torch.Tensor:
        h = self.ops.rms_norm(residual.to(self.dtype), self.norm_f, self.cfg.norm_eps)
        return h @ self.lm_head.t()

    def _check_state(self, state: ModelState, batch: int, arg: str = "state"):
        if not isinstance(state, ModelState) or len(state.conv) != self.cfg.n_layer or len(state.ssm) != self.cfg.n_layer:
            fail(arg, f"a ModelState with {self.cfg.n_layer} layers", type(state).__name__)
        if state.batch != batch:
            fail(arg, f"states of {batch} requests", f"{state.batch}")

    def forward_packed(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, state: ModelState | None = None):
        """Packed prefill: tokens (T,), cu_seqlens (S+1,) -> (logits (T, vocab_size), new state of S requests)."""
        S = int(cu_seqlens.numel()) - 1
        if state is not None:
            self._check_state(state, S)
        residual = self.embedding[tokens].to(self.residual_dtype)
        conv_out, ssm_out = [], []
        for i, mixer in enumerate(self.mixers):
            h = self.ops.rms_norm(residual.to(self.dtype), self.norms[i], self.cfg.norm_eps)
            out, c, s = mixer.forward(h, cu_seqlens, None if state is None else state.conv[i],
                                      None if state is None else state.ssm[i])
            residual = residual + out.to(self.residual_dtype)
            conv_out.append(c)
            ssm_out.append(s)
        return self._logits(residual), ModelState(conv_out, ssm_out)

    def prefill(self, tokens_list: Sequence, state: ModelState | None = None):
        """Prefill several requests: -> (list of per-request logits (L_i, vocab_size), ModelState).

        With `state`, each request continues from its state (chunked prefill)."""
        if not isinstance(tokens_list, (list, tuple)) or not tokens_list:
            fail("tokens_list", "a non-empty list of token sequences", repr(tokens_list)[:80])
        seqs = [self._tokens(t, f"tokens_list[{i}]") for i, t in enumerate(tokens_list)]
        lengths = [int(s.numel()) for s in seqs]
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        logits, new_state = self.forward_packed(torch.cat(seqs), cu, state)
        return list(torch.split(logits, lengths)), new_state

    def decode(self, next_tokens, state: ModelState):
        """One decode step for B requests: next_tokens (B,) -> (logits (B, vocab_size), new ModelState)."""
        tok = self._tokens(next_tokens, "next_tokens")
        self._check_state(state, int(tok.numel()))
        residual = self.embedding[tok].to(self.residual_dtype)
        conv_out, ssm_out = [], []
        for i, mixer in enumerate(self.mixers):
            h = self.ops.rms_norm(residual.to(self.dtype), self.norms[i], self.cfg.norm_eps)
            out, c, s = mixer.step(h, state.conv[i], state.ssm[i])
            residual = residual + out.to(self.residual_dtype)
            conv_out.append(c)
            ssm_out.append(s)
        return self._logits(residual), ModelState(conv_out, ssm_out)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy choice over the real vocabulary (padding rows are never chosen)."""
        return logits[..., : self.cfg.vocab_size_unpadded].argmax(-1)

    def greedy_generate(self, prompt: Sequence[int], n: int, *, forced: Sequence[int] | None = None) -> Generation:
        """Greedy generation of `n` tokens after `prompt` (prefill, then n-1 decode steps).

        With `forced`, the model is teacher-forced on those tokens instead of its own choices (its
        logits at every step are still returned), e.g. to compare logits with an oracle's stream
        beyond a tie. `tokens` are always the model's own argmax choices.
        """
        if n < 1:
            fail("n", "a positive number of tokens", n)
        if forced is not None and len(forced) < n - 1:
            fail("forced", f"at least n - 1 = {n - 1} tokens", len(forced))
        logits, state = self.prefill([list(prompt)])
        if logits[0].shape[0] == 0:
            fail("prompt", "at least one token", "an empty prompt")
        step_logits = [logits[0][-1]]
        tokens = [int(self.argmax(step_logits[-1]))]
        for i in range(n - 1):
            feed = tokens[-1] if forced is None else int(forced[i])
            lg, state = self.decode([feed], state)
            step_logits.append(lg[0])
            tokens.append(int(self.argmax(lg[0])))
        return Generation(tokens=tokens, logits=torch.stack(step_logits))
