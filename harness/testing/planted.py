"""Planted bugs: deliberately broken components that the suites must catch (docs/bug-classes.md).

Two kinds of broken component live here, shared by the tests that check their own catch and by the suite
variants of `harness selftest` (harness.selftest_suites), which run the real suites against them:

* implementation wrappers (``Impl -> Impl``): the `torch` implementation with one op broken. Each has a
  factory without arguments, so that pytest and `harness` load it as ``--impl harness.testing.planted:NAME``;
* patches (context managers) that break a component which is not an implementation -- a kernel-index
  function, a checkpoint name rule, a cache spec, the comparison every check goes through. They are applied
  for a whole pytest run by this module as a plugin: ``pytest -p harness.testing.planted --plant NAME``
  (before collection, so that names the test modules import are the broken ones).

Every broken component is wrong in exactly one way and right otherwise, so that a test catching it
catches that bug, and the unbroken component passes the same tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from harness.ops import PAD_SLOT_ID, SPECS

# ============================================================================ implementation wrappers


def activation(sp, args: dict) -> torch.Tensor:
    """The activation tensor of a decode op's arguments (`v` for the delta rules, `x` otherwise)."""
    return args["v"] if "v" in sp.args else args["x"]


def state_in_activation_dtype(base):
    """`base` whose decode ops round the named slots to the activations' dtype after every step (a state
    kept in bf16 between steps, stored into the fp32 pool): right to one bf16 rounding after one step,
    drifting over many (bug class 18)."""
    from harness.selftest import wrap_op

    def after(a, y, op):
        sp = SPECS[op]
        pool, act = a[sp.pool], activation(sp, a).dtype
        idx = a[sp.index].long()
        idx = idx[idx != PAD_SLOT_ID]
        pool[idx] = pool[idx].to(act).to(pool.dtype)

    ops = {op: wrap_op(op, base.ops[op], after=lambda a, y, op=op: after(a, y, op))
           for op in ("selective_state_update", "gated_delta_rule_update", "kda_update") if op in base.ops}
    return dataclasses.replace(base, name=f"{base.name}[state in bf16 between steps]", ops={**base.ops, **ops})


def shared_workspace(base):
    """`base` with every op returning, when called without `out=`, a view of one buffer it keeps and reuses
    on every call (grown when too small): each result is right when it is returned, and overwritten by the
    next call (bug class 21)."""
    ws: dict = {}

    def wrap(fn):
        def op(*args, out=None, **kwargs):
            if out is not None:
                return fn(*args, out=out, **kwargs)
            y = fn(*args, **kwargs)
            buf = ws.get("buf")
            if buf is None or buf.numel() < y.numel() or buf.dtype != y.dtype or buf.device != y.device:
                buf = ws["buf"] = torch.empty(y.numel(), dtype=y.dtype, device=y.device)
            view = buf[:y.numel()].view(y.shape)
            view.copy_(y)
            return view
        return op
    return dataclasses.replace(base, name=f"{base.name}[shared workspace]",
                               ops={name: wrap(fn) for name, fn in base.ops.items()})


def first_call_drifts(base):
    """`base` whose first op call in the process moves its output by one unit in the last place: right to
    rounding, but two runs of the same inputs differ in their bits, as with a race in compiled code or a
    launch configuration picked at run time (autotuning) on the first call (bug class 26)."""
    calls = [0]

    def wrap(fn):
        def op(*args, **kwargs):
            y = fn(*args, **kwargs)
            calls[0] += 1
            if calls[0] == 1:
                for t in (y if isinstance(y, (tuple, list)) else (y,)):
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                        first = t.view(-1)[:1]
                        first.copy_(torch.nextafter(first, torch.full_like(first, float("inf"))))
            return y
        return op
    return dataclasses.replace(base, name=f"{base.name}[first call drifts]",
                               ops={name: wrap(fn) for name, fn in base.ops.items()})


