"""A chat choice's generated text split into reasoning, answer and tool calls, as it streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.reasoning import ReasoningParser
from app.tool_parser import ParsedToolCall, ToolCallParser


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ChatOutputParser:
    """Reasoning first (a think block), then tool calls within the answer; either may be off."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        """Add one event's text; `final` on the choice's last event releases what was held back."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if final and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[ParsedToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                content += self.tools.flush()
        return ChatDelta(reasoning, content, calls)
