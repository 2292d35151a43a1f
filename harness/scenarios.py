"""Engine scenario properties: each written ONCE as a plain function ``prop_*(case, make_runner, check=None)``.

A *scenario* (:class:`Scenario`) is a set of requests on a tiny random model (family, seed), run in
one or more *waves* (each wave is one ``EngineRunner.run`` call on the same runner, so a later wave
can be seeded from the prefix-cache snapshots of an earlier one), with a token budget, chunk sizes
(a deterministic chooser seeded by ``chunk_seed``: boundaries anywhere, including chunks shorter than
the conv width), a cache mode and block size, a pool size and layout (layer-major or page-major; conv
slots row-major or channels-last, as vLLM keeps them: ``conv_layout``), and decode padding.

``make_runner`` is a :class:`RunnerFactory` (implementation, dtype, device): ``make_runner(model, **kw)``
builds an ``EngineRunner``. Every op call of its engine is checked against the pad-row contract of
``harness.ops`` (a pad request's output rows are exactly 0; they go on into the next layer): a call that
leaves them otherwise fails the property that ran it. The oracle is the float64 reference model
(``reference.models.ReferenceLM``) run ONE request at a time over the request's whole token stream (no chunking,
no batching, no cache).

Properties (each raises AssertionError with a message that says what differs, where, and the case):
  * :func:`prop_matches_reference` -- every request's step logits, greedy tokens (tie-aware), final
    state and every prefix-cache snapshot equal the oracle's;
  * :func:`prop_split_invariance` -- prefill/decode split and chunked prefill: the case run with its
    chunk boundaries equals the oracle (incl. the state after EVERY step) and the same engine run with
    whole prefills;
  * :func:`prop_seeding_equivalence` -- requests seeded from the prefix cache (mixing seeded, unseeded,
    tracked, untracked) equal computing from scratch (the oracle and the engine with cache mode none);
  * :func:`prop_batch_invariance` -- a request's results do not depend on the other requests: packed ==
    one-by-one == permuted == with half the others removed;
  * :func:`prop_determinism` -- the same scenario twice is bitwise equal (only for implementations
    that claim ``deterministic``).

Token agreement is tie-aware: a greedy choice may differ from the oracle's only where the oracle's
logits of the two tokens are within the logit tolerance; the oracle is teacher-forced on the engine's
tokens so the comparison continues past such a tie.

Suites wrap the properties with hypothesis (:func:`scenarios` is the strategy); ``harness selftest``
reuses them against deliberately broken engines. A scenario needs from an implementation only the ops of
its family (:func:`engine_ops`, as ``harness.engine.families`` lists them).
"""
from __future__ import annotations

import math
import random
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
from hypothesis import currently_in_test_context, event, target
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from harness.testing.checks import Tolerance, compare, describe_tolerance, tolerance_for
from harness.engine import families as engine_families
from harness.engine.pool import PAD_SLOT_ID
from harness.engine.runner import EngineRunner, random_chunk_fn
from harness.engine.scheduler import Request
from reference import families
from reference.loader import ModelConfig, expected_parameters

FAMILIES = tuple(n for n in families.names() if families.get(n).whole_models)  # families with whole models
MODES = ("none", "align", "all")
# conv-state slots: row-major (conv_dim, K-1), or channels-last ((K-1, conv_dim) in memory, vLLM's layout;
# harness.testing.CONV_LAYOUTS "channels_last" at op level)
CONV_SLOT_LAYOUTS = ("row_major", "channels_last")

# ============================================================================ tiny models

def tiny_config(family: str, *, d_model: int = 16, n_layer: int = 2, vocab: int = 60, d_state: int | None = None,
                d_conv: int = 4, chunk_size: int = 8) -> ModelConfig:
    """A tiny model config of `family` (vocab padded to a multiple of 8, so padding rows exist); the
    family's module chooses its own tiny sizes."""
    return families.get(family).tiny_config(d_model=d_model, n_layer=n_layer, vocab=vocab, d_state=d_state,
                                            d_conv=d_conv, chunk_size=chunk_size)


