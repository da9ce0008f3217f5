#!/usr/bin/env bash
# The container, for real: builds the CPU image from this Dockerfile (on the base docker/make_cpu_base.sh
# makes), runs it with its port published on loopback, and checks it from the host with the openai SDK.
# One line per check, then `container smoke: ok` or `container smoke: FAILED (...)`. Every container and
# image it creates is removed at the end, also on failure or Ctrl-C.
#
#   docker/smoke.sh                    # or: make test-container
#
# Environment:
#   CONTAINER_ENGINE   podman or docker (default: podman if installed, else docker if its daemon answers)
#   SMOKE_BASE_IMAGE   an existing base image to build on (kept); default: make a fresh one (~10 min)
#   PYTHON             interpreter with the openai SDK (default: .venv/bin/python, see requirements-dev.txt)
#   HOST_CA_BUNDLE     CA bundle the build trusts (default: $PIP_CERT or Debian's bundle); see below
# Needs root (mmdebstrap's root mode, rootful podman), mmdebstrap, and the network to reach Debian's
# archive and PyPI during the builds; the running containers need no network beyond loopback.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CLIENT=("$PY" "$ROOT/docker/smoke_client.py")

if [ -n "${CONTAINER_ENGINE:-}" ]; then
  ENGINE="$CONTAINER_ENGINE"
elif command -v podman >/dev/null; then
  ENGINE=podman
elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  ENGINE=docker # the docker CLI alone, without a daemon, cannot build
else
  echo "container smoke: FAILED (neither podman nor a working docker; apt-get install podman runc mmdebstrap)" >&2
  exit 1
fi
export CONTAINER_ENGINE="$ENGINE" # make_cpu_base.sh imports into the same engine

