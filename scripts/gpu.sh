#!/usr/bin/env bash
# The GPU run: regenerates a device baseline folder, reports/baselines/<device>/, as one set.
#
#   bash scripts/gpu.sh [--device NAME] [--out DIR] [--logs DIR] [--budget SECONDS] [--steps LIST] [--workers N]
#                       [--gpus N] [--resume DIR] [--fresh LIST]
#
#   --device   folder name (default: from the GPU's name, e.g. "NVIDIA H200" -> h200)
#   --out      baseline folder (default reports/baselines/<device>)
#   --logs     pytest/benchmark logs, outcome files, sweep timings, built peer extensions
#              (default reports/runs/gpu-<time>, git-ignored)
#   --budget   seconds for the whole run (default 3600); each step gets at most what is left
#   --steps    comma-separated subset of: env,tp,suites,bench,throughput,peers,ieee,sweep (default all but tp,
#              ieee and sweep, in that order)
#   --workers  pytest-xdist workers for the suites (default 8)
#   --gpus     1 (default) runs the steps one after the other on the first GPU (pytest workers of the suites
#              and peers steps take every visible GPU in turn). 2 runs two lanes at once:
#              the timing lane (sweep, bench, throughput) on GPU 0 pinned to a quarter of the CPU cores,
#              and the checking lane (suites, peers) on GPU 1 with the other cores, so timings are not taken
#              beside busy test workers; the tp step runs first on both GPUs. Without suites or peers to run,
#              the sweep and bench steps use both GPUs at once (Mamba ops on GPU 0, delta-rule and
#              speculative ops on GPU 1, each process pinned to its own quarter of the cores); with nothing
#              to time, the suites check on GPU 0 and the peers (ieee) on GPU 1, half the cores each (only one of
#              them asked for: it checks on both GPUs, pytest worker gwN on GPU N mod 2, every core).
#   --resume   folder of an earlier run cut by its budget (its logs, or the baseline folder, which keeps the
#              outcome files too): the suites, peers and ieee steps run only the tests its outcome files do not
#              record as passed or skipped, the bench only the cases its bench.jsonl does not time (but the
#              ops swept in this run and those in BENCH_RETIME: timed again, their old records dropped), and
#              they add their records to the baseline folder's files instead of replacing them
#   --fresh    with --resume: these of the suites, peers, ieee and bench steps start over instead (comma-separated;
#              e.g. our suites fresh after a kernel change while the peers' suites resume)
#
# Environment: PEERS_RESUME_FAILED=rerun makes a resumed peers step run again the peers' tests that failed on an
# assertion (default skip: those verdicts are written-up findings; errors and crashes always run again);
# PEERS_K a pytest -k expression narrowing the peers step (e.g. "fla": one peer's tests first; default every peer);
# PEERS_GIB the GPU memory a worker of the peers and ieee steps is given (default 10 GiB): their workers are
# --workers, at most the smallest visible GPU's memory over PEERS_GIB (7 on an 80 GB H100, 13 on an H200;
# fla-core's tests in 14 workers on an 80 GB card stopped on CUDA out-of-memory errors in its Triton launches);
# BENCH_OPS / BENCH_IMPLS (comma lists) narrow the bench; SWEEP_OPS the swept ops and
# SWEEP_ARGS more `harness bench sweep` arguments (e.g. "--group scan,assoc --candidates 10"); *_S cap a step's
# seconds (SUITES_S, BENCH_S, TP_S, PEERS_S, SWEEP_S, TPAR_S); SHRINK_S the seconds a failing hypothesis test
# shrinks its example for (default 60); GENERATE_S the seconds a peers' property test draws examples for (default
# 240); COMPUTE_SANITIZER the compute-sanitizer the replays
# of faulted tests run under (default: the installed one; empty: none).
#
# Steps and what each writes into the baseline folder:
#   env         env.json: versions, GPU, clocks, peers found; each later step adds its exit code and seconds
#   tp          (only when named; 2 GPUs) the tensor-parallel suite over NCCL, TP = 2 against TP = 1 for
#               every family, ours                                                       -> results-tp.jsonl
#   suites      pytest suites/ --device cuda --impl triton --impl torch  -> results.jsonl, outcomes.jsonl
#               (a test that lost the CUDA context: its last op call replayed alone under compute-sanitizer,
#               `harness replay`, into <logs>/replay-suites.txt; the peers step likewise -> replay-peers.txt)
#   bench       harness bench --device cuda, once the peers' CUDA extensions are built: ours, the peers'
#               adapters and the peers' own kernels (mamba_ssm's CUDA scan and Triton state update, SSD
#               and gated norm; causal-conv1d's CUDA kernels), eager and CUDA graph, in one run -> bench.jsonl
#   throughput  harness bench throughput, falcon-mamba-7b and mamba-codestral-7b shapes,
#               transformers alongside                                                  -> throughput.jsonl
#               (and the eager decode step's profiles, Python and operators -> profile/)
#   peers       every suite but the benchmarks' with the peers' adapters (mamba_ssm, mamba_ssm_cuda,
#               causal_conv1d, fla, vllm, sglang: those importable)                       -> results-peers.jsonl
#   ieee        (only when named) fla-core's tests but those of half and fp64 dtypes, with fla's fp32 dots in IEEE
#               fp32 (HARNESS_FLA_FP32=ieee) and judged at fp32's tolerance: as shipped fla multiplies fp32
#               in TF32 and is judged at TF32's (the peers step), which it leaves at ill-conditioned steps
#               (docs/findings.md)                            -> results-fla-ieee.jsonl, outcomes-fla-ieee.jsonl
#   sweep       (only when named; before the bench, which then times the winners) harness bench sweep for
#               every op with launch-configuration candidates: the winners go to
#               harness/impls/triton/configs/<device>/ (review, then commit them); the timings to
#               <logs>/sweep.jsonl
#
# Peers come from .peers/ (scripts/peers_setup.sh): sdists (mamba_ssm, causal-conv1d), pure-Python wheels
# (fla-core, einops) and the sources scripts/peers_fetch.py extracts (vLLM, SGLang) in .peers/src. Their CUDA extensions (selective_scan_cuda,
# causal_conv1d_cuda) are compiled for sm_90 in the background from the start, forward only
# (scripts/build_peer_ext.py); the built modules are gzipped into <logs>/ext/: copied into .peers/ext/ they
# are reused next time instead of rebuilt. Triton's autotune results (the peers autotune each kernel anew for
# every head count and width a test draws; the peers step has Triton keep them on disk: fla-core's, mamba_ssm's,
# vLLM's, SGLang's) are kept in .peers/autotune/: put into Triton's cache at the start,
# gathered back at the end, and packed into <logs>/autotune.tgz for another machine (unpack it in the
# repository root). On the H200 one of fla's KDA varlen tests ran 480+ s cold and 120-200 s with them.
#
# Safe to cut: a step's file replaces the old one in the baseline folder as soon as that step ends (also
# when the step hit its time limit: its records so far are valid lines), so a run stopped half way leaves
# the finished steps' files; the suites run with --outcomes (one line per finished test in <logs>), so a cut
# run still says what passed and what failed, and its log names the tests that were running when the step was
# cut, with how long each had run (<outcomes>.running); the outcome file records them as "cut" with those
# seconds, and a --resume starts them first, one per pytest worker (harness.testing.resume). Files of the
# selected steps are removed from the folder at the start: the folder never mixes two runs' files for a step.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

