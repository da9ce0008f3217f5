"""Settings names that mean one thing: DOMINO_MAX_DRAFTS caps the drafts verified per step (the
drafter's own block size is DrafterConfig.block_size), DOMINO_KV_BLOCK_SIZE is the KV cache's block;
DOMINO_BLOCK_SIZE, once the drafts cap, is refused with a message that names both, as are the slot
layout's retired DOMINO_KV_LAYOUT=slots and DOMINO_PREFIX_BLOCK_SIZE. Bad KV settings fail at
start-up naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from app.main import build_parser
from app.server import engine_config
from app.settings import Settings


def test_max_drafts_and_the_retired_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DOMINO_MAX_DRAFTS", raising=False)
    monkeypatch.delenv("DOMINO_BLOCK_SIZE", raising=False)
    assert Settings().max_drafts is None
    monkeypatch.setenv("DOMINO_MAX_DRAFTS", "5")
    assert Settings().max_drafts == 5
    assert Settings(max_drafts=2).max_drafts == 2  # a flag wins
    monkeypatch.setenv("DOMINO_BLOCK_SIZE", "3")
    with pytest.raises(ValidationError, match="DOMINO_BLOCK_SIZE was retired: set DOMINO_MAX_DRAFTS"):
        Settings()
    flags = build_parser().format_help()
    assert "--max-drafts" in flags and "--kv-block-size" in flags and "--kv-cache-memory" in flags


def test_kv_settings_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOMINO_KV_CACHE_MEMORY", "64MiB")
    monkeypatch.setenv("DOMINO_KV_BLOCK_SIZE", "32")
    monkeypatch.setenv("DOMINO_KV_LAYOUT", "paged")  # what storage always is now: accepted
    cfg = engine_config(Settings())
    assert cfg.kv_cache_memory == 64 * 2**20 and cfg.kv_block_size == 32
    monkeypatch.setenv("DOMINO_KV_CACHE_MEMORY", "0.5")
    assert engine_config(Settings()).kv_cache_memory == 0.5
    monkeypatch.delenv("DOMINO_KV_CACHE_MEMORY")
    assert engine_config(Settings()).kv_cache_memory is None


def test_chunked_prefill_setting_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_config(Settings()).max_num_batched_tokens == "auto"  # chosen at start-up unless set
    monkeypatch.setenv("DOMINO_MAX_NUM_BATCHED_TOKENS", "256")
    assert engine_config(Settings()).max_num_batched_tokens == 256
    monkeypatch.setenv("DOMINO_MAX_NUM_BATCHED_TOKENS", "0")
    assert engine_config(Settings()).max_num_batched_tokens is None  # off: whole prompts
    monkeypatch.setenv("DOMINO_MAX_NUM_BATCHED_TOKENS", "-1")
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        Settings()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DOMINO_KV_BLOCK_SIZE": "12"}, "DOMINO_KV_BLOCK_SIZE must be a power of two"),
        ({"DOMINO_KV_CACHE_MEMORY": "lots"}, "DOMINO_KV_CACHE_MEMORY"),
        ({"DOMINO_KV_CACHE_MEMORY": "1.5"}, "DOMINO_KV_CACHE_MEMORY"),
        ({"DOMINO_BLOCK_SIZE": "4"}, "DOMINO_MAX_DRAFTS"),
        ({"DOMINO_KV_LAYOUT": "slots"}, "DOMINO_KV_LAYOUT=slots was retired"),
        ({"DOMINO_PREFIX_BLOCK_SIZE": "8"}, "DOMINO_PREFIX_BLOCK_SIZE was retired"),
    ],
)
def test_bad_kv_settings_stop_the_server_at_start_naming_the_setting(env: dict[str, str], message: str) -> None:
    """The real entry point, before any model loads: exit status non-zero and the setting named."""
    proc = subprocess.run(
        [sys.executable, "-m", "app.main", "--port", "0"],
        env={**_clean_env(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DOMINO_")}
