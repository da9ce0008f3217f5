"""`domino-train gen`: regenerate answers with the target itself (labels are its own greedy output).

Writes resumable gzip JSONL shards (train/shards.py); a finished shard is never regenerated.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import time
from typing import Any

from tqdm import tqdm

from model.engine.engine import Engine, SamplingParams
from model.load.loading import chat_prompt_ids, eos_token_ids, load_target, resolve_device, resolve_dtype
from model.load.prompts import load_prompt_file
from model.nn.target import TargetModel
from train.config import GenConfig
from train.data import load_sharegpt_later_turns, load_sharegpt_prompts, split_sharegpt
from train.shards import shard_path

log = logging.getLogger("domino.train.gen")


def gen(cfg: GenConfig) -> None:
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    model, tokenizer = load_target(cfg.target, resolve_dtype(cfg.dtype, device), device)
    if cfg.prompts:
        prompts: list[Any] = load_prompt_file(cfg.prompts, tokenizer)
    else:
        # ShareGPT first human turns; the held-out slice (bench/prompts) is never trained on.
        prompts, heldout = split_sharegpt(load_sharegpt_prompts(), heldout=cfg.heldout, seed=0)
        if cfg.source == "later-turns":
            # Later turns of the training conversations only: nothing of a held-out one.
            prompts = load_sharegpt_later_turns(heldout)
    engine = Engine(
        TargetModel(model),
        None,
        mode="ar",
        max_batch_size=cfg.batch_size,
        max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens,
        eos_token_ids=eos_token_ids(model, tokenizer),
        # Batches of hundreds of rows of one-off lengths: graphs per batch bucket would cost more
        # memory and start-up than the launches they save.
        static_shapes=False,
    )
    total = min(len(prompts), cfg.limit or len(prompts))
    num_shards = math.ceil(total / cfg.shard_size)
    last = num_shards - 1 if cfg.last_shard is None else min(cfg.last_shard, num_shards - 1)
    todo = [k for k in range(cfg.first_shard, last + 1) if not shard_path(out, k).exists()]
    log.info("%d train prompts, %d shards of %d, %d to do", len(prompts), num_shards, cfg.shard_size, len(todo))
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens)

    def shard_prompts(k: int) -> int:
        return min(cfg.shard_size, total - k * cfg.shard_size)

    bar = tqdm(total=sum(shard_prompts(k) for k in todo), desc="gen", unit="answer")
    started, last_shard_s = time.perf_counter(), 0.0
    for k in todo:
        t0 = time.perf_counter()
        if cfg.time_budget_s and t0 - started + last_shard_s > cfg.time_budget_s:
            log.info("time budget reached: stopping before shard %d (rerun to resume)", k)
            break
        if shard_path(out, k).exists():  # written meanwhile by another gen job on this directory
            bar.update(shard_prompts(k))
            continue
        batch = []
        for i in range(k * cfg.shard_size, min((k + 1) * cfg.shard_size, total)):
            ids = prompts[i] if cfg.prompts else chat_prompt_ids(tokenizer, [{"role": "user", "content": prompts[i]}])
            if len(ids) <= cfg.max_prompt_tokens:
                batch.append((i, ids))
        results = engine.generate([ids for _, ids in batch], params)
        tmp = shard_path(out, k).with_suffix(".tmp")
        with gzip.open(tmp, "wt") as f:
            for (i, ids), (answer, _, _) in zip(batch, results):
                f.write(json.dumps({"i": i, "prompt": ids, "answer": answer}) + "\n")
        os.replace(tmp, shard_path(out, k))
        new_tokens = sum(len(r[0]) for r in results)
        last_shard_s = time.perf_counter() - t0
        bar.update(shard_prompts(k))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
