"""The fewest bytes each benchmark must move: every input read once, every output written once.

Ops of the contract count through their spec (`harness.ops.SPECS[op].bytes`); the benchmark-only
entries (`copy`, the model-level mixer) are here. `op_bytes(op, inputs)` dispatches by name; entries
without a count have no GB/s.
"""
from __future__ import annotations

from harness.ops import SPECS
from harness.ops._inputs import nbytes as _nb


def bytes_copy(inp: dict) -> int:
    return _nb(inp["src"]) + _nb(inp["dst"])


def bytes_mamba2_mixer(inp: dict) -> int:
    """Model level: the layer's weights and its input/output activations (the fewest a layer moves)."""
    return sum(_nb(v) for k, v in inp.items() if k.startswith("w_")) + 2 * _nb(inp["hidden"]) \
        + sum(_nb(v) for k, v in inp.items() if k.endswith("_states"))


BYTES = {**{n: s.bytes for n, s in SPECS.items()},
         **{name[len("bytes_"):]: fn for name, fn in dict(globals()).items() if name.startswith("bytes_")}}


def op_bytes(op: str, inputs: dict) -> int | None:
    fn = BYTES.get(op)
    return int(fn(inputs)) if fn else None
