#!/usr/bin/env bash
# One GPU call that verifies and measures everything (run through the device tool with carry=[".peers"]):
#   1. peers' CUDA extensions build in the background (selective_scan_cuda, causal_conv1d_cuda)
#   2. GPU suites: ops + scenarios for the triton and torch implementations, records to gpu-suites.jsonl
#   3. our Triton ops vs the peers' CUDA kernels on the ANCHORS shapes (peer-cuda.jsonl)
#   4. engine throughput, falcon-mamba-7b and Mamba-Codestral-7B shapes, with transformers alongside
#   5. harness bench --device cuda (every usable implementation, peers' Triton ops included)
# Every phase has its own time limit; outputs land in $OUT as they are produced.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/log.txt
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
SUITE_S=${SUITE_S:-170}; TP_S=${TP_S:-150}; BENCH_S=${BENCH_S:-110}; BUILD_WAIT_S=${BUILD_WAIT_S:-330}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$LOG" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$LOG" 2>&1
export MAX_JOBS=6
PEERS_BUILD_CUDA=1 source scripts/peers_setup.sh
el "phase 2: GPU suites (limit ${SUITE_S}s)"
timeout "$SUITE_S" python3 -m pytest suites/ops suites/scenarios --device cuda --impl triton --impl torch -n 4 -q \
  -p no:cacheprovider --results "$OUT/gpu-suites.jsonl" > "$OUT/gpu-suites.txt" 2>&1
el "suites exit $? : $(tail -1 "$OUT/gpu-suites.txt")"
while [ $(( $(date +%s) - t0 )) -lt "$BUILD_WAIT_S" ] && [ "$(ls /tmp/peers/ext/*.so 2>/dev/null | wc -l)" -lt 2 ]; do sleep 5; done
el "peer builds: $(ls /tmp/peers/ext/*.so 2>/dev/null | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
el "phase 3: triton vs peer CUDA kernels"
timeout 90 python3 scripts/gpu_peer_cuda_bench.py "$OUT/peer-cuda.jsonl" >> "$LOG" 2>&1; el "peer bench exit $?"
el "phase 4: engine throughput (limit ${TP_S}s)"
timeout "$TP_S" bash -c 'for p in falcon-mamba-7b mamba-codestral-7b; do
  python3 -m harness.engine.throughput --device cuda --preset $p --impl triton --prefill 4096 --decode-batch 64 \
    --reps 3 --warmup 1 --hf-new-tokens 4 --out "$0/throughput.jsonl"; done' "$OUT" > "$OUT/throughput.txt" 2>&1
el "throughput exit $?"
el "phase 5: harness bench (limit ${BENCH_S}s)"
timeout "$BENCH_S" python3 -m harness.cli bench --device cuda --reps 20 --warmup 3 --no-progress \
  --out "$OUT/bench.jsonl" > "$OUT/bench.txt" 2>&1
el "bench exit $?"
for f in /tmp/peers/build-*.log; do echo "== $f" >> "$LOG"; tail -5 "$f" >> "$LOG"; done
el "done"
