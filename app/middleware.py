"""ASGI guard: auth and body size, before anything reads the body; the replica header on every response."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, bad_request
from app.nesting import MAX_JSON_DEPTH, json_depth

REPLICA_HEADER = b"x-domino-replica"


class GuardMiddleware:
    """401 for /v1 routes (and /tokenize, /detokenize) without the right bearer token; 415 for POST
    bodies that are not JSON; 413 for bodies over the limit; 400 for bodies nested too deeply; 408 for
    a body not received within body_timeout seconds (a client trickling its body must not hold a
    connection and a request slot for ever).

    The body is read here (bounded) and replayed to the app, so the limit holds whether or not the
    client sent Content-Length, and FastAPI never sees an oversized body.

    With `replica` set, every HTTP response, the guard's own refusals included, carries
    `x-domino-replica: <replica>`, so an operator behind a load balancer sees which replica answered."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body: int,
        body_timeout: float = 30.0,
        replica: str | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.replica_header = (REPLICA_HEADER, replica.encode("latin-1", "replace")) if replica else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.replica_header is not None:
            send = self._with_replica_header(send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and _needs_key(scope.get("path", "")) and not self._authorized(headers):
            err = APIError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await err.response()(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await bad_request("invalid Content-Length header").response()(scope, receive, send)
                return
            if declared > self.max_body:
                await self._too_large(scope, receive, send)
                return
        if scope.get("method") == "POST" and not _is_json(headers.get(b"content-type", b"")):
            # Only JSON: a form or text/plain body is what a cross-site <form> (or no-CORS fetch) can
            # send, and it must never start a generation.
            err = APIError(
                415,
                "the request body must be JSON, sent with 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
            await err.response()(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.body_timeout):
                body = await self._read_body(scope, receive, send)
        except TimeoutError:
            err = APIError(
                408,
                f"the request body was not received within {self.body_timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},
            )
            await err.response()(scope, receive, send)
            return
        if body is None:
            return
        if body and json_depth(body) > MAX_JSON_DEPTH:
            # Before FastAPI parses it: a body nested ~1,000 deep would reach a RecursionError (a 500).
            err = bad_request(
                f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep",
                code="too_deeply_nested",
            )
            await err.response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _with_replica_header(self, send: Send) -> Send:
        header = self.replica_header

        async def send_naming_replica(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        return send_naming_replica

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self.api_key is not None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest: the time taken does not reveal how much of the key matched.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when the client left or the body is too large (answered here)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await self._too_large(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(
            413,
            f"request body is larger than {self.max_body} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await err.response()(scope, receive, send)


# Routes that do work for a client sit behind the API key; /health, /metrics and /version do not.
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def _needs_key(path: str) -> bool:
    return path.startswith("/v1") or path.rstrip("/") in KEYED_PATHS


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or (
        media_type.startswith(b"application/") and media_type.endswith(b"+json")
    )
