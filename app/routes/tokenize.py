"""vLLM's small endpoints that scripts use: POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /version.

The first two do work for the client (behind the API key, bounded in size, run off the event loop
like every other tokenization)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter

from app.deps import ServiceDep
from app.errors import ERROR_RESPONSES, bad_request
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
async def tokenize(body: TokenizeRequest, service: ServiceDep) -> TokenizeResponse:
    service.check_model(body.model)
    if body.messages is not None:
        service.check_template_kwargs(body.chat_template_kwargs)
        if body.tools and not service.supports_tools:
            raise bad_request("tools: not supported for this model: its chat template does not render tools", "tools")
        ids, _ = await service.prepare(service.render_chat, body, param="messages")
    else:
        assert body.prompt is not None
        encode = service.encode_text if body.add_special_tokens else service.encode_plain
        ids = await service.prepare(encode, body.prompt, param="prompt")
    strs = None
    if body.return_token_strs:  # in a thread too: a long prompt's strings take a while to build
        strs = await service.prepare(service.tokenizer.convert_ids_to_tokens, ids, param="return_token_strs")
    return TokenizeResponse(count=len(ids), max_model_len=service.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, service: ServiceDep) -> DetokenizeResponse:
    service.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < service.vocab_size]
    if bad:
        raise bad_request(f"tokens: {bad[:5]} are outside the vocabulary (size {service.vocab_size})", "tokens")
    text = await service.prepare(service.decode, body.tokens, param="tokens")
    return DetokenizeResponse(prompt=text)


@router.get("/tokenizer_info")
async def tokenizer_info(service: ServiceDep) -> TokenizerInfoResponse:
    """What a client needs to tokenize and render like the server without a copy of the tokenizer
    (lm-eval's remote tokenizer, with /tokenize and /detokenize): its special tokens and chat template."""
    tok = service.tokenizer
    template = getattr(tok, "chat_template", None)
    return TokenizerInfoResponse(
        tokenizer_class=type(tok).__name__,
        eos_token=tok.eos_token,
        bos_token=tok.bos_token,
        pad_token=tok.pad_token,
        chat_template=template if isinstance(template, str) else None,
        model_max_length=service.max_model_len,
        vocab_size=service.vocab_size,
    )


@router.get("/version")
async def server_version() -> VersionResponse:
    # No ServiceDep: the version is known before the model is loaded.
    try:
        return VersionResponse(version=version("domino-serve"))
    except PackageNotFoundError:  # a source tree that was never installed
        return VersionResponse(version="unknown")
