#!/usr/bin/env bash
# Round 8 (docs/history/rounds-06-10.md): the shipped block-4 drafter trained on over the first-turn data plus
# the later-turn data (`gen --source later-turns`, data/smollm2-135m-instruct-turns). The later
# turns' features are stored by a job beside fit (fit --stored-only picks each shard up as it
# lands, every 500 steps); both jobs use one core each. Resumable: run it again with the same RUN.
# Round 9 ran it twice, one per core: DISTILL=0 (hard labels, 6,600 s) and DISTILL=0.5 (the
# target's stored top-16 mixed in, 4,470 s); the distilled one validated higher and is shipped.
# Round 11 ran it on round 10's shipped drafter with all 36 stored shards (2.96M answer tokens):
#   RUN=runs/turns11 GAMMA=1.1 BUDGET_S=5400 bash scripts/train_turns.sh
# Round 12 widened round 11's head from rank 64 to 256 (output unchanged) and trained on:
#   RUN=runs/turns12 GAMMA=1.1 RANK=256 BUDGET_S=5700 bash scripts/train_turns.sh
# On a fresh machine no features are stored (~2.3 min per shard per core): FEATURE_JOBS=2 stores
# them two at a time, the first-turn ones before fit starts, the later turns from the start and
# beside fit. The first-turn shards hold ~980 answers each (~10 min per shard per core): round 14
# stored three of them (FIRST_SHARDS=0,6,7; shard 0 holds fit's validation samples) as a replay of
# the data INIT was trained on, so that fit started early.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BUDGET_S=${BUDGET_S:-7200}   # wall-time budget; warm-up, cosine and λ follow it
RUN=${RUN:-runs/turns}
INIT=${INIT:-drafters/smollm2-135m-domino}
LR=${LR:-3e-4}
DISTILL=${DISTILL:-0.5}   # weight of the soft labels (0: hard labels only)
GAMMA=${GAMMA:-}          # per-slot loss decay; empty: fit's default (0.45·B)
RANK=${RANK:-}            # widen INIT's head to this correction rank (fit --rank); empty: keep it
LAYERS=${LAYERS:-}        # deepen INIT to this many layers (fit --layers); empty: keep its depth
FEATURE_JOBS=${FEATURE_JOBS:-1}  # features jobs (one core each); 2 on a fresh machine's 2 cores
TURN_SHARDS=${TURN_SHARDS:-}      # later-turn shards to store (default: all); fit trains on what is stored
FIRST_SHARDS=${FIRST_SHARDS:-}    # first-turn shards to store before fit (default: all; ~10 min each per core; include 0)
FIRST=data/smollm2-135m-instruct
TURNS=data/smollm2-135m-instruct-turns
TAPS=4,15,28
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
mkdir -p "$RUN"
# Stores the features of DIR's shards (or of the comma-separated shard numbers $3) in $2 jobs, one
# core each, newest shards first: a drafter trained on from INIT has not seen them yet.
features_jobs() {
  local dir=$1 jobs=$2 j
  local nums=($(ls "$dir" | sed -n 's/^shard-0*\([0-9][0-9]*\)\.jsonl\.gz$/\1/p' | sort -rn))
  [ -z "${3:-}" ] || nums=($(tr , '\n' <<< "$3" | sort -rn))
  for ((j = 0; j < jobs; j++)); do
    local mine=()
    for ((k = j; k < ${#nums[@]}; k += jobs)); do mine+=("${nums[k]}"); done
    [ ${#mine[@]} -eq 0 ] || $PY -m train features --data "$dir" --taps $TAPS --threads 1 \
      --shards "$(IFS=,; echo "${mine[*]}")" >> "$RUN/features.log" 2>&1 &
  done
  wait
}
features_jobs $FIRST "$FEATURE_JOBS" "$FIRST_SHARDS" &   # already stored: a quick check
first=$!
features_jobs $TURNS "$FEATURE_JOBS" "$TURN_SHARDS" &
features=$!
wait $first   # fit validates on shard 0's last samples: it starts once the first-turn shards are stored
$PY -m train fit --data $FIRST,$TURNS --stored-only --init-from "$INIT" --block-size 4 \
  --batch-seqs 1 --anchors 32 --lr "$LR" --distill "$DISTILL" --base-loss-until 0.1 --threads 1 --save-every 500 \
  --steps 1000000 --time-budget-s "$BUDGET_S" --eval-every 2000 \
  ${GAMMA:+--gamma "$GAMMA"} ${RANK:+--rank "$RANK"} ${LAYERS:+--layers "$LAYERS"} --out "$RUN/drafter" --run-dir "$RUN/state" >> "$RUN/fit.log" 2>&1
wait $features
$PY -m train eval --drafter "$RUN/drafter" --modes domino,dflash --slice test --json "$RUN/drafter/eval.json"
echo "compare $RUN/drafter/eval.json with drafters/smollm2-135m-domino/eval.json; copy if better"
