#!/usr/bin/env bash
# The drafters for the embedded SmolLM2-135M-Instruct target, trained on one CUDA GPU in a time box.
#   gen:  greedy answers (fp32) to the ShareGPT train prompts (the held-out slice in bench/prompts
#         is never trained on), batched 512 rows at a time by our own engine;
#   fit:  Domino and its DFlash twin (no head) for each depth in LAYERS, all side by side on the GPU,
#         same data and seed, schedules following the wall-time budget;
#   features: the target's tap features and top-k log-probs stored once for every fit;
#   eval: held-out τ on the validation slice (40 prompts, 128 tokens, T=0, full blocks) of every drafter;
#   pick: the Domino drafter with the best τ per unit of drafting cost, and its DFlash twin, are
#         copied to $WORK/chosen (copy them to drafters/ by hand after a look at $WORK/*/eval.json).
# Everything lands under $WORK; rerunning resumes gen shards and fit runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WORK=${WORK:-runs/gpu}
DATA=${DATA:-$WORK/data}
PROMPTS=${PROMPTS:-}  # a prompt_ids JSONL; default: gen reads the ShareGPT train split itself
LIMIT=${LIMIT:-}
GEN_BUDGET_S=${GEN_BUDGET_S:-240}
FIT_BUDGET_S=${FIT_BUDGET_S:-180}
LAYERS=${LAYERS:-"1 2"}
BATCH_SEQS=${BATCH_SEQS:-32}
DEVICE=${DEVICE:-cuda}
EVAL_LIMIT=${EVAL_LIMIT:-40}
TAPS=4,15,28
mkdir -p "$WORK"

gen_args=(--out "$DATA" --device "$DEVICE" --batch-size 512 --shard-size 1024 --time-budget-s "$GEN_BUDGET_S")
[ -n "$PROMPTS" ] && gen_args+=(--prompts "$PROMPTS")
[ -n "$LIMIT" ] && gen_args+=(--limit "$LIMIT")
$PY -m train gen "${gen_args[@]}" 2>&1 | tee "$WORK/gen.log"
# Target features stored once (memory-mapped, outside the repo), shared by every fit below.
$PY -m train features --data "$DATA" --taps $TAPS --device "$DEVICE" --dtype bfloat16 2>&1 | tee "$WORK/features.log"

common=(--data "$DATA" --taps $TAPS --block-size 8 --gru-size 256 --rank 64 --draft-vocab 8192
        --batch-seqs "$BATCH_SEQS" --anchors 32 --lr 6e-4 --steps 1000000 --time-budget-s "$FIT_BUDGET_S"
        --save-every 500 --device "$DEVICE" --stored-only --no-qk-norm --eval-every 2000)
for layers in $LAYERS; do
  for kind in domino dflash; do
    head=(); [ $kind = dflash ] && head=(--no-head)
    OMP_NUM_THREADS=2 $PY -m train fit "${common[@]}" "${head[@]}" --layers "$layers" \
      --out "$WORK/$kind-l$layers" --run-dir "$WORK/run-$kind-l$layers" > "$WORK/fit-$kind-l$layers.log" 2>&1 &
  done
done
wait

for layers in $LAYERS; do
  for kind in domino dflash; do
    OMP_NUM_THREADS=2 $PY -m train eval --drafter "$WORK/$kind-l$layers" --modes $kind --device "$DEVICE" \
      --slice validation --limit "$EVAL_LIMIT" --json "$WORK/$kind-l$layers/eval.json" > "$WORK/eval-$kind-l$layers.log" 2>&1 &
  done
done
wait

# Drafting cost grows with depth (about +8 % of a CPU decode step per layer for this target):
# a deeper drafter must buy at least that much τ.
$PY - "$WORK" $LAYERS <<'EOF'
import json, shutil, sys
from pathlib import Path
out, depths = Path(sys.argv[1]), [int(x) for x in sys.argv[2:]]
tau = {d: json.loads((out / f"domino-l{d}/eval.json").read_text())["domino"]["tau"] for d in depths}
best = max(depths, key=lambda d: tau[d] / (1 + 0.08 * (d - 1)))
print("domino tau by depth:", tau, "-> chosen depth", best)
for kind in ("domino", "dflash"):
    dst = out / "chosen" / kind
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(out / f"{kind}-l{best}", dst)
EOF
