"""Per-signature caches of the eager host path: the validators' memo (harness.ops: calls given `out=`, index checks
off) and the Triton ops' launch plans (`_common.HostPlans`), both keyed on the arguments' metadata
(`_checks.call_key`). A cached signature must not answer for a call it does not cover: `out=` or an argument
written whole in place sharing memory with another argument (same metadata, other addresses), slot ids out of
range with the index checks on, a changed stride or dtype, a launch configuration changed in place, the
environment read again; and a plan holds no value read from a tensor (query_start_loc rewritten in place between
two calls is honoured)."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from harness.ops import SPECS, no_index_checks
from harness.testing.checks import assert_bitwise_equal
from harness.testing.optest import validator_paths

OPS = sorted(SPECS)


def _contract(sp, device, shape=None):
    return sp.inputs(shape or sp.shapes["contract"][0], torch.float32, device, torch.Generator().manual_seed(0))


def _clone(kw):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _first_activation(sp):
    return sp.args[0] if sp.pool != sp.args[0] else sp.args[1]


def _validate(sp, kw):
    import inspect
    pos, opt = sp.split(kw)
    takes = inspect.signature(sp.validate).parameters
    return pos, {k: v for k, v in opt.items() if k in takes}


def _out_like(sp, kw):
    pos, opt = sp.split(_clone(kw))
    return torch.empty_like(sp.reference(torch.float32, *pos, **opt))


def _overlapping(kw, name, like):
    """`kw` with argument `name` moved into a buffer and an output of `like`'s shape and dtype one element into
    it (the metadata of both unchanged: a memo keyed on metadata alone would accept the call)."""
    x = kw[name]
    buf = torch.zeros(max(x.numel(), like.numel()) + 1, dtype=x.dtype, device=x.device)
    moved = buf[:x.numel()].view(x.shape).copy_(x)
    return dict(kw, **{name: moved}), buf[1:1 + like.numel()].view(like.shape)


@pytest.mark.parametrize("op", OPS)
def test_memo_still_compares_addresses(device, op):
    """After the validator has accepted a call with `out=` (its memo filled), an `out=` with the same metadata
    that shares memory with the first activation is rejected as the rule-by-rule checks reject it."""
    sp = SPECS[op]
    kw = _contract(sp, device)
    out = _out_like(sp, kw)
    x = kw[_first_activation(sp)]
    if x.dtype != out.dtype:
        pytest.skip(f"{op}: the output's dtype is not the first activation's")
    with no_index_checks():
        pos, opt = _validate(sp, dict(kw, out=out))
        for _ in range(2):
            want = sp.checks(*pos, **opt)
            assert sp.validate(*pos, **opt) == want
        bad, bad_out = _overlapping(kw, _first_activation(sp), out)
        pos, opt = _validate(sp, dict(bad, out=bad_out))
        fast, slow = validator_paths(sp, pos, opt)
    assert fast == slow and fast[0] == "raised" and "out" in fast[2], (fast, slow)


def test_memo_compares_a_residual_written_in_place():
    """add_rms_norm writes its residual in place: after an accepted call, a residual with the same metadata
    that shares x's memory is rejected."""
    sp = SPECS["add_rms_norm"]
    kw = _contract(sp, "cpu")
    out = _out_like(sp, kw)
    with no_index_checks():
        pos, opt = _validate(sp, dict(kw, out=out))
        sp.validate(*pos, **opt)
        sp.validate(*pos, **opt)
        x = kw["x"]
        buf = torch.zeros(x.numel() + 1)
        bad = dict(kw, x=buf[:x.numel()].view(x.shape), residual=buf[1:].view(x.shape))
        pos, opt = _validate(sp, dict(bad, out=out))
        fast, slow = validator_paths(sp, pos, opt)
    assert fast == slow and fast[0] == "raised" and "residual" in fast[2], fast


def test_memo_follows_metadata():
    """A memoised signature answers only calls of equal metadata: another stride or dtype of an argument is
    validated again (a non-contiguous copy is valid input, an int32 activation is not)."""
    sp = SPECS["gated_delta_rule_update"]
    kw = _contract(sp, "cpu")
    out = _out_like(sp, kw)
    with no_index_checks():
        pos, opt = _validate(sp, dict(kw, out=out))
        dims = sp.validate(*pos, **opt)
        assert sp.validate(*pos, **opt) == dims
        q = kw["q"]
        strided = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2]).narrow(2, 0, q.shape[2]).copy_(q)
        pos, opt = _validate(sp, dict(kw, q=strided, out=out))
        assert sp.validate(*pos, **opt) == dims
        pos, opt = _validate(sp, dict(kw, q=q.to(torch.int32), out=out))
        with pytest.raises(ValueError, match="q"):
            sp.validate(*pos, **opt)


# ---- the Triton ops' launch plans ------------------------------------------------------------------------------

def _triton(device):
    from harness.impls.registry import get
    impl = get("triton")
    why = impl.why_unavailable(device)
    if why:
        pytest.skip(why)
    return impl


