"""Environment capture for result records: git sha, versions, device name."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from functools import lru_cache

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


GIT_SHA_VARS = ("HARNESS_GIT_SHA", "GITHUB_SHA", "CI_COMMIT_SHA", "GIT_COMMIT")


def _git_dir_sha(root: str) -> str | None:
    """HEAD's sha read from the .git folder itself (a checkout on a machine without the git binary)."""
    gd = os.path.join(root, ".git")
    try:
        if os.path.isfile(gd):  # a worktree: "gitdir: PATH"
            with open(gd) as f:
                line = f.read().strip()
            if not line.startswith("gitdir:"):
                return None
            gd = os.path.join(root, line.split(":", 1)[1].strip())
        with open(os.path.join(gd, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        common = gd
        if os.path.isfile(os.path.join(gd, "commondir")):
            with open(os.path.join(gd, "commondir")) as f:
                common = os.path.join(gd, f.read().strip())
        for base in (gd, common):
            p = os.path.join(base, ref)
            if os.path.isfile(p):
                with open(p) as f:
                    return f.read().strip() or None
        with open(os.path.join(common, "packed-refs")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
    except OSError:
        return None
    return None


@lru_cache(maxsize=1)
def git_info() -> tuple[str | None, str | None]:
    """(sha, where it came from): $HARNESS_GIT_SHA when set (it wins: a tree copied to another machine can
    carry a .git whose HEAD is not the commit it was copied from), else `git rev-parse HEAD` (+ "-dirty" for
    uncommitted tracked changes), else the first of $GITHUB_SHA, $CI_COMMIT_SHA, $GIT_COMMIT (a tree copied
    without its .git), else the .git folder read directly (no git binary); (None, None) when none is known."""
    v = os.environ.get("HARNESS_GIT_SHA", "").strip()
    if v:
        return v, "$HARNESS_GIT_SHA"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            sha = out.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return sha + ("-dirty" if dirty else ""), "git"
    except (OSError, subprocess.SubprocessError):
        pass
    for var in GIT_SHA_VARS:
        v = os.environ.get(var, "").strip()
        if v:
            return v, f"${var}"
    sha = _git_dir_sha(REPO_ROOT)
    if sha:
        return sha, ".git"
    return None, None


def git_sha() -> str | None:
    return git_info()[0]


@lru_cache(maxsize=1)
def harness_version() -> str:
    """The installed package's version, else the one pyproject.toml declares (a source tree)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("ssm-harness")
    except (ImportError, PackageNotFoundError):
        pass
    try:
        with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
            for line in f:
                if line.startswith("version"):
                    return line.split("=", 1)[1].strip().strip('"') + " (source tree)"
    except OSError:
        pass
    return "unknown"


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else the platform's), not just the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model") and val.strip():
                    return f"{val.strip()} ({os.cpu_count()} cores, {platform.machine()})"
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
            if out:
                return f"{out} ({os.cpu_count()} cores)"
        except (OSError, subprocess.SubprocessError):
            pass
    proc = platform.processor()
    arch = platform.machine() or "cpu"
    return f"{proc} ({arch})" if proc and proc != arch else arch


def device_name(device: str) -> str:
    import torch
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("xpu") and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.get_device_name(torch.device(device))
    return cpu_model()


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
        "git_sha": git_info()[0],
        "git_sha_source": git_info()[1],
        "harness": harness_version(),
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


def child_pytest_env(**extra) -> dict:
    """The environment for a pytest run of its own started from this process: without a caller's
    pytest-xdist worker variables (they would make the child's plugin act as a worker: no outcomes file, no
    bench timing) or its current-test variable; `extra` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}
    env.update(extra)
    return env

