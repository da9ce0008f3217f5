"""A request as the engine runs it: its prompt, parameters, output so far and per-row state. One
type that the engine, the scheduler, the proposers and the policy all use (the wire-side types in
requests.py stay torch-free; this one holds the row's torch-side state). Beside it, what happens to
a row alone: its random stream and committing tokens to it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.engine.costs import NgramAcceptance
from model.engine.logits_processors import RowProcessor
from model.engine.ngram import NgramIndex
from model.engine.requests import RequestOutput, RequestStats, SamplingParams, TokenLogprob


@dataclass
class Row:
    """One running or waiting request: its prompt, parameters, output so far and per-row state."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: np.random.Generator  # the row's uniforms (seed_generator)
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    anchor: int = -1
    stats: RequestStats = field(default_factory=RequestStats)
    aborted: bool = False
    ngram: NgramIndex | None = None  # prompt + output, indexed for prompt lookup
    ngram_acceptance: NgramAcceptance | None = None  # this row's own record of its copies
    processor: RowProcessor | None = None  # logits processors and their state (None: plain sampling)
    admitted: int = 0  # order of first admission (0: never admitted); the newest is preempted first
    shared_tokens: int = 0  # positions 0.. its admission found in shared prefix blocks
    prefilled: int = 0  # positions of cache_ids(row) in the caches so far (shared, then chunk by chunk)
    # The drafter's confidence per slot at the row's last block (float32 [d]): the policy's
    # forecast of its next block, read back with that step's results (model/engine/policy.py).
    draft_confidence: np.ndarray | None = None


def cache_ids(row: Row) -> list[int]:
    """The tokens a (re)prefill puts in the caches: the prompt, and for a preempted row its output
    but the last token (the anchor, which the next step writes)."""
    return row.prompt_ids + row.output_ids[:-1]


def scores_prompt(row: Row) -> bool:
    """The row's prefill scores its prompt (prompt logprobs): asked for, and not a preempted row
    being recomputed (its scores went out with its first prefill)."""
    return row.params.prompt_logprobs is not None and not row.output_ids


def cached_tokens(row: Row) -> int:
    """How many `cache_ids(row)` are, without building them: the row's positions in the caches."""
    return len(row.prompt_ids) + max(len(row.output_ids) - 1, 0)


def seed_generator(seed: int) -> np.random.Generator:
    """A row's random stream. The whole 64-bit seed counts (NumPy's SeedSequence hashes it): torch's CPU
    generator keeps only the low 32 bits, so seeds 7 and 7 + 2**32 would sample the same text."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed % 2**64)))


def draw_uniforms(rows: list[Row], count: int) -> np.ndarray:
    """`count` uniforms per sampling row from that row's own generator (a fixed number per step),
    on the host: [R, count] float32, for the step's one copy to the device (model/upload.py).

    Greedy rows get zeros and never touch their generators: no per-row work in greedy batches."""
    u = np.zeros((len(rows), count), dtype=np.float32)
    for i, row in enumerate(rows):
        if not row.params.greedy:
            u[i] = row.generator.random(count, dtype=np.float32)
    return u


def commit(row: Row, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
    """Append tokens to a row, stopping exactly at a stop token or the token budget, and advance
    its processors: the step's output for the row (the caller adds the step's statistics)."""
    emitted: list[int] = []
    reason, stop_tok = None, None
    for tok in tokens:
        row.output_ids.append(tok)
        emitted.append(tok)
        if tok in row.stop_ids:
            reason, stop_tok = "stop", tok
            break
        if len(row.output_ids) >= row.params.max_new_tokens:
            reason = "length"
            break
    error = None
    if row.processor is not None:
        row.processor.commit(emitted)
        # Output that can no longer follow its grammar ends as an error, never as "stop".
        error = row.processor.grammar_error
        if error is not None:
            reason = "error"
    lp = logprobs[: len(emitted)] if logprobs is not None else None
    return RequestOutput(
        row.request_id,
        emitted,
        reason is not None,
        reason,
        row.stats,
        lp,
        stop_tok,
        error=error,
        client_error=error is not None,
    )
