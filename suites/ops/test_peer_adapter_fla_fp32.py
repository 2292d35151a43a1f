"""HARNESS_FLA_FP32: the fla adapter runs fla-core's fp32 dots as it ships (TF32, judged at TF32's precision) or
in IEEE fp32 (judged at the fp32 tolerance), which tells TF32 rounding apart from a defect in fla's fp32 path.
Each setting is read when the adapter is imported, so each case runs in a fresh interpreter."""
import os
import subprocess
import sys
import textwrap

import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = textwrap.dedent("""
    import os, types
    import triton.language as tl
    from harness.impls.registry import all_impls
    from harness.impls.adapters import fla
    from harness.testing.checker import _uses_tf32
    impl = all_impls()["fla"]
    solve = types.SimpleNamespace(SOLVE_TRIL_DOT_PRECISION=tl.constexpr("tf32"))  # as fla sets it on a TF32 GPU
    fla.ieee_solve(solve)
    print(impl.fp32_matmul, _uses_tf32("fla"), os.environ.get("FLA_TRIL_PRECISION"),
          os.environ.get("TRITON_F32_DEFAULT"), str(solve.SOLVE_TRIL_DOT_PRECISION), sep="|")
    print("problem", fla.fp32_mode_problem(), sep="|")
""")


def _probe(value):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HARNESS_FLA_FP32", "FLA_TRIL_PRECISION", "TRITON_F32_DEFAULT")}
    env["PYTHONPATH"] = ROOT
    if value is not None:
        env["HARNESS_FLA_FP32"] = value
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln.split("|") for ln in r.stdout.strip().splitlines()[-2:]]
    return lines[0], lines[1][1]


def test_fla_fp32_default_is_tf32_as_shipped():
    """Unset: fla is judged as a TF32 kernel and nothing of fla's or Triton's precision is touched."""
    (matmul, tf32, tril, f32_default, solve), problem = _probe(None)
    assert (matmul, tf32, tril, f32_default, problem) == ("tf32", "True", "None", "None", "None")
    assert solve == str(tl.constexpr("tf32"))


def test_fla_fp32_ieee_sets_every_precision_and_the_tolerance():
    """ieee: judged at the fp32 tolerance; Triton's default, fla's triangular solve and its GDN per-chunk
    solve (which sets TF32 itself on a TF32 GPU) all multiply in IEEE fp32."""
    (matmul, tf32, tril, f32_default, solve), problem = _probe("ieee")
    assert (matmul, tf32, tril, f32_default, problem) == ("ieee", "False", "ieee", "ieee", "None")
    assert solve == str(tl.constexpr("ieee"))


def test_fla_fp32_bad_value_makes_fla_unavailable_with_the_reason():
    """Any other value: fla is unavailable, and the reason names the variable, what it takes and what it got."""
    _, problem = _probe("tf64")
    assert problem == "HARNESS_FLA_FP32: expected one of tf32, ieee, got 'tf64'"
