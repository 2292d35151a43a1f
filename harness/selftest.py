"""`harness selftest`: proof that the scenario properties catch the real serving bugs of docs/bug-classes.md.

Each *variant* breaks one REAL component of the engine on purpose, through a context manager that
patches (or wraps) it and restores it afterwards:

* the metadata builder (``harness.engine.metadata.build_metadata`` / ``chunk_indices_offsets``),
* the mixer backend (``harness.engine.backend.MixerBackend``) and the family mixers it runs
  (``harness.engine.families``),
* the implementation's ops (wrappers around the ``reference`` -- or ``--impl`` -- ops that mishandle
  pad ids, pad rows, dt, groups, short conv chunks or channels-last conv slots),
* a mamba_ssm-style varlen SSD on a GLOBAL chunk grid (:func:`grid_ssd_varlen`, which takes its logical
  chunks from ``harness.engine.metadata.chunk_indices_offsets``), correct or with bug class 4.

For each variant, ``hypothesis.find`` searches scenario request sets (harness.scenarios.scenarios) for
one on which a scenario property fails, and shrinks it to a minimal request set. The catch is then
confirmed: the minimal case must FAIL with the variant and PASS with the unbroken engine (the
control), and every property is run on it to list which ones catch it. A variant escapes when no
failing case is found within its example/time budget, or when its control fails.

The bug classes that no scenario property can see (below the engine or outside it: exp overflow under
stress inputs, int32 offsets, checkpoint names, cache specs, the checks themselves, inputs written, state
precision, tile boundaries, shared workspaces) are *suite variants* (harness.selftest_suites): a planted
component (harness.testing.planted) and the tests of the real suites that must fail with it and pass
without it, run by pytest in a subprocess. Together the two kinds cover every class of docs/bug-classes.md.

Exit code 1 if any variant escapes.
"""
from __future__ import annotations

import contextlib
import math
import random
import time
import traceback
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

from harness import ops as C_
from harness.engine import backend as backend_mod
from harness.engine import metadata as metadata_mod
from harness.engine.families import mamba1 as falcon_engine
from harness.impls.registry import Impl
from harness.engine import families as engine_families
from harness.scenarios import FAMILIES as SCENARIO_FAMILIES
from harness.scenarios import PROPERTIES, RunnerFactory, Scenario, scenarios
from harness.selftest_suites import SUITE_VARIANTS, SuiteOutcome, run_suite_variant
from reference.pads import pad_row_mask, zero_pad_rows

# ============================================================================ patch helpers


@contextlib.contextmanager
def patched(obj, name: str, new):
    """Replace ``obj.name`` by `new` for the duration (restored even on error)."""
    old = getattr(obj, name)
    setattr(obj, name, new)
    try:
        yield
    finally:
        setattr(obj, name, old)


# Argument roles come from the op specs (harness.ops): positional names, the pool, the slot indices.
OP_ARGS = {n: sp.args for n, sp in C_.SPECS.items()}
POOL_ARG = {n: sp.pool for n, sp in C_.SPECS.items() if sp.pool}
INDEX_ARG = {n: sp.index for n, sp in C_.SPECS.items() if sp.index}


def wrap_op(op_name: str, fn: Callable, before: Callable | None = None, after: Callable | None = None) -> Callable:
    """An op that calls `fn` with its arguments rewritten by ``before(args: dict) -> dict`` and then runs
    ``after(args, result)`` (both optional). Positional args are named by OP_ARGS."""
    names = OP_ARGS[op_name]

    def op(*args, **kwargs):
        a = dict(zip(names, args))
        a.update(kwargs)
        if before is not None:
            a = before(a)
        pos = [a.pop(n) for n in names]
        y = fn(*pos, **a)
        if after is not None:
            after(dict(zip(names, pos)), y)
        return y
    op.__name__ = f"broken_{op_name}"
    return op


def with_ops(impl: Impl, name: str, **ops) -> Impl:
    return replace(impl, name=name, ops={**impl.ops, **ops}, description=f"{impl.name} with {sorted(ops)} replaced")


# ============================================================================ a global-grid varlen SSD

