"""POST /v1/chat/completions (the flow: app/serving/chat.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.deps import ServingDep
from app.errors import ERROR_RESPONSES
from app.protocol import ChatCompletionRequest

router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: ServingDep) -> Response:
    return await serving.chat.create(body, request)
