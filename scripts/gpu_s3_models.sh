#!/usr/bin/env bash
# Session 3, one GPU call: suites/models on cuda with every registered implementation (reference, torch,
# triton; the final kernels of session 2) and the machine's own transformers (5.17 on the H200 box).
# Triton compiles per drawn shape, so this needs most of a call: MODELS_S (default 540 s).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUTD=${OUT:-/tmp/out}
LOG=$OUTD/log.txt
source scripts/peers_setup.sh
python3 -c "import transformers, triton, torch; print('transformers', transformers.__version__, 'triton', triton.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" >> $LOG 2>&1
T0=$(date +%s)
timeout ${MODELS_S:-540} python3 -m pytest suites/models --device cuda -q -rs -p no:randomly -n ${NPROC:-14} \
  --results $OUTD/models-gpu.jsonl -o cache_dir=/tmp/pc --durations=15 --junitxml=$OUTD/models-junit.xml \
  > $OUTD/models-pytest.txt 2>&1
echo "models rc=$? after $(( $(date +%s) - T0 ))s" >> $LOG
grep -E "FAILED|passed|failed|skipped|rror" $OUTD/models-pytest.txt | tail -12 >> $LOG