DEVICE=""; DIR=""; LOGS=""; BUDGET=3600; STEPS="env,suites,bench,throughput,peers"; WORKERS=8; GPUS=1; RESUME=""
FRESH=""
usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs a value}; shift 2 ;;
    --out) DIR=${2:?--out needs a value}; shift 2 ;;
    --logs) LOGS=${2:?--logs needs a value}; shift 2 ;;
    --budget) BUDGET=${2:?--budget needs a value}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a value}; shift 2 ;;
    --workers) WORKERS=${2:?--workers needs a value}; shift 2 ;;
    --gpus) GPUS=${2:?--gpus needs a value}; shift 2 ;;
    --resume) RESUME=${2:?--resume needs a value}; shift 2 ;;
    --fresh) FRESH=${2:?--fresh needs a value}; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "gpu.sh: unknown argument $1 (expected --device/--out/--logs/--budget/--steps/--workers/--gpus/--resume/--fresh)" >&2; exit 2 ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu.sh: --budget: expected whole seconds, got $BUDGET" >&2; exit 2 ;; esac
case "$WORKERS" in ''|*[!0-9]*) echo "gpu.sh: --workers: expected a whole number, got $WORKERS" >&2; exit 2 ;; esac
case "${PEERS_GIB-10}" in
  ''|*[!0-9]*|0) echo "gpu.sh: PEERS_GIB: expected whole GiB >= 1, got '${PEERS_GIB-}'" >&2; exit 2 ;;
esac
case "$GPUS" in 1|2) ;; *) echo "gpu.sh: --gpus: expected 1 or 2, got $GPUS" >&2; exit 2 ;; esac
if [ -n "$RESUME" ] && [ ! -d "$RESUME" ]; then echo "gpu.sh: --resume: expected the logs folder of an earlier run, got $RESUME" >&2; exit 2; fi
for s in ${FRESH//,/ }; do
  case "$s" in suites|bench|peers|ieee) ;;
    *) echo "gpu.sh: --fresh: expected a subset of suites,bench,peers,ieee, got $s" >&2; exit 2 ;; esac
