"""`harness bench`: every benchmark of the harness, timing records appended to a JSONL file.

    harness bench --device cuda                         # op benchmarks: docs/targets.md shapes, every usable impl
    harness bench --device cpu --op ssd_varlen,gated_rms_norm --impl torch,reference
    harness bench --list                                # the declared cases, nothing timed
    harness bench peers --device cuda                   # ours next to the peers (adapters and their own kernels)
    harness bench sweep --op causal_conv1d_varlen       # launch configurations; best -> configs/<device>/<module>.json
    harness bench throughput --preset falcon-mamba-7b   # model-level tok/s (engine path, transformers alongside)
    harness bench loader --size-gb 1                    # checkpoint loading vs transformers.from_pretrained
    harness bench host                                  # host time of each op's validator per call (CPU)

Every timing goes through harness.bench.timing: triton.testing.do_bench (eager) and do_bench_cudagraph
(CUDA graph) on GPUs, a time budget per case on the CPU; on CUDA each op case gives an eager and a
CUDA-graph record, each carrying both p50s and the host overhead (eager - graph). `--kernels` adds to each
eager record the cost of each launch of the call (`kernels`, through torch.profiler, outside the timing).

`--op` / `--impl` take comma-separated lists (and repeat); a name that does not exist is a usage error.
Exit codes: 0 every case timed, 1 some case raised (recorded with its error), 2 bad value or a device
the machine lacks, 4 an unknown op or implementation name (the valid names are listed).
"""
from __future__ import annotations

import argparse
import os
import sys

EXIT_UNKNOWN_NAME = 4
SUBCOMMANDS = ("peers", "sweep", "throughput", "loader", "host")


def _add_budget_args(p) -> None:
    p.add_argument("--reps", type=int, default=None,
                   help="samples wanted per case (default 20; fewer when --max-time runs out first)")
    p.add_argument("--min-time", type=float, default=None, metavar="S",
                   help="least timed seconds per case on the CPU; on GPUs do_bench's window (default 0.25 / 0.1)")
    p.add_argument("--max-time", type=float, default=None, metavar="S",
                   help="stop adding samples to a case after this many seconds (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per case first on the CPU (default 1)")


def _add_op_args(p, *, op_help: str = "op(s) to time (comma-separated, repeatable; default all)") -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "xpu"))
    p.add_argument("--impl", action="append", default=None,
                   help="implementation(s) to time (comma-separated, repeatable; default all usable)")
    p.add_argument("--op", action="append", default=None, help=op_help)
    p.add_argument("--dtype", action="append", default=None, help="dtype(s) (default: float32 on CPU, bfloat16 on GPU)")
    _add_budget_args(p)
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="also time CUDA-graph replays (default: on CUDA devices); --no-cuda-graph: eager only")
    p.add_argument("--max-tokens", type=int, default=None, help="skip shapes with more tokens than this")
    p.add_argument("--kernels", action="store_true",
                   help="after timing a case, profile 10 more calls (torch.profiler, not part of the timing): the "
                        "eager record gets `kernels`, each launch's time and count per call (CUDA: device time of "
                        "each kernel; CPU: operators by self CPU time), and the table its top 3")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="JSONL file to append to (default reports/runs/<run id>/bench.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default=None, metavar="RECORDS",
                   help="a records file of an earlier (cut) run: the cases it times without an error are not "
                        "timed again (the copy roofline always is)")
    p.add_argument("--retime", default=None, metavar="OP[,OP]",
                   help="with --resume: time these ops' cases again although the records time them (after a sweep "
                        "changed their launch configurations; every implementation of the op, side by side)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default 1 on the CPU: tiny shapes time more stably on one thread)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the cases and exit")


def add_args(p) -> None:
    _add_op_args(p)
    sub = p.add_subparsers(dest="bench_command", metavar="{" + ",".join(SUBCOMMANDS) + "}",
                           help="without one: the op benchmarks")
    sp = sub.add_parser("peers", help="ours next to the peers: their adapters and their own kernels "
                                      "(harness.bench.peers), eager and CUDA graph, on the ops they have")
    _add_op_args(sp, op_help="op(s) to time (comma-separated; default every op a peer has)")
    sp = sub.add_parser("sweep", help="time each candidate launch configuration of a kernel at the op's shapes "
                                      "and write the best to harness/impls/triton/configs/<device>/<module>.json")
    from harness.bench import sweep
    sweep.add_args(sp)
    _add_budget_args(sp)
    sp = sub.add_parser("throughput", help="model-level tok/s of the engine's path, transformers alongside")
    from harness.bench import args
    args.add_throughput_args(sp)
    sp = sub.add_parser("loader", help="checkpoint loading: our loaders next to transformers' from_pretrained")
    args.add_loader_args(sp)
    sp = sub.add_parser("host", help="host time per call of each op's contract validator, on the CPU")
    from harness.bench import host
    host.add_args(sp)
    _add_budget_args(sp)


