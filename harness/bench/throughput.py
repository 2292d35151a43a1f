"""Model-level throughput of the engine's backend path (and transformers' own model on the same shapes).

    harness bench throughput --device cuda --preset falcon-mamba-7b --impl triton \
        --prefill 4096 --decode-batch 64 --out reports/throughput.jsonl
    harness bench throughput --device cuda --family mamba2 --layers 64 --d-model 4096 \
        --impl triton --prefill 4096 --decode-batch 64 --out FILE.jsonl
    harness bench throughput --device cpu --family mamba1 --layers 2 --d-model 64 \
        --vocab 256 --prefill 64 --decode-batch 4 --dtype float32 --out /tmp/t.jsonl     # CPU smoke

Random weights (realistic init) generated directly on the device in `--dtype` (default bfloat16).
Measured, each written as a ``timing`` record (harness.records) with ``bench="model/..."``:

* ``model_prefill``: batch 1, one forward of the engine's path over all layers (embedding, per layer
  norm + MixerBackend with the implementation's varlen ops, final norm, lm_head on the last token) for
  ``--prefill`` tokens; ``tok_s`` = prefill tokens / time;
* ``model_decode``: ``--decode-batch`` requests, one decode step of all layers (+ greedy sample fed back),
  timed per step after warm-up steps (so the first token is excluded); ``tok_s`` = batch / step time;
* ``model_decode`` with ``cuda_graph=True``: the same step (static buffers, ops called inside
  ``harness.ops.no_index_checks()``) as CUDA-graph replays (CUDA only); both decode records carry the
  eager and the graph p50 and the host overhead (harness.bench.timing);
* ``source="transformers"``: ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` built from a config with the same
  shapes, random init, same dtype: prefill = one forward of ``--prefill`` tokens (logits of the last
  token); decode = ``generate`` at ``--decode-batch`` with k vs k+n new tokens, per-step time = the
  difference / n. Skipped with ``--no-hf``; a failure is recorded as a record with ``error``.

Presets: falcon-mamba-7b (Falcon-Mamba / Mamba-1: d_model 4096, d_inner 8192, N 16, dt_rank 256,
vocab 65024, 64 layers); mamba-codestral-7b (Mamba-2: d_model 4096, H 128, P 64, G 8, N 128, vocab 32768,
64 layers).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from reference import families
from reference.loader import ModelConfig, expected_parameters
from reference.validate import fail

from harness.bench.args import PRESETS  # the parser needs no torch
from harness.bench.args import add_throughput_args as add_args


def model_config(family: str, layers: int, d_model: int, *, vocab: int = 32768, expand: int = 2, d_conv: int = 4,
                 chunk_size: int = 256, **fields) -> ModelConfig:
    """The config of a `family` model of these sizes; `fields` are family fields (d_state, dt_rank, head_dim,
    n_groups, ...): those the family does not have, and None values, are ignored (its defaults apply)."""
    fam = families.get(family)
    own = {k: v for k, v in fields.items() if k in fam.build_fields and v is not None}
    return fam.build_config(d_model=d_model, n_layer=layers, vocab=vocab, d_conv=d_conv, expand=expand,
                            chunk_size=chunk_size, **own)


def device_params(cfg: ModelConfig, device, dtype, seed: int = 0) -> dict:
    """Random weights made on the device in `dtype` (A_log, D, dt biases in float32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in expected_parameters(cfg).items():
        leaf = name.split(".mixer.")[-1]
        small = leaf in ("A_log", "D", "dt_bias", "dt_proj.bias")
        dt = torch.float32 if small else dtype
        t = torch.empty(shape, dtype=dt, device=device)
        if leaf == "A_log":
            t.uniform_(0.0, math.log(16.0), generator=g)
        elif leaf == "D" or leaf.endswith("norm.weight") or name in ("norm_f.weight",):
            t.fill_(1.0)
        elif leaf in ("dt_bias", "dt_proj.bias"):
            t.uniform_(-4.0, -1.0, generator=g)
        elif name == "embedding.weight":
            t.normal_(0.0, 1.0, generator=g)
        elif leaf.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=g)
        out[name] = t
    return out


def _record(writer, rows, **fields):
    rows.append(fields)
    if writer is not None:
        writer.write("timing", **fields)
    tag = f"{fields['source']:12s} {fields['op']:14s} graph={str(fields.get('cuda_graph', False)):5s}"
    if fields.get("error"):
        print(f"throughput: {tag} ERROR {fields['error']}", flush=True)
    else:
        print(f"throughput: {tag} {fields['ms_p50']:10.3f} ms  {fields['tok_s']:12.1f} tok/s", flush=True)


