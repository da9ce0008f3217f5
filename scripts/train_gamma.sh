#!/usr/bin/env bash
# Round 10 (docs/history/rounds-06-10.md): the shipped drafter trained on by 384k blocks more, twice at once (one
# core each) with one difference, the per-slot loss decay γ: 0.45·B = 1.8 at block 4 (fit's default)
# against 1.1, which puts the slot weights near the τ gradient at ~0.4 conditional acceptance per
# slot (1, 0.40, 0.16, 0.07). Same data (every stored shard), steps, seed and soft labels.
# Resumable: run it again with the same RUN.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=${RUN:-runs/gamma10}
INIT=${INIT:-drafters/smollm2-135m-domino}
STEPS=${STEPS:-12000}   # x 32 blocks per step
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
mkdir -p "$RUN"
common=(--data data/smollm2-135m-instruct,data/smollm2-135m-instruct-turns --stored-only --init-from "$INIT"
        --block-size 4 --batch-seqs 1 --anchors 32 --lr 3e-4 --distill 0.5 --base-loss-until 0.1 --threads 1
        --save-every 500 --steps "$STEPS" --eval-every 2000 --seed 1)
$PY -m train fit "${common[@]}" --out "$RUN/g18" --run-dir "$RUN/g18-run" >> "$RUN/g18.log" 2>&1 &
$PY -m train fit "${common[@]}" --gamma 1.1 --out "$RUN/g11" --run-dir "$RUN/g11-run" >> "$RUN/g11.log" 2>&1
wait
for g in g11 g18; do
  $PY -m train eval --drafter "$RUN/$g" --modes domino,dflash --slice test --json "$RUN/$g/eval.json"
done
echo "ship the one with the higher best_val_tau ($RUN/g*-run/summary.json) if it beats the shipped drafter's"
