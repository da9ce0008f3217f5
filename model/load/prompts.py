"""Prompt files shared by training, evaluation and the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model.load.loading import chat_prompt_ids


def load_prompt_file(path: Path, tokenizer: Any, limit: int | None = None) -> list[list[int]]:
    """JSONL lines {"prompt": str} | {"messages": [...]} | {"prompt_ids": [...]} -> token ids."""
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if "prompt_ids" in item:
            prompts.append(list(item["prompt_ids"]))
        elif "messages" in item:
            prompts.append(chat_prompt_ids(tokenizer, item["messages"]))
        else:
            prompts.append(list(tokenizer(item["prompt"])["input_ids"]))
        if limit and len(prompts) >= limit:
            break
    return prompts
