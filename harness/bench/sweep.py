"""`harness bench sweep --op OP`: launch-configuration sweeps of our Triton kernels.

Each sweepable op has groups of candidates (`SWEEPS`); a candidate is a partial override of a kernel
module's launch configuration (its `CONFIG`, or `TUNING` for ssd; object values merge one level, so
{"chunk_scan": {"num_warps": 4}} changes one SSD stage parameter). Groups run in order; each group
times the current configuration and every candidate at the op's benchmark shapes the group affects
(docs/targets.md on GPUs; the tiny CPU shapes under the interpreter), with harness.bench.timing, ranked
by CUDA-graph p50 on CUDA (GPU time: launch parameters do not change the host's share) and eager p50
elsewhere. A candidate replaces the current configuration when its geometric-mean time over those
shapes is at least `--min-gain` lower, and its outputs (and the pool it writes) match the current
configuration's on the same inputs, in two runs that agree bit for bit (a racy compile can pass one run);
later groups sweep on top of the winners. Before it is timed, every
configuration (the starting one too) must pass the op's conformance cases against the float64 reference
(`CHECKS`: the delta-rule prefills at fp16 and bf16, K = 128, each case run twice); one that fails is recorded
with the reason and left out, and a starting configuration that fails stops the op's sweep (no file
written). At the end the module's full configuration is written to configs/<device>/<module>.json
(harness/impls/triton/configs/, the file `launch_config` reads on that device), unless --no-write. Every
timed candidate is a timing record (bench `sweep/<op>/<group>/<n>`, candidate 0 = the configuration the group
started from).

    harness bench sweep --op causal_conv1d_varlen --device cuda
    harness bench sweep --op ssd_varlen --group chunk_scan,variants --budget 300
    harness bench sweep --op selective_state_update --list
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SweepGroup:
    name: str
    module: str                          # harness.impls.triton.<module>
    candidates: list                     # partial overrides of the module's configuration
    attr: str = "CONFIG"                 # the module's configuration dict
    applies: Callable = field(default=lambda shape: True)   # the op's shapes the group's parameters affect
    shape_class: str = "default"         # the class of configs/<device>/<module>.json it writes


def _grid(**axes) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(axes[k] for k in keys))]


def _first(first: list, rest: list) -> list:
    """`first`, then the candidates of `rest` not in it (a group's most important candidates lead)."""
    return first + [c for c in rest if c not in first]


def _rows(keys: tuple, rows: list) -> list[dict]:
    return [dict(zip(keys, r)) for r in rows]


def _layout(name):
    return lambda shape: shape.get("layout") == name


# GDN's per-chunk stage in two launches (prep_split: T and the key norms stored, then w, u and kg in programs
# of wu_bw columns): offline for sm_90 at the bench shape the first launch takes 156 registers at 4 warps
# against the fused launch's 254 (3 programs per SM instead of 2), the second 78 (blocks of 64) or 147 (128)
_SPLIT_PREP = [{"prep_split": True}, {"prep_split": True, "t_products": "half"}, {"prep_split": True, "wu_bw": 128},
               {"prep_split": True, "wu_warps": 8}, {"prep_split": True, "prep_warps": 8}]
# The GDN recurrence holding S^T (K, BV) (state_major "key"): offline for sm_90 at the bench shape both of its
# products compile to warpgroup MMAs (the value-major tile's update v'^T kg, BV = 32 rows, to mma.sync),
# 168 registers at 32 value rows over 4 warps (107 at 16; 64 rows spill at 4 warps)
_KEY_MAJOR = _rows(("state_major", "update_keys", "bv", "scan_warps", "scan_stages"), [
    ("key", "stored", 32, 4, 2), ("key", "stored", 32, 4, 3), ("key", "stored", 16, 4, 2), ("key", "rows", 32, 4, 2),
    ("key", "stored", 64, 8, 2)])
_SCAN_STAGE = ("block_m", "block_k", "heads", "num_warps", "num_stages", "maxnreg", "early_epilogue")
_STATE_STAGE = ("block_p", "block_n", "block_k", "heads", "num_warps", "num_stages", "maxnreg")
# (value rows, warps) of the decode update with at most 64 state values a thread (K 128), tried first
_UPDATE_NOSPILL = [(16, 1), (32, 4), (16, 2), (32, 8), (64, 8), (8, 1)]

# The candidates of the H200 sweeps that set the modules' defaults, most important first. Where a group leads
# with settings "with the fewest registers", the order came from offline sm_90 compiles
# (`python -m harness.impls.triton.aot --shapes gpu --resources`) made from the argument types alone, which
# inflated every figure (scalar loads); compiled with the JIT's alignment facts, as the tool now does, the
# defaults keep at most a few hundred bytes of stack (SSD chunk scan, KDA per-chunk launch) or none. The order
# only decides what a sweep cut by --candidates tries: the timings choose.
SWEEPS: dict[str, list[SweepGroup]] = {
    "selective_scan_varlen": [
        SweepGroup("scan", "selective_scan", _rows(("bd", "warps", "pf", "chunk"), [
            (16, 1, 4, 512), (32, 1, 4, 512), (32, 1, 4, 256), (32, 1, 2, 256), (16, 1, 2, 512)])),
        # the time-parallel mode: tokens per block, channels per program, warps, each at today's piece length
        # and at chunk 0 (one pass per sequence where the channel blocks alone give enough programs: no second
        # pass over the exponentials). Tiles (bt, N 16, bd) of more than 64 fp32 values per thread are left
        # out: at sm_90 they spill (ptxas) or run at a few warps per SM.
        # Most important first (a tile per register budget, single pass before pieces), then the rest.
        SweepGroup("assoc", "selective_scan", _first([
            dict(mode="assoc", bt=bt, bd=bd, warps=w, chunk=ch) for bt, bd, w, ch in (
                (16, 8, 4, 0), (32, 8, 4, 0), (16, 16, 4, 0), (32, 4, 4, 0), (16, 8, 4, 256), (16, 4, 2, 0),
                (64, 4, 4, 0), (32, 8, 8, 0), (32, 16, 8, 0), (16, 32, 8, 0), (16, 16, 8, 256), (64, 8, 8, 0))],
            [dict(c, mode="assoc", chunk=ch) for c in _grid(bt=(16, 32, 64), bd=(4, 8, 16, 32), warps=(2, 4, 8))
             if c["bt"] * c["bd"] <= 128 * c["warps"] for ch in (256, 0)])),
        # the other register layout of the "assoc" tiles (B/C rows broadcast over the channel block: tokens
        # in-thread), at the tile shapes that compile without spills at moderate register counts
        SweepGroup("assoc_layout", "selective_scan", [
            dict(mode="assoc", bc_full=True, bt=bt, bd=bd, warps=w, chunk=ch)
            for bt, bd, w in ((16, 8, 4), (32, 8, 4), (32, 4, 4), (16, 16, 8), (32, 8, 8), (64, 4, 4), (16, 4, 2))
            for ch in (256, 0)]),
    ],
    "causal_conv1d_varlen": [SweepGroup("prefill", "conv1d", _rows(
        ("bt", "bd", "warps", "stages", "chunks", "progs", "dfirst", "maxnreg"), [
            (8, 1024, 8, 3, 8, 1024, False, 0), (8, 1024, 4, 3, 8, 1024, False, 0), (8, 512, 4, 3, 8, 1024, False, 0),
            (16, 1024, 8, 2, 4, 1024, False, 0), (16, 512, 4, 2, 4, 1024, False, 0), (8, 1024, 8, 4, 8, 1024, False, 0),
            (8, 1024, 8, 3, 8, 2048, False, 0), (8, 1024, 8, 3, 16, 512, False, 0), (8, 1024, 8, 3, 8, 1024, True, 0),
            (8, 1024, 8, 1, 2, 2048, False, 0), (8, 1024, 8, 3, 8, 1024, False, 64),
            (4, 1024, 8, 4, 16, 1024, False, 0)]))],
    "causal_conv1d_update": [SweepGroup("update", "conv1d", _rows(("upd_bd", "upd_warps", "upd_rows"), [
        (512, 4, 2), (512, 4, 1), (512, 4, 4), (1024, 4, 1), (1024, 8, 2), (1024, 8, 1), (2048, 8, 1), (256, 2, 2),
        (256, 4, 4), (256, 8, 4), (128, 4, 8), (512, 2, 2)]))],
    "selective_state_update": [
        # the head-dim blocks on grid axis 0 first (consecutive programs on consecutive state blocks)
        SweepGroup("mamba2", "selective_state_update", _first(
            [{"m2_pfirst": 1}, {"m2_pfirst": 1, "m2_bp": 8}, {"m2_pfirst": 1, "m2_bp": 4, "m2_warps": 4}],
            _grid(m2_bp=(4, 8, 16, 32), m2_warps=(2, 4, 8), m2_pfirst=(0, 1))), applies=_layout("mamba2")),
        SweepGroup("mamba1", "selective_state_update", _rows(("m1_bd", "m1_rows", "m1_warps", "m1_tiles", "m1_dfirst"), [
            (32, 4, 2, 1, 1), (64, 2, 2, 1, 1), (128, 2, 2, 1, 1), (16, 8, 4, 1, 1), (32, 8, 4, 1, 1), (16, 4, 2, 1, 1),
            (32, 4, 4, 1, 1), (64, 4, 2, 1, 1), (32, 8, 8, 1, 1), (16, 4, 2, 2, 1), (16, 8, 4, 2, 1),
            (32, 4, 2, 1, 0)]), applies=_layout("mamba1")),
    ],
    "selective_state_update_spec": [
        SweepGroup("mamba2", "spec_decode", _grid(m2_bp=(4, 8, 16, 32), m2_warps=(2, 4, 8)), applies=_layout("mamba2")),
        SweepGroup("mamba1", "spec_decode", _grid(m1_bd=(16, 32, 64, 128), m1_warps=(1, 2, 4)),
                   applies=_layout("mamba1")),
    ],
    "causal_conv1d_update_spec": [SweepGroup("update", "spec_decode", _grid(conv_bd=(128, 256, 512, 1024),
                                                                            conv_warps=(1, 2, 4, 8)))],
    "gated_delta_rule_varlen": [
        # the pipeline: outputs from the per-chunk states in a parallel launch, or inside the sequential scan
        SweepGroup("outputs", "delta_rule_chunk", [{"outputs": "parallel"}, {"outputs": "scan"},
                                                   {"outputs": "scan", "bv": 16}]),
        # the per-sequence state recurrence (either pipeline): value rows per program (programs at batch 1:
        # Hv * V / bv), warps, stages
        # First the layouts of fla-core's recurrence, the fastest measured beside ours: the update's decays on
        # the rows of v' with k loaded in the recurrence (update_keys "rows": no kg scratch written by the
        # per-chunk launch and read back), 32 or 64 value rows over 2 or 4 warps, 2 or 3 stages; then the
        # stored keys from the fewest registers (16 rows at 4 warps) up. Leading them, the key-major state tile
        # (`_KEY_MAJOR`).
        SweepGroup("scan", "delta_rule_chunk", _first(_KEY_MAJOR + _rows(
            ("update_keys", "bv", "scan_warps", "scan_stages"), [
                ("rows", 64, 4, 2), ("rows", 32, 4, 2), ("rows", 64, 2, 2), ("rows", 64, 4, 3), ("rows", 32, 2, 2),
                ("rows", 32, 4, 3)]) + _rows(("bv", "scan_warps", "scan_stages"), [(64, 4, 2), (64, 4, 3), (16, 4, 2)]),
            _rows(("bv", "scan_warps", "scan_stages"), [
                (16, 4, 2), (16, 4, 1), (32, 4, 2), (64, 4, 2), (32, 8, 2), (32, 4, 1), (32, 4, 3), (16, 2, 2),
                (16, 4, 3), (64, 8, 2), (64, 8, 3), (16, 1, 2), (16, 2, 3)])
            + _rows(("update_keys", "bv", "scan_warps", "scan_stages"), [
                ("rows", 32, 8, 2), ("rows", 64, 8, 2), ("rows", 64, 8, 3), ("rows", 16, 4, 2)]))),
        # the parallel output launch (chunks x value heads x value blocks of out_bv rows): no effect on "scan"
        # (first a program per key head over its value heads, q k^T formed once for them: at the whole value
        # width over 8 warps once per chunk and key head (212 registers offline, no spill); then key blocks of
        # 32 / 16, the fewest registers; then the module's 64-column blocks). One pipeline stage throughout: at
        # two, Triton 3.6 compiles this loop for sm_90 into programs whose outputs differ from run to run, at
        # 128- and at 64-column key blocks (docs/findings.md)
        SweepGroup("output", "delta_rule_chunk", _first(_rows(("out_heads", "out_bk", "out_bv", "out_warps",
                                                               "out_stages"), [
            ("key", 64, 128, 8, 1), ("key", 64, 64, 8, 1), ("key", 32, 128, 8, 1), ("key", 64, 64, 4, 1)]),
            _first(_rows(("out_bk", "out_bv", "out_warps", "out_stages"), [
                (32, 64, 8, 1), (16, 64, 8, 1), (32, 32, 8, 1), (16, 32, 4, 1)]),
                _rows(("out_bv", "out_warps", "out_stages"), [
                    (32, 8, 1), (16, 8, 1), (64, 4, 1), (32, 4, 1), (128, 8, 1), (64, 8, 1), (32, 2, 1),
                    (128, 4, 1), (16, 4, 1)])))),
        # the parallel per-chunk stage: diagonal blocks of the (I + A)^-1 substitution, warps
        # (first T's products in bf16, as fla-core's w / u stage takes its solve's output: twice the tensor-core
        # rate of tf32, the same registers offline (255); then the stage split in two launches (`_SPLIT_PREP`);
        # then key blocks of 32 / 16 over 8 warps, the
        # fewest registers; then a program per key head over its value heads, k k^T formed once for them (at sub
        # 64 over 8 warps 231 registers offline and no spill; at sub 16, 48 bytes spilled); then the whole key
        # width per value head)
        SweepGroup("prep", "delta_rule_chunk", _first([{"t_products": "half"}] + _SPLIT_PREP, _first(
            _rows(("prep_bk", "sub", "prep_warps"), [(32, 64, 8), (16, 64, 8), (32, 16, 8), (16, 16, 8), (32, 32, 8)]),
            _rows(("prep_heads", "prep_bk", "sub", "prep_warps"), [("key", 0, 64, 8), ("key", 0, 16, 8)])
            + _rows(("sub", "prep_warps"), [(64, 8), (16, 4), (16, 8), (32, 4), (32, 8), (64, 4), (16, 2)])))),
        # chunk 32 first (the fewest registers in all three launches): all three kernels' parameters set, as
        # the groups before may have picked chunk-64 values
        SweepGroup("chunk", "delta_rule_chunk", _first([
            dict(chunk=32, sub=sub, prep_warps=pw, bv=bv, scan_warps=4, scan_stages=2, out_bv=ob, out_warps=8,
                 out_stages=1, out_bk=64, prep_bk=0)
            for sub, pw, bv, ob in ((16, 4, 16, 64), (32, 8, 16, 32), (16, 8, 32, 64))],
            [{"chunk": 32, "sub": 16}, {"chunk": 32, "sub": 32, "bv": 64}, {"chunk": 64, "state_tf32": True}])),
    ],
    "gated_delta_rule_update": [
        SweepGroup("gdn", "delta_rule_update", _first(_rows(("gdn_bv", "gdn_warps"), _UPDATE_NOSPILL),
                                                      _grid(gdn_bv=(8, 16, 32, 64), gdn_warps=(1, 2, 4, 8)))),
        SweepGroup("small_batch", "delta_rule_update", _grid(min_programs=(0, 256, 1024, 2048)),
                   applies=lambda shape: shape["B"] * shape["Hv"] < 512)],
    "kda_update": [
        SweepGroup("kda", "delta_rule_update", _first(_rows(("kda_bv", "kda_warps"), _UPDATE_NOSPILL),
                                                      _grid(kda_bv=(8, 16, 32, 64), kda_warps=(1, 2, 4, 8)))),
        SweepGroup("small_batch", "delta_rule_update", _grid(min_programs=(0, 256, 1024, 2048)),
                   applies=lambda shape: shape["B"] * shape["H"] < 512)],
    "gated_delta_rule_update_spec": [
        SweepGroup("gdn_spec", "delta_rule_update", _first(_rows(("gdn_spec_bv", "gdn_spec_warps"), _UPDATE_NOSPILL),
                                                           _grid(gdn_spec_bv=(8, 16, 32, 64),
                                                                 gdn_spec_warps=(1, 2, 4, 8))))],
    "kda_update_spec": [
        SweepGroup("kda_spec", "delta_rule_update", _first(_rows(("kda_spec_bv", "kda_spec_warps"), _UPDATE_NOSPILL),
                                                           _grid(kda_spec_bv=(8, 16, 32, 64),
                                                                 kda_spec_warps=(1, 2, 4, 8))))],
    "ssd_varlen": [
        # whole-pipeline variants (end-to-end: the stage-by-stage figures time chunk_scan on its CB-reading path)
        SweepGroup("variants", "ssd", [
            # 8 warps, 3 stages: the fused chunk_scan with the fewest registers
            {"chunk_scan": {"block_m": 128, "block_k": 64, "block_p": 64, "num_warps": 8, "num_stages": 3,
                            "maxnreg": None}},
            {"fused_cb": False}, {"fuse_front": False},
            {"chunk_scan": {"block_m": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}},
            {"chunk_scan": {"block_m": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}},
            {"chunk_state": {"heads": 1}}], attr="TUNING"),
        # the fewest registers first; a cap of 128 registers makes the fused scan spill
        SweepGroup("chunk_scan", "ssd", [{"chunk_scan": dict(c, block_p=64, block_n=64)} for c in _rows(_SCAN_STAGE, [
            (128, 64, 1, 8, 3, None, False), (64, 32, 1, 4, 2, None, False), (128, 64, 1, 8, 2, None, False),
            (128, 64, 1, 8, 2, 128, False), (128, 32, 1, 8, 3, 128, False),
            (128, 64, 1, 8, 3, 128, False), (128, 64, 1, 8, 2, 128, True), (64, 64, 1, 4, 2, None, False),
            (64, 32, 1, 4, 2, 128, False), (64, 64, 1, 8, 2, 128, False), (128, 64, 2, 8, 2, None, False),
            (64, 64, 2, 4, 2, None, False)])], attr="TUNING"),
        SweepGroup("chunk_state", "ssd", [{"chunk_state": c} for c in _rows(_STATE_STAGE, [
            (64, 128, 64, 2, 8, 2, 128), (64, 128, 64, 1, 8, 2, None), (64, 128, 32, 2, 8, 3, 128),
            (64, 128, 64, 2, 8, 3, 128), (64, 128, 64, 4, 8, 2, None), (64, 128, 32, 4, 8, 2, None),
            (64, 64, 64, 2, 4, 2, None), (64, 128, 64, 1, 4, 2, None)])], attr="TUNING"),
        # at most 32 values (elements x chunks) a thread first, or 64 at 8 warps with 16 chunks
        SweepGroup("state_passing", "ssd", [{"state_passing": c} for c in _rows(("block", "block_c", "num_warps"), [
            (1024, 8, 8), (512, 16, 4), (1024, 4, 4), (2048, 4, 8), (1024, 16, 8), (1024, 8, 4), (512, 8, 2),
            (2048, 8, 8), (1024, 16, 4), (512, 16, 2), (256, 8, 1)])],
            attr="TUNING"),
        # the separate C.B^T and cumsum stages run only on the non-default paths
        SweepGroup("bmm", "ssd", [{"fused_cb": False, "bmm": c} for c in _rows(
            ("block_m", "block_n", "block_k", "num_warps", "num_stages"),
            [(128, 128, 32, 8, 3), (128, 64, 64, 4, 3), (64, 64, 128, 4, 2)])], attr="TUNING"),
        SweepGroup("cumsum", "ssd", [{"fuse_front": False, "cumsum": c} for c in _rows(
            ("block_h", "num_warps"), [(8, 4), (16, 4), (32, 8), (4, 2)])], attr="TUNING"),
    ],
    "kda_varlen": [
        # the scan: value channels per program (programs = sequences x heads x V / bv: 128 at batch 1, H 32,
        # V 128 with bv 32), warps and load pipelining of the chunk loop
        # (8 warps first: the fewest registers)
        SweepGroup("scan", "kda_chunk", _first(_rows(("bv", "scan_warps", "scan_stages"), [
            (32, 8, 2), (16, 8, 2), (16, 8, 1), (32, 8, 1)]),
            _grid(bv=(32, 16, 64), scan_warps=(4, 8, 2), scan_stages=(2, 1, 3)))),
        # the chunk length (fewer, larger steps along the sequence; the per-chunk stage's T solve and pairwise
        # terms grow with it, and its fast path covers weaker decays only: half a chunk within fast_thr)
        # (chunk 16 first, then chunk 32 with 16 value channels over 8 warps: the fewest registers)
        SweepGroup("chunk", "kda_chunk", _rows(("bt", "bv", "scan_warps", "scan_stages", "prep_warps"), [
            (16, 32, 4, 2, 8), (16, 32, 8, 2, 8), (16, 64, 8, 2, 8), (32, 16, 8, 2, 8),
            (16, 32, 4, 2, 4), (32, 32, 4, 2, 4), (32, 64, 4, 2, 4), (32, 32, 4, 2, 8), (64, 64, 4, 2, 8),
            (64, 32, 8, 2, 8), (64, 32, 4, 3, 8), (64, 16, 4, 2, 8), (64, 32, 4, 2, 4)])),
        # the per-chunk stage: T's and Qk's products in bf16 first (as fla-core takes its solve's output), then
        # key blocks (prep_bk: offline for sm_90 at 8 warps the whole width takes 255 registers and spills 120
        # bytes; blocks of 32 channels 252 and no spill, 32 with 32 value channels per step 237, 16 232), then
        # warps, value channels per step of u / Qk u
        SweepGroup("prep", "kda_chunk", _first([{"t_products": "half"}] + _rows(("prep_bk", "prep_bv"), [
            (32, 64), (32, 32), (16, 64)]), _grid(prep_warps=(8, 4, 16), prep_bv=(64, 32, 128)))),
    ],
}


def add_args(p) -> None:
    p.add_argument("--op", action="append", default=None, help=f"op(s) to sweep (comma-separated): {', '.join(SWEEPS)}")
    p.add_argument("--group", action="append", default=None, help="candidate group(s) of the op (default all)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "xpu"))
    p.add_argument("--dtype", default=None, help="dtype (default: the op's benchmark dtype on the device)")
    p.add_argument("--candidates", type=int, default=None, metavar="N", help="only the first N candidates of a group")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="stop trying candidates after this many seconds (the groups' winners so far are kept)")
    p.add_argument("--min-gain", type=float, default=0.01,
                   help="a candidate must be this fraction faster (geometric mean over the shapes) to win")
    p.add_argument("--config-dir", default=None, metavar="DIR",
                   help="where configs/<device>/<module>.json go (default: the package's harness/impls/triton/configs)")
    p.add_argument("--device-name", default=None,
                   help="the configs folder (default: this machine's, e.g. h200; cpu under the interpreter)")
    p.add_argument("--no-write", action="store_true", help="report the winners, write no config file")
    p.add_argument("--out", default=None, metavar="PATH", help="append timing records (JSONL) here "
                   "(default reports/runs/<run id>/sweep.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the groups and candidates and exit")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="sweep each (op, group) in its own process, one after the other (default: on GPUs), so a "
                        "candidate that breaks the device context (an illegal memory access) costs only the rest "
                        "of its group")