def setup_device(name: str) -> str:
    """Resolve --device (DeviceUnavailable when the machine lacks it) and prepare it for timing."""
    from harness import devices
    device = devices.worker_device(devices.resolve(name))
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif device.startswith("cuda"):
        import torch
        torch.cuda.set_device(device)
    return device


def budget_from(args, device: str):
    from harness.bench.timing import Budget
    kw = {}
    if args.reps is not None:
        kw["min_reps"] = args.reps
    if args.min_time is not None:
        kw["min_time"] = args.min_time
        kw["rep_ms"] = args.min_time * 1e3
    elif device != "cpu":
        kw["min_time"] = 0.1
    if args.max_time is not None:
        kw["max_time"] = args.max_time
    if args.warmup is not None:
        kw["warmup"] = args.warmup
    return Budget(**kw)


def run_bench(args) -> int:
    from harness import devices
    from harness.bench.registry import UnknownName
    cmd = getattr(args, "bench_command", None)
    try:
        if cmd == "throughput":
            from harness.bench import throughput
            return throughput.run_cli(args)
        if cmd == "loader":
            from harness.bench import loader
            return loader.run_cli(args)
        if cmd == "host":
            from harness.bench import host
            return host.run_cli(args)
        # the device first: on the CPU, TRITON_INTERPRET must be set before the kernels are imported
        device = setup_device(args.device)
        if cmd == "sweep":
            from harness.bench import sweep
            return sweep.run_cli(args, device)
        return _run_ops(args, device, peers=cmd == "peers")
    except UnknownName as e:
        print(f"harness bench{' ' + cmd if cmd else ''}: {e}", file=sys.stderr)
        return EXIT_UNKNOWN_NAME
    except devices.DeviceUnavailable as e:
        print(f"harness bench: {e}", file=sys.stderr)
        return 2


def peer_ops() -> list[str]:
    """The ops some peer has: through an adapter in the impl registry or a decorated peer backend."""
    from harness.bench.registry import BENCHMARKS, OP_INPUTS, OURS, known_names
    from harness.impls.registry import all_impls
    known_names()  # registers the declarations
    have = {op for name, impl in all_impls().items() if name not in OURS for op in impl.ops}
    have |= {b.op for b in BENCHMARKS.values() if b.peer and b.op != "copy"}
    return [op for op in OP_INPUTS if op in have]


def _run_ops(args, device: str, *, peers: bool = False) -> int:
    from harness.bench.registry import check_names, known_names, split_names
    valid_ops, valid_impls = known_names()
    ops = check_names("--op", split_names(args.op), valid_ops)
    impls = check_names("--impl", split_names(args.impl), valid_impls)
    if peers:
        have = peer_ops()
        ops = check_names("--op (ops a peer has)", ops, have) or have
    if device == "cpu":
        import torch
        torch.set_num_threads(args.threads or 1)
    from harness.bench.runner import build_cases, format_table, parse_dtype, run_benchmarks
    from harness.env import REPO_ROOT
    from harness.records import new_run_id
    dtypes = [parse_dtype(d) for d in split_names(args.dtype) or ()] or None
    if args.cuda_graph and not device.startswith("cuda"):
        print(f"harness bench: --cuda-graph: expected a CUDA device, got {device}", file=sys.stderr)
        return 2
    cuda_graph = device.startswith("cuda") if args.cuda_graph is None else args.cuda_graph
    done = None
    if args.resume:
        from harness.bench.runner import timed_cases
        if not os.path.isfile(args.resume):
            print(f"harness bench: --resume: expected a records file, got {args.resume!r} (no such file)",
                  file=sys.stderr)
            return 2
        retime = check_names("--retime", split_names([args.retime]) if args.retime else None, valid_ops) or ()
        done = timed_cases(args.resume, retime=retime)
    elif args.retime:
        print("harness bench: --retime: expected with --resume RECORDS (without it every case is timed)",
              file=sys.stderr)
        return 2
    if args.list:
        cases, skipped = build_cases(device, impls=impls, ops=ops, dtypes=dtypes, cuda_graph=cuda_graph,
                                     max_tokens=args.max_tokens, done=done)
        for c in cases:
            print(c.id)
        for s in skipped:
            print(f"skipped {s}")
        return 0
    budget = budget_from(args, device)
    run_id = os.environ.get("HARNESS_RUN_ID") or new_run_id()
    out = args.out or os.path.join(REPO_ROOT, "reports", "runs", run_id, "bench.jsonl")
    records = run_benchmarks(device, out, impls=impls, ops=ops, dtypes=dtypes, budget=budget, cuda_graph=cuda_graph,
                             progress=not args.no_progress, seed=args.seed, max_tokens=args.max_tokens, run_id=run_id,
                             env_extra={"kind": "peers"} if peers else None, done=done, kernels=args.kernels)
    print(format_table(records))
    print(f"harness bench{' peers' if peers else ''}: {len(records)} records, in {out}")
    return 1 if any(r.get("error") for r in records) else 0
