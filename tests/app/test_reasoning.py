"""The reasoning parser (app/reasoning.py): the split is the same however the text is cut into
stream pieces (tags cut anywhere, several in one piece), and matches a plain reading of the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.reasoning import ReasoningParser, prompt_opens_reasoning, reasoning_mode, split_reasoning


def reference(text: str, in_reasoning: bool) -> tuple[str, str]:
    """The split, read off the whole text: one think block at the start (or opened by the prompt)."""
    rest = text.lstrip()
    if rest.startswith("<think>"):
        body = rest[len("<think>") :]
    elif in_reasoning:
        body = rest
    else:
        return "", text
    reasoning, tag, content = body.partition("</think>")
    return reasoning.strip(), content.lstrip() if tag else ""


def streamed(text: str, cuts: list[int], in_reasoning: bool) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ReasoningParser(in_reasoning)
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    deltas.append(parser.flush())
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


PIECES = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", ">", "\n", "\n\n", " ", "a", "b c", "é🙂", "<t>"]


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
    in_reasoning=st.booleans(),
)
def test_any_chunking_gives_the_reference_split(parts: list[str], cuts: list[int], in_reasoning: bool) -> None:
    text = "".join(parts)
    reasoning, content, deltas = streamed(text, cuts, in_reasoning)
    assert (reasoning, content) == reference(text, in_reasoning)
    assert (reasoning, content) == split_reasoning(text, in_reasoning)
    # Reasoning is never sent after the answer has begun.
    seen_content = False
    for r, c in deltas:
        assert not (seen_content and r)
        seen_content = seen_content or bool(c)


@pytest.mark.parametrize(
    ("text", "in_reasoning", "want"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.", "Paris.")),
        ("\n<think>x</think>y", False, ("x", "y")),
        ("Paris.", False, ("", "Paris.")),
        ("Paris. <think>later</think>", False, ("", "Paris. <think>later</think>")),  # only a leading block
        ("<think>cut off at max_tokens", False, ("cut off at max_tokens", "")),
        ("<think>\n\n</think>\n\nok", False, ("", "ok")),
        ("still thinking\n</think>\n\nanswer", True, ("still thinking", "answer")),
        ("no end tag", True, ("no end tag", "")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),
        ("  <thin", False, ("", "  <thin")),
    ],
)
def test_examples(text: str, in_reasoning: bool, want: tuple[str, str]) -> None:
    assert split_reasoning(text, in_reasoning) == want
    # Token by token (one character at a time) as well.
    assert streamed(text, list(range(len(text))), in_reasoning)[:2] == want


def test_tag_cut_across_pieces_is_never_leaked() -> None:
    parser = ReasoningParser()
    got = [parser.feed(p) for p in ["<th", "ink>\nstep 1", "\n</th", "ink", ">\n\nAns", "wer"]]
    assert got == [("", ""), ("step 1", ""), ("", ""), ("", ""), ("", "Ans"), ("", "wer")]
    assert parser.flush() == ("", "")


def test_mode_and_prompt_detection() -> None:
    qwen3_like = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert reasoning_mode("auto", qwen3_like) == "qwen3"
    assert reasoning_mode("auto", "{{ messages }}") is None
    assert reasoning_mode("auto", None) is None
    assert reasoning_mode("none", qwen3_like) is None
    assert reasoning_mode("deepseek_r1", None) == "deepseek_r1"
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
