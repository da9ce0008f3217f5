"""Incremental detokenization and stop strings, token by token on a real byte-level BPE."""

from __future__ import annotations

import random
from typing import Any

import pytest

from app.detokenize import REPLACEMENT, IncrementalDetokenizer, StopMatcher, TokenTexts
from tests.fixtures.models import build_tiny_tokenizer

MULTIBYTE = "Hi 🙂🚀 日本語 naïve café — “x” 👍🏽 한국어 ∑≈∞ ok"


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


def stream(tok: Any, ids: list[int], prompt: list[int] = (), chunk: int = 1) -> list[str]:  # type: ignore[assignment]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_split_over_tokens_are_never_broken(tok: Any) -> None:
    ids = tok.encode(MULTIBYTE)
    # The tokenizer really splits some characters into byte tokens.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    for chunk in (1, 2, 3, 5):
        deltas = stream(tok, ids, chunk=chunk)
        assert "".join(deltas) == MULTIBYTE
        assert not any(REPLACEMENT in d for d in deltas), deltas


def test_prompt_context_does_not_leak_into_output(tok: Any) -> None:
    prompt = tok.encode("日本語 prompt 🙂")
    ids = tok.encode(" and 🚀 more")
    assert "".join(stream(tok, ids, prompt)) == " and 🚀 more"


def test_genuinely_invalid_bytes_are_released_at_the_end(tok: Any) -> None:
    ids = tok.encode("ok🦄")[:-1]  # an emoji unseen in training is split into bytes; cut its last byte
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith(REPLACEMENT)


def test_special_tokens_are_skipped(tok: Any) -> None:
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("ab") + [im_start] + tok.encode("cd")
    assert "".join(stream(tok, ids)) == "abcd"


def feed_all(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out, hit = [], False
    for piece in pieces:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit


@pytest.mark.parametrize(
    ("stops", "pieces", "expected", "hit"),
    [
        (["STOP"], ["abc", "ST", "OP", "def"], "abc", True),
        (["STOP"], ["abcS", "T", "O", "Pxyz"], "abc", True),
        (["STOP"], ["abcST", "x"], "abcSTx", False),  # a false start is released
        (["STOP"], ["abcST"], "abcST", False),  # released at the end
        (["\n\n", "END"], ["a\n", "b\n", "\nc"], "a\nb", True),
        (["xyz", "yz"], ["axyz"], "a", True),  # the earliest stop wins
        (["日本"], ["テ日", "本語"], "テ", True),
        ([""], ["abc"], "abc", False),  # empty stops are ignored
    ],
)
def test_stop_strings_across_chunks(stops: list[str], pieces: list[str], expected: str, hit: bool) -> None:
    assert feed_all(stops, pieces) == (expected, hit)


def test_stop_matcher_never_emits_any_part_of_a_stop() -> None:
    rng = random.Random(0)
    alphabet = "abST"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got, hit = feed_all(["STS", "bb"], pieces)
        first = min((i for i in (text.find("STS"), text.find("bb")) if i >= 0), default=-1)
        assert (got, hit) == ((text[:first], True) if first >= 0 else (text, False)), (text, pieces)


def test_token_texts_give_exact_bytes(tok: Any) -> None:
    texts = TokenTexts(tok)
    ids = tok.encode("🙂a")
    parts = [texts(i) for i in ids]
    assert b"".join(bytes(p.bytes) for p in parts) == "🙂a".encode()
    assert any(p.text.startswith("bytes:\\x") for p in parts)  # a partial character is shown as bytes
    assert parts[-1].text == "a"
    assert texts(tok.convert_tokens_to_ids("<|im_end|>")).text == "<|im_end|>"
