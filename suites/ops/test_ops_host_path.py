"""The eager host path of every op. The Triton launchers read the environment once, at import; `refresh_env`
reads it again."""
from __future__ import annotations

import pytest
import torch


def test_launchers_read_the_environment_once(monkeypatch):
    """TRITON_INTERPRET and HARNESS_AOT_NVIDIA are read at import, not per launch; `refresh_env` re-reads them
    (`python -m harness.impls.triton.aot` sets HARNESS_AOT_NVIDIA and calls it)."""
    _common = pytest.importorskip("harness.impls.triton._common", reason="triton is not installed")
    t = torch.zeros(1)
    before = (_common.interpreting(), _common.nvidia_fast(t))
    try:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setenv("HARNESS_AOT_NVIDIA", "1")
        if before != (False, True):
            assert (_common.interpreting(), _common.nvidia_fast(t)) == before, "the environment was read per call"
        _common.refresh_env()
        assert not _common.interpreting()
        assert _common.nvidia_fast(t) == (torch.version.hip is None), "HARNESS_AOT_NVIDIA=1: CPU tensors take " \
            "the NVIDIA paths after refresh_env"
        monkeypatch.setenv("HARNESS_AOT_NVIDIA", "0")
        _common.refresh_env()
        assert not _common.nvidia_fast(t)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("HARNESS_AOT_NVIDIA", "1")
        _common.refresh_env()
        assert _common.interpreting() and not _common.nvidia_fast(t), "the interpreter never takes NVIDIA paths"
    finally:
        monkeypatch.undo()
        _common.refresh_env()
    assert (_common.interpreting(), _common.nvidia_fast(t)) == before


def test_device_guard_makes_the_device_current():
    """Inside `device_guard(t)` the current CUDA device is t's, on every visible device (with one device the
    guard switches nothing and queries nothing)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (on the CPU the guard is a no-op context)")
    from harness.impls.triton._common import device_guard
    for d in range(torch.cuda.device_count()):
        with device_guard(torch.empty(1, device=f"cuda:{d}")):
            assert torch.cuda.current_device() == d
