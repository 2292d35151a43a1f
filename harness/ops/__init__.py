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
from harness.ops._checks import call_key
from harness.ops.spec import OpSpec
from reference.validate import fail

SPECS: dict[str, OpSpec] = {}
_MEMO_SIZE = 512  # accepted signatures per validator; beyond it the memo starts over


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


def _memo_key(args: tuple, kw: dict) -> tuple:
    return call_key(args) + (tuple(kw), call_key(kw.values())) if kw else call_key(args)


def _guard_out(spec: OpSpec) -> None:
    """The spec's `validate` and `checks`, each first rejecting an `out=` that shares memory with an argument
    (`_checks.check_out_alone`; `spec.in_place` may be `out` itself). Both get the same check first, so the
    validator's fast path and its rule-by-rule path still agree on every input. Given `out=`, `validate` answers
    a call whose metadata (`_checks.call_key`) it has accepted before from a memo while the index checks are off
    (they read values; the rest of a validator reads metadata, and addresses only for the memory `out=` and a
    pool without slots own): those addresses are compared on every call (`_checks.all_apart`), and where their
    byte ranges meet the validator runs. Without `out=` its own fast path costs no more than the memo's key."""
    import inspect

    from harness.ops import _checks as ck

    def guarded(fn, memo: bool):
        names = list(inspect.signature(fn).parameters)
        i_out = names.index("out")
        tensor_at = frozenset(names.index(a) for a in spec.args if a in names)
        # the arguments whose memory must be their own: out=, and an argument written whole in place
        alone = (i_out,) + ((names.index(spec.pool),) if spec.pool and spec.index is None else ())
        i_same = names.index(spec.in_place) if spec.in_place else None  # out= may be this argument itself
        answers: dict = {}

        def check_out(out, full):
            ck.check_out_alone(out, {names[i]: full[i] for i in sorted(tensor_at)}, spec.in_place)

        def complete(args, kw):
            """The arguments by position, those not given None (only tensors and `out` are read from it)."""
            return args if len(args) == len(names) else args + tuple(kw.get(n) for n in names[len(args):])

        def call(*args, **kw):
            full = complete(args, kw)
            out = full[i_out]
            if out is None:
                return fn(*args, **kw)
            key = None
            if memo and not ck.index_checks_on():
                try:
                    key = _memo_key(args, kw)
                    hit = answers.get(key)
                except TypeError:  # an unhashable argument: not memoised
                    key = hit = None
                if hit is not None and ck.all_apart(full, hit[1]):
                    return hit[0]
            check_out(out, full)
            result = fn(*args, **kw)
            if key is not None and isinstance(out, ck._Tensor):
                if len(answers) >= _MEMO_SIZE:
                    answers.clear()
                answers[key] = (result, ck.alone_spans([t if i in tensor_at or i == i_out else None
                                                        for i, t in enumerate(full)], alone, i_same))
            return result
        call.__doc__, call.__wrapped__ = getattr(fn, "__doc__", None), fn
        return call
    object.__setattr__(spec, "validate", guarded(spec.validate, True))
    object.__setattr__(spec, "checks", guarded(spec.checks, False))


_discover()

OP_NAMES = tuple(SPECS)


def spec(name: str) -> OpSpec:
    """The spec of op `name` (ValueError listing the ops otherwise)."""
    if name not in SPECS:
        fail("op", f"one of {sorted(SPECS)}", repr(name))
    return SPECS[name]
