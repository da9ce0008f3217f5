"""Admission's model work: the prompts of newly admitted rows through the target in as few padded
forwards as pay, each after the shared prompt blocks admission found, the drafter's context filled
from the target's features, the row's own prompt blocks indexed for later prompts, and each row's
first token chosen from its prompt's last position. The engine then commits
the first tokens to the rows (model/engine/engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model.engine.logits_processors import process_logits
from model.engine.logprobs import prompt_logprobs, token_logprobs
from model.engine.requests import TokenLogprob
from model.engine.row import Row, cache_ids, draw_uniforms, scores_prompt
from model.engine.sampling import SamplingBatch, pick_tokens
from model.kv.blocks import BlockTables
from model.kv.draft_cache import DraftContextCache
from model.kv.target_cache import RaggedKVCache
from model.nn.drafter import Drafter
from model.nn.target import RowGroup, TargetModel, TargetOutput
from model.upload import upload


def prefill_groups(lengths: list[int], split_tokens: int) -> list[tuple[int, int]]:
    """Split prompts sorted by length into consecutive groups [a, b), one forward each, so that
    padded tokens plus `split_tokens` per forward (what one more forward costs, in prompt tokens)
    is least. A group pads to its longest (last) prompt. Exact by dynamic programming: n is at
    most the batch size."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for b in range(1, n + 1):
        for a in range(b):
            cost = best[a] + split_tokens + (b - a) * lengths[b - 1]
            if cost < best[b]:
                best[b], cut[b] = cost, a
    groups, b = [], n
    while b > 0:
        groups.append((cut[b], b))
        b = cut[b]
    return groups[::-1]


@dataclass
class PrefillResult:
    """Admitted rows in the order they now occupy cache slots lo.., with what their prefill gave."""

    rows: list[Row]
    first_tokens: list[int | None]  # None: a preempted row resumed (its anchor is its last output token)
    logprobs: list[list[TokenLogprob] | None]  # of the first token, where asked for
    prompt_logprobs: list[list[TokenLogprob] | None]  # of the prompt, where asked for
    features: list[torch.Tensor | None]  # captured target features [prompt, K*H] (capture only), fp16 on the host


@dataclass
class PrefillBatch:
    """A prefill planned (`Prefiller.plan`): rows in the order of their slots lo.., what each
    forwards, and the padded groups [a, b) of rows that go through the target together."""

    rows: list[Row]
    lo: int
    ids: dict[int, list[int]]  # id(row) -> the tokens its caches will hold (cache_ids)
    starts: list[int]  # what each row's caches hold before
    lengths: list[int]  # tokens each row forwards now
    lens: torch.Tensor  # lengths, on the device
    done: set[int]  # id(row) of the rows whose prompt is all in after this
    resumed: set[int]  # id(row) of the preempted rows recomputed
    groups: list[tuple[int, int]]
    tokens: list[torch.Tensor]  # per group [b - a, longest], padded on the right, on the device
    fresh: list[int]  # rows new to the batch whose prompt is done: they get a first token
    fresh_index: torch.Tensor  # `fresh`, on the device

    def row_groups(self) -> list[RowGroup]:
        """The groups for a packed forward (model/nn/target.py)."""
        return [RowGroup(self.lo + a, t, self.lens[a:b] - 1) for (a, b), t in zip(self.groups, self.tokens)]


