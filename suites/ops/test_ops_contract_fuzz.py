"""Op contract, fuzzed: every op of every implementation, driven with malformed inputs drawn by hypothesis
(one or two defects per call: a wrong dtype, rank, size or device of any tensor argument, garbage option
values, optional tensors of the wrong shape, slot ids outside the pool, a pool whose slots share memory,
query_start_loc perturbed), must raise ValueError — the same error the op's contract validator gives,
naming the argument — before anything runs: no pool slot, input or `out=` element changes.

Defects that are malformed by construction (a wrong dtype, rank or device, a slot id past the pool, an
overlapping pool) must be rejected by the contract itself, naming the mutated argument; the others (sizes,
option values, perturbed offsets) may happen to stay valid, and those examples are discarded. The ci
profile draws a few examples per op and implementation; nightly draws hundreds.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from harness.testing.checks import assert_bitwise_equal, poison_
from harness.testing.optest import require, validator_paths
from harness.ops import SPECS, no_index_checks
from harness.testing import strict_op

OPS = sorted(SPECS)
NON_FLOAT = (torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64)
GARBAGE = ("x", None, float("nan"), float("inf"), -1, 0, True, 1.5, [1], {"a": 1}, (1,), 10**12, object())


def _tensors(kw: dict) -> list[str]:
    return [k for k, v in kw.items() if torch.is_tensor(v) and v.device.type != "meta"]


# dtypes that are wrong for an argument of each role (an index-like argument takes int32 and int64)
BAD_DTYPES = {"index": (torch.float32, torch.float64, torch.bool, torch.complex64),
              "offsets": (torch.float32, torch.float64, torch.bool, torch.complex64),
              "flags": (torch.float32, torch.int64, torch.complex64),
              "float": NON_FLOAT}


def _role(sp, arg: str, t: torch.Tensor) -> str:
    """The argument's role, for the dtypes that are defects of it: slot ids, offsets, flags, other integer
    tensors (counts such as num_accepted_tokens: index-like), or floats."""
    if arg == sp.index:
        return "index"
    if arg == "query_start_loc":
        return "offsets"
    if arg == "has_initial_state" or t.dtype == torch.bool:
        return "flags"
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return "index"
    return "float"


def _like(t: torch.Tensor, shape) -> torch.Tensor:
    """A tensor of `t`'s dtype and device with another shape (values in range for index-like ints)."""
    if t.dtype.is_floating_point:
        return torch.rand(shape, dtype=t.dtype, device=t.device)
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


def _mutate(data, sp, kw: dict) -> tuple[str, str, bool]:
    """Apply one drawn defect to `kw`; returns (kind, mutated argument, malformed by construction)."""
    tensors = _tensors(kw)
    kinds = ["dtype", "rank", "size", "device", "option", "optional"]
    if sp.index and sp.index in tensors:
        kinds += ["slot", "overlap"]
    if sp.varlen and "query_start_loc" in tensors and kw["query_start_loc"].dim() == 1 \
            and kw["query_start_loc"].numel() > 0:
        kinds.append("offsets")
    kind = data.draw(st.sampled_from(kinds), label="defect")
    if kind in ("dtype", "rank", "size", "device"):
        arg = data.draw(st.sampled_from(tensors), label="argument")
        t = kw[arg]
        if kind == "dtype":
            bad = BAD_DTYPES[_role(sp, arg, t)]
            with warnings.catch_warnings():  # complex -> real after an earlier complex defect
                warnings.simplefilter("ignore", UserWarning)
                kw[arg] = t.to(data.draw(st.sampled_from(bad), label="dtype"))
            return kind, arg, True
        if kind == "rank":
            grow = data.draw(st.booleans(), label="add a dim") or t.dim() == 0 or t.shape[-1] == 0
            kw[arg] = t[None] if grow else t[..., 0]
            # where the ranks select one of several layouts (Mamba-1 / Mamba-2 state update), another rank
            # may read as the other layout, and the error then names the argument that does not fit it
            return kind, arg, len({sh.get("layout") for sh in sp.shapes["contract"]}) == 1
        if kind == "size":
            if t.dim() == 0:
                return kind, arg, False
            d = data.draw(st.integers(0, t.dim() - 1), label="dim")
            n = data.draw(st.integers(0, t.shape[d] + 3).filter(lambda n: n != t.shape[d]), label="size")
            shape = list(t.shape)
            shape[d] = n
            kw[arg] = _like(t, shape)
            # a pool may have any number of slots; every other size is tied to another argument
            return kind, arg, False
        kw[arg] = t.to("meta")
        return kind, arg, True
    if kind == "option":
        opt = data.draw(st.sampled_from(sorted(sp.options)), label="option")
        kw[opt] = data.draw(st.sampled_from(GARBAGE), label="value")
        return kind, opt, False
    if kind == "optional":
        free = [a for a in sp.args if kw.get(a) is None] or [a for a in sp.args if a in tensors]
        arg = data.draw(st.sampled_from(free), label="argument")
        shape = data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=3), label="shape")
        dtype = data.draw(st.sampled_from((torch.float32, torch.float64, torch.int32)), label="dtype")
        kw[arg] = torch.ones(shape, dtype=dtype, device=kw[tensors[0]].device)
        return kind, arg, False
    if kind == "slot":
        arg, slots = sp.index, kw[sp.index]
        if slots.numel() == 0:
            return kind, arg, False
        n_slots = kw[sp.pool].shape[0] if torch.is_tensor(kw.get(sp.pool)) and kw[sp.pool].dim() else 1
        row = data.draw(st.integers(0, slots.numel() - 1), label="row")
        value = data.draw(st.sampled_from((n_slots, n_slots + 5, -2, -100, 2**31 - 1)), label="slot id")
        kw[arg] = slots.clone()
        kw[arg].view(-1)[row] = value
        return kind, arg, True
    if kind == "overlap":
        pool = kw[sp.pool]
        if pool.dim() == 0 or pool.shape[0] < 2:
            return kind, sp.pool, False
        kw[sp.pool] = pool[:1].expand(pool.shape)
        return kind, sp.pool, True
    qsl = kw["query_start_loc"].clone()
    i = data.draw(st.integers(0, qsl.numel() - 1), label="position")
    qsl[i] = data.draw(st.integers(-3, int(qsl[-1]) + 3).filter(lambda v: v != int(qsl[i])), label="offset")
    kw["query_start_loc"] = qsl
    return kind, "query_start_loc", False


