"""Environment capture for result records: git sha, versions, device name."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from functools import lru_cache

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@lru_cache(maxsize=1)
def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return None
        sha = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str) -> str:
    import torch
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("xpu") and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


def environment(device: str = "cpu") -> dict:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - triton may be absent or broken on a platform
        triton_version = None
    try:
        import transformers
        transformers_version = transformers.__version__
    except Exception:  # noqa: BLE001
        transformers_version = None
    env = {
        "git_sha": git_sha(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers_version,
        "device": device,
        "device_name": device_name(device),
        "host": platform.node(),
        "platform": platform.platform(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(torch.device(device))
        env["sm_count"] = props.multi_processor_count
        env["capability"] = f"{props.major}.{props.minor}"
    return env
