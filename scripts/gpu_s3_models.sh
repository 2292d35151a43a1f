#!/usr/bin/env bash
# Session 3, one GPU call: suites/models on cuda with the machine's own transformers (5.17 on the H200 box).
#  A: the whole models suite with our implementations (reference, torch, triton; the final kernels of session 2)
#  B: the engine oracle with the peers' adapters (mamba_ssm Triton ops, mamba_ssm CUDA scan, causal-conv1d,
#     fla), the rest of each engine filled from `torch`; a peer that cannot run an engine step skips, saying why.
# --outcomes keeps one line per finished test, so a part cut by its time limit still says what failed.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUTD=${OUT:-/tmp/out}
LOG=$OUTD/log.txt
python3 -c "import transformers, triton, torch; print('transformers', transformers.__version__, 'triton', triton.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" >> $LOG 2>&1
T0=$(date +%s)
COMMON="--device cuda -q -rs -p no:randomly -n ${NPROC:-15} --results $OUTD/models-gpu.jsonl --outcomes $OUTD/models-outcomes.jsonl -o cache_dir=/tmp/pc --durations=12"
# A runs without the peers on the path (nothing of ours needs them)
PYTHONPATH=$PWD timeout ${A_S:-250} python3 -m pytest suites/models --impl reference --impl torch --impl triton $COMMON > $OUTD/models-pytest-A.txt 2>&1
echo "A rc=$? after $(( $(date +%s) - T0 ))s" >> $LOG
source scripts/peers_setup.sh
# every registered implementation usable here, less ours (an --impl naming an unusable peer would stop the run)
timeout ${B_S:-250} python3 -m pytest suites/models/test_models_engine_oracle.py -k "mamba_ssm or causal_conv1d or fla" $COMMON > $OUTD/models-pytest-B.txt 2>&1
echo "B rc=$? after $(( $(date +%s) - T0 ))s" >> $LOG
python3 - "$OUTD/models-outcomes.jsonl" >> $LOG 2>&1 <<'PY'
import collections, json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(collections.Counter(r["outcome"] for r in rows))
for r in rows:
    if r["outcome"] != "passed" or r["seconds"] > 60:
        print(r["outcome"], r["seconds"], r["nodeid"].split("::")[-1], r["why"][:300])
PY
