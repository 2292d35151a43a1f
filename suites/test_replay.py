"""`harness replay`: the op call a test left in its --outcomes line (`last_call`) is rebuilt with the same
shapes, dtypes, strides and recorded integer values, floating-point values in each argument's domain, and run
again; `--compare` judges it against the float64 oracle. Bad files and ambiguous choices are usage errors."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from harness.cli import main
from harness.impls import registry
from harness.ops import SPECS
from harness.replay import rebuild
from harness.testing.lastcall import describe_call
from reference.testing import gen


def _contract_call(op: str, page_major: bool = False):
    """(fn, args, kwargs) of op's contract case through the torch implementation; the pool, if asked, as a
    page-major view (a slot stride twice the slot's numel) starting one slot into its buffer."""
    spec = SPECS[op]
    kw = spec.inputs(spec.shapes["contract"][0], torch.float32, "cpu", gen(3))
    if page_major and spec.pool:
        p = kw[spec.pool]
        big = torch.zeros((p.shape[0] + 1, 2 * p[0].numel()), dtype=p.dtype)
        view = big[1:, :p[0].numel()].view(p.shape)
        view.copy_(p)
        kw[spec.pool] = view
    args, options = spec.split(kw)
    return registry.get("torch").op(op), args, options


def _outcomes(tmp_path, *calls):
    path = tmp_path / "outcomes.jsonl"
    with open(path, "w") as f:
        for nodeid, desc in calls:
            f.write(json.dumps({"nodeid": nodeid, "outcome": "failed", "why": "CUDA context lost", "last_call": desc}) + "\n")
        f.write(json.dumps({"nodeid": "suites/x.py::test_passes", "outcome": "passed"}) + "\n")
    return str(path)


@pytest.mark.parametrize("op", sorted(SPECS))
def test_rebuilt_call_keeps_the_recorded_layout_and_values(op):
    """For every op: each tensor comes back with the recorded shape, dtype and strides (a page-major pool
    view included), integer and bool tensors with the recorded values, floating-point tensors finite and
    within the range the op's input builder gives that argument, `out=` NaN; scalars as recorded."""
    spec = SPECS[op]
    fn, args, options = _contract_call(op, page_major=True)
    desc = json.loads(json.dumps(describe_call(op, fn, args, options)))
    _, fn_name, pos, kw, notes = rebuild(desc, seed=1)
    domain = spec.inputs(spec.shapes["contract"][0], torch.float32, "cpu", gen(1))
    rebuilt = dict(zip(spec.args, pos), **kw)
    assert fn_name == desc["fn"] and not notes, notes
    for name, d in desc["args"].items():
        t = rebuilt[name]
        if not (isinstance(d, dict) and "shape" in d):
            assert t == d, name
            continue
        assert (list(t.shape), list(t.stride()), str(t.dtype)) == (d["shape"], d["stride"], "torch." + d["dtype"]), name
        assert t.storage_offset() == d.get("offset", 0), name
        if "values" in d:
            assert t.tolist() == d["values"], name
        elif name == "out":
            assert bool(torch.isnan(t).all()), name
        elif t.numel():
            src = domain[name].float()
            assert bool(torch.isfinite(t).all()) and src.min() <= t.min() and t.max() <= src.max(), name


@pytest.mark.parametrize("op", ["gated_delta_rule_varlen", "selective_state_update", "causal_conv1d_varlen", "ssd_varlen"])
def test_replay_runs_the_recorded_function_and_compares(op, tmp_path, capsys):
    """The recorded function is imported by name, run on the rebuilt inputs and matches the float64 oracle;
    with two faulted tests in the file, --test picks one."""
    fn, args, options = _contract_call(op)
    desc = describe_call(op, fn, args, options)
    path = _outcomes(tmp_path, ("suites/a.py::test_one[x]", desc), ("suites/a.py::test_two[x]", desc))
    assert main(["replay", path, "--test", "test_two", "--device", "cpu", "--compare"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("suites/a.py::test_two[x]:") and f"{op}.y: matches the float64 oracle" in out, out
    if SPECS[op].pool:
        assert f"{op}.{SPECS[op].pool}: matches" in out, out


def test_replay_says_when_the_call_raises_or_differs(tmp_path, capsys, monkeypatch):
    """A recorded function that raises exits 1 naming the exception; one that returns wrong values exits 1
    with --compare naming the output that differs (and 0 without --compare: it returned)."""
    mod = tmp_path / "replay_planted.py"
    mod.write_text("import torch\n"
                   "def raises(*a, **k):\n    raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
                   "def wrong(q, k, v, g, beta, pool, qsl, idx, hi, *, out=None, **kw):\n"
                   "    o = out if out is not None else torch.empty(v.shape, dtype=v.dtype)\n"
                   "    o.fill_(1.0)\n    return o\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn, args, options = _contract_call("gated_delta_rule_varlen")
    desc = describe_call("gated_delta_rule_varlen", fn, args, options)
    for name, code, said in (("raises", 1, "raised RuntimeError: CUDA error: an illegal memory access"),
                             ("wrong", 1, "gated_delta_rule_varlen.y: DIFFERS from the float64 oracle")):
        path = _outcomes(tmp_path, ("suites/a.py::test_f", dict(desc, fn=f"replay_planted.{name}")))
        assert main(["replay", path, "--compare"]) == code, name
        assert said in capsys.readouterr().out, name
    assert main(["replay", path]) == 0
    sys.modules.pop("replay_planted", None)


def test_replay_bad_files_and_choices_are_usage_errors(tmp_path, capsys):
    """No call in the file, a --test matching none or several, an unknown op or an unimportable function:
    exit 2 with the argument, what was expected and what was found."""
    fn, args, options = _contract_call("gated_delta_rule_varlen")
    desc = describe_call("gated_delta_rule_varlen", fn, args, options)
    none = tmp_path / "none.jsonl"
    none.write_text(json.dumps({"nodeid": "suites/x.py::test_y", "outcome": "failed", "why": "assert"}) + "\n")
    two = _outcomes(tmp_path, ("suites/a.py::test_one", desc), ("suites/a.py::test_two", desc))
    bad_op = tmp_path / "op.json"
    bad_op.write_text(json.dumps(dict(desc, op="no_such_op")))
    bad_fn = tmp_path / "fn.json"
    bad_fn.write_text(json.dumps(dict(desc, fn="no_such_module.no_such_fn")))
    for argv, said in (([str(none)], "FILE: expected an --outcomes file with at least one line carrying last_call"),
                       ([str(tmp_path / "missing.jsonl")], "FILE: expected a readable --outcomes file"),
                       ([two], "--test: expected a part of exactly one of the tests in the file, got None matches 2"),
                       ([two, "--test", "test_three"], "got 'test_three' matches 0: suites/a.py::test_one, suites/a.py::test_two"),
                       ([str(bad_op)], "last_call.op: expected one of"),
                       ([str(bad_fn), "--device", "cpu"], "last_call.fn: expected an importable function")):
        assert main(["replay", *argv]) == 2, argv
        assert said in capsys.readouterr().err, argv
