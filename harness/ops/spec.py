"""`OpSpec`: everything the harness knows about one op, declared once, in the op's own module.

Each module `harness/ops/<op>.py` defines `SPEC = OpSpec(...)`; the package discovers them, so adding
an op is a new file here (plus its implementations). Every table the harness needs is derived from
the specs: the op names, the reference implementation and the float64 oracle, the selftest's argument
names, the contract tests' cases, the benchmark input sets, byte and FLOP counts.

Fields
------
name        the op's name (the key implementations register under).
args        positional arguments, in order (the contract's signature).
options     keyword-only options with their defaults (`pad_slot_id` and `out` included where taken).
pool        the state-pool argument (read and written in place), or None. Without `index`, an argument the op
            updates whole in place (add_rms_norm's residual): the suites compare it with the oracle's, as a pool;
            its memory must be its own (no element shared with another argument), the one rule besides `out=`'s
            whose check reads addresses: the validators' memo (harness.ops) compares them on every call.
index       the argument naming each request's pool slot, or None.
validate    validate(*args, **options): raises ValueError (argument, expected, got) before anything is
            written; returns the op's dimensions. Runs before every eager call: it first asks a predicate
            over the whole input, reading each tensor's metadata once, and only when that says no runs
            `checks`.
checks      checks(*args, **options): the same rules one at a time, the first broken one raising (the
            validator's slow path). For any input, `validate` returns what `checks` returns or raises
            the error `checks` raises (suites/ops/test_ops_host_path.py, test_ops_contract_fuzz.py).
reference   reference(compute_dtype, *args, **options) -> y: the plain-loop reference ops of `reference/`
            evaluated in `compute_dtype` (float64 for the oracle); writes final states into the pool it is
            given.
inputs      inputs(shape: dict, dtype, device, gen) -> dict: one valid input set (keyword arguments by
            name) for a shape of `shapes`; shared by benchmarks, the contract tests and the AOT compile
            check. A shape may carry `optional=False` (optional tensors None, activation off) and
            `pool_dtype`.
bytes       bytes(inputs) -> int: the fewest bytes the op must move (each input read once, each output
            written once; pools count only the slots the batch names).
flops       flops(inputs) -> int: the arithmetic of the op's natural formulation (multiply-adds count 2).
shapes      {"cpu": [...], "gpu": [...]}: benchmark shapes per device kind; "contract": tiny valid cases
            (several sequences, at least one without an initial state); "aot": the launch variants to
            compile ahead of time.
bad_inputs  op-specific malformed inputs: (what, argument the error must name, mutate(kwargs) -> None);
            the generic ones (dtypes, ranks, slot ids, query_start_loc, `out=`) are derived from the roles.
tokens      tokens(shape) -> int | None: tokens processed per call (for tok/s), from a benchmark shape.
in_place    the positional argument `out=` may be itself (the op then writes over that input, as engines run
            it: vLLM's conv update writes into x by default), or None. Any other `out=` that shares memory
            with an argument (the pool included) is bad input: `validate` and `checks` both reject it first
            (harness.ops wraps them with `_checks.check_out_alone`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from reference.validate import fail


@dataclass(frozen=True)
class OpSpec:
    name: str
    args: tuple[str, ...]
    options: dict
    validate: Callable
    checks: Callable
    reference: Callable
    inputs: Callable
    bytes: Callable
    flops: Callable
    shapes: dict
    tokens: Callable
    pool: str | None = None
    index: str | None = None
    bad_inputs: tuple = ()
    doc: str = ""
    in_place: str | None = None

    def __post_init__(self):
        missing = [k for k in ("cpu", "gpu", "contract") if not self.shapes.get(k)]
        if missing:
            fail(f"OpSpec({self.name!r}).shapes", "non-empty 'cpu', 'gpu' and 'contract' lists", f"missing {missing}")
        for role in ("pool", "index", "in_place"):
            a = getattr(self, role)
            if a is not None and a not in self.args:
                fail(f"OpSpec({self.name!r}).{role}", f"one of the positional args {self.args}", repr(a))

    @property
    def varlen(self) -> bool:
        """Takes packed sequences (query_start_loc)."""
        return "query_start_loc" in self.args

    def split(self, kwargs: dict) -> tuple[list, dict]:
        """Keyword arguments by name -> (positional list, options) in the contract's order."""
        unknown = sorted(set(kwargs) - set(self.args) - set(self.options))
        if unknown:
            fail("inputs", f"arguments of {self.name} {list(self.args) + list(self.options)}", f"unknown {unknown}")
        missing = [a for a in self.args if a not in kwargs]
        if missing:
            fail("inputs", f"every positional argument of {self.name}", f"missing {missing}")
        return [kwargs[a] for a in self.args], {k: v for k, v in kwargs.items() if k in self.options}

    def call(self, fn: Callable, kwargs: dict):
        """Call `fn` (an implementation of this op) with a by-name input dict."""
        pos, opt = self.split(kwargs)
        return fn(*pos, **opt)

