"""The arguments of `harness bench throughput` and `harness bench loader`, without importing torch (the
command line builds every parser, and answers --help, before anything heavy is loaded). The runs themselves
are harness.bench.throughput and harness.bench.loader."""
from __future__ import annotations

from pathlib import Path

PRESETS = {
    "falcon-mamba-7b": dict(family="falcon_mamba", layers=64, d_model=4096, d_state=16, dt_rank=256, vocab=65024,
                            expand=2, d_conv=4),
    "mamba-codestral-7b": dict(family="mamba2", layers=64, d_model=4096, d_state=128, head_dim=64, n_groups=8,
                               vocab=32768, expand=2, d_conv=4, chunk_size=256),
}
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def add_throughput_args(p) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, xpu or e.g. cuda:1 (default auto; a device "
                                                 "this machine lacks is exit 4)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model shapes (overrides --family etc.)")
    p.add_argument("--family", default="mamba1",
                   help="mixer family (a registered one: mamba1, falcon_mamba, mamba2, ...; default mamba1)")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-state", type=int, default=None)
    p.add_argument("--dt-rank", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--n-groups", type=int, default=8)
    p.add_argument("--vocab", type=int, default=None,
                   help="default: the family's usual vocabulary (65024 Mamba-1, 32768 Mamba-2)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--impl", default="triton")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hf-new-tokens", type=int, default=8, help="decode steps timed for transformers' generate")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph decode")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append timing records (JSONL) here")
    p.add_argument("--compare-launch", action="store_true",
                   help="also time the eager decode step with every Triton launch through Triton's own kernel[grid] "
                        "path instead of the launch shortcut (record op model_decode_jit_launch; CUDA only)")
    p.add_argument("--profile-decode", default=None, metavar="DIR",
                   help="after the timings, profile 5 eager decode steps of the engine (not part of the timing) "
                        "into DIR: <family>-decode-python.txt (cProfile: the Python functions by own time, per "
                        "step) and <family>-decode-ops.txt (torch.profiler: operators and kernels by self CPU "
                        "time; device time on CUDA)")


def add_loader_args(p) -> None:
    p.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size to write (GB, >= 0.01)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    p.add_argument("--d-model", type=int, default=2048, help="the synthetic model's width (a multiple of 256)")
    p.add_argument("--device", default="cpu", help="target device for the loads (cpu, cuda:0, ...)")
    p.add_argument("--dir", type=Path, default=None, help="write the checkpoint here instead of a temp folder")
    p.add_argument("--keep", action="store_true", help="keep the temp checkpoint")
    p.add_argument("--reps", type=int, default=1, help="loads per contender (default 1)")
    p.add_argument("--out", default=None, metavar="PATH", help="append timing records (JSONL) here")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
