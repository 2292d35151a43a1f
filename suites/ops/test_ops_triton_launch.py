"""`harness.impls.triton._common.launch`: our kernels' launches skip Triton's per-call binding once a call of the
same specialisation has run. The shortcut is only safe if it tells specialisations apart exactly as Triton does:
the key is checked against Triton's own binder on the CPU (no launch needed), and on CUDA the shortcut's launches
are checked against `kernel[grid]` over the alignments and integer classes Triton specialises on."""
from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import given, strategies as st
import triton.language as tl
from triton.runtime.jit import JITFunction, create_function_from_signature

from harness.impls.triton import _common


def _scale_copy(x_ptr, y_ptr, n, sx, sy, alpha, flag, BLOCK: tl.constexpr, NEG: tl.constexpr = False):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x_ptr + i * sx, mask=m, other=0.0) * alpha
    if NEG:
        v = -v
    v = tl.where(flag, v, v + 0.0)
    tl.store(y_ptr + i * sy, v, mask=m)


def _jit(fn=_scale_copy, **kw) -> JITFunction:
    """A JITFunction whatever TRITON_INTERPRET says (binding needs no device and no compile)."""
    return JITFunction(fn, **kw)


def _calls():
    """Calls that Triton tells apart, and some it does not: integers in every class (1, multiples of 16, others,
    64-bit, negative), True against 1, 0.0 against 0, aligned and misaligned pointers of several dtypes,
    constexprs and launch options."""
    x = torch.zeros(64)
    for n in (1, 2, 16, 17, 32, 0, -1, 2 ** 31 - 1, 2 ** 31, 2 ** 40, True, False, 1.0, 0.0):
        yield (x, x, n, 1, 16, 0.5, True), dict(BLOCK=16)
    yield (x, x, 3, 1, 16, 0.5, True), dict(BLOCK=16)
    # a constexpr as True and as 1: one key of a dict, two specialisations (the nightly profile's minimal case)
    yield (x, x, 0, 0, 0, 0, 0), dict(BLOCK=16, NEG=True)
    yield (x, x, 0, 0, 0, 0, 0), dict(BLOCK=16, NEG=1)
    yield (x[1:], x, 7, 3, 1, 2.0, False), dict(BLOCK=32, NEG=True)
    yield (x[4:], x[8:], 7, 3, 1, 2.0, False), dict(BLOCK=32, NEG=True)
    yield (x.to(torch.float16), x[4:], 7, 16, 16, 1.0, True), dict(BLOCK=16, num_warps=2)
    yield (x.to(torch.float16)[8:], x[4:], 7, 16, 16, 1.0, True), dict(BLOCK=16, num_warps=2)
    yield (x.to(torch.int32)[2:], x, 64, 1, 1, 1.0, False), dict(BLOCK=64)
    yield (x, x, 64, 1, 1, 1.0, 1), dict(BLOCK=64)


@pytest.mark.parametrize("dns", [(), ("n",), ("sx", "sy")])
def test_equal_keys_have_equal_triton_specialisations(dns):
    """Whenever two calls get the same key, Triton's binder (its generated function, with the parameters'
    do_not_specialize flags) gives them the same specialisation and options: a key never maps a call onto a
    kernel compiled for another specialisation. Calls Triton tells apart by integer class are told apart."""
    from triton.backends.compiler import BaseBackend
    kernel = _jit(do_not_specialize=list(dns))
    plan = _common._plan_of(kernel)
    assert plan is not _common._NO_PLAN
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    seen = {}
    for args, kw in _calls():
        _, spec, options = binder(*args, **kw)
        want = (repr(spec), sorted(options.items()))
        key = _common.launch_key(args, kw)
        assert seen.setdefault(key, want) == want, (args[2:], kw)
    assert len(set(map(repr, seen.values()))) >= (8 if "n" not in dns else 5)


_SCALARS = st.one_of(st.integers(-2 ** 40, 2 ** 40), st.sampled_from([0, 1, 16, 2 ** 31 - 1, 2 ** 31, -2 ** 31]),
                    st.booleans(), st.floats(-4.0, 4.0, allow_nan=False), st.none())
_BUFS = {dt: torch.zeros(64, dtype=dt) for dt in (torch.float32, torch.float16, torch.int32)}


def _twins(v):
    """Values a key could confuse with `v`: equal in Python but of another type (True and 1, 0.0 and 0), the
    next integer class, or the same tensor one element along (16-byte alignment) or of another dtype."""
    if isinstance(v, torch.Tensor):
        return [v[1:], v[4:], _BUFS[torch.float16][:v.numel()], _BUFS[torch.int32][:v.numel()]]
    if v is None:
        return [0, False]
    out = [int(v), float(v), bool(v)] if not isinstance(v, float) or v.is_integer() else [v + 1.0]
    return out + ([v + 1, v * 16, v + 2 ** 31] if type(v) is int else [])


