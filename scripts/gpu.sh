#!/usr/bin/env bash
# The GPU run: regenerates a device baseline folder, reports/baselines/<device>/, as one set.
#
#   bash scripts/gpu.sh [--device NAME] [--out DIR] [--logs DIR] [--budget SECONDS] [--steps LIST] [--workers N]
#
#   --device   folder name (default: from the GPU's name, e.g. "NVIDIA H200" -> h200)
#   --out      baseline folder (default reports/baselines/<device>)
#   --logs     pytest/benchmark logs, outcome files, sweep timings, built peer extensions
#              (default reports/runs/gpu-<time>, git-ignored)
#   --budget   seconds for the whole run (default 3600); each step gets at most what is left
#   --steps    comma-separated subset of: env,suites,bench,throughput,peers,sweep (default all but sweep, in
#              that order)
#   --workers  pytest-xdist workers for the suites (default 8)
#
# Steps and what each writes into the baseline folder:
#   env         env.json: versions, GPU, clocks, peers found; each later step adds its exit code and seconds
#   suites      pytest suites/ --device cuda --impl triton --impl torch               -> results.jsonl
#   bench       harness bench --device cuda, once the peers' CUDA extensions are built: ours, the peers'
#               adapters and the peers' own kernels (mamba_ssm's CUDA scan and Triton state update, SSD
#               and gated norm; causal-conv1d's CUDA kernels), eager and CUDA graph, in one run -> bench.jsonl
#   throughput  harness bench throughput, falcon-mamba-7b and mamba-codestral-7b shapes,
#               transformers alongside                                                  -> throughput.jsonl
#   peers       op suites, the engine and delta-mixer oracles with the peers' adapters (mamba_ssm,
#               causal_conv1d, fla, vllm, sglang: those importable)                       -> results-peers.jsonl
#   sweep       (only when named) harness bench sweep for every op with launch-configuration candidates:
#               the winners go to harness/impls/triton/configs/<device>/ (review, then commit them); the
#               timings to <logs>/sweep.jsonl
#
# Peers come from .peers/ (scripts/peers_setup.sh): sdists (mamba_ssm, causal-conv1d), pure-Python wheels
# (fla-core, einops) and the sources scripts/peers_fetch.py extracts (vLLM, SGLang) in .peers/src. Their CUDA extensions (selective_scan_cuda,
# causal_conv1d_cuda) are compiled for sm_90 in the background from the start, forward only
# (scripts/build_peer_ext.py); the built modules are gzipped into <logs>/ext/: copied into .peers/ext/ they
# are reused next time instead of rebuilt.
#
# Safe to cut: a step's file replaces the old one in the baseline folder as soon as that step ends (also
# when the step hit its time limit: its records so far are valid lines), so a run stopped half way leaves
# the finished steps' files; the suites run with --outcomes (one line per finished test in <logs>), so a cut
# run still says what passed and what failed. Files of the selected steps are removed from the folder at
# the start: the folder never mixes two runs' files for a step.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

DEVICE=""; DIR=""; LOGS=""; BUDGET=3600; STEPS="env,suites,bench,throughput,peers"; WORKERS=8
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs a value}; shift 2 ;;
    --out) DIR=${2:?--out needs a value}; shift 2 ;;
    --logs) LOGS=${2:?--logs needs a value}; shift 2 ;;
    --budget) BUDGET=${2:?--budget needs a value}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a value}; shift 2 ;;
    --workers) WORKERS=${2:?--workers needs a value}; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "gpu.sh: unknown argument $1 (expected --device/--out/--logs/--budget/--steps/--workers)" >&2; exit 2 ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu.sh: --budget: expected whole seconds, got $BUDGET" >&2; exit 2 ;; esac