def dt_in_place(base):
    """`base` with a selective_state_update that turns the caller's dt into softplus(dt + dt_bias) in
    place and then runs the op with the bias and the softplus switched off: y and the state are right,
    the caller's dt is not (bug class 17)."""
    from harness.selftest import wrap_op

    def before(a):
        if a["dt_bias"] is not None:
            a["dt"].add_(a["dt_bias"].to(a["dt"].dtype))
            a["dt_bias"] = None
        if a.get("dt_softplus", True):
            a["dt"].copy_(F.softplus(a["dt"]))
            a["dt_softplus"] = False
        return a
    op = wrap_op("selective_state_update", base.ops["selective_state_update"], before)
    return dataclasses.replace(base, name=f"{base.name}[dt in place]", ops={**base.ops, "selective_state_update": op})


def restarts_at_tiles(base, op_name: str = "selective_scan_varlen"):
    """`base`'s selective scan run on each sequence in pieces of its declared tile (`Impl.tiles`), every piece
    after the first from a zero state instead of the state carried from the piece before: a kernel that drops
    its carried state at an internal chunk boundary (bug class 20). Exact for sequences no longer than one
    tile."""
    fn, tile = base.ops[op_name], base.tiles[op_name][0]

    def op(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
           *, out=None, **kw):
        from harness import ops
        ops.validate_selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, ssm_states, query_start_loc,
                                           cache_indices, has_initial_state, out=out)
        y = out if out is not None else torch.empty_like(u)
        q = query_start_loc.tolist()
        for i in range(len(q) - 1):
            for p0 in list(range(q[i], q[i + 1], tile)) or [q[i]]:
                r = slice(p0, min(p0 + tile, q[i + 1]))
                init = has_initial_state[i:i + 1] if p0 == q[i] else torch.zeros_like(has_initial_state[i:i + 1])
                qsl = torch.tensor([0, r.stop - r.start], dtype=query_start_loc.dtype, device=u.device)
                fn(u[r], delta[r], A, B[r], C[r], D, None if z is None else z[r], delta_bias, ssm_states, qsl,
                   cache_indices[i:i + 1], init, out=y[r], **kw)
        return y
    return dataclasses.replace(base, name=f"{base.name}[state dropped every {tile} tokens]",
                               ops={**base.ops, op_name: op})


def global_grid_ssd(base, exp_before_mask: bool = False):
    """`base` with the global-chunk-grid varlen SSD of `harness.selftest.grid_ssd_varlen` (mamba_ssm's
    chunking); with `exp_before_mask` it takes exp of the segment sums before masking the upper triangle,
    where they are positive: a large |A| overflows exp and inf * 0 is NaN (bug class 6)."""
    from harness.selftest import grid_ssd_varlen

    def ssd_varlen(*args, **kwargs):
        return grid_ssd_varlen(*args, **kwargs, _bug_exp_before_mask=exp_before_mask)
    tag = "grid ssd, exp before mask" if exp_before_mask else "grid ssd"
    return dataclasses.replace(base, name=f"{base.name}[{tag}]", ops={**base.ops, "ssd_varlen": ssd_varlen})


def contiguous_rows(base):
    """`base` whose ops read every tensor argument but the pool and `out=` as if its rows were contiguous
    (a kernel addressing row t at `base + t * row`): a row-strided view — x and z as the two halves of one
    projection's output — is read from the view's first element on, straight through the neighbouring
    columns; contiguous inputs are read right (bug class 23)."""
    def wrap(op, fn):
        sp = SPECS[op]

        def read_as_contiguous(name, t):
            if name in (sp.pool, "out") or not isinstance(t, torch.Tensor) or t.dim() < 2 or t.is_contiguous():
                return t
            strides, acc = [], 1
            for n in reversed(t.shape):
                strides.insert(0, acc)
                acc *= n
            return t.as_strided(t.shape, strides)  # from the view's own first element

        def call(*args, **kwargs):
            names = list(sp.args) + [f"args[{i}]" for i in range(len(sp.args), len(args))]
            return fn(*[read_as_contiguous(n, a) for n, a in zip(names, args)],
                      **{k: read_as_contiguous(k, v) for k, v in kwargs.items()})
        return call
    return dataclasses.replace(base, name=f"{base.name}[contiguous rows assumed]",
                               ops={name: wrap(name, fn) for name, fn in base.ops.items()})


