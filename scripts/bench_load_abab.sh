#!/usr/bin/env bash
# Speculation on vs DOMINO_MODE=ar, alternately (ABAB), embedded default, bf16 (auto), 1 thread each.
# REPS repetitions (default 2) of both servers, each at the LEVELS concurrencies with REQUESTS
# requests per level; then one summary over the repetitions (median, range, ratio of means).
set -u
cd "$(dirname "$0")/.."
# Results: bench/results/load_{domino,ar}_N$TAG.*, load_domino_vs_ar_N$TAG.* per repetition N, and
# load_domino_vs_ar_reps$TAG.{json,md} (docs/benchmarks.md).
TAG=${TAG:-}
REPS=${REPS:-2}
LEVELS=${LEVELS:-8,16}
REQUESTS=${REQUESTS:-32}
mkdir -p runs
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
compared=()
for rep in $(seq "$REPS"); do
  for mode in domino ar; do
    DOMINO_MODE=$mode DOMINO_MAX_BATCH_SIZE=16 DOMINO_PORT=8101 DOMINO_HOST=127.0.0.1 .venv/bin/python -c "from app.main import main; main()" > runs/load-server-$mode-$rep.log 2>&1 &
    pid=$!
    for i in $(seq 240); do curl -sf http://127.0.0.1:8101/health >/dev/null && break; sleep 1; done
    .venv/bin/python -m bench.load --url http://127.0.0.1:8101 --concurrency "$LEVELS" --requests "$REQUESTS" --max-tokens 64 \
      --label $mode --json bench/results/load_${mode}_$rep$TAG.json > runs/load-$mode-$rep.log 2>&1
    kill -TERM $pid; wait $pid
  done
  .venv/bin/python -m bench.load --compare bench/results/load_domino_$rep$TAG.json,bench/results/load_ar_$rep$TAG.json \
    --json bench/results/load_domino_vs_ar_$rep$TAG.json >> runs/load-compare.log 2>&1
  compared+=("bench/results/load_domino_vs_ar_$rep$TAG.json")
done
list=$(IFS=,; echo "${compared[*]}")
.venv/bin/python -m bench.load --repetitions "$list" --json bench/results/load_domino_vs_ar_reps$TAG.json
echo done
