#!/usr/bin/env bash
# Session 2, GPU call 2: the changed kernels' op suites on cuda (bf16/fp16/fp32), launch-config sweeps of
# the changed kernels, then our ops next to the peers' CUDA kernels with the best configs.
set -u
export PYTHONUNBUFFERED=1
OUTD=${OUT:-/tmp/out}
LOG=$OUTD/log.txt
_cc_set=${CC+x}; _cc_val=${CC-}
source scripts/peers_setup.sh
if [ -n "$_cc_set" ]; then export CC="$_cc_val"; else unset CC; fi
unset MS
T0=$(date +%s)
python3 -c "import transformers, triton, torch; print('transformers', transformers.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" >> $LOG 2>&1
echo "== op suites (${OPS_FILES})" >> $LOG
timeout ${OPS_S:-200} python3 -m pytest ${OPS_FILES} --device cuda --impl triton -q -p no:randomly -n 8 -k "not float64" \
  --results $OUTD/ops-gpu.jsonl -o cache_dir=/tmp/pc > $OUTD/ops-pytest.txt 2>&1
echo "ops rc=$? at $(( $(date +%s) - T0 ))s" >> $LOG
grep -E "^E  |FAILED|passed|failed|rror" $OUTD/ops-pytest.txt | grep -v "^E   *'" | head -30 >> $LOG
echo "== sweeps ($SWEEP_ONLY)" >> $LOG
timeout ${SWEEP_S:-200} python3 scripts/gpu_ops_bench.py $OUTD --sweep --budget ${BUDGET:-150} >> $LOG 2>&1
echo "sweep rc=$? at $(( $(date +%s) - T0 ))s" >> $LOG
echo "== peer CUDA side by side (best configs)" >> $LOG
HARNESS_TRITON_CONFIG=$OUTD/ops-best-config.json timeout ${PEER_S:-100} python3 scripts/gpu_peer_cuda_bench.py \
  $OUTD/peer-cuda.jsonl >> $LOG 2>&1
echo "peer rc=$? at $(( $(date +%s) - T0 ))s" >> $LOG