def _contract_error(sp, kw: dict) -> ValueError | None:
    """The contract validator's ValueError for these inputs (None: it accepts them). Any other exception
    escapes: the validator must answer malformed input with ValueError, never TypeError and the like."""
    pos, opt = sp.split(kw)
    takes = inspect.signature(sp.validate).parameters
    try:
        sp.validate(*pos, **{k: v for k, v in opt.items() if k in takes})
    except ValueError as e:
        return e
    return None


@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_malformed_inputs_raise_before_anything_is_touched(impl, device, op, data):
    sp = SPECS[op]
    require(impl, op)
    shape = data.draw(st.sampled_from(sp.shapes["contract"]), label="contract shape")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    kw = sp.inputs(shape, torch.float32, device, torch.Generator().manual_seed(seed))
    if "out" in sp.options and data.draw(st.booleans(), label="with out="):
        pos, opt = sp.split({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()})
        y = sp.reference(torch.float32, *pos, **opt)
        kw["out"] = torch.empty_like(y)
    defects = [_mutate(data, sp, kw) for _ in range(data.draw(st.integers(1, 2), label="defects"))]
    expected = _contract_error(sp, kw)
    by_construction = len(defects) == 1 and defects[0][2]
    if by_construction:
        kind, arg, _ = defects[0]
        assert expected is not None, f"{op}: the contract accepted a {kind} defect of {arg!r}"
        assert arg in str(expected), f"{op}: a {kind} defect of {arg!r}, but the error names: {expected}"
    assume(expected is not None)
    before = {k: kw[k].clone() for k in _tensors(kw)}
    for k in before:
        if k == "out":
            poison_(kw[k])
            before[k] = kw[k].clone()
    with pytest.raises(ValueError) as ei:
        sp.call(strict_op(impl, op), kw)
    assert str(ei.value) == str(expected), (
        f"{op} ({impl.name}, defects {[(k, a) for k, a, _ in defects]}): expected the contract's error "
        f"{str(expected)!r}, got {str(ei.value)!r}")
    for k, b in before.items():
        assert_bitwise_equal(f"{op} ({impl.name}): {k} after a rejected call", kw[k], b)


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=settings.default.max_examples * 8)
@given(data=st.data())
def test_fast_path_agrees_with_the_checks(device, op, data):
    """A validator's fast path (one predicate over all arguments) never accepts what its rule-by-rule checks
    (`OpSpec.checks`) reject: on input with zero, one or two defects both return the same dimensions or raise
    the same error, with and without the index checks. Validators only: many more examples than above."""
    sp = SPECS[op]
    shape = data.draw(st.sampled_from(sp.shapes["contract"]), label="contract shape")
    kw = sp.inputs(shape, torch.float32, device, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    if data.draw(st.booleans(), label="with out="):
        pos, opt = sp.split({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()})
        kw["out"] = torch.empty_like(sp.reference(torch.float32, *pos, **opt))
    defects = [_mutate(data, sp, kw)[:2] for _ in range(data.draw(st.integers(0, 2), label="defects"))]
    pos, opt = sp.split(kw)
    takes = inspect.signature(sp.validate).parameters
    opt = {k: v for k, v in opt.items() if k in takes}
    with contextlib.nullcontext() if data.draw(st.booleans(), label="index checks") else no_index_checks():
        fast, slow = validator_paths(sp, pos, opt)
    assert fast == slow, f"{op} (defects {defects}): the validator gives {fast}, its checks {slow}"


@pytest.mark.parametrize("op", [o for o in OPS if "num_accepted_tokens" in SPECS[o].args])
def test_accepted_counts_are_index_like(op):
    """num_accepted_tokens is an integer count: int32 is no dtype defect of it, and each of the index role's bad
    dtypes is one the contract rejects naming it (the fuzz once drew int32 from the float role's defects for it:
    gated_delta_rule_update_spec, contract shape B 2, Hk 2, Hv 4, K 3, V 2, num_spec 2, seed 0)."""
    sp = SPECS[op]
    kw = sp.inputs(sp.shapes["contract"][0], torch.float32, "cpu", torch.Generator().manual_seed(0))
    t = kw["num_accepted_tokens"]
    assert _role(sp, "num_accepted_tokens", t) == "index"
    assert _contract_error(sp, dict(kw, num_accepted_tokens=t.to(torch.int32))) is None
    for dtype in BAD_DTYPES["index"]:
        err = _contract_error(sp, dict(kw, num_accepted_tokens=t.to(dtype)))
        assert err is not None and "num_accepted_tokens" in str(err), (op, dtype, err)
