"""The serving layer: one module per endpoint, each owning its whole flow (validation, rendering,
grammar, submission, the stream and the JSON body), over the shared `Service` (the engine client).
Routes (app/routes/) only hand requests here."""

from __future__ import annotations

from dataclasses import dataclass

from app.service import Service
from app.serving.chat import ChatServing
from app.serving.completions import CompletionServing
from app.serving.render import ChatRenderer
from app.serving.tokenize import TokenizeServing


@dataclass
class Serving:
    service: Service
    chat: ChatServing
    completions: CompletionServing
    tokenize: TokenizeServing

    @classmethod
    def build(cls, service: Service) -> Serving:
        settings = service.settings
        # The rendered prompt may exceed the body only by the template's own text.
        renderer = ChatRenderer(service.tokenizer, settings.tool_prompt, 4 * settings.max_request_bytes)
        return cls(
            service, ChatServing(service, renderer), CompletionServing(service), TokenizeServing(service, renderer)
        )
