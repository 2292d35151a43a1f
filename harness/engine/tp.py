"""Tensor parallelism for the engine: a model sharded over `size` ranks of torch.distributed.

Each rank holds its shard of every mixer weight (as ``harness.engine.families`` gives the cuts, the same
cuts the fast loader reads with ``load_weights(tp_rank=, tp_size=)``): column-parallel input projections,
conv channels, heads and groups split, row-parallel output projections followed by an all-reduce (Mamba-1's
x_proj is row parallel too). Embedding, block norms, final norm and lm_head are replicated (every rank
computes the whole logits); every rank runs the same scheduler steps on the same tokens, and rank 0's
sampled tokens are broadcast so that the ranks can never disagree on a near-tie. A rank's state pool holds
its slice of every state, as the family's ``reference.cache`` spec with ``tp_size`` describes it (Mamba-2
with ``n_groups == 1`` replicates B and C on every rank).

Hybrid models (GDN: Qwen3-Next, KDA: Kimi Linear) shard their other layers as vLLM and SGLang do: the
full-attention layers split their query heads, split their key/value heads or, when there are fewer of
them than ranks, replicate one per rank (:func:`kv_heads_of_rank`), and end in a row-parallel output
projection; each rank's paged KV pool holds its key/value heads only. The dense MLP is column parallel
(gate_proj, up_proj) then row parallel (down_proj); a mixture-of-experts MLP cuts every expert and the
shared expert the same way (each rank: its slice of every expert's intermediate channels, as vLLM's fused
MoE does), with the router (and Qwen3-Next's shared-expert gate) replicated. The loader reads attention and
MLP weights whole; the engine cuts them on each rank (:func:`split_heads`, :meth:`TensorParallel.shard_mlp`).
Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` interleave q, k, v, z (b, a) per key head, so they are
cut as whole key-head groups and permuted per rank (``harness/engine/families/gdn.py``). A split the weights
do not allow (heads, groups, channels, MLP or expert width not divisible by ``tp_size``) is a ValueError
naming ``tp_size`` (the family's ``check_tp``) before anything is built.

    tp = TensorParallel(rank, size)          # inside an initialised process group
    runner = EngineRunner(model, "torch", tp=tp, device=rank_device("cuda", rank), ...)

:func:`launch` runs a function on `size` fresh processes (``torch.multiprocessing`` spawn, a TCP rendezvous
on a free local port; gloo on the CPU, the device's default backend elsewhere, e.g. NCCL on CUDA, where
rank r uses device r) and returns what each rank returned. :func:`run_engine` runs requests through a
sharded engine that way. ``python -m harness.engine.tp --device cuda --tp 2`` runs every family with
whole models at TP = tp and TP = 1 and compares greedy tokens and state slices, the hybrids' keys and
values included (the CI suite is ``suites/engine/test_engine_tp.py``).
"""
from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import torch

from reference.validate import check_int, fail

__all__ = ["TensorParallel", "SINGLE", "rank_device", "default_backend", "kv_heads_of_rank", "split_heads",
           "shard_rule", "shard_mixer_params", "state_slice", "distributed_unavailable", "launch", "run_engines",
           "run_engine", "plain_results", "paired_states", "compare_ranks", "tp_configs"]


