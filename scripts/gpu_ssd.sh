#!/usr/bin/env bash
# One GPU call for ssd_varlen: timing (stage sweep when SWEEP=1) next to mamba_ssm, then the SSD suites on cuda.
set -u
export PYTHONUNBUFFERED=1
source scripts/peers_setup.sh
OUTD=${OUT:-/tmp/out}
timeout ${BENCH_S:-150} python3 scripts/bench_ssd.py $OUTD/ssd-bench.jsonl ${SWEEP:+--sweep} 2>&1 | tee $OUTD/ssd-bench.txt
timeout ${SUITE_S:-120} python3 -m pytest suites/ops/test_ops_ssd.py suites/ops/test_ops_ssd_stages.py \
  --device cuda --impl triton --impl torch -q -p no:randomly --results $OUTD/ssd-gpu.jsonl \
  -o cache_dir=/tmp/pc ${PYTEST_ARGS:-} 2>&1 | tee $OUTD/ssd-gpu-pytest.txt | tail -80
timeout ${BIG_S:-60} python3 -m pytest suites/ops/test_ops_ssd.py -k int64 --profile nightly \
  --device cuda --impl triton --impl torch -q -p no:randomly --results $OUTD/ssd-gpu-int64.jsonl \
  -o cache_dir=/tmp/pc 2>&1 | tee $OUTD/ssd-gpu-int64.txt | tail -30
