"""`harness bench`: run the benchmark matrix on a device and append timing records to a JSONL file.

    harness bench --device cuda                         # docs/targets.md shapes, every usable implementation
    harness bench --device cpu --reps 5                 # tiny shapes (seconds)
    harness bench --device cuda --op ssd_varlen --impl triton --impl mamba_ssm --cuda-graph
    harness bench --list                                # the declared cases, nothing timed

Exit codes: 0 every case timed, 1 some case raised (recorded with its error), 2 usage error.
"""
from __future__ import annotations

import os
import sys


def add_args(p) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "xpu"))
    p.add_argument("--impl", action="append", default=None, help="implementation(s) to time (repeatable; default all usable)")
    p.add_argument("--op", action="append", default=None, help="op(s) to time (repeatable; default all)")
    p.add_argument("--dtype", action="append", default=None, help="dtype(s) (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per case (default 5 on CPU, 50 on GPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per case (default 1 on CPU, 5 on GPU)")
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--max-tokens", type=int, default=None, help="skip shapes with more tokens than this")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="JSONL file to append to (default reports/runs/<run id>/bench.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default 1 on the CPU: tiny shapes time more stably on one thread)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the cases and exit")


def run_bench(args) -> int:
    from harness import devices
    try:
        device = devices.worker_device(devices.resolve(args.device))
    except devices.DeviceUnavailable as e:
        print(f"harness bench: {e}", file=sys.stderr)
        return 2
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import torch
        torch.set_num_threads(args.threads or 1)
    elif device.startswith("cuda"):
        import torch
        torch.cuda.set_device(device)
    from harness.bench.runner import build_cases, format_table, parse_dtype, run_benchmarks
    from harness.env import REPO_ROOT
    from harness.records import new_run_id
    cpu = device == "cpu"
    reps = args.reps if args.reps is not None else (5 if cpu else 50)
    warmup = args.warmup if args.warmup is not None else (1 if cpu else 5)
    dtypes = [parse_dtype(d) for d in args.dtype] if args.dtype else None
    if args.cuda_graph and not device.startswith("cuda"):
        print(f"harness bench: --cuda-graph: expected a CUDA device, got {device}", file=sys.stderr)
        return 2
    if args.list:
        cases, skipped = build_cases(device, impls=args.impl, ops=args.op, dtypes=dtypes, cuda_graph=args.cuda_graph,
                                     max_tokens=args.max_tokens)
        for c in cases:
            print(c.id)
        for s in skipped:
            print(f"skipped {s}")
        return 0
    run_id = os.environ.get("HARNESS_RUN_ID") or new_run_id()
    out = args.out or os.path.join(REPO_ROOT, "reports", "runs", run_id, "bench.jsonl")
    records = run_benchmarks(device, out, impls=args.impl, ops=args.op, dtypes=dtypes, reps=reps, warmup=warmup,
                             cuda_graph=args.cuda_graph, progress=not args.no_progress, seed=args.seed,
                             max_tokens=args.max_tokens, run_id=run_id)
    print(format_table(records))
    print(f"harness bench: {len(records)} cases, records in {out}")
    return 1 if any(r.get("error") for r in records) else 0
