"""`domino-serve`: flags mirror the DOMINO_* settings; flags win over the environment."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, get_args

import uvicorn
from pydantic import ValidationError

from app.settings import Settings

log = logging.getLogger("app.main")

# Exit status when the model worker died: the orchestrator (Docker/compose restart policy, Kubernetes)
# restarts the process, which is the only way back to a working engine.
EXIT_WORKER_DIED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="domino-serve",
        description="OpenAI-compatible server with Domino speculative decoding. Every flag can also be set "
        "as an environment variable DOMINO_<NAME> (e.g. DOMINO_PORT=8001).",
    )
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        choices = None
        args = get_args(field.annotation)
        if args and all(isinstance(a, str) for a in args):  # Literal[...]
            choices = list(args)
        default = field.default
        help_text = (field.description or "").replace("%", "%%")
        help_text = f"{help_text} (env DOMINO_{name.upper()}, default: {default})".strip()
        # Values stay strings here: Settings validates and converts them like environment values.
        parser.add_argument(flag, dest=name, default=None, choices=choices, help=help_text)
    return parser


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    try:
        # Init values beat environment values; both get the same (lax) string parsing.
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SystemExit(f"domino-serve: invalid settings: {problems}") from None


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT first mark the service as draining (health 503, new requests 503), then let
    uvicorn stop accepting connections and wait for in-flight responses up to drain_timeout."""

    def __init__(
        self, config: uvicorn.Config, on_drain: Callable[[], None], worker_failed: Callable[[], bool] = lambda: False
    ) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.worker_failed = worker_failed
        self.failed = False

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop ticks every 0.1 s: a dead worker starts the same drain as SIGTERM.
        if not self.failed and not self.should_exit and self.worker_failed():
            self.failed = True
            log.error("the model worker died: draining, then exiting with status %d to be restarted", EXIT_WORKER_DIED)
            self.on_drain()
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the signal after shutting down; a completed drain exits with status 0.
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info(
                "received %s: draining in-flight requests (up to %.0f s), admitting no new ones",
                signal.Signals(sig).name,
                self.config.timeout_graceful_shutdown or 0,
            )
            self.on_drain()
        super().handle_exit(sig, frame)


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    level = getattr(logging, settings.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # Model loading shows progress bars (download, conversion, weights).
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()

    if settings.uses_ray:
        # Imported only here: serving without replicas does not need Ray installed.
        from app.ray_serve import serve_with_ray

        sys.exit(serve_with_ray(settings))

    from app.server import create_app

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.drain_timeout,  # type: ignore[arg-type]  # float is fine
        limit_concurrency=settings.limit_concurrency,
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]  # float is fine
        lifespan="on",
        # Fixed, not "auto": installing uvloop/httptools (Ray Serve pulls them in) must not change how
        # this server parses HTTP or runs its event loop.
        loop="asyncio",
        http="h11",
    )
    server = DrainingServer(
        config,
        app.state.begin_drain,
        lambda: app.state.service is not None and app.state.service.worker.failed,
    )
    server.run()
    if not server.started:
        sys.exit(1)  # startup (model loading) failed; uvicorn logged why
    if server.failed:
        sys.exit(EXIT_WORKER_DIED)


if __name__ == "__main__":
    main()
