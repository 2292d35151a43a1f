#!/usr/bin/env bash
# One GPU call for ssd_varlen: timing next to mamba_ssm (then a stage sweep and a re-timing when SWEEP=1),
# then the SSD suites on cuda (xdist), then the nightly int64-offset case.
set -u
export PYTHONUNBUFFERED=1
source scripts/peers_setup.sh
OUTD=${OUT:-/tmp/out}
timeout ${BENCH_S:-150} python3 scripts/bench_ssd.py $OUTD/ssd-bench.jsonl ${SWEEP:+--sweep} > $OUTD/ssd-bench.txt 2>&1
grep -v '"sweep"' $OUTD/ssd-bench.txt | tail -40
timeout ${SUITE_S:-100} python3 -m pytest suites/ops/test_ops_ssd_stages.py suites/ops/test_ops_ssd.py \
  --device cuda --impl triton --impl torch -q -p no:randomly -n ${NPROC:-8} -k "not float64" \
  --results $OUTD/ssd-gpu.jsonl -o cache_dir=/tmp/pc ${PYTEST_ARGS:-} > $OUTD/ssd-gpu-pytest.txt 2>&1
grep -v "^E   *'" $OUTD/ssd-gpu-pytest.txt | grep -E "^E  |FAILED|passed|failed|rror" | head -40
timeout ${BIG_S:-45} python3 -m pytest suites/ops/test_ops_ssd.py -k int64 --profile nightly \
  --device cuda --impl triton -q -p no:randomly --results $OUTD/ssd-gpu-int64.jsonl \
  -o cache_dir=/tmp/pc > $OUTD/ssd-gpu-int64.txt 2>&1
grep -E "^E  |FAILED|passed|failed" $OUTD/ssd-gpu-int64.txt | head -10
