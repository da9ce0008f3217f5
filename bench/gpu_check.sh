#!/usr/bin/env bash
# One GPU check, 8 minutes at most (each part has its own timeout; a failing or timed-out part
# does not stop the others, and the benchmarks write their reports after every batch size, so
# partial results still come back):
#   pytest  tests/model/test_cuda.py (graphs vs eager, sampling through graphs, the benches on CUDA)
#           and tests/model/test_static.py;
#   costs   bench.gpu_costs at full Qwen3-8B / Domino-b16 shape: eager, static and graph columns;
#   e2e     bench.gpu_e2e: tokens/s at tau 1, 4, 7.17 with an oracle drafter, eager vs graph, vs graph ar.
# Results in $OUT_DIR (default bench/results), named gpu_check_$TAG (TAG: the GPU's last name word,
# e.g. h200): _pytest.log, _costs.{json,md,log}, _e2e.{json,md,log}, and the summary .md / .json.
#   bash bench/gpu_check.sh
#   OUT_DIR=/tmp/out TAG=h200 PY=python3 bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# On a lent machine with no package index: the pinned transformers stack from .whl/
# (scripts/device_wheels.sh) shadows the image's older one.
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
OUT_DIR=${OUT_DIR:-bench/results}
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($NF)}')}
base="$OUT_DIR/gpu_check_${TAG:-gpu}"
mkdir -p "$OUT_DIR"
parts=()

# part NAME TIMEOUT_S COMMAND...: output to ${base}_NAME.log; exit status 124 means timed out.
part() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (at most ${limit} s): $*"
  rm -f "${base}_$name".{json,md}  # never report an earlier run's results
  timeout --kill-after=15 "$limit" "$@" > "${base}_$name.log" 2>&1
  rc=$?
  parts+=("$name $rc $((SECONDS - t0))")
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
}

part pytest 230 "$PY" -m pytest -q -rA --durations=15 -p no:cacheprovider \
  tests/model/test_cuda.py tests/model/test_static.py
# Fewer repeats than the default 2 + 5: 27 engines (3 variants x 3 modes x 3 batch sizes) must fit.
part costs 150 "$PY" -m bench.gpu_costs --contexts 512,2048 --batch-sizes 1,4,16 --warmup 1 --repeats 3 \
  --json "${base}_costs.json" --markdown "${base}_costs.md"
part e2e 100 "$PY" -m bench.gpu_e2e --batch-sizes 1,4 --prompt-len 128 --max-new-tokens 128 \
  --json "${base}_e2e.json" --markdown "${base}_e2e.md"

# The summary: each part's status, the pytest tail, then the two reports.
"$PY" - "$base" "${parts[@]}" <<'EOF'
import json, subprocess, sys
from pathlib import Path

base, parts = sys.argv[1], [p.split() for p in sys.argv[2:]]
def read(suffix):
    path = Path(base + suffix)
    return path.read_text() if path.exists() else None
def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
gpu = sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
commit = sh("git", "rev-parse", "--short", "HEAD") or "unknown"
commit += " (modified)" if sh("git", "status", "--porcelain", "-uno") else ""
status = [{"part": n, "exit": int(rc), "seconds": int(s), "timed_out": rc in ("124", "137")} for n, rc, s in parts]
tail = (read("_pytest.log") or "").strip().splitlines()[-1:]
lines = [f"# GPU check: {gpu or 'no nvidia-smi'}, commit {commit}", "", "| part | exit | seconds |", "|---|---|---|"]
lines += [f"| {p['part']} | {p['exit']}{' (timed out)' if p['timed_out'] else ''} | {p['seconds']} |" for p in status]
lines += ["", f"pytest: {tail[0] if tail else 'no output'}", ""]
loads = {k: json.loads(read(f"_{k}.json")) if read(f"_{k}.json") else None for k in ("costs", "e2e")}
for k, result in loads.items():
    if result is not None and not result.get("complete"):
        lines.append(f"({k}: partial, the run stopped before its last batch size; see {base}_{k}.log)\n")
    lines.append(read(f"_{k}.md") or f"(no {k} report: see {base}_{k}.log)\n")
Path(base + ".md").write_text("\n".join(lines))
Path(base + ".json").write_text(json.dumps({"gpu": gpu, "commit": commit, "parts": status, **loads}, indent=2) + "\n")
print("\n".join(lines[: 5 + len(status)]))
EOF
echo "== results: ${base}.md (and .json, _pytest.log, _costs.*, _e2e.*)"