case "$WORKERS" in ''|*[!0-9]*) echo "gpu.sh: --workers: expected a whole number, got $WORKERS" >&2; exit 2 ;; esac
for s in ${STEPS//,/ }; do
  case "$s" in env|suites|bench|throughput|peers|sweep) ;;
    *) echo "gpu.sh: --steps: expected a subset of env,suites,bench,throughput,peers,sweep, got $s" >&2; exit 2 ;; esac
done
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu.sh: expected a CUDA device, got none (torch.cuda.is_available() is False)" >&2; exit 2
fi
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
# limit CAP: the step's time limit, at most what is left of the budget less a margin for the file moves
limit() { local l; l=$(( $(left) - 10 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
# note STEP RC SECONDS: the step's exit code (124: cut by its time limit) and seconds, into env.json
note() {
  python3 - "$DIR/env.json" "$1" "$2" "$3" <<'PY'
import json, os, sys
path, step, rc, sec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
env = json.load(open(path)) if os.path.isfile(path) else {}
env.setdefault("steps", {})[step] = {"exit": rc, "seconds": sec, "cut": rc in (124, 137)}
with open(path + ".tmp", "w") as f:
    json.dump(env, f, indent=1)
os.replace(path + ".tmp", path)
PY
}
# place FILE...: move finished step outputs from the logs into the baseline folder
place() { for f in "$@"; do [ -s "$LOGS/$f" ] && cp "$LOGS/$f" "$DIR/$f.tmp" && mv "$DIR/$f.tmp" "$DIR/$f"; done; }

for s in ${STEPS//,/ }; do
  case "$s" in
    suites) rm -f "$DIR/results.jsonl" ;;
    bench) rm -f "$DIR/bench.jsonl" ;;
    throughput) rm -f "$DIR/throughput.jsonl" ;;
    peers) rm -f "$DIR/results-peers.jsonl" ;;
    env) rm -f "$DIR/env.json" ;;
  esac
done
log "device $DEVICE -> $DIR (logs $LOGS, budget ${BUDGET}s, steps $STEPS)"

# The peers' CUDA extensions compile in the background while the suites run.
if want bench || want peers || want throughput; then
  export MAX_JOBS=${MAX_JOBS:-8}
  (PEERS_BUILD_CUDA=1 . scripts/peers_setup.sh) >> "$LOG" 2>&1
fi

if want env; then
  python3 - "$DIR/env.json" <<'PY' >> "$LOG" 2>&1
import glob, json, os, subprocess, sys
from harness.env import environment
from harness.bench.runner import clocks
env = environment("cuda")
env["clocks"] = clocks("cuda")
env["peers"] = sorted(os.path.basename(p) for p in glob.glob(".peers/*.tar.gz") + glob.glob(".peers/*.whl"))
env["steps"] = {}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(env, f, indent=1)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
PY
  log "env: $?"
fi

PYTEST_COMMON="--device cuda -q -rfs -p no:randomly -p no:cacheprovider --tb=line"

if want suites; then
  if [ "$(left)" -lt 60 ]; then log "suites: skipped (budget spent)"; else
    t=$(date +%s)
    # our implementations without the peers on the path (nothing of ours imports them)
    timeout "$(limit ${SUITES_S:-1500})" python3 -m pytest suites/ --impl triton --impl torch $PYTEST_COMMON \
      -n "$WORKERS" --results "$LOGS/results.jsonl" --outcomes "$LOGS/outcomes.jsonl" > "$LOGS/suites.txt" 2>&1
    rc=$?; place results.jsonl; note suites $rc $(( $(date +%s) - t ))
    log "suites: exit $rc: $(tail -1 "$LOGS/suites.txt")"
  fi
fi

if want bench || want throughput || want peers; then
  . scripts/peers_setup.sh >> "$LOG" 2>&1
fi

