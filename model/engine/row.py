"""A request as the engine runs it: its prompt, parameters, output so far and per-row state. One
type that the engine, the scheduler, the proposers and the policy all use (the wire-side types in
requests.py stay torch-free; this one holds the row's torch-side state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.engine.costs import NgramAcceptance
from model.engine.logits_processors import RowProcessor
from model.engine.ngram import NgramIndex
from model.engine.requests import RequestStats, SamplingParams


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
