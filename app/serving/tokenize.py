"""vLLM's small tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info. They do
work for the client: behind the API key (app/middleware.py), bounded in size (app/protocol.py), and
run off the event loop like every other tokenization."""

from __future__ import annotations

from app.errors import bad_request
from app.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from app.service import Service
from app.serving.render import ChatRenderer


class TokenizeServing:
    def __init__(self, service: Service, renderer: ChatRenderer) -> None:
        self.service = service
        self.renderer = renderer

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        service = self.service
        service.check_model(body.model)
        if body.messages is not None:  # rendered as /v1/chat/completions renders them
            self.renderer.check(body)
            ids, _ = await service.prepare(self.renderer.render, body, param="messages")
        else:
            assert body.prompt is not None
            encode = service.encode_text if body.add_special_tokens else service.encode_plain
            ids = await service.prepare(encode, body.prompt, param="prompt")
        strs = None
        if body.return_token_strs:  # in a thread too: a long prompt's strings take a while to build
            strs = await service.prepare(service.tokenizer.convert_ids_to_tokens, ids, param="return_token_strs")
        return TokenizeResponse(count=len(ids), max_model_len=service.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        service = self.service
        service.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < service.vocab_size]
        if bad:
            raise bad_request(f"tokens: {bad[:5]} are outside the vocabulary (size {service.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await service.prepare(service.decode, body.tokens, param="tokens"))

    def info(self) -> TokenizerInfoResponse:
        """What a client needs to tokenize and render like the server without a copy of the tokenizer
        (lm-eval's remote tokenizer, with /tokenize and /detokenize): its special tokens and template."""
        tok = self.service.tokenizer
        return TokenizerInfoResponse(
            tokenizer_class=type(tok).__name__,
            eos_token=tok.eos_token,
            bos_token=tok.bos_token,
            pad_token=tok.pad_token,
            chat_template=self.renderer.template,
            model_max_length=self.service.max_model_len,
            vocab_size=self.service.vocab_size,
        )
