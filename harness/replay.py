"""`harness replay`: run again the op call that a test left behind when it lost the CUDA context.

A kernel that faults (an illegal memory access) takes the process's CUDA context with it, so the test can
neither shrink nor print its example. The pytest plugin then writes the last op call into the test's
--outcomes line (`last_call`, harness.testing.lastcall): the op, the implementation function, and every
argument — a tensor by shape, dtype, strides and device, a small integer or bool tensor (lengths, offsets,
slot ids, flags) by its values too, scalars as they were. This module rebuilds that call in a fresh process
and runs it, so the fault can be reproduced alone, under `compute-sanitizer`, or on another device
(`--device cpu` runs a Triton kernel under the interpreter, whose bounds checks name an out-of-range access).

What is rebuilt exactly: shapes, dtypes, strides and storage offsets (a view's addressing: a pool's slot
stride, a transposed layout, z as the second half of one projection), the recorded integer and bool values,
scalar options. What is not recorded, and is drawn again from
`--seed`: the floating-point values. They are sampled from the values the op's own input builder gives for
its contract case (`OpSpec.inputs`), so every argument keeps its domain (log-decays negative, write strengths
in (0, 1), time steps positive); `out=` is filled with NaN as the suites fill it. An integer tensor too long
for its values to have been recorded is rebuilt plainly (offsets evenly spaced over the tokens, slot ids
counting up) and said so. Faults that depend on addresses reproduce this way; a wrong value that depends on
the data may not.

`--compare` also evaluates the float64 oracle (harness.impls.reference_impl.oracle) on copies of the same
inputs and compares the output and the pool at the activations' tolerance (harness.testing.checks).

Input: an --outcomes file (JSON lines; the lines that carry `last_call`, chosen with `--test` when there are
several) or a JSON file holding one call description.
"""
from __future__ import annotations

import importlib
import json

from reference.validate import fail


def read_calls(path: str) -> list[tuple[str, dict]]:
    """[(label, call description)] in `path`: the `last_call` of each --outcomes line that has one, or the one
    description a JSON file holds (label: the test's node id, or the file name)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        fail("FILE", "a readable --outcomes file or call description", f"{path} ({e.strerror})")
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and "nodeid" not in whole:  # one call description
        if not ("op" in whole and "args" in whole):
            fail("FILE", "a call description (keys op, fn, args) or an --outcomes file", path)
        return [(path, whole)]
    calls = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a time limit
        if isinstance(rec, dict) and isinstance(rec.get("last_call"), dict):
            calls.append((rec.get("nodeid", f"{path}:{n}"), rec["last_call"]))
    return calls


def pick(calls: list[tuple[str, dict]], test: str | None, path: str) -> tuple[str, dict]:
    """The call of the test named `test` (its latest, when the file has it more than once), else the one whose
    label contains `test` (the only one when `test` is None)."""
    if not calls:
        fail("FILE", "an --outcomes file with at least one line carrying last_call (a test that lost the CUDA "
             "context), or a call description", f"{path}: none")
    exact = [c for c in calls if c[0] == test]
    if exact:
        return exact[-1]  # a test run more than once (a resumed run): its latest call
    found = [c for c in calls if test is None or test in c[0]]
    if len(found) != 1:
        labels = ", ".join(label for label, _ in (found or calls))
        fail("--test", "a part of exactly one of the tests " + ("in the file" if test is None else "that matches"),
             f"{test!r} matches {len(found)}: {labels}")
    return found[0]


def _numel_span(shape, stride) -> int:
    """Elements of storage the strided view needs (0 for an empty one)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def _plain_ints(name: str, shape, args: dict, spec) -> tuple[object, str]:
    """Values for an integer tensor whose values were not recorded, and the note saying how they were made."""
    import torch
    n = shape[0] if shape else 1
    if name == "query_start_loc":
        tokens = next((d["shape"][0] for k, d in args.items() if isinstance(d, dict) and "shape" in d and d["shape"]
                       and k not in ("query_start_loc", spec.pool, spec.index) and d["dtype"].startswith("float")), n - 1)
        return torch.linspace(0, tokens, n).round().long(), f"{name}: {n} offsets not recorded, evenly spaced over {tokens} tokens"
    slots = args.get(spec.pool, {}).get("shape", [n])[0] if spec.pool else n
    return torch.arange(n) % max(slots, 1), f"{name}: {n} values not recorded, counting up modulo {slots}"


