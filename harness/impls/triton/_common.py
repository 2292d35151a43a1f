"""Launch helpers shared by our Triton kernels.

* `interpreting()`: True when Triton runs kernels through its interpreter (TRITON_INTERPRET=1; the
  only way to run them on CPU tensors). The interpreter is slow (milliseconds per program and loop
  step) and its bf16/fp16 arithmetic is wrong, so the `triton` Impl only offers fp32/fp64 there.
* `refresh_env()`: re-read the environment variables the launchers consult (TRITON_INTERPRET,
  HARNESS_AOT_NVIDIA). They are read once, when this module is imported, not on every launch (a decode
  launch is bound by the host's time per call); a program that changes them later calls this.
* `device_guard(t)`: a context that makes `t`'s device current (cuda / xpu), a no-op on cpu and where
  it already is.
* `TL_DTYPES` / `tl_dtype`: torch dtype -> triton.language dtype.
* `next_power_of_2`, `cdiv`.
* `autotune_configs(configs)`: a list of `triton.Config` that collapses to its first entry under the
  interpreter (`@triton.autotune` with more than one config fails there).
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch
import triton
import triton.language as tl

from harness.ops._checks import all_apart, alone_spans, call_key, index_checks_on


# The environment as the launchers see it (`refresh_env`): whether Triton interprets its kernels, and
# whether CUDA / CPU tensors take the NVIDIA-only paths (`nvidia_fast`).
_INTERPRET = False
_FAST_CUDA = False
_FAST_CPU = False
_ENV_READS = [0]  # how many times `refresh_env` has run: launch plans made under an earlier reading are stale


def refresh_env() -> None:
    """Read TRITON_INTERPRET and HARNESS_AOT_NVIDIA again. Both are read once, at import; a program that
    sets them afterwards (as `python -m harness.impls.triton.aot` sets HARNESS_AOT_NVIDIA) calls this.
    Triton itself decides whether a kernel is interpreted when its @triton.jit definition runs, so
    TRITON_INTERPRET belongs in the environment before the kernel modules are imported."""
    global _INTERPRET, _FAST_CUDA, _FAST_CPU
    _ENV_READS[0] += 1
    _INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
    _FAST_CUDA = not _INTERPRET and torch.version.hip is None
    _FAST_CPU = _FAST_CUDA and os.environ.get("HARNESS_AOT_NVIDIA") == "1"


refresh_env()


def interpreting() -> bool:
    return _INTERPRET


_NO_GUARD = contextlib.nullcontext()
_CUDA_DEVICES: list = []  # the process's CUDA device count, read at the first CUDA launch


def device_guard(t: torch.Tensor):
    """No switch (a shared no-op context) when `t`'s CUDA device is already the current one: entering
    torch.cuda.device costs microseconds per launch, and decode launches are bound by the host. With one
    visible CUDA device, a CUDA tensor's device is the current one: no query either."""
    if t.is_cuda:
        if not _CUDA_DEVICES:
            _CUDA_DEVICES.append(torch.cuda.device_count())
        if _CUDA_DEVICES[0] == 1 or t.get_device() == torch.cuda.current_device():
            return _NO_GUARD
        return torch.cuda.device(t.device)
    if t.is_xpu:
        return torch.xpu.device(t.device)
    return _NO_GUARD


TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}


TORCH_DTYPES = {t: d for d, t in TL_DTYPES.items()}  # Triton's dtype -> torch's


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


