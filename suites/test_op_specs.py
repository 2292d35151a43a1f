"""The op specs are complete and every implementation's ops are registered specs.

Each op is declared once (`harness/ops/<op>.py`): validator, float64 reference, input builder, byte and
FLOP counts, benchmark shapes, tiny contract cases. Every table the harness uses is derived from them,
so an op with a missing piece, or an implementation registering an op that is no spec, fails here.
"""
import re
from pathlib import Path

import pytest
import torch

from harness.impls import all_impls
from harness.impls.reference_impl import oracle
from harness.ops import OP_NAMES, SPECS, spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", OP_NAMES)
def test_spec_is_complete(name):
    sp = SPECS[name]
    for f in ("validate", "checks", "reference", "inputs", "bytes", "flops", "tokens"):
        assert callable(getattr(sp, f)), f"{name}: spec field {f} is not callable"
    for kind in ("cpu", "gpu", "contract"):
        assert sp.shapes.get(kind), f"{name}: no {kind!r} shapes"
    assert sp.doc.strip().startswith(name), f"{name}: the module docstring must start with the op's name"
    assert "out" in sp.options, f"{name}: every op takes out="
    if sp.varlen:
        assert sp.index and sp.pool, f"{name}: a varlen op with a pool names its pool and index arguments"


@pytest.mark.parametrize("name", OP_NAMES)
def test_spec_pieces_agree(name):
    """The builder's inputs validate, the oracle runs on them, and the byte / FLOP counts are positive ints."""
    sp = SPECS[name]
    for shape in sp.shapes["contract"] + sp.shapes["cpu"][:1]:
        inp = sp.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(0))
        pos, opt = sp.split(inp)
        sp.validate(*pos, **{k: v for k, v in opt.items() if k in ("pad_slot_id", "out", "dt_limit", "activation",
                                                                     "eps", "group_size")})
        y, pool = oracle(name, *pos, **opt)
        assert torch.isfinite(y).all(), f"{name}: oracle output not finite on the builder's inputs {shape}"
        assert (pool is None) == (sp.pool is None)
        b, f = sp.bytes(inp), sp.flops(inp)
        assert isinstance(b, int) and b > 0 and isinstance(f, int) and f > 0, (name, shape, b, f)


def test_every_implementation_registers_specs_only():
    for name, impl in all_impls().items():
        unknown = sorted(set(impl.ops) - set(SPECS))
        assert not unknown, f"implementation {name!r} registers ops that are no spec: {unknown}"


def test_unknown_op_is_a_clear_error():
    with pytest.raises(ValueError, match="op: expected one of"):
        spec("no_such_op")
    from harness.impls.registry import provides
    with pytest.raises(ValueError, match="no_such_op"):
        provides("mine", "no_such_op")


def _py_files():
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith((".", "build/")) or "/." in rel:
            continue
        yield rel, p.read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_name_is_not_spread(name):
    """Outside the op's own files (its spec, its implementations and adapters, the planted broken
    implementations of the selftest, the peers' native kernels and our kernels' launch-config candidates in
    the benchmarks, the reference, the mixer families that compose it) and the test suites, an op's literal name appears in at most 4 files of the
    product: everything else derives what it needs from the spec."""
    own = re.compile(r"^(harness/ops/|harness/impls/|reference/|harness/engine/families/|suites/|"
                     r"harness/bench/peers\.py|harness/bench/sweep\.py|harness/testing/planted\.py)")
    pat = re.compile(rf"[\"']{name}[\"']")
    users = sorted(rel for rel, text in _py_files() if pat.search(text) and not own.search(rel))
    assert len(users) <= 4, f"{name!r} is written out in {len(users)} files outside its own: {users}"