class TensorParallel:
    """Rank `rank` of a tensor-parallel group of `size` ranks (``group``: a torch.distributed process group,
    None for the default one). With size 1 the collectives are no-ops and torch.distributed is never
    touched."""

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        check_int("tp_size", size, 1)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            fail("tp_rank", f"an int in 0..{size - 1}", repr(rank))
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `t` on every rank, in place; returns `t`."""
        if self.size > 1:
            import torch.distributed as dist
            dist.broadcast(t, src=src, group=self.group)
        return t

    def split(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's equal share of `t` along `dim` (a view): rows [r*n/T, (r+1)*n/T) of its n rows."""
        if self.size == 1:
            return t
        n = t.shape[dim]
        if n % self.size:
            fail("t", f"a tensor whose dim {dim} splits over {self.size} ranks", f"shape {tuple(t.shape)}")
        return t.narrow(dim, self.rank * (n // self.size), n // self.size)

    def shard_mlp(self, params: dict) -> dict:
        """This rank's shard of a gated MLP (``gate_proj.weight``, ``up_proj.weight`` column parallel: their
        rows split; ``down_proj.weight`` row parallel: its columns split, the partial products summed with
        :meth:`all_reduce`). `params` hold whole weights (names relative to ``layers.{i}.mlp.``; empty: the
        layer has no MLP); a mixture of experts cuts each expert's and the shared expert's projections
        (``experts.{e}.*_proj.weight``, ``shared.*_proj.weight``) so, and keeps the router and
        ``shared_gate.weight`` whole. Returns them unchanged with one rank."""
        if self.size == 1 or not params:
            return params
        dims = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}
        leaf = lambda k: ".".join(k.split(".")[-2:])  # noqa: E731
        return {k: self.split(v, dims[leaf(k)]) if leaf(k) in dims else v for k, v in params.items()}

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"


SINGLE = TensorParallel()


def rank_device(device, rank: int) -> torch.device:
    """The device rank `rank` runs on: the CPU for every rank; on an accelerator, device index + rank
    ("cuda" or "cuda:0": rank r on cuda:r; "cuda:2": rank r on cuda:2+r)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    return torch.device(dev.type, (dev.index or 0) + rank)


def kv_heads_of_rank(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first, count) of the key/value heads rank `rank` of `size` holds (as vLLM's QKVParallelLinear cuts
    them): ``num_kv_heads / size`` heads when `size` divides `num_kv_heads`; otherwise, when `num_kv_heads`
    divides `size`, ONE head replicated on ``size / num_kv_heads`` ranks (rank r holds head
    ``r * num_kv_heads // size``, the head its query heads read). Any other pair is a ValueError naming
    ``tp_size``."""
    if num_kv_heads % size == 0:
        n = num_kv_heads // size
        return rank * n, n
    if size % num_kv_heads == 0:
        return rank * num_kv_heads // size, 1
    raise ValueError(f"tp_size: expected a divisor or a multiple of num_kv_heads = {num_kv_heads}, got {size}")


def split_heads(t, num_heads: int, tp: TensorParallel, dim: int = 0, kv: bool = False):
    """Rank ``tp.rank``'s heads of `t`, whose `dim` holds `num_heads` equal blocks (one per head; None stays
    None): query heads split evenly (``kv`` False), key/value heads as :func:`kv_heads_of_rank` says."""
    if t is None or tp.size == 1:
        return t
    if t.shape[dim] % num_heads:
        fail("t", f"a tensor whose dim {dim} holds {num_heads} heads", f"shape {tuple(t.shape)}")
    if kv:
        first, count = kv_heads_of_rank(num_heads, tp.rank, tp.size)
    else:
        if num_heads % tp.size:
            fail("tp_size", f"a divisor of {num_heads} heads", tp.size)
        count = num_heads // tp.size
        first = tp.rank * count
    per = t.shape[dim] // num_heads
    return t.narrow(dim, first * per, count * per)


def default_backend(device) -> str:
    """The torch.distributed backend for `device`: gloo on the CPU, NCCL on CUDA, the device's default
    elsewhere."""
    import torch.distributed as dist
    dev = torch.device(device)
    if hasattr(dist, "get_default_backend_for_device"):
        return dist.get_default_backend_for_device(dev)
    return {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}[dev.type]


def distributed_unavailable(device="cpu", tp_size: int = 2) -> str | None:
    """Why a `tp_size`-rank group cannot run on `device` here (None: it can)."""
    import torch.distributed as dist
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    dev = torch.device(device)
    if dev.type == "cpu":
        return None if dist.is_gloo_available() else "torch.distributed has no gloo backend in this build"
    need = (dev.index or 0) + tp_size
    if dev.type == "cuda":
        if not dist.is_nccl_available():
            return "torch.distributed has no NCCL backend in this build"
        if torch.cuda.device_count() < need:
            return (f"tensor parallelism over {tp_size} ranks from {dev} needs {need} CUDA devices, "
                    f"found {torch.cuda.device_count()}")
        return None
    if dev.type == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.device_count() >= need):
            return f"tensor parallelism over {tp_size} ranks from {dev} needs {need} XPU devices"
        return None
    return f"no tensor-parallel backend for device type {dev.type!r}"


