"""Adapters: third-party kernels (mamba_ssm, causal-conv1d, flash-linear-attention) behind the op
contract of `harness.ops`. Each module registers its Impl at import whether or not the package is
installed; `Impl.unavailable()` imports the package lazily and says why it cannot be used.

Shared by the adapters: `import_peer(module)` imports a peer module; when `HARNESS_PEERS_STUB_CUDA=1` (set by
scripts/peers_setup.sh) and only mamba_ssm's compiled `selective_scan_cuda` is missing, it installs a
placeholder module of that name (flagged `__harness_placeholder__`) so mamba_ssm's Triton ops import.
"""
from __future__ import annotations

import importlib
import os
import sys
import types


def import_peer(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == "selective_scan_cuda" and os.environ.get("HARNESS_PEERS_STUB_CUDA") == "1":
            stub = types.ModuleType("selective_scan_cuda")
            stub.__harness_placeholder__ = True
            sys.modules["selective_scan_cuda"] = stub
            return importlib.import_module(name)
        raise


def unavailable_reason(package: str, *modules: str) -> str | None:
    for m in modules:
        try:
            import_peer(m)
        except Exception as e:  # noqa: BLE001 - any import failure makes the peer unusable
            return f"package {package} not importable: {type(e).__name__}: {e}"
    return None


def host_slots(indices, pad_slot_id):
    """Host list of slot ids and the positions of live (non-pad) requests."""
    idx = [int(i) for i in indices.detach().cpu().tolist()]
    return idx, [i for i, s in enumerate(idx) if s != pad_slot_id]
