"""Operations: GET /health (for orchestrators) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.deps import ServiceDep
from app.service import Service

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    # No ServiceDep: an unloaded model is an answer here (503), not an error.
    return health_response(request.app.state.service)


def health_response(service: Service | None) -> JSONResponse:
    if service is None or not service.worker.healthy:
        reason = "draining" if service is not None and service.worker.draining else "unavailable"
        return JSONResponse({"status": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