def random_params(cfg: ModelConfig, seed: int) -> dict:
    """Realistic random weights (negative A, dt after softplus in [0.01, 0.5], unit-scale activations,
    logits spread enough that greedy ties are rare), float64 on the CPU."""
    from reference.testing import inverse_softplus
    g = torch.Generator().manual_seed(int(seed))
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ru = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    p = {}
    for name, shape in expected_parameters(cfg).items():
        leaf = name.split(".mixer.")[-1]
        fan_in = shape[-1] if len(shape) > 1 else 1
        if name == "embedding.weight":
            t = rn(*shape)
        elif name == "lm_head.weight":
            t = rn(*shape) * 3 / math.sqrt(cfg.d_model)
        elif name.endswith("norm.weight") or name == "norm_f.weight":
            t = 1 + 0.1 * rn(*shape)
        elif leaf == "conv1d.weight":
            t = rn(*shape) * 0.5
        elif leaf in ("conv1d.bias", "in_proj.bias", "out_proj.bias"):
            t = rn(*shape) * 0.1
        elif leaf == "A_log":
            t = torch.log(1 + ru(*shape) * (cfg.d_state if len(shape) == 2 else 8))
        elif leaf == "D":
            t = 1 + 0.1 * rn(*shape)
        elif leaf in ("dt_proj.bias", "dt_bias"):
            dt = torch.exp(ru(*shape) * (math.log(0.5) - math.log(0.01)) + math.log(0.01))
            t = inverse_softplus(dt)
        else:  # projections
            t = rn(*shape) / math.sqrt(fan_in)
        p[name] = t
    return p


@lru_cache(maxsize=16)
def tiny_model(family: str, seed: int) -> tuple:
    cfg = tiny_config(family)
    return cfg, random_params(cfg, seed)


@lru_cache(maxsize=16)
def reference_model(family: str, seed: int):
    from reference.models import ReferenceLM
    cfg, params = tiny_model(family, seed)
    return ReferenceLM(cfg, params, dtype=torch.float64)


_REF_CACHE: dict = {}


def reference_run(family: str, seed: int, tokens: tuple):
    """Float64 oracle over one request's whole token stream: (logits (L, V), its state named as the engine's
    snapshots name it: ``conv.<j>`` / ``recurrent.<j>`` of the j-th mixer layer and, in hybrid models,
    ``kv.<a>.k`` / ``kv.<a>.v`` of the a-th attention layer)."""
    key = (family, seed, tokens)
    if key not in _REF_CACHE:
        if len(_REF_CACHE) > 4096:
            _REF_CACHE.clear()
        ref = reference_model(family, seed)
        logits, state = ref.prefill([list(tokens)])
        conv = [c[0] for c in state.conv if c is not None]
        ssm = [s[0] for s in state.ssm if s is not None]
        kv = [k[0] for k in (state.kv or ()) if k is not None]
        states = {f"conv.{j}": c for j, c in enumerate(conv)}
        states.update({f"recurrent.{j}": s for j, s in enumerate(ssm)})
        for a, (k, v) in enumerate(kv):
            states[f"kv.{a}.k"], states[f"kv.{a}.v"] = k, v
        _REF_CACHE[key] = (logits[0], states)
    return _REF_CACHE[key]


# ============================================================================ scenarios

@dataclass(frozen=True)
class Scenario:
    family: str
    model_seed: int
    prompts: tuple
    max_new: tuple
    track: tuple
    waves: tuple
    token_budget: int
    block_size: int = 8
    cache_mode: str = "all"
    chunk_seed: int | None = None
    num_slots: int = 4
    layout: str = "layer_major"
    decode_pad: int = 1
    conv_layout: str = "row_major"

    @property
    def size(self) -> tuple[int, int]:
        """(requests, prompt tokens)."""
        return len(self.prompts), sum(len(p) for p in self.prompts)

    def requests(self, indices=None) -> list[Request]:
        idx = range(len(self.prompts)) if indices is None else indices
        return [Request(i, self.prompts[i], self.max_new[i], self.track[i]) for i in idx]

    def runner_kwargs(self, **over) -> dict:
        kw = dict(num_slots=self.num_slots, token_budget=self.token_budget, cache_mode=self.cache_mode,
                  block_size=self.block_size, layout=self.layout, decode_pad_multiple=self.decode_pad,
                  conv_channels_last=self.conv_layout == "channels_last",
                  chunk_fn=None if self.chunk_seed is None else random_chunk_fn(self.chunk_seed))
        kw.update(over)
        return kw

    def __str__(self) -> str:
        f = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__dataclass_fields__)
        return f"Scenario({f})"


