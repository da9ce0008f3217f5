#!/usr/bin/env bash
# Reproduces the drafters shipped in models/ for the embedded SmolLM2-135M-Instruct target on a CPU.
# The committed data (data/smollm2-135m-instruct: 8 shards of 1024 ShareGPT train prompts, greedy
# answers of up to 256 tokens) came from scripts/train_default_gpu.sh's gen on a GPU; gen resumes
# here too (set GEN=1), with the same shard size. fit computes the target features per batch
# (--online-features): 2.4M positions of features would not fit in this machine's memory.
# Every stage resumes: gen skips finished shards, fit continues from its run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BUDGET_S=${BUDGET_S:-2300}  # wall-time budget per drafter; the schedules follow it
DATA=data/smollm2-135m-instruct
TAPS=4,15,28

mkdir -p runs
[ "${GEN:-0}" = 1 ] && $PY -m train gen --out $DATA --shard-size 1024 --batch-size 16

common=(--data $DATA --taps $TAPS --layers 1 --block-size 8 --gru-size 256 --rank 64 --draft-vocab 8192
        --batch-seqs 2 --anchors 192 --lr 6e-4 --steps 100000 --time-budget-s "$BUDGET_S" --save-every 25
        --online-features)
# INIT=1 (default) continues from the committed drafters, so compute accumulates across runs.
init_domino=() init_dflash=()
if [ "${INIT:-1}" = 1 ]; then
  init_domino=(--init-from models/smollm2-135m-domino --rebuild-vocab --restart)
  init_dflash=(--init-from models/smollm2-135m-dflash --rebuild-vocab --restart)
fi
$PY -m train fit "${common[@]}" "${init_domino[@]}" \
  --out runs/domino-next --run-dir runs/run-domino-next > runs/domino-next.log 2>&1
[ "${DFLASH:-0}" = 1 ] && $PY -m train fit "${common[@]}" "${init_dflash[@]}" --no-head \
  --out runs/dflash-next --run-dir runs/run-dflash-next > runs/dflash-next.log 2>&1

$PY -m train eval --drafter runs/domino-next --modes domino,dflash --json runs/domino-next/eval.json
echo "compare runs/domino-next/eval.json with models/smollm2-135m-domino/eval.json; copy if better"
