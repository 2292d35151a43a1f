"""Model runner: drives Scheduler -> build_metadata -> per-layer mixer backend -> lm_head -> greedy sample.

    runner = EngineRunner((cfg, params), "reference", num_slots=4, token_budget=32, cache_mode="all",
                          block_size=16, dtype=torch.float64)
    results = runner.run([Request("a", prompt, max_new_tokens=8), ...])
    results["a"].tokens, results["a"].step_logits, results["a"].final_state

One step
  1. ``Scheduler.schedule()`` picks decodes, prefill chunks and new requests (admission seeds a slot from
     the prefix cache: the longest cached block-aligned prefix, leaving >= 1 prompt token to compute);
  2. decode rows are padded with pad requests (slot PAD_SLOT_ID) up to a multiple of
     ``decode_pad_multiple`` (as CUDA-graph batch buckets do);
  3. ``harness.engine.metadata.build_metadata`` (looked up on the module at every step, so a patched
     builder is what runs) gives query_start_loc, state_indices, has_initial_states, snapshot positions;
  4. embedding -> per layer: ``residual += backend(rms_norm(residual), md, pool.conv(l), pool.recurrent(l))``
     (the backend's 3-tuple is unpacked here) -> final norm -> lm_head on the sampling rows -> argmax
     over the unpadded vocabulary. Hybrid models (the family's ``layer_kinds``): the pool is a
     ``harness.engine.attention.HybridPool`` whose state pool holds the mixer layers only; an attention
     layer runs the family's attention over the pool's paged keys and values (pages reserved up to each
     request's end before the step, lengths advanced after it); layers with an MLP add
     ``mlp(rms_norm(residual))`` (dense or a mixture of experts: ``harness.engine.families._delta.make_mlp``);
     the norms scale by the family's norm_offset + weight;
  5. prefix-cache snapshots: the scheduler's chunk sizes are adjusted (through its ``chunk_fn``) for
     TRACKED requests: in cache mode ``all`` a prefill chunk never crosses a block boundary; in mode
     ``align`` a chunk that crosses block boundaries (and is not the prompt's last) is shortened to end on
     the last one it crosses (as engines align chunks to blocks). Every snapshot position of the
     metadata is then the END of its step, and the snapshot is the slot's state after the step
     (``pool.snapshot(slot)``), inserted under ``tokens[:pos]`` (mode ``none`` never snapshots). A
     snapshot position that is not a step end is a RuntimeError (it would need a mid-step state);
  6. ``Scheduler.update`` with the sampled tokens.

Results per request (:class:`Result`): generated tokens, the logits that chose each token (float64 on
the CPU), the request's final state (the slot's state after its last fed token, as a ``Snapshot``),
the tokens restored from the prefix cache at admission, its steps, and with ``record_states`` the
state after every step keyed by absolute position.

Tensor parallelism (``tp``, a ``harness.engine.tp.TensorParallel`` of size > 1, inside an initialised
torch.distributed group; ``harness.engine.tp.launch`` starts one): every rank builds the runner with its
rank; the mixers run on the rank's shard of the weights (whole parameters are cut on each rank) and its
slice of every state (the pool holds the per-rank spec, so results' states and prefix-cache snapshots are
the rank's slices); embeddings, norms and lm_head are replicated; rank 0's sampled tokens are broadcast, so
every rank schedules the same steps. Families that cannot be split refuse ``tp`` with a ValueError naming
``tp_size`` (the family's ``check_tp``) before anything is built.

Speculative decoding (``num_spec`` = k > 0, with a ``proposer``; see ``harness.engine.spec``): each request
holds 1 + k pool slots (``num_slots`` stays the number of requests; the pool has ``num_slots * (1 + k)``
slots). A decode entry feeds the last accepted token and up to k drafts (the proposer's, fewer near the
request's end or the budget's); the mixers run the speculative decode ops, every fed position gets logits,
greedy verification accepts drafts while each equals the argmax before it, and the request emits the
accepted drafts plus one token (their logits in ``step_logits``, one row per emitted token; ``Result.accepted``
lists (step, drafts, accepted)). The next step starts from the slot of the last accepted position. Snapshots of
a speculative decode entry are taken after verification, at the block positions the accepted tokens reach
(mode ``all``; mode ``align``: the accepted end on a block boundary), each from its position's slot;
``record_states`` records every accepted position. A family whose engine mixer has no speculative decode path
raises NotImplementedError.

Index checks: with an implementation that does not read device values on the host (`Impl.reads_host` False:
ours), the step's offsets and slot ids are checked in one host read (`_check_metadata`) and the layers run inside
`harness.ops.no_index_checks()`, so an eager step makes no device-to-host read per op call; the peers'
adapters, which read slot ids to decline what they cannot run, keep every op call's checks.

Free slots are NaN-filled at start and whenever a request finishes (``poison_free_slots``), so an op
that reads a slot it was told not to (``has_initial_state`` False, pad rows) produces NaN.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from harness.engine import backend as backend_mod
from harness.engine import families as engine_families
from harness.engine import metadata as metadata_mod
from harness.engine import spec as spec_mod
from harness.engine.attention import HybridPool
from harness.engine.families._delta import make_mlp
from harness.engine.pool import PAD_SLOT_ID, Snapshot, StatePool
from harness.engine.prefix_cache import PrefixCache
from harness.engine.scheduler import BatchEntry, Request, Scheduler
from harness.ops import _checks as ck
from harness.ops import no_index_checks
from reference.cache import check_block_size, check_cache_mode, snapshot_positions
from reference.validate import check_int, fail

__all__ = ["EngineRunner", "Result", "model_parts", "state_spec", "random_chunk_fn"]


@functools.lru_cache(maxsize=None)
def _promotes_to(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether a + b of dtypes a and b is in a (torch's promotion, looked up once per pair: an eager step adds
    a residual per layer)."""
    return torch.promote_types(a, b) == a


