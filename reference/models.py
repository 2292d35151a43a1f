"""Reference language models: causal LMs of every family (Mamba-1 / Falcon-Mamba / Mamba-2, and the hybrid
Qwen3-Next / Kimi Linear) built from the reference mixers and attention layers.

    x        = embedding[tokens]
    residual = x                                   (float32 at least when residual_in_fp32)
    for each layer:  residual = residual + token_mixer(rms_norm(residual, layers.i.norm.weight))
                     residual = residual + mlp(rms_norm(residual, layers.i.mlp_norm.weight))  (if it has one:
                                                      dense or a mixture of experts, the family's make_mlp)
    logits   = rms_norm(residual, norm_f.weight) @ lm_head.weight^T   (lm_head tied or loaded)

The token mixer of a layer is the family's mixer or, in a hybrid model's full-attention layers, its
attention (the family's `layer_kinds`); the norms scale by (family.norm_offset + weight).

State is explicit and per request: a `ModelState` holds, per mixer layer, the conv states (S, conv_dim, K-1)
and the SSM states (S, ...) of S requests, and per attention layer each request's keys and values so far.
Nothing is cached inside the model, so a whole generation can be computed in float64, split anywhere,
batched in any order.

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
    """Per-layer states of a batch of requests: `conv` and `ssm` (request index first) of the mixer layers
    (None at attention layers); `kv` per attention layer a list of (keys (L, H_kv, Dk), values (L, H_kv, Dv))
    per request (None at mixer layers; `kv` None altogether for a model without attention layers)."""
    conv: list
    ssm: list
    kv: list | None = None

    def _kv(self, i):
        return None if self.kv is None else self.kv[i]

    @property
    def batch(self) -> int:
        for i, c in enumerate(self.conv):
            if c is not None:
                return int(c.shape[0])
            if self._kv(i) is not None:
                return len(self.kv[i])
        return 0

    def select(self, indices: Sequence[int]) -> "ModelState":
        indices = list(indices)
        idx = torch.as_tensor(indices, dtype=torch.long)
        pick = lambda t: None if t is None else t.index_select(0, idx.to(t.device))  # noqa: E731
        kv = None if self.kv is None else [None if k is None else [k[j] for j in indices] for k in self.kv]
        return ModelState([pick(c) for c in self.conv], [pick(s) for s in self.ssm], kv)

    @staticmethod
    def concat(states: Sequence["ModelState"]) -> "ModelState":
        n = len(states[0].conv)
        cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        kv = None if states[0].kv is None else [
            None if states[0].kv[i] is None else [r for s in states for r in s.kv[i]] for i in range(n)]
        return ModelState([cat([s.conv[i] for s in states]) for i in range(n)],
                          [cat([s.ssm[i] for s in states]) for i in range(n)], kv)

    def clone(self) -> "ModelState":
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        kv = None if self.kv is None else [None if k is None else [(a.clone(), b.clone()) for a, b in k]
                                           for k in self.kv]
        return ModelState([c(x) for x in self.conv], [c(x) for x in self.ssm], kv)


@dataclass
class Generation:
    tokens: list          # the n generated tokens
    logits: torch.Tensor  # (n, vocab_size): logits that chose token i (before it was appended)


class ReferenceLM:
    """A causal LM of any registered family in plain PyTorch with explicit per-request state."""

    def __init__(self, cfg, params: dict, *, dtype: torch.dtype = torch.float64, ops: MixerOps | None = None,
                 device=None):
        from reference import families
        from reference.loader import expected_parameters
        fam = families.get(cfg.family, "cfg.family")
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
        self._params = {k: cast(params[k]) for k in want if not (k == "lm_head.weight" and cfg.tie_embeddings)}
        self._params["lm_head.weight"] = self._params["lm_head.weight" if not cfg.tie_embeddings else "embedding.weight"]
        self.embedding = self._params["embedding.weight"]
        self.lm_head = self._params["lm_head.weight"]
        off = fam.norm_offset
        self.norm_f = self._params["norm_f.weight"] + off
        self.kinds = fam.layer_kinds(cfg)
        self.norms, self.mixers, self.attns, self.mlps = [], [], [], []
        for i in range(cfg.n_layer):
            self.norms.append(self._params[f"layers.{i}.norm.weight"] + off)
            sub = lambda pre: {k[len(pre):]: v for k, v in self._params.items() if k.startswith(pre)}  # noqa: E731
            mixer = attn = None
            if self.kinds[i] == "mixer":
                mixer = make_mixer(cfg, sub(f"layers.{i}.mixer."), dtype=dtype, ops=self.ops, device=self.device)
            else:
                attn = fam.make_attention(cfg, sub(f"layers.{i}.attn."), dtype=dtype, ops=self.ops, device=self.device)
            self.mixers.append(mixer)
            self.attns.append(attn)
            mlp = sub(f"layers.{i}.mlp.")
            self.mlps.append((self._params[f"layers.{i}.mlp_norm.weight"] + off, fam.make_mlp(cfg, i, mlp))
                             if mlp else None)
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
        return dict(self._params)

    @property
    def has_attention(self) -> bool:
        return "attention" in self.kinds

    # ------------------------------------------------------------------------------------------
    def zero_state(self, batch: int) -> ModelState:
        conv, ssm, kv = [], [], []
        for m in self.mixers:
            c, s = (None, None) if m is None else m.zero_states(batch, self.device)
            conv.append(c)
            ssm.append(s)
            kv.append([(None, None)] * batch if m is None else None)
        return ModelState(conv, ssm, kv if self.has_attention else None)

    def _tokens(self, tokens, arg: str) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.cfg.vocab_size):
            fail(arg, f"token ids in [0, {self.cfg.vocab_size})", f"ids in [{int(t.min())}, {int(t.max())}]")
        return t

    def _logits(self, residual: torch.Tensor) -> torch.Tensor:
        h = self.ops.rms_norm(residual.to(self.dtype), self.norm_f, self.cfg.norm_eps)
        return h @ self.lm_head.t()

    def _check_state(self, state: ModelState, batch: int, arg: str = "state"):
        if not isinstance(state, ModelState) or len(state.conv) != self.cfg.n_layer or len(state.ssm) != self.cfg.n_layer \
                or (state.kv is None) == self.has_attention:
            fail(arg, f"a ModelState with {self.cfg.n_layer} layers" + (" and key/value histories" if self.has_attention
                                                                         else ""), type(state).__name__)
        if state.batch != batch:
            fail(arg, f"states of {batch} requests", f"{state.batch}")

    def _layers(self, residual, run_layer):
        """The decoder layers over `residual`; run_layer(i, h) -> (token mixer output, conv, ssm, kv) of layer i."""
        conv_out, ssm_out, kv_out = [], [], []
        for i in range(self.cfg.n_layer):
            h = self.ops.rms_norm(residual.to(self.dtype), self.norms[i], self.cfg.norm_eps)
            out, c, s, kv = run_layer(i, h)
            residual = residual + out.to(self.residual_dtype)
            if self.mlps[i] is not None:
                norm, mlp = self.mlps[i]
                h = self.ops.rms_norm(residual.to(self.dtype), norm, self.cfg.norm_eps)
                residual = residual + mlp(h).to(self.residual_dtype)
            conv_out.append(c)
            ssm_out.append(s)
            kv_out.append(kv)
        return residual, ModelState(conv_out, ssm_out, kv_out if self.has_attention else None)

    def forward_packed(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, state: ModelState | None = None):
        """Packed prefill: tokens (T,), cu_seqlens (S+1,) -> (logits (T, vocab_size), new state of S requests)."""
        S = int(cu_seqlens.numel()) - 1
        if state is not None:
            self._check_state(state, S)

        def run_layer(i, h):
            if self.attns[i] is not None:
                out, kv = self.attns[i].forward(h, cu_seqlens, None if state is None else state.kv[i])
                return out, None, None, kv
            out, c, s = self.mixers[i].forward(h, cu_seqlens, None if state is None else state.conv[i],
                                               None if state is None else state.ssm[i])
            return out, c, s, None

        residual, new_state = self._layers(self.embedding[tokens].to(self.residual_dtype), run_layer)
        return self._logits(residual), new_state

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

        def run_layer(i, h):
            if self.attns[i] is not None:
                out, kv = self.attns[i].step(h, state.kv[i])
                return out, None, None, kv
            return (*self.mixers[i].step(h, state.conv[i], state.ssm[i]), None)

        residual, new_state = self._layers(self.embedding[tok].to(self.residual_dtype), run_layer)
        return self._logits(residual), new_state

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
