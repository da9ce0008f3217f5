"""The Hermes/Qwen3 tool-call parser (app/tool_parser.py): calls, text around them, malformed output
returned as text, and the same result however the text is cut into stream pieces."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from app.tool_parser import ToolCallParser, parse_call

NAMES = {"get_weather", "get_time"}
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def run(text: str, cuts: list[int] | None = None, **kwargs: object) -> tuple[str, list[tuple[str, dict]]]:
    parser = ToolCallParser(NAMES, **kwargs)  # type: ignore[arg-type]
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts or []}), len(text)]
    out, calls = "", []
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece, got = parser.feed(text[a:b])
        out += piece
        calls += got
    out += parser.flush()
    return out, [(c.name, json.loads(c.arguments)) for c in calls]


def test_one_call() -> None:
    assert run(WEATHER) == ("", [("get_weather", {"city": "Paris", "unit": "°C"})])


def test_text_before_and_after_and_two_calls() -> None:
    text = f"Let me check.\n\n{WEATHER}\n{TIME}\nDone."
    assert run(text) == ("Let me check.\nDone.", [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})])


def test_broken_json_is_returned_as_text() -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    assert run(f"Hmm {broken} ok") == (f"Hmm {broken} ok", [])
    # A good call next to a broken one: the good one is parsed, the broken one kept as text.
    assert run(f"{broken}{TIME}") == (broken, [("get_time", {})])


def test_not_a_call_is_text() -> None:
    for body in [
        '"just a string"',
        '{"arguments": {}}',
        '{"name": "rm_rf", "arguments": {}}',
        '{"name": "get_time", "arguments": [1]}',
    ]:
        text = f"<tool_call>{body}</tool_call>"
        assert run(text) == (text, []), body


def test_unterminated_call_is_text() -> None:
    text = 'Sure. <tool_call>{"name": "get_time", "argu'
    assert run(text) == (text, [])


def test_string_arguments_are_accepted() -> None:
    call = parse_call('{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}', NAMES)
    assert call is not None and json.loads(call.arguments) == {"tz": "CET"} and call.id.startswith("call_")


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    assert run(f"{WEATHER}\n{TIME}", max_calls=1) == ("", [("get_weather", {"city": "Paris", "unit": "°C"})])


def test_ids_are_unique() -> None:
    parser = ToolCallParser(NAMES)
    _, calls = parser.feed(WEATHER + TIME)
    assert len({c.id for c in calls}) == 2


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from([WEATHER, TIME, "<tool_call>", "</tool_call>", "<tool", "{", "}", "\n", " ", "text", "é"]),
        max_size=10,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=15),
)
def test_any_chunking_gives_the_whole_text_result(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    assert run(text, cuts) == run(text)
    # Nothing is lost: every character is in the text or in a parsed call.
    out, calls = run(text)
    if not calls:
        assert out == text or out.strip() == text.strip()
