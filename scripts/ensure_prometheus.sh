#!/usr/bin/env bash
# The metrics tests scrape the service with a real Prometheus (Debian's package).
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package may start a system service on install; the tests run their own instance.
($SUDO systemctl stop prometheus 2>/dev/null || $SUDO service prometheus stop 2>/dev/null || pkill -x prometheus || true) >/dev/null 2>&1
command -v prometheus && prometheus --version | head -1
