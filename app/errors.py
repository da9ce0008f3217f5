"""Errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) and the handlers that
turn FastAPI's own exceptions (validation, 404/405, crashes) into it."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.events import SeqEvent
from app.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Documented in /openapi.json for the /v1 routes: every error has OpenAI's shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request"),
        (401, "missing or invalid API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (415, "request body not sent as application/json"),
        (429, "the server is at capacity; retry after Retry-After seconds"),
        (500, "internal error; the message names a request id"),
        (503, "model not loaded or server draining"),
    )
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def server_error(what: str, detail: str, code: str | None = None, exc_info: bool = False) -> APIError:
    """A 500 that names a request id and nothing else: the detail (exception text, internals) goes to
    the log under that id, never to the client."""
    request_id = uuid.uuid4().hex
    log.error("%s [request id %s]: %s", what, request_id, detail, exc_info=exc_info)
    return APIError(
        500,
        f"{what}; the server logged the details under request id {request_id}",
        "server_error",
        code=code,
        headers={"X-Request-Id": request_id},
    )


def generation_error(event: SeqEvent) -> APIError:
    """The error a failed choice turns into (the whole response fails with it)."""
    if event.unavailable:
        return APIError(503, event.error or "the server is shutting down", "server_error", code="service_unavailable")
    if event.client_error:  # the output could not follow the request's grammar: say why, not a bare 500
        return APIError(
            500, event.error or "the output could not follow the grammar", "server_error", code="grammar_error"
        )
    return server_error("generation failed", event.error or "unknown error", code="generation_failed")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not any(c in part for c in "[]-") and part not in ("str", "int", "float"):
            out += f".{part}" if out else part
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    # An unknown field is reported before the errors a union's other branches raise about it.
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    if first.get("type") == "json_invalid":
        return bad_request(
            f"request body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})", code="invalid_json"
        )
    param = _param_from_loc(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "field required"
    if first.get("type") == "extra_forbidden":  # OpenAI's own answer to a field it does not know
        msg = "unrecognized request argument (not part of the API this server implements)"
    if param is None:
        msg = "request body must be a JSON object"
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers invalid fields with 400, never FastAPI's 422.
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 400 and code is None:  # FastAPI could not decode the body at all
            detail, code = "request body could not be parsed as JSON (it must be UTF-8 encoded JSON)", "invalid_json"
        return APIError(exc.status_code, detail, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        return server_error("internal server error", f"{type(exc).__name__}: {exc}", exc_info=True).response()
