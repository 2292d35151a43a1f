"""Device selection: `auto`, `cpu`, `cuda`, `xpu` (XPU paths follow torch.xpu; not verified on hardware)."""
from __future__ import annotations

import os

import torch

CHOICES = ("auto", "cpu", "cuda", "xpu")


class DeviceUnavailable(RuntimeError):
    pass


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def resolve(device: str) -> str:
    """Map a requested device kind to a concrete torch device string, or raise DeviceUnavailable."""
    if device not in CHOICES:
        raise ValueError(f"--device: expected one of {CHOICES}, got {device!r}")
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if _xpu_available():
            return "xpu"
        return "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable("--device cuda: no CUDA device on this machine "
                                f"(torch {torch.__version__}, torch.cuda.is_available() is False)")
    if device == "xpu" and not _xpu_available():
        raise DeviceUnavailable("--device xpu: no XPU device on this machine "
                                f"(torch {torch.__version__}, torch.xpu.is_available() is False)")
    return device


def worker_device(device: str) -> str:
    """Under pytest-xdist on a multi-GPU host, worker gwN takes GPU N mod count."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if device in ("cuda", "xpu") and worker.startswith("gw"):
        n = int(worker[2:])
        count = torch.cuda.device_count() if device == "cuda" else torch.xpu.device_count()
        if count > 1:
            return f"{device}:{n % count}"
    if device in ("cuda", "xpu"):
        return f"{device}:0"
    return device


def synchronize(device: str) -> None:
    kind = str(device).split(":")[0]
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "xpu":
        torch.xpu.synchronize(device)
