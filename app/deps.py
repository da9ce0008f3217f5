"""FastAPI dependencies: routes declare `service: ServiceDep` or `serving: ServingDep` instead of
looking them up."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.errors import APIError
from app.service import Service
from app.serving import Serving


def _not_loaded() -> APIError:
    return APIError(503, "the model is not loaded", "server_error", code="service_unavailable")


def get_service(request: Request) -> Service:
    """The app's service; 503 while the model is not loaded (startup, shutdown)."""
    service: Service | None = getattr(request.app.state, "service", None)
    if service is None:
        raise _not_loaded()
    return service


def get_serving(request: Request) -> Serving:
    """The app's serving layer (one object per endpoint); 503 while the model is not loaded."""
    serving: Serving | None = getattr(request.app.state, "serving", None)
    if serving is None:
        raise _not_loaded()
    return serving


ServiceDep = Annotated[Service, Depends(get_service)]
ServingDep = Annotated[Serving, Depends(get_serving)]
