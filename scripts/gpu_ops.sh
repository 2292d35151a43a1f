#!/usr/bin/env bash
# One GPU call for the op kernels: timings (with a config sweep when SWEEP=1), then the op suites on cuda.
set -u
export PYTHONUNBUFFERED=1
source scripts/peers_setup.sh
OUTD=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUTD/ops-env.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUTD/ops-env.txt 2>&1
timeout ${BENCH_S:-120} python3 scripts/gpu_ops_bench.py $OUTD/ops-bench.jsonl ${SWEEP:+--sweep} 2>&1 | tee $OUTD/ops-bench.txt
timeout ${SUITE_S:-150} python3 -m pytest suites/ops/test_ops_conv1d.py suites/ops/test_ops_state_update.py \
  suites/ops/test_ops_selective_scan.py suites/ops/test_ops_gated_norm.py suites/ops/test_ops_contract.py \
  --device cuda --impl triton --impl torch ${EXTRA_IMPL:-} -q -p no:randomly --results $OUTD/ops-gpu.jsonl \
  -o cache_dir=/tmp/pc ${PYTEST_ARGS:-} 2>&1 | tee $OUTD/ops-gpu-pytest.txt | tail -60
