"""Tools for chat templates that cannot render them (DOMINO_TOOL_PROMPT=auto, the default).

Such a template (SmolLM2's, the embedded default) never shows the model the request's tools, so no
tool call could ever come back. Here the tools are described in a system-prompt block in the
Hermes format that app/tool_parser.py reads and model/engine/grammar.py enforces: the signatures between
`<tools>` tags, one JSON object a line, and the `<tool_call>` format a call must use. Past calls
and their results in the history become text in the same format, since the template would drop
them. `POST /tokenize` with the same messages and tools shows the prompt exactly as the model sees it.
"""

from __future__ import annotations

import json
from typing import Any

from app.tool_parser import CALL_END, CALL_START

TOOL_BLOCK_INTRO = (
    "# Tools\n\nFunctions you can call are listed between <tools> and </tools>, one JSON signature a line:\n<tools>\n"
)
TOOL_BLOCK_OUTRO = (
    "</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between the tags, one call "
    f"a block:\n{CALL_START}\n"
    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
    f"{CALL_END}"
)


def tool_block(tools: list[dict[str, Any]]) -> str:
    """The system-prompt block that describes the tools (OpenAI's `tools` entries)."""
    lines = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
    return TOOL_BLOCK_INTRO + lines + TOOL_BLOCK_OUTRO


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """messages (as given to the template) with the tool block in the system prompt (the first
    system or developer message, or a new one) and calls and results written out as text."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        msg = dict(msg)
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in msg.pop("tool_calls"))
            msg["content"] = f"{msg['content']}\n{calls}" if msg.get("content") else calls
        elif msg["role"] == "tool":
            msg = {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        out.append(msg)
    block = tool_block(tools)
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]
        out[0] = {**first, "content": f"{first['content']}\n\n{block}" if first.get("content") else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
