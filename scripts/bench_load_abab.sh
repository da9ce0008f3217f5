#!/usr/bin/env bash
# Two servers alternately (ABBA: A first in odd repetitions, B in even ones), embedded default,
# bf16 (auto), 1 thread each: by default speculation on (A = domino) vs DOMINO_MODE=ar (B). REPS
# repetitions (default 2) of both servers, each at the LEVELS concurrencies with REQUESTS requests
# per level; then one summary over the repetitions (median, range, ratio of means).
# Any two settings: A_LABEL/B_LABEL name the servers, A_ENV/B_ENV are their DOMINO_* variables, e.g.
#   A_LABEL=prefix B_LABEL=noprefix A_ENV="DOMINO_MODE=domino" \
#   B_ENV="DOMINO_MODE=domino DOMINO_PREFIX_CACHE_TOKENS=0" bash scripts/bench_load_abab.sh
# LOAD_ARGS adds bench.load options to both sides, e.g. LOAD_ARGS="--temperature 1" (sampled traffic).
set -u
cd "$(dirname "$0")/.."
# Results: bench/results/load_{A,B}_N$TAG.*, load_A_vs_B_N$TAG.* per repetition N, and
# load_A_vs_B_reps$TAG.{json,md} (docs/benchmarks.md).
TAG=${TAG:-}
REPS=${REPS:-2}
LEVELS=${LEVELS:-8,16}
REQUESTS=${REQUESTS:-32}
A_LABEL=${A_LABEL:-domino}
B_LABEL=${B_LABEL:-ar}
A_ENV=${A_ENV:-DOMINO_MODE=domino}
B_ENV=${B_ENV:-DOMINO_MODE=ar}
LOAD_ARGS=${LOAD_ARGS:-}
mkdir -p runs
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
compared=()
for rep in $(seq "$REPS"); do
  # ABBA: the server that runs first in a repetition measured ~5 % slower here, whichever it was.
  order="A B"; [ $((rep % 2)) = 0 ] && order="B A"
  for side in $order; do
    if [ $side = A ]; then label=$A_LABEL; settings=$A_ENV; else label=$B_LABEL; settings=$B_ENV; fi
    # shellcheck disable=SC2086  # settings is a list of VAR=value words
    env $settings DOMINO_MAX_BATCH_SIZE=16 DOMINO_PORT=8101 DOMINO_HOST=127.0.0.1 .venv/bin/python -c "from app.main import main; main()" > runs/load-server-$label-$rep.log 2>&1 &
    pid=$!
    for i in $(seq 240); do curl -sf http://127.0.0.1:8101/health >/dev/null && break; sleep 1; done
    # shellcheck disable=SC2086  # LOAD_ARGS is a list of words
    .venv/bin/python -m bench.load --url http://127.0.0.1:8101 --concurrency "$LEVELS" --requests "$REQUESTS" --max-tokens 64 $LOAD_ARGS \
      --label "$label" --json "bench/results/load_${label}_$rep$TAG.json" > "runs/load-$label-$rep.log" 2>&1
    kill -TERM $pid; wait $pid
  done
  pair="load_${A_LABEL}_vs_${B_LABEL}_$rep$TAG.json"
  .venv/bin/python -m bench.load --compare "bench/results/load_${A_LABEL}_$rep$TAG.json,bench/results/load_${B_LABEL}_$rep$TAG.json" \
    --json "bench/results/$pair" >> runs/load-compare.log 2>&1
  compared+=("bench/results/$pair")
done
list=$(IFS=,; echo "${compared[*]}")
.venv/bin/python -m bench.load --repetitions "$list" --json "bench/results/load_${A_LABEL}_vs_${B_LABEL}_reps$TAG.json"
echo done