if want bench; then
  if [ "$(left)" -lt 60 ]; then log "bench: skipped (budget spent)"; else
    t=$(date +%s); rc=0
    # the peers' own CUDA kernels are backends of the same run: wait for the background builds first
    # (only when their sources were carried: .peers/*.tar.gz)
    w=$(limit ${BUILD_WAIT_S:-400}); ls .peers/*.tar.gz >/dev/null 2>&1 || w=0
    while [ "$w" -gt 0 ] && [ "$(ls /tmp/peers/ext/*.so 2>/dev/null | wc -l)" -lt 2 ]; do sleep 5; w=$(( w - 5 )); done
    log "bench: peer extensions: $(ls /tmp/peers/ext/*.so 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"
    timeout "$(limit ${BENCH_S:-900})" python3 -m harness.cli bench --device cuda --no-progress \
      --out "$LOGS/bench.jsonl" > "$LOGS/bench.txt" 2>&1 || rc=$?
    log "bench: harness bench exit $rc"
    place bench.jsonl
    note bench $rc $(( $(date +%s) - t ))
    mkdir -p "$LOGS/ext"
    for so in /tmp/peers/ext/*.so; do [ -e "$so" ] && gzip -c "$so" > "$LOGS/ext/$(basename "$so").gz"; done
  fi
fi

if want throughput; then
  if [ "$(left)" -lt 60 ]; then log "throughput: skipped (budget spent)"; else
    t=$(date +%s); rc=0
    for preset in falcon-mamba-7b mamba-codestral-7b; do
      [ "$(left)" -lt 40 ] && { log "throughput: $preset skipped (budget spent)"; continue; }
      timeout "$(limit ${TP_S:-300})" python3 -m harness.cli bench throughput --device cuda --preset "$preset" --impl triton \
        --prefill 4096 --decode-batch 64 --reps 3 --warmup 1 --hf-new-tokens 4 --out "$LOGS/throughput.jsonl" \
        >> "$LOGS/throughput.txt" 2>&1 || rc=$?
      log "throughput: $preset exit $rc"
      place throughput.jsonl
    done
    note throughput $rc $(( $(date +%s) - t ))
  fi
fi

if want peers; then
  if [ "$(left)" -lt 60 ]; then log "peers: skipped (budget spent)"; else
    t=$(date +%s)
    # every registered implementation usable here, filtered to the peers' (an --impl naming a peer that
    # is not importable would stop the run)
    timeout "$(limit ${PEERS_S:-900})" python3 -m pytest suites/ops suites/models/test_models_engine_oracle.py \
      suites/models/test_models_delta_mixer_oracle.py \
      -k "mamba_ssm or causal_conv1d or fla or vllm or sglang" $PYTEST_COMMON -n "$WORKERS" --results "$LOGS/results-peers.jsonl" \
      --outcomes "$LOGS/outcomes-peers.jsonl" > "$LOGS/peers.txt" 2>&1
    rc=$?; place results-peers.jsonl; note peers $rc $(( $(date +%s) - t ))
    log "peers: exit $rc: $(tail -1 "$LOGS/peers.txt")"
  fi
fi

if want sweep; then
  if [ "$(left)" -lt 60 ]; then log "sweep: skipped (budget spent)"; else
    t=$(date +%s)
    timeout "$(limit ${SWEEP_S:-1800})" python3 -m harness.cli bench sweep --device cuda --device-name "$DEVICE" \
      --op selective_scan_varlen,causal_conv1d_varlen,causal_conv1d_update,selective_state_update,ssd_varlen,gated_delta_rule_varlen,gated_delta_rule_update,kda_varlen,kda_update \
      --budget "$(( $(limit ${SWEEP_S:-1800}) * 4 / 5 ))" --out "$LOGS/sweep.jsonl" > "$LOGS/sweep.txt" 2>&1
    rc=$?; note sweep $rc $(( $(date +%s) - t ))
    log "sweep: exit $rc; configs: $(git status --short harness/impls/triton/configs | tr '\n' ' ')"
  fi
fi

for f in /tmp/peers/build-*.log; do [ -e "$f" ] && cp "$f" "$LOGS/"; done
log "done: $(ls "$DIR" | tr '\n' ' ')"
