"""Loading-speed benchmark: our loaders next to transformers' from_pretrained on one synthetic checkpoint.

    harness bench loader --size-gb 1 [--dtype bfloat16] [--device cpu] [--dir PATH] [--reps N] [--out JSONL] [--json OUT]

Writes a synthetic Mamba-2 checkpoint of at least `--size-gb` GB (HF layout: config.json with
model_type mamba2, `backbone.*` names, safetensors shards of <= 512 MB with an index) to a temp folder,
then times, in one run and in this order:
  * harness.loader.load_weights (safetensors mmap straight to the device/dtype),
  * harness.loader.load_weights with tp_size=2, rank 0 (half of every mixer weight),
  * reference.loader.load_checkpoint (plain full reads),
  * transformers Mamba2ForCausalLM.from_pretrained(folder, dtype=...).
Each timing is wall-clock from the call until one element of every 4 KiB page of every returned
tensor has been read (mmap-backed results are paid for like copied ones); the page cache is warm for
every contender alike (the file was just written); `--reps` loads per contender (default 1), timed with
harness.bench.timing.wall_samples. Every loader's result is checked against the harness load on a
few tensors so that a fast-but-wrong loader cannot win. `--out` appends one timing record per contender
(bench `loader/<contender>`, ms p20/p50/p80 of the loads, GB/s of checkpoint data delivered) that the gate
and the report read; `--json` writes the summary as one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness.bench.args import add_loader_args as add_args  # the parser needs no torch
from harness.records import write_json


def mamba2_config(n_layer: int, d_model: int = 2048, vocab: int = 50288) -> dict:
    return {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": d_model,
            "num_hidden_layers": n_layer, "vocab_size": vocab, "state_size": 128, "expand": 2, "head_dim": 64,
            "num_heads": 2 * d_model // 64, "n_groups": 8, "conv_kernel": 4, "chunk_size": 256,
            "use_bias": False, "use_conv_bias": True, "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
            "tie_word_embeddings": True, "time_step_limit": [0.0, {"__float__": "Infinity"}],
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def write_checkpoint(folder: Path, size_gb: float, dtype: torch.dtype, shard_mb: int = 512,
                     d_model: int = 2048) -> tuple[dict, int]:
    """Write the synthetic checkpoint; returns (config dict, bytes of tensor data)."""
    from safetensors.torch import save_file
    from reference.loader import detect_config, expected_parameters
    el = torch.tensor([], dtype=dtype).element_size()
    probe = detect_config(mamba2_config(1, d_model))
    shapes1 = expected_parameters(probe)
    per_layer = sum(math.prod(s) for n, s in shapes1.items() if n.startswith("layers.0.")) * el
    fixed = (math.prod(shapes1["embedding.weight"]) + probe.d_model) * el
    n_layer = max(1, math.ceil((size_gb * 1e9 - fixed) / per_layer))
    cfg_dict = mamba2_config(n_layer, d_model)
    cfg = detect_config(cfg_dict)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    g = torch.Generator().manual_seed(0)
    names = {"embedding.weight": "backbone.embeddings.weight", "norm_f.weight": "backbone.norm_f.weight"}
    shard, shard_bytes, idx, weight_map, total = {}, 0, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, idx
        if shard:
            idx += 1
            fname = f"model-{idx:05d}.safetensors"
            save_file(shard, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            shard, shard_bytes = {}, 0

    for name, shape in expected_parameters(cfg).items():
        if name == "lm_head.weight":
            continue  # tied
        key = names.get(name, "backbone." + name)
        if name.endswith("A_log"):
            t = torch.log(torch.rand(shape, generator=g) * 15 + 1)
        elif name.endswith("norm.weight") or name == "norm_f.weight" or name.endswith(".D"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * 0.02
        t = t.to(dtype)
        nb = t.numel() * t.element_size()
        if shard_bytes and shard_bytes + nb > shard_mb * 2**20:
            flush()
        shard[key] = t
        shard_bytes += nb
        total += nb
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return cfg_dict, total


def _touch(tensors) -> float:
    """Read one element of every 4 KiB page of every tensor, so that lazily memory-mapped results
    are paid for like copied ones (each loader's timing includes this)."""
    total, seen = 0.0, set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        step = max(1, 4096 // t.element_size())
        total += float(t.reshape(-1)[::step].float().sum())
    return total


def _timed(fn, tensors_of, device: str = "cpu", reps: int = 1):
    """(result of the last load, seconds of each load)."""
    from harness.bench.timing import wall_samples
    box = []

    def load():
        box.clear()
        gc.collect()
        box.append(fn())
        _touch(tensors_of(box[0]))
    ms = wall_samples(load, device, reps)
    return box[0], [m / 1e3 for m in ms]


def run(size_gb: float, dtype_name: str, device: str, folder: Path | None, keep: bool, reps: int = 1,
        d_model: int = 2048) -> dict:
    from harness.loader import load_weights
    from reference.loader import load_checkpoint
    dtype = getattr(torch, dtype_name)
    tmp = None
    if folder is None:
        tmp = tempfile.mkdtemp(prefix="loader_bench_")
        folder = Path(tmp)
    try:
        t0 = time.perf_counter()
        cfg_dict, nbytes = write_checkpoint(folder, size_gb, dtype, d_model=d_model)
        write_s = time.perf_counter() - t0
        gb = nbytes / 1e9
        results = {"checkpoint": {"bytes": nbytes, "n_layer": cfg_dict["num_hidden_layers"],
                                  "d_model": cfg_dict["hidden_size"], "dtype": dtype_name,
                                  "files": len(list(folder.glob("*.safetensors"))), "write_s": write_s},
                   "device": device, "torch": torch.__version__, "loads": {}, "samples": {}}

        def timed(name, fn, tensors_of):
            out, secs = _timed(fn, tensors_of, device, reps)
            results["samples"][name] = secs
            results["loads"][name] = sorted(secs)[len(secs) // 2]
            return out

        ours = timed("harness.loader", lambda: load_weights(folder, device=device, dtype=dtype),
                     lambda w: w.params.values())
        probe = {k: ours.params[k].float().cpu().clone() for k in
                 ("embedding.weight", "layers.0.mixer.in_proj.weight", f"layers.{cfg_dict['num_hidden_layers'] - 1}.mixer.A_log")}
        del ours

        tp = timed("harness.loader tp=2 rank0", lambda: load_weights(folder, device=device, dtype=dtype, tp_rank=0,
                                                                     tp_size=2), lambda w: w.params.values())
        results["tp_rank0_bytes"] = tp.bytes_read
        del tp

        ref = timed("reference.loader", lambda: load_checkpoint(folder, dtype=dtype), lambda c: c.params.values())
        for k, v in probe.items():
            assert torch.equal(ref.params[k].float().cpu(), v), f"reference loader disagrees on {k}"
        del ref

        try:
            import logging
            from transformers import Mamba2ForCausalLM
            from transformers.utils import logging as hf_logging
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            logging.getLogger("transformers").setLevel(logging.ERROR)
            kw = {} if device == "cpu" else {"device_map": device}  # device_map needs accelerate
            hf = timed("transformers.from_pretrained",
                       lambda: Mamba2ForCausalLM.from_pretrained(str(folder), dtype=dtype, **kw),
                       lambda m: list(m.state_dict().values()))
            sd = hf.state_dict()
            assert torch.equal(sd["backbone.embeddings.weight"].float().cpu(), probe["embedding.weight"])
            del hf, sd
        except Exception as e:  # report, don't hide
            results["loads"]["transformers.from_pretrained"] = None
            results["samples"]["transformers.from_pretrained"] = []
            results["transformers_error"] = f"{type(e).__name__}: {e}"
        # GB/s of checkpoint data delivered (the TP row delivers only rank 0's share)
        results["throughput_gb_s"] = {
            k: (((results["tp_rank0_bytes"] / 1e9) if "tp=2" in k else gb) / v if v else None)
            for k, v in results["loads"].items()}
        return results
    finally:
        if tmp is not None and not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def write_records(r: dict, path: str) -> None:
    """One timing record per contender (bench loader/<name>), after an env record."""
    from harness.bench.timing import summarize
    from harness.env import environment
    from harness.records import RecordWriter
    ck = r["checkpoint"]
    w = RecordWriter(path)
    w.write("env", env=environment(r["device"]), bench=dict(kind="loader"))
    shape = dict(bytes=ck["bytes"], n_layer=ck["n_layer"], d_model=ck["d_model"], files=ck["files"])
    for name, secs in r["samples"].items():
        base = dict(bench=f"loader/{name}", op="load_checkpoint", impl=name, device=r["device"], dtype=ck["dtype"],
                    shape=shape, tokens=None, peer=name.startswith("transformers"), cuda_graph=False, level="model")
        if r["loads"].get(name) is None:
            w.write("timing", **base, ms_p20=None, ms_p50=None, ms_p80=None, gb_s=None,
                    error=r.get("transformers_error", "failed"))
            continue
        st = summarize([s * 1e3 for s in secs])
        nbytes = r["tp_rank0_bytes"] if "tp=2" in name else ck["bytes"]
        w.write("timing", **base, ms_p20=st.ms_p20, ms_p50=st.ms_p50, ms_p80=st.ms_p80, reps=st.n,
                eager_ms_p50=st.ms_p50, timer="wall_samples", bytes=nbytes, gb_s=nbytes / (st.ms_p50 * 1e-3) / 1e9)


def run_cli(a) -> int:
    from reference.validate import fail
    if not a.size_gb >= 0.01:
        fail("--size-gb", "a number >= 0.01", a.size_gb)
    if not a.reps >= 1:
        fail("--reps", "an int >= 1", a.reps)
    if not (a.d_model >= 256 and a.d_model % 256 == 0):
        fail("--d-model", "a positive multiple of 256 (64-wide heads in 8 groups)", a.d_model)
    r = run(a.size_gb, a.dtype, a.device, a.dir, a.keep, a.reps, a.d_model)
    ck = r["checkpoint"]
    print(f"checkpoint: {ck['bytes'] / 1e9:.3f} GB, Mamba-2 d_model {ck['d_model']} x {ck['n_layer']} layers, "
          f"{ck['dtype']}, {ck['files']} safetensors shards (written in {ck['write_s']:.1f} s); device {r['device']}")
    print(f"{'loader':34s} {'seconds':>9s} {'GB/s':>8s}")
    for k, v in r["loads"].items():
        if v is None:
            print(f"{k:34s} {'failed':>9s}   {r.get('transformers_error', '')}")
        else:
            print(f"{k:34s} {v:9.2f} {r['throughput_gb_s'][k]:8.2f}")
    if a.out:
        write_records(r, a.out)
    if a.json:
        write_json(a.json, r, indent=2)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.loader", description=__doc__.split("\n")[0])
    add_args(p)
    a = p.parse_args(argv)
    try:
        return run_cli(a)
    except ValueError as e:
        print(f"loader: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
