"""The eager host path of every op. A validator answers valid input from its fast path (one predicate over the
tensors' metadata, no message built) with exactly what its rule-by-rule checks return, at every shape list of
the spec, with and without the index checks and `out=` (the fuzz test in test_ops_contract_fuzz.py drives
both paths with malformed input). The Triton launchers read the environment once, at import;
`refresh_env` reads it again."""
from __future__ import annotations

import contextlib
import inspect
import sys

import pytest
import torch

from harness.ops import SPECS, no_index_checks
from harness.testing.optest import validator_paths

OPS = sorted(SPECS)


def _slow_code(sp):
    """The code object of the spec's rule-by-rule checks (a function, or a partial of one; under the `out=`
    guard harness.ops puts in front of both paths)."""
    checks = inspect.unwrap(sp.checks)
    return getattr(checks, "func", checks).__code__


def _ran(fn, code) -> tuple:
    """(fn(), whether a function with `code` ran during the call)."""
    seen = []
    prev = sys.getprofile()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code is code:
            seen.append(frame)

    sys.setprofile(prof)
    try:
        r = fn()
    finally:
        sys.setprofile(prev)
    return r, bool(seen)


def _cases(sp, device):
    """(shape list, shape, inputs by name): the builder's inputs for the contract, cpu and aot shapes on the
    device under test; the gpu shapes' inputs on the CPU, unfilled (as `harness bench host` builds them)."""
    from harness.bench.host import _materialize
    gen = torch.Generator().manual_seed(0)
    for kind in ("contract", "cpu", "aot"):
        for shape in sp.shapes.get(kind, ()):
            yield kind, shape, sp.inputs(shape, torch.float32, device, gen)
    for shape in sp.shapes["gpu"]:
        yield "gpu", shape, _materialize(sp, shape, torch.bfloat16)


def _validate_args(sp, kw):
    pos, opt = sp.split(kw)
    takes = inspect.signature(sp.validate).parameters
    return pos, {k: v for k, v in opt.items() if k in takes}


@pytest.mark.parametrize("op", OPS)
def test_valid_inputs_take_the_fast_path(device, op):
    """No valid input set of the spec reaches the slow path, and the fast path's dimensions are the checks'."""
    sp = SPECS[op]
    code = _slow_code(sp)
    for kind, shape, kw in _cases(sp, device):
        variants = [kw]
        if kind == "contract":  # with a preallocated output too
            pos, opt = sp.split({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()})
            variants.append(dict(kw, out=torch.empty_like(sp.reference(torch.float32, *pos, **opt))))
        for inp in variants:
            pos, opt = _validate_args(sp, inp)
            for index_checks in (True, False):
                with contextlib.nullcontext() if index_checks else no_index_checks():
                    dims, slow = _ran(lambda: sp.validate(*pos, **opt), code)
                    want = sp.checks(*pos, **opt)
                where = f"{op} {kind} {shape} (out={'out' in inp}, index checks {'on' if index_checks else 'off'})"
                assert not slow, f"{where}: valid input went through the rule-by-rule checks"
                assert dims == want, f"{where}: the fast path returned {dims}, the checks {want}"


DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool)
GARBAGE = (None, "x", 1, -1, 0, True, 1.5, float("nan"), (0.0, 1.0), (1, 0), [0.0, 1.0], 10**30)


def _clone(kw):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}


def _single_defects(sp, kw):
    """(what, mutated inputs): every tensor argument (and `out=`) resized by one along each dim, with a dim
    more and one less, in every other dtype, on the meta device, overlapping itself, None, a list; each entry
    of every integer tensor (slot ids, offsets, counts) set to values around its own and the pool's bounds;
    every other argument and every option set to each garbage value; B and C with 3 groups; every tensor on
    the meta device; no sequences; the spec's own malformed inputs."""
    for what, _, mutate in sp.bad_inputs:
        k = _clone(kw)
        mutate(k)
        yield what, k
    if "B" in kw and "C" in kw:  # a group count dividing none of the contract cases' channel counts
        yield "B and C with 3 groups", dict(kw, B=torch.cat([kw["B"]] * 3, dim=1), C=torch.cat([kw["C"]] * 3, dim=1))
    yield "every tensor on the meta device", {k: v.to("meta") if torch.is_tensor(v) else v for k, v in kw.items()}
    if "query_start_loc" in kw:  # no sequences, every per-sequence tensor empty alike
        rows = {a: kw[a][:0] for a in (sp.index, "has_initial_state", "num_accepted_tokens") if a in kw}
        yield "query_start_loc of one entry", dict(kw, query_start_loc=kw["query_start_loc"][:1], **rows)
    for a, v in kw.items():
        if a in sp.options or torch.is_tensor(v):
            continue
        for g in GARBAGE:
            yield f"{a}={g!r}", dict(kw, **{a: g})
    num_slots = kw[sp.pool].shape[0] if sp.pool else 1
    for a, t in kw.items():
        if not torch.is_tensor(t):
            continue
        if t.dtype in (torch.int32, torch.int64):
            for pos in range(t.numel()):
                have = int(t.reshape(-1)[pos])
                for v in {-2, -1, 0, 1, have - 1, have + 1, num_slots, t.numel(), 2**31 - 1}:
                    k = _clone(kw)
                    k[a].view(-1)[pos] = v
                    yield f"{a}[{pos}] = {v}", k
        for d in range(t.dim()):
            for n in (t.shape[d] - 1, t.shape[d] + 1):
                if n >= 0:
                    shape = list(t.shape)
                    shape[d] = n
                    yield f"{a} dim {d} = {n}", dict(kw, **{a: torch.zeros(shape, dtype=t.dtype, device=t.device)})
        yield f"{a} with a dim more", dict(kw, **{a: t[None]})
        if t.dim():
            yield f"{a} with a dim less", dict(kw, **{a: t[..., 0]})
            if t.shape[0] > 1:
                yield f"{a} overlapping itself", dict(kw, **{a: t[:1].expand(t.shape)})
        for dt in DTYPES:
            if dt != t.dtype:
                yield f"{a} of {dt}", dict(kw, **{a: t.to(dt)})
        yield f"{a} on the meta device", dict(kw, **{a: t.to("meta")})
        yield f"{a} None", dict(kw, **{a: None})
        yield f"{a} a list", dict(kw, **{a: t.tolist()})
    for o in sp.options:
        for v in GARBAGE:
            yield f"{o}={v!r}", dict(kw, **{o: v})