@st.composite
def _twin_calls(draw):
    """A call of `_scale_copy` (tensors at aligned or misaligned offsets, any scalars) and variants of it with
    one argument replaced by a twin (`_twins`) or a launch option changed."""
    def tensor():
        return _BUFS[draw(st.sampled_from(list(_BUFS)))][draw(st.integers(0, 9)):]
    base = [tensor(), tensor(), *(draw(_SCALARS) for _ in range(5))]
    kw = dict(BLOCK=draw(st.sampled_from([16, 32])))
    calls = [(tuple(base), kw)]
    for _ in range(draw(st.integers(1, 8))):
        args, k = list(base), dict(kw)
        pos = draw(st.integers(0, len(args)))
        if pos == len(args):
            k[draw(st.sampled_from(["NEG", "num_warps"]))] = draw(st.sampled_from([True, 1, 4]))
        else:
            args[pos] = draw(st.sampled_from(_twins(args[pos])))
        calls.append((tuple(args), k))
    return calls


@given(calls=_twin_calls())
def test_equal_keys_have_equal_specialisations_for_any_calls(calls):
    """Property: for a call and its near twins (an argument equal in Python but of another type, the next
    integer class, a pointer one element along, another dtype, other options), calls with the same key have the
    same specialisation and options in Triton's binder."""
    from triton.backends.compiler import BaseBackend
    kernel = _jit()
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    seen = {}
    for args, kw in calls:
        _, spec, options = binder(*args, **kw)
        want = (repr(spec), sorted(options.items()))
        assert seen.setdefault(_common.launch_key(args, kw), want) == want, (args[2:], kw)


def test_class_keys_are_the_binders_specialisations():
    """`class_key` (what a call with a new key looks up a kernel compiled for another call by) is equal for two
    calls exactly when Triton's binder gives them the same specialisation and options as Triton writes them in
    its kernels' keys (constexprs True and 1 apart); None where the binder raises (a parameter without a value:
    the call then takes Triton's own error)."""
    from triton.backends.compiler import BaseBackend
    kernel = _jit()
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    wants, keys = [], []
    for args, kw in _calls():
        _, spec, options = binder(*args, **kw)
        wants.append((repr(spec), str(options)))
        keys.append(_common.class_key(binder, args, kw))
    assert None not in keys
    for i in range(len(keys)):
        for j in range(i):
            assert (keys[i] == keys[j]) == (wants[i] == wants[j]), (i, j, wants[i], wants[j])
    assert len(set(keys)) >= 8
    assert _common.class_key(binder, (torch.zeros(4),), dict(BLOCK=8)) is None


def test_values_fill_defaults_and_leave_out_options():
    """The launcher's values: every parameter in order, constexprs by keyword, defaults filled, launch options
    (num_warps) not among them; None when a parameter has no value (the call then takes Triton's error)."""
    plan = _common._plan_of(_jit())
    x = torch.zeros(4)
    vals = _common.launch_values(plan, (x, x, 4, 1, 1, 1.0, True), dict(BLOCK=8, num_warps=4))
    assert vals[2:] == [4, 1, 1, 1.0, True, 8, False] and len(vals) == len(plan.params)
    assert _common.launch_values(plan, (x, x, 4), dict(BLOCK=8)) is None


def test_kernels_the_shortcut_does_not_cover_take_the_jit_path():
    """Annotated non-constexpr parameters (Triton's binder special-cases them), pre-run hooks and anything that
    is not a plain JITFunction (an autotuner, the interpreter's function) get no plan."""
    def annotated(x_ptr, n: tl.int64, BLOCK: tl.constexpr):
        pass
    assert _common._plan_of(_jit(annotated)) is _common._NO_PLAN
    hooked = _jit()
    hooked.add_pre_run_hook(lambda *a, **k: None)
    assert _common._plan_of(hooked) is _common._NO_PLAN
    tuned = triton.autotune([triton.Config({})], key=[])(_jit())
    assert _common._plan_of(tuned) is _common._NO_PLAN


