"""Text held back while streaming: the longest tail that could still become a tag (a stop string,
`<think>`, `<tool_call>`), since tokens may cut a tag anywhere."""

from __future__ import annotations

from collections.abc import Iterable


def partial_tag_length(text: str, tags: Iterable[str]) -> int:
    """Length of the longest proper prefix of any of `tags` that `text` ends with (0: none)."""
    held = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), held, -1):
            if text.endswith(tag[:k]):
                held = k
                break
    return held