PROFILE_STEPS = 5


def _write_text(path: str, text: str) -> None:
    """`text` into `path` whole or not at all (a temporary file renamed over it)."""
    import os
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def short_paths(text: str) -> str:
    """cProfile's file names without the machine's folders: ours relative to the repository (harness/...),
    installed packages' from their package (triton/..., torch/...)."""
    import re
    from harness.env import REPO_ROOT
    text = text.replace(REPO_ROOT.rstrip("/") + "/", "")
    return re.sub(r"(?:/[^\s/]+)*/(?:site|dist)-packages/", "", text)


def profile_decode(step, device, out_dir: str, tag: str, layers: int, steps: int = PROFILE_STEPS) -> list[str]:
    """Profile `steps` calls of the eager decode step `step` (after one untimed call) into `out_dir`:
    <tag>-decode-python.txt, cProfile's Python functions by own time, and <tag>-decode-ops.txt,
    torch.profiler's operators and kernels by self CPU time (with device time on CUDA). Returns the paths."""
    import cProfile
    import io
    import os
    import pstats
    import time
    step()
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps
    sync()
    wall = (time.perf_counter() - t0) / steps
    head = (f"{tag}: eager decode step, {layers} layers: host {host * 1e3:.3f} ms per step (the calls return), "
            f"{wall * 1e3:.3f} ms with the device done ({wall / layers * 1e6:.1f} us per layer); {steps} steps "
            f"profiled\n\n")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    sync()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
    paths = [os.path.join(out_dir, f"{tag}-decode-python.txt"), os.path.join(out_dir, f"{tag}-decode-ops.txt")]
    _write_text(paths[0], head + f"cProfile over {steps} steps (times are totals; divide by {steps} per step)\n"
                + short_paths(buf.getvalue()))
    acts = [torch.profiler.ProfilerActivity.CPU]
    if str(device).startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    _write_text(paths[1], head + f"torch.profiler over {steps} steps (totals)\n" + table)
    return paths


def decode_runner(cfg, params, impl, device, dtype, batch: int, context: int, token_budget: int | None = None):
    """An engine runner of `cfg` with `params` on `impl` and `batch` slots taken (at least one), and the metadata
    of one decode step of `batch` one-token requests, each after `context` tokens: (runner, metadata)."""
    from harness.engine.metadata import build_metadata
    from harness.engine.runner import EngineRunner
    from harness.engine.scheduler import BatchEntry
    runner = EngineRunner((cfg, params), impl, num_slots=max(batch, 1), token_budget=token_budget or max(batch, 1),
                          dtype=dtype, device=device, poison_free_slots=False)
    for _ in range(max(batch, 1)):
        runner.pool.alloc()
    md = build_metadata([BatchEntry(i, i, context, 1, True) for i in range(batch)], chunk_size=runner.chunk_size,
                        device=device)
    return runner, md