# ---------------------------------------------------------------------------------------------- weights

def shard_rule(cfg, name: str):
    """The cut of mixer parameter `name` (relative to ``layers.{i}.mixer.``) as the family gives it
    (a ``harness.loader.ShardRule``)."""
    from harness.engine import families
    from harness.loader import ShardRule
    cut = families.get(cfg.family, "cfg.family").shard_sections(cfg, name)
    if cut is None:
        fail("params", f"mixer parameters of a {cfg.family} model", f"unknown parameter {name!r}")
    return ShardRule(*cut)


def _local_shape(rule, shape: tuple, size: int) -> tuple:
    if rule.dim is None or size == 1:
        return tuple(shape)
    n = sum(length // size if sharded else length for length, sharded in rule.sections)
    return tuple(n if d == rule.dim else s for d, s in enumerate(shape))


def shard_mixer_params(cfg, params: dict, tp: TensorParallel) -> tuple[dict, dict]:
    """(rank's parameters, their expected shapes) of one layer's mixer. Each parameter may come whole (it is
    cut here) or already cut for this rank (e.g. from ``load_weights(tp_rank=, tp_size=)``); any other shape is
    a ValueError. Names missing from `params` are left for the caller's check."""
    from harness.loader import take_shard
    from reference.loader import mixer_parameter_shapes
    out, shapes = {}, {}
    for name, full in mixer_parameter_shapes(cfg).items():
        rule = shard_rule(cfg, name)
        local = _local_shape(rule, full, tp.size)
        shapes[name] = local
        t = params.get(name)
        if t is None:
            continue
        if tuple(t.shape) == local:
            out[name] = t
        elif tuple(t.shape) == tuple(full):
            out[name] = take_shard(t, rule, tp.rank, tp.size)
        else:
            fail(f"params[{name!r}]", f"shape {tuple(full)} (whole) or {local} (rank {tp.rank} of {tp.size})",
                 f"shape {tuple(t.shape)}")
    return out, shapes


# ---------------------------------------------------------------------------------------------- states

def state_slice(spec, kind: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a whole (TP = 1) state of one slot, as the per-rank `spec` (a
    ``reference.cache`` spec with ``tp_size``) lays it out. `kind` "conv": `full` is (conv_dim, K-1) and the
    rank holds its rows of every conv segment (a replicated segment whole); "recurrent": the leading dim
    (channels or heads) is split; "kv": `full` is an attention layer's keys or values (tokens,
    num_kv_heads, head_dim) of a hybrid model and the rank holds its key/value heads (:func:`kv_heads_of_rank`)."""
    T = spec.tp_size
    if not 0 <= rank < T:
        fail("rank", f"an int in 0..{T - 1}", repr(rank))
    if kind == "conv":
        parts, off = [], 0
        for _, whole, per_rank, replicated in spec.conv_segments():
            a = off if replicated else off + rank * per_rank
            parts.append(full[a:a + per_rank])
            off += whole
        if off != full.shape[0]:
            fail("full", f"a whole conv state of {off} channels", f"shape {tuple(full.shape)}")
        return torch.cat(parts)
    if kind == "kv":
        if full.dim() != 3:
            fail("full", "keys or values (tokens, num_kv_heads, head_dim)", f"shape {tuple(full.shape)}")
        first, count = kv_heads_of_rank(full.shape[1], rank, T)
        return full[:, first:first + count]
    if kind == "recurrent":
        n = spec.recurrent_shape[0]
        if full.shape[0] != n * T:
            fail("full", f"a whole recurrent state of {n * T} rows", f"shape {tuple(full.shape)}")
        return full[rank * n:(rank + 1) * n]
    fail("kind", "'conv', 'recurrent' or 'kv'", repr(kind))


# ---------------------------------------------------------------------------------------------- processes

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, backend: str, device: str, threads: int, out_dir: str, timeout: float,
            fn, args):
    from datetime import timedelta
    import torch.distributed as dist
    if threads:
        torch.set_num_threads(threads)
    dev = rank_device(device, rank)
    if dev.type != "cpu":
        torch.accelerator.set_device_index(dev.index)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))
    try:
        out = fn(TensorParallel(rank, size), dev, *args)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def launch(fn, tp_size: int, *args, device="cpu", backend: str | None = None, threads: int | None = 1,
           timeout: float = 300.0) -> list:
    """Run ``fn(tp, device, *args)`` on `tp_size` spawned processes, one per rank, inside one process group;
    returns each rank's return value (in rank order; values travel through ``torch.save``: tensors, lists,
    dicts, numbers, strings). `fn` must be importable (a module-level function). `threads`: intra-op
    threads per rank (None: torch's default). A rank that raises makes this raise with its traceback; a
    collective that waits longer than `timeout` seconds for another rank fails."""
    import torch.multiprocessing as mp
    check_int("tp_size", tp_size, 1)
    why = distributed_unavailable(device, tp_size)
    if why:
        raise RuntimeError(why)
    backend = backend or default_backend(device)
    with tempfile.TemporaryDirectory(prefix="harness-tp-") as tmp:
        mp.spawn(_worker, args=(tp_size, _free_port(), backend, str(device), threads, tmp, float(timeout), fn, args),
                 nprocs=tp_size, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(tp_size)]


def plain_results(runner, results: dict) -> dict:
    """A run's results as plain data (what :func:`launch` can carry back): per request id its tokens, step
    logits, final state and per-step states; and the runner's prefix-cache snapshots in insertion order."""
    return {"results": {rid: {"tokens": list(r.tokens), "step_logits": r.step_logits,
                              "final_state": dict(r.final_state) if r.final_state is not None else None,
                              "states": {pos: dict(s) for pos, s in r.states.items()}}
                        for rid, r in results.items()},
            "snapshots": [(rid, list(prefix), dict(snap)) for rid, prefix, snap in runner.snapshot_log]}


def _engine_rank(tp: TensorParallel, device, jobs: list):
    from harness.engine.runner import EngineRunner
    from harness.impls import registry
    from harness.scenarios import engine_impl
    out = []
    for model, impl, requests, runner_kwargs in jobs:
        if isinstance(model, list):  # one (cfg, params) per rank
            model = model[tp.rank]
        try:
            runner = EngineRunner(model, engine_impl(registry.get(impl)), tp=tp, device=device, **runner_kwargs)
            out.append(plain_results(runner, runner.run(requests)))
        except Exception as e:  # every rank fails alike (same model, same steps): the next job still runs
            out.append({"error": f"{type(e).__name__}: {e}", "declined": isinstance(e, NotImplementedError)})
    return out


def run_engines(jobs, tp_size: int, *, device="cpu", backend: str | None = None, threads: int | None = 1) -> list:
    """Run engine jobs ``(model, impl, requests, runner_kwargs)`` one after the other on ONE group of `tp_size`
    spawned ranks (``model``: ``(cfg, params)``, whole weights, cut on each rank, or a list of `tp_size`
    ``(cfg, params)``, rank r's mixer weights already cut, e.g. by ``load_weights(tp_rank=r, tp_size=)``;
    ``impl``: a registered implementation name). Returns per job the per-rank :func:`plain_results`, or
    ``{"error": message, "declined": whether it was a NotImplementedError}`` for a job that raised."""
    jobs = [(m, i, list(r), dict(kw)) for m, i, r, kw in jobs]
    for j, (m, _, _, _) in enumerate(jobs):
        if isinstance(m, list) and len(m) != tp_size:
            fail(f"jobs[{j}] model", f"(cfg, params) or a list of {tp_size} per-rank (cfg, params)",
                 f"a list of {len(m)}")
    per_rank = launch(_engine_rank, tp_size, jobs, device=device, backend=backend, threads=threads)
    return [[per_rank[r][j] for r in range(tp_size)] for j in range(len(jobs))]


def run_engine(model, impl: str, requests: list, tp_size: int, *, device="cpu", backend: str | None = None,
               threads: int | None = 1, **runner_kwargs) -> list:
    """One engine job on `tp_size` ranks (see :func:`run_engines`): per rank its :func:`plain_results`."""
    return run_engines([(model, impl, requests, runner_kwargs)], tp_size, device=device, backend=backend,
                       threads=threads)[0]


def paired_states(spec, single: dict, part: dict, rank: int):
    """Line up a rank's states with the TP = 1 run's (both :func:`plain_results`): returns (differences in
    what was recorded, one line each; [(what, the rank's states, the matching slices of the TP = 1 states)]
    with every final state, per-step state and prefix-cache snapshot, flattened and concatenated per what)."""
    bad = []
    pairs = {"final states": ([], []), "states after every step": ([], []), "prefix-cache snapshots": ([], [])}

    def add(what, where, whole: dict, got: dict):
        if set(whole) != set(got):
            bad.append(f"{where}: rank {rank} holds {sorted(got)}, TP = 1 {sorted(whole)}")
            return
        for key in sorted(whole):
            pairs[what][0].append(got[key].detach().double().cpu().flatten())
            pairs[what][1].append(state_slice(spec, key.split(".")[0], whole[key], rank).double().cpu().flatten())

    for rid, one in single["results"].items():
        got = part["results"].get(rid)
        if got is None:
            bad.append(f"request {rid!r}: no result on rank {rank}")
            continue
        if (one["final_state"] is None) != (got["final_state"] is None):
            bad.append(f"request {rid!r}: a final state on one side only (rank {rank})")
        elif one["final_state"] is not None:
            add("final states", f"request {rid!r} final state", one["final_state"], got["final_state"])
        if set(got["states"]) != set(one["states"]):
            bad.append(f"request {rid!r}: rank {rank} steps end at {sorted(got['states'])}, "
                       f"TP = 1 at {sorted(one['states'])}")
        for pos in sorted(set(got["states"]) & set(one["states"])):
            add("states after every step", f"request {rid!r} after {pos} tokens", one["states"][pos],
                got["states"][pos])
    if [(r, p) for r, p, _ in part["snapshots"]] != [(r, p) for r, p, _ in single["snapshots"]]:
        bad.append(f"rank {rank}: prefix-cache snapshots of other prefixes than with TP = 1")
    else:
        for (rid, prefix, one), (_, _, got) in zip(single["snapshots"], part["snapshots"]):
            add("prefix-cache snapshots", f"snapshot of {rid!r} after {len(prefix)} tokens", one, got)
    return bad, [(what, torch.cat(a), torch.cat(b)) for what, (a, b) in pairs.items() if a]


def compare_ranks(spec, single: dict, ranks: list, tol) -> list[str]:
    """Differences between a TP = 1 run and the per-rank results of a sharded run (all :func:`plain_results`):
    greedy tokens must be equal and every state of every rank must equal the rank's slice of the TP = 1
    state within `tol` (a ``harness.testing.checks.Tolerance``). One line per difference (empty: they agree)."""
    from harness.testing.checks import compare
    bad = []
    for rank, part in enumerate(ranks):
        if "error" in part:
            bad.append(f"rank {rank}: {part['error']}")
            continue
        for rid, one in single["results"].items():
            got = part["results"].get(rid, {}).get("tokens")
            if got != one["tokens"]:
                bad.append(f"request {rid!r}: rank {rank} greedy tokens {got}, TP = 1 {one['tokens']}")
        lines, pairs = paired_states(spec, single, part, rank)
        bad += lines
        for what, actual, expected in pairs:
            c = compare(f"{what}, rank {rank} of {len(ranks)}", actual, expected, tol)
            if not c.passed:
                bad.append(c.message(f"rank {rank} of {len(ranks)}", ""))
    return bad


# ---------------------------------------------------------------------------------------------- command line

def _main(argv=None) -> int:
    import argparse
    from harness import devices
    import sys
    from harness.scenarios import engine_impl, random_params
    from harness.engine.runner import EngineRunner, state_spec
    from harness.engine.scheduler import Request
    from harness.testing.checks import tolerance_for
    from harness.impls import registry
    from reference import families

    ap = argparse.ArgumentParser(prog="python -m harness.engine.tp",
                                 description="Greedy tokens and state slices of a tensor-parallel engine against "
                                             "TP = 1, for every family with whole models and TP support.")
    devices.add_device_arg(ap)
    ap.add_argument("--tp", type=int, default=2, help="ranks (default 2; rank r uses device r)")
    ap.add_argument("--impl", action="append", default=None, help="implementation (repeatable; default torch)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "float64"),
                    help="engine dtype (default auto: float64 where the implementation has it, else float32; "
                         "greedy tokens must be equal exactly)")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--new", type=int, default=16, help="generated tokens per request")
    a = ap.parse_args(argv)
    device = devices.resolve_or_exit(a.device, ap.prog)
    devices.prepare(device)
    why = distributed_unavailable(device, a.tp)
    if why:
        print(f"{ap.prog}: error: {why}", file=sys.stderr)
        return devices.EXIT_NO_DEVICE
    failures = 0
    for impl in a.impl or ["torch"]:
        run = engine_impl(registry.get(impl))
        dtype = getattr(torch, a.dtype) if a.dtype != "auto" else \
            (torch.float64 if torch.float64 in run.dtypes else torch.float32)
        rec = torch.float64 if dtype == torch.float64 else torch.float32
        kw = dict(num_slots=4, token_budget=24, dtype=dtype, record_states=True, cache_mode="all", block_size=8)
        jobs, singles = [], []
        for cfg in tp_configs(a.tp, a.d_model).values():
            params = random_params(cfg, 0)
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(0, cfg.vocab_size_unpadded, (n,), generator=g).tolist() for n in (1, 7, 40)]
            reqs = [Request(f"r{i}", p, a.new) for i, p in enumerate(prompts)]
            one = EngineRunner((cfg, params), run, device=rank_device(device, 0), **kw)
            singles.append(plain_results(one, one.run(reqs)))
            jobs.append(((cfg, params), impl, reqs, kw))
        for cfg, single, ranks in zip(tp_configs(a.tp, a.d_model).values(), singles,
                                      run_engines(jobs, a.tp, device=device, threads=None)):
            bad = compare_ranks(state_spec(cfg, dtype, rec, tp_size=a.tp), single, ranks, tolerance_for(dtype, 4.0))
            name = f"{impl} {cfg.family} {families.get(cfg.family).summary(cfg)} tp={a.tp} {dtype} on {device}"
            print(("FAIL " if bad else "ok   ") + name, flush=True)
            for line in bad[:8]:
                print("     " + line.replace("\n", "\n     "))
            failures += bool(bad)
    return 1 if failures else 0


def tp_configs(tp_size: int, d_model: int = 16) -> dict:
    """{label: tiny config} of every family with whole models whose weights `tp_size` ranks can split, one
    per way they split (the family's ``tp_cases``; e.g. Mamba-2 with one replicated group and with
    `tp_size` split groups). Families that refuse `tp_size` (their ``check_tp``) are left out."""
    from harness.engine import families as engine_families
    from reference import families
    out = {}
    for name in engine_families.names():
        if not families.get(name).whole_models:
            continue
        efam = engine_families.get(name)
        cfg = families.get(name).tiny_config(d_model=d_model, vocab=60)
        for label, c in (efam.tp_cases(cfg, tp_size) if efam.tp_cases else ((name, cfg),)):
            try:
                efam.check_tp(c, tp_size)
            except ValueError:
                continue
            out[label] = c
    return out


if __name__ == "__main__":  # the spawned ranks pickle this module's functions by their importable name
    from harness.engine.tp import _main as main
    raise SystemExit(main())
