"""Root of the test suite: the shared fixtures live in small modules under tests/fixtures/.

- `tests.fixtures.models`: tiny offline tokenizer/target/drafter, the embedded default target.
- `tests.fixtures.servers`: `python -m app.main` on a loopback port (`server`, `server_factory`).
- `tests.fixtures.prometheus`: a real Prometheus on a loopback port (`prometheus_factory`).
- `tests.fixtures.waiting`: `wait_for()`, polling a condition with a deadline (a helper, not a fixture).

The layout mirrors the code: tests/app, tests/model, tests/train, tests/bench; cross-cutting checks
(container, packaging, scripts) stay here at the top.
"""

import os

# Torch's default thread pool oversubscribes a small shared CPU (10x slower steps here); tests and
# their servers run single-threaded. Set before the fixture modules (and torch) are imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.servers",
    "tests.fixtures.prometheus",
]
