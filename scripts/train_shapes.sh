#!/usr/bin/env bash
# What the CPU favours (docs/history/rounds-02-05.md, round 5; rounds-06-10.md, round 6): block 8 vs 4 and 1 vs 2 draft layers at equal wall time,
# same data, seed and recipe; chosen on the validation walk (val.csv: τ and τ per slot), never on
# the test slice. Needs the features of SHARDS stored (scripts/train_pair.sh stores 0 and 1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SHARDS=${SHARDS:-0,1}
BUDGET_S=${BUDGET_S:-600}
OUT=${OUT:-runs/shapes}
DATA=data/smollm2-135m-instruct
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
common=(--data $DATA --stored-only --taps 4,15,28 --no-qk-norm --gru-size 256 --rank 64 --draft-vocab 8192
        --batch-seqs 1 --anchors 32 --lr 6e-4 --threads 1 --save-every 500 --steps 1000000
        --time-budget-s "$BUDGET_S" --eval-every 1000 --seed 0)
# SHAPES: which to run (names from the list below); PARALLEL=1 runs them at once, one core each.
SHAPES=${SHAPES:-b8-l1,b4-l1,b8-l2}
PARALLEL=${PARALLEL:-0}
for shape in "b8-l1 --block-size 8 --layers 1" "b4-l1 --block-size 4 --layers 1" "b8-l2 --block-size 8 --layers 2"; do
  set -- $shape
  [[ ",$SHAPES," == *",$1,"* ]] || continue
  $PY -m train fit "${common[@]}" "${@:2}" --out "$OUT/$1" --run-dir "$OUT/$1-run" > "$OUT/$1.log" 2>&1 &
  [ "$PARALLEL" = 1 ] || wait $!
done
wait