def _tokens(seed: int, n: int, vocab: int = 60) -> tuple:
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(n))


@st.composite
def scenarios(draw, families=FAMILIES, modes=MODES, min_requests: int = 1, max_requests: int = 6,
              max_prompt: int = 40, max_new: int = 4, max_waves: int = 2, budgets=(1, 64),
              block_sizes=(8, 16), layouts=("layer_major", "page_major"), pads=(1, 4), max_slots: int = 6,
              chunked=None, seeds=(0, 3), min_base: int = 0, conv_layouts=CONV_SLOT_LAYOUTS, min_new: int = 1):
    """Request sets on tiny models: shared prefixes, tracked/untracked, waves, budgets, chunking, the pool
    layouts engines use (`layouts`, and `conv_layouts` for the conv slots: vLLM's channels-last ones too).
    Each request generates `min_new`..`max_new` tokens (with `min_new` 2, every request reaches a decode step)."""
    family = draw(st.sampled_from(families))
    n = draw(st.integers(min_requests, max_requests))
    block_size = draw(st.sampled_from(block_sizes))
    cache_mode = draw(st.sampled_from(modes))
    # token values come from seeded PRNGs so that lengths (not values) carry the distribution: long
    # shared prefixes (>= a block) are common, and shrinking shortens prompts rather than zeroing tokens.
    # A base of whole blocks (half the time) and prompts that are exactly a shared prefix make
    # whole-prompt and multi-block prefix-cache hits common enough for a CI-sized search to meet them.
    lo = min(min_base, max_prompt)
    whole_blocks = [k for k in range(block_size, max_prompt + 1, block_size) if k >= lo]
    whole_blocks = [k for k in whole_blocks if k >= 2 * block_size] or whole_blocks  # several blocks
    base_len = draw(st.one_of(st.integers(lo, max_prompt), st.sampled_from(whole_blocks))
                    if whole_blocks else st.integers(lo, max_prompt))
    base = _tokens(draw(st.integers(0, 1 << 16)), base_len)
    prompts = []
    for _ in range(n):
        share = draw(st.one_of(st.just(base_len), st.just(base_len), st.integers(0, base_len)))
        own = st.integers(0 if share else 1, max(1, min(12, max_prompt - share)))
        own_len = draw(st.one_of(st.just(0), own) if share else own)
        prompts.append(tuple(base[:share]) + _tokens(draw(st.integers(0, 1 << 16)), own_len))
    news = tuple(draw(st.integers(min(min_new, max_new), max_new)) for _ in range(n))
    # mostly tracked requests in several waves: later waves then find earlier waves' snapshots
    track = tuple(draw(st.one_of(st.just(True), st.booleans())) for _ in range(n))
    most_waves = min(max_waves, n)
    nw = draw(st.one_of(st.just(most_waves), st.integers(1, most_waves)))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, n - 1)), min_size=nw - 1, max_size=nw - 1, unique=True))) \
        if n > 1 else []
    bounds = [0] + cuts + [n]
    waves = tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a)
    use_chunks = draw(st.booleans()) if chunked is None else chunked
    model_seed = draw(st.integers(*seeds))
    token_budget = draw(st.integers(*budgets))
    chunk_seed = draw(st.integers(0, 1000)) if use_chunks else None
    num_slots = draw(st.integers(1, max_slots))
    # the pool layout and the conv slots' layout in one draw: the other draws (and a fixed-seed search's
    # examples) stay what they were with the pool layout alone
    layout, conv_layout = draw(st.sampled_from([(p, c) for p in layouts for c in conv_layouts]))
    return Scenario(
        family=family, model_seed=model_seed, prompts=tuple(prompts), max_new=news, track=track, waves=waves,
        token_budget=token_budget, block_size=block_size, cache_mode=cache_mode, chunk_seed=chunk_seed,
        num_slots=num_slots, layout=layout, decode_pad=draw(st.sampled_from(pads)), conv_layout=conv_layout)