@pytest.mark.parametrize("op", OPS)
def test_single_defects_agree(device, op):
    """Every single defect of the contract cases (with and without `out=`, with and without the index checks):
    the validator returns what its checks return or raises the error they raise (the fast path accepts
    nothing the checks reject)."""
    sp = SPECS[op]
    for shape in sp.shapes["contract"]:
        kw = sp.inputs(shape, torch.float32, device, torch.Generator().manual_seed(0))
        pos, opt = sp.split({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()})
        out = torch.empty_like(sp.reference(torch.float32, *pos, **opt))
        cases = [c for base in (kw, dict(kw, out=out)) for c in _single_defects(sp, base)]
        # consistent inputs of other sizes, valid or not (value heads not a multiple of the key heads, 3 groups,
        # width 9, ...); the delta rules' builders take Hv over H (KDA's Hv != H)
        sizes = {k: v for k, v in shape.items() if type(v) is int and k not in ("fresh", "optional")}
        if "H" in sizes:
            sizes.setdefault("Hv", sizes["H"])
        for key, have in sizes.items():
            for n in {1, have + 1, have + 2, 9}:
                cases.append((f"{key}={n}", sp.inputs(dict(shape, **{key: n}), torch.float32, device,
                                                      torch.Generator().manual_seed(0))))
        for what, bad in cases:
            pos, opt = _validate_args(sp, bad)
            for index_checks in (True, False):
                with contextlib.nullcontext() if index_checks else no_index_checks():
                    fast, slow = validator_paths(sp, pos, opt)
                assert fast == slow, f"{op} {shape} ({what}, index checks {index_checks}): the validator " \
                    f"gives {fast}, its checks {slow}"


def test_slow_path_detection_works():
    """The probe above sees the slow path when it runs (input the fast path declines: a bad option)."""
    sp = SPECS["gated_rms_norm"]
    kw = sp.inputs(sp.shapes["contract"][0], torch.float32, "cpu", torch.Generator().manual_seed(0))
    pos, opt = _validate_args(sp, dict(kw, eps=1))  # an int eps: valid, but only the checks accept it
    dims, slow = _ran(lambda: sp.validate(*pos, **opt), _slow_code(sp))
    assert slow and dims == sp.checks(*pos, **opt)


def test_launchers_read_the_environment_once(monkeypatch):
    """TRITON_INTERPRET and HARNESS_AOT_NVIDIA are read at import, not per launch; `refresh_env` re-reads them
    (`python -m harness.impls.triton.aot` sets HARNESS_AOT_NVIDIA and calls it)."""
    _common = pytest.importorskip("harness.impls.triton._common", reason="triton is not installed")
    t = torch.zeros(1)
    before = (_common.interpreting(), _common.nvidia_fast(t))
    try:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setenv("HARNESS_AOT_NVIDIA", "1")
        if before != (False, True):
            assert (_common.interpreting(), _common.nvidia_fast(t)) == before, "the environment was read per call"
        _common.refresh_env()
        assert not _common.interpreting()
        assert _common.nvidia_fast(t) == (torch.version.hip is None), "HARNESS_AOT_NVIDIA=1: CPU tensors take " \
            "the NVIDIA paths after refresh_env"
        monkeypatch.setenv("HARNESS_AOT_NVIDIA", "0")
        _common.refresh_env()
        assert not _common.nvidia_fast(t)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("HARNESS_AOT_NVIDIA", "1")
        _common.refresh_env()
        assert _common.interpreting() and not _common.nvidia_fast(t), "the interpreter never takes NVIDIA paths"
    finally:
        monkeypatch.undo()
        _common.refresh_env()
    assert (_common.interpreting(), _common.nvidia_fast(t)) == before


def test_device_guard_makes_the_device_current():
    """Inside `device_guard(t)` the current CUDA device is t's, on every visible device (with one device the
    guard switches nothing and queries nothing)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (on the CPU the guard is a no-op context)")
    from harness.impls.triton._common import device_guard
    for d in range(torch.cuda.device_count()):
        with device_guard(torch.empty(1, device=f"cuda:{d}")):
            assert torch.cuda.current_device() == d