def contiguous_ids(base):
    """`base` whose ops read every 1-dim integer or bool tensor argument (offsets, slot ids, flags, accepted
    counts) as if its elements were adjacent (a kernel addressing element i at `base + i`): a strided view — one
    column of a slot table — is read from its first element on through its neighbours; contiguous ones are read
    right (bug class 25)."""
    def wrap(op, fn):
        def read_as_contiguous(t):
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dim() != 1 or t.is_contiguous():
                return t
            return t.as_strided(t.shape, (1,))  # from the view's own first element

        def call(*args, **kwargs):
            return fn(*[read_as_contiguous(a) for a in args], **{k: read_as_contiguous(v) for k, v in kwargs.items()})
        return call
    return dataclasses.replace(base, name=f"{base.name}[contiguous ids assumed]",
                               ops={name: wrap(name, fn) for name, fn in base.ops.items()})


def state_from_output(base):
    """`base` whose conv update, run in place (`out` is x, as vLLM and SGLang run it), writes the output over x
    first and then shifts the slots' windows in from x -- which holds the output by then: the outputs are
    right, the conv states take each row's activated output as its newest input. Out of place it is right
    (bug class 24)."""
    def wrap(fn):
        def op(x, conv_states, weight, bias, conv_state_indices, *, out=None, **kwargs):
            if out is None or out.data_ptr() != x.data_ptr():
                return fn(x, conv_states, weight, bias, conv_state_indices, out=out, **kwargs)
            y = fn(x, conv_states.clone(), weight, bias, conv_state_indices, **kwargs)  # the outputs, right
            x.copy_(y)  # written over the input
            fn(x.clone(), conv_states, weight, bias, conv_state_indices, **kwargs)  # windows from x, now y
            return x
        return op
    ops = {"causal_conv1d_update": wrap(base.ops["causal_conv1d_update"])}
    return dataclasses.replace(base, name=f"{base.name}[in-place state from the output]", ops={**base.ops, **ops})


def _torch():
    from harness.impls import registry
    return registry.get("torch")


# --impl harness.testing.planted:NAME -- the torch implementation with one planted bug (or its control)
def torch_state_in_bf16():
    return state_in_activation_dtype(_torch())


def torch_shared_workspace():
    return shared_workspace(_torch())


def torch_first_call_drifts():
    return first_call_drifts(_torch())


def torch_dt_in_place():
    return dt_in_place(_torch())


def torch_contiguous_rows():
    return contiguous_rows(_torch())


def torch_contiguous_ids():
    return contiguous_ids(_torch())


def torch_state_from_output():
    return state_from_output(_torch())


def torch_restarts_at_tiles():
    return restarts_at_tiles(_torch())


def torch_grid_ssd_exp_before_mask():
    return global_grid_ssd(_torch(), exp_before_mask=True)


def torch_grid_ssd():
    return global_grid_ssd(_torch())


# ============================================================================ patches


def _wrap_int32(v: int) -> int:
    """`v` as a 32-bit signed integer holds it: wrapped modulo 2^32."""
    return (v + 2 ** 31) % 2 ** 32 - 2 ** 31


def int32_offsets():
    """The Triton kernels' index function (`harness.impls.triton._common.max_offset`, read by `index_type`)
    accumulating offsets in 32-bit arithmetic, as an `int` offset in a kernel does: an offset past 2^31 - 1
    wraps negative, so the kernels keep int32 index math where they need int64 (bug class 12)."""
    from harness.impls.triton import _common
    from harness.selftest import patched

    def max_offset(*tensors) -> int:
        best = 0
        for t in tensors:
            if isinstance(t, int):
                best = max(best, _wrap_int32(t))
            elif t is not None and t.numel() > 0:
                off = 0
                for s, st in zip(t.shape, t.stride()):
                    off = _wrap_int32(off + _wrap_int32((s - 1) * abs(st)))
                best = max(best, off)
        return best
    return patched(_common, "max_offset", max_offset)


def model_prefix_unknown():
    """Checkpoint name rules that know the `backbone.` prefix but not `model.`: the keys of a checkpoint
    saved with `model.` names match no rule (bug class 13, `model.` vs `backbone.`)."""
    from harness.selftest import patched
    from reference import loader
    if not any(loader._PREFIX in p.pattern for p, _ in loader.NAME_RULES):
        raise RuntimeError(f"reference.loader.NAME_RULES: expected rules built on _PREFIX {loader._PREFIX!r}, got none")
    rules = tuple((re.compile(p.pattern.replace(loader._PREFIX, r"(?:backbone\.)?")), t) for p, t in loader.NAME_RULES)
    return patched(loader, "NAME_RULES", rules)


