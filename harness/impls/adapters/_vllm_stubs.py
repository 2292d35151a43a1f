"""Our stand-ins for the engine-only modules that vLLM's extracted kernel files import.

`harness.impls.adapters.vllm.SOURCE` writes each entry of `STUBS` (path inside the source tree -> module
source) next to the files extracted from the vLLM wheel. They answer platform detection, logging, env
settings and metadata-builder imports; none of them computes anything a kernel or a metadata builder
under test computes. The constants they define (PAD_SLOT_ID, NULL_BLOCK_ID, enum values) are vLLM's.
Engine functions that the extracted files import but the adapter never calls raise NotImplementedError
naming themselves, so an accidental use fails loudly instead of returning a made-up answer.
"""
from __future__ import annotations

_NOT_EXTRACTED = '''
def _not_extracted(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"{name}: part of the vLLM engine, not of the extracted kernel sources")
    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn
'''

ENVS = '''"""Stand-in for vllm.envs: the settings the extracted kernels read, from the same environment
variables as vLLM. One default differs: under TRITON_INTERPRET=1 VLLM_TRITON_FORCE_FIRST_CONFIG defaults
to on (vLLM's own switch: every autotuned kernel runs its first valid config), since the interpreter has
no driver to benchmark configs with."""
import os

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
VLLM_TRITON_FORCE_FIRST_CONFIG = os.environ.get(
    "VLLM_TRITON_FORCE_FIRST_CONFIG", "1" if _INTERPRET else "0").strip().lower() in ("1", "true")
VLLM_TUNED_CONFIG_FOLDER = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
VLLM_TRITON_USE_TD = None
'''

LOGGER = '''"""Stand-in for vllm.logger: a standard logger with vLLM's *_once methods."""
import logging


class _Logger(logging.LoggerAdapter):
    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})
        self._seen = set()

    def _once(self, level, msg, *args, **kwargs):
        key = (level, msg, args)
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args)


def init_logger(name):
    return _Logger(name)
'''

PLATFORMS = '''"""Stand-in for vllm.platforms: answers from torch about the device the kernels run on.

is_cpu() is False everywhere: it selects vLLM's Triton kernels (not its torch CPU fallbacks), which on a
host without a GPU run only under TRITON_INTERPRET=1. PDL launches need CUDA capability >= 9.0, as in
vLLM's CUDA platform.
"""
import torch


def _cuda():
    return torch.cuda.is_available()


class _Platform:
    @property
    def device_type(self):
        return "cuda" if _cuda() else "cpu"

    def is_cuda(self):
        return _cuda() and torch.version.hip is None

    def is_rocm(self):
        return _cuda() and torch.version.hip is not None

    def is_cuda_alike(self):
        return _cuda()

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def get_device_capability(self, device_id=0):
        return torch.cuda.get_device_capability(device_id) if _cuda() else None

    def has_device_capability(self, capability, device_id=0):
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        if isinstance(capability, tuple):
            return tuple(cap) >= capability
        return cap[0] * 10 + cap[1] >= capability

    def is_device_capability(self, capability, device_id=0):
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        if isinstance(capability, tuple):
            return tuple(cap) == capability
        return cap[0] * 10 + cap[1] == capability

    def is_device_capability_family(self, capability, device_id=0):
        cap = self.get_device_capability(device_id)
        return cap is not None and cap[0] == capability // 10

    def is_arch_support_pdl(self):
        cap = self.get_device_capability(torch.cuda.current_device()) if self.is_cuda() else None
        return cap is not None and cap[0] >= 9

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id) if _cuda() else "cpu"

    def num_compute_units(self, device_id=0):
        return torch.cuda.get_device_properties(device_id).multi_processor_count


current_platform = _Platform()


def vllm_version_matches_substr(substr):
    return False
'''

TRITON_IMPORTING = '''"""Stand-in for vllm.triton_utils.importing: Triton is used wherever it is importable (vLLM's own check
also counts active GPU drivers, which a host running the interpreter has none of)."""
from importlib.util import find_spec

HAS_TRITON = find_spec("triton") is not None


class TritonPlaceholder:
    def __getattr__(self, name):
        raise ImportError("triton is not installed")


class TritonLanguagePlaceholder(TritonPlaceholder):
    pass
'''