@dataclass
class Result:
    request_id: Hashable
    prompt: tuple
    tokens: list = field(default_factory=list)
    step_logits: list = field(default_factory=list)  # list of (vocab,) float64 CPU tensors, stacked at the end
    final_state: Snapshot | None = None
    num_cached: int = 0
    steps: list = field(default_factory=list)  # (step index, start, num_tokens fed, is_decode)
    states: dict = field(default_factory=dict)  # position -> Snapshot (record_states only)
    accepted: list = field(default_factory=list)  # speculative decoding: (step index, drafts, accepted drafts)

    @property
    def fed_tokens(self) -> tuple:
        """Tokens whose state the request ends with: prompt + outputs except the last."""
        return tuple(self.prompt) + tuple(self.tokens[:-1])


def model_parts(model):
    """(cfg, params) of a model given as (cfg, params), an object with .cfg/.params, or a ReferenceLM."""
    if isinstance(model, tuple) and len(model) == 2:
        return model
    if hasattr(model, "cfg") and hasattr(model, "params"):  # e.g. reference.models.ReferenceLM
        return model.cfg, model.params
    fail("model", "(cfg, params), an object with .cfg and .params, or a reference ReferenceLM", type(model).__name__)


def state_spec(cfg, conv_dtype: torch.dtype, recurrent_dtype: torch.dtype, tp_size: int = 1):
    """The pool spec of a model config (one layer, one rank of `tp_size`), as the config's family defines it."""
    from reference import families
    return families.get(cfg.family, "cfg.family").state_spec(cfg, conv_dtype=conv_dtype,
                                                             recurrent_dtype=recurrent_dtype, tp_size=tp_size)


def random_chunk_fn(seed: int) -> Callable:
    """A deterministic chunk chooser: request `rid` at `start` gets a chunk in 1..cap from a PRNG seeded
    by (seed, rid, start); the same scenario gives the same chunks in every run."""
    def fn(rid, start, cap):
        return random.Random(f"{seed}/{rid!r}/{start}").randint(1, cap)
    return fn


