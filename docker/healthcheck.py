"""Docker HEALTHCHECK: exit 0 when the server's /health answers 200 (standard library only: the base
image has no curl). /health fails while the model loads and while draining after SIGTERM."""

from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    host = os.environ.get("DOMINO_HOST", "127.0.0.1")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"  # listening on all interfaces includes loopback
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    url = f"http://{host}:{os.environ.get('DOMINO_PORT', '8000')}/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy
    try:
        with opener.open(url, timeout=5) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:  # refused, timed out, or an HTTP error status (503 while loading or draining)
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
