#!/usr/bin/env bash
# Throughput of 1 plain process vs Ray Serve with 1 and 2 replicas of the embedded default (DOMINO_MODE
# and the rest as configured), one after the other; results in bench/results/replicas_*.json.
set -u
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PORT=8102
run() {  # label, extra domino-serve args...
  local label=$1; shift
  .venv/bin/python -c "from app.main import main; main()" "$@" > runs/replicas-server-$label.log 2>&1 &
  local pid=$!
  for _ in $(seq 900); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  sleep 20  # Ray: let every replica come up behind the proxy
  .venv/bin/python -m bench.load --url http://127.0.0.1:$PORT --concurrency 8 --requests 32 --max-tokens 64 \
    --label "$label" --json bench/results/replicas_$label.json > runs/replicas-$label.log 2>&1
  kill -TERM $pid; wait $pid
  ray stop --force > /dev/null 2>&1 || true
}
export DOMINO_PORT=$PORT DOMINO_HOST=127.0.0.1
run plain
run ray1 --replicas 1
run ray2 --replicas 2
grep -h "^| 8 " bench/results/replicas_*.md