def engine_throughput(cfg, params, impl, device, dtype, prefill: int, batch: int, *, reps: int, warmup: int,
                      graphs: bool, emit, profile_dir: str | None = None, compare_launch: bool = False):
    from harness.bench.timing import Budget, measure
    from harness.engine.metadata import build_metadata
    from harness.engine.scheduler import BatchEntry
    from harness.ops import no_index_checks
    runner, md_d = decode_runner(cfg, params, impl, device, dtype, batch, prefill, token_budget=max(prefill, batch))
    V = cfg.vocab_size_unpadded

    def head(residual):
        h = runner._rms(residual, runner.norm_f)
        return h @ runner.lm_head.t()

    # prefill: batch 1
    g = torch.Generator(device=device).manual_seed(1)
    toks = torch.randint(0, V, (prefill,), device=device, generator=g)
    md_p = build_metadata([BatchEntry("p", 0, 0, prefill, False)], chunk_size=runner.chunk_size, device=device)

    def prefill_fn():
        return head(runner.forward(toks, md_p)[-1:])
    with torch.inference_mode(), no_index_checks():
        st = measure([prefill_fn], device, Budget(min_reps=reps, warmup=warmup)).fields()
    emit(op="model_prefill", tokens=prefill, batch=1, tok_s=prefill / (st["ms_p50"] / 1e3), **st)

    # decode: `batch` requests, one token each per step, sampled token fed back (metadata md_d)
    static = torch.randint(0, V, (batch,), device=device, generator=g)

    def decode_fn():
        logits = head(runner.forward(static, md_d))
        static.copy_(logits[:, :V].argmax(-1))
    if graphs and not str(device).startswith("cuda"):
        print("throughput: CUDA-graph decode skipped (needs a CUDA device)", flush=True)
        graphs = False
    with torch.inference_mode(), no_index_checks():
        t = measure([decode_fn], device, Budget(min_reps=reps, warmup=max(warmup, 2)), graph=graphs)
    for graph in ((False, True) if t.graph is not None else (False,)):
        st = t.fields(graph)
        emit(op="model_decode", tokens=batch, batch=batch, tok_s=batch / (st["ms_p50"] / 1e3), **st)
    if t.graph_error:  # record why capture failed
        emit(op="model_decode", tokens=batch, batch=batch, cuda_graph=True, error=t.graph_error[:500])
    if compare_launch and not str(device).startswith("cuda"):
        print("throughput: --compare-launch skipped (the launch shortcut is CUDA-only)", flush=True)
    elif compare_launch:  # the same eager step with every Triton launch through kernel[grid]
        from harness.impls.triton._common import jit_launches
        with torch.inference_mode(), no_index_checks(), jit_launches():
            st = measure([decode_fn], device, Budget(min_reps=reps, warmup=max(warmup, 2))).fields()
        emit(op="model_decode_jit_launch", tokens=batch, batch=batch, tok_s=batch / (st["ms_p50"] / 1e3), **st)
    if profile_dir:
        with torch.inference_mode(), no_index_checks():
            for path in profile_decode(decode_fn, device, profile_dir, cfg.family, cfg.n_layer):
                print(f"throughput: decode profile -> {path}", flush=True)


