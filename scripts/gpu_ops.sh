#!/usr/bin/env bash
# One GPU call for the op kernels (run from the repo root; results under $OUT):
#   1. timings on the ANCHORS.md shapes, with a launch-config sweep when SWEEP=1 (scripts/gpu_ops_bench.py);
#   2. the op suites on cuda for the triton and torch impls, with the best configs (HARNESS_TRITON_CONFIG);
#   3. the large-offset (> 2^31 elements) cases for the triton impl (--profile nightly).
set -u
export PYTHONUNBUFFERED=1
source scripts/peers_setup.sh
OUTD=${OUT:-/tmp/out}
mkdir -p $OUTD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUTD/ops-env.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUTD/ops-env.txt 2>&1
timeout ${BENCH_S:-120} python3 scripts/gpu_ops_bench.py $OUTD ${SWEEP:+--sweep --graph-sweep} --budget ${SWEEP_BUDGET:-85} 2>&1 \
  | tee $OUTD/ops-bench.txt | grep -v "^\[B\]"
[ -f $OUTD/ops-best-config.json ] && export HARNESS_TRITON_CONFIG=$OUTD/ops-best-config.json
timeout ${SUITE_S:-100} python3 -m pytest suites/ops/test_ops_conv1d.py suites/ops/test_ops_state_update.py \
  suites/ops/test_ops_selective_scan.py suites/ops/test_ops_gated_norm.py suites/ops/test_ops_contract.py \
  --device cuda --impl triton --impl torch ${EXTRA_IMPL:-} -q -n ${WORKERS:-8} --results $OUTD/ops-gpu.jsonl \
  -o cache_dir=/tmp/pc ${PYTEST_ARGS:-} 2>&1 | tee $OUTD/ops-gpu-pytest.txt | tail -40
timeout ${BIG_S:-35} python3 -m pytest suites/ops/test_ops_conv1d.py suites/ops/test_ops_state_update.py \
  suites/ops/test_ops_selective_scan.py -k offsets_past --device cuda --impl triton --profile nightly -q \
  --results $OUTD/ops-gpu.jsonl -o cache_dir=/tmp/pc 2>&1 | tee $OUTD/ops-gpu-big.txt | tail -15
