"""`EngineConfig`: everything an `Engine` is configured with, in one typed place (the server builds it
from its settings, app/server.py; tests and benchmarks override fields by keyword)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("domino", "dflash", "ngram", "ar")
DRAFT_POLICIES = ("adaptive", "fixed")
# The chunked-prefill budget "auto" takes where no start-up probe ran, by device type: on this
# project's CPUs a 128-token chunk costs ~2 decode steps of 8 rows (docs/benchmarks.md); a GPU's
# forward of 512 tokens costs a few decode steps of a large batch.
DEFAULT_TOKEN_BUDGET = {"cpu": 128, "cuda": 512}


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "domino"  # domino | dflash (head off) | ngram (copies only) | ar (no drafts)
    max_batch_size: int = 8  # rows decoding at once
    max_model_len: int = 2048  # prompt + output tokens per row
    eos_token_ids: tuple[int, ...] = ()  # end a row unless its request sets ignore_eos
    # adaptive: drafts per step from the drafter's confidence and measured step costs (model/engine/policy.py);
    # fixed: every draft up to the first below draft_threshold.
    draft_policy: str = "adaptive"
    draft_threshold: float = 0.0
    max_drafts: int | None = None  # at most this many drafts verified per step (None: the drafter's block)
    ngram: bool = True  # in domino/dflash, prompt-lookup copies as a second proposer
    ngram_max_n: int = 4
    ngram_min_n: int = 1
    ngram_max_drafts: int = 8
    static_shapes: bool | None = None  # fixed-shape buckets (CUDA graphs); None: on for CUDA
    cuda_graphs: bool = True  # capture the static buckets (CUDA only)
    prefill_split_tokens: int | None = None  # None: 512 on CUDA, 32 on the CPU (model/engine/prefill.py)
    prefix_cache_tokens: int = 0  # 0: prompts share no blocks; else they share full prompt blocks
    capture_taps: tuple[int, ...] | None = None  # record these target layers' features (training data)
    # KV memory (model/kv/blocks.py): bytes, or a fraction of the memory left after the weights;
    # None: 2 GiB on a CPU, 0.9 on a GPU. Rows are admitted while their blocks fit.
    kv_cache_memory: int | float | None = None
    kv_block_size: int = 16  # tokens per KV block, a power of two
    # Paged static steps attend over the capacity, or a quarter of it, a sixteenth, ... down to no
    # less than this many positions (model/engine/static.py: span_buckets).
    static_min_span: int = 512
    # Chunked prefill: tokens one step may forward, decoding rows first (each its verify width),
    # prompt chunks in what is left, at least max(1, budget // 4) a step. None: whole prompts, in
    # steps of their own (and prefill_split_tokens groups them). "auto": with probe_costs, the
    # largest chunk this device forwards within CHUNK_STALL decode steps (model/engine/cost_probe.py),
    # else DEFAULT_TOKEN_BUDGET for the device.
    max_num_batched_tokens: int | str | None = None
    # Chunks ride in the decode step's verify forward (one pass through the weights a step) on the
    # dynamic path; False: a prefill forward of their own after it (the comparison's other side).
    fold_chunks: bool = True
    # Time verify forwards (batch 1 and the largest, every verify width) and drafter blocks before
    # serving, so the adaptive policy starts from this device's costs, not a prior's
    # (model/engine/cost_probe.py). The server turns it on; tests and benchmarks that build many
    # engines leave it off unless they measure it.
    probe_costs: bool = False

    def check(self) -> None:
        """ValueError naming the field, for values no engine can run with."""
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"draft_policy must be one of {DRAFT_POLICIES}, got {self.draft_policy!r}")
        for name in ("max_batch_size", "max_model_len", "static_min_span"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_drafts is not None and self.max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {self.max_drafts}")
        if self.kv_block_size < 1 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if isinstance(self.kv_cache_memory, float) and self.kv_cache_memory > 1:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {self.kv_cache_memory}")
        budget = self.max_num_batched_tokens
        if budget is not None and budget != "auto" and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"max_num_batched_tokens must be 'auto' or >= 1, got {budget!r}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
