"""Stand-ins for the SGLang engine modules that its Mamba / linear-attention kernel files import.

`harness.impls.adapters.sglang.SOURCE` writes these next to the kernel files extracted from the sglang wheel
(see `harness.impls.adapters._source`). They cover platform detection, engine settings, the CUDA-graph
configuration and the model-building helpers that `mamba1.py` imports for its layer class; none of them
computes anything a kernel computes. Platform answers follow SGLang on a plain CUDA host (no NPU, no CPU
engine, no HIP); under Triton's interpreter (TRITON_INTERPRET=1) no GPU launch option is turned on.
"""
from __future__ import annotations

_JIT_UTILS = '''"""Stand-in for sglang.kernels.jit.utils: the GPU architecture queries only."""
import collections
import functools
import os

import torch

ArchInfo = collections.namedtuple("ArchInfo", "major minor")


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def get_jit_cuda_arch():
    if _interpreting() or not torch.cuda.is_available():
        return ArchInfo(0, 0)
    return ArchInfo(*torch.cuda.get_device_capability())


@functools.lru_cache(maxsize=1)
def is_arch_support_pdl():
    if _interpreting() or torch.version.hip is not None:
        return False
    return get_jit_cuda_arch().major >= 9
'''

_SRT_UTILS = '''"""Stand-in for sglang.srt.utils: platform predicates and small integer helpers."""
import contextlib

import torch

from .common import torch_release  # noqa: F401


def cdiv(a, b):
    return -(a // -b)


def next_power_of_2(n):
    return 1 if n < 1 else 1 << (int(n) - 1).bit_length()


def is_cuda():
    return torch.cuda.is_available() and torch.version.cuda is not None


def is_hip():
    return torch.version.hip is not None


def is_cpu():
    return False


def is_npu():
    return False


def is_xpu():
    return False


def cpu_has_amx_support():
    return False


@contextlib.contextmanager
def device_context(device):
    module = torch.get_device_module(device)
    with module.device(device.index):
        yield


def set_weight_attrs(weight, attrs):
    for k, v in (attrs or {}).items():
        setattr(weight, k, v)
'''

_SRT_UTILS_COMMON = '''"""Stand-in for sglang.srt.utils.common: the torch release tuple."""
import torch
from packaging import version

torch_release = version.parse(torch.__version__).release
'''

_BATCH_INVARIANT = '''"""Stand-in for sglang.srt.batch_invariant_ops: the engine default (mode off)."""


def is_batch_invariant_mode_enabled():
    return False
'''

_CUDA_GRAPH_CONFIG = '''"""Stand-in for sglang.srt.model_executor.cuda_graph_config: no configuration published (as in
SGLang's own unit tests), so no phase uses a capture backend."""


class Phase:
    DECODE = "decode"
    PREFILL = "prefill"
    ALL = (DECODE, PREFILL)


class Backend:
    TC_PIECEWISE = "tc_piecewise"
    FULL = "full"
    BREAKABLE = "breakable"
    DISABLED = "disabled"
    ALL = (FULL, BREAKABLE, DISABLED)


def check_cuda_graph_backend(phase, backend):
    return False
'''

_FORWARD_BATCH_INFO = '''"""Stand-in for sglang.srt.model_executor.forward_batch_info: the type name the metadata module annotates
with. Code that reads a batch takes any object with the attributes it uses."""


class ForwardBatch:
    pass
'''

_ENGINE_ONLY = '''"""Stand-in for an SGLang engine module that builds model layers ({what}); the harness calls no layer.
Every name raises when used."""


def _engine_only(name):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{{name}}: an SGLang engine object, not available outside the engine")
    fail.__name__ = name
    return fail


{names}
'''


def _engine_only(what: str, *names: str) -> str:
    return _ENGINE_ONLY.format(what=what, names="\n".join(f"{n} = _engine_only({n!r})" for n in names))


STUBS = {
    "sglang/kernels/jit/utils/__init__.py": _JIT_UTILS,
    "sglang/srt/utils/__init__.py": _SRT_UTILS,
    "sglang/srt/utils/common.py": _SRT_UTILS_COMMON,
    "sglang/srt/batch_invariant_ops/__init__.py": _BATCH_INVARIANT,
    "sglang/srt/model_executor/cuda_graph_config.py": _CUDA_GRAPH_CONFIG,
    "sglang/srt/model_executor/forward_batch_info.py": _FORWARD_BATCH_INFO,
    # imported by mamba1.py for its layer class (the harness uses only its selective-scan loop)
    "sglang/srt/distributed/__init__.py": _engine_only("tensor parallelism", "divide"),
    "sglang/srt/layers/attention/mamba/mamba.py": _engine_only(
        "the Mamba-2 mixer", "causal_conv1d_fn", "causal_conv1d_fn_triton", "causal_conv1d_update",
        "causal_conv1d_update_triton"),
    "sglang/srt/layers/linear.py": _engine_only(
        "parallel linear layers", "ColumnParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear"),
    "sglang/srt/layers/quantization/base_config.py": _engine_only("quantization", "QuantizationConfig"),
    "sglang/srt/model_loader/weight_utils.py": _engine_only("weight loading", "sharded_weight_loader"),
    "sglang/srt/runtime_context.py": _engine_only("runtime context", "get_parallel"),
}
