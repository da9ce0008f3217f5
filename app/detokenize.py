"""Streaming text out of token ids: an incremental detokenizer, a stop-string matcher, token texts
for logprobs, and the per-choice `OutputProcessor` the worker runs them in.

Byte-level BPE splits multi-byte UTF-8 characters over several tokens, so decoding one token at a
time yields U+FFFD halves. `IncrementalDetokenizer` decodes a small sliding window and holds text
back while it ends in a replacement character; `StopMatcher` holds back any tail that could be the
start of a stop string, so a stop split over two chunks is still found and never emitted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from app.events import LogprobEntry, SequenceSpec, TokenText
from app.partial import partial_tag_length

if TYPE_CHECKING:
    from model.engine.requests import RequestOutput

REPLACEMENT = "\ufffd"
# Tokens of prompt context decoded with the window so tokenizers whose decoding depends on the
# previous token (SentencePiece leading spaces) render the first generated token correctly.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never contain broken characters."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        # ids[prefix:read] were already emitted; ids[read:] are pending.
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became final."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        # A trailing U+FFFD is usually an incomplete UTF-8 sequence that the next token completes.
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        # Slide the window so decoding cost stays constant per token.
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back at the end of generation (a genuinely invalid byte run stays U+FFFD)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


class StopMatcher:
    """Finds stop strings in streamed text; the returned text never contains a stop string or any
    part of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found). After a stop, nothing more
        is emitted."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return buf[: min(hits)], True
        hold = partial_tag_length(buf, self.stops)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Text held back as a possible stop prefix, released when generation ends without it."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class TokenTexts:
    """Token id -> display text and exact bytes, cached. Byte-level BPE vocabularies store bytes as
    printable stand-in characters; mapping them back gives the token's real bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_map = _byte_level_map() if _is_byte_level(tokenizer) else None
        self.cache: dict[int, TokenText] = {}

    def __call__(self, token_id: int) -> TokenText:
        hit = self.cache.get(token_id)
        if hit is None:
            hit = self.cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> TokenText:
        raw: bytes | None = None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self.byte_map is not None and isinstance(piece, str) and all(c in self.byte_map for c in piece):
            raw = bytes(self.byte_map[c] for c in piece)
        if raw is None:
            raw = self.tokenizer.decode([token_id]).encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return TokenText(text, list(raw))


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


def _byte_level_map() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-character table: printable bytes stand for themselves, the
    others are shifted to code points from 256 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class OutputProcessor:
    """Per-choice post-processing on the worker thread: tokens -> text deltas, stop strings."""

    def __init__(self, spec: SequenceSpec, tokenizer: Any, token_texts: TokenTexts) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, spec.prompt_ids, spec.skip_special_tokens)
        self.stops = StopMatcher(spec.stop)
        self.token_texts = token_texts

    def process(self, out: RequestOutput) -> tuple[str, list[LogprobEntry] | None, bool]:
        """Returns (text delta, logprobs of the rendered tokens, whether a stop string ended it)."""
        ids = list(out.new_token_ids)
        lps = out.logprobs
        # The stop/EOS token is generated (and counted) but never rendered.
        if out.finish_reason == "stop" and out.stop_token_id is not None and ids and ids[-1] == out.stop_token_id:
            ids.pop()
        text = self.detok.push(ids)
        if out.finished:
            text += self.detok.flush()
        text, hit = self.stops.feed(text)
        if out.finished and not hit:
            text += self.stops.flush()
        entries = None
        if lps is not None:
            tt = self.token_texts
            entries = [
                LogprobEntry(tt(lp.token_id), lp.logprob, [(tt(t), v) for t, v in lp.top]) for lp in lps[: len(ids)]
            ]
        return text, entries, hit

    def prompt_entries(self, prompt_ids: Sequence[int], out: RequestOutput) -> list[LogprobEntry] | None:
        """The prompt's logprobs (SamplingParams.prompt_logprobs), its first token's being None."""
        if out.prompt_logprobs is None or not prompt_ids:
            return None
        tt = self.token_texts
        first = LogprobEntry(tt(prompt_ids[0]), None, [])
        return [first] + [
            LogprobEntry(tt(lp.token_id), lp.logprob, [(tt(t), v) for t, v in lp.top]) for lp in out.prompt_logprobs
        ]
