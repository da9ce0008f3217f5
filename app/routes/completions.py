"""POST /v1/completions (the flow: app/serving/completions.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.deps import ServingDep
from app.errors import ERROR_RESPONSES
from app.protocol import CompletionRequest

router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, serving: ServingDep) -> Response:
    return await serving.completions.create(body, request)
