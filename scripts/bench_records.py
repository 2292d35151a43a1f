"""Turn the side-by-side benchmark scripts' JSONL into result records (harness.records, schema 1), so
`harness gate` and `harness report` read them next to `harness bench`'s own timings.

    python scripts/bench_records.py SOURCE IN.jsonl OUT.jsonl [--env ENV.json] [--run-id ID]

SOURCE names the script that wrote IN.jsonl:
  peer_cuda   scripts/gpu_peer_cuda_bench.py   our ops next to the peers' CUDA kernels
  ops         scripts/gpu_ops_bench.py         our ops next to mamba_ssm's Triton ops (phases A and C;
                                               the sweep entries of phase B are left out)
  ssd         scripts/ssd_variants.py          ssd_varlen next to mamba_ssm's mamba_chunk_scan_combined
                                               (the default launch only; tuning variants are left out)

Every timing becomes one `timing` record (bench `<source>/<op>/<impl>`, bf16); an impl spelled
`NAME-graph` becomes NAME with cuda_graph=true and bench `<source>/<op>/<impl>/cuda_graph` (CUDA-graph
replays, GPU time only; the bench id keeps it apart from the eager case); mamba_ssm's and
causal-conv1d's kernels are marked peer=true. OUT.jsonl gets an `env` record first: the one IN.jsonl
carries, else ENV.json (a JSON object), else this machine's (harness.env.environment("cuda")).
Records are appended; an unknown line raises ValueError naming the line before anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.records import RecordWriter  # noqa: E402
from reference.validate import fail  # noqa: E402

SOURCES = ("peer_cuda", "ops", "ssd")
PEERS = ("mamba_ssm", "causal_conv1d")
SSD_SHAPE = {"H": 128, "P": 64, "G": 8, "N": 128, "chunk": 256}


def _impl(name: str) -> tuple[str, bool, bool]:
    """(impl, cuda_graph, peer) of a script's impl label."""
    graph = name.endswith("-graph")
    base = name[: -len("-graph")] if graph else name
    if base.endswith("-triton"):          # gpu_ops_bench: "mamba_ssm-triton" is mamba_ssm's Triton op
        base = base[: -len("-triton")]
    return base, graph, base.startswith(PEERS)


def _shape(s) -> dict:
    """A shape dict from a dict or a 'D=10240 K=4 L=4096' / '256 MiB d2d' string."""
    if isinstance(s, dict):
        return dict(s)
    m = re.fullmatch(r"(\d+) MiB d2d", str(s))
    if m:
        return {"bytes": int(m.group(1)) << 20}
    out = {}
    for tok in str(s).split():
        k, _, v = tok.partition("=")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def _timing(source: str, op: str, shape: dict, label: str, **fields) -> dict:
    impl, graph, peer = _impl(label)
    if op.startswith("selective_state_update/"):   # gpu_ops_bench's m1/m2 suffix is the state layout
        op, layout = op.split("/", 1)
        shape = {"layout": {"m1": "mamba1", "m2": "mamba2"}.get(layout, layout), **shape}
    rec = dict(bench=f"{source}/{op}/{impl}" + ("/cuda_graph" if graph else ""), op=op, impl=impl, device="cuda:0",
               dtype="uint8" if op == "copy" else "bfloat16", shape=shape, tokens=None, peer=peer,
               cuda_graph=graph, level="kernel")
    rec.update(fields)
    return rec


def convert(source: str, rows: list[dict], path: str = "IN") -> tuple[dict | None, list[dict]]:
    """(env payload or None, timing fields) of one script's rows."""
    if source not in SOURCES:
        fail("SOURCE", f"one of {SOURCES}", source)
    env, out = None, []
    for i, r in enumerate(rows, 1):
        kind = r.get("kind")
        if kind == "env":
            env = r.get("env") or {k: v for k, v in r.items() if k != "kind"}
        elif source == "peer_cuda" and kind is None and "op" in r:
            f = {k: r.get(k) for k in ("ms_p20", "ms_p50", "ms_p80", "bytes", "gb_s", "pct_copy_bw")}
            if r.get("error"):
                f["error"] = r["error"]
            out.append(_timing(source, r["op"], _shape(r["shape"]), r["impl"], **f))
        elif source == "ops" and kind == "timing":
            if r.get("phase") == "B":
                continue
            ms = r.get("ms")
            f = dict(ms_p50=ms, gb_s=r.get("gbps"), bytes=round(r["gbps"] * ms * 1e6) if ms and r.get("gbps") else None)
            if r.get("config"):
                f["config"] = r["config"]
            out.append(_timing(source, r["op"], _shape(r["shape"]), r["impl"], **f))
        elif source == "ssd" and kind in ("variant", "peer"):
            if kind == "variant" and r.get("variant") != "default":
                continue
            shape = _shape(r["shape"]) if "shape" in r else {**SSD_SHAPE, "L": r["L"]}
            label = "triton" if kind == "variant" else r.get("impl", "mamba_ssm")
            if r.get("error"):
                out.append(_timing(source, "ssd_varlen", shape, label, ms_p50=None, error=r["error"]))
                continue
            out.append(_timing(source, "ssd_varlen", shape, label, ms_p50=r["ms"]))
            if r.get("ms_graph") is not None:
                out.append(_timing(source, "ssd_varlen", shape, label + "-graph", ms_p50=r["ms_graph"]))
        else:
            fail(f"{path} line {i}", f"a {source} record", json.dumps(r)[:120])
    copy = [t for t in out if t["op"] == "copy" and t.get("gb_s")]
    if copy:
        for t in out:
            if t.get("gb_s") and t.get("pct_copy_bw") is None:
                t["pct_copy_bw"] = 100.0 * t["gb_s"] / copy[0]["gb_s"]
    return env, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", choices=SOURCES)
    p.add_argument("inp", metavar="IN.jsonl")
    p.add_argument("out", metavar="OUT.jsonl")
    p.add_argument("--env", default=None, metavar="ENV.json", help="env payload when IN.jsonl has none")
    p.add_argument("--run-id", default=None)
    a = p.parse_args(argv)
    if not os.path.isfile(a.inp):
        fail("IN.jsonl", "an existing file", a.inp)
    with open(a.inp) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    env, timings = convert(a.source, rows, a.inp)
    if env is None and a.env:
        with open(a.env) as f:
            env = json.load(f)
    if env is None:
        from harness.env import environment
        env = environment("cuda")
    w = RecordWriter(a.out, run_id=a.run_id)
    w.write("env", env=env, bench=dict(source=a.source))
    for t in timings:
        w.write("timing", **t)
    print(f"{a.out}: {len(timings)} timing records from {a.inp} ({a.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
