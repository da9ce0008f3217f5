#!/usr/bin/env bash
# Reproduces the drafters shipped in models/ for the embedded SmolLM2-135M-Instruct target.
# Every stage resumes: gen skips finished shards, fit continues from its run directory.
# Later sessions grow the data (raise LIMIT) and continue from the committed drafters with
# INIT=1, so compute accumulates from one run to the next.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-600}
LIMIT=${LIMIT:-6400}
DATA=data/smollm2-135m-instruct
FEATURES=runs/features/smollm2
TAPS=4,15,28

mkdir -p runs
[ "${SKIP_GEN:-0}" = 1 ] || $PY -m model.train gen --out $DATA --taps $TAPS --features-dir $FEATURES --limit "$LIMIT"

common=(--data $DATA --features-dir $FEATURES --taps $TAPS --layers 1 --block-size 8 --gru-size 256 --rank 64
        --draft-vocab 8192 --batch-seqs 4 --anchors 32 --lr 6e-4 --steps "$STEPS" --save-every 100)
init_domino=() init_dflash=()
if [ "${INIT:-0}" = 1 ]; then
  init_domino=(--init-from models/smollm2-135m-domino --restart)
  init_dflash=(--init-from models/smollm2-135m-dflash --restart)
fi
# Same data, same steps, same seed; one thread each so the two runs share the CPU fairly.
OMP_NUM_THREADS=1 $PY -m model.train fit "${common[@]}" "${init_domino[@]}" \
  --out models/smollm2-135m-domino --run-dir runs/domino > runs/domino.log 2>&1 &
OMP_NUM_THREADS=1 $PY -m model.train fit "${common[@]}" "${init_dflash[@]}" --no-head \
  --out models/smollm2-135m-dflash --run-dir runs/dflash > runs/dflash.log 2>&1 &
wait

$PY -m model.train eval --drafter models/smollm2-135m-domino --modes domino,dflash \
  --json models/smollm2-135m-domino/eval.json
$PY -m model.train eval --drafter models/smollm2-135m-dflash --modes dflash \
  --json models/smollm2-135m-dflash/eval.json
