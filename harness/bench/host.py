"""`harness bench host`: the host time of each op's contract validator, and of our Triton op's whole Python path,
per call, on the CPU.

An op's eager call pays its validator (`SPEC.validate`) before any kernel launches; at decode sizes that
host time is a large part of the call. This times `SPEC.validate(...)` alone on CPU tensors, for every op
at its "contract" shapes (float32) and its "gpu" shapes (bfloat16; the float tensors are allocated and
left unwritten: the validator reads only their metadata, the slot ids and offsets are real), twice: with
the index range checks (which read the slot ids and offsets on the host) and inside `no_index_checks()`.
Then the `triton` implementation's op on the same input set inside `no_index_checks()` with every kernel
launch replaced by what the launch shortcut computes before it hands a call to the compiled kernel (its key:
`_common.launch_key`, or `_common.fixed_key` for a launch of an op's launch plan): the validator or the plan's
lookup, the launch parameters, scratch allocations and the key, without the kernel launcher and the driver (a
GPU machine's figure is `harness bench`'s `launch_ms`). It is called with `out=` given where the op takes one
(on the CPU a large output's allocation would dominate; the GPU's caching allocator returns one in
microseconds). The figures are p50 microseconds per call through
`harness.bench.timing.measure`. With the "gpu" shapes, also each prefill op's path at a token count not seen
before, call after call, against a repeat of the same call (`time_new_signatures`: a launch plan built, or
found). With `--engine`, one eager engine decode step of each named family's small model
(`time_engine_decode`) likewise, per layer: the mixers' glue, projections and norms besides the ops.

    harness bench host                       # every op
    harness bench host --op gated_delta_rule_update,causal_conv1d_update --min-time 0.5
    harness bench host --shapes gpu --engine all --json reports/baselines/cpu/host.json
"""
from __future__ import annotations

import contextlib
import inspect
import sys

# the dtypes the shapes are validated in (torch is imported only when timing: `harness bench --help` loads
# this module)
GPU_DTYPE = "bfloat16"
CONTRACT_DTYPE = "float32"


def add_args(p) -> None:
    p.add_argument("--op", action="append", default=None, help="op(s) to time (comma-separated; default all)")
    p.add_argument("--shapes", default="contract,gpu",
                   help="shape lists of the specs to time (comma-separated; default contract,gpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default 1)")
    p.add_argument("--engine", default=None, metavar="FAMILIES",
                   help="also time an eager engine decode step's host path per layer for these families "
                        "(comma-separated, or 'all'; `time_engine_decode`)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the rows and the environment (versions, CPU) as one JSON document")


def _materialize(spec, shape: dict, dtype) -> dict:
    """One valid input set for `shape` on the CPU without filling the float tensors: shapes from the spec's
    builder on the meta device; float tensors `torch.empty` (same shape, dtype, strides), the slot ids,
    offsets and flags rebuilt with real values (slots 1..n of the pool, equal-length sequences, all with an
    initial state, one accepted token per speculative row)."""
    import torch

    from harness.ops import _inputs as I
    meta = spec.inputs(shape, dtype, "meta", torch.Generator())
    out = {}
    for name, t in meta.items():
        if not isinstance(t, torch.Tensor):
            out[name] = t
        elif t.is_floating_point():
            out[name] = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype)
        elif name == "query_start_loc":  # over the shape's packed tokens
            out[name] = I.seqs(spec.tokens(shape), t.numel() - 1, "cpu").to(t.dtype)
        elif t.dtype == torch.bool:
            out[name] = torch.ones(tuple(t.shape), dtype=torch.bool)
        elif name == "num_accepted_tokens":  # every row starts from its first position's slot
            out[name] = torch.ones(tuple(t.shape), dtype=t.dtype)
        else:  # slot ids
            out[name] = torch.arange(1, t.numel() + 1, dtype=t.dtype).reshape(t.shape)
    return out


def time_validators(ops=None, shape_kinds=("contract", "gpu"), budget=None, triton_path: bool = False) -> list[dict]:
    """Rows {op, shapes, shape, dtype, us_p50, us_p50_no_index}: the validator's p50 per call; with `triton_path`
    also us_p50_triton, the `triton` op's path on the same input set (`_time_triton_path`; None for an op it
    lacks)."""
    import torch

    from harness.bench.timing import Budget, measure
    from harness.impls.registry import get
    from harness.ops import SPECS, no_index_checks
    budget = budget or Budget(min_reps=200, min_time=0.2, max_time=5.0, warmup=20)
    impl = get("triton") if triton_path else None
    rows = []
    for name, spec in SPECS.items():
        if ops and name not in ops:
            continue
        for kind in shape_kinds:
            dtype = getattr(torch, GPU_DTYPE if kind == "gpu" else CONTRACT_DTYPE)
            for shape in spec.shapes.get(kind, ()):
                pos, given = spec.split(_materialize(spec, shape, dtype))
                validate = spec.validate
                takes = inspect.signature(validate).parameters  # the options the validator checks
                opt = {k: v for k, v in given.items() if k in takes}

                def call(validate=validate, pos=pos, opt=opt):
                    return validate(*pos, **opt)

                call()  # a valid input set: raises here otherwise
                on = measure(call, "cpu", budget).eager.ms_p50
                with no_index_checks():
                    off = measure(call, "cpu", budget).eager.ms_p50
                row = dict(op=name, shapes=kind, shape=shape, dtype=str(dtype).replace("torch.", ""),
                           us_p50=on * 1e3, us_p50_no_index=off * 1e3)
                if impl is not None:
                    row["us_p50_triton"] = _time_triton_path(impl.ops.get(name), pos, given, budget)
                rows.append(row)
    return rows


