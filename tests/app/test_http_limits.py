"""uvicorn's connection and keep-alive limits and the request-body read timeout, on a real server
(raw sockets where a well-behaved client cannot misbehave on purpose)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
import pytest

from app.settings import Settings
from tests.fixtures.servers import ServerProcess
from tests.fixtures.waiting import wait_for


@pytest.fixture(scope="module")
def limited(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return server_factory(body_read_timeout=1, keep_alive_timeout=1, limit_concurrency=3)


def connect(srv: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOMINO_LIMIT_CONCURRENCY", "7")
    monkeypatch.setenv("DOMINO_KEEP_ALIVE_TIMEOUT", "2.5")
    monkeypatch.setenv("DOMINO_BODY_READ_TIMEOUT", "4")
    s = Settings()
    assert (s.limit_concurrency, s.keep_alive_timeout, s.body_read_timeout) == (7, 2.5, 4.0)


def test_a_body_sent_too_slowly_gets_408(limited: ServerProcess) -> None:
    with connect(limited) as sock:
        body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body[:5])  # and then nothing: before the fix the server waited for ever
        t0 = time.monotonic()
        reply = read_all(sock)  # the server answers and closes
        assert time.monotonic() - t0 < 5
    status, _, rest = reply.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), reply[:200]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and set(error) == {"message", "type", "param", "code"}


def test_idle_keep_alive_connections_are_closed(limited: ServerProcess) -> None:
    with connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        # The body may arrive in a later segment than the headers: read the whole response first.
        head, _, body = first.partition(b"\r\n\r\n")
        length = int(next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")).split(b":")[1])
        while len(body) < length:
            body += sock.recv(65536)
        t0 = time.monotonic()
        assert read_all(sock) == b""  # closed by the server after keep_alive_timeout (default: 5 s)
        assert time.monotonic() - t0 < 3


def health(srv: ServerProcess) -> int:
    return httpx.get(srv.url + "/health", timeout=10).status_code


def test_connections_beyond_the_limit_get_503(limited: ServerProcess) -> None:
    held = [connect(limited) for _ in range(3)]  # open connections count against limit_concurrency
    try:
        # They count once the server has accepted them: until then a new request still gets 200.
        wait_for(lambda: health(limited), until=lambda status: status == 503, timeout=10, what="503 at the limit")
    finally:
        for sock in held:
            sock.close()
    # And stop counting once the server has seen them close.
    wait_for(lambda: health(limited), until=lambda status: status == 200, timeout=10, what="200 below the limit")
