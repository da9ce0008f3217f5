"""FastAPI dependencies: routes declare `service: ServiceDep` instead of looking it up."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.errors import APIError
from app.service import Service


def get_service(request: Request) -> Service:
    """The app's service; 503 while the model is not loaded (startup, shutdown)."""
    service: Service | None = getattr(request.app.state, "service", None)
    if service is None:
        raise APIError(503, "the model is not loaded", "server_error", code="service_unavailable")
    return service


ServiceDep = Annotated[Service, Depends(get_service)]