done
for s in ${STEPS//,/ }; do
  case "$s" in env|tp|suites|bench|throughput|peers|ieee|sweep) ;;
    *) echo "gpu.sh: --steps: expected a subset of env,tp,suites,bench,throughput,peers,ieee,sweep, got $s" >&2
       exit 2 ;;
  esac
done
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$NGPU" -lt 1 ]; then
  echo "gpu.sh: expected a CUDA device, got none (torch.cuda.is_available() is False)" >&2; exit 2
fi
if [ "$GPUS" -gt "$NGPU" ]; then echo "gpu.sh: --gpus: expected at most the $NGPU GPU(s) here, got $GPUS" >&2; exit 2; fi
case ",$STEPS," in *,tp,*) [ "$NGPU" -ge 2 ] || { echo "gpu.sh: --steps tp: expected 2 GPUs, got $NGPU" >&2; exit 2; } ;; esac
# the smallest visible GPU's memory in GiB (the peers' and ieee steps' worker cap: peer_workers)
GPU_GIB=$(python3 -c "import torch
print(min(torch.cuda.get_device_properties(i).total_memory for i in range($NGPU)) >> 30)")
# peer_workers: the workers of the peers and ieee steps: --workers, at most GPU_GIB / PEERS_GIB (at least 1)
peer_workers() {
  local cap=$(( GPU_GIB / ${PEERS_GIB:-10} )); [ "$cap" -ge 1 ] || cap=1
  [ "$WORKERS" -le "$cap" ] && echo "$WORKERS" || echo "$cap"
}
# the folder name the kernels' launch configurations use too (harness/impls/triton/configs/<device>/)
[ -n "$DEVICE" ] || DEVICE=$(python3 -c "import torch; from harness.impls.triton._common import device_folder; print(device_folder(torch.cuda.get_device_name()))")
DIR=${DIR:-reports/baselines/$DEVICE}
LOGS=${LOGS:-reports/runs/gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$DIR" "$LOGS"
LOG=$LOGS/gpu.log
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
# resumes STEP: whether STEP continues the --resume run (one of suites, peers, ieee, bench, not named in --fresh;
# the other steps always start over)
resumes() {
  [ -n "$RESUME" ] || return 1
  case "$1" in suites|peers|ieee|bench) ;; *) return 1 ;; esac
  case ",$FRESH," in *",$1,"*) return 1 ;; *) return 0 ;; esac
}
# limit CAP: the step's time limit, at most what is left of the budget less a margin for the file moves
limit() { local l; l=$(( $(left) - 10 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
# note STEP RC SECONDS: the step's exit code (124: cut by its time limit) and seconds, into env.json (under a
# lock: the two lanes note at the same time)
note() {
  python3 - "$DIR/env.json" "$1" "$2" "$3" <<'PY'
import fcntl, json, os, sys
path, step, rc, sec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with open(path + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    env = json.load(open(path)) if os.path.isfile(path) else {}
    env.setdefault("steps", {})[step] = {"exit": rc, "seconds": sec, "cut": rc in (124, 137)}
    with open(path + ".tmp", "w") as f:
        json.dump(env, f, indent=1)
    os.replace(path + ".tmp", path)
PY
  rm -f "$DIR/env.json.lock"
}
# place STEP FILE...: move STEP's finished outputs from the logs into the baseline folder (a resumed step's
# file is added to the one there: the earlier run's records and this run's make the set)
place() {
  local step=$1; shift
  for f in "$@"; do
    [ -s "$LOGS/$f" ] || continue
    if resumes "$step" && [ -s "$DIR/$f" ]; then cat "$DIR/$f" "$LOGS/$f" > "$DIR/$f.tmp"; else cp "$LOGS/$f" "$DIR/$f.tmp"; fi
    mv "$DIR/$f.tmp" "$DIR/$f"
  done
}
# resume_args STEP OUTCOMES: the pytest --resume argument for an earlier run's outcome file, if STEP resumes
resume_args() { resumes "$1" && [ -s "$RESUME/$2" ] && echo "--resume $RESUME/$2"; }
# retime_ops: the ops a resumed bench times again although the earlier run timed them: BENCH_RETIME, and the
# ops this run sweeps (their launch configurations may change)
retime_ops() { local o="${BENCH_RETIME:-}"; want sweep && o="${o:+$o,}${SWEEP_OPS:-$SWEEP_ALL}"; echo "$o"; }
# bench_resume: harness bench's --resume for the earlier run's timings, if there are any (with --retime)
bench_resume() {
  resumes bench && [ -s "$RESUME/bench.jsonl" ] || return 0
  local r; r=$(retime_ops); echo "--resume $RESUME/bench.jsonl${r:+ --retime $r}"
}
# drop_retimed FILE NEW: FILE without the timing records of the retimed ops that NEW times again: an (op,
# implementation) pair NEW has replaces FILE's records of it; the implementations a narrowed bench (BENCH_IMPLS)
# left out keep theirs
drop_retimed() {
  local r; r=$(retime_ops); [ -n "$r" ] && [ -s "$1" ] && [ -s "$2" ] || return 0
  python3 - "$1" "$r" "$2" <<'PY'
import json, os, sys
path, ops, new = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[3]


def records(p):
    for ln in open(p):
        try:
            yield json.loads(ln)
        except ValueError:
            continue  # a line cut by a time limit


timed = {(r.get("op"), r.get("impl")) for r in records(new) if r.get("kind") == "timing"}
keep = [json.dumps(r) + "\n" for r in records(path)
        if not (r.get("kind") == "timing" and r.get("op") in ops and (r.get("op"), r.get("impl")) in timed)]
with open(path + ".tmp", "w") as f:
    f.writelines(keep)
os.replace(path + ".tmp", path)
PY
}

# preflight: the pytest options the test steps pass (--generate-seconds, --shrink-seconds, --outcomes) work with
# this machine's pytest and hypothesis, on a throwaway property test (a few seconds, on the CPU). A GPU machine's
# newer hypothesis once renamed the engine counts the generation cap reads, and every capped test failed; this
# stops the run before any step starts or any file is removed.
preflight() {
  local d rc; d=$(mktemp -d)
  printf "pytest_plugins = ['harness.testing.plugin']\n" > "$d/conftest.py"
  printf '%s\n' "import time" "from hypothesis import given, settings, strategies as st" \
    "@settings(max_examples=50, database=None)" "@given(st.integers())" "def test_drawn(x):" \
    "    time.sleep(0.05)" > "$d/test_preflight.py"
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider -p no:randomly \
    --device cpu --generate-seconds 0.2 --shrink-seconds 1 --outcomes "$d/o.jsonl" "$d/test_preflight.py" \
    > "$d/log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ] || ! grep -q '"why": "--generate-seconds: ' "$d/o.jsonl" 2>/dev/null; then
    echo "gpu.sh: preflight: expected a property test capped by --generate-seconds to pass, got exit $rc:" >&2
    tail -5 "$d/log" >&2; rm -rf "$d"; return 3
  fi
  rm -rf "$d"
}
if want suites || want peers || want ieee || want tp; then preflight || exit 3; fi

for s in ${STEPS//,/ }; do
  case "$s" in
    suites) resumes suites || rm -f "$DIR/results.jsonl" "$DIR/outcomes.jsonl" ;;
    peers) resumes peers || rm -f "$DIR/results-peers.jsonl" "$DIR/outcomes-peers.jsonl" ;;
    ieee) resumes ieee || rm -f "$DIR/results-fla-ieee.jsonl" "$DIR/outcomes-fla-ieee.jsonl" ;;
    tp) rm -f "$DIR/results-tp.jsonl" "$DIR/outcomes-tp.jsonl" ;;
    bench) resumes bench || rm -f "$DIR/bench.jsonl" ;;
    throughput) rm -rf "$DIR/throughput.jsonl" "$DIR/profile" ;;
    env) rm -f "$DIR/env.json" ;;
  esac
