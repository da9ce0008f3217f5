"""Write the benchmark prompt files: ``python -m bench.prompts.build``.

* ``humaneval.jsonl``: one ``{"prompt": ...}`` per HumanEval problem (completion-style).
* ``sharegpt_heldout.jsonl``: one ``{"messages": [{"role": "user", "content": ...}]}`` per
  held-out ShareGPT prompt (chat-style), the slice ``split_sharegpt`` keeps out of training.

The outputs are deterministic, so rebuilding gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from train.data import load_humaneval_prompts, load_sharegpt_prompts, split_sharegpt

HERE = Path(__file__).resolve().parent
HUMANEVAL_FILE = "humaneval.jsonl"
SHAREGPT_HELDOUT_FILE = "sharegpt_heldout.jsonl"


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows atomically (temp file + rename) and return how many were written."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(path)
    return count


def build(out_dir: Path, heldout: int = 200, seed: int = 0) -> dict[str, int]:
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {HUMANEVAL_FILE: write_jsonl(out_dir / HUMANEVAL_FILE, ({"prompt": p} for p in load_humaneval_prompts()))}
    _, held = split_sharegpt(load_sharegpt_prompts(), heldout=heldout, seed=seed)
    counts[SHAREGPT_HELDOUT_FILE] = write_jsonl(
        out_dir / SHAREGPT_HELDOUT_FILE,
        ({"messages": [{"role": "user", "content": p}]} for p in held),
    )
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE, help="where to write (default: %(default)s)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out ShareGPT prompts")
    parser.add_argument("--seed", type=int, default=0, help="split seed (keep 0 for the benchmarks)")
    args = parser.parse_args(argv)
    for name, count in build(args.out_dir, args.heldout, args.seed).items():
        print(f"wrote {count} prompts to {args.out_dir / name}")


if __name__ == "__main__":
    main()