def grid_ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
                    has_initial_state, *, dt_softplus=True, dt_limit=(0.0, math.inf), pad_slot_id=C_.PAD_SLOT_ID,
                    out=None, _bug_cumsum_at_chunk_start=False, _bug_exp_before_mask=False):
    """``ssd_varlen`` the mamba_ssm way: the packed stream is cut into a GLOBAL grid of `chunk_size`
    tokens; logical chunks (a sequence's run inside one global chunk) come from
    ``harness.engine.metadata.chunk_indices_offsets``; the cumulative dA is taken per global chunk and,
    for a logical chunk that starts mid-chunk (a sequence start), measured from that start.
    With ``_bug_cumsum_at_chunk_start`` it is measured from the global chunk start instead (bug class 4).
    With ``_bug_exp_before_mask`` the decay matrix is exp(segment sums) times the causal mask: above the
    diagonal the difference of cumulative sums is positive, a large |A| overflows exp there and inf * 0 is
    NaN (bug class 6).
    Plain loops over logical chunks: for small selftest shapes."""
    T, H, P, N, G, S = C_.validate_ssd_varlen(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states,
                                              query_start_loc, cache_indices, has_initial_state, dt_limit,
                                              pad_slot_id, out)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = [int(v) for v in query_start_loc.tolist()]
    idx = [int(v) for v in cache_indices.tolist()]
    hinit = [bool(v) for v in has_initial_state.tolist()]
    d = dt.to(cd) + (dt_bias.to(cd) if dt_bias is not None else 0)
    if dt_softplus:
        d = F.softplus(d)
    d = d.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))
    dA = d * A.to(cd)
    hpg = H // G
    xs = x.to(cd)
    Bh = B.to(cd).repeat_interleave(hpg, dim=1)
    Ch = C.to(cd).repeat_interleave(hpg, dim=1)
    cs = chunk_size
    cum = torch.zeros_like(dA)
    for g in range(math.ceil(T / cs)):
        cum[g * cs:(g + 1) * cs] = dA[g * cs:(g + 1) * cs].cumsum(0)
    ci, co = metadata_mod.chunk_indices_offsets(q, cs)
    starts = [i * cs + o for i, o in zip(ci, co)]
    h = {}
    for s in range(S):
        if idx[s] != pad_slot_id and hinit[s]:
            h[s] = ssm_states[idx[s]].to(cd).clone()
        else:
            h[s] = torch.zeros((H, P, N), dtype=cd, device=x.device)
    y = torch.full((T, H, P), float("nan"), dtype=cd, device=x.device)
    for j, a in enumerate(starts):
        g = ci[j]
        b = starts[j + 1] if j + 1 < len(starts) and ci[j + 1] == g else min((g + 1) * cs, T)
        if a >= b or a >= T:
            continue
        s = bisect_right(q, a) - 1
        b = min(b, q[s + 1])
        base = cum[a - 1] if (a > g * cs and not _bug_cumsum_at_chunk_start) else torch.zeros_like(cum[0])
        c = cum[a:b] - base  # (L, H)
        L = b - a
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device))
        seg = c[:, None, :] - c[None, :, :]
        if _bug_exp_before_mask:
            decay = torch.exp(seg) * mask[..., None]
        else:
            decay = torch.exp(torch.where(mask[..., None], seg, torch.full_like(seg, -math.inf)))
        cb = torch.einsum("ihn,jhn->ijh", Ch[a:b], Bh[a:b])
        yj = torch.einsum("ijh,jh,jhp->ihp", cb * decay, d[a:b], xs[a:b])
        yj = yj + torch.exp(c)[:, :, None] * torch.einsum("ihn,hpn->ihp", Ch[a:b], h[s])
        h[s] = torch.exp(c[-1])[:, None, None] * h[s] + torch.einsum(
            "jh,jhp,jhn->hpn", torch.exp(c[-1][None] - c) * d[a:b], xs[a:b], Bh[a:b])
        y[a:b] = yj
    if D is not None:
        Dd = D.to(cd)
        y = y + (Dd[:, None] if Dd.dim() == 1 else Dd) * xs
    if z is not None:
        y = y * F.silu(z.to(cd))
    for s in range(S):
        if idx[s] != pad_slot_id:
            ssm_states[idx[s]] = h[s].to(ssm_states.dtype)
    zero_pad_rows(y, pad_row_mask(idx, pad_slot_id, q, T))  # a pad request's tokens are 0 (the contract)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


# ============================================================================ variants

@dataclass
class Variant:
    """A deliberately broken engine: `patch()` is a context manager that breaks a real component;
    `impl(base)` gives the implementation the engine runs (default: `base`, possibly wrapped);
    `control(base)` the unbroken implementation the catch is confirmed against; `runner`: engine options
    (harness.engine.runner.EngineRunner keyword arguments) of both the broken engine and the control that the
    scenario does not set itself (its pool and conv-slot layouts are drawn: narrow them through `strategy`)."""
    name: str
    bug_class: str
    description: str
    patch: Callable = contextlib.nullcontext
    impl: Callable = lambda base: base
    control: Callable = lambda base: base
    strategy: dict = field(default_factory=dict)
    runner: dict = field(default_factory=dict)