# The searches of the split-invariance and seeding suites (suites/scenarios/test_scen_properties.py);
# test_scen_coverage.py requires them to meet every rare engine event (``scenarios`` is looked up when
# called, so a replaced strategy is what they draw from).
SPLIT_SEARCH = dict(max_requests=3, max_prompt=24, budgets=(1, 12), chunked=True, max_waves=1)
SEEDING_SEARCH = dict(min_requests=2, max_requests=5, modes=("none", "align", "align", "all", "all"), max_waves=3,
                      block_sizes=(8, 16), min_base=9, max_prompt=48)


def split_scenarios():
    """The request sets the split-invariance suite draws: a few short chunked prompts, one wave."""
    return scenarios(**SPLIT_SEARCH)


def seeding_scenarios():
    """The request sets the seeding suite draws: long shared prefixes, up to three waves."""
    return scenarios(**SEEDING_SEARCH)


# ============================================================================ runner factory

@dataclass
class RunnerFactory:
    """Builds EngineRunners for one implementation / dtype / device. ``tol_scale`` widens the dtype's
    tolerance for model-level comparisons (errors accumulate over layers and tokens). ``check_pad_rows``:
    the engine's op calls are checked against the pad-row contract (:func:`pad_row_checked`)."""
    impl: object
    dtype: torch.dtype = torch.float64
    device: str = "cpu"
    tol_scale: float | None = None
    extra: dict = field(default_factory=dict)
    check_pad_rows: bool = True

    def __post_init__(self):
        if isinstance(self.impl, str):
            from harness.impls import registry
            self.impl = registry.get(self.impl)
        if self.tol_scale is None:
            self.tol_scale = 1.0 if self.dtype == torch.float64 else 4.0

    def __call__(self, model, **kw) -> EngineRunner:
        impl = pad_row_checked(self.impl) if self.check_pad_rows else self.impl
        return EngineRunner(model, impl, dtype=self.dtype, device=self.device, **{**self.extra, **kw})

    @property
    def tol(self) -> Tolerance:
        return tolerance_for(self.dtype, self.tol_scale)

    @property
    def state_tol(self) -> Tolerance:
        return tolerance_for(self.dtype, self.tol_scale)


# ============================================================================ comparison helpers

class Mismatch(AssertionError):
    pass


def pad_row_checked(impl):
    """`impl` (same name and properties) whose ops that take slot ids check after every call that the output
    rows of the call's pad requests are exactly 0 (`harness.testing.pad_rows`): an engine hands a padded
    CUDA-graph batch's pad rows on to the next layer's projections and all-reduce, so stale values or NaN
    left there are a bug even though no request's result reads them. Raises Mismatch naming the op, the
    row and its value."""
    from harness.ops import SPECS
    from harness.testing import assert_pad_rows_zero, pad_rows

    def wrap(name, fn):
        def op(*args, **kwargs):
            pads = pad_rows(name, args, kwargs)
            y = fn(*args, **kwargs)
            try:
                assert_pad_rows_zero(name, y, pads, context="in an engine step (pad rows go on into the next layer)")
            except AssertionError as e:
                raise Mismatch(str(e)) from None
            return y
        op.__name__ = getattr(fn, "__name__", name)
        op.__wrapped__ = fn
        return op
    ops = {n: (wrap(n, fn) if n in SPECS and SPECS[n].index else fn) for n, fn in impl.ops.items()}
    return replace(impl, ops=ops)


def _close(name, actual, expected, tol, where: str, check=None, make_runner=None):
    if check is not None:
        impl = getattr(getattr(make_runner, "impl", None), "name", "?")
        check.close(name, actual, expected, op="engine", impl=impl, dtype=getattr(make_runner, "dtype", None),
                    tol=tol, context=where)
        return
    c = compare(name, actual, expected, tol, describe_tolerance(tol, getattr(make_runner, "dtype", None)))
    if not c.passed:
        raise Mismatch(c.message(where))


def _tie_tol(logits: torch.Tensor, tol: Tolerance) -> float:
    return 2 * (tol.atol + tol.rtol * float(logits.abs().max()))