CUSTOM_OPS = '''"""Stand-in for vllm._custom_ops (vLLM's compiled _C extension, not extracted)."""
''' + _NOT_EXTRACTED + '''
selective_scan_fwd = _not_extracted("vllm._custom_ops.selective_scan_fwd")
'''

PLATFORM_UTILS = '''"""Stand-in for vllm.utils.platform_utils: the device name used to pick tuned kernel configs."""
import re
from functools import cache


@cache
def get_device_name_as_file_name(device_id=0):
    from vllm.platforms import current_platform
    return re.sub(r"[\\s/]+", "_", current_platform.get_device_name(device_id))


def num_compute_units(device_id=0):
    from vllm.platforms import current_platform
    return current_platform.num_compute_units(device_id)
'''

GPU_SYNC_DEBUG = '''"""Stand-in for vllm.utils.gpu_sync_debug: the sync checker is off."""
import contextlib


def gpu_sync_allowed(first_only=False):
    return contextlib.nullcontext()
'''

TORCH_UTILS = '''"""Stand-in for vllm.utils.torch_utils: host-to-device copy of a list or tensor."""
import torch


def async_tensor_h2d(data, device=None, dtype=None, out=None):
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype, device="cpu")
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device=device, dtype=dtype, non_blocking=True)
'''

BACKEND_UTILS = '''"""Stand-in for vllm.v1.attention.backends.utils: vLLM's pad and null-block ids; the engine helpers
that the Mamba metadata builder imports are not extracted."""
''' + _NOT_EXTRACTED + '''
PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0

compute_causal_conv1d_metadata = _not_extracted("compute_causal_conv1d_metadata")
mamba_get_block_table_tensor = _not_extracted("mamba_get_block_table_tensor")
split_decodes_and_prefills = _not_extracted("split_decodes_and_prefills")
'''

CONFIG = '''"""Stand-in for vllm.config: type names only (no engine configuration exists here)."""


class VllmConfig:
    pass


def get_current_vllm_config_or_none():
    return None
'''

CONFIG_MAMBA = '''"""Stand-in for vllm.config.mamba: the backend enum with vLLM's values."""
from enum import Enum


class MambaBackendEnum(Enum):
    TRITON = "triton"
    FLASHINFER = "flashinfer"
    CPU = "cpu"
'''

ATTN_BACKEND = '''"""Stand-in for vllm.v1.attention.backend: the base types the Mamba metadata builder derives from."""
from enum import Enum
from typing import Generic, TypeVar

M = TypeVar("M")


class AttentionCGSupport(Enum):
    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class AttentionMetadataBuilder(Generic[M]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device


class CommonAttentionMetadata:
    pass
'''

KV_CACHE_INTERFACE = '''"""Stand-in for vllm.v1.kv_cache_interface: type names only."""


class KVCacheSpec:
    pass


class MambaSpec(KVCacheSpec):
    pass
'''

STUBS = {
    "vllm/envs.py": ENVS,
    "vllm/logger.py": LOGGER,
    "vllm/platforms/__init__.py": PLATFORMS,
    "vllm/triton_utils/importing.py": TRITON_IMPORTING,
    "vllm/_custom_ops.py": CUSTOM_OPS,
    "vllm/utils/platform_utils.py": PLATFORM_UTILS,
    "vllm/utils/gpu_sync_debug.py": GPU_SYNC_DEBUG,
    "vllm/utils/torch_utils.py": TORCH_UTILS,
    "vllm/v1/attention/backends/utils.py": BACKEND_UTILS,
    "vllm/config/__init__.py": CONFIG,
    "vllm/config/mamba.py": CONFIG_MAMBA,
    "vllm/v1/attention/backend.py": ATTN_BACKEND,
    "vllm/v1/kv_cache_interface.py": KV_CACHE_INTERFACE,
}
