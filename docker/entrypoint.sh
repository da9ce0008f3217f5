#!/usr/bin/env bash
# Container entry point (tests/test_container.py runs this same file outside Docker). It turns
# Hugging Face model ids into directories of the mounted cache, then execs domino-serve, so the
# server is PID 1 and gets docker stop's SIGTERM itself (graceful drain, see DOMINO_DRAIN_TIMEOUT).
# Arguments are passed on to domino-serve (`docker run IMAGE --max-batch-size 16`).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Reachable through the published port; the Dockerfile sets the same defaults.
export DOMINO_HOST="${DOMINO_HOST:-0.0.0.0}"
export DOMINO_PORT="${DOMINO_PORT:-8000}"

target="${DOMINO_TARGET:-default}"
if [ "$target" != default ] && [ ! -e "$target" ]; then
  # A hub id: clients keep seeing its name (Qwen3-8B), not the snapshot's commit hash.
  export DOMINO_SERVED_MODEL_NAME="${DOMINO_SERVED_MODEL_NAME:-${target##*/}}"
  DOMINO_TARGET="$(python "$HERE/resolve_model.py" "$target")"
  export DOMINO_TARGET
fi
if [ -n "${DOMINO_DRAFTER:-}" ] && [ ! -e "$DOMINO_DRAFTER" ]; then
  # The server loads drafters from a directory only.
  DOMINO_DRAFTER="$(python "$HERE/resolve_model.py" "$DOMINO_DRAFTER")"
  export DOMINO_DRAFTER
fi

exec domino-serve "$@"
