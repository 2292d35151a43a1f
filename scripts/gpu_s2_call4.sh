#!/usr/bin/env bash
# Session 2, GPU call 4: op suites of the rewritten kernels on cuda, launch-config sweeps, the SSD stage sweep,
# then our ops next to the peers' CUDA kernels with the best configs.
set -u
export PYTHONUNBUFFERED=1
OUTD=${OUT:-/tmp/out}
LOG=$OUTD/log.txt
source scripts/peers_setup.sh
T0=$(date +%s)
el() { echo "$1 at $(( $(date +%s) - T0 ))s" >> $LOG; }
echo "== op suites" >> $LOG
timeout ${OPS_S:-170} python3 -m pytest suites/ops/test_ops_selective_scan.py suites/ops/test_ops_conv1d.py \
  suites/ops/test_ops_state_update.py suites/ops/test_ops_ssd.py suites/ops/test_ops_ssd_stages.py \
  --device cuda --impl triton -q -p no:randomly -n 12 -k "not float64" \
  --results $OUTD/ops-gpu.jsonl -o cache_dir=/tmp/pc > $OUTD/ops-pytest.txt 2>&1
el "ops rc=$?"
grep -E "^E  |FAILED|passed|failed|rror" $OUTD/ops-pytest.txt | grep -v "^E   *'" | head -30 >> $LOG
echo "== ssd bench + sweep" >> $LOG
timeout ${SSD_S:-110} python3 scripts/bench_ssd.py $OUTD/ssd-bench.jsonl --sweep > /dev/null 2>&1
el "ssd rc=$?"
grep '"timing"\|"stage"\|TUNING\|error' $OUTD/ssd-bench.jsonl | cut -c1-300 >> $LOG
echo "== sweeps" >> $LOG
SWEEP_ONLY=${SWEEP_ONLY:-scan4096,m1,conv4096,conv_upd} timeout ${SWEEP_S:-170} python3 scripts/gpu_ops_bench.py \
  $OUTD --sweep --budget ${BUDGET:-140} > $OUTD/ops-bench.txt 2>&1
el "sweep rc=$?"
grep -v "^\[B\]" $OUTD/ops-bench.txt | tail -40 >> $LOG
echo "== peer CUDA side by side (best configs)" >> $LOG
HARNESS_TRITON_CONFIG=$OUTD/ops-best-config.json timeout ${PEER_S:-80} python3 scripts/gpu_peer_cuda_bench.py \
  $OUTD/peer-cuda.jsonl >> $LOG 2>&1
el "peer rc=$?"
