#!/usr/bin/env bash
# Session 2, GPU call 1: forward-only builds of the peers' CUDA extensions (background, shipped back
# gzipped so later calls can carry them), suites/models on cuda (triton + torch), the SSD stage
# breakdown and block-size sweep, then our ops next to the peers' CUDA kernels.
set -u
export PYTHONUNBUFFERED=1
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD/ext
LOG=$OUTD/log.txt
PEERS_BUILD_CUDA=1 source scripts/peers_setup.sh
T0=$(date +%s)
echo "== models suite" >> $LOG
timeout ${MODELS_S:-220} python3 -m pytest suites/models --device cuda --impl triton --impl torch -q -p no:randomly \
  -n 8 --results $OUTD/models-gpu.jsonl -o cache_dir=/tmp/pc >> $LOG 2>&1
echo "models rc=$? at $(( $(date +%s) - T0 ))s" >> $LOG
echo "== ssd bench + sweep" >> $LOG
timeout ${SSD_S:-170} python3 scripts/bench_ssd.py $OUTD/ssd-bench.jsonl --sweep >> $LOG 2>&1
echo "ssd rc=$? at $(( $(date +%s) - T0 ))s" >> $LOG
for i in $(seq 1 ${WAIT_S:-150}); do
  [ -e /tmp/peers/ext/selective_scan_cuda*.so ] && [ -e /tmp/peers/ext/causal_conv1d_cuda*.so ] && break
  sleep 1
done
echo "== builds at $(( $(date +%s) - T0 ))s" >> $LOG
tail -3 /tmp/peers/build-*.log >> $LOG 2>&1
for so in /tmp/peers/ext/*.so; do [ -e "$so" ] && gzip -c "$so" > $OUTD/ext/$(basename $so).gz; done
ls -la $OUTD/ext >> $LOG
timeout ${PEER_S:-120} python3 scripts/gpu_peer_cuda_bench.py $OUTD/peer-cuda.jsonl >> $LOG 2>&1
echo "peer rc=$? at $(( $(date +%s) - T0 ))s" >> $LOG
