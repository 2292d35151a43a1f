"""Device selection: `auto`, `cpu`, `cuda`, `xpu` (XPU paths follow torch.xpu; not verified on hardware).

Every command takes `--device {auto,cpu,cuda,xpu}` with `auto` as the default (cuda, else xpu, else cpu).
A device the machine lacks is a usage error with one line of reason and exit code 4 (pytest's exit
code for a usage error): the same line from `pytest --device`, `harness run|bench|selftest|impls` and
`harness bench throughput`.
"""
from __future__ import annotations

import os
import sys

# torch is imported inside the functions: the command line builds its parsers (and answers --help) from
# this module without loading it.
CHOICES = ("auto", "cpu", "cuda", "xpu")
DEFAULT = "auto"
EXIT_NO_DEVICE = 4  # pytest.ExitCode.USAGE_ERROR
HELP = "device to run on (default: auto = cuda, else xpu, else cpu; a device this machine lacks is exit 4)"


class DeviceUnavailable(RuntimeError):
    pass


def add_device_arg(parser, default: str = DEFAULT) -> None:
    """The `--device` option, the same in every command."""
    parser.add_argument("--device", default=default, choices=CHOICES, help=HELP)


def resolve_or_exit(device: str, prog: str) -> str:
    """`resolve(device)`, or print `<prog>: error: <reason>` (one line) to stderr and exit 4."""
    try:
        return resolve(device)
    except DeviceUnavailable as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_NO_DEVICE) from None


def prepare(device: str) -> None:
    """Process set-up for a resolved device kind: on the CPU, Triton kernels run through its interpreter
    (TRITON_INTERPRET=1 must be set before any @triton.jit definition is executed)."""
    if device.split(":")[0] == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _xpu_available() -> bool:
    import torch
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def resolve(device: str) -> str:
    """Map a requested device kind to a concrete torch device string, or raise DeviceUnavailable."""
    import torch
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
    import torch
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
    import torch
    kind = str(device).split(":")[0]
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "xpu":
        torch.xpu.synchronize(device)