def merged(cfg: dict, override: dict) -> dict:
    """`cfg` with `override` applied (object values merged one level deep)."""
    out = copy.deepcopy(cfg)
    for k, v in override.items():
        if k not in out:
            raise ValueError(f"candidate: expected launch parameters of the module ({sorted(out)}), got {k!r}")
        out[k] = {**out[k], **v} if isinstance(out[k], dict) and isinstance(v, dict) else v
    return out


def _set(conf: dict, values: dict) -> None:
    conf.clear()
    conf.update(copy.deepcopy(values))


def _outputs(spec, inputs, result) -> list:
    """The tensors a call produced: its return value(s) and the state pool it writes."""
    import torch
    outs = [t for t in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(t, torch.Tensor)]
    pool = inputs.get(spec.pool) if spec.pool else None
    return [t.detach().float().clone() for t in outs + ([pool] if isinstance(pool, torch.Tensor) else [])]


# Conformance cases every candidate (the starting configuration too) must pass against the float64 reference
# before it is timed, run CHECK_REPS times each: shapes at which a launch setting changes the code the compiler
# emits for the half dtypes (on the H200, Triton 3.6 compiled the GDN output launch's whole-width setting to
# wrong outputs at fp16, K = 128, in most runs but not all: docs/findings.md). The timing shapes are compared
# with the starting configuration's outputs only. Per device kind: (dtypes, shapes); the CPU's are the
# interpreter's small stand-ins.
_DELTA_GPU = [dict(T=6, K=128, V=v, S=2, fresh=1, l2norm=True) for v in (64, 128)] + [
    dict(T=1077, K=128, V=128, S=3, fresh=1, l2norm=True)]
