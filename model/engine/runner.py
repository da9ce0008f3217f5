"""The model side of one engine: the target and the drafter, their per-row caches, the prefix cache
and the static-shape (CUDA-graph) buckets, and the forwards that read and advance them. The engine
(model/engine/engine.py) decides what runs; this runs it (vLLM's split of scheduler and runner)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from model.engine.config import EngineConfig
from model.engine.cost_probe import PROBE_CONTEXT, ChunkProbe, CostProbe, probe_chunk_budget, probe_step_costs
from model.engine.prefill import Prefiller
from model.engine.proposers import DrafterProposer
from model.engine.row import Row
from model.engine.sampling import SamplingBatch
from model.engine.static import StaticSteps, batch_buckets, span_buckets, verify_widths
from model.kv.blocks import BlockPool, BlockTables, kv_budget, kv_bytes_per_token
from model.kv.sizes import format_bytes
from model.nn.drafter import Drafter, new_context_cache
from model.nn.target import RowGroup, TargetModel, TargetOutput


def check_drafter(mode: str, drafter: Drafter | None) -> None:
    """ValueError unless the drafter can run in `mode`."""
    if mode not in ("ar", "ngram") and drafter is None:
        raise ValueError(f"mode {mode!r} needs a drafter")
    if mode == "domino" and drafter is not None and not drafter.config.has_head:
        raise ValueError("mode 'domino' needs a Domino drafter (projector_type 'domino'); use 'dflash'")


def cache_layout(max_batch_size: int, max_model_len: int, scratch: int, static_shapes: bool) -> tuple[int, int]:
    """(slots, capacity) of the engine's caches, the one place they are worked out. Capacity: the
    longest allowed context plus room for `scratch` tokens written behind it (a full block of draft
    keys, or a verify's drafts) and the anchor. Slots: the batch, or with static shapes the largest
    batch bucket, since padded batches use rows up to it."""
    slots = batch_buckets(max_batch_size)[-1] if static_shapes else max_batch_size
    return slots, max_model_len + scratch + 1


class ModelRunner:
    """Row i of the engine's batch lives in cache slot i of both caches."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None,
        cfg: EngineConfig,
        num_drafts: int,
        max_drafts_per_step: int,
        use_head: bool,
    ) -> None:
        """`num_drafts`: the drafter's slots per block; `max_drafts_per_step`: the most drafts a row
        verifies in a step, from either proposer (the verify widths and the caches' scratch room)."""
        self.target, self.drafter, self.device = target, drafter, target.device
        capture_taps = list(cfg.capture_taps or [])
        self.capture = bool(capture_taps)
        # Taps are this engine's own: the target and the drafter may be shared with other engines
        # (benchmarks build one per mode over the same objects). Training data generation records
        # the target's features without a drafter.
        self.taps = list(drafter.config.target_layer_ids) if drafter is not None else capture_taps
        target.add_taps(self.taps)
        if drafter is not None:
            drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
        self.want_features = drafter is not None or self.capture
        budget = kv_budget(cfg.kv_cache_memory, self.device)  # before the caches: what the weights left
        static_shapes = self.device.type == "cuda" if cfg.static_shapes is None else cfg.static_shapes
        block = drafter.config.block_size if drafter is not None else 1
        slots, capacity = cache_layout(
            cfg.max_batch_size, cfg.max_model_len, max(block, max_drafts_per_step), static_shapes
        )
        # KV memory by blocks (model/kv/blocks.py): admission reserves a row's blocks, each step grows
        # them. Never more blocks than the slots could use (so small test engines stay small).
        self.lookahead = capacity - cfg.max_model_len  # positions a step may write past a row's tokens
        self.bytes_per_token = kv_bytes_per_token(target.num_layers, target.kv_heads, target.head_dim, target.dtype)
        if drafter is not None:
            dcfg = drafter.config
            self.bytes_per_token += kv_bytes_per_token(
                dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim, target.dtype
            )
        block_bytes = cfg.kv_block_size * self.bytes_per_token
        per_row = math.ceil(capacity / cfg.kv_block_size)
        num_blocks = min(budget // block_bytes, slots * per_row)
        if num_blocks < per_row:
            raise ValueError(
                f"kv_cache_memory (DOMINO_KV_CACHE_MEMORY) of {format_bytes(budget)} holds {num_blocks} blocks of "
                f"{cfg.kv_block_size} tokens; one row at max_model_len {cfg.max_model_len} needs {per_row} "
                f"({format_bytes(per_row * block_bytes)})"
            )
        # The storage: pools of those blocks (model/kv/paged.py), the scheduler's block ids in both.
        paging = (num_blocks, cfg.kv_block_size)
        self.cache = target.new_cache(slots, capacity, paging)
        self.draft_cache = (
            new_context_cache(drafter.config, slots, capacity, target.dtype, self.device, paging)
            if drafter is not None
            else None
        )
        self.blocks = BlockTables(BlockPool(num_blocks, cfg.kv_block_size))
        self.rows_at_max_len = num_blocks // per_row
        # Prompt beginnings seen before share their blocks by reference (the index in
        # model/kv/blocks.py, inside the budget); not when capturing training features, which need
        # every prompt position's taps.
        self.share_prefixes = cfg.prefix_cache_tokens > 0 and not self.capture
        # What one more prefill forward costs, in padded prompt tokens: on a CPU a forward's fixed
        # cost is ~30 prompt tokens' worth (bench.verify_cost: 51 ms for 1 token, +1.9 ms per
        # token from 16 on); on a GPU launches dominate, so rows are split only for long padding.
        split_tokens = cfg.prefill_split_tokens
        if split_tokens is None:
            split_tokens = 512 if self.device.type == "cuda" else 32
        self.prefiller = Prefiller(
            target, self.cache, drafter, self.draft_cache, self.taps, self.want_features, self.capture,
            split_tokens, self.place, self.blocks if self.share_prefixes else None,
        )  # fmt: skip
        self.drafter_proposer = (
            DrafterProposer(drafter, self.draft_cache, num_drafts, use_head, self.device)
            if drafter is not None and self.draft_cache is not None
            else None
        )
        self.static: StaticSteps | None = None
        if static_shapes:
            spans = span_buckets(capacity, cfg.static_min_span)
            self.static = self._build_static_steps(cfg.max_batch_size, max_drafts_per_step, spans, cfg.cuda_graphs)
            if self.drafter_proposer is not None:
                self.drafter_proposer.static = self.static

    @torch.inference_mode()
    def _build_static_steps(
        self, max_batch_size: int, max_drafts: int, spans: list[int], cuda_graphs: bool
    ) -> StaticSteps:
        """Verify per (batch, T, span) bucket and the proposal per (batch, span) (greedy, and with
        sampling rows per top-k/top-p or not), built (and on CUDA captured) now: T is 1 for
        `ar`/paused steps, else a width holding the step's drafts."""
        proposer = self.drafter_proposer
        if proposer is not None:
            proposer.reserve_dists(batch_buckets(max_batch_size)[-1])
        steps = StaticSteps(
            self.static_verify,
            proposer.static_block if proposer is not None else None,
            max_batch_size,
            verify_widths(max_drafts),
            spans,
            self.device,
            cuda_graphs,
            sampled_fn=proposer.static_sampled_block if proposer is not None else None,
            num_drafts=proposer.num_drafts if proposer is not None else 0,
        )
        steps.warm_up()
        return steps

    def static_verify(self, tokens: torch.Tensor, span: int) -> tuple[torch.Tensor, ...]:
        """The body of a static verify bucket: slots 0..R-1, fixed shapes, nothing read back. With a
        drafter, the drafter's context of every verified position is written too (at each row's
        draft length; acceptance then only moves the lengths): on a GPU that projection is dozens
        of small kernels the graph launches at once instead of the host after every step."""
        out = self.target.forward(self.cache, 0, tokens, want_features=self.want_features, span=span, taps=self.taps)
        if out.features is None:
            return (out.logits,)
        if self.drafter is not None and self.draft_cache is not None:
            self.drafter.write_context(self.draft_cache, 0, out.features)
        return out.logits, out.features

    @property
    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The drafter's vocabulary in the target's ids, when it drafts over a restricted one."""
        if self.drafter is None or not self.drafter.config.draft_vocab_size:
            return None
        return self.drafter.draft_vocab_ids

    def verify(self, lo: int, tokens: torch.Tensor) -> TargetOutput:
        """The target over [anchor, drafts] per row: a static-shape bucket when one holds the batch
        (the outputs are that bucket's buffers, valid until its next replay), else the dynamic path."""
        if self.static is not None and lo == 0:
            out = self.static.run_verify(tokens, max(self.cache.host_lengths[: tokens.shape[0]]))
            if out is not None:
                features = out[1] if len(out) > 1 else None
                return TargetOutput(out[0], features, drafter_context=self.drafter is not None)
        return self.target.forward(self.cache, lo, tokens, want_features=self.want_features, taps=self.taps)

    def verify_packed(self, lo: int, tokens: torch.Tensor, groups: list[RowGroup]) -> list[TargetOutput]:
        """`verify` on the dynamic path with other groups of rows (prompt chunks) in the same
        forward; the verify's output first, then each group's."""
        return self.target.forward_packed(
            self.cache, [RowGroup(lo, tokens), *groups], want_features=self.want_features, taps=self.taps
        )

    def advance(self, lo: int, hi: int, out: TargetOutput, accepted: torch.Tensor, host_accepted: list[int]) -> None:
        """Advance the caches by each row's anchor + accepted drafts (rejected positions are simply
        not counted; the host lengths from `host_accepted`, already read with the step's results).
        The drafter's context first, rolled back if it fails: the target cache then moves only once
        nothing can fail, so a retry of this step (step() retries row by row) starts where it did."""
        counts = [a + 1 for a in host_accepted]
        if out.drafter_context:
            assert self.draft_cache is not None
            self.draft_cache.advance(lo, accepted + 1, counts)
        elif self.drafter is not None:
            assert self.draft_cache is not None and out.features is not None
            draft_lengths = self.draft_cache.host_lengths[lo:hi]
            try:
                self.drafter.append_context(self.draft_cache, lo, out.features, accepted + 1, counts)
            except BaseException:
                self.draft_cache.set_lengths(lo, draft_lengths)
                raise
        self.cache.advance(lo, accepted + 1, counts)

    def probe_costs(self, batches: list[int], widths: list[int], reps: int) -> CostProbe:
        """Verify forwards at every batch in `batches` and width in `widths`, and a full drafter
        block per batch, timed over the empty slots 0.. (model/engine/cost_probe.py). Before any
        row is admitted: every slot's table points at the trash block."""
        proposer = self.drafter_proposer

        def draft(anchors: torch.Tensor) -> object:
            assert proposer is not None
            greedy = SamplingBatch.all_greedy_rows(anchors.shape[0], self.device)
            return proposer.propose(0, [], anchors, greedy, proposer.num_drafts)

        def set_context(rows: int, positions: int) -> None:
            for cache in (self.cache, self.draft_cache):
                if cache is not None:
                    cache.set_lengths(0, [positions] * rows)

        return probe_step_costs(
            lambda tokens: self.verify(0, tokens),
            draft if proposer is not None else None,
            set_context,
            batches,
            widths,
            self.device,
            reps,
            self.target.vocab_size,
            min(PROBE_CONTEXT, self.cache.capacity - self.lookahead),  # room for any step after it
        )

    def probe_chunk_budget(self, decode: tuple[int, int, float]) -> ChunkProbe:
        """The chunked-prefill token budget this device affords (model/engine/cost_probe.py:
        `probe_chunk_budget`), from one-row prefill forwards over slot 0, before any row is admitted."""

        def prefill(tokens: torch.Tensor) -> object:
            at = torch.tensor([tokens.shape[1] - 1], device=self.device)
            return self.target.forward(
                self.cache, 0, tokens, logits_at=at, want_features=self.want_features, taps=self.taps
            )

        def set_context(rows: int, positions: int) -> None:
            self.cache.set_lengths(0, [positions] * rows)

        context = min(PROBE_CONTEXT, self.cache.capacity // 2)
        return probe_chunk_budget(
            prefill, set_context, decode, self.device, self.target.vocab_size,
            room=self.cache.capacity - self.lookahead, context=context,
        )  # fmt: skip

    def kv_summary(self) -> str:
        """The start-up line's account of KV memory."""
        pool = self.blocks.pool
        tokens = pool.num_blocks * pool.block_size
        return (
            f"KV cache: {pool.num_blocks} blocks x {pool.block_size} tokens = {tokens} tokens "
            f"({format_bytes(tokens * self.bytes_per_token)}); {self.rows_at_max_len} "
            f"{'row fits' if self.rows_at_max_len == 1 else 'rows fit'} at max_model_len"
        )

    def place(self, rows: Sequence[Row], lo: int = 0) -> None:
        """Rows now in slots lo..: each slot's block table becomes its row's (copied only where it
        changed)."""
        tables = [self.blocks.table(row.request_id) for row in rows]
        for cache in (self.cache, self.draft_cache):
            if cache is not None:
                cache.set_tables(range(lo, lo + len(rows)), tables)

    def seat(self, row: Row, slot: int) -> None:
        """A row admitted for a chunked prefill takes `slot`: its block table, and the length of
        what its caches hold already (shared prompt blocks)."""
        self.place([row], slot)
        for cache in (self.cache, self.draft_cache):
            if cache is not None:
                cache.set_lengths(slot, [row.prefilled])

    def vacate(self, first: int) -> None:
        """Slots first.. hold no row: emptied, so that a static step's padding rows never write where
        a row that left, or a block it gave back, was."""
        for cache in (self.cache, self.draft_cache):
            if cache is not None:
                cache.vacate(first)

    def move_row(self, src: int, dst: int) -> None:
        """Row `src` now lives in slot `dst`: its block table and length move, no key is copied."""
        self.cache.move_row(src, dst)
        if self.draft_cache is not None:
            self.draft_cache.move_row(src, dst)
