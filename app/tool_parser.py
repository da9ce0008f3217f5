"""Tool calls in Qwen3/Hermes format, parsed from streamed text.

The model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The parser
takes the answer text in arbitrary pieces and returns, per piece, the plain text that became final
and the calls completed in it. A call whose body is not a JSON object with a declared function's
`name` (and object `arguments`), or one left open when generation ends, is returned as text,
verbatim: the model's output is never lost and never a 500. Whitespace before a call, and after the
last one, is formatting and dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from app.partial import partial_tag_length

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=new_call_id)


def parse_call(body: str, names: Collection[str] | None = None) -> ParsedToolCall | None:
    """The call in one `<tool_call>` body, or None when it is not a well-formed call."""
    try:
        obj: Any = json.loads(body)
    except (ValueError, RecursionError):  # the model's own text: never a 500
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None  # a function the request did not declare: no client could run it
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Streams answer text in, (text, calls) out. `max_calls`: calls returned at most (with
    `parallel_tool_calls: false`, 1); the output after the last one allowed is dropped."""

    def __init__(self, names: Collection[str] | None = None, max_calls: int | None = None) -> None:
        self.names = names
        self.max_calls = max_calls
        self.calls = 0
        self.inside = False
        self.pending = ""  # outside: trailing whitespace or a cut <tool_call>; inside: the call so far
        self.space_before = ""  # dropped before the open call; restored if it turns out malformed

    @property
    def done(self) -> bool:
        return self.max_calls is not None and self.calls >= self.max_calls

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        buf, out, calls = self.pending + text, "", []
        self.pending = ""
        while buf and not self.done:
            if self.inside:
                end = buf.find(CALL_END)
                if end < 0:
                    self.pending = buf
                    break
                body, buf = buf[:end], buf[end + len(CALL_END) :]
                self.inside = False
                call = parse_call(body, self.names)
                if call is None:  # malformed: the model's text goes out as it was
                    out += self.space_before + CALL_START + body + CALL_END
                else:
                    calls.append(call)
                    self.calls += 1
                continue
            start = buf.find(CALL_START)
            if start >= 0:
                before = buf[:start].rstrip()  # the whitespace before a call is formatting
                out += before
                self.space_before = buf[len(before) : start]
                buf = buf[start + len(CALL_START) :]
                self.inside = True
                continue
            keep = len(buf) - partial_tag_length(buf, (CALL_START,))
            final = buf[:keep].rstrip()
            out += final
            self.pending = buf[len(final) :]
            break
        return out, calls

    def flush(self) -> str:
        """Text held back when generation ends: an unfinished call is text."""
        pending, self.pending = self.pending, ""
        if self.done:
            return ""
        if self.inside:
            return self.space_before + CALL_START + pending
        return pending if pending.strip() or not self.calls else ""  # not the whitespace after the last call
