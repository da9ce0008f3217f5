"""Streaming text out of token ids: an incremental detokenizer and a stop-string matcher.

Byte-level BPE splits multi-byte UTF-8 characters over several tokens, so decoding one token at a
time yields U+FFFD halves. `IncrementalDetokenizer` decodes a small sliding window and holds text
back while it ends in a replacement character; `StopMatcher` holds back any tail that could be the
start of a stop string, so a stop split over two chunks is still found and never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
        hold = 0
        for stop in self.stops:
            # Longest proper prefix of this stop that the buffer ends with.
            for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                if buf.endswith(stop[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Text held back as a possible stop prefix, released when generation ends without it."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
