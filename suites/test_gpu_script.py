"""scripts/gpu.sh: its arguments are checked before anything runs or is removed (on any machine)."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_sh(*args):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("args, message", [
    (["--gpus", "3"], "--gpus: expected 1 or 2, got 3"),
    (["--steps", "suites,bogus"], "--steps: expected a subset of env,tp,suites,bench,throughput,peers,sweep, got bogus"),
    (["--budget", "ten"], "--budget: expected whole seconds, got ten"),
    (["--resume", "/no/such/run"], "--resume: expected the logs folder of an earlier run, got /no/such/run"),
    (["--frobnicate"], "unknown argument --frobnicate"),
])
def test_bad_arguments_are_refused_first(args, message):
    r = _gpu_sh(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_help_names_the_lanes_and_resume():
    r = _gpu_sh("--help")
    assert r.returncode == 0
    assert "--gpus" in r.stdout and "--resume" in r.stdout and "tp" in r.stdout
