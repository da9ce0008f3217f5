"""vLLM's small endpoints that scripts use: POST /tokenize, POST /detokenize, GET /tokenizer_info
(the flows: app/serving/tokenize.py), GET /version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter

from app.deps import ServingDep
from app.errors import ERROR_RESPONSES
from app.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)

router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> TokenizeResponse:
    return await serving.tokenize.tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> DetokenizeResponse:
    return await serving.tokenize.detokenize(body)


@router.get("/tokenizer_info")
async def tokenizer_info(serving: ServingDep) -> TokenizerInfoResponse:
    return serving.tokenize.info()


@router.get("/version")
async def server_version() -> VersionResponse:
    # No ServingDep: the version is known before the model is loaded.
    try:
        return VersionResponse(version=version("domino-serve"))
    except PackageNotFoundError:  # a source tree that was never installed
        return VersionResponse(version="unknown")
