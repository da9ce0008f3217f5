#!/usr/bin/env bash
# The GPU check: a thin wrapper around `python -m bench.gpu_check` (its docstring says what it
# measures). One process, a global deadline (420 s) and a time box per part; results.jsonl,
# log.txt and summary.md in OUT_DIR (default $OUT, else bench/results/gpu_check). Wheel-free: it
# runs on the GPU image's own torch and transformers. Extra arguments go to the driver, e.g.
#   bash bench/gpu_check.sh --parts timings,e2e --deadline 170      # the rerun of failed parts
#   OUT_DIR=/tmp/out PY=python3 bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1
exec "$PY" -m bench.gpu_check --out "${OUT_DIR:-${OUT:-bench/results/gpu_check}}" "$@"