def kernel_modules() -> list:
    """Every module of harness.impls.triton, imported (the kernel modules register their launch-config defaults
    and launch through this module's `launch`)."""
    import importlib
    import pkgutil
    pkg = importlib.import_module("harness.impls.triton")
    return [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def nvidia_fast(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` may use NVIDIA-only PTX (the MUFU approximations below, through inline
    assembly): a CUDA (not ROCm) tensor outside the interpreter. With HARNESS_AOT_NVIDIA=1, CPU tensors count
    too: that is how `python -m harness.impls.triton.aot` compiles those paths for sm_90 on a machine
    without a GPU. The environment is the one `refresh_env` last read."""
    return (_FAST_CUDA and t.is_cuda) or (_FAST_CPU and t.is_cpu)


def has_gpu() -> bool:
    if torch.cuda.is_available():
        return True
    return bool(hasattr(torch, "xpu") and torch.xpu.is_available())


def dummy(t: torch.Tensor) -> torch.Tensor:
    """A placeholder pointer for an absent optional tensor (never read: its HAS_* flag is False)."""
    return t


# Launch configurations as data: configs/<device>/<module>.json, one file per device kind and kernel module,
# an object keyed by shape class ("default" where a module has one set) -> {parameter: value}.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# (module, shape class) -> the defaults written in the module, as `launch_config` received them
DEFAULTS: dict = {}
_VENDOR_WORDS = ("nvidia", "amd", "intel(r)", "intel", "geforce", "tesla", "quadro", "radeon", "data", "center",
                 "gpu", "max")


def device_folder(name: str) -> str:
    """A device's model name -> its folder under configs/ (and reports/baselines/): the first word that is not
    a vendor or product-line word, lower case, e.g. "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100"."""
    words = [w for w in name.lower().replace("-", " ").replace("_", " ").split() if w not in _VENDOR_WORDS]
    word = "".join(c for c in (words[0] if words else "") if c.isalnum())
    return word or "gpu"


def _gpu_model() -> str | None:
    """The model name of the machine's first GPU. The NVIDIA driver's /proc files come first: reading them
    initialises no CUDA context at import time (all GPUs of a host are taken to be alike)."""
    import glob
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as f:
                for line in f:
                    if line.startswith("Model:"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.get_device_name(0)
    return None


def device_config_name() -> str | None:
    """The configs/ folder of this machine: HARNESS_TRITON_DEVICE if set (e.g. "h200"), else from the GPU's
    model name (`device_folder`); None under the interpreter or without a GPU (the modules' defaults hold)."""
    name = os.environ.get("HARNESS_TRITON_DEVICE")
    if name:
        return name
    if interpreting():
        return None
    model = _gpu_model()
    return device_folder(model) if model else None


def read_config_file(path: str, *, override: bool = False) -> dict:
    """A config file's object, checked for shape: {shape class: {parameter: value}} for a device file,
    {module: {shape class: {parameter: value}}} for the HARNESS_TRITON_CONFIG override."""
    import json
    from reference.validate import fail
    what = "HARNESS_TRITON_CONFIG" if override else "launch config file"
    layout = "{module: {shape class: {parameter: value}}}" if override else "{shape class: {parameter: value}}"
    if not os.path.isfile(path):
        fail(f"{what} {path}", "an existing JSON file", "no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{what} {path}", f"a JSON object {layout}", f"unreadable JSON ({e})")
    levels = 2 if override else 1
    bad = None
    if not isinstance(data, dict):
        bad = type(data).__name__
    else:
        for k, v in data.items():
            if not isinstance(v, dict) or (levels == 2 and not all(isinstance(x, dict) for x in v.values())):
                bad = f"{k!r}: {json.dumps(v)[:80]}"
                break
    if bad is not None:
        fail(f"{what} {path}", f"a JSON object {layout}", bad)
    return data


def _merge(cfg: dict, values: dict, where: str) -> None:
    from reference.validate import fail
    for k, v in values.items():
        if k not in cfg:
            fail(f"{where}: {k!r}", f"a launch parameter of the module ({sorted(cfg)})", "an unknown name")
        if isinstance(cfg[k], dict):
            if not isinstance(v, dict):
                fail(f"{where}: {k!r}", "an object of parameters", repr(v))
            cfg[k] = {**cfg[k], **v}
        elif v is not None and not isinstance(v, (bool, int, float, str)):
            fail(f"{where}: {k!r}", "a number, a boolean, a string or null", repr(v))
        else:
            cfg[k] = v


def launch_config(module: str, defaults: dict, shape_class: str = "default") -> dict:
    """A kernel module's launch parameters for one shape class: `defaults` (the values written in the
    module), updated from configs/<device>/<module>.json for this machine's device kind
    (`device_config_name`) where that file has the class, then from the JSON file named by
    HARNESS_TRITON_CONFIG ({module: {shape class: {parameter: value}}}), which wins. Parameters whose
    default is an object (ssd's per-stage tunables) merge one level deep. A file that is not such an object,
    or names a parameter the module does not have, raises ValueError naming the file."""
    import copy
    DEFAULTS[(module, shape_class)] = copy.deepcopy(defaults)
    cfg = copy.deepcopy(defaults)
    device = device_config_name()
    if device:
        path = os.path.join(CONFIG_DIR, device, f"{module}.json")
        if os.path.exists(path):
            data = read_config_file(path)
            if shape_class in data:
                _merge(cfg, data[shape_class], f"{path} [{shape_class}]")
    path = os.environ.get("HARNESS_TRITON_CONFIG")
    if path:
        data = read_config_file(path, override=True)
        if shape_class in data.get(module, {}):
            _merge(cfg, data[module][shape_class], f"HARNESS_TRITON_CONFIG {path} {module} [{shape_class}]")
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


def unit_stride(*ids):
    """The index tensors (offsets, slot ids, flags, slot tables) as the kernels address them: element i of a
    1-dim one at base + i. A strided view (an engine may slice one column out of a slot table, or every other
    row out of padded metadata) is copied on the device (no synchronisation: capturable); a contiguous one, what
    engines pass, is returned as it is."""
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in ids)


# ---- launching ---------------------------------------------------------------------------------------------
# `launch(kernel, grid, *args, **kw)` is `kernel[grid](*args, **kw)` with fewer host steps once a call of the same
# specialisation has run. Triton's `JITFunction.run` binds the arguments through a generated function, builds a
# string cache key, reads its knobs, asks for launch metadata and checks hooks and globals on every call: tens of
# microseconds of Python per launch, what an eager decode step is made of. Here the first call of each key goes
# through `kernel[grid]` (which compiles or finds the kernel, launches it and returns it); later calls with the
# same key hand the arguments to that compiled kernel's launcher directly. The key is finer than Triton's
# specialisation, never coarser: every positional argument contributes its type; a tensor its dtype and whether
# its address is 16-byte aligned (all Triton specialises a pointer on), any other argument its value; constexprs
# and launch options come by keyword and contribute their values and their types (True and 1 are equal keys of a
# dict but not one constexpr to Triton; suites/ops/test_ops_triton_launch.py checks the key against Triton's
# binder).
# A call whose key is new (a prefill of a new token count, a launch plan's first call) but whose specialisation
# has run before -- Triton's binder for the device, the function `JITFunction.run` binds with, gives the same
# specialisation and options (`class_key`) -- takes that compiled kernel too: the binder's microseconds instead of
# the whole of `JITFunction.run`.
# Any case the shortcut does not cover runs `kernel[grid]`: the interpreter, a non-CUDA backend, launch hooks
# (profilers) installed, a callable grid, an autotuned, hooked or annotated kernel, a non-constexpr parameter
# given by keyword, an unhashable argument. HARNESS_TRITON_LAUNCH=jit turns the shortcut off.
try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # a Triton without these: every launch takes kernel[grid]
    _JITFunction = None

_SHORTCUT = os.environ.get("HARNESS_TRITON_LAUNCH", "fast") != "jit" and _JITFunction is not None
_NO_PLAN = object()
_MAX_KEYS = 512  # per kernel; beyond it the table starts over (a prefill's token counts are values of the key)
_TENSOR_AT: dict = {}  # argument types of a call -> the positions of its tensors (`launch_key`)


@contextlib.contextmanager
def jit_launches():
    """Inside, every `launch` takes `kernel[grid]` (Triton's own per-call path): for timing the shortcut against
    it in one run (`harness bench throughput --compare-launch`)."""
    global _SHORTCUT
    before, _SHORTCUT = _SHORTCUT, False
    try:
        yield
    finally:
        _SHORTCUT = before


class _Plan:
    """What `launch` needs of one kernel, read once: its parameters in order, the names of its non-constexpr
    ones, and per key the compiled kernel with the values of the parameters after the positional ones."""
    __slots__ = ("params", "runtime_names", "compiled", "backends", "classes")

    def __init__(self, kernel):
        self.params = list(kernel.params)
        self.runtime_names = frozenset(p.name for p in self.params if not p.is_constexpr)
        self.compiled: dict = {}
        self.backends: dict = {}
        self.classes: dict = {}  # (device, `class_key`) -> the compiled kernel


def _plan_of(kernel):
    plan = kernel.__dict__.get("_harness_launch_plan")
    if plan is None:
        ok = (_JITFunction is not None and type(kernel) is _JITFunction and not kernel.pre_run_hooks
              and not any(p.annotation_type for p in kernel.params if not p.is_constexpr))
        plan = _Plan(kernel) if ok else _NO_PLAN
        kernel.__dict__["_harness_launch_plan"] = plan
    return plan


def launch_values(plan: _Plan, args: tuple, kw: dict) -> list | None:
    """Every parameter's value in the kernel's order (positional, then by name, then the default; keywords that
    name no parameter are launch options, not values); None where a parameter has no value (Triton raises the
    error: the caller takes kernel[grid])."""
    vals = list(args)
    for p in plan.params[len(args):]:
        if p.name in kw:
            vals.append(kw[p.name])
        elif p.has_default:
            vals.append(p.default)
        else:
            return None
    return vals


def class_key(binder, args: tuple, kw: dict):
    """The specialisation and options Triton's `binder` (a kernel's `create_function_from_signature`) gives a call,
    as strings, as `JITFunction.run` makes its compiled kernels' keys of them (a tuple of the specialisation would
    hold constexprs True and 1, or 0.0 and -0.0, as one key); None where the binder raises (the caller then takes
    `kernel[grid]`, which raises Triton's own error)."""
    try:
        _, spec, options = binder(*args, **kw)
    except Exception:  # noqa: BLE001 - any binding failure
        return None
    return repr(spec), str(options)


def _class_of(kernel, device, args: tuple, kw: dict):
    """(device, `class_key`) of a call with the binder `JITFunction.run` uses on `device` (the last of the
    kernel's cache entry for it); None before the kernel's first call there, where this Triton keeps another
    layout, or where `class_key` tells nothing."""
    caches = kernel.device_caches.get(device)
    if not (isinstance(caches, tuple) and len(caches) == 5 and callable(caches[-1])):
        return None
    key = class_key(caches[-1], args, kw)
    return None if key is None else (device, key)


def _bounded(table: dict) -> dict:
    """`table`, emptied first once it holds `_MAX_KEYS` entries."""
    if len(table) >= _MAX_KEYS:
        table.clear()
    return table


def _tensor_positions(types: tuple) -> tuple:
    """The positions of the tensors among arguments of these types (kept per tuple of types)."""
    at = _TENSOR_AT.get(types)
    if at is None:
        at = _bounded(_TENSOR_AT)[types] = tuple(i for i, t in enumerate(types) if issubclass(t, torch.Tensor))
    return at


def launch_key(args: tuple, kw: dict) -> tuple:
    """A call's key (see the section's comment): equal keys have equal Triton specialisations. The positions of
    the tensors among the arguments are looked up by the arguments' types (`isinstance(a, torch.Tensor)` on
    every argument cost more than the rest of the key: ~0.1 us each, and a kernel takes ~50)."""
    types = tuple(map(type, args))
    at = _tensor_positions(types)
    vals = list(args)
    for i in at:
        a = args[i]
        vals[i] = (a.dtype, a.data_ptr() & 15 == 0)
    return types, tuple(vals), tuple(kw.items()), tuple(map(type, kw.values()))


def hooked(runtime) -> bool:
    """Whether launch hooks are installed in Triton's runtime knobs: a hook is None where none is set, or (newer
    Tritons) a chain that is never None and holds its hooks in `calls`."""
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook  # read on every launch: no generator
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))


class Fixed:
    """One launch of an op's launch plan (`HostPlans`): the kernel, its grid and keywords, and a guarantee from the
    op that every call made through it (`launch_fixed`) passes the same argument types, tensors of the same dtypes
    at the same positions, and the same values but for the tensors' addresses and float arguments (which Triton
    does not specialise on). Its key in the launch shortcut's table is then the object itself and the 16-byte
    alignment of each tensor (`fixed_key`), not `launch_key` over every argument."""
    __slots__ = ("kernel", "grid", "kw", "tensor_at")

    def __init__(self, kernel, grid, **kw):
        self.kernel, self.grid, self.kw = kernel, tuple(grid), kw
        self.tensor_at = None  # the tensors' positions among the arguments, from the first call


def fixed_key(fixed: Fixed, args: tuple) -> tuple:
    """`fixed`'s part of a call's key: the object (held by the table, so no other object takes its id while the
    entry lives) and which tensor arguments are 16-byte aligned, as the bits of an int."""
    at = fixed.tensor_at
    if at is None:
        at = fixed.tensor_at = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    bits = 1
    for i in at:
        bits = bits + bits + (args[i].data_ptr() & 15 == 0)
    return fixed, bits


def launch(kernel, grid, *args, **kw):
    """`kernel[grid](*args, **kw)` (see the section's comment); returns what that returns."""
    return _launch(kernel, grid, args, kw, None)


def launch_fixed(fixed: Fixed, *args):
    """`launch(fixed.kernel, fixed.grid, *args, **fixed.kw)`, keyed by `fixed_key`."""
    return _launch(fixed.kernel, fixed.grid, args, fixed.kw, fixed)


def _launch(kernel, grid, args: tuple, kw: dict, fixed: Fixed | None):
    if not _SHORTCUT or _INTERPRET or callable(grid) or hooked(_knobs.runtime):
        return kernel[grid](*args, **kw)
    plan = _plan_of(kernel)
    if plan is _NO_PLAN or not plan.runtime_names.isdisjoint(kw):
        return kernel[grid](*args, **kw)
    device = _driver.active.get_current_device()
    cuda = plan.backends.get(device)
    if cuda is False:  # another backend on this device
        return kernel[grid](*args, **kw)
    try:
        key = (device, launch_key(args, kw) if fixed is None else fixed_key(fixed, args))
        hit = plan.compiled.get(key)
    except TypeError:  # an unhashable argument
        return kernel[grid](*args, **kw)
    if hit is None:
        cls = _class_of(kernel, device, args, kw) if cuda else None
        compiled = None if cls is None else plan.classes.get(cls)
        fresh = compiled is None
        if fresh:  # a specialisation not run before (or no class to tell): Triton's own path, which launches
            compiled = kernel[grid](*args, **kw)
            if cuda is None:  # the device's first call: its backend is known now
                plan.backends[device] = cuda = kernel.device_caches[device][2].backend == "cuda"
            if not cuda or compiled is None:
                return compiled
            cls = cls or _class_of(kernel, device, args, kw)
            if cls is not None:
                _bounded(plan.classes)[cls] = compiled
        vals = launch_values(plan, args, kw)
        if vals is None:  # launched already, or left to Triton's path (which raises)
            return compiled if fresh else kernel[grid](*args, **kw)
        hit = _bounded(plan.compiled)[key] = (compiled, tuple(vals[len(args):]))
        if fresh:
            return compiled
    compiled, rest = hit
    g = tuple(grid)
    compiled.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, _driver.active.get_current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *rest)
    return compiled


# ---- launch plans ------------------------------------------------------------------------------------------
# An op's host work before its launches -- the contract's validation, launch parameters, strides, grids -- is a
# function of its arguments' metadata and option values (`harness.ops._checks.call_key`), of its module's launch
# configuration and of the environment `refresh_env` read. `HostPlans` keeps that work per call signature: a
# repeated call looks its plan up, compares the addresses of `out=` (and of an argument written whole in place)
# with the other arguments' (the contract's aliasing rules, the only checks that read more than metadata:
# `harness.ops._checks.all_apart`) and launches. The validator runs in full on a signature's first call, whenever
# the index checks are on (they read the slot ids and offsets), and where those byte ranges meet (it then decides
# element by element, or raises). 0.0 and -0.0 are one key: a plan holds a value derived from a float argument
# only where equal values are equal bits (a scale, > 0 by the contract) or the argument's repr is a key too
# (ssd's dt_limit); ops read the others from the call. A plan holds no value read from a tensor.

class HostPlans:
    """The launch plans of one op by call signature: `build(validate(*call), call, *options)` makes one (see
    `plan`); `config`: the module's launch configuration (a plan made under other values is stale: it is
    compared on every lookup, as tests and sweeps change it in place); `alone`: the positions in the call of
    the arguments besides `out=` whose memory must be their own (one written whole in place); `same`: the
    position of the argument `out=` may be itself (the spec's `in_place`)."""
    __slots__ = ("validate", "build", "config", "alone", "same", "plans", "_copy")

    def __init__(self, validate, build, config: dict | None = None, alone: tuple = (), same: int | None = None):
        self.validate, self.build, self.config, self.alone, self.same = validate, build, config, alone, same
        self.plans: dict = {}
        self._copy = None  # the latest `_snapshot` of config, shared by the plans made while config equals it

    def plan(self, call: tuple, options: tuple = ()):
        """The plan of `call` (the op's arguments in its validator's order, `out=` last) with `options` (the op's
        arguments the validator does not take, hashable values): cached, or built from the validator's answer
        (the validator raising on bad input) and kept. The validator runs first wherever the cache cannot answer
        for the contract (see the section's comment)."""
        validate = self.validate
        try:
            key = call_key(call) + call_key(options) if options else call_key(call)
            hit = self.plans.get(key)
        except TypeError:  # an unhashable argument: validated and planned on every call
            return self.build(validate(*call), call, *options)
        cfg = self.config
        if hit is not None and hit[0] == _ENV_READS[0] and (cfg is None or hit[1] == cfg):
            if index_checks_on() or not all_apart(call, hit[2]):
                validate(*call)
            return hit[3]
        made = self.build(validate(*call), call, *options)
        spans = alone_spans(call, (len(call) - 1,) + self.alone, self.same)
        if cfg is not None and not (self._copy is not None and self._copy == cfg):
            self._copy = _snapshot(cfg)  # never changed in place: plans made under equal values share it
        _bounded(self.plans)[key] = (_ENV_READS[0], None if cfg is None else self._copy, spans, made)
        return made


def _snapshot(cfg):
    """A copy of a launch configuration that later in-place changes of `cfg` leave as it is: its dicts, lists and
    tuples copied level by level (what the configurations are made of, with scalars); `copy.deepcopy` otherwise."""
    kind = type(cfg)
    if kind is dict:
        return {k: _snapshot(v) for k, v in cfg.items()}
    if kind is list or kind is tuple:
        return kind(_snapshot(v) for v in cfg)
    if cfg is None or kind in (bool, int, float, str):
        return cfg
    return copy.deepcopy(cfg)


class Staged:
    """The launches of a multi-stage op as one plan's data: scratch buffers allocated anew on every call (`buffer`,
    `filled`, `view`; what the build reads of one is a meta-device stand-in's metadata: a new tensor's), and per
    launch its `Fixed`, its arguments with the positions of its tensors and their names (`add`, `add_call`).
    `run` takes the call's tensors by name."""
    __slots__ = ("scratch", "launches", "names")

    def __init__(self):
        self.scratch: list = []
        self.launches: list = []
        self.names: dict = {}  # while building: id(stand-in) -> (name, stand-in), for `add_call`

    def _named(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.names[id(t)] = (name, t)
        return t

    def stand_in(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The call's tensor `t` as `add_call` knows it, as `name`: `t` itself, or where `t` already stands for
        another name (two arguments that are one tensor in this call) a new view of it, so that each name keeps
        an object of its own."""
        if id(t) in self.names:
            t = t.as_strided(t.shape, t.stride(), t.storage_offset())
        return self._named(name, t)

    def buffer(self, name: str, shape: tuple, dtype, device) -> torch.Tensor:
        """Scratch `name`, a new (shape, dtype) tensor on `device` per call; returns its meta stand-in."""
        self.scratch.append((name, torch.empty, tuple(shape), dict(dtype=dtype, device=device)))
        return self._named(name, torch.empty(shape, dtype=dtype, device="meta"))

    def view(self, name: str, of: str, base: torch.Tensor, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
        """Tensor `name`, per call the view (shape, stride, storage offset) of the call's tensor `of` (whose stand-in
        is `base`); returns its stand-in."""
        self.scratch.append((name, _as_strided, of, (tuple(shape), tuple(stride), offset)))
        return self._named(name, base.as_strided(shape, stride, offset))

    def adopt(self, names: tuple, tensors: tuple, device) -> tuple:
        """Scratch named `names`: the meta-device tensors `tensors` a stage's allocating function made (whole new
        tensors, or views of one it allocated: `_base`), allocated on `device` alike per call; returns their
        stand-ins."""
        out, bases = [], {}
        for name, t in zip(names, tensors):
            base = t._base
            if base is None:
                out.append(self.buffer(name, t.shape, t.dtype, device))
                continue
            if id(base) not in bases:
                bases[id(base)] = (f"{name}:base", self.buffer(f"{name}:base", base.shape, base.dtype, device))
            bname, stand = bases[id(base)]
            out.append(self.view(name, bname, stand, t.shape, t.stride(), t.storage_offset()))
        return tuple(out)

    def filled(self, name: str, value: float, dtype, device) -> None:
        """Scratch `name`, a new one-element tensor holding `value` per call (filled on the device)."""
        self.scratch.append((name, torch.full, ((1,), value), dict(dtype=dtype, device=device)))

    def alias(self, name: str, of: str) -> None:
        """Tensor argument `name` is the call's tensor `of` (a stand-in for an argument a kernel does not read)."""
        self.scratch.append((name, None, of, None))

    def add(self, kernel, grid, tensors: tuple, values: tuple, **kw) -> None:
        """A launch whose arguments are the tensors named `tensors`, then `values`."""
        refs = tuple(enumerate(tensors))
        n = len(tensors)
        fixed = Fixed(kernel, grid, **kw)
        # what `fixed_key` would find on the first call: the named tensors, and any tensor among `values`
        fixed.tensor_at = tuple(range(n)) + tuple(n + i for i in _tensor_positions(tuple(map(type, values))))
        self.launches.append((fixed, refs, (None,) * n + tuple(values)))

    def add_call(self, kernel, grid, args: tuple, **kw) -> None:
        """A launch of `args` as a stage function builds them: every tensor among them a stand-in of this plan
        (`stand_in`, `buffer`, `view`), known by name."""
        names, refs, template = self.names, [], list(args)
        at = _tensor_positions(tuple(map(type, args)))
        for i in at:
            a = args[i]
            name, t = names.get(id(a), (None, None))
            if t is not a:
                raise ValueError(f"Staged.add_call: argument {i} of {kernel} is a tensor the plan does not know")
            refs.append((i, name))
            template[i] = None
        fixed = Fixed(kernel, grid, **kw)
        fixed.tensor_at = at  # what `fixed_key` would find on the first call
        self.launches.append((fixed, tuple(refs), tuple(template)))

    def built(self) -> "Staged":
        """The plan with its stand-ins released (they may view the call's tensors)."""
        self.names = {}
        return self

    def run(self, tensors: dict) -> None:
        """Allocate the scratch into `tensors` (name -> tensor: the call's) and make the launches in order."""
        for name, make, args, kw in self.scratch:
            if make is None:
                tensors[name] = tensors[args]
            elif make is torch.empty:
                tensors[name] = torch.empty(args, **kw)
            elif make is _as_strided:
                tensors[name] = tensors[args].as_strided(*kw)
            else:
                tensors[name] = make(*args, **kw)
        for fixed, refs, template in self.launches:
            args = list(template)
            for i, name in refs:
                args[i] = tensors[name]
            launch_fixed(fixed, *args)


_as_strided = torch.Tensor.as_strided