@contextlib.contextmanager
def launches_keyed_only():
    """Inside, every kernel launch of our Triton modules computes the launch shortcut's key (`launch_key`, or
    `fixed_key` for a launch plan's `launch_fixed`) and returns None (no kernel runs): the host path of an op up
    to the compiled kernel's launcher."""
    from harness.impls.triton import _common

    def keyed(kernel, grid, *args, **kw):
        _common.launch_key(args, kw)

    def keyed_fixed(fixed, *args):
        _common.fixed_key(fixed, args)

    swaps = ((_common.launch, keyed), (_common.launch_fixed, keyed_fixed))
    swapped = []
    for mod in _common.kernel_modules():
        for name, (real, fake) in zip(("launch", "launch_fixed"), swaps):
            # _common's own launch_fixed too: its `Staged` plans launch through it
            if getattr(mod, name, None) is real and (mod is not _common or name == "launch_fixed"):
                swapped.append((mod, name, real))
                setattr(mod, name, fake)
    try:
        yield
    finally:
        for mod, name, real in swapped:
            setattr(mod, name, real)


def _time_triton_path(fn, pos, opt, budget) -> float | None:
    """p50 microseconds of op `fn` (None: none) per call inside `no_index_checks()` with the launches keyed only
    (`launches_keyed_only`), `out=` given where the op takes one."""
    if fn is None:
        return None
    from harness.bench.timing import measure
    from harness.ops import no_index_checks
    with launches_keyed_only(), no_index_checks():
        if "out" in inspect.signature(fn).parameters and opt.get("out") is None:
            first = fn(*pos, **opt)
            opt = {**opt, "out": first[0] if isinstance(first, tuple) else first}
        return measure(lambda: fn(*pos, **opt), "cpu", budget).eager.ms_p50 * 1e3


def time_new_signatures(ops=None, count: int = 40, first_tokens: int = 512, step: int = 16) -> list[dict]:
    """Rows {op, shape, dtype, count, us_p50_new, us_p50_repeat}: our Triton op's Python path (launches keyed only,
    inside `no_index_checks()`, the output allocated by the op) per call of a signature not seen before — a
    prefill of a new token count, `count` of them (T = first_tokens, first_tokens + step, ...; the other sizes
    the op's first "gpu" shape, bfloat16) — and of the same call once more (its launch plan found): p50
    microseconds of each. The ops with a token count T in their "gpu" shapes (default all of them)."""
    import statistics
    import time

    import torch

    from harness.impls.registry import get
    from harness.ops import SPECS, no_index_checks
    impl = get("triton")
    rows = []
    for name, spec in SPECS.items():
        shapes = spec.shapes.get("gpu", ())
        fn = impl.ops.get(name)
        if (ops and name not in ops) or fn is None or not shapes or "T" not in shapes[0]:
            continue
        new, again = [], []
        with launches_keyed_only(), no_index_checks():
            for i in range(count + 1):  # the first call compiles nothing but warms the op's module
                shape = {**shapes[0], "T": first_tokens + step * i}
                pos, given = spec.split(_materialize(spec, shape, torch.bfloat16))
                t0 = time.perf_counter()
                fn(*pos, **given)
                t1 = time.perf_counter()
                fn(*pos, **given)
                t2 = time.perf_counter()
                if i:
                    new.append((t1 - t0) * 1e6)
                    again.append((t2 - t1) * 1e6)
        rows.append(dict(op=name, shape={k: v for k, v in shapes[0].items() if k != "T"}, dtype="bfloat16",
                         count=count, tokens=[first_tokens + step, first_tokens + step * count],
                         us_p50_new=statistics.median(new), us_p50_repeat=statistics.median(again)))
    return rows


def format_new_signature_rows(rows) -> str:
    lines = [f"{'op':28s} {'calls':>5s} {'us/new T':>9s} {'us/repeat':>9s}  shape"]
    lines += [f"{r['op']:28s} {r['count']:5d} {r['us_p50_new']:9.1f} {r['us_p50_repeat']:9.1f}  "
              f"T={r['tokens'][0]}..{r['tokens'][1]}," + ",".join(f"{k}={v}" for k, v in r["shape"].items())
              for r in rows]
    return "\n".join(lines)