def check_tokens(label, tokens, ref_logits, vocab: int, tol: Tolerance, where: str):
    """Engine tokens vs the oracle's argmax at each step (oracle teacher-forced on the engine's stream)."""
    for k, t in enumerate(tokens):
        lg = ref_logits[k, :vocab]
        best = int(lg.argmax())
        if t != best:
            margin = float(lg[best] - lg[t])
            if margin > _tie_tol(lg, tol):
                raise Mismatch(f"{label}: greedy token {k} is {t}, oracle chooses {best} with a clear margin "
                               f"{margin:.3e} (> tie tolerance {_tie_tol(lg, tol):.3e}); {where}")


_STATE_NAMES = {"conv": "conv state", "recurrent": "ssm state", "kv": "attention"}


def check_state(label, snap, ref_states: dict, tol, where, check=None, make_runner=None):
    """An engine snapshot holds exactly the oracle's states (`reference_run`), each within tolerance."""
    if set(snap) != set(ref_states):
        raise Mismatch(f"{label}: state entries {sorted(snap)}, the oracle's {sorted(ref_states)}; {where}")
    for name, ref in ref_states.items():
        kind, layer, *part = name.split(".")
        what = f"{_STATE_NAMES[kind]} layer {layer}" + (f" {'keys' if part == ['k'] else 'values'}" if part else "")
        _close(f"{label} {what}", snap[name], ref, tol, where, check, make_runner)


def check_against_reference(case: Scenario, results: dict, make_runner, *, snapshot_log=(), every_step=False,
                            check=None, label="engine"):
    """Each request's logits, tokens, final state (and every snapshot / every recorded step state)
    equal the float64 oracle run on that request alone."""
    cfg = tiny_model(case.family, case.model_seed)[0]
    tol = make_runner.tol
    for rid, res in results.items():
        where = f"request {rid!r} (prompt {len(res.prompt)} tokens, seeded {res.num_cached}, steps {res.steps}); " \
                f"case: {case}"
        P = len(res.prompt)
        fed = res.fed_tokens
        logits, states = reference_run(case.family, case.model_seed, fed)
        ref_step = logits[P - 1:]
        n = len(res.tokens)
        if res.step_logits.shape[0] != n or ref_step.shape[0] != n:
            raise Mismatch(f"{label}: request {rid!r} has {res.step_logits.shape[0]} step logits for {n} tokens; "
                           f"{where}")
        check_tokens(f"{label} request {rid!r}", res.tokens, ref_step, cfg.vocab_size_unpadded, tol, where)
        _close(f"{label} request {rid!r} step logits", res.step_logits[:, :cfg.vocab_size_unpadded],
               ref_step[:, :cfg.vocab_size_unpadded], tol, where, check, make_runner)
        if res.final_state is None:
            raise Mismatch(f"{label}: request {rid!r} has no final state; {where}")
        check_state(f"{label} request {rid!r} final", res.final_state, states, make_runner.state_tol, where,
                    check, make_runner)
        if every_step:
            for pos, snap in sorted(res.states.items()):
                _, s = reference_run(case.family, case.model_seed, fed[:pos])
                check_state(f"{label} request {rid!r} state after {pos} tokens", snap, s, make_runner.state_tol,
                            where, check, make_runner)
    for rid, prefix, snap in snapshot_log:
        _, s = reference_run(case.family, case.model_seed, tuple(prefix))
        check_state(f"{label} prefix-cache snapshot of request {rid!r} at {len(prefix)} tokens", snap, s,
                    make_runner.state_tol, f"case: {case}", check, make_runner)


def check_same_results(a: dict, b: dict, case: Scenario, make_runner, what: str, ids=None):
    """Two engine runs agree per request: tokens (tie-aware w.r.t. the oracle) and step logits."""
    cfg = tiny_model(case.family, case.model_seed)[0]
    tol = make_runner.tol
    for rid in (ids if ids is not None else a):
        ra, rb = a[rid], b[rid]
        where = f"{what}; request {rid!r}; case: {case}"
        if ra.tokens != rb.tokens:
            # allowed only where the oracle (on the first run's stream) has a tie at the first difference
            k = next(i for i, (x, y) in enumerate(zip(ra.tokens, rb.tokens)) if x != y)
            logits, _ = reference_run(case.family, case.model_seed, ra.fed_tokens)
            lg = logits[len(ra.prompt) - 1 + k, :cfg.vocab_size_unpadded]
            margin = abs(float(lg[ra.tokens[k]] - lg[rb.tokens[k]]))
            if margin > _tie_tol(lg, tol):
                raise Mismatch(f"{what}: request {rid!r} tokens differ at step {k}: {ra.tokens} vs {rb.tokens} "
                               f"(oracle margin {margin:.3e}, not a tie); {where}")
            n = k + 1
        else:
            n = len(ra.tokens)
        _close(f"{what}: request {rid!r} step logits", rb.step_logits[:n, :cfg.vocab_size_unpadded],
               ra.step_logits[:n, :cfg.vocab_size_unpadded], tol, where, make_runner=make_runner)