def _meta_patch(transform):
    orig = metadata_mod.build_metadata

    def broken(*a, **k):
        return transform(orig(*a, **k))
    return patched(metadata_mod, "build_metadata", broken)


def _seeding_gate():
    return _meta_patch(lambda md: replace(md, has_initial_states=md.has_initial_states & md.track_mask))


def _stale_seeding():
    """The opposite gate: every live request reads its slot, also one without a cached state (its slot still
    holds what the slot's previous request left there)."""
    return _meta_patch(lambda md: replace(md, has_initial_states=md.has_initial_states
                                          | (md.state_indices != C_.PAD_SLOT_ID)))


def _bs1_drop():
    def t(md):
        if md.num_reqs == 1:
            return replace(md, has_initial_states=torch.zeros_like(md.has_initial_states))
        return md
    return _meta_patch(t)


def _two_values():
    orig = backend_mod.MixerBackend.forward

    def forward(self, hidden, md, conv_states, ssm_states):
        out, conv, ssm = orig(self, hidden, md, conv_states, ssm_states)
        return out, ssm  # a mixer that returns 2 values
    return patched(backend_mod.MixerBackend, "forward", forward)


def _per_request_grid():
    def chunk_indices_offsets(cu_seqlens, chunk_size):
        cu = [int(c) for c in cu_seqlens]
        idx, off, g = [], [], 0
        for s in range(len(cu) - 1):
            for _ in range(math.ceil((cu[s + 1] - cu[s]) / chunk_size)):
                idx.append(g)
                off.append(0)
                g += 1
        return idx, off
    return patched(metadata_mod, "chunk_indices_offsets", chunk_indices_offsets)


def _falcon_norm(kind):
    def norm(self, t, ones, group_size=None):
        if kind == "missing":
            return t
        # the layer norm's eps in place of mixer_rms_eps
        return self.ops["gated_rms_norm"](t, ones, None, eps=float(self.cfg.norm_eps), group_size=group_size)
    return patched(falcon_engine.FalconMambaMixer, "falcon_norm", norm)


def _pad_wrap(base: Impl) -> Impl:
    """Every op maps pad ids (-1) to the pool's last slot, as Python/C negative indexing does."""
    ops = {}
    for name, arg in INDEX_ARG.items():
        if name not in base.ops:
            continue

        def before(a, arg=arg, name=name):
            pool = a[POOL_ARG[name]]
            idx = a[arg]
            a[arg] = torch.where(idx == C_.PAD_SLOT_ID, torch.full_like(idx, pool.shape[0] - 1), idx)
            return a
        ops[name] = wrap_op(name, base.ops[name], before)
    return with_ops(base, f"{base.name}[pad->last slot]", **ops)


def _dt_decode(base: Impl, kind: str) -> Impl:
    def before(a):
        if a["dt_bias"] is None:
            return a
        if kind == "bias_twice":
            a["dt"] = a["dt"] + a["dt_bias"].to(a["dt"].dtype)
        else:  # softplus twice: pre-apply bias + softplus, the op applies softplus again
            a["dt"] = F.softplus(a["dt"] + a["dt_bias"].to(a["dt"].dtype))
            a["dt_bias"] = None
        return a
    return with_ops(base, f"{base.name}[decode dt {kind}]",
                    selective_state_update=wrap_op("selective_state_update", base.ops["selective_state_update"], before))


def _groups_repeat(base: Impl) -> Impl:
    """Mamba-2 groups mapped to heads with `repeat` (head h -> group h % G) instead of repeat_interleave."""
    def before(a):
        heads = a["x"].shape[1] if a["x"].dim() == 3 else None
        if heads is None or a["B"].shape[1] == heads:
            return a
        r = heads // a["B"].shape[1]
        a["B"] = a["B"].repeat(1, r, 1).contiguous()
        a["C"] = a["C"].repeat(1, r, 1).contiguous()
        return a
    return with_ops(base, f"{base.name}[groups repeat]",
                    ssd_varlen=wrap_op("ssd_varlen", base.ops["ssd_varlen"], before),
                    selective_state_update=wrap_op("selective_state_update", base.ops["selective_state_update"],
                                                   before))