# the engine decode step's model: every family's sizes small (heads, head and state widths), so that the
# projections' arithmetic on the CPU stays a few microseconds; an op's host path does not depend on them
SMALL_FIELDS = dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, num_heads=4, kda_head_dim=16,
                    d_state=16, dt_rank=16, head_dim=16, n_groups=2)


def time_engine_decode(family_names=None, layers: int = 4, batch: int = 64, d_model: int = 64,
                       budget=None, dtype: str = CONTRACT_DTYPE) -> list[dict]:
    """Rows {family, layers, batch, d_model, us_p50_step, us_p50_layer}: the host path of one eager engine decode
    step (`EngineRunner.forward` of `batch` one-token requests, inside `no_index_checks()` as the engine runs
    its ops) with the `triton` implementation's kernel launches keyed only (`launches_keyed_only`): the mixers'
    glue, projections, norms and our ops' Python paths, per step and per layer, on the CPU, of a model of
    `SMALL_FIELDS` sizes in float32 (bf16 matrix products are slow on most CPUs)."""
    import torch

    from harness.bench.throughput import decode_runner, device_params, model_config
    from harness.bench.timing import Budget, measure
    from harness.impls.registry import get
    from harness.ops import no_index_checks
    from reference import families
    budget = budget or Budget(min_reps=50, min_time=0.5, max_time=5.0, warmup=5)
    dtype = getattr(torch, dtype)
    rows = []
    for name in family_names or families.names():
        cfg = model_config(name, layers, d_model, vocab=256, **SMALL_FIELDS)
        runner, md = decode_runner(cfg, device_params(cfg, "cpu", dtype), get("triton"), "cpu", dtype, batch, 8)
        tokens = torch.zeros(batch, dtype=torch.long)
        with torch.inference_mode(), no_index_checks(), launches_keyed_only():
            us = measure(lambda: runner.forward(tokens, md), "cpu", budget).eager.ms_p50 * 1e3
        rows.append(dict(family=name, layers=layers, batch=batch, d_model=d_model,
                         dtype=str(dtype).replace("torch.", ""), us_p50_step=us, us_p50_layer=us / layers))
    return rows


def format_engine_rows(rows) -> str:
    lines = [f"{'family':12s} {'layers':>6s} {'batch':>5s} {'d_model':>7s} {'us/step':>9s} {'us/layer':>9s}"]
    lines += [f"{r['family']:12s} {r['layers']:6d} {r['batch']:5d} {r['d_model']:7d} {r['us_p50_step']:9.1f} "
              f"{r['us_p50_layer']:9.1f}" for r in rows]
    return "\n".join(lines)


def format_rows(rows) -> str:
    lines = [f"{'op':28s} {'shapes':8s} {'dtype':9s} {'us/validate':>11s} {'no index':>9s} {'triton path':>11s}  "
             f"shape"]
    for r in rows:
        path = r.get("us_p50_triton")
        shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())
        lines.append(f"{r['op']:28s} {r['shapes']:8s} {r['dtype']:9s} {r['us_p50']:11.2f} "
                     f"{r['us_p50_no_index']:9.2f} {'-' if path is None else f'{path:.2f}':>11s}  {shape}")
    return "\n".join(lines)


def run_cli(args) -> int:
    from harness.bench.registry import check_names, split_names
    from harness.ops import OP_NAMES
    ops = check_names("--op", split_names(args.op), list(OP_NAMES))
    kinds = tuple(split_names([args.shapes]))
    for k in kinds:
        if k not in ("contract", "gpu", "cpu"):
            print(f"harness bench host: --shapes: expected names among contract, gpu, cpu, got {k!r}",
                  file=sys.stderr)
            return 2
    import torch
    torch.set_num_threads(args.threads or 1)
    from harness.bench.cli import budget_from
    budget = budget_from(args, "cpu") if any(getattr(args, a, None) is not None
                                             for a in ("reps", "min_time", "max_time", "warmup")) else None
    fams = None
    if args.engine:
        from reference import families
        fams = list(families.names()) if args.engine == "all" else \
            check_names("--engine", split_names([args.engine]), list(families.names()))
    rows = time_validators(ops, kinds, budget, triton_path=True)
    print(format_rows(rows))
    doc = {"rows": rows}
    if "gpu" in kinds and (fresh := time_new_signatures(ops)):
        doc["new_signatures"] = fresh
        print("\nprefill at a new token count per call, triton path (kernels not run)\n"
              + format_new_signature_rows(doc["new_signatures"]))
    if fams:
        doc["engine"] = time_engine_decode(fams, budget=budget)
        print("\neager engine decode step, host path (kernels not run)\n" + format_engine_rows(doc["engine"]))
    if args.json:
        from harness.env import environment
        from harness.records import write_json
        write_json(args.json, {"env": environment("cpu"), "threads": torch.get_num_threads(), **doc})
    return 0