def replicated_group_divided():
    """`Mamba2Spec.conv_dim` computed by a second formula, d/TP + 2 * G * N / TP, instead of from the conv
    segments: with one group replicated on every rank (n_groups == 1, TP > 1) it divides the B and C
    channels by TP, and disagrees with the segments (and with the state the kernels write) (bug class 14)."""
    from harness.selftest import patched
    from reference.cache import Mamba2Spec

    def conv_dim(self) -> int:
        d = self.num_heads * self.head_dim // self.tp_size
        return d + (2 * self.n_groups * self.state_size // self.tp_size if self.bc_in_conv else 0)
    return patched(Mamba2Spec, "conv_dim", property(conv_dim))


def nan_masked_compare():
    """The comparison every check goes through (`harness.testing.checks.compare`) judging only the finite
    elements of the output -- a NaN or inf is replaced by the expected value first, as a mask of finite
    elements or `allclose(equal_nan=True)` does: a kernel that writes NaN passes (bug class 15)."""
    from harness.selftest import patched
    from harness.testing import checker, checks
    orig = checks.compare

    def compare(name, actual, expected, tol):
        fin = torch.isfinite(actual)
        if fin.shape == expected.shape:
            actual = torch.where(fin, actual, expected.to(actual.device, actual.dtype))
        return orig(name, actual, expected, tol)
    stack = contextlib.ExitStack()
    stack.enter_context(patched(checks, "compare", compare))
    stack.enter_context(patched(checker, "compare", compare))
    return stack


def plans_keyed_on_shapes():
    """The metadata key of the Triton ops' launch plans and of the validators' memo (`call_key`) leaving out the
    tensors' strides: a call whose tensors have the shapes and dtypes of an earlier call's but other strides
    (a row-strided view, a transposed buffer) reuses the strides and offsets planned for the earlier one
    (bug class 27)."""
    import harness.ops as ops_pkg
    from harness.impls.triton import _common
    from harness.ops import _checks
    from harness.selftest import patched

    def call_key(args) -> tuple:
        key = []
        for a in args:
            key += (a.dtype, a.device, a.shape) if isinstance(a, torch.Tensor) else (type(a), a)
        return tuple(key)
    stack, real = contextlib.ExitStack(), _checks.call_key
    for mod in (_checks, ops_pkg, _common):
        if getattr(mod, "call_key", None) is not real:
            raise RuntimeError(f"{mod.__name__}.call_key: expected harness.ops._checks.call_key, got "
                               f"{getattr(mod, 'call_key', None)!r}")
        stack.enter_context(patched(mod, "call_key", call_key))
    return stack


PLANTS = {
    "int32_offsets": int32_offsets,
    "plans_keyed_on_shapes": plans_keyed_on_shapes,
    "model_prefix_unknown": model_prefix_unknown,
    "replicated_group_divided": replicated_group_divided,
    "nan_masked_compare": nan_masked_compare,
}

# ============================================================================ the pytest plugin (-p harness.testing.planted)

_ACTIVE: list = []


def pytest_addoption(parser):
    parser.getgroup("ssm-harness").addoption(
        "--plant", action="store", default=None, metavar="NAME", choices=sorted(PLANTS),
        help=f"break one component for the whole run, on purpose (one of {sorted(PLANTS)})")


@pytest.hookimpl(trylast=True)  # after the harness plugin has set up the device (TRITON_INTERPRET on CPU)
def pytest_configure(config):
    name = config.getoption("plant")
    if name:
        cm = PLANTS[name]()
        cm.__enter__()
        _ACTIVE.append(cm)


def pytest_report_header(config):
    name = config.getoption("plant")
    return [f"planted bug: {name} ({PLANTS[name].__doc__.split(':')[0].strip()})"] if name else []


def pytest_unconfigure(config):
    while _ACTIVE:
        _ACTIVE.pop().__exit__(None, None, None)
