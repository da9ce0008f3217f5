"""The SSE event encoder: one event is one line for any line reader a client may use."""

from __future__ import annotations

import json

from app.serving.responses import sse


def test_sse_event_is_one_line_for_splitlines_readers() -> None:
    # NEL and the Unicode line/paragraph separators are legal raw inside JSON strings, but
    # str.splitlines (httpx's aiter_lines) breaks lines there: a sampled token holding one cut an
    # event in half under the soak test.
    text = "a\x85b\u2028c\u2029d\ne\x0bf\r\x1cg"
    event = sse({"choices": [{"text": text}]})
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text
    assert "é" in sse({"text": "é"})  # other non-ASCII stays readable
