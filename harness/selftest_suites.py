"""Suite variants of `harness selftest`: the bug classes of docs/bug-classes.md that the scenario properties
cannot see (they live below the engine or outside it) are planted into one component and the real suites
are run against it.

A *suite variant* names a broken component of harness.testing.planted -- an implementation wrapper plugged
in with ``--impl harness.testing.planted:NAME`` or a patch applied for the whole run with
``-p harness.testing.planted --plant NAME`` -- and the tests that must catch it: a ``-k`` expression on one
test file. The variant runs pytest twice in a subprocess, on the CPU with the ``ci`` profile, on the same
selection:

* broken: with the component plugged in, some selected test must FAIL in its body (a failed assertion
  or an exception while the test runs; an error while collecting or setting up is no catch);
* control: with the unbroken component (the `torch` implementation, or the run without the patch),
  every selected test must pass (at least one, none skipped to nothing).

The variant is caught when both hold. Each pytest run writes its outcomes with the harness plugin's
``--outcomes``, which name the tests that failed and why.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

PLANTED = "harness.testing.planted"


@dataclass(frozen=True)
class SuiteVariant:
    """A planted component and the tests that must catch it (see the module docstring).

    `impl`: the object of harness.testing.planted giving the broken implementation (``--impl``);
    `control_impl`: the unbroken one the same tests must pass with (a registered name or `module:object`); `plant`: a name of harness.testing.planted.PLANTS instead (no ``--impl``: every
    registered implementation usable on the CPU); `path`, `select`: the test file and the ``-k`` expression
    naming the tests; `why`: why these tests, and what the scenario properties cannot see."""
    name: str
    bug_class: str
    description: str
    path: str
    select: str
    impl: str | None = None
    control_impl: str = "torch"
    plant: str | None = None
    why: str = ""

    def __post_init__(self):
        if (self.impl is None) == (self.plant is None):
            raise ValueError(f"SuiteVariant {self.name}: expected exactly one of impl= and plant=, "
                             f"got impl={self.impl!r}, plant={self.plant!r}")

    def pytest_args(self, broken: bool) -> list[str]:
        """The pytest arguments of the broken run (`broken`) or of its control."""
        args = [self.path, "-q", "-p", "no:cacheprovider", "--device", "cpu", "--profile", "ci", "-k", self.select]
        if self.impl is not None:
            args += ["--impl", f"{PLANTED}:{self.impl}" if broken else self.control_impl]
        elif broken:
            args += ["-p", PLANTED, "--plant", self.plant]
        return args

    def command(self, broken: bool = True) -> str:
        return " ".join(shlex.quote(a) for a in ["python", "-m", "pytest", *self.pytest_args(broken)])


SUITE_VARIANTS = [
    SuiteVariant(
        "ssd_exp_before_mask", "6", "varlen SSD takes exp of the segment sums before masking the upper "
        "triangle: a large |A| overflows, inf * 0 = NaN",
        "suites/ops/test_ops_ssd.py", "test_ssd_varlen_stress_is_finite and float32",
        impl="torch_grid_ssd_exp_before_mask", control_impl=f"{PLANTED}:torch_grid_ssd",
        why="the engine's models draw |A| small enough that exp never overflows; the op suite's stress inputs "
            "(A = -exp(U(0, 6)), dt at both dt_limit ends) do"),
    SuiteVariant(
        "int32_offsets", "12", "the Triton kernels' index function accumulates offsets in 32-bit arithmetic: past "
        "2^31 elements it wraps and keeps int32 index math",
        "suites/ops/test_ops_index_type.py", "test_index_type_of_the_nightly_offset_shapes",
        plant="int32_offsets",
        why="the offsets-past-2^31 op tests need tensors of 2^31 elements (profile nightly, GPU); the index "
            "function's unit test checks the same sizes on meta tensors, on every machine"),
    SuiteVariant(
        "model_prefix_unknown", "13", "checkpoint name rules know the `backbone.` prefix but not `model.`",
        "suites/models/test_models_loader.py", "test_models_loader_mapping_accepts_every_spelling",
        plant="model_prefix_unknown", why="the engine runs random weights, never a checkpoint"),
    SuiteVariant(
        "replicated_group_divided", "14", "Mamba2Spec.conv_dim from a second formula that divides a replicated "
        "B/C group by TP: it disagrees with the conv segments",
        "suites/cache/test_cache_specs.py",
        "test_shapes_match_the_issue_formulas or test_mamba2_replicated_group_example",
        plant="replicated_group_divided", why="the scenario engine runs without tensor parallelism"),
    SuiteVariant(
        "nan_masked_compare", "15", "the comparison every check goes through masks NaN/inf out of the output "
        "(a NaN-writing kernel passes)", "suites/test_checks.py", "test_nan_never_passes",
        plant="nan_masked_compare", why="the check itself is what is broken: a test of the checks catches it"),
    SuiteVariant(
        "dt_in_place", "17", "selective_state_update rewrites the caller's dt in place (softplus(dt + "
        "dt_bias)) and runs with both off: outputs and states stay right",
        "suites/ops/test_ops_inputs_untouched.py",
        "test_op_leaves_its_inputs_unchanged and selective_state_update and float32",
        impl="torch_dt_in_place", why="the engine never reads dt after the decode op"),
    SuiteVariant(
        "state_in_bf16", "18", "the decode ops round the recurrent state to bf16 (the activations' dtype) "
        "between steps although the pool is fp32",
        "suites/ops/test_ops_long_decode.py",
        "test_long_decode_matches_oracle_step_by_step and bfloat16 and selective_state_update",
        impl="torch_state_in_bf16", why="the scenario engine keeps its states in float64"),
    SuiteVariant(
        "scan_restarts_at_tiles", "20", "the selective scan restarts from a zero state at every 64-token tile "
        "of a sequence (its declared tile)",
        "suites/ops/test_ops_selective_scan.py", "test_selective_scan_matches_oracle and float32",
        impl="torch_restarts_at_tiles", why="the scenarios' prompts stay far below the scan's 64-token tile"),
    SuiteVariant(
        "first_call_drifts", "26", "the first op call of a process moves its output by one unit in the last place "
        "(a race, or a launch configuration picked at run time): two runs of the same inputs differ in their bits",
        "suites/scenarios/test_scen_properties.py", "test_scen_determinism",
        impl="torch_first_call_drifts", why="the selftest's scenario search runs each case once per property; "
        "the determinism property runs a case twice, in its own suite"),
    SuiteVariant(
        "shared_workspace", "21", "without out=, every op returns a view of one buffer it reuses on the next call",
        "suites/ops/test_ops_fresh_outputs.py",
        "test_results_stay_valid_across_calls and float32 and selective_state_update and contract",
        impl="torch_shared_workspace", why="the engine consumes each mixer output before the next call"),
    SuiteVariant(
        "contiguous_rows", "23", "every op reads its activations as contiguous rows: a row-strided view (x and z "
        "as the two halves of one projection's output) is read through the neighbouring columns",
        "suites/ops/test_ops_strided_inputs.py",
        "test_strided_inputs_give_the_same_results and not transposed and float32 and contract and "
        "(selective_state_update or gated_delta_rule_varlen or causal_conv1d_varlen)",
        impl="torch_contiguous_rows", why="planted below the engine, where the suite names the op and the "
        "arguments (the engine's mixers hand the ops views, so the scenario properties see it too)"),
    SuiteVariant(
        "contiguous_ids", "25", "every op reads its 1-dim index tensors (offsets, slot ids, flags) as adjacent "
        "elements: a strided view (one column of a slot table) is read through its neighbours",
        "suites/ops/test_ops_strided_inputs.py",
        "test_strided_index_tensors_give_the_same_results and contract and (selective_state_update or "
        "gated_delta_rule_update or causal_conv1d_varlen)",
        impl="torch_contiguous_ids", why="the engine builds its index tensors contiguous; only the op suite "
        "hands an op strided ones"),
    SuiteVariant(
        "in_place_state_from_output", "24", "the conv update run in place (out is x, as vLLM and SGLang run it) "
        "writes the output over x, then shifts the slots' windows in from x: the states take the outputs",
        "suites/ops/test_ops_out_aliasing.py", "test_in_place_matches_out_of_place and causal_conv1d_update and "
        "not spec", impl="torch_state_from_output",
        why="the engine passes no out= to the conv update: only the op suite runs it in place"),
    SuiteVariant(
        "plans_keyed_on_shapes", "27", "the Triton ops' launch plans (and the validators' memo) are keyed on their "
        "arguments' shapes and dtypes but not their strides: a view of the same shape reuses another call's strides",
        "suites/ops/test_ops_strided_inputs.py",
        "test_strided_inputs_give_the_same_results and triton and float32 and contract and "
        "(selective_state_update or causal_conv1d_update) and not spec",
        plant="plans_keyed_on_shapes",
        why="the engine hands an op views of one layout throughout a run; the strided-input suite calls the same "
            "op on contiguous tensors and on views of their shapes, one after the other"),
]


@dataclass
class SuiteOutcome:
    """What a suite variant's two pytest runs found; the fields `format_table` reads match
    harness.selftest.Outcome (`properties`: the (node id, why) of each test that failed in the broken run)."""
    variant: SuiteVariant
    caught: bool
    properties: list
    control_ok: bool | None
    seconds: float
    examples: int  # tests selected
    error: str = ""
    impl_name: str = "torch"
    control_failures: list = field(default_factory=list)
    case = None
    size = (0, 0)


def repo_root() -> str:
    import harness
    return os.path.dirname(os.path.dirname(os.path.abspath(harness.__file__)))


def _run(args: list[str], root: str, timeout: float) -> tuple[int, list[dict], str]:
    """pytest `args` in a subprocess from `root`: (exit code, its --outcomes lines, the output's tail)."""
    with tempfile.TemporaryDirectory(prefix="harness-selftest-") as tmp:
        out = os.path.join(tmp, "outcomes.jsonl")
        from harness.env import child_pytest_env
        env = child_pytest_env(PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                               HYPOTHESIS_STORAGE_DIRECTORY=os.path.join(tmp, "hypothesis"))
        try:
            p = subprocess.run([sys.executable, "-m", "pytest", *args, "--outcomes", out], cwd=root, env=env,
                               capture_output=True, text=True, timeout=timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = -1, f"timed out after {timeout:.0f}s: {(e.stdout or b'')[-2000:]!r}"
        lines = []
        if os.path.exists(out):
            with open(out) as f:
                lines = [json.loads(ln) for ln in f if ln.strip()]
    return rc, lines, tail


def _summary(lines: list[dict]) -> tuple[list, list, int, int]:
    """(failures in a test's body, other failures (setup, teardown), tests passed, tests run)."""
    def why(r):  # the first `E ` line of the failure, without pytest's marker
        w = r["why"]
        return w[1:].strip() if w.startswith("E ") else w.strip()
    body = [(r["nodeid"], why(r)) for r in lines if r["when"] == "call" and r["outcome"] == "failed"]
    other = [(f'{r["nodeid"]} ({r["when"]})', why(r)) for r in lines if r["when"] != "call" and r["outcome"] == "failed"]
    passed = sum(r["when"] == "call" and r["outcome"] == "passed" for r in lines)
    ran = sum(r["when"] == "call" for r in lines)
    return body, other, passed, ran


def run_suite_variant(v: SuiteVariant, *, timeout: float = 300.0, root: str | None = None) -> SuiteOutcome:
    """Run `v`'s broken and control pytest runs (see the module docstring)."""
    t0 = time.time()
    root = root or repo_root()
    impl_name = v.impl or f"plant {v.plant}"
    if not os.path.isfile(os.path.join(root, v.path)):
        return SuiteOutcome(v, False, [], None, time.time() - t0, 0,
                            f"{v.path} not found under {root} (the suites ship with the source checkout)", impl_name)
    rc_b, lines_b, tail_b = _run(v.pytest_args(broken=True), root, timeout)
    body, other, _, ran = _summary(lines_b)
    rc_c, lines_c, tail_c = _run(v.pytest_args(broken=False), root, timeout)
    c_body, c_other, c_passed, c_ran = _summary(lines_c)
    control_ok = rc_c == 0 and c_passed > 0 and not c_body and not c_other
    errors = []
    if not body:
        errors.append(f"no selected test failed with the planted bug (exit code {rc_b}, {ran} tests run)"
                      + ("" if rc_b in (0, 1) else f": {tail_b.strip().splitlines()[-1] if tail_b.strip() else ''}"))
    if other:
        errors.append("broken run: " + "; ".join(f"{n}: {w}" for n, w in other))
    if not control_ok:
        errors.append(f"control (exit code {rc_c}, {c_passed} of {c_ran} passed): "
                      + ("; ".join(f"{n}: {w}" for n, w in c_body + c_other)
                         or (tail_c.strip().splitlines()[-1] if tail_c.strip() else "")))
    if ran != c_ran and body and control_ok:
        errors.append(f"the broken run ran {ran} tests, the control {c_ran}")
    caught = bool(body) and control_ok and ran == c_ran
    return SuiteOutcome(v, caught, body, control_ok, time.time() - t0, ran, "; ".join(errors), impl_name,
                        c_body + c_other)
