"""Print the local directory for a model given as a directory or a Hugging Face id (`org/name`).

Ids are looked up in the Hugging Face cache ($HF_HOME, mounted into the container). With
HF_HUB_OFFLINE=1 (the image's default) nothing is downloaded and a missing model fails here, at
start, with a message saying what to mount; with HF_HUB_OFFLINE=0 the files are fetched into the cache.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# Relative paths that look like ids (`models/foo`) are taken as ids only when no such directory exists.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a target (HF config, weights, tokenizer, chat template) or a drafter checkpoint consists of.
WANTED_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


def resolve(value: str) -> str:
    if Path(value).exists() or not REPO_ID.fullmatch(value):
        return value  # a directory, or something the server itself will report on
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=value, allow_patterns=WANTED_FILES)
    except Exception as exc:  # the hub's errors have many types; all mean "not available"
        cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
        raise SystemExit(
            f"resolve_model: {value!r} is neither a directory nor a model in the Hugging Face cache at {cache} "
            f"({type(exc).__name__}: {exc}). Mount a cache that holds it (`hf download {value}` on the host) "
            "or mount the model's directory and name that path."
        ) from None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: resolve_model.py DIR_OR_HF_ID", file=sys.stderr)
        return 2
    print(resolve(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
