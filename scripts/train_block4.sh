#!/usr/bin/env bash
# Round 7 (docs/history/rounds-06-10.md): the shipped block-8 Domino drafter re-blocked to 4 drafts per block
# (no weight depends on the block size) and trained on over all 8 data shards. Block 4 won the
# round-6 equal-wall-time comparison on this CPU (1.541 vs 1.465), and its forward costs about half
# of a block-8 one in serving. Resumable: run it again with the same RUN to continue.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BUDGET_S=${BUDGET_S:-5400}   # wall-time budget; warm-up, cosine and λ follow it
RUN=${RUN:-runs/block4}
# Round 7 started from round 4's block-8 drafter (git show 2aec651:models/smollm2-135m-domino/…);
# the default now continues from the shipped block-4 drafter.
INIT=${INIT:-drafters/smollm2-135m-domino}
LR=${LR:-4e-4}
EXTRA=${EXTRA:-}   # more fit arguments, e.g. "--distill 0.5"
DATA=data/smollm2-135m-instruct
TAPS=4,15,28
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
mkdir -p "$RUN"
$PY -m train features --data $DATA --taps $TAPS --shards 0,1,2,3,4,5,6,7 --threads 1
# λ back to 0 after 10 %: the head is already trained. A lower peak rate than from scratch: the
# backbone is already trained on these shards, only its block changes.
$PY -m train fit --data $DATA --stored-only --init-from "$INIT" --block-size 4 \
  --batch-seqs 1 --anchors 32 --lr "$LR" --base-loss-until 0.1 --threads 1 --save-every 500 \
  --steps 1000000 --time-budget-s "$BUDGET_S" --eval-every 2000 \
  --out "$RUN/drafter" --run-dir "$RUN/state" $EXTRA >> "$RUN/fit.log" 2>&1
$PY -m train eval --drafter "$RUN/drafter" --modes domino,dflash --slice test --json "$RUN/drafter/eval.json"
echo "compare $RUN/drafter/eval.json with drafters/smollm2-135m-domino/eval.json; copy if better"