def run_case(case: Scenario, make_runner, *, waves=None, order=None, **over):
    """Run the scenario's waves on one runner; returns (results by request id, runner). The engine
    events of the run (:func:`engine_events`) are reported to hypothesis and to the active recorders."""
    model = tiny_model(case.family, case.model_seed)
    runner = make_runner(model, **case.runner_kwargs(**over))
    watch = _EngineWatch(runner)
    results = {}
    for wave in (waves if waves is not None else case.waves):
        idx = list(wave) if order is None else [i for i in order if i in wave]
        if idx:
            results.update(runner.run(case.requests(idx)))
    report_events(engine_events(case, results, runner, watch))
    return results, runner


# ============================================================================ coverage events

# Rare engine events: a property that never meets one cannot catch a bug that lives there. Each is
# derived from what the engine did (the prefix cache's contents and hit lengths at admission, the
# scheduler's chunks, the pad rows of the steps' metadata, the conv pool's strides), not from what the strategy
# meant to draw.
EVENT_FAMILY = "scenario of family {family}"
EVENT_WHOLE_PROMPT_HIT = "whole-prompt prefix-cache hit"
EVENT_MULTI_BLOCK_HIT = "multi-block prefix-cache hit (mode {mode}, block {block})"
EVENT_CHUNK_CROSSES_BLOCK = "prefill chunk crossing a block boundary"
EVENT_SEEDED_THEN_CHUNKED = "request seeded from a cached prefix, then chunk-prefilled"
EVENT_DECODE_PADS = "decode step with pad rows"
EVENT_CHANNELS_LAST_CONV = "conv slots stored channels-last (vLLM's layout)"

_RECORDERS: list = []


@contextmanager
def recording_events():
    """Collect the engine events of every scenario run inside the block: yields a Counter (event ->
    number of runs that met it)."""
    seen = Counter()
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        _RECORDERS.remove(seen)


def report_events(events) -> None:
    """Count `events` in the active recorders and, inside a hypothesis test, as hypothesis events
    (shown by ``--hypothesis-show-statistics``)."""
    for rec in _RECORDERS:
        rec.update(events)
    if currently_in_test_context():
        for e in events:
            event(e)


def report_targets(case: Scenario, results: dict) -> None:
    """Steer a hypothesis search towards long prefix-cache hits in every cache mode and block size: the
    longest hit of `results` in blocks, under a label per (mode, block size). Hypothesis takes one
    observation per label and test case: where one test case runs several properties (``harness
    selftest``), the first one's counts."""
    if currently_in_test_context() and case.cache_mode != "none":
        try:
            target(max((r.num_cached for r in results.values()), default=0) / case.block_size,
                   label=f"prefix-cache hit blocks (mode {case.cache_mode}, block {case.block_size})")
        except InvalidArgument:  # this label was observed by an earlier property of the test case
            pass


class _EngineWatch:
    """Observes a runner's admissions (whether the prefix cache held the WHOLE prompt when the request
    was admitted; the engine then seeds from the longest shorter prefix) and its steps' pad rows."""

    def __init__(self, runner: EngineRunner):
        self.whole_prompt_cached = 0
        self.pad_steps = 0
        cache, forward = runner.cache, runner.forward

        def lookup(tokens, max_tokens=None):
            if max_tokens is not None and max_tokens < len(tokens) and tuple(tokens) in cache:
                self.whole_prompt_cached += 1
            return type(cache).lookup(cache, tokens, max_tokens)

        def forward_watched(tokens, md):
            if bool((md.state_indices == PAD_SLOT_ID).any()):
                self.pad_steps += 1
            return forward(tokens, md)

        cache.lookup = lookup
        runner.forward = forward_watched


