"""Launch helpers shared by our Triton kernels.

* `interpreting()`: True when Triton runs kernels through its interpreter (TRITON_INTERPRET=1; the
  only way to run them on CPU tensors). The interpreter is slow (milliseconds per program and loop
  step) and its bf16/fp16 arithmetic is wrong, so the `triton` Impl only offers fp32/fp64 there.
* `device_guard(t)`: a context that makes `t`'s device current (cuda / xpu), a no-op on cpu.
* `TL_DTYPES` / `tl_dtype`: torch dtype -> triton.language dtype.
* `next_power_of_2`, `cdiv`.
* `autotune_configs(configs)`: a list of `triton.Config` that collapses to its first entry under the
  interpreter (`@triton.autotune` with more than one config fails there).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_guard(t: torch.Tensor):
    kind = t.device.type
    if kind == "cuda":
        return torch.cuda.device(t.device)
    if kind == "xpu" and hasattr(torch, "xpu"):
        return torch.xpu.device(t.device)
    return contextlib.nullcontext()


TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}


def tl_dtype(dtype: torch.dtype):
    if dtype not in TL_DTYPES:
        raise ValueError(f"dtype: expected one of {list(TL_DTYPES)}, got {dtype}")
    return TL_DTYPES[dtype]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def autotune_configs(configs: list) -> list:
    """`configs` on a GPU; only the first one under the interpreter."""
    return configs[:1] if interpreting() else list(configs)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def nvidia_fast(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` may use NVIDIA-only PTX (the MUFU approximations below, through inline
    assembly): a CUDA (not ROCm) tensor outside the interpreter. With HARNESS_AOT_NVIDIA=1, CPU tensors count
    too: that is how `python -m harness.impls.triton.aot` compiles those paths for sm_90 on a machine
    without a GPU."""
    if interpreting() or torch.version.hip is not None:
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and os.environ.get("HARNESS_AOT_NVIDIA") == "1")


def has_gpu() -> bool:
    if torch.cuda.is_available():
        return True
    return bool(hasattr(torch, "xpu") and torch.xpu.is_available())


def dummy(t: torch.Tensor) -> torch.Tensor:
    """A placeholder pointer for an absent optional tensor (never read: its HAS_* flag is False)."""
    return t


def launch_config(module: str, defaults: dict) -> dict:
    """A kernel module's launch parameters: `defaults`, updated from the JSON file named by
    HARNESS_TRITON_CONFIG (an object keyed by module name, e.g. {"conv1d": {"bt": 64}}), if set.
    scripts/gpu_ops_bench.py --sweep writes such a file with the best configs it measured."""
    import json
    cfg = dict(defaults)
    path = os.environ.get("HARNESS_TRITON_CONFIG")
    if path and os.path.exists(path):
        with open(path) as f:
            cfg.update(json.load(f).get(module, {}))
    return cfg


def max_offset(*tensors) -> int:
    """The largest element offset any of `tensors` (None skipped; an int stands for a contiguous buffer of
    that many elements) can reach from its base pointer: sum((size - 1) * |stride|). Kernels pick int32
    index math when every tensor they address stays below 2**31 elements (with a margin), int64
    otherwise (bug class 12)."""
    best = 0
    for t in tensors:
        if isinstance(t, int):
            best = max(best, t)
        elif t is not None and t.numel() > 0:
            best = max(best, sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())))
    return best


def index_type(*tensors, margin: int = 1 << 20):
    """tl.int32 when every offset of `tensors` fits in int32 with `margin` to spare, else tl.int64."""
    return tl.int64 if max_offset(*tensors) + margin >= 2 ** 31 else tl.int32


@triton.jit
def _mufu(x, ASM: tl.constexpr):
    """One fp32 MUFU instruction (ASM: its PTX, operands $0 = out, $1 = in) on every element."""
    return tl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def exp2_fast(x, FAST: tl.constexpr):
    """2**x; on CUDA (FAST) the single MUFU instruction with flush-to-zero (no denormal fix-up code),
    elsewhere (interpreter, XPU) tl.exp2. fp32 only when FAST."""
    if FAST:
        return _mufu(x, "ex2.approx.ftz.f32 $0, $1;")
    else:
        return tl.exp2(x)


@triton.jit
def log2_fast(x, FAST: tl.constexpr):
    """log2(x); on CUDA (FAST) the single MUFU instruction (lg2.approx.ftz), elsewhere tl.log2."""
    if FAST:
        return _mufu(x, "lg2.approx.ftz.f32 $0, $1;")
    else:
        return tl.log2(x)


@triton.jit
def rcp_fast(x, FAST: tl.constexpr):
    """1 / x; on CUDA (FAST) the single MUFU instruction (rcp.approx.ftz), elsewhere a division."""
    if FAST:
        return _mufu(x, "rcp.approx.ftz.f32 $0, $1;")
    else:
        return 1.0 / x


@triton.jit
def softplus_fast(x, FAST: tl.constexpr):
    """log(1 + exp(x)) = max(x, 0) + ln2 * log2(1 + 2**(-|x| log2 e)), overflow-free; MUFU-only on CUDA."""
    return tl.maximum(x, 0.0) + 0.6931471805599453 * log2_fast(1.0 + exp2_fast(-tl.abs(x) * 1.4426950408889634,
                                                                                  FAST), FAST)


@triton.jit
def silu_fast(x, FAST: tl.constexpr):
    """x * sigmoid(x) = x / (1 + 2**(-x log2 e)); MUFU-only on CUDA."""
    return x * rcp_fast(1.0 + exp2_fast(-x * 1.4426950408889634, FAST), FAST)
