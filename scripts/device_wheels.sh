#!/usr/bin/env bash
# Wheels for a lent GPU machine, which cannot reach a package index: its image has torch but an
# older transformers / huggingface_hub than constraints.txt pins. Downloads the pinned ones into
# .whl/ (ignored by git); bench/gpu_check.sh installs them into /tmp/site when .whl/ is there.
# Then: device `run` with carry [".whl"] and command `OUT_DIR=$OUT PY=python3 bash bench/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
names='transformers|huggingface_hub|tokenizers|hf-xet|httpx2|httpcore2|truststore'
pins=$(grep -E -i "^($names)==" constraints.txt)
PY=${PY:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl $pins
ls -la .whl