def _conv_short_chunks(base: Impl) -> Impl:
    """A prefill chunk shorter than K-1 writes its window as if the initial state were zeros."""
    def after(a, y):
        K1 = a["weight"].shape[1] - 1
        q = a["query_start_loc"].tolist()
        for s, slot in enumerate(a["cache_indices"].tolist()):
            n = q[s + 1] - q[s]
            if slot == C_.PAD_SLOT_ID or n >= K1 or not bool(a["has_initial_state"][s]):
                continue
            xs = a["x"][q[s]:q[s + 1]].t().to(a["conv_states"].dtype)
            win = torch.cat([torch.zeros(xs.shape[0], K1 - n, dtype=xs.dtype, device=xs.device), xs], dim=1)
            a["conv_states"][slot] = win
    return with_ops(base, f"{base.name}[conv short chunks]",
                    causal_conv1d_varlen=wrap_op("causal_conv1d_varlen", base.ops["causal_conv1d_varlen"],
                                                 after=after))


def row_major_conv_slots(base: Impl) -> Impl:
    """Conv ops that address a conv-state slot's elements as slot_base + d * (K-1) + k (a row-major slot:
    what `.view` on a slot or a kernel ignoring the channel and tap strides assumes). Right on row-major
    slots; on vLLM's channels-last slots ((K-1, conv_dim) in memory, strides (page, 1, conv_dim)) every
    window is read and written scrambled."""
    def before(a):
        p = a["conv_states"]
        a["conv_states"] = p.as_strided(p.shape, (p.stride(0), p.shape[2], 1), p.storage_offset())
        return a
    ops = {op: wrap_op(op, base.ops[op], before) for op in ("causal_conv1d_update", "causal_conv1d_varlen")
           if op in base.ops}
    return with_ops(base, f"{base.name}[row-major conv slots]", **ops)


def unwritten_pad_rows(base: Impl) -> Impl:
    """Ops that leave the output rows of pad requests unwritten (bug class 22): whatever the output buffer
    held stays there -- `out=`'s previous contents, or NaN without `out=` (a CUDA-graph batch buffer a
    previous replay left NaN in). Every live row, every slot and the pads' slots are the unbroken op's, so
    only a check of the pad rows themselves sees it."""
    from harness.testing import pad_rows
    ops = {}
    for name in INDEX_ARG:
        if name not in base.ops:
            continue

        def op(*args, name=name, fn=base.ops[name], **kwargs):
            pads = pad_rows(name, args, kwargs)
            out = kwargs.get("out")
            stale = None if out is None or pads is None else out[pads.to(out.device)].clone()
            y = fn(*args, **kwargs)
            if pads is not None:
                y[pads.to(y.device)] = stale if stale is not None else float("nan")
            return y
        op.__name__ = f"broken_{name}"
        ops[name] = op
    return with_ops(base, f"{base.name}[pad rows unwritten]", **ops)


def _grid(base: Impl, bug: bool) -> Impl:
    fn = grid_ssd_varlen if not bug else (lambda *a, **k: grid_ssd_varlen(*a, **k, _bug_cumsum_at_chunk_start=True))
    return with_ops(base, f"{base.name}+grid_ssd" + ("[cumsum at chunk start]" if bug else ""), ssd_varlen=fn)


DELTA_VARLEN = ("gated_delta_rule_varlen", "kda_varlen")
DELTA_UPDATE = ("gated_delta_rule_update", "kda_update")
# the scenario families whose engine mixers call a delta-rule op (from the registry, not by name)
DELTA = dict(families=tuple(f for f in SCENARIO_FAMILIES if set(engine_families.required_ops(f)) & set(DELTA_VARLEN)))


def _key_major(pool: torch.Tensor) -> torch.Tensor:
    """The pool's slots indexed (V, K) but laid out key-major in memory ((K, V), fla's default layout): what a
    kernel that stores the state the other way round writes. Pools whose slots are not densely packed are
    returned as they are."""
    *_, V, K = pool.shape
    st = pool.stride()
    if st[-1] != 1 or st[-2] != K:
        return pool
    return pool.as_strided(pool.shape, (*st[:-2], 1, V), pool.storage_offset())


def _delta_key_major_prefill(base: Impl) -> Impl:
    """The chunked prefill stores (and reads) the state key-major; the decode reads it value-major."""
    def before(a):
        a["ssm_states"] = _key_major(a["ssm_states"])
        return a
    return with_ops(base, f"{base.name}[delta prefill key-major]",
                    **{n: wrap_op(n, base.ops[n], before) for n in DELTA_VARLEN if n in base.ops})


