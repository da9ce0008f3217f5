"""Separating a reasoning model's thinking from its answer, on streamed text.

Qwen3 (and DeepSeek-R1-style models) write `<think>…</think>` before the answer. The parser takes the
generated text in arbitrary pieces (a tag may be cut anywhere, or several may arrive in one piece)
and returns, per piece, the reasoning text and the answer text that became final. Whitespace next to
the tags is dropped, as Qwen3's template does when it renders a past answer (`reasoning.strip()`,
`content.lstrip()`); text without a think block is returned untouched as content.

Modes (`DOMINO_REASONING_PARSER`): `qwen3` starts in the answer unless the rendered prompt left a think
block open (then in the reasoning); a leading `<think>` opens one. `deepseek_r1` always starts in the
reasoning (R1's template opens the block in the prompt). `auto` is `qwen3` when the served chat
template mentions `<think>`, else off; `none` is off.
"""

from __future__ import annotations

from typing import Literal

from app.partial import partial_tag_length

THINK_START, THINK_END = "<think>", "</think>"
ReasoningMode = Literal["qwen3", "deepseek_r1"]
ParserSetting = Literal["auto", "qwen3", "deepseek_r1", "none"]


def reasoning_mode(setting: str, chat_template: object) -> ReasoningMode | None:
    """The parser a deployment uses: from the setting, `auto` deciding by the served template."""
    if setting == "none":
        return None
    if setting == "auto":
        return "qwen3" if isinstance(chat_template, str) and THINK_START in chat_template else None
    if setting in ("qwen3", "deepseek_r1"):
        return setting  # type: ignore[return-value]
    raise ValueError(f"unknown reasoning parser {setting!r}")


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a think block (templates that open it for the model)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    """Streams text in, (reasoning, content) deltas out. Only one think block counts: at the start of
    the output (or opened by the prompt); a later `<think>` is part of the answer."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.in_reasoning_by_default = in_reasoning
        # start: only whitespace so far (a <think> may still open the block); lead_r / lead_c: at the
        # start of the reasoning / the answer (whitespace dropped); reasoning; content.
        self.state = "start"
        self.pending = ""  # text held back: whitespace or a prefix of a tag

    def feed(self, text: str) -> tuple[str, str]:
        """Add generated text; return (reasoning, content) that became final (reasoning comes first)."""
        buf, reasoning, content = self.pending + text, "", ""
        self.pending = ""
        while buf:
            if self.state == "start":
                rest = buf.lstrip()
                if rest.startswith(THINK_START):
                    self.state, buf = "lead_r", rest[len(THINK_START) :]
                elif not rest or THINK_START.startswith(rest):
                    self.pending = buf  # undecided: whitespace or a cut <think>
                    return reasoning, content
                elif self.in_reasoning_by_default:
                    self.state, buf = "lead_r", rest
                else:
                    self.state = "content"  # no think block: the text is kept as it is
            elif self.state in ("lead_r", "lead_c"):
                buf = buf.lstrip()
                if buf:
                    self.state = "reasoning" if self.state == "lead_r" else "content"
            elif self.state == "reasoning":
                end = buf.find(THINK_END)
                if end >= 0:
                    reasoning += buf[:end].rstrip()
                    self.state, buf = "lead_c", buf[end + len(THINK_END) :]
                    continue
                # Hold a cut </think> and the whitespace before it (dropped if the tag follows).
                keep = len(buf) - partial_tag_length(buf, (THINK_END,))
                final = buf[:keep].rstrip()
                reasoning += final
                self.pending = buf[len(final) :]
                return reasoning, content
            else:
                content += buf
                buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The text held back when generation ends (a cut tag was just text)."""
        pending, self.pending = self.pending, ""
        if self.state == "start" and not self.in_reasoning_by_default:
            return "", pending
        return pending.strip() if self.state == "start" else pending.rstrip(), ""

    @property
    def in_reasoning(self) -> bool:
        return self.state in ("lead_r", "reasoning")


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """The whole text at once: (reasoning, content)."""
    parser = ReasoningParser(in_reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.flush()
    return r1 + r2, c1 + c2
