#!/usr/bin/env bash
# Reproduces round 3's drafters for the embedded SmolLM2-135M-Instruct target on a CPU, the start of
# the chain that led to the shipped ones (drafters/README.md, training history). The committed data (data/smollm2-135m-instruct: 8 shards of 1024 ShareGPT
# train prompts, greedy answers of up to 256 tokens) came from scripts/train_default_gpu.sh's gen;
# gen resumes here too (GEN=1). Every stage resumes: gen skips finished shards, features skips
# stored shards, fit continues from its run directory (schedules continue, they never restart).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BUDGET_S=${BUDGET_S:-3790}      # wall-time budget of the Domino run; the schedules follow it
SHARDS=${SHARDS:-0,1,2,3}       # shards whose features are stored and trained on
DATA=data/smollm2-135m-instruct
TAPS=4,15,28
# One thread per process: on a shared 2-core machine, OpenMP barriers across busy cores cost more
# than the second thread gains.
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

mkdir -p runs
[ "${GEN:-0}" = 1 ] && $PY -m train gen --out $DATA --shard-size 1024 --batch-size 16
$PY -m train features --data $DATA --taps $TAPS --shards "$SHARDS"

common=(--data $DATA --stored-only --taps $TAPS --no-qk-norm --layers 1 --block-size 8 --gru-size 256 --rank 64
        --draft-vocab 8192 --batch-seqs 1 --anchors 32 --lr 6e-4 --threads 1 --save-every 500)
$PY -m train fit "${common[@]}" --steps 1000000 --time-budget-s "$BUDGET_S" --eval-every 2500 \
  --out runs/domino --run-dir runs/domino-run > runs/domino.log 2>&1
# Same-budget comparisons (docs/history/rounds-02-05.md): Domino vs DFlash, hard labels vs distillation.
if [ "${COMPARE:-0}" = 1 ]; then
  for run in "domino-hard" "domino-distill --distill 0.5" "dflash-hard --no-head"; do
    set -- $run
    $PY -m train fit "${common[@]}" --steps 1500 --eval-every 500 "${@:2}" \
      --out "runs/cmp-$1" --run-dir "runs/cmp-$1-run" > "runs/cmp-$1.log" 2>&1 &
  done
  wait
fi
$PY -m train eval --drafter runs/domino --modes domino,dflash --slice test --json runs/domino/eval.json
echo "compare runs/domino/eval.json with drafters/smollm2-135m-domino/eval.json; copy if better"