def test_launch_on_gpu_matches_the_jit_path(device, monkeypatch):
    """On CUDA: over aligned and misaligned pointers, strides of 1, 16 and others and element counts in every
    class, each call through `launch` writes what the kernel launched through `kernel[grid]` writes, and a
    second call of a specialisation seen before does not enter Triton's `JITFunction.run` -- nor does a call of a
    new key (other values, a new launch plan) whose specialisation ran before."""
    if not device.startswith("cuda"):
        pytest.skip("the shortcut launches compiled CUDA kernels; elsewhere `launch` is kernel[grid]")
    if _common.interpreting():
        pytest.skip("TRITON_INTERPRET=1: kernels run in the interpreter, `launch` is kernel[grid]")
    kernel = triton.jit(_scale_copy)
    entered = []
    run = JITFunction.run

    def counted(self, *a, **k):
        entered.append(1)
        return run(self, *a, **k)
    monkeypatch.setattr(JITFunction, "run", counted)
    buf = torch.randn(4096, device=device)
    for off_x, off_y, n, sx, sy in [(0, 0, 64, 1, 1), (1, 0, 64, 1, 1), (0, 3, 17, 16, 1), (5, 0, 1, 3, 16),
                                   (0, 0, 200, 2, 3), (2, 2, 33, 1, 1)]:
        for flag in (True, False):
            x = buf[off_x:]
            got = torch.full((4096,), float("nan"), device=device)
            want = got.clone()
            args = (x, got[off_y:], n, sx, sy, 0.5, flag)
            grid = (triton.cdiv(n, 32),)
            for _ in range(2):
                before = len(entered)
                _common.launch(kernel, grid, *args, BLOCK=32)
            assert len(entered) == before, "a repeated specialisation went through JITFunction.run"
            kernel[grid](x, want[off_y:], n, sx, sy, 0.5, flag, BLOCK=32)
            torch.cuda.synchronize()
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (off_x, off_y, n, sx, sy, flag)
    # new keys of the specialisations run above (other counts and strides of the same classes, pointers at other
    # offsets of the same alignment; launch plans' new launches) take the compiled kernel without
    # JITFunction.run, and write what kernel[grid] writes
    for off_x, off_y, n, sx, sy, fixed in [(0, 0, 96, 1, 1, False), (5, 0, 80, 1, 1, False),
                                           (4, 7, 49, 32, 1, False), (1, 0, 1, 5, 48, True),
                                           (0, 4, 300, 7, 9, True), (6, 6, 35, 1, 1, False)]:
        x = buf[off_x:]
        got = torch.full((4096,), float("nan"), device=device)
        want = got.clone()
        args = (x, got[off_y:], n, sx, sy, 0.25, True)
        grid = (triton.cdiv(n, 32),)
        before = len(entered)
        if fixed:
            _common.launch_fixed(_common.Fixed(kernel, grid, BLOCK=32), *args)
        else:
            _common.launch(kernel, grid, *args, BLOCK=32)
        assert len(entered) == before, f"a new key of a compiled specialisation entered JITFunction.run: {args[2:]}"
        kernel[grid](x, want[off_y:], n, sx, sy, 0.25, True, BLOCK=32)
        torch.cuda.synchronize()
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (off_x, off_y, n, sx, sy, fixed)


def test_jit_launches_turns_the_shortcut_off_and_back():
    """`jit_launches()` (the throughput bench's --compare-launch) sends every launch through kernel[grid] inside
    and restores the setting after, also when the body raises."""
    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: ("kernel[grid]", grid, a, k)
    before = _common._SHORTCUT
    with pytest.raises(KeyError):
        with _common.jit_launches():
            assert _common._SHORTCUT is False
            assert _common.launch(Kernel(), (3,), 1, BLOCK=2) == ("kernel[grid]", (3,), (1,), {"BLOCK": 2})
            raise KeyError("body")
    assert _common._SHORTCUT is before


def test_hooks_are_seen_in_either_form():
    """`hooked` sees a launch hook (a profiler's) as Triton keeps it: a callable or None, or a chain object that is
    never None (Triton's own default: an empty chain, which must not count, else the shortcut never runs)."""
    from types import SimpleNamespace as NS
    from triton import knobs

    def hook(meta):
        return None
    assert not _common.hooked(NS(launch_enter_hook=None, launch_exit_hook=None))
    assert _common.hooked(NS(launch_enter_hook=hook, launch_exit_hook=None))
    assert _common.hooked(NS(launch_enter_hook=None, launch_exit_hook=hook))
    assert not _common.hooked(NS(launch_enter_hook=NS(calls=[]), launch_exit_hook=NS(calls=[])))
    assert _common.hooked(NS(launch_enter_hook=NS(calls=[hook]), launch_exit_hook=NS(calls=[])))
    assert not _common.hooked(knobs.runtime), "this Triton's default knobs read as hooked: the shortcut is off"
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert _common.hooked(knobs.runtime)
        finally:
            chain.remove(hook)


@given(alphas=st.lists(st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1e300, -1e-300, 3.5e38])), min_size=2,
                       max_size=6),
       offsets=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=2, max_size=6))
def test_fixed_keys_have_equal_specialisations(alphas, offsets):
    """Property: a launch plan's launches (`launch_fixed`) pass the same values but for float arguments and the
    tensors' addresses; their key (`fixed_key`: the launch and each tensor's 16-byte alignment) maps calls that
    differ only there onto one specialisation and options of Triton's binder (floats of any magnitude, NaN,
    infinities, signed zeros; pointers at any offset)."""
    from triton.backends.compiler import BaseBackend
    kernel = _jit()
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    fixed = _common.Fixed(kernel, (1,), BLOCK=16)
    seen = {}
    buf = _BUFS[torch.float32]
    for alpha, (ox, oy) in zip(alphas, offsets):
        args = (buf[ox:], buf[oy:], 7, 1, 16, alpha, True)
        _, spec, options = binder(*args, **fixed.kw)
        want = (repr(spec), sorted(options.items()))
        assert seen.setdefault(_common.fixed_key(fixed, args), want) == want, (alpha, ox, oy)
