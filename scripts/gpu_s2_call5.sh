#!/usr/bin/env bash
# Session 2, GPU call 5 (final): op suites of the final kernels on cuda, SSD next to mamba_ssm, our ops next to
# the peers' CUDA kernels (eager and CUDA graph), the anchor table with mamba_ssm's Triton ops, suites/models on
# cuda (the machine's own transformers: with a 5.24 wheel carried in .peers every transformers test failed there; 5.17's Mamba-2 norm
# limits its oracle to n_groups = 1, see suites/models), then engine throughput for the falcon-mamba-7b shape.
# suites/models needs ~400 s there (Triton compiles per drawn shape): give it a call of its own (MODELS_S=400).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUTD=${OUT:-/tmp/out}
LOG=$OUTD/log.txt
source scripts/peers_setup.sh
T0=$(date +%s)
el() { echo "$1 at $(( $(date +%s) - T0 ))s" >> $LOG; }
python3 -c "import transformers, triton, torch; print('transformers', transformers.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" >> $LOG 2>&1
echo "== op suites" >> $LOG
timeout ${OPS_S:-120} python3 -m pytest suites/ops/test_ops_selective_scan.py suites/ops/test_ops_conv1d.py \
  suites/ops/test_ops_state_update.py suites/ops/test_ops_ssd.py suites/ops/test_ops_ssd_stages.py \
  suites/ops/test_ops_contract.py --device cuda --impl triton -q -p no:randomly -n 12 \
  --results $OUTD/ops-gpu.jsonl -o cache_dir=/tmp/pc > $OUTD/ops-pytest.txt 2>&1
el "ops rc=$?"
grep -E "^E  |FAILED|passed|failed|rror" $OUTD/ops-pytest.txt | grep -v "^E   *'" | head -20 >> $LOG
echo "== ssd next to mamba_ssm" >> $LOG
timeout ${SSD_S:-80} python3 scripts/ssd_variants.py $OUTD/ssd-variants.jsonl >> $LOG 2>&1
el "ssd rc=$?"
echo "== peer CUDA side by side" >> $LOG
timeout ${PEER_S:-90} python3 scripts/gpu_peer_cuda_bench.py $OUTD/peer-cuda.jsonl >> $LOG 2>&1
el "peer rc=$?"
echo "== anchors (no sweep)" >> $LOG
timeout ${ANCH_S:-60} python3 scripts/gpu_ops_bench.py $OUTD > $OUTD/ops-bench.txt 2>&1
el "anchors rc=$?"
echo "== models suite" >> $LOG
timeout ${MODELS_S:-170} python3 -m pytest suites/models --device cuda --impl triton --impl torch -q -p no:randomly \
  -n 12 --results $OUTD/models-gpu.jsonl -o cache_dir=/tmp/pc --durations=8 > $OUTD/models-pytest.txt 2>&1
el "models rc=$?"
grep -E "FAILED|passed|failed|skipped|rror" $OUTD/models-pytest.txt | tail -8 >> $LOG
echo "== throughput (falcon-mamba-7b shape)" >> $LOG
timeout ${TP_S:-80} python3 -m harness.engine.throughput --device cuda --preset falcon-mamba-7b --impl triton \
  --prefill 4096 --decode-batch 64 --reps 3 --warmup 1 --no-hf --out $OUTD/throughput.jsonl >> $LOG 2>&1
el "throughput rc=$?"