def _op(impl, name):
    from harness.testing import strict_op
    return strict_op(impl, name)


def _all_plans():
    """Every HostPlans of the Triton modules."""
    from harness.impls.triton import _common
    found = []
    for mod in _common.kernel_modules():
        for v in vars(mod).values():
            if isinstance(v, _common.HostPlans):
                found.append(v)
            elif isinstance(v, dict):
                found += [p for p in v.values() if isinstance(p, _common.HostPlans)]
    return found


@contextlib.contextmanager
def _recorded_launches():
    """The `Fixed` launches made inside (the plans' launches still run)."""
    from harness.impls.triton import _common
    seen, real = [], _common.launch_fixed

    def recording(fixed, *args):
        seen.append(fixed)
        return real(fixed, *args)
    mods = [m for m in _common.kernel_modules() if getattr(m, "launch_fixed", None) is real]
    with contextlib.ExitStack() as stack:
        for m in mods:
            stack.enter_context(mock.patch.object(m, "launch_fixed", recording))
        yield seen


PLANNED = [op for op in OPS if op != "add_rms_norm"]


@pytest.mark.parametrize("op", OPS)
def test_plan_rejects_shared_memory_after_a_cached_call(device, op):
    """The op has run twice with `out=` (its plan cached): an `out=` of the same metadata sharing the first
    activation's memory is rejected with a ValueError naming `out`, the pool and the inputs unchanged."""
    impl = _triton(device)
    sp = SPECS[op]
    fn = _op(impl, op)
    kw = _contract(sp, device)
    out = _out_like(sp, kw)
    if kw[_first_activation(sp)].dtype != out.dtype:
        pytest.skip(f"{op}: the output's dtype is not the first activation's")
    with no_index_checks():
        for _ in range(2):
            sp.call(fn, dict(_clone(kw), out=out))
        bad, bad_out = _overlapping(kw, _first_activation(sp), out)
        watch = [n for n in (_first_activation(sp), sp.pool) if n]
        before = {n: bad[n].clone() for n in watch}
        with pytest.raises(ValueError, match="out"):
            sp.call(fn, dict(bad, out=bad_out))
    for n in watch:
        assert_bitwise_equal(f"{op}: {n} after the rejected call", bad[n], before[n])


@pytest.mark.parametrize("op", [op for op in OPS if SPECS[op].index])
def test_plan_still_reads_slot_ids_with_index_checks(device, op):
    """With the index checks on, a cached plan does not answer for the slot ids: an id past the pool after two
    valid calls of the same metadata raises naming the index argument, the pool unchanged."""
    impl = _triton(device)
    sp = SPECS[op]
    fn = _op(impl, op)
    kw = _contract(sp, device)
    for _ in range(2):
        sp.call(fn, _clone(kw))
    bad = _clone(kw)
    bad[sp.index].view(-1)[0] = bad[sp.pool].shape[0]
    before = bad[sp.pool].clone()
    with pytest.raises(ValueError, match=sp.index):
        sp.call(fn, bad)
    assert_bitwise_equal(f"{op}: the pool after the rejected call", bad[sp.pool], before)


@pytest.mark.parametrize("op", PLANNED)
def test_plan_follows_strides_and_dtypes(device, op):
    """After a cached call, the first activation as a strided view (same values) gives the same result bit for
    bit through a plan of its own, and as an int32 tensor raises naming it."""
    impl = _triton(device)
    sp = SPECS[op]
    fn = _op(impl, op)
    kw = _contract(sp, device)
    name = _first_activation(sp)
    want = sp.call(fn, _clone(kw))
    assert_bitwise_equal(f"{op}: a repeated call", sp.call(fn, _clone(kw)), want)
    x = kw[name]
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1] + 1, dtype=x.dtype, device=x.device)
    strided = wide.narrow(-1, 1, x.shape[-1]).copy_(x)
    got = sp.call(fn, dict(_clone(kw), **{name: strided}))
    assert_bitwise_equal(f"{op}: {name} strided", got, want)
    with pytest.raises(ValueError, match=name):
        sp.call(fn, dict(_clone(kw), **{name: x.to(torch.int32)}))


def test_plan_follows_the_launch_configuration(device):
    """A launch configuration changed in place after a cached call (as tests and sweeps change it) makes a new
    plan: selective_scan's CONFIG["mode"] reaches the kernel's ASSOC flag."""
    impl = _triton(device)
    from harness.impls.triton import selective_scan as M
    sp = SPECS["selective_scan_varlen"]
    fn = _op(impl, sp.name)
    kw = _contract(sp, device)
    flags = []
    for mode in ("loop", "assoc", "loop"):
        with mock.patch.dict(M.CONFIG, {"mode": mode}), _recorded_launches() as seen:
            sp.call(fn, _clone(kw))
        flags.append({f.kw["ASSOC"] for f in seen if "ASSOC" in f.kw})
    assert flags == [{False}, {True}, {False}], flags


