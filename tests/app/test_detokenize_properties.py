"""Property tests (hypothesis) for the incremental detokenizer and the stop-string matcher: arbitrary
byte-level token sequences (partial UTF-8 and invalid byte runs included), arbitrary chunking, stop
strings spanning tokens and chunks."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.detokenize import IncrementalDetokenizer, StopMatcher
from tests.fixtures.models import build_tiny_tokenizer

PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


def chunked(items: list[Any], sizes: list[int]) -> list[list[Any]]:
    """items cut into consecutive pieces of the given sizes (cycled; the last piece takes the rest)."""
    out, i, k = [], 0, 0
    while i < len(items):
        size = sizes[k % len(sizes)] if sizes else 1
        out.append(items[i : i + size])
        i, k = i + size, k + 1
    return out


def detokenize(tok: Any, pieces: list[list[int]], prompt: list[int] = ()) -> list[str]:  # type: ignore[assignment]
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.push(p) for p in pieces] + [detok.flush()]


def token_ids(tok: Any) -> st.SearchStrategy[list[int]]:
    # The whole vocabulary: single-byte tokens that split multi-byte characters, merges, specials.
    return st.lists(st.integers(0, len(tok) - 1), max_size=40)


SIZES = st.lists(st.integers(1, 6), min_size=1, max_size=5)


@PROPERTY_SETTINGS
@given(data=st.data(), sizes=SIZES)
def test_deltas_concatenate_to_the_full_decode(tok: Any, data: st.DataObject, sizes: list[int]) -> None:
    ids = data.draw(token_ids(tok))
    deltas = detokenize(tok, chunked(ids, sizes))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


@PROPERTY_SETTINGS
@given(text=st.text(max_size=30), data=st.data(), sizes=SIZES)
def test_valid_text_streams_without_replacement_characters(
    tok: Any, text: str, data: st.DataObject, sizes: list[int]
) -> None:
    """Text that was valid UTF-8 never shows a U+FFFD half of a character, however it is chunked,
    and a prompt before it does not leak into the output."""
    prompt = tok.encode(data.draw(st.text(max_size=10)))
    ids = tok.encode(text)
    deltas = detokenize(tok, chunked(ids, sizes), prompt)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas), deltas


def run_matcher(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    emitted, stopped = "", False
    for chunk in chunks:
        out, stopped = matcher.feed(chunk)
        emitted += out
        if stopped:
            break
    if not stopped:
        emitted += matcher.flush()
    return emitted, stopped


def check_stop_semantics(text: str, chunks: list[str], stops: list[str]) -> None:
    emitted, stopped = run_matcher(chunks, stops)
    live = [s for s in stops if s]
    assert text.startswith(emitted)  # nothing invented, nothing reordered
    assert not any(s in emitted for s in live)  # no stop string (or a part that completes one) leaks
    ends = [text.find(s) + len(s) for s in live if s in text]
    if not ends:
        assert not stopped and emitted == text
        return
    assert stopped
    # It stopped in the chunk where the first stop string completed, at a stop string.
    boundary, first_end = 0, min(ends)
    for chunk in chunks:
        boundary += len(chunk)
        if boundary >= first_end:
            break
    assert any(text.startswith(s, len(emitted)) and len(emitted) + len(s) <= boundary for s in live)


@PROPERTY_SETTINGS
@given(data=st.data(), sizes=SIZES)
def test_stops_are_found_across_chunks(tok: Any, data: st.DataObject, sizes: list[int]) -> None:
    text = data.draw(st.text(alphabet="abcab🙂é ", max_size=30))
    # Stops mostly taken from the text itself (so they occur, often spanning chunks), some not.
    substrings = st.builds(lambda i, n: text[i : i + n], st.integers(0, max(0, len(text) - 1)), st.integers(0, 6))
    stops = data.draw(st.lists(substrings | st.text(alphabet="abc🙂", max_size=4), max_size=4))
    chunks = ["".join(c) for c in chunked(list(text), sizes)]
    check_stop_semantics(text, chunks, stops)


@PROPERTY_SETTINGS
@given(data=st.data(), sizes=SIZES)
def test_stops_spanning_tokens_of_a_real_tokenizer(tok: Any, data: st.DataObject, sizes: list[int]) -> None:
    """Detokenizer deltas fed to the matcher, as the worker does: stop strings that span tokens and
    split multi-byte characters are found, and nothing of them is emitted."""
    ids = data.draw(token_ids(tok))
    deltas = detokenize(tok, chunked(ids, sizes))
    text = "".join(deltas)
    if not text:
        return
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 8))]
    check_stop_semantics(text, deltas, [stop])
