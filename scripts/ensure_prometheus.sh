#!/usr/bin/env bash
# The metrics tests scrape the service with a real Prometheus (Debian's package).
# Installing the package may start its system service; this script stops only what the install
# started (the service if it was not running before, and prometheus processes that appeared during
# the install), never a Prometheus the user already runs.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

service_was_active=false
if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
  service_was_active=true
fi
before=" $(pgrep -x prometheus | tr '\n' ' ' || true) "

$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null

if ! $service_was_active; then
  ($SUDO systemctl stop prometheus || $SUDO service prometheus stop || true) >/dev/null 2>&1
fi
for pid in $(pgrep -x prometheus || true); do
  case "$before" in
    *" $pid "*) ;;  # running before the install: not ours
    *) $SUDO kill "$pid" 2>/dev/null || true ;;
  esac
done
command -v prometheus && prometheus --version | head -1