def engine_events(case: Scenario, results: dict, runner: EngineRunner, watch: _EngineWatch) -> list[str]:
    """The rare events one engine run met (see the EVENT_* names)."""
    bs, mode = runner.cache.block_size, runner.cache.mode
    events = [EVENT_FAMILY.format(family=runner.cfg.family)]
    if watch.whole_prompt_cached:
        events.append(EVENT_WHOLE_PROMPT_HIT)
    if watch.pad_steps:
        events.append(EVENT_DECODE_PADS)
    conv = runner.pool.conv(0)  # channels-last: the channels, not the window's taps, are the contiguous axis
    if conv.shape[2] > 1 and conv.stride(1) == 1 and conv.stride(2) != 1:
        events.append(EVENT_CHANNELS_LAST_CONV)
    multi = crossing = seeded_chunked = False
    for res in results.values():
        prefills = [(start, start + n) for _, start, n, is_decode in res.steps if not is_decode]
        multi |= res.num_cached >= 2 * bs
        if len(prefills) > 1:  # the prompt's remainder took several chunks
            crossing |= any(a // bs < (b - 1) // bs for a, b in prefills)
            seeded_chunked |= res.num_cached > 0
    if multi:
        events.append(EVENT_MULTI_BLOCK_HIT.format(mode=mode, block=bs))
    if crossing:
        events.append(EVENT_CHUNK_CROSSES_BLOCK)
    if seeded_chunked:
        events.append(EVENT_SEEDED_THEN_CHUNKED)
    return events


# ============================================================================ properties

def prop_matches_reference(case: Scenario, make_runner, check=None):
    """Every request of the scenario (its waves, chunks, cache, padding) equals the float64 oracle run
    on that request alone: step logits, tie-aware tokens, final state, and every prefix-cache snapshot."""
    results, runner = run_case(case, make_runner)
    report_targets(case, results)
    check_against_reference(case, results, make_runner, snapshot_log=runner.snapshot_log, check=check)


def prop_split_invariance(case: Scenario, make_runner, check=None):
    """Prefill/decode split and chunked prefill with boundaries anywhere (incl. chunks shorter than the
    conv width, single requests): the state after EVERY step, the logits and tokens equal the oracle's
    whole-prompt computation, and the same engine with whole prefills (one chunk per prompt)."""
    chunked = case if case.chunk_seed is not None else replace(case, chunk_seed=0)
    res_c, runner = run_case(chunked, make_runner, record_states=True)
    report_targets(chunked, res_c)
    check_against_reference(chunked, res_c, make_runner, snapshot_log=runner.snapshot_log, every_step=True,
                            check=check, label="chunked")
    whole = replace(case, chunk_seed=None, token_budget=max(case.token_budget,
                                                            max(len(p) for p in case.prompts) * len(case.prompts)))
    res_w, _ = run_case(whole, make_runner)
    check_same_results(res_w, res_c, case, make_runner, "chunked prefill vs whole prefill")


def prop_seeding_equivalence(case: Scenario, make_runner, check=None):
    """Requests seeded from prefix-cache snapshots (earlier waves fill the cache; batches mix seeded,
    unseeded, tracked and untracked requests) equal computing from scratch: the oracle, and the same
    engine with cache mode none. Every snapshot equals the oracle state at its position."""
    results, runner = run_case(case, make_runner)
    report_targets(case, results)
    check_against_reference(case, results, make_runner, snapshot_log=runner.snapshot_log, check=check,
                            label=f"cache mode {case.cache_mode}")
    scratch, _ = run_case(replace(case, cache_mode="none"), make_runner)
    check_same_results(scratch, results, case, make_runner, f"seeded (mode {case.cache_mode}) vs from scratch")


def prop_batch_invariance(case: Scenario, make_runner, check=None):
    """A request's results do not depend on the other requests of its batch: all requests packed in one
    wave == each request alone == the requests in reverse order == with every other request removed."""
    n = len(case.prompts)
    one = (tuple(range(n)),)
    packed, _ = run_case(case, make_runner, waves=one)
    report_targets(case, packed)
    check_against_reference(case, packed, make_runner, check=check, label="packed")
    for i in range(n):
        alone, _ = run_case(case, make_runner, waves=((i,),))
        check_same_results(packed, alone, case, make_runner, f"packed vs request {i} alone", ids=[i])
    if n > 1:
        rev, _ = run_case(case, make_runner, waves=one, order=list(reversed(range(n))))
        check_same_results(packed, rev, case, make_runner, "packed vs reversed order")
        keep = list(range(0, n, 2))
        sub, _ = run_case(case, make_runner, waves=(tuple(keep),))
        check_same_results(packed, sub, case, make_runner, "packed vs every other request removed", ids=keep)


def prop_determinism(case: Scenario, make_runner, check=None):
    """The same scenario twice on fresh runners gives bitwise-equal tokens, step logits and final states
    (only asserted for implementations that claim determinism; returns False when not applicable)."""
    from harness.testing.checks import assert_bitwise_equal
    if not getattr(make_runner.impl, "deterministic", False):
        return False
    a, _ = run_case(case, make_runner)
    b, _ = run_case(case, make_runner)
    for rid in a:
        where = f"request {rid!r}; case: {case}"
        if a[rid].tokens != b[rid].tokens:
            raise Mismatch(f"determinism: request {rid!r} tokens {a[rid].tokens} vs {b[rid].tokens}; {where}")
        assert_bitwise_equal(f"determinism: request {rid!r} step logits", b[rid].step_logits, a[rid].step_logits,
                             where)
        for k in a[rid].final_state:
            assert_bitwise_equal(f"determinism: request {rid!r} final {k}", b[rid].final_state[k],
                                 a[rid].final_state[k], where)
    return True


PROPERTIES = {
    "matches_reference": prop_matches_reference,
    "split_invariance": prop_split_invariance,
    "seeding": prop_seeding_equivalence,
    "batch_invariance": prop_batch_invariance,
    "determinism": prop_determinism,
}


# ============================================================================ suites' helpers

def engine_ops(family: str) -> tuple[str, ...]:
    """The ops an engine running a scenario of `family` calls (its mixer's and the runner's)."""
    return engine_families.required_ops(family)


def lacking_ops(impl, family: str) -> list[str]:
    """The ops of `family`'s scenarios that `impl` lacks, after `engine_impl` filled in what it can."""
    have = engine_impl(impl).ops
    return [o for o in engine_ops(family) if o not in have]


def engine_impl(impl):
    """`impl` completed for the engine: ops it lacks (of any family's engine) come from the `torch`
    implementation (the result is named e.g. "mamba_ssm+torch"); an implementation providing none of the
    engine's ops is returned as is."""
    from harness.impls import registry
    wanted = engine_families.all_ops()
    missing = [o for o in wanted if o not in impl.ops]
    if not missing or len(missing) == len(wanted):
        return impl
    fill = registry.get("torch")
    ops = dict(impl.ops)
    ops.update({o: fill.ops[o] for o in missing if o in fill.ops})
    return replace(impl, name=f"{impl.name}+torch", ops=ops,
                   deterministic=impl.deterministic and fill.deterministic, description=f"{impl.name}, rest from torch")


def factory_for(impl, device: str, dtype: torch.dtype | None = None) -> RunnerFactory:
    """The runner factory the scenario suites use for `impl` on `device`: float64 on the CPU where the
    implementation supports it (tight tolerances), else float32."""
    impl = engine_impl(impl)
    if dtype is None:
        dtype = torch.float64 if device.startswith("cpu") and torch.float64 in impl.dtypes else torch.float32
    return RunnerFactory(impl, dtype=dtype, device=device)


def skip_reason(impl, device: str, family: str | None = None) -> str | None:
    """Why the scenario suites don't run `impl` here (None: they do): for scenarios of `family`, the ops
    that family needs; without `family`, when `impl` can run no family's scenarios at all."""
    wanted = (family,) if family is not None else FAMILIES
    lacking = {f: lacking_ops(impl, f) for f in wanted}
    if all(lacking.values()):
        what = "; ".join(f"{f}: {ops}" for f, ops in lacking.items())
        return f"implementation {impl.name!r} lacks the engine ops ({what})"
    if impl.name == "triton" and device.startswith("cpu"):
        return ("Triton under the CPU interpreter takes 5-100 s per scenario: scenario suites run it on GPU; "
                "test_scen_backend.py runs one small CPU smoke scenario")
    return None
