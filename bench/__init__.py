"""Benchmarks (docs/benchmarks.md). `save_result` is the shared tail of the single-table ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_result(result: dict[str, Any], json_path: str | Path, table: str) -> None:
    """Write `result` as JSON and its Markdown `table` beside it (same stem, .md), and print the table."""
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