done
log "device $DEVICE -> $DIR (logs $LOGS, budget ${BUDGET}s, steps $STEPS, gpus $GPUS${RESUME:+, resuming $RESUME}${FRESH:+ but for $FRESH})"
if { want peers || want ieee; } && [ "$(peer_workers)" -lt "$WORKERS" ]; then
  log "peers, ieee: $(peer_workers) workers, not $WORKERS (${GPU_GIB} GiB of GPU memory, ${PEERS_GIB:-10} GiB a worker)"
fi

# The peers' CUDA extensions compile in the background while the suites run.
if want bench || want peers || want ieee || want throughput; then
  export MAX_JOBS=${MAX_JOBS:-8}
  (PEERS_BUILD_CUDA=1 . scripts/peers_setup.sh) >> "$LOG" 2>&1
fi

# a failing hypothesis test shrinks its example for at most SHRINK_S seconds (hypothesis' own limit, 300 s, is
# most of a run's budget: two of the peers' tests a run cut at 328 s were shrinking failures)
PYTEST_COMMON="--device cuda -q -rfs -p no:randomly -p no:cacheprovider --tb=line --shrink-seconds ${SHRINK_S:-60}"
# the workers steal queued tests from each other: a few tests of ~100 s clustered in one file no longer leave
# the rest idle at the end
XDIST="--dist worksteal"