def test_plan_follows_a_nested_launch_setting():
    """A plan's copy of its configuration is its own at every level: ssd's per-stage tables are dicts inside
    TUNING, and a stage setting changed in place after a plan was made no longer matches it."""
    from harness.impls.triton import _common, ssd
    snap = _common._snapshot(ssd._CONFIGS)
    assert snap == ssd._CONFIGS
    with mock.patch.dict(ssd.TUNING["chunk_scan"], {"block_m": 16}):
        assert snap != ssd._CONFIGS
    assert snap == ssd._CONFIGS


def test_plans_share_one_copy_of_an_unchanged_configuration():
    """Plans made while the configuration keeps its values share one copy of it (no copy per new signature); a
    setting changed in place gives the next plan a new copy, and the plans before it no longer match."""
    from harness.impls.triton import _common
    cfg = {"stage": {"block": 16}, "fused": True}
    made = []
    plans = _common.HostPlans(lambda *a: None, lambda checked, call: made.append(call) or len(made), cfg)
    plans.plan((1,))
    plans.plan((2,))
    a, b = plans.plans[_common.call_key((1,))][1], plans.plans[_common.call_key((2,))][1]
    assert a is b and a == cfg and a is not cfg and a["stage"] is not cfg["stage"]
    cfg["stage"]["block"] = 32
    plans.plan((3,))
    c = plans.plans[_common.call_key((3,))][1]
    assert c is not a and c == cfg and a != cfg
    assert plans.plan((1,)) == 4 and plans.plan((1,)) == 4  # stale: made anew once, then found


def test_plans_follow_refresh_env(device):
    """`refresh_env` reads the environment again: plans made before it are made anew (a kernel's NVIDIA-only
    paths depend on what it read)."""
    impl = _triton(device)
    from harness.impls.triton import _common
    sp = SPECS["causal_conv1d_update"]
    fn = _op(impl, sp.name)
    kw = _contract(sp, device)
    runs = []
    for refresh in (False, False, True):
        if refresh:
            _common.refresh_env()
        with _recorded_launches() as seen:
            sp.call(fn, _clone(kw))
        runs.append(seen[0])
    assert runs[0] is runs[1] and runs[2] is not runs[1]


def _rewritten(sp, kw) -> list:
    """Other valid offsets over the same tokens and sequence count (a sequence one token longer, the next one
    shorter), or [] where there are none."""
    v = kw["query_start_loc"].tolist()
    for i in range(1, len(v) - 1):
        for d in (1, -1):
            w = list(v)
            w[i] += d
            cand = dict(_clone(kw), query_start_loc=torch.tensor(w, dtype=kw["query_start_loc"].dtype,
                                                                  device=kw["query_start_loc"].device))
            try:
                sp.validate(*_validate(sp, cand)[0], **_validate(sp, cand)[1])
            except ValueError:
                continue
            return w
    return []


@pytest.mark.parametrize("op", [op for op in PLANNED if "query_start_loc" in SPECS[op].args])
def test_plan_honours_offsets_rewritten_in_place(device, op):
    """query_start_loc rewritten in place between two calls (the same tensor, the same metadata): the second
    call, through the plan the first made, gives bit for bit what a plan made for the new offsets gives."""
    impl = _triton(device)
    sp = SPECS[op]
    fn = _op(impl, op)
    kw = _contract(sp, device)
    new = _rewritten(sp, kw)
    if not new:
        pytest.skip(f"{op}: the contract case's offsets cannot move")
    first = _clone(kw)
    sp.call(fn, first)
    run = _clone(kw)
    run["query_start_loc"].copy_(torch.tensor(new, dtype=run["query_start_loc"].dtype))
    fresh = _clone(run)
    got = sp.call(fn, run)
    for p in _all_plans():
        p.plans.clear()
    want = sp.call(fn, fresh)
    assert_bitwise_equal(f"{op}: output after the offsets changed", got, want)
    if sp.pool:
        assert_bitwise_equal(f"{op}: pool after the offsets changed", run[sp.pool], fresh[sp.pool])


@pytest.mark.parametrize("op", [op for op in OPS if SPECS[op].in_place])
def test_in_place_calls_through_a_cached_plan(device, op):
    """`out=` the in-place argument itself, call after call (the plan and the validators' memo cached): accepted,
    with the out-of-place result bit for bit; an output one element into it is still rejected."""
    impl = _triton(device)
    sp = SPECS[op]
    fn = _op(impl, op)
    kw = _contract(sp, device)
    want = sp.call(fn, _clone(kw))
    with no_index_checks():
        for _ in range(3):
            run = _clone(kw)
            got = sp.call(fn, dict(run, out=run[sp.in_place]))
            assert got.data_ptr() == run[sp.in_place].data_ptr()
            assert_bitwise_equal(f"{op}: in place through a cached plan", got, want)
        bad, bad_out = _overlapping(kw, sp.in_place, want)
        with pytest.raises(ValueError, match="out"):
            sp.call(fn, dict(bad, out=bad_out))
