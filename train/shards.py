"""gen's output: gzip JSONL shards of {"i": prompt index, "prompt": [ids], "answer": [ids]}."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"shard-{index:05d}.jsonl.gz"


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("shard-*.jsonl.gz"))


def read_shard(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]
