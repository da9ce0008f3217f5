#!/usr/bin/env bash
# Issue 53's served scenario (bench/interference.py --url) against two servers in turns (ABBA), the
# embedded default, 1 thread each, DOMINO_MAX_BATCH_SIZE=16 (the 8 streams and the long prompt run
# together): by default chunked prefill as the server chooses it (A) against off (B). REPS rounds.
# Results: bench/results/interference_served_{A,B}_N$TAG.json per run and
# interference_served_A_vs_B$TAG.json (every run, medians, a table).
set -u
cd "$(dirname "$0")/.."
TAG=${TAG:-}
REPS=${REPS:-2}
A_LABEL=${A_LABEL:-auto}
B_LABEL=${B_LABEL:-whole}
A_ENV=${A_ENV:-DOMINO_MODE=domino}
B_ENV=${B_ENV:-DOMINO_MAX_NUM_BATCHED_TOKENS=0}
mkdir -p runs
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
files=()
for rep in $(seq "$REPS"); do
  # ABBA: the server that runs first in a repetition measured ~5 % slower here, whichever it was.
  order="A B"; [ $((rep % 2)) = 0 ] && order="B A"
  for side in $order; do
    if [ $side = A ]; then label=$A_LABEL; settings=$A_ENV; else label=$B_LABEL; settings=$B_ENV; fi
    # shellcheck disable=SC2086  # settings is a list of VAR=value words
    env $settings DOMINO_MAX_BATCH_SIZE=16 DOMINO_PORT=8102 DOMINO_HOST=127.0.0.1 .venv/bin/python -c "from app.main import main; main()" > "runs/interference-server-$label-$rep.log" 2>&1 &
    pid=$!
    for i in $(seq 240); do curl -sf http://127.0.0.1:8102/health >/dev/null && break; sleep 1; done
    out="bench/results/interference_served_${label}_$rep$TAG.json"
    .venv/bin/python -m bench.interference --url http://127.0.0.1:8102 --reps 1 --label "$label" --json "$out" \
      > "runs/interference-$label-$rep.log" 2>&1
    files+=("$out")
    kill -TERM $pid; wait $pid
  done
done
list=$(IFS=,; echo "${files[*]}")
.venv/bin/python -m bench.interference --summarize "$list" --json "bench/results/interference_served_${A_LABEL}_vs_${B_LABEL}$TAG.json"