class EngineRunner:
    """A small serving engine over one implementation (see module doc).

    Args:
      model: (cfg, params) with our parameter names, or a reference ReferenceLM.
      impl: an ``Impl`` or a registered implementation name.
      num_slots: max concurrently running requests (the pool holds num_slots * (1 + num_spec) slots).
      token_budget: max tokens per step (>= 1).
      cache_mode: prefix-cache mode "none" | "align" | "all".
      block_size: prefix-cache block size (positive multiple of 8).
      chunk_size: SSD chunk size for ``ssd_varlen`` and the metadata (default: cfg.chunk_size).
      dtype: activation/weight dtype.
      state_dtype: recurrent-state dtype (default float32; float64 when dtype is float64); the conv
        state uses ``dtype``.
      device: torch device.
      cache_capacity: max prefix-cache snapshots.
      layout: pool layout "layer_major" | "page_major"; conv_channels_last: see StatePool.
      max_model_len: max len(prompt) + max_new_tokens per request (None: unlimited).
      chunk_fn: ``chunk_fn(request_id, start, max_tokens) -> n`` prefill chunk chooser (default: as many
        as fit the budget); then aligned to block boundaries for tracked requests (see step 5).
      decode_pad_multiple: pad decode rows with pad requests up to a multiple of this.
      record_states: keep every request's state after every step (Result.states).
      poison_free_slots: NaN-fill free slots (see module doc).
      tp: a ``harness.engine.tp.TensorParallel`` (default: one rank); see the module doc.
      num_spec: speculative tokens per decode step (0: plain decoding); see the module doc.
      proposer: with num_spec > 0, the draft proposer (``propose(request_id, tokens, num_drafts)``, e.g.
        ``harness.engine.spec.OracleProposer``).
    """

    def __init__(self, model, impl, *, num_slots: int = 4, token_budget: int = 64, cache_mode: str = "none",
                 block_size: int = 16, chunk_size: int | None = None, dtype: torch.dtype = torch.float32,
                 state_dtype: torch.dtype | None = None, device="cpu", cache_capacity: int = 64,
                 layout: str = "layer_major", conv_channels_last: bool = False, max_model_len: int | None = None,
                 chunk_fn: Callable | None = None, decode_pad_multiple: int = 1, record_states: bool = False,
                 poison_free_slots: bool = True, tp=None, num_spec: int = 0, proposer=None):
        from harness.engine.tp import SINGLE, TensorParallel
        from harness.impls import registry
        if isinstance(impl, str):
            impl = registry.get(impl)
        cfg, params = model_parts(model)
        tp = SINGLE if tp is None else tp
        if not isinstance(tp, TensorParallel):
            fail("tp", "None or a harness.engine.tp.TensorParallel", type(tp).__name__)
        engine_families.get(cfg.family, "cfg.family").check_tp(cfg, tp.size)
        check_int("num_slots", num_slots, 1)
        check_int("token_budget", token_budget, 1)
        check_int("decode_pad_multiple", decode_pad_multiple, 1)
        check_cache_mode(cache_mode)
        check_block_size(block_size)
        if chunk_size is not None:
            check_int("chunk_size", chunk_size, 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            fail("dtype", "a floating-point torch.dtype", repr(dtype))
        check_int("num_spec", num_spec, 0)
        if num_spec:
            self._check_spec(cfg, impl, proposer)
        elif proposer is not None:
            fail("proposer", "None without speculative decoding (num_spec=0)", type(proposer).__name__)
        self.num_spec = num_spec
        self.proposer = proposer
        self.cfg = cfg
        self.tp = tp
        self.impl = impl
        self.dtype = dtype
        self.device = torch.device(device)
        self.chunk_size = int(chunk_size or cfg.chunk_size or 256)
        self.record_states = record_states
        self.poison_free_slots = poison_free_slots
        self.decode_pad_multiple = decode_pad_multiple
        rec_dtype = state_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        from reference import families as ref_families
        fam = ref_families.get(cfg.family, "cfg.family")
        efam = engine_families.get(cfg.family, "cfg.family")
        self.kinds = fam.layer_kinds(cfg)
        self.layer_index = [sum(1 for k in self.kinds[:i] if k == kind) for i, kind in enumerate(self.kinds)]
        n_mixer = self.kinds.count("mixer")
        self.spec = state_spec(cfg, dtype, rec_dtype, tp.size)
        pool_slots = num_slots * (1 + num_spec)  # a request's slot group (reference.cache.slots_needed)
        if "attention" in self.kinds:
            self.pool = HybridPool(self.spec, n_mixer, pool_slots, kv_spec=fam.kv_spec(cfg, dtype),
                                   num_attention_layers=self.kinds.count("attention"), page_size=block_size,
                                   device=self.device, layout=layout, conv_channels_last=conv_channels_last)
        else:
            self.pool = StatePool(self.spec, n_mixer, pool_slots, device=self.device, layout=layout,
                                  conv_channels_last=conv_channels_last)
        self.cache = PrefixCache(cache_mode, block_size, cache_capacity)
        self._user_chunk_fn = chunk_fn
        self.sched = Scheduler(self.pool, token_budget, max_model_len=max_model_len, prefix_cache=self.cache,
                               chunk_fn=self._chunk, max_num_seqs=num_slots, num_spec=num_spec,
                               draft_fn=self._draft if num_spec else None)
        cast = lambda t: t.detach().to(self.device, dtype)  # noqa: E731
        need = ["embedding.weight", "lm_head.weight", "norm_f.weight"]
        need += [f"layers.{i}.{k}" for i in range(cfg.n_layer) for k in fam.layer_parameter_shapes(cfg, i)
                 if not k.startswith("mixer.")]  # the mixer's own are checked by its backend
        for k in need:
            if k not in params:
                fail("params", f"a {k!r} entry", "none")
        off = efam.norm_offset
        self.embedding = cast(params["embedding.weight"])
        self.lm_head = cast(params["lm_head.weight"])
        self.norm_f = cast(params["norm_f.weight"]) + off
        self.norms = [cast(params[f"layers.{i}.norm.weight"]) + off for i in range(cfg.n_layer)]
        self.backends, self.mlps = [], []
        for i in range(cfg.n_layer):
            sub = lambda pre: {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}  # noqa: E731
            if self.kinds[i] == "mixer":
                self.backends.append(backend_mod.make_backend(cfg, sub(f"layers.{i}.mixer."), impl, dtype=dtype,
                                                              device=self.device, chunk_size=self.chunk_size,
                                                              **({"tp": tp} if tp.size > 1 else {})))
            else:
                self.backends.append(efam.attention(cfg, sub(f"layers.{i}.attn."), impl.ops, dtype=dtype,
                                                    device=self.device, tp=tp))
            mlp = tp.shard_mlp(sub(f"layers.{i}.mlp."))
            self.mlps.append((cast(params[f"layers.{i}.mlp_norm.weight"]) + off,
                              make_mlp(cfg, i, mlp, dtype=dtype, device=self.device)) if mlp else None)
        low = dtype in (torch.float16, torch.bfloat16)
        self.residual_dtype = torch.float32 if (cfg.residual_in_fp32 and low) else dtype
        self._requests: dict = {}
        self.snapshot_log: list = []  # (request_id, prefix tokens, Snapshot) in insertion order
        self.step_count = 0
        if poison_free_slots:
            self.pool.fill_free_()

    # ------------------------------------------------------------------ scheduling hooks
    def _chunk(self, rid, start: int, cap: int) -> int:
        n = cap if self._user_chunk_fn is None else self._user_chunk_fn(rid, start, cap)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cap:
            fail("chunk_fn", f"a chunk size in 1..{cap} (request {rid!r} at {start})", repr(n))
        req = self._requests.get(rid)
        if req is None or not req.track:
            return n
        bs = self.cache.block_size
        if self.cache.mode == "all":  # never cross a block boundary: every boundary is a step end
            n = min(n, (start // bs + 1) * bs - start)
        elif self.cache.mode == "align" and start + n < len(req.prompt):
            aligned = (start + n) // bs * bs  # end the chunk on the last block boundary it crosses
            if aligned > start:
                n = aligned - start
        return n

    # ------------------------------------------------------------------ speculative decoding
    @staticmethod
    def _check_spec(cfg, impl, proposer) -> None:
        """num_spec > 0: the family's mixer has a speculative decode path, the implementation its ops, and
        a proposer is given."""
        ops = spec_mod.spec_ops(engine_families.get(cfg.family, "cfg.family").mixer)
        if not ops:
            raise NotImplementedError(f"speculative decoding: the {cfg.family} family's engine mixer has no "
                                      f"speculative decode path")
        lacking = [o for o in ops if o not in impl.ops]
        if lacking:
            fail("impl", f"an implementation providing {list(ops)} (speculative decoding)",
                 f"{impl.name!r} lacks {lacking}")
        if not callable(getattr(proposer, "propose", None)):
            fail("proposer", "a draft proposer with propose(request_id, tokens, num_drafts) (harness.engine.spec)",
                 type(proposer).__name__)

    def _draft(self, rid, tokens, k):
        """The proposer's drafts for request `rid`, checked: token ids of the vocabulary."""
        from harness.engine.scheduler import token_id
        got = self.proposer.propose(rid, tuple(tokens), k)
        if isinstance(got, torch.Tensor):
            got = got.tolist() if got.dim() == 1 else got
        if isinstance(got, (str, bytes, dict)) or not isinstance(got, Sequence):
            fail("proposer", f"a sequence of at most {k} draft token ids (request {rid!r})", repr(got)[:60])
        ids = tuple(token_id(f"proposer drafts[{j}] (request {rid!r})", t) for j, t in enumerate(got))
        V = self.cfg.vocab_size
        if any(t >= V for t in ids):
            fail("proposer", f"draft token ids in [0, {V}) (request {rid!r})", list(ids))
        return ids

    # ------------------------------------------------------------------ seeding from outside
    def seed(self, prefix_tokens: Sequence[int], snapshot) -> None:
        """Put a state snapshot for `prefix_tokens` into the prefix cache (e.g. one taken from another
        runner of the same model). Checked now: another model's / layout's snapshot, a prefix that is
        not a whole number of blocks, or a snapshot whose token count differs is a ValueError, and
        nothing changes."""
        toks = tuple(int(t) for t in prefix_tokens)
        if self.cache.mode == "none":
            fail("cache_mode", "'align' or 'all' to seed the prefix cache", "'none'")
        if not toks or len(toks) % self.cache.block_size:
            fail("prefix_tokens", f"a non-empty multiple of block_size={self.cache.block_size} tokens",
                 f"{len(toks)} tokens")
        self.pool.check_snapshot(snapshot)
        n = getattr(snapshot, "num_tokens", None)
        if n is not None and n != len(toks):
            fail("snapshot", f"the state after {len(toks)} tokens", f"a snapshot of {n} tokens")
        snap = Snapshot({k: v.detach().clone() for k, v in snapshot.items()},
                        getattr(snapshot, "model_key", self.pool.model_key), len(toks))
        self.cache.insert(toks, snap)

    # ------------------------------------------------------------------ run
    def _check_requests(self, requests) -> list[Request]:
        reqs = []
        seen = set()
        V = self.cfg.vocab_size
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                if isinstance(r, (tuple, list)) and len(r) in (3, 4):
                    r = Request(*r)
                else:
                    fail(f"requests[{i}]", "a Request or (id, prompt, max_new_tokens[, track])", repr(r)[:60])
            if r.id in seen or r.id in self._requests:
                fail(f"requests[{i}]", "a new request id", f"duplicate id {r.id!r}")
            seen.add(r.id)
            bad = [t for t in r.prompt if not 0 <= t < V]
            if bad:
                fail(f"requests[{i}].prompt", f"token ids in [0, {V})", f"{bad[:4]} (request {r.id!r})")
            mml = self.sched.max_model_len
            if mml is not None and len(r.prompt) + r.max_new_tokens > mml:
                fail(f"requests[{i}]", f"len(prompt) + max_new_tokens <= max_model_len={mml}",
                     f"{len(r.prompt)} + {r.max_new_tokens} (request {r.id!r})")
            reqs.append(r)
        return reqs

    def run(self, requests: Sequence[Request]) -> dict:
        """Run `requests` to completion; returns {request_id: Result}. Every request is validated before
        anything runs (bad input changes no state)."""
        reqs = self._check_requests(requests)
        results = {}
        for r in reqs:
            self._requests[r.id] = r
            results[r.id] = Result(r.id, r.prompt)
            self.sched.add(r)
        started = set()
        while (batch := self.sched.schedule()) is not None:
            self._step(batch, results, started)
        for res in results.values():
            res.step_logits = torch.stack(res.step_logits) if res.step_logits else torch.zeros(0, self.cfg.vocab_size)
        return results

    def _add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x in the residual's dtype; where that dtype is the promoted one (an fp32 residual, a bf16
        x), one kernel that reads x as it is (the same sums as casting x first, without the cast's launch)."""
        if _promotes_to(residual.dtype, x.dtype):
            return residual + x
        return residual + x.to(residual.dtype)

    def _rms(self, x, w):
        return self.impl.ops["gated_rms_norm"](engine_families.cast(x, self.dtype).contiguous(), w, None,
                                               eps=float(self.cfg.norm_eps))

    def _check_metadata(self, md, num_tokens: int) -> list:
        """The index checks the ops would make of this step's metadata (`harness.ops._checks`: offsets
        [0, ..., T] non-decreasing; slot ids, the speculative slot table's too, slots of the pool or the pad id,
        the live ones distinct), once, from one device-to-host read (the step reads the offsets anyway).
        Returns query_start_loc's values."""
        table = md.spec_state_indices.reshape(-1) if md.spec_state_indices is not None else None
        parts = [md.query_start_loc, md.state_indices] + ([table] if table is not None else [])
        values = ck.read_host(*parts)
        n = self.pool.num_slots
        S = ck.check_qsl(md.query_start_loc, num_tokens, values=values[0])
        ck.check_indices("state_indices", md.state_indices, S, n, PAD_SLOT_ID, values=values[1])
        if table is not None:
            ck.check_indices("spec_state_indices", table, table.shape[0], n, PAD_SLOT_ID, values=values[2])
        return values[0] if isinstance(values[0], list) else values[0].tolist()

    def _add_rms(self, x, residual, w):
        """residual += x (in the residual's dtype), then the RMSNorm of the sum in the engine dtype: one launch
        (`add_rms_norm`) for the residual add of one block and the pre-norm of the next."""
        return self.impl.ops["add_rms_norm"](engine_families.cast(x, self.dtype), residual, w,
                                             eps=float(self.cfg.norm_eps))

    def forward(self, tokens: torch.Tensor, md) -> torch.Tensor:
        """Hidden states after the last layer's residual add, for the packed step tokens (T,)."""
        # a fresh tensor (indexing copies): the residual adds below write it in place
        residual = self.embedding[tokens].to(self.residual_dtype)
        n = len(self.backends)
        h = self._rms(residual, self.norms[0]) if n else None
        for i, be in enumerate(self.backends):
            j = self.layer_index[i]
            if self.kinds[i] == "mixer":
                out, conv, ssm = be(h, md, self.pool.conv(j), self.pool.recurrent(j))
            else:
                out = be.forward(h, md, self.pool.kv, j)  # the norms give the engine dtype
            if self.mlps[i] is not None:
                norm, mlp = self.mlps[i]
                out = self.tp.all_reduce(mlp(self._add_rms(out, residual, norm)))
            if i + 1 < n:
                h = self._add_rms(out, residual, self.norms[i + 1])
            else:
                residual = self._add(residual, out)
        return residual

    def _step(self, batch, results, started):
        entries = list(batch.entries)
        ndec = sum(1 for e in entries if e.is_decode)
        npad = (-ndec) % self.decode_pad_multiple if ndec else 0
        pads = [BatchEntry(("__pad__", k), PAD_SLOT_ID, 0, 1, True, (0,), sample=False, track=False)
                for k in range(npad)]
        all_entries = tuple(entries) + tuple(pads)
        md = metadata_mod.build_metadata(all_entries, mode=self.cache.mode, block_size=self.cache.block_size,
                                         chunk_size=self.chunk_size, device=self.device,
                                         **({"num_spec": self.num_spec} if self.num_spec else {}))
        tokens = torch.tensor([t for e in all_entries for t in e.tokens], dtype=torch.long, device=self.device)
        kv = getattr(self.pool, "kv", None)
        if kv is not None:
            for e in entries:
                kv.reserve(e.slot, e.end)
        if getattr(self.impl, "reads_host", True):
            residual = self.forward(tokens, md)
            qsl = md.query_start_loc.tolist()
        else:  # the step's offsets and slot ids checked here, in one read: none per op call
            qsl = self._check_metadata(md, tokens.shape[0])
            with no_index_checks():
                residual = self.forward(tokens, md)
        if kv is not None:
            for e in entries:
                kv.set_length(e.slot, e.end)
        # logits rows: a sampling entry's last position; every position of a speculative decode entry
        spans, rows = {}, []
        for i, e in enumerate(entries):
            if e.sample:
                lo = qsl[i] if e.is_spec else qsl[i + 1] - 1
                spans[i] = (len(rows), qsl[i + 1] - lo)
                rows.extend(range(lo, qsl[i + 1]))
        sampled, emitted = {}, {}
        if rows:
            h = self._rms(residual[rows], self.norm_f)
            logits = torch.nn.functional.linear(h, self.lm_head).to(torch.float64).cpu()
            choice = logits[:, : self.cfg.vocab_size_unpadded].argmax(-1)
            if self.tp.size > 1:  # rank 0 decides: the ranks' logits may differ in the last bits
                choice = self.tp.broadcast(choice.to(self.device)).cpu()
            choice = [int(c) for c in choice.tolist()]
            for i, (lo, n) in spans.items():
                e, res = entries[i], results[entries[i].request_id]
                if e.is_spec:  # greedy verification: the accepted drafts, then the argmax after them
                    a = spec_mod.verify_greedy(e.drafts, choice[lo:lo + n])
                    res.accepted.append((self.step_count, len(e.drafts), a))
                    toks = choice[lo:lo + a + 1]
                    sampled[e.request_id] = toks
                else:
                    toks = choice[lo:lo + 1]
                    sampled[e.request_id] = toks[0]
                emitted[i] = toks
                res.step_logits.extend(logits[lo:lo + len(toks)])
                res.tokens.extend(toks)
        for i, e in enumerate(entries):
            res = results[e.request_id]
            if e.request_id not in started:
                started.add(e.request_id)
                res.num_cached = e.start
            res.steps.append((self.step_count, e.start, e.num_tokens, e.is_decode))
            if e.is_spec:
                if kv is not None:  # the keys and values of the accepted positions count, the rest is rewritten
                    kv.set_length(e.slot, e.start + len(emitted[i]))
                self._spec_snapshots(e, emitted[i], res)
                continue
            for pos in md.snapshot_positions[i]:
                if pos != e.end:
                    raise RuntimeError(f"snapshot at position {pos} inside the step [{e.start}, {e.end}) of request "
                                       f"{e.request_id!r}: the runner only snapshots at step ends")
                prefix = self.sched.tokens(e.request_id)[:pos]
                snap = self.pool.snapshot(e.slot, num_tokens=pos)
                self.snapshot_log.append((e.request_id, prefix, snap))
                self.cache.insert(prefix, snap)
            if self.record_states:
                res.states[e.end] = self.pool.snapshot(e.slot, num_tokens=e.end)
            if e.sample and len(res.tokens) >= self._requests[e.request_id].max_new_tokens:
                res.final_state = self.pool.snapshot(e.slot, num_tokens=e.end)
        done = self.sched.update(batch, sampled)
        self.step_count += 1
        if done and self.poison_free_slots:
            self.pool.fill_free_()

    def _spec_snapshots(self, e, toks, res) -> None:
        """After verification of a speculative decode entry that emitted `toks`: the fed tokens up to the last
        accepted one count (positions e.start + 1 .. e.start + len(toks)), the state after position j lies in
        spec_slots[j]. Prefix-cache snapshots at the block positions they reach, recorded states, final state."""
        n = len(toks)
        end = e.start + n
        slot = lambda pos: e.spec_slots[pos - e.start - 1]  # noqa: E731
        if e.track and self.cache.mode != "none":
            stream = self.sched.tokens(e.request_id) + tuple(e.drafts[:n - 1])  # the accepted fed tokens
            for pos in snapshot_positions(self.cache.mode, e.start, n, self.cache.block_size):
                snap = self.pool.snapshot(slot(pos), num_tokens=pos)
                self.snapshot_log.append((e.request_id, stream[:pos], snap))
                self.cache.insert(stream[:pos], snap)
        if self.record_states:
            for pos in range(e.start + 1, end + 1):
                res.states[pos] = self.pool.snapshot(slot(pos), num_tokens=pos)
        if len(res.tokens) >= self._requests[e.request_id].max_new_tokens:
            res.final_state = self.pool.snapshot(slot(end), num_tokens=end)