step_env() {
  python3 - "$DIR/env.json" "$GPUS" <<'PY' >> "$LOG" 2>&1
import glob, json, os, subprocess, sys
from harness.env import environment
from harness.bench.runner import clocks
env = environment("cuda")
env["clocks"] = clocks("cuda")
env["peers"] = sorted(os.path.basename(p) for p in glob.glob(".peers/*.tar.gz") + glob.glob(".peers/*.whl"))
env["gpus_used"] = int(sys.argv[2])
env["steps"] = {}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(env, f, indent=1)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
PY
  log "env: $?"
}

step_tp() {
  [ "$(left)" -lt 60 ] && { log "tp: skipped (budget spent)"; return; }
  local t; t=$(date +%s)
  timeout "$(limit ${TPAR_S:-300})" python3 -m pytest suites/engine/test_engine_tp.py --impl triton --impl torch \
    $PYTEST_COMMON --results "$LOGS/results-tp.jsonl" --outcomes "$LOGS/outcomes-tp.jsonl" > "$LOGS/tp.txt" 2>&1
  checked tp $? "$t" results-tp.jsonl outcomes-tp.jsonl
}

# replay_faults OUTCOMES OUT: every test in OUTCOMES that lost the CUDA context has its last op call run again
# alone (`harness replay`), under compute-sanitizer's memcheck where it is installed (it names the kernel, the
# source line and the access), each within REPLAY_S seconds (default 120) and the budget -> OUT
replay_faults() {
  [ -s "$1" ] || return 0
  local cs id; cs=${COMPUTE_SANITIZER-$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)}
  python3 -c "
import json, sys
seen = []
for ln in open(sys.argv[1]):
    try:
        r = json.loads(ln)
    except ValueError:
        continue
    if isinstance(r, dict) and r.get('last_call') and r.get('nodeid') not in seen:
        seen.append(r['nodeid'])
print('\n'.join(seen))" "$1" | while IFS= read -r id; do
    [ -n "$id" ] && [ "$(left)" -ge 60 ] || continue
    echo "== $id${cs:+ (compute-sanitizer --tool memcheck)}" >> "$2"
    timeout "$(limit ${REPLAY_S:-120})" ${cs:+$cs --tool memcheck --print-limit 4} python3 -m harness.cli replay "$1" \
      --test "$id" >> "$2" 2>&1
    echo "exit $?" >> "$2"
  done
  [ -s "$2" ] && log "replayed the calls of the tests that lost the CUDA context: $2"
}

# cut_in STEP OUTCOMES: a cut step's tests still running when it ended (pytest's OUTCOMES.running), with how
# long each had run, into the log (a test that hangs shows there) and into OUTCOMES as lines "cut"
# (harness.testing.resume: the next --resume starts them first, one per worker)
cut_in() {
  [ -s "$2.running" ] || return 0
  log "$1: running when it ended: $(python3 -c "
import json, sys, time
now = json.load(open(sys.argv[1]))
print('; '.join(f'{n} ({time.time() - t:.0f} s)' for n, t in sorted(now.items(), key=lambda x: x[1])) or '-')" "$2.running" 2>&1)"
  PYTHONPATH="$OURS_PATH" python3 -m harness.testing.resume cut "$2" >> "$LOG" 2>&1
}

# checked STEP RC T0 RESULTS OUTCOMES: a test step's pytest has ended with RC (started at T0): its running tests
# recorded as cut, its files placed in the baseline folder, its exit code and seconds noted and logged
checked() {
  cut_in "$1" "$LOGS/$5"; place "$1" "$4" "$5"
  note "$1" "$2" $(( $(date +%s) - $3 ))
  log "$1: exit $2: $(tail -1 "$LOGS/$1.txt")"
}

step_suites() {
  [ "$(left)" -lt 60 ] && { log "suites: skipped (budget spent)"; return; }
  local t; t=$(date +%s)
  # our implementations without the peers on the path (nothing of ours imports them)
  timeout "$(limit ${SUITES_S:-1500})" env PYTHONPATH="$OURS_PATH" python3 -m pytest suites/ --impl triton --impl torch \
    $PYTEST_COMMON -n "$WORKERS" $XDIST $(resume_args suites outcomes.jsonl) --results "$LOGS/results.jsonl" \
    --outcomes "$LOGS/outcomes.jsonl" > "$LOGS/suites.txt" 2>&1
  checked suites $? "$t" results.jsonl outcomes.jsonl
  PYTHONPATH="$OURS_PATH" replay_faults "$LOGS/outcomes.jsonl" "$LOGS/replay-suites.txt"
}

