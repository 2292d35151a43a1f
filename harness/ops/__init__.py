"""The op contract: one signature per op, close to what serving engines call.

Every implementation (ours, a peer's adapter, a user's) provides some of these ops in its
`Impl.ops` dict under these names, with exactly these signatures. Adapters translate to the peer's
own calling convention; suites and benchmarks only ever call through this contract.

Conventions for every op
------------------------
* Token-major packed layout: the first dim of per-token tensors is the token index over all
  sequences of the batch concatenated (T tokens). `query_start_loc` (int32/int64, shape (S+1,),
  on the op's device) splits them into S sequences: starts at 0, non-decreasing, ends at T.
* State pools: `*_states` are pools of `num_slots` slots (first dim); they may be strided views
  (e.g. page-major: one buffer per slot holding all layers, each layer a view with a slot stride
  larger than the slot's numel). Implementations must honour strides, never `.contiguous()` a pool
  and copy back.
* `cache_indices[i]` (prefill) / `*_indices[b]` (decode) names the pool slot of sequence i / batch
  row b. `has_initial_state[i]` (bool): read the slot as the initial state, else start from zeros.
  After the op, the slot holds the sequence's final state. A request whose index equals
  `pad_slot_id` (default PAD_SLOT_ID = -1) is padding: its slot is neither read nor written, and
  every output row it owns is exactly zero (a decode op's row b; a varlen op's tokens of request i;
  a multi-token decode's tokens of a padding row -- `reference.pads`). Engines pad CUDA-graph batches
  this way and hand the pad rows on to the next layer's projections and all-reduce, so a kernel that
  leaves them unwritten (a reused buffer's stale values, NaN) corrupts later layers: the op suites
  poison `out=` with NaN and require the pad rows to be 0 afterwards. Slots not named by the batch are
  left bit-for-bit unchanged.
* Strided inputs: every tensor argument may be a strided view, not only the pools -- engines hand over
  views of one projection's output (x and z as the two halves of in_proj's (T, 2*D) output, row stride
  2*D; Mamba-2's x, B and C from one conv output; GDN's q, k and v from one qkv projection).
  Implementations address their inputs through the strides (or copy), never as contiguous rows
  (`suites/ops/test_ops_strided_inputs.py`).
* `out=`: an optional preallocated output (suites poison it with NaN before the call); the op writes
  into it and returns it. Without `out`, a new tensor is returned. `out` shares no element with an argument
  (the state pool included): an overlap is bad input, rejected first by every validator -- but for the ops
  engines run in place (the spec's `in_place`: the conv updates' x, as vLLM and SGLang write into it), where
  `out` may be that very tensor and the result is the out-of-place one, bit for bit.
* Inputs are read-only: an op writes only its state pool (`*_states`, the named slots; add_rms_norm's
  `residual`, updated whole) and `out=`.
  Every other tensor argument (activations, dt, A, dt_bias, weights, indices, offsets, flags) is left
  bit-for-bit unchanged -- no in-place softplus, bias add, cast or reordering on the caller's tensors,
  which the caller may still read (a CUDA-graph replay reuses its static input buffers; a speculative
  re-run reads them again). The op suites check every input bit for bit after each call.
* dtypes: activations in fp16/bf16/fp32 (fp64 where an implementation supports it); A, D, dt_bias
  in fp32 (or the activations' dtype); pools in any float dtype (recurrent state usually fp32).
  Implementations accumulate in fp32 at least.
* Bad input — wrong dtypes or layouts, indices outside the pool, query_start_loc inconsistent with
  the token count — raises ValueError (argument, expected, got) *before* any kernel launches: call
  the `validate_<op>` function of this module first. Index range checks read the indices on the
  host; inside `no_index_checks()` (CUDA-graph capture, the benchmark loops, an engine step whose
  metadata the engine checked once for the whole step) they are skipped.

Ops
---
One module per op in this package (`harness/ops/<op>.py`), each holding the op's signature and
semantics in its docstring and its `OpSpec` (see `harness.ops.spec`): validator, float64 reference,
input builder, byte and FLOP counts, benchmark shapes. `SPECS` maps every op name to its spec;
`OP_NAMES` lists them; `validate_<op>` is each op's validator. `python -m harness.ops` prints them all.
"""
from __future__ import annotations

import importlib
import pkgutil

from harness.ops._checks import INF, PAD_SLOT_ID, no_index_checks  # noqa: F401
from harness.ops.spec import OpSpec
from reference.validate import fail

SPECS: dict[str, OpSpec] = {}


def _discover() -> None:
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if m.name.startswith("_") or m.name == "spec":
            continue
        mod = importlib.import_module(f"{__name__}.{m.name}")
        spec = getattr(mod, "SPEC", None)
        if not isinstance(spec, OpSpec):
            raise ImportError(f"harness.ops.{m.name}: expected a module-level SPEC = OpSpec(...), got {spec!r}")
        if spec.name != m.name:
            raise ImportError(f"harness.ops.{m.name}: expected SPEC.name == {m.name!r}, got {spec.name!r}")
        _guard_out(spec)
        SPECS[spec.name] = spec
        globals()[f"validate_{spec.name}"] = spec.validate


def _guard_out(spec: OpSpec) -> None:
    """The spec's `validate` and `checks`, each first rejecting an `out=` that shares memory with an argument
    (`_checks.check_out_alone`; `spec.in_place` may be `out` itself). Both get the same check first, so the
    validator's fast path and its rule-by-rule path still agree on every input."""
    import inspect

    from harness.ops._checks import check_out_alone

    def guarded(fn):
        names = list(inspect.signature(fn).parameters)
        i_out = names.index("out")
        tensor_args = [a for a in spec.args if a in names]

        def call(*args, **kw):
            out = args[i_out] if len(args) > i_out else kw.get("out")
            if out is not None:
                bound = dict(zip(names, args))
                bound.update(kw)
                check_out_alone(out, {a: bound.get(a) for a in tensor_args}, spec.in_place)
            return fn(*args, **kw)
        call.__doc__, call.__wrapped__ = getattr(fn, "__doc__", None), fn
        return call
    object.__setattr__(spec, "validate", guarded(spec.validate))
    object.__setattr__(spec, "checks", guarded(spec.checks))


_discover()

OP_NAMES = tuple(SPECS)


def spec(name: str) -> OpSpec:
    """The spec of op `name` (ValueError listing the ops otherwise)."""
    if name not in SPECS:
        fail("op", f"one of {sorted(SPECS)}", repr(name))
    return SPECS[name]