def _decay_factor(g: torch.Tensor) -> torch.Tensor:
    """exp(g) shaped to multiply a (H, V, K) state: per head (GDN, g (H,)) or per key channel (KDA, (H, K))."""
    f = torch.exp(g.to(torch.float32))
    return f[:, None, None] if f.dim() == 1 else f[:, None, :]


def _delta_tail_chunk(base: Impl, chunk: int = 8) -> Impl:
    """The zero-padded tail of a sequence's last chunk decays the final state: each padding position applies
    the last token's decay again (the chunked form's padding taken for tokens)."""
    def after(a, y):
        q = a["query_start_loc"].tolist()
        pool, g = a["ssm_states"], a["g"]
        for s, slot in enumerate(a["cache_indices"].tolist()):
            n = q[s + 1] - q[s]
            if slot == C_.PAD_SLOT_ID or n == 0 or n % chunk == 0:
                continue
            f = _decay_factor(g[q[s + 1] - 1]) ** (chunk - n % chunk)
            pool[slot] = (pool[slot].float() * f.to(pool.device)).to(pool.dtype)
    return with_ops(base, f"{base.name}[delta tail chunk decays]",
                    **{n: wrap_op(n, base.ops[n], after=after) for n in DELTA_VARLEN if n in base.ops})


def _delta_decay_after_write(base: Impl) -> Impl:
    """The decode step writes the delta into the undecayed state and decays afterwards:
    S <- exp(g) (S + beta (v - S k) k^T) instead of S <- exp(g) S; S <- S + beta (v - S k) k^T."""
    ops = {}
    for name in DELTA_UPDATE:
        if name not in base.ops:
            continue
        names, fn = OP_ARGS[name], base.ops[name]

        def op(*args, names=names, fn=fn, **kw):
            a = dict(zip(names, args))
            g = a["g"]
            a["g"] = torch.zeros_like(g)
            y = fn(*[a[n] for n in names], **kw)
            pool, pad = a["ssm_states"], kw.get("pad_slot_id", C_.PAD_SLOT_ID)
            for b, slot in enumerate(a["state_indices"].tolist()):
                if slot != pad:
                    pool[slot] = (pool[slot].float() * _decay_factor(g[b]).to(pool.device)).to(pool.dtype)
            return y
        op.__name__ = f"broken_{name}"
        ops[name] = op
    return with_ops(base, f"{base.name}[delta decay after write]", **ops)


M2 = dict(families=("mamba2",))
VARIANTS = [
    Variant("seeding_gate", "1", "has_initial_states ANDed with the track mask in build_metadata",
            patch=_seeding_gate),
    Variant("stale_slot_seeding", "1", "has_initial_states set for every live request: one without a cached "
            "state starts from its slot's stale content", patch=_stale_seeding),
    Variant("two_return_values", "2", "the mixer backend returns 2 values; the runner unpacks 3",
            patch=_two_values),
    Variant("bs1_state_dropped", "3", "has_initial_states cleared when the step has a single request",
            patch=_bs1_drop),
    Variant("ssd_cumsum_chunk_start", "4", "global-grid varlen SSD reads cumulative dA at the chunk start "
            "instead of the sequence start", impl=lambda b: _grid(b, True), control=lambda b: _grid(b, False),
            strategy=M2),
    Variant("chunk_grid_per_request", "5", "chunk_indices/offsets computed as if every request had its own "
            "chunk grid (consumed by the global-grid SSD)", patch=_per_request_grid,
            impl=lambda b: _grid(b, False), control=lambda b: _grid(b, False), strategy=M2),
    Variant("groups_repeat", "7", "Mamba-2 groups broadcast with repeat instead of repeat_interleave",
            impl=_groups_repeat, strategy=M2),
    Variant("conv_short_chunk", "8", "a prefill chunk shorter than K-1 writes the conv window from zeros",
            impl=_conv_short_chunks),
    Variant("pad_wraps_to_last_slot", "9", "pad ids (-1) index the last slot (read and written)",
            impl=_pad_wrap, strategy=dict(pads=(4,))),
    Variant("dt_bias_twice", "10", "decode adds dt_bias twice", impl=lambda b: _dt_decode(b, "bias_twice")),
    Variant("dt_softplus_twice", "10", "decode applies softplus twice", impl=lambda b: _dt_decode(b, "softplus")),
    Variant("conv_row_major_slots", "19", "conv ops address conv-state slots row-major; the engine keeps them "
            "channels-last as vLLM does", impl=row_major_conv_slots, strategy=dict(conv_layouts=("channels_last",))),
    Variant("pad_rows_unwritten", "22", "ops leave the output rows of pad requests unwritten (NaN, as a "
            "CUDA-graph batch buffer may hold); live rows and every slot are right", impl=unwritten_pad_rows,
            strategy=dict(pads=(4,), min_new=2)),
    Variant("falcon_norms_missing", "11", "Falcon-Mamba B/C/dt RMSNorm missing",
            patch=lambda: _falcon_norm("missing"), strategy=dict(families=("falcon_mamba",))),
    Variant("falcon_norms_wrong_eps", "11", "Falcon-Mamba B/C/dt RMSNorm with the layer norm's eps (1e-5) "
            "instead of mixer_rms_eps (1e-6)", patch=lambda: _falcon_norm("eps"),
            strategy=dict(families=("falcon_mamba",))),
    Variant("delta_state_key_major", "16", "the GDN/KDA chunked prefill stores the state key-major (K, V); the "
            "decode reads it value-major (V, K)", impl=_delta_key_major_prefill, strategy=DELTA),
    Variant("delta_pad_wraps_to_last_slot", "9", "GDN/KDA: pad ids (-1) index the last slot (read and written)",
            impl=_pad_wrap, strategy=dict(DELTA, pads=(4,))),
    Variant("delta_tail_chunk_decays", "16", "GDN/KDA prefill: the zero-padded tail of the last chunk decays "
            "the final state", impl=_delta_tail_chunk, strategy=DELTA),
    Variant("delta_decay_after_write", "16", "GDN/KDA decode: the decay is applied after the delta write",
            impl=_delta_decay_after_write, strategy=DELTA),
]