# This sandbox refuses to raise resource limits, and both engines raise nofile by default.
ULIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
STOP_TIMEOUT=40 # Dockerfile and README: `docker stop -t 40` = DOMINO_DRAIN_TIMEOUT (30 s) + a margin
RUN_ID="$$-$(date +%s)"
IMAGE="localhost/domino-serve-smoke:$RUN_ID"
BASE_IMAGE="${SMOKE_BASE_IMAGE:-localhost/domino-serve-smoke-base:$RUN_ID}"
CONTAINERS=()
CURRENT="setup"
LAST_OUT=""

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
mb() { awk -v b="$1" 'BEGIN { printf "%.0f MB", b / 1e6 }'; }

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$rc" -ne 0 ] && [ "${#CONTAINERS[@]}" -gt 0 ]; then
    local last="${CONTAINERS[-1]}"
    echo "--- last 30 log lines of $last:" >&2
    "$ENGINE" logs --tail 30 "$last" >&2 2>&1 || true
  fi
  for c in "${CONTAINERS[@]}"; do
    "$ENGINE" rm -f "$c" >/dev/null 2>&1 || true
  done
  "$ENGINE" rmi -f "$IMAGE" >/dev/null 2>&1 || true
  if [ -z "${SMOKE_BASE_IMAGE:-}" ]; then
    "$ENGINE" rmi -f "$BASE_IMAGE" >/dev/null 2>&1 || true # ours: made by this run
  fi
  if [ "$rc" -eq 0 ]; then
    echo "container smoke: ok"
  else
    echo "container smoke: FAILED ($CURRENT)"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM # through cleanup

# check NAME CMD...: runs CMD, prints "ok    NAME: <its output>" or fails the smoke with its output.
check() {
  local name="$1" out
  shift
  CURRENT="$name"
  if out="$("$@" 2>&1)"; then
    LAST_OUT="$out"
    echo "ok    $name: ${out//$'\n'/; }"
  else
    echo "FAIL  $name: $out" >&2
    return 1
  fi
}

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# run_container NAME [ENGINE-ARGS...]: starts the image detached, port 8000 published on loopback only.
run_container() {
  local name="$1" port
  shift
  port="$(free_port)"
  CONTAINERS+=("$name")
  # podman says on stderr that it cannot start HEALTHCHECK timers without systemd: shown on failure only.
  local err
  err="$("$ENGINE" run -d --name "$name" -p "127.0.0.1:$port:8000" "${ULIMITS[@]}" "$@" "$IMAGE" 2>&1 >/dev/null)" || {
    echo "$err" >&2
    return 1
  }
  URL="http://127.0.0.1:$port"
}

# wait_healthy NAME CONTAINER: /health 200 through the published port, failing early if the container exits.
wait_healthy() {
  check "$1" "${CLIENT[@]}" --url "$URL" wait-healthy --timeout 300 \
    -- "$ENGINE" inspect --format '{{.State.Running}}' "$2"
}

# -- build -----------------------------------------------------------------------------------------

if [ -z "${SMOKE_BASE_IMAGE:-}" ]; then
  start="$(now)"
  CURRENT="base image"
  nice -n 10 bash "$ROOT/docker/make_cpu_base.sh" "$BASE_IMAGE" >/tmp/domino-smoke-base.$$.log 2>&1 || {
    tail -30 /tmp/domino-smoke-base.$$.log >&2
    rm -f /tmp/domino-smoke-base.$$.log
    exit 1
  }
  rm -f /tmp/domino-smoke-base.$$.log
  echo "ok    base image: $BASE_IMAGE made in $(since "$start") s (mmdebstrap bookworm + Python 3.11 + CPU torch)"
fi

BUILD_ARGS=(--network host "${ULIMITS[@]}" --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE")
if [ "$ENGINE" = podman ]; then
  # OCI image configs have no HEALTHCHECK: podman keeps it only in the docker format. No layer cache:
  # a cold build is what is measured, and no untagged intermediate images are left behind.
  BUILD_ARGS+=(--format docker --layers=false)
  # The build's pip calls trust what the host trusts (a TLS-inspecting proxy's CA, where there is
  # one). A build-time mount: the bundle is not part of any layer, and the Dockerfile stays the same.
  BUILD_ARGS+=(--volume "${HOST_CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}:/etc/ssl/certs/ca-certificates.crt:ro")
else
  BUILD_ARGS+=(--no-cache)
fi
CURRENT="build"
start="$(now)"
nice -n 10 "$ENGINE" build "${BUILD_ARGS[@]}" "$ROOT" >/tmp/domino-smoke-build.$$.log 2>&1 || {
  tail -40 /tmp/domino-smoke-build.$$.log >&2
  rm -f /tmp/domino-smoke-build.$$.log
  exit 1
}
rm -f /tmp/domino-smoke-build.$$.log
BUILD_S="$(since "$start")"
IMAGE_BYTES="$("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE")"
BASE_BYTES="$("$ENGINE" image inspect --format '{{.Size}}' "$BASE_IMAGE")"
echo "ok    build: $IMAGE built in $BUILD_S s; $(mb "$IMAGE_BYTES") ($(mb "$BASE_BYTES") of it the base)"

healthcheck_config() {
  local hc
  hc="$("$ENGINE" image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE")"
  grep -q 'healthcheck.py' <<<"$hc" || {
    echo "the image has no HEALTHCHECK: $hc"
    return 1
  }
  echo "the image's HEALTHCHECK runs docker/healthcheck.py"
}
check "image healthcheck" healthcheck_config

# -- the image as `docker run -p 8000:8000 domino-serve` runs it -------------------------------------

CURRENT="start"
start="$(now)"
MAIN="domino-smoke-$RUN_ID"
run_container "$MAIN"
wait_healthy "healthy" "$MAIN"
COLD_S="$(since "$start")"
echo "ok    cold start: $COLD_S s from \`$ENGINE run\` to /health 200"

# The HEALTHCHECK must agree. podman runs it on demand (its timers need systemd); Docker runs it every
# interval, and a success during the start period marks the container healthy at once.
container_healthy() {
  if [ "$ENGINE" = podman ]; then
    podman healthcheck run "$MAIN" >/dev/null || {
      echo "podman healthcheck run failed"
      return 1
    }
  fi
  local status="" i
  for i in $(seq 1 90); do
    status="$("$ENGINE" inspect --format '{{.State.Health.Status}}' "$MAIN")"
    [ "$status" = healthy ] && break
    sleep 1
  done
  [ "$status" = healthy ] || {
    echo "HEALTHCHECK status: $status"
    return 1
  }
  echo "the container's HEALTHCHECK says $status"
}
check "healthcheck agrees" container_healthy

# The server is PID 1 (entrypoint.sh execs it, so it gets SIGTERM itself) and runs as the image's user.
non_root() {
  local uid cmd
  uid="$("$ENGINE" exec "$MAIN" awk '/^Uid:/ { print $2 }' /proc/1/status)"
  cmd="$("$ENGINE" exec "$MAIN" cat /proc/1/cmdline | tr '\0' ' ')"
  [ "$uid" != 0 ] && [ -n "$uid" ] || {
    echo "PID 1 runs as uid '$uid'"
    return 1
  }
  grep -q 'domino-serve' <<<"$cmd" || {
    echo "PID 1 is not domino-serve: $cmd"
    return 1
  }
  echo "PID 1 is domino-serve, uid $uid ($("$ENGINE" exec "$MAIN" id -un))"
}
check "non-root" non_root

check "completion" "${CLIENT[@]}" --url "$URL" completion
check "streamed chat" "${CLIENT[@]}" --url "$URL" chat-stream
FIRST_TOKEN="$(sed -n 's/.*first token \([0-9]*\) ms.*/\1/p' <<<"$LAST_OUT")"

# `stop` sends SIGTERM: the in-flight stream must finish whole, and the server exit 0, in time.
check "drain on stop" "${CLIENT[@]}" --url "$URL" drain --max-tokens 160 --limit "$STOP_TIMEOUT" \
  -- "$ENGINE" stop -t "$STOP_TIMEOUT" "$MAIN"
exit_code() {
  local code
  code="$("$ENGINE" inspect --format '{{.State.ExitCode}}' "$MAIN")"
  [ "$code" = 0 ] || {
    echo "the container exited with status $code"
    return 1
  }
  "$ENGINE" logs "$MAIN" 2>&1 | grep -q 'draining in-flight requests' || {
    echo "the server did not log a drain"
    return 1
  }
  echo "exited with status 0 after draining"
}
check "exit status" exit_code

# -- with DOMINO_API_KEY ------------------------------------------------------------------------------

# Given by name only, so the key is on no command line.
DOMINO_API_KEY="$("$PY" -c 'import secrets; print(secrets.token_hex(16))')"
export DOMINO_API_KEY
KEYED="domino-smoke-key-$RUN_ID"
run_container "$KEYED" -e DOMINO_API_KEY
wait_healthy "healthy (key set)" "$KEYED"
check "api key" "${CLIENT[@]}" --url "$URL" auth # the key: from DOMINO_API_KEY
CURRENT="stop (key set)"
# podman's stderr again complains about the HEALTHCHECK timers it never started: shown on failure only.
err="$("$ENGINE" stop -t "$STOP_TIMEOUT" "$KEYED" 2>&1 >/dev/null)" || {
  echo "$err" >&2
  exit 1
}

echo "ok    figures: image $(mb "$IMAGE_BYTES"), build $BUILD_S s, cold start $COLD_S s, first token $FIRST_TOKEN ms ($ENGINE $("$ENGINE" --version | awk '{ print $NF }'))"
CURRENT="cleanup"