def rebuild(desc: dict, *, device: str | None = None, seed: int = 0):
    """(op, function name, positional args, keyword args, notes) of the call `desc` (see the module doc)."""
    import torch

    from harness.ops import SPECS
    from reference.testing import gen
    op = desc.get("op")
    if op not in SPECS:
        fail("last_call.op", f"one of {sorted(SPECS)}", repr(op))
    spec = SPECS[op]
    args = desc.get("args") or {}
    floats = [d for d in args.values() if isinstance(d, dict) and "shape" in d and d["dtype"].startswith(("float", "bfloat"))]
    act = getattr(torch, floats[0]["dtype"]) if floats else torch.float32
    domain = spec.inputs(spec.shapes["contract"][0], act, "cpu", gen(seed))
    g = torch.Generator().manual_seed(seed)
    notes: list[str] = []
    built = {}
    for name, d in args.items():
        if not (isinstance(d, dict) and "shape" in d and "dtype" in d):
            built[name] = d
            continue
        dtype = getattr(torch, d["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            fail(f"last_call.args.{name}.dtype", "a torch dtype name", repr(d["dtype"]))
        shape, stride, offset = tuple(d["shape"]), tuple(d["stride"]), int(d.get("offset", 0))
        dev = device or d.get("device", "cpu")
        base = torch.zeros(offset + _numel_span(shape, stride), dtype=dtype)
        t = base.as_strided(shape, stride, offset)
        if "values" in d:
            t.copy_(torch.tensor(d["values"], dtype=dtype).reshape(shape))
        elif dtype.is_floating_point:
            if name == "out":
                t.fill_(float("nan"))
            else:
                src = domain.get(name)
                src = src.detach().flatten().float() if isinstance(src, torch.Tensor) and src.numel() else None
                if src is None:
                    vals = torch.randn(t.numel(), generator=g)
                    notes.append(f"{name}: no contract values to sample, standard normal")
                else:
                    vals = src[torch.randint(src.numel(), (t.numel(),), generator=g)]
                t.copy_(vals.reshape(shape).to(dtype))
        elif dtype == torch.bool:
            t.fill_(True)
            notes.append(f"{name}: {t.numel()} flags not recorded, all True")
        else:
            vals, note = _plain_ints(name, shape, args, spec)
            t.copy_(vals.reshape(shape).to(dtype))
            notes.append(note)
        built[name] = base.to(dev).as_strided(shape, stride, offset) if dev != "cpu" else t
    positional = [built.pop(a) for a in spec.args if a in built]
    return op, desc.get("fn", ""), positional, built, notes


def resolve(fn_name: str, op: str, impl: str | None):
    """The function to call: implementation `impl`'s op, else the recorded function imported by its
    qualified name (module path, then attributes)."""
    if impl:
        from harness.impls import registry
        return registry.get(impl).op(op)
    parts = fn_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        if callable(obj):
            return obj
    fail("last_call.fn", "an importable function (module.name); or name the implementation with --impl",
         repr(fn_name))


def _describe_result(y) -> str:
    import torch
    if isinstance(y, (tuple, list)):
        return "(" + ", ".join(_describe_result(x) for x in y) + ")"
    if isinstance(y, torch.Tensor):
        fin = bool(torch.isfinite(y).all()) if y.is_floating_point() and y.numel() else True
        return f"{y.dtype} {list(y.shape)}, {'all finite' if fin else 'NON-FINITE values'}"
    return repr(y)[:80]


def replay(desc: dict, *, device: str | None, impl: str | None, seed: int, compare: bool) -> tuple[bool, list[str]]:
    """Rebuild and run the call; (passed, report lines). Passed: it returned (and, with `compare`, matched the
    float64 oracle)."""
    import torch

    from harness.devices import synchronize
    op, fn_name, args, kwargs, notes = rebuild(desc, device=device, seed=seed)
    fn = resolve(fn_name, op, impl)
    where = next((str(a.device) for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), "cpu")
    lines = [f"replaying {op} by {impl or fn_name} on {where} (floating-point values from seed {seed})"]
    lines += [f"  note: {n}" for n in notes]
    expected = None
    if compare:
        from harness.impls.reference_impl import oracle
        cpu = [a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]
        ckw = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        expected = oracle(op, *cpu, **ckw)
    try:
        y = fn(*args, **kwargs)
        synchronize(where)
    except Exception as e:  # the point of a replay: say how the call ends
        lines.append(f"  raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return False, lines
    lines.append(f"  returned {_describe_result(y)}")
    if expected is None:
        return True, lines
    from harness.ops import SPECS
    from harness.testing.checks import compare as cmp, tolerance_for
    spec = SPECS[op]
    out = y[0] if isinstance(y, (tuple, list)) else y
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    tol = tolerance_for(floats[0].dtype if floats else torch.float32)
    pairs = [(f"{op}.y", out, expected[0])]
    if spec.pool is not None and expected[1] is not None:
        pool = args[spec.args.index(spec.pool)] if spec.pool in spec.args[:len(args)] else kwargs[spec.pool]
        pairs.append((f"{op}.{spec.pool}", pool, expected[1]))
    ok = True
    for name, a, b in pairs:
        c = cmp(name, a, b.to(a.dtype) if a.dtype == torch.float64 else b, tol)
        ok = ok and c.passed
        lines.append(f"  {name}: {'matches' if c.passed else 'DIFFERS from'} the float64 oracle ({c.reason}; error "
                     f"ratio {c.err_ratio:.3e}, max abs {c.max_abs_err:.3e})")
    return ok, lines


def add_args(p) -> None:
    p.add_argument("file", metavar="FILE", help="an --outcomes file (its lines with last_call) or a JSON call description")
    p.add_argument("--test", default=None, metavar="PART", help="the test whose call to replay: a part of its node id")
    p.add_argument("--device", default=None, help="run on this device instead of the recorded one (cpu: the "
                   "Triton interpreter, with its bounds checks)")
    p.add_argument("--impl", default=None, help="call this implementation's op instead of the recorded function")
    p.add_argument("--seed", type=int, default=0, help="seed of the floating-point values (default 0)")
    p.add_argument("--compare", action="store_true", help="also compare with the float64 oracle")


def main(args) -> int:
    calls = read_calls(args.file)
    label, desc = pick(calls, args.test, args.file)
    if args.device and args.device.startswith("cpu"):
        from harness import devices
        from harness.testing import triton_bounds
        devices.prepare("cpu")  # Triton's interpreter, before any kernel module is imported
        triton_bounds.install()
    ok, lines = replay(desc, device=args.device, impl=args.impl, seed=args.seed, compare=args.compare)
    print(f"{label}:")
    print("\n".join(lines))
    return 0 if ok else 1