# ============================================================================ running

SELFTEST_PROPERTIES = ("matches_reference", "split_invariance", "seeding", "batch_invariance")
STRATEGY = dict(max_requests=3, max_prompt=16, max_new=3, budgets=(1, 24), max_slots=3)


@dataclass
class Outcome:
    variant: Variant
    caught: bool
    properties: list
    case: Scenario | None
    control_ok: bool | None
    seconds: float
    examples: int
    error: str = ""
    impl_name: str = "reference"

    @property
    def size(self) -> tuple:
        return self.case.size if self.case is not None else (0, 0)


def _fails(props, case, factory) -> list:
    """Names of the properties in `props` that fail on `case` (any exception counts: a crash is a catch)."""
    bad = []
    for name in props:
        try:
            PROPERTIES[name](case, factory)
        except Exception as e:  # noqa: BLE001 - assertion or crash, both are catches
            bad.append((name, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
    return bad


def run_variant(v: Variant, base: Impl, *, max_examples: int = 30, seconds: float = 8.0, device: str = "cpu",
                dtype=torch.float64, seed: int | None = 0) -> Outcome:
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample
    t0 = time.time()
    broken = RunnerFactory(v.impl(base), dtype=dtype, device=device, extra=dict(v.runner))
    control = RunnerFactory(v.control(base), dtype=dtype, device=device, extra=dict(v.runner))
    memo: dict = {}
    deadline = t0 + seconds

    catching: list = []  # once a property has caught the variant, shrinking only re-runs that one

    def condition(case):
        key = str(case)
        if key not in memo:
            if time.time() > deadline and any(memo.values()):
                memo[key] = False  # budget spent: stop shrinking, keep the smallest catch so far
            else:
                memo[key] = False
                with v.patch():
                    for p in (catching or SELFTEST_PROPERTIES):
                        if _fails((p,), case, broken):
                            memo[key] = True
                            if not catching:
                                catching.append(p)
                            break
        return memo[key]

    strat = scenarios(**{**STRATEGY, **v.strategy})
    try:
        case = find(strat, condition, settings=settings(
            max_examples=max_examples, database=None, deadline=None, phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck)), random=None if seed is None else random.Random(seed))
    except NoSuchExample:
        return Outcome(v, False, [], None, None, time.time() - t0, len(memo), "no failing scenario found")
    except Exception as e:  # noqa: BLE001
        return Outcome(v, False, [], None, None, time.time() - t0, len(memo), traceback.format_exc(limit=3))
    with v.patch():
        caught_by = _fails(SELFTEST_PROPERTIES, case, broken)
    ctl = _fails(SELFTEST_PROPERTIES, case, control)
    return Outcome(v, bool(caught_by) and not ctl, caught_by, case, not ctl, time.time() - t0, len(memo),
                   "; ".join(f"control {n}: {m}" for n, m in ctl))


def reproduce(variant: str, case: Scenario, prop: str = "matches_reference", impl="reference", *,
              device: str = "cpu", dtype=torch.float64, broken: bool = True) -> None:
    """Run property `prop` on `case` with the named variant (``broken=False``: the unbroken engine);
    raises what the property raises."""
    from harness.impls import registry
    from harness.scenarios import engine_impl
    v = {x.name: x for x in VARIANTS}.get(variant)
    if v is None:
        raise ValueError(f"variant: expected one of {[x.name for x in VARIANTS]}, got {variant!r}")
    if prop not in PROPERTIES:
        raise ValueError(f"prop: expected one of {sorted(PROPERTIES)}, got {prop!r}")
    base = engine_impl(registry.get(impl) if isinstance(impl, str) else impl)
    if broken:
        with v.patch():
            PROPERTIES[prop](case, RunnerFactory(v.impl(base), dtype=dtype, device=device, extra=dict(v.runner)))
    else:
        PROPERTIES[prop](case, RunnerFactory(v.control(base), dtype=dtype, device=device, extra=dict(v.runner)))


KINDS = ("all", "scenario", "suite")


def _choose(variants, kind: str) -> tuple[list, list]:
    """(scenario variants, suite variants) named by `variants` (names or bug classes; None = all) of `kind`."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    every = VARIANTS + SUITE_VARIANTS
    if variants is not None:
        unknown = set(variants) - {v.name for v in every} - {v.bug_class for v in every}
        if unknown:
            raise ValueError(f"variant: expected names or bug classes of {[v.name for v in every]}, "
                             f"got {sorted(unknown)}")

    def pick(vs, k):
        if kind not in ("all", k):
            return []
        return [v for v in vs if variants is None or v.name in variants or v.bug_class in variants]
    return pick(VARIANTS, "scenario"), pick(SUITE_VARIANTS, "suite")


def run_selftest(impl="reference", variants=None, *, max_examples: int = 30, seconds: float = 8.0,
                 device: str = "cpu", dtype=torch.float64, seed: int | None = 0, echo=print,
                 kind: str = "all") -> list:
    """Run the chosen variants (names or bug classes; None = all; `kind`: both kinds, or only the scenario
    or the suite variants): the scenario variants against `impl` on `device`, the suite variants with the
    planted components of harness.testing.planted on the CPU (their outcomes are `SuiteOutcome`s); `seed`
    makes the hypothesis search reproducible (None: random)."""
    from harness.impls import registry
    from harness.scenarios import engine_impl
    chosen, suites = _choose(variants, kind)
    base = engine_impl(registry.get(impl) if isinstance(impl, str) else impl) if chosen else None
    outcomes = []
    for v in chosen:
        o = run_variant(v, base, max_examples=max_examples, seconds=seconds, device=device, dtype=dtype, seed=seed)
        o.impl_name = base.name
        outcomes.append(o)
        if echo:
            echo(f"  {v.name:26s} class {v.bug_class:3s} {'caught' if o.caught else 'ESCAPED'} "
                 f"({o.seconds:.1f}s, {o.examples} examples)")
    for v in suites:
        o = run_suite_variant(v)
        outcomes.append(o)
        if echo:
            echo(f"  {v.name:26s} class {v.bug_class:3s} {'caught' if o.caught else 'ESCAPED'} "
                 f"({o.seconds:.1f}s, {o.examples} tests)")
    return outcomes


def _short_test(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    return f"{path.rsplit('/', 1)[-1]}::{name}"


def format_table(outcomes: list) -> str:
    """One row per outcome: the scenario variants' catching properties and minimal request sets, the suite
    variants' failing tests and how many of the selected tests failed."""
    rows = [("variant", "class", "caught", "caught by (properties / tests)", "case", "seconds")]
    for o in outcomes:
        suite = isinstance(o, SuiteOutcome)
        if suite:
            tests = [_short_test(n) for n, _ in o.properties]
            by = (tests[0] + (f" (+{len(tests) - 1} more)" if len(tests) > 1 else "")) if tests else "-"
            case = f"{len(o.properties)} of {o.examples} tests failed"
        else:
            by = ", ".join(n for n, _ in o.properties) or "-"
            case = f"{o.size[0]} requests, {o.size[1]} tokens" if o.case else "-"
        what = "component" if suite else "engine"
        caught = "yes" if o.caught else (f"NO: the unbroken {what} fails too" if o.control_ok is False else "NO")
        rows.append((o.variant.name, o.variant.bug_class, caught, by, case, f"{o.seconds:.1f}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def format_cases(outcomes: list) -> str:
    out = []
    for o in outcomes:
        out.append(f"[{o.variant.name}] class {o.variant.bug_class}: {o.variant.description}")
        if isinstance(o, SuiteOutcome):
            if o.variant.why:
                out.append(f"  not a scenario variant: {o.variant.why}")
            out.append(f"  broken:  {o.variant.command(broken=True)}")
            out.append(f"  control: {o.variant.command(broken=False)}")
            for n, m in o.properties:
                out.append(f"  {n}: {m}")
        else:
            if o.case is not None:
                out.append(f"  minimal case: {o.case}")
                prop = o.properties[0][0] if o.properties else "matches_reference"
                out.append(f"  reproduce: python -c \"from harness.selftest import reproduce; from harness.scenarios "
                           f"import Scenario; reproduce('{o.variant.name}', {o.case}, '{prop}', impl='{o.impl_name}')\"")
            for n, m in o.properties:
                out.append(f"  {n}: {m}")
        if o.error:
            out.append(f"  note: {o.error.strip()}")
    return "\n".join(out)


def documented_classes(path: str | None = None) -> dict[str, str]:
    """The bug classes of docs/bug-classes.md: class number -> the row's "selftest variant" cell, read from the
    table (rows `| <number> | ...`), so that a class added there without a variant is seen."""
    import os
    import re
    from harness.selftest_suites import repo_root
    path = path or os.path.join(repo_root(), "docs", "bug-classes.md")
    with open(path) as f:
        lines = [ln.strip() for ln in f]

    def cells(ln):  # a cell may hold an escaped pipe (`\\|A\\|`)
        return [c.strip() for c in re.split(r"(?<!\\)\|", ln.strip().removeprefix("|").removesuffix("|"))]
    head = next((i for i, ln in enumerate(lines) if ln.startswith("|") and cells(ln)[0] == "#"), None)
    if head is None or "selftest variant" not in cells(lines[head]):
        raise ValueError(f"{path}: expected a table with the columns '#' and 'selftest variant', got none")
    col = cells(lines[head]).index("selftest variant")
    rows = {}
    for ln in lines[head + 2:]:
        if not ln.startswith("|"):
            break
        c = cells(ln)
        if c[0].isdigit():
            rows[c[0]] = c[col] if col < len(c) else ""
    return rows


def add_args(p):
    """The selftest's arguments; the CLI defines them (`harness.cli`) so that building the parser needs no torch."""
    from harness.cli import _selftest_args
    _selftest_args(p)


def main(args) -> int:
    kind = getattr(args, "kind", "all")
    if args.list:
        scen, suites = _choose(None, kind)
        for v in scen:
            print(f"{v.name:26s} class {v.bug_class:3s} scenario  {v.description}")
        for v in suites:
            print(f"{v.name:26s} class {v.bug_class:3s} suite     {v.description}")
        return 0
    if args.max_examples < 1 or args.seconds <= 0:
        raise ValueError(f"--max-examples/--seconds: expected positive values, got {args.max_examples}/{args.seconds}")
    try:
        _choose(args.variant, kind)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    from harness.devices import resolve_or_exit
    # A device this machine lacks is one usage error (exit 4), not twelve variants escaping on it.
    device = resolve_or_exit(getattr(args, "device", "cpu"), "harness selftest")
    dtype = {"float64": torch.float64, "float32": torch.float32}[getattr(args, "dtype", "float64")]
    print(f"harness selftest: breaking the engine on purpose ({args.impl}, {dtype}, {device})", flush=True)
    seed = getattr(args, "seed", 0)
    outcomes = run_selftest(args.impl, args.variant, max_examples=args.max_examples, seconds=args.seconds,
                            seed=None if seed == -1 else seed, device=device, dtype=dtype, kind=kind)
    print()
    print(format_table(outcomes))
    print()
    print(format_cases(outcomes))
    escaped = [o.variant.name for o in outcomes if not o.caught]
    print(f"\nharness selftest: {len(outcomes) - len(escaped)}/{len(outcomes)} variants caught"
          + (f"; ESCAPED: {escaped}" if escaped else ""))
    return 1 if escaped else 0
