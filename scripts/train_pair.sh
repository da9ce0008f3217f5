#!/usr/bin/env bash
# Like-for-like Domino vs DFlash (drafters/README.md, "Domino against DFlash, like for like"): the same data, steps, seed and
# recipe, with and without the Domino head, then both evaluated on the held-out test slice.
# Resumable: features skips stored shards, fit continues from its run directory.
# STAGE2_STEPS > 0 then trains both on from their stage-1 drafters, again with one recipe for both
# (fresh warm-up and cosine, seed 1 for a new anchor order, λ at 0 after 10 % for the trained head),
# so the pair stays like for like at twice the budget.
# Round 10 ran it on all stored data at block 4 with soft labels, both fits at once, one core each:
#   DATA=data/smollm2-135m-instruct,data/smollm2-135m-instruct-turns SHARDS= BLOCK=4 DISTILL=0.5 \
#   STEPS=26000 PARALLEL=1 OUT=runs/pair10 bash scripts/train_pair.sh
# Round 11 trained the Domino side again on round 10's 23 shards (FEATURES_DIR: a directory of
# links to just those), reusing round 10's DFlash run as $OUT/dflash (same data, steps and seed):
# with DETACH=1 (fit --detach-head, the backbone keeps DFlash's gradient), and with RANK=256.
# Round 12: the same with RANK=512 (OUT=runs/pair12r5).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SHARDS=${SHARDS-0,1}          # empty: every shard whose features are stored (store none while the
                              # pair trains: fit --stored-only picks new shards up, unlike for like)
STEPS=${STEPS:-8000}            # x 32 blocks per step
STAGE2_STEPS=${STAGE2_STEPS:-0}
OUT=${OUT:-runs/pair}
DATA=${DATA:-data/smollm2-135m-instruct}   # comma-separated gen directories
BLOCK=${BLOCK:-8}
DISTILL=${DISTILL:-0}         # weight of the target's stored top-k soft labels
PARALLEL=${PARALLEL:-0}       # 1: the two fits at once, one core each
DETACH=${DETACH:-0}           # 1: the Domino head trains on a detached backbone (fit --detach-head)
FEATURES_DIR=${FEATURES_DIR:-}  # default: fit's (~/.cache/domino-serve/features)
RANK=${RANK:-64}              # the head's correction rank (DFlash has no head)
TAPS=4,15,28
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
if [ -n "$SHARDS" ]; then
  $PY -m train features --data "$DATA" --taps $TAPS --shards "$SHARDS" --threads 1
fi
common=(--data "$DATA" --stored-only --taps $TAPS --no-qk-norm --layers 1 --block-size "$BLOCK" --gru-size 256
        --rank "$RANK" --draft-vocab 8192 --batch-seqs 1 --anchors 32 --lr 6e-4 --distill "$DISTILL" --threads 1
        --save-every 500 --steps "$STEPS" --eval-every 2000 --seed 0)
[ -z "$FEATURES_DIR" ] || common+=(--features-dir "$FEATURES_DIR")
domino_args=()
[ "$DETACH" != 1 ] || domino_args+=(--detach-head)
# A run whose eval.json exists is done and skipped.
domino=
if [ ! -f "$OUT/domino/eval.json" ]; then
  # Domino in the background; without PARALLEL it is waited for before DFlash starts. Either way a
  # failed fit stops the script (wait returns its status).
  ( $PY -m train fit "${common[@]}" "${domino_args[@]}" --out "$OUT/domino" --run-dir "$OUT/domino-run" >> "$OUT/domino.log" 2>&1 &&
    $PY -m train eval --drafter "$OUT/domino" --modes domino,dflash --slice test --json "$OUT/domino/eval.json" > "$OUT/eval-domino.log" 2>&1 ) &
  domino=$!
  [ "$PARALLEL" = 1 ] || wait $domino
fi
if [ ! -f "$OUT/dflash/eval.json" ]; then
  $PY -m train fit "${common[@]}" --no-head --out "$OUT/dflash" --run-dir "$OUT/dflash-run" >> "$OUT/dflash.log" 2>&1
  $PY -m train eval --drafter "$OUT/dflash" --modes dflash --slice test --json "$OUT/dflash/eval.json" > "$OUT/eval-dflash.log" 2>&1
fi
[ -z "$domino" ] || [ "$PARALLEL" != 1 ] || wait $domino

if [ "$STAGE2_STEPS" -gt 0 ] && [ ! -f "$OUT/dflash2/eval.json" ]; then
  stage2=(--data $DATA --stored-only --threads 1 --batch-seqs 1 --anchors 32 --lr 6e-4 --save-every 500
          --steps "$STAGE2_STEPS" --eval-every 2000 --seed 1 --base-loss-until 0.1)
  $PY -m train fit "${stage2[@]}" --init-from "$OUT/domino" --out "$OUT/domino2" --run-dir "$OUT/domino2-run" > "$OUT/domino2.log" 2>&1
  $PY -m train fit "${stage2[@]}" --no-head --init-from "$OUT/dflash" --out "$OUT/dflash2" --run-dir "$OUT/dflash2-run" > "$OUT/dflash2.log" 2>&1
  $PY -m train eval --drafter "$OUT/domino2" --modes domino,dflash --slice test --json "$OUT/domino2/eval.json" > "$OUT/eval-domino2.log" 2>&1
  $PY -m train eval --drafter "$OUT/dflash2" --modes dflash --slice test --json "$OUT/dflash2/eval.json" > "$OUT/eval-dflash2.log" 2>&1
fi