def hf_model_class_and_config(cfg: ModelConfig):
    """transformers' CausalLM class for `cfg`'s family and its config object (from the family's HF config)."""
    import transformers
    d = families.get(cfg.family).to_hf(cfg)
    d.update(tie_word_embeddings=False, residual_in_fp32=True, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model_type, arch = d.pop("model_type"), d.pop("architectures")[0]
    return getattr(transformers, arch), transformers.AutoConfig.for_model(model_type, **d)


def hf_config(cfg: ModelConfig):
    return hf_model_class_and_config(cfg)[1]


def hf_throughput(cfg, device, dtype, prefill: int, batch: int, *, reps: int, warmup: int, new_tokens: int, emit):
    from harness.bench.timing import Budget, measure, wall_samples
    try:
        cls, hc = hf_model_class_and_config(cfg)
        with torch.device(device):
            model = cls(hc).to(dtype).eval()
    except Exception as e:  # noqa: BLE001
        emit(op="model_prefill", tokens=prefill, batch=1, error=f"{type(e).__name__}: {e}"[:500])
        return
    V = cfg.vocab_size_unpadded
    g = torch.Generator(device=device).manual_seed(1)
    try:
        ids = torch.randint(0, V, (1, prefill), device=device, generator=g)
        with torch.inference_mode():
            st = measure([lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)], device,
                         Budget(min_reps=reps, warmup=warmup)).fields()
        emit(op="model_prefill", tokens=prefill, batch=1, tok_s=prefill / (st["ms_p50"] / 1e3), **st)
    except Exception as e:  # noqa: BLE001
        emit(op="model_prefill", tokens=prefill, batch=1, error=f"{type(e).__name__}: {e}"[:500])
    try:
        ids = torch.randint(0, V, (batch, 8), device=device, generator=g)

        def gen(n):
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0, use_cache=True)

        gen(2)
        # the fastest of a few samples of each length; on a busy host the difference can come out <= 0 (the
        # longer run's best sample beat by the shorter's worst luck): sample both lengths again, once
        n = max(3, reps // 3)
        short = wall_samples(lambda: gen(2), device, n)
        long = wall_samples(lambda: gen(2 + new_tokens), device, n)
        if min(long) <= min(short):
            short += wall_samples(lambda: gen(2), device, 2 * n)
            long += wall_samples(lambda: gen(2 + new_tokens), device, 2 * n)
            n *= 3
        step_ms = (min(long) - min(short)) / new_tokens
        if step_ms <= 0:
            raise RuntimeError(f"timing noise: generate with {2 + new_tokens} tokens was not slower than with 2 "
                               f"in {n} samples of each")
        emit(op="model_decode", tokens=batch, batch=batch, tok_s=batch / (step_ms / 1e3), ms_p20=step_ms,
             ms_p50=step_ms, ms_p80=step_ms, reps=n, method="min generate(k+n) - min generate(k), per step")
    except Exception as e:  # noqa: BLE001
        emit(op="model_decode", tokens=batch, batch=batch, error=f"{type(e).__name__}: {e}"[:500])
    del model


def build_parser():
    p = argparse.ArgumentParser(prog="harness bench throughput", description=__doc__.splitlines()[0])
    add_args(p)
    return p


def run_cli(args) -> int:
    """`harness bench throughput`: an unknown --impl is a usage error (exit 4), a bad value exits 2."""
    from harness.bench.registry import UnknownName, check_names
    from harness.impls.registry import all_impls
    try:
        if ":" not in args.impl:
            check_names("--impl", [args.impl], sorted(all_impls()))
        check_names("--family", [args.family], families.names())
        return run(args)
    except UnknownName as e:
        print(f"throughput: {e}", file=sys.stderr)
        return 4
    except ValueError as e:
        print(f"throughput: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    return run_cli(build_parser().parse_args(argv))


def run(args) -> int:
    from harness.devices import CHOICES, prepare, resolve_or_exit
    device = args.device
    kind = resolve_or_exit(device.split(":")[0] if device.split(":")[0] in CHOICES else device,
                           "harness bench throughput")
    device = kind if device in CHOICES else device
    prepare(kind)
    from harness.impls import registry
    for name in ("layers", "d_model", "prefill", "decode_batch", "reps"):
        v = getattr(args, name)
        if v < 1:
            fail(f"--{name.replace('_', '-')}", "a positive int", v)
    dims = dict(PRESETS[args.preset]) if args.preset else dict(
        family=args.family, layers=args.layers, d_model=args.d_model, d_state=args.d_state, dt_rank=args.dt_rank,
        head_dim=args.head_dim, n_groups=args.n_groups,
        vocab=args.vocab or families.get(args.family).typical_vocab_size, chunk_size=args.chunk_size)
    family = dims.pop("family")
    cfg = model_config(family, dims.pop("layers"), dims.pop("d_model"), **dims)
    dtype = getattr(torch, args.dtype)
    impl = registry.get(args.impl)
    why = impl.why_unavailable(device)
    if why:
        fail("--impl", f"an implementation usable on {device}", f"{impl.name!r}: {why}")
    profile_dir = getattr(args, "profile_decode", None)
    if profile_dir:
        import os
        if os.path.exists(profile_dir) and not os.path.isdir(profile_dir):
            fail("--profile-decode", "a folder (made if missing)", f"{profile_dir!r}, a file")
        os.makedirs(profile_dir, exist_ok=True)
    writer = None
    if args.out:
        from harness.env import environment
        from harness.records import RecordWriter
        writer = RecordWriter(args.out)
        writer.write("env", env=environment(device), bench=dict(kind="model_throughput", reps=args.reps,
                                                                warmup=args.warmup))
    shape = dict(family=cfg.family, layers=cfg.n_layer, d_model=cfg.d_model, vocab=cfg.vocab_size,
                 prefill=args.prefill, decode_batch=args.decode_batch, **families.get(cfg.family).summary(cfg))
    rows: list = []

    def emitter(source, impl_name):
        def emit(**f):
            base = dict(bench=f"model/{cfg.family}/{f['op']}/{impl_name}", impl=impl_name, device=device,
                        dtype=args.dtype, shape=shape, source=source, cuda_graph=False, peer=source != "engine")
            base.update(f)
            _record(writer, rows, **base)
        return emit
    print(f"throughput: {cfg.family} {cfg.n_layer} layers d_model {cfg.d_model} on {device} ({args.dtype}), "
          f"impl {impl.name}", flush=True)
    params = device_params(cfg, device, dtype, args.seed)
    engine_throughput(cfg, params, impl, device, dtype, args.prefill, args.decode_batch, reps=args.reps,
                      warmup=args.warmup, graphs=not args.no_graphs, emit=emitter("engine", impl.name),
                      profile_dir=profile_dir, compare_launch=args.compare_launch)
    del params
    import gc
    gc.collect()  # the runner holds a reference cycle (scheduler -> chunk_fn -> runner)
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    if not args.no_hf:
        hf_throughput(cfg, device, dtype, args.prefill, args.decode_batch, reps=args.reps, warmup=args.warmup,
                      new_tokens=args.hf_new_tokens, emit=emitter("transformers", "transformers"))
    return 1 if any(r.get("error") and r["source"] == "engine" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
