"""GET /v1/models and /v1/models/{id}; with them the served model's tokenizer endpoints and the
server's version (app/routes/tokenize.py)."""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import ServiceDep
from app.errors import ERROR_RESPONSES
from app.protocol import ModelCard, ModelList
from app.routes import tokenize
from app.service import Service

router = APIRouter(responses=ERROR_RESPONSES)
router.include_router(tokenize.router)


def _card(service: Service) -> ModelCard:
    return ModelCard(id=service.model_name, created=service.created, max_model_len=service.max_model_len)


@router.get("/v1/models")
async def models(service: ServiceDep) -> ModelList:
    return ModelList(data=[_card(service)])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, service: ServiceDep) -> ModelCard:
    service.check_model(model_id)
    return _card(service)