class Prefiller:
    """Prompt forwards into the caches of one engine (the pieces are the engine's own)."""

    def __init__(
        self,
        target: TargetModel,
        cache: RaggedKVCache,
        drafter: Drafter | None,
        draft_cache: DraftContextCache | None,
        taps: list[int],
        want_features: bool,
        capture: bool,
        split_tokens: int,
        place: Callable[[list[Row], int], None],
        shared_prefixes: BlockTables | None = None,
    ) -> None:
        self.target, self.cache = target, cache
        self.drafter, self.draft_cache = drafter, draft_cache
        # Rows begin with the shared blocks admission found (Row.shared_tokens), and their own full
        # prompt blocks are indexed for later rows once the prefill succeeded (None: no sharing).
        self.shared_prefixes = shared_prefixes
        self.taps, self.want_features, self.capture = taps, want_features, capture
        # What one more prefill forward costs, in padded prompt tokens (EngineConfig.prefill_split_tokens).
        self.split_tokens = split_tokens
        self.place = place  # rows now in slots lo..: their block tables (paged storage) follow them
        self.device = target.device

    @torch.inference_mode()
    def run(self, new: list[Row], lo: int, chunk: list[int] | None = None) -> PrefillResult:
        """Prefill `new` into slots lo..: rows sorted by length, split where padding would cost more
        than another forward, each after what its caches hold (`Row.prefilled`: shared prompt
        blocks, earlier chunks). The caches advance only once every forward succeeded. A row that
        was preempted (it has output already) is recomputed: its prompt and output but the last
        token (its anchor) go back into the caches, and nothing is chosen, drawn, scored or
        captured for it again. `chunk`: forward that many tokens of each row (chunked prefill); a
        row whose prompt is not done yet gets no first token (None) and no random draw, and its
        blocks are indexed for sharing only once it is."""
        batch = self.plan(new, lo, chunk)
        outputs, scored = self.forward(batch)
        return self.finish(batch, outputs, scored)

    def plan(self, new: list[Row], lo: int, chunk: list[int] | None = None) -> PrefillBatch:
        """`run`'s first part: the rows in their slots (sorted by tokens to forward), the tokens
        each forwards and the groups they go in. Nothing is forwarded or advanced yet."""
        dev = self.device
        resumed = {id(r) for r in new if r.output_ids}
        ids = {id(r): cache_ids(r) for r in new}
        todo = {id(r): len(ids[id(r)]) - r.prefilled for r in new}
        if chunk is not None:
            todo = {id(r): min(n, todo[id(r)]) for r, n in zip(new, chunk)}
        new = sorted(new, key=lambda r: todo[id(r)])
        self.place(new, lo)
        starts = [r.prefilled for r in new]
        lengths = [todo[id(r)] for r in new]  # tokens forwarded per row
        done = {id(r) for r in new if r.prefilled + todo[id(r)] == len(ids[id(r)])}
        for row in new:
            if id(row) not in resumed:
                row.stats.cached_prompt_tokens = row.shared_tokens
        groups = prefill_groups(lengths, self.split_tokens)
        parts = []
        for a, b in groups:
            part = np.zeros((b - a, lengths[b - 1]), dtype=np.int64)
            for i in range(a, b):
                part[i - a, : lengths[i]] = ids[id(new[i])][starts[i] : starts[i] + lengths[i]]
            parts.append(part)
        self.cache.set_lengths(lo, starts)
        fresh = [i for i, r in enumerate(new) if id(r) not in resumed and id(r) in done]
        # The groups' tokens, the lengths and the rows that get a first token, in one non-blocking
        # copy (model/upload.py).
        *tokens, lens, fresh_index = upload(
            [*parts, np.array(lengths, dtype=np.int64), np.array(fresh, dtype=np.int64)], dev
        )
        return PrefillBatch(new, lo, ids, starts, lengths, lens, done, resumed, groups, tokens, fresh, fresh_index)

    def forward(self, batch: PrefillBatch) -> tuple[list[TargetOutput], list[list[TokenLogprob] | None]]:
        """`run`'s second part: one target forward per group; (outputs, prompt logprobs per row)."""
        new, lo, lens = batch.rows, batch.lo, batch.lens
        outputs = []
        scored_logprobs: list[list[TokenLogprob] | None] = [None] * len(new)
        for (a, b), tokens in zip(batch.groups, batch.tokens):
            scored = [i for i in range(a, b) if scores_prompt(new[i])]
            out = self.target.forward(
                self.cache,
                lo + a,
                tokens,
                logits_at=lens[a:b] - 1,
                want_features=self.want_features,
                taps=self.taps,
                keep_hidden=bool(scored),
            )
            for i in scored:
                top_n = new[i].params.prompt_logprobs
                assert out.hidden is not None and top_n is not None
                scored_logprobs[i] = prompt_logprobs(self.target.lm_head, out.hidden[i - a], new[i].prompt_ids, top_n)
            outputs.append(out)
        return outputs, scored_logprobs

    def pick_first(self, batch: PrefillBatch, outputs: list[TargetOutput]) -> torch.Tensor | None:
        """The first tokens, on the device, of the rows new to the batch whose prompt is done (in
        their order in `batch.rows`), each drawn with the first of its uniforms; None when there
        are none. A decode step carrying chunks reads them back with its own results (one copy)."""
        fresh = batch.fresh
        if not fresh:
            return None
        rows = [batch.rows[i] for i in fresh]
        logits = torch.cat([out.logits[:, 0] for out in outputs])
        sampling = SamplingBatch.of_params([r.params for r in rows], draw_uniforms(rows, 1), self.device)
        fresh_logits = logits.index_select(0, batch.fresh_index)[:, None]
        scores = process_logits([r.processor for r in rows], fresh_logits, None)[:, 0]
        return pick_tokens(scores, sampling, slot=0)[0]

    def finish(
        self,
        batch: PrefillBatch,
        outputs: list[TargetOutput],
        scored_logprobs: list[list[TokenLogprob] | None] | None = None,
        first_tokens: list[int] | None = None,
    ) -> PrefillResult:
        """`run`'s last part, from its groups' outputs (`forward`'s, or a packed forward's that
        carried them beside a decode step, with `first_tokens` from `pick_first` read already):
        the first tokens, then the caches advanced."""
        new, lo, starts, lengths, lens, resumed = (
            batch.rows,
            batch.lo,
            batch.starts,
            batch.lengths,
            batch.lens,
            batch.resumed,
        )
        groups, features = batch.groups, [out.features for out in outputs]
        if first_tokens is None:
            picked = self.pick_first(batch, outputs)
            first_tokens = picked.tolist() if picked is not None else []
        logits = torch.cat([out.logits[:, 0] for out in outputs])
        first: list[int | None] = [None] * len(new)
        first_logprobs: list[list[TokenLogprob] | None] = [None] * len(new)
        for i, tok in zip(batch.fresh, first_tokens):
            first[i] = tok
            if new[i].params.logprobs is not None:  # a read of its own (the row asked for logprobs)
                first_logprobs[i] = token_logprobs(logits[i : i + 1], [tok], new[i].params.logprobs)
        # All work is done: now advance the caches.
        self.cache.set_lengths(lo, [s + n for s, n in zip(starts, lengths)])
        if self.drafter is not None:
            assert self.draft_cache is not None
            for (a, b), feats in zip(groups, features):
                assert feats is not None
                self.draft_cache.set_lengths(lo + a, starts[a:b])
                self.drafter.append_context(self.draft_cache, lo + a, feats, lens[a:b], lengths[a:b])
        for row, n in zip(new, lengths):
            row.prefilled += n
        if self.shared_prefixes is not None:
            for row in new:
                if id(row) in batch.done:
                    self.shared_prefixes.index_prefix(row.request_id, batch.ids[id(row)])
        captured: list[torch.Tensor | None] = [None] * len(new)
        if self.capture:
            for (a, b), feats in zip(groups, features):
                assert feats is not None
                for i in range(a, b):
                    if id(new[i]) not in resumed:
                        captured[i] = feats[i - a, : lengths[i]].to(torch.float16).cpu()
        return PrefillResult(new, first, first_logprobs, scored_logprobs or [None] * len(new), captured)