_DELTA_CPU = [dict(T=6, K=16, V=5, S=2, fresh=1, l2norm=True)]
CHECKS = {
    "gated_delta_rule_varlen": {"gpu": (("float16", "bfloat16"), [dict(s, Hk=2, Hv=4) for s in _DELTA_GPU]),
                                "cpu": (("float32",), [dict(s, Hk=2, Hv=4) for s in _DELTA_CPU])},
    "kda_varlen": {"gpu": (("float16", "bfloat16"), [dict(s, H=2) for s in _DELTA_GPU]),
                   "cpu": (("float32",), [dict(s, H=2) for s in _DELTA_CPU])},
}
CHECK_REPS = 2


def conformance(op: str, fn, device: str, refs: dict, seed: int = 0) -> str | None:
    """Why `fn` (an implementation of `op`) fails the op's conformance cases (`CHECKS`) on `device`, or None:
    its output and the pool it writes against the reference implementation's (computed once per case into
    `refs`), at each dtype's tolerance (harness.testing.checks), CHECK_REPS runs of each case."""
    import torch

    from harness.impls.registry import get
    from harness.ops import SPECS
    from harness.testing.checks import compare, tolerance_for
    cases = CHECKS.get(op, {}).get("cpu" if device.startswith("cpu") else "gpu")
    if not cases:
        return None
    spec = SPECS[op]
    dtypes, shapes = cases

    def fresh(dt, shape):
        gen = torch.Generator(device=device).manual_seed(seed)
        kw = spec.inputs(shape, getattr(torch, dt), device, gen)
        kw.pop("out", None)
        return kw

    def run(f, kw):
        pos, opt = spec.split({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
        y = f(*pos, **opt)
        return [y, pos[spec.args.index(spec.pool)]] if spec.pool else [y]

    for dt in dtypes:
        for shape in shapes:
            key = (dt, json.dumps(shape, sort_keys=True))
            kw = fresh(dt, shape)
            if key not in refs:
                refs[key] = [t.detach().to("cpu", torch.float64) for t in run(get("reference").ops[op], kw)]
            tol = tolerance_for(getattr(torch, dt))
            for rep in range(CHECK_REPS):
                for name, got, want in zip(("output", "pool"), run(fn, kw), refs[key]):
                    c = compare(name, got, want, tol)
                    if not c.passed:
                        return (f"conformance: {dt} {json.dumps(shape)}, run {rep + 1} of {CHECK_REPS}: {name} "
                                f"{c.reason}")
    return None


def _mismatch(ref: list, got: list, tol: float) -> str | None:
    if len(ref) != len(got):
        return f"{len(got)} outputs, expected {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, got)):
        scale = float(a.abs().max()) if a.numel() else 0.0
        err = float((a - b).abs().max()) if a.numel() else 0.0
        if not (err <= tol * max(scale, 1e-6)):  # NaN fails too
            return f"output {i} differs from the current configuration's: max |diff| {err:.3g} vs scale {scale:.3g}"
    return None


def run_cli(args, device: str) -> int:
    """Run the sweep of `args.op` on `device` (resolved by harness.bench.cli.setup_device)."""
    import torch

    from harness.bench.cli import budget_from
    from harness.bench.registry import OP_INPUTS, check_names, known_names, split_names
    from harness.bench.runner import parse_dtype
    from harness.bench.timing import measure
    from harness.env import environment
    from harness.testing.checks import assert_bitwise_equal
    from harness.impls.registry import get
    from harness.impls.triton import _common
    from harness.ops import SPECS, no_index_checks
    from harness.records import RecordWriter

    all_ops, _ = known_names()
    ops = split_names(args.op)
    if not ops:
        from reference.validate import fail
        fail("--op", f"one or more of {', '.join(SWEEPS)}", "none")
    check_names("--op (ops with a launch-configuration sweep)", ops, list(SWEEPS))
    groups_asked = split_names(args.group)
    # a name is a group of some sweepable op (one list serves runs that split the ops between processes);
    # at least one of the named groups must belong to the ops swept
    check_names("--group", groups_asked, sorted({g.name for gs in SWEEPS.values() for g in gs}))
    if groups_asked and not any(g.name in groups_asked for op in ops for g in SWEEPS[op]):
        from reference.validate import fail
        fail("--group", f"a group of {', '.join(ops)}: {sorted({g.name for op in ops for g in SWEEPS[op]})}",
             ", ".join(groups_asked))
    if args.list:
        for op in ops:
            for g in SWEEPS[op]:
                if groups_asked and g.name not in groups_asked:
                    continue
                print(f"{op} / {g.name} ({g.module}.{g.attr}, class {g.shape_class}): {len(g.candidates)} candidates")
                for i, c in enumerate(g.candidates, 1):
                    print(f"  {i:3d} {json.dumps(c)}")
        return 0
    if args.candidates is not None and args.candidates < 1:
        from reference.validate import fail
        fail("--candidates", "an int >= 1", args.candidates)
    isolate = args.isolate if args.isolate is not None else not device.startswith("cpu")
    if isolate and not os.environ.get(_CHILD):
        return _isolated(args, ops, groups_asked, device)
    if os.environ.get(_CHILD) and args.budget is not None:
        # shortly before the parent kills a child past its budget, every thread's stack goes to stderr: a
        # hang then says where it was
        import faulthandler
        faulthandler.dump_traceback_later(max(args.budget + CHILD_GRACE_S - 10, 1), exit=False)
    if device == "cpu":
        torch.set_num_threads(1)
    impl = get("triton")
    why = impl.why_unavailable(device)
    if why:
        from reference.validate import fail
        fail("--device", "a device the triton implementation runs on", f"{device}: {why}")
    budget = budget_from(args, device)
    graph = device.startswith("cuda")
    dtype = parse_dtype(args.dtype) if args.dtype else None
    run_id, out = _run_and_out(args)
    writer = RecordWriter(out, run_id=run_id)
    writer.write("env", env=environment(device), bench=dict(kind="sweep", ops=ops, min_reps=budget.min_reps,
                                                             cuda_graph=graph))
    folder = args.device_name or _common.device_config_name() or device.split(":")[0]
    config_dir = args.config_dir or _common.CONFIG_DIR
    t_start = time.perf_counter()
    failed = False
    import importlib
    for op in ops:
        spec, op_spec = OP_INPUTS[op], SPECS[op]
        fn = impl.ops[op]
        dt = dtype or spec.dtypes_for(device)[0]
        tol = 2e-2 if dt in (torch.float16, torch.bfloat16) else 1e-4
        touched: dict = {}
        checked: dict = {}  # the reference's results of the op's conformance cases
        op_failed = False
        for g in SWEEPS[op]:
            if groups_asked and g.name not in groups_asked:
                continue
            mod = importlib.import_module(f"harness.impls.triton.{g.module}")
            conf = getattr(mod, g.attr)
            touched.setdefault((g.module, g.attr, g.shape_class), (mod, copy.deepcopy(conf)))
            shapes = [s for s in spec.shapes_for(device) if g.applies(s)]
            if not shapes:
                print(f"sweep: {op}/{g.name}: no shape of {op} on {device} is affected; skipped")
                continue
            start = copy.deepcopy(conf)
            cands = [{}] + list(g.candidates[:args.candidates] if args.candidates else g.candidates)
            refs: dict = {}
            scores = []
            for ci, cand in enumerate(cands):
                if args.budget is not None and time.perf_counter() - t_start > args.budget and ci > 0:
                    print(f"sweep: budget spent; {op}/{g.name} stopped after {ci - 1} candidates")
                    break
                cfg = merged(start, cand)
                _set(conf, cfg)
                logs, ratios, err = [], [], None
                try:
                    err = conformance(op, fn, device, checked, args.seed)
                except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded and left out
                    err = f"conformance: {type(e).__name__}: {str(e)[:300]}"
                if err:
                    writer.write("timing", bench=f"sweep/{op}/{g.name}/{ci}", op=op, impl="triton", device=device,
                                 dtype=None, shape={}, tokens=None, peer=False, cuda_graph=graph, level="kernel",
                                 group=g.name, candidate=ci, module=g.module, config=cand, ms_p20=None,
                                 ms_p50=None, ms_p80=None, error=err)
                    print(f"sweep: {op}/{g.name} #{ci} {json.dumps(cand)}: {err}")
                    if ci == 0:
                        failed = op_failed = True
                        break
                    continue
                for si, shape in enumerate(shapes):
                    base = dict(bench=f"sweep/{op}/{g.name}/{ci}", op=op, impl="triton", device=device,
                                dtype=str(dt).replace("torch.", ""), shape=dict(shape), tokens=spec.tokens(shape),
                                peer=False, cuda_graph=graph, level="kernel", group=g.name, candidate=ci,
                                module=g.module, config=cand)
                    try:
                        # two runs of the same inputs, built afresh (the ops write their pools in place): a racy
                        # compile can pass one run (docs/findings.md), and our kernels give the same bits every run
                        runs = []
                        for _ in range(2):
                            gen = torch.Generator(device=device).manual_seed(args.seed)
                            inputs = spec.make(shape, dt, device, gen)
                            runs.append(_outputs(op_spec, inputs, spec.call(fn, inputs)))
                        outs = runs[0]
                        for i, (a, b) in enumerate(zip(*runs)):
                            assert_bitwise_equal(f"output {i} differs between two runs of the same inputs (a race in "
                                                 "the compiled code)", b, a)
                        if ci == 0:
                            refs[si] = outs
                        else:
                            why = _mismatch(refs[si], outs, tol)
                            if why:
                                raise ValueError(why)
                        with no_index_checks():
                            t = measure([lambda inp=inputs: spec.call(fn, inp)], device, budget, graph=graph)
                        if graph and t.graph is None:
                            raise RuntimeError(f"no CUDA-graph timing: {t.graph_error}")
                        fields = t.fields(graph)
                    except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded and left out
                        err = f"{type(e).__name__}: {str(e)[:300]}"
                        writer.write("timing", **base, ms_p20=None, ms_p50=None, ms_p80=None, error=err)
                        if ci == 0:
                            failed = op_failed = True
                        break
                    from harness.bench.bytes import op_bytes
                    nbytes = op_bytes(op, inputs)
                    fields.update(bytes=nbytes, gb_s=nbytes / (fields["ms_p50"] * 1e-3) / 1e9 if nbytes else None,
                                  tok_s=base["tokens"] / (fields["ms_p50"] * 1e-3) if base["tokens"] else None)
                    writer.write("timing", **{**base, **fields})
                    logs.append(fields["ms_p50"])
                    if ci > 0:
                        ratios.append(fields["ms_p50"] / scores[0][2][si])
                    del inputs
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                if err:
                    print(f"sweep: {op}/{g.name} #{ci} {json.dumps(cand)}: {err}")
                    if ci == 0:
                        break
                    continue
                score = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 1.0
                scores.append((score, ci, logs))
                print(f"sweep: {op}/{g.name} #{ci:<3d} {score:6.3f}x  "
                      + " ".join(f"{ms:.4g}" for ms in logs) + f" ms  {json.dumps(cand)}", flush=True)
            best = min(scores, key=lambda s: s[0]) if scores else None
            if best and best[1] > 0 and best[0] <= 1 - args.min_gain:
                print(f"sweep: {op}/{g.name}: candidate #{best[1]} wins ({best[0]:.3f}x of the starting time)")
                _set(conf, merged(start, cands[best[1]]))
            else:
                print(f"sweep: {op}/{g.name}: the starting configuration stays")
                _set(conf, start)
        for (module, attr, cls), (mod, original) in touched.items():
            conf = getattr(mod, attr)
            if not args.no_write and not op_failed:
                path = write_config(config_dir, folder, module, cls, conf)
                print(f"sweep: {module} [{cls}] -> {path}")
            _set(conf, original)  # this process keeps the configuration it started with
    print(f"sweep: records in {out}")
    return 1 if failed else 0


_CHILD = "HARNESS_SWEEP_CHILD"
# a child may overrun the budget it is given by the candidate it is timing (the budget is checked between
# candidates); past that grace it is killed, so a child that hangs cannot hold the run
CHILD_GRACE_S = 120


def _run_and_out(args) -> tuple[str, str]:
    """The run id (the caller's HARNESS_RUN_ID, else a new one) and the records file (--out, else
    reports/runs/<run id>/sweep.jsonl)."""
    from harness.env import REPO_ROOT
    from harness.records import new_run_id
    run_id = os.environ.get("HARNESS_RUN_ID") or new_run_id()
    return run_id, args.out or os.path.join(REPO_ROOT, "reports", "runs", run_id, "sweep.jsonl")


def _isolated(args, ops: list, groups_asked, device: str) -> int:
    """Sweep each (op, group) in a child process, one after the other, sharing the records file, the run id
    and the budget. A child starts from the configuration files the ones before it wrote (as one process
    carries a group's winner into the next group), and a candidate that breaks the device context (an
    illegal memory access makes every later CUDA call fail) ends only its own group."""
    import subprocess
    run_id, out = _run_and_out(args)
    # the children are given the device as the user named it ("cuda", not the resolved "cuda:0")
    common = ["--device", args.device, "--min-gain", str(args.min_gain), "--seed", str(args.seed), "--out", out]
    for flag, value in (("--dtype", args.dtype), ("--candidates", args.candidates), ("--config-dir", args.config_dir),
                        ("--device-name", args.device_name), ("--reps", args.reps), ("--min-time", args.min_time),
                        ("--max-time", args.max_time), ("--warmup", args.warmup)):
        if value is not None:
            common += [flag, str(value)]
    if args.no_write:
        common.append("--no-write")
    t0 = time.perf_counter()
    rc = 0
    for op in ops:
        for g in SWEEPS[op]:
            if groups_asked and g.name not in groups_asked:
                continue
            argv = [*common, "--op", op, "--group", g.name]
            limit = None
            if args.budget is not None:
                left = args.budget - (time.perf_counter() - t0)
                if left <= 0:
                    print(f"sweep: budget spent; {op}/{g.name} and the groups after it not swept")
                    return rc
                argv += ["--budget", f"{left:.1f}"]
                limit = left + CHILD_GRACE_S
            try:
                r = subprocess.run([sys.executable, "-m", "harness.cli", "bench", "sweep", *argv],
                                   env={**os.environ, _CHILD: "1", "HARNESS_RUN_ID": run_id}, timeout=limit)
            except subprocess.TimeoutExpired:
                print(f"sweep: {op}/{g.name}: its process ran {limit:.0f} s, past the budget and "
                      f"{CHILD_GRACE_S} s more; killed (its records so far are kept)", flush=True)
                rc = 1
                continue
            if r.returncode:
                print(f"sweep: {op}/{g.name}: its process exited with {r.returncode}", flush=True)
                rc = 1
    return rc


def write_config(config_dir: str, device: str, module: str, shape_class: str, values: dict) -> str:
    """Write one shape class of configs/<device>/<module>.json (the file's other classes kept)."""
    from harness.impls.triton._common import read_config_file
    path = os.path.join(config_dir, device, f"{module}.json")
    data = read_config_file(path) if os.path.exists(path) else {}
    data[shape_class] = copy.deepcopy(values)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    from harness.cli import main
    sys.exit(main(["bench", "sweep", *sys.argv[1:]]))
