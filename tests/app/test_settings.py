"""Settings names that mean one thing: DOMINO_MAX_DRAFTS caps the drafts verified per step (the
drafter's own block size is DrafterConfig.block_size); DOMINO_BLOCK_SIZE, its old name, still works."""

from __future__ import annotations

import pytest

from app.main import build_parser
from app.settings import Settings


def test_max_drafts_and_its_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DOMINO_MAX_DRAFTS", raising=False)
    monkeypatch.delenv("DOMINO_BLOCK_SIZE", raising=False)
    assert Settings().max_drafts is None
    monkeypatch.setenv("DOMINO_BLOCK_SIZE", "3")
    assert Settings().max_drafts == 3
    monkeypatch.setenv("DOMINO_MAX_DRAFTS", "5")  # the new name wins
    assert Settings().max_drafts == 5
    assert Settings(max_drafts=2).max_drafts == 2  # and a flag wins over both
    flags = build_parser().format_help()
    assert "--max-drafts" in flags and "--block-size" not in flags