step_bench() {
  [ "$(left)" -lt 60 ] && { log "bench: skipped (budget spent)"; return; }
  local t rc w; t=$(date +%s); rc=0
  # the peers' own CUDA kernels are backends of the same run: wait for the background builds first
  # (only when their sources were carried: .peers/*.tar.gz)
  w=$(limit ${BUILD_WAIT_S:-400}); ls .peers/*.tar.gz >/dev/null 2>&1 || w=0
  while [ "$w" -gt 0 ] && [ "$(ls /tmp/peers/ext/*.so 2>/dev/null | wc -l)" -lt 2 ]; do sleep 5; w=$(( w - 5 )); done
  log "bench: peer extensions: $(ls /tmp/peers/ext/*.so 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"
  if [ "${BENCH_SPLIT:-0}" = 1 ]; then
    # both GPUs time: the Mamba ops on GPU 0, the delta-rule and speculative ops on GPU 1, each process on
    # its own quarter of the cores; one file after (the second process's env record dropped)
    local halves; halves=$(halves "${BENCH_OPS:-}")
    local g=0 ops pids=""
    for ops in $halves; do
      [ "$ops" = - ] || { CUDA_VISIBLE_DEVICES=$g pin "$(( g * QUARTER ))-$(( g * QUARTER + QUARTER - 1 ))" \
        timeout "$(limit ${BENCH_S:-900})" python3 -m harness.cli bench --device cuda --no-progress --op "$ops" ${BENCH_IMPLS:+--impl $BENCH_IMPLS} $(bench_resume) \
        --out "$LOGS/bench-gpu$g.jsonl" > "$LOGS/bench-gpu$g.txt" 2>&1 & pids="$pids $!"; }
      g=$(( g + 1 ))
    done
    for p in $pids; do wait "$p" || rc=$?; done
    python3 - "$LOGS" <<'PY'
import json, os, sys
logs = sys.argv[1]
with open(os.path.join(logs, "bench.jsonl"), "w") as out:
    for i, name in enumerate(("bench-gpu0.jsonl", "bench-gpu1.jsonl")):
        path = os.path.join(logs, name)
        if not os.path.isfile(path):
            continue
        for ln in open(path):
            try:
                rec = json.loads(ln)
            except ValueError:
                continue  # a line cut by the time limit
            if not (rec.get("kind") == "env" and out.tell()):
                out.write(json.dumps(rec) + "\n")
PY
  else
    timeout "$(limit ${BENCH_S:-900})" python3 -m harness.cli bench --device cuda --no-progress \
      ${BENCH_OPS:+--op $BENCH_OPS} ${BENCH_IMPLS:+--impl $BENCH_IMPLS} $(bench_resume) \
      --out "$LOGS/bench.jsonl" > "$LOGS/bench.txt" 2>&1 || rc=$?
  fi
  log "bench: harness bench exit $rc"
  resumes bench && [ -s "$LOGS/bench.jsonl" ] && drop_retimed "$DIR/bench.jsonl" "$LOGS/bench.jsonl"
  place bench bench.jsonl
  note bench $rc $(( $(date +%s) - t ))
  mkdir -p "$LOGS/ext"
  for so in /tmp/peers/ext/*.so; do [ -e "$so" ] && gzip -c "$so" > "$LOGS/ext/$(basename "$so").gz"; done
}

step_throughput() {
  [ "$(left)" -lt 60 ] && { log "throughput: skipped (budget spent)"; return; }
  local t rc preset; t=$(date +%s); rc=0
  for preset in falcon-mamba-7b mamba-codestral-7b; do
    [ "$(left)" -lt 40 ] && { log "throughput: $preset skipped (budget spent)"; continue; }
    timeout "$(limit ${TP_S:-300})" python3 -m harness.cli bench throughput --device cuda --preset "$preset" --impl triton \
      --prefill 4096 --decode-batch 64 --reps 3 --warmup 1 --hf-new-tokens 4 --out "$LOGS/throughput.jsonl" \
      --profile-decode "$LOGS/profile" --compare-launch \
      >> "$LOGS/throughput.txt" 2>&1 || rc=$?
    log "throughput: $preset exit $rc"
    place throughput throughput.jsonl
  done
  if ls "$LOGS"/profile/*.txt > /dev/null 2>&1; then
    mkdir -p "$DIR/profile.tmp" && cp "$LOGS"/profile/*.txt "$DIR/profile.tmp/" && rm -rf "$DIR/profile" \
      && mv "$DIR/profile.tmp" "$DIR/profile"
  fi
  note throughput $rc $(( $(date +%s) - t ))
}

step_peers() {
  [ "$(left)" -lt 60 ] && { log "peers: skipped (budget spent)"; return; }
  local t; t=$(date +%s)
  # every registered implementation usable here, filtered to the peers' (an --impl naming a peer that
  # is not importable would stop the run). TRITON_CACHE_AUTOTUNING: every @triton.autotune of the peers
  # (mamba_ssm's, vLLM's and SGLang's Triton kernels; fla-core asks for it itself) keeps its results in
  # Triton's cache, so one worker's tuning of a drawn shape serves the others and, through .peers/autotune,
  # the next machine: without it each process tunes each shape anew (mamba_ssm's SSD kernels hold ~200
  # autotune configs; its SSD property tests were still running at 327 s when a peers run was cut).
  # --generate-seconds GENERATE_S (default 240): vLLM's and mamba_ssm's SSD and delta-rule property tests compile
  # and tune each drawn shape anew and ran past 476 s, so a run of at most 600 s restarted them from nothing
  # every time; each now stops drawing after that long, and its outcome line says after how many examples
  timeout "$(limit ${PEERS_S:-900})" env TRITON_CACHE_AUTOTUNING=1 python3 -m pytest suites/ --ignore=suites/bench \
    -k "${PEERS_K:-mamba_ssm or causal_conv1d or fla or vllm or sglang}" $PYTEST_COMMON -n "$(peer_workers)" $XDIST \
    --generate-seconds "${GENERATE_S:-240}" \
    $(resume_args peers outcomes-peers.jsonl) --resume-failed "${PEERS_RESUME_FAILED:-skip}" \
    --results "$LOGS/results-peers.jsonl" \
    --outcomes "$LOGS/outcomes-peers.jsonl" > "$LOGS/peers.txt" 2>&1
  checked peers $? "$t" results-peers.jsonl outcomes-peers.jsonl
  replay_faults "$LOGS/outcomes-peers.jsonl" "$LOGS/replay-peers.txt"
}

step_ieee() {
  [ "$(left)" -lt 60 ] && { log "ieee: skipped (budget spent)"; return; }
  if ! python3 -c "import fla" 2>/dev/null; then
    log "ieee: skipped (fla-core is not importable: see scripts/peers_setup.sh)"; return
  fi
  local t; t=$(date +%s)
  # fla-core's tests whose comparisons are in fp32 or that name no dtype (the models run in fp32), its fp32 dots
  # in IEEE fp32; "not float16" leaves out the bfloat16 cases too (their dots are half either way)
  timeout "$(limit ${IEEE_S:-900})" env HARNESS_FLA_FP32=ieee TRITON_CACHE_AUTOTUNING=1 python3 -m pytest suites/ \
    --ignore=suites/bench -k "fla and not float16 and not float64" --impl fla $PYTEST_COMMON -n "$(peer_workers)" $XDIST \
    --generate-seconds "${GENERATE_S:-240}" $(resume_args ieee outcomes-fla-ieee.jsonl) \
    --results "$LOGS/results-fla-ieee.jsonl" --outcomes "$LOGS/outcomes-fla-ieee.jsonl" > "$LOGS/ieee.txt" 2>&1
  checked ieee $? "$t" results-fla-ieee.jsonl outcomes-fla-ieee.jsonl
  replay_faults "$LOGS/outcomes-fla-ieee.jsonl" "$LOGS/replay-ieee.txt"
}

SWEEP_ALL=selective_scan_varlen,causal_conv1d_varlen,causal_conv1d_update,selective_state_update,ssd_varlen,gated_delta_rule_varlen,gated_delta_rule_update,kda_varlen,kda_update,selective_state_update_spec,causal_conv1d_update_spec,gated_delta_rule_update_spec,kda_update_spec
# sweep_one OPS OUT: harness bench sweep of OPS (comma-separated), timings to OUT
sweep_one() {
  timeout "$(limit ${SWEEP_S:-1800})" python3 -m harness.cli bench sweep --device cuda --device-name "$DEVICE" \
    --op "$1" --budget "$(( $(limit ${SWEEP_S:-1800}) * 4 / 5 ))" ${SWEEP_ARGS:-} --out "$2" > "${2%.jsonl}.txt" 2>&1
}

step_sweep() {
  [ "$(left)" -lt 60 ] && { log "sweep: skipped (budget spent)"; return; }
  local t rc=0; t=$(date +%s)
  if [ "${BENCH_SPLIT:-0}" = 1 ]; then
    # both GPUs sweep (each group writes its own op's configuration file): Mamba ops on GPU 0, the rest on 1
    local g=0 ops pids=""
    for ops in $(halves "${SWEEP_OPS:-$SWEEP_ALL}" "$SWEEP_ALL"); do
      [ "$ops" = - ] || { CUDA_VISIBLE_DEVICES=$g pin "$(( g * QUARTER ))-$(( g * QUARTER + QUARTER - 1 ))" \
        bash -c "sweep_one $ops $LOGS/sweep-gpu$g.jsonl" & pids="$pids $!"; }
      g=$(( g + 1 ))
    done
    for p in $pids; do wait "$p" || rc=$?; done
    cat "$LOGS"/sweep-gpu*.jsonl > "$LOGS/sweep.jsonl" 2>/dev/null
  else
    sweep_one "${SWEEP_OPS:-$SWEEP_ALL}" "$LOGS/sweep.jsonl" || rc=$?
  fi
  note sweep $rc $(( $(date +%s) - t ))
  log "sweep: exit $rc; configs: $(git status --short harness/impls/triton/configs | tr '\n' ' ')"
}

# halves OPS [ALL]: two comma-separated lists ('-' when empty), the Mamba ops and the delta-rule and
# speculative ones, of OPS (default: ALL, else every op the bench knows)
halves() {
  python3 -c "
from harness.bench.registry import known_names
want = '$1' or '${2:-}'
ops = [o for o in (want.split(',') if want else known_names()[0])]
late = [o for o in ops if 'delta' in o or 'kda' in o or 'spec' in o]
print(','.join(o for o in ops if o not in late) or '-', ','.join(late) or '-')"
}
# pin CPUS CMD...: run CMD on those cores (taskset), or as is where there is no taskset
pin() { if command -v taskset >/dev/null; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi; }
# run_steps STEP...: the named steps that were asked for, in order
run_steps() { for s in "$@"; do want "$s" && "step_$s"; done; }

OURS_PATH=${PYTHONPATH:-}
want env && step_env
. scripts/peers_setup.sh >> "$LOG" 2>&1
TUNED=.peers/autotune
TCACHE=${TRITON_CACHE_DIR:-${TRITON_HOME:-$HOME}/.triton/cache}
# keep_tuned FROM TO: the autotune result files under FROM copied into TO at the same relative paths
keep_tuned() {
  [ -d "$1" ] || return 0
  mkdir -p "$2"; local to; to=$(cd "$2" && pwd)
  (cd "$1" && find . -name '*.autotune.json' -print0 | xargs -0 -r cp --parents -t "$to")
}
keep_tuned "$TUNED" "$TCACHE"
want tp && step_tp
if [ "$GPUS" = 2 ] && ! want suites && ! want peers && ! want ieee; then
  # nothing to check: both GPUs time
  export QUARTER=$(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 )) BENCH_SPLIT=1
  export -f pin sweep_one halves limit left want resumes retime_ops bench_resume
  export LOGS T0 BUDGET DEVICE SWEEP_S SWEEP_ARGS SWEEP_ALL STEPS RESUME FRESH
  run_steps sweep bench
  BENCH_SPLIT=0 run_steps throughput
elif [ "$GPUS" = 2 ] && ! want sweep && ! want bench && ! want throughput; then
  if want suites && want peers; then
    # nothing to time: both GPUs check, our suites on GPU 0 and the peers' on GPU 1, half the cores each
    ncpu=$(nproc); half=$(( ncpu / 2 > 0 ? ncpu / 2 : 1 ))
    export -f pin step_suites step_peers step_ieee run_steps want resumes left limit log note place resume_args peer_workers \
      replay_faults cut_in checked
    export DIR LOGS LOG T0 BUDGET STEPS RESUME FRESH DEVICE WORKERS GPU_GIB PYTEST_COMMON XDIST OURS_PATH
    CUDA_VISIBLE_DEVICES=0 pin "0-$(( half - 1 ))" bash -c 'run_steps suites' &
    CUDA_VISIBLE_DEVICES=1 pin "$half-$(( ncpu - 1 ))" bash -c 'run_steps peers ieee' &
    wait
  else
    # one checking step: its pytest workers take the GPUs in turn (worker gwN on GPU N mod 2), every core
    run_steps suites peers ieee
  fi
elif [ "$GPUS" = 2 ]; then
  ncpu=$(nproc); quarter=$(( ncpu / 4 > 0 ? ncpu / 4 : 1 ))
  export -f pin step_bench step_throughput step_sweep step_suites step_peers step_ieee run_steps want resumes left limit peer_workers \
    log note place resume_args replay_faults cut_in checked sweep_one halves bench_resume retime_ops drop_retimed
  export SWEEP_ALL SWEEP_ARGS
  export DIR LOGS LOG T0 BUDGET STEPS RESUME FRESH DEVICE WORKERS GPU_GIB PYTEST_COMMON XDIST OURS_PATH
  CUDA_VISIBLE_DEVICES=0 pin "0-$(( quarter - 1 ))" bash -c 'run_steps sweep bench throughput' &
  CUDA_VISIBLE_DEVICES=1 pin "$quarter-$(( ncpu - 1 ))" bash -c 'run_steps suites peers ieee' &
  wait
else
  run_steps suites sweep bench throughput peers ieee
fi

for f in /tmp/peers/build-*.log; do [ -e "$f" ] && cp "$f" "$LOGS/"; done
keep_tuned "$TCACHE" "$TUNED"
if [ -d "$TUNED" ]; then
  tar czf "$LOGS/autotune.tgz" "$TUNED"
  log "autotune results: $(find "$TUNED" -name '*.autotune.json' | wc -l) kept in $TUNED (and $LOGS/autotune.tgz)"
fi
log "done: $(ls "$DIR" | tr '\n' ' ')"
