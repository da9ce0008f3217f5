"""Continuous-batching speculative decoding engine (docs/design.md §1.4, §3).

One `Engine` owns a target, an optional drafter and their per-row caches. `step()` either admits
waiting requests (one batched prefill) or advances every running row by one speculative step:
draft a block per row, verify all rows in one target forward, commit a different number of tokens
per row and roll the rest back by not advancing that row's cache length. With a token budget
(`max_num_batched_tokens`, chunked prefill; the server's default) a step does both: the decoding
rows' step, with prompt chunks in the same verify forward.

Modes: `domino` (Domino head on), `dflash` (head off: base logits only), `ngram` (only prompt-lookup
copies from each row's own context, no drafter), `ar` (no drafts: plain batched autoregressive
decoding through the same code path). In `domino`/`dflash` the n-gram copies are on by default too:
per row and step the policy verifies whichever proposal it expects to pay more (or none).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from model.engine.config import DEFAULT_TOKEN_BUDGET, EngineConfig
from model.engine.cost_probe import STEP_STALL, ChunkProbe, CostProbe
from model.engine.costs import TRUSTED_SAMPLES, NgramAcceptance, prior_curve_for
from model.engine.logits_processors import new_row_processor, process_logits
from model.engine.logprobs import token_logprobs
from model.engine.ngram import NgramIndex
from model.engine.policy import DraftPolicy
from model.engine.prefill import PrefillBatch, PrefillResult
from model.engine.proposers import DraftProposer, NgramProposer
from model.engine.rejection import accept, assemble_drafts, choice_arrays
from model.engine.requests import RequestOutput, RequestStats, SamplingParams, StepTiming, check_prompt
from model.engine.row import Row, cached_tokens, commit, scores_prompt, seed_generator
from model.engine.runner import ModelRunner, check_drafter
from model.engine.scheduler import Scheduler
from model.engine.static import verify_widths
from model.engine.step import DecodeStep, StepResults
from model.engine.timing import PhaseTimer
from model.kv.blocks import BlockPool
from model.nn.attention import KV_READS
from model.nn.drafter import Drafter
from model.nn.target import TargetModel, TargetOutput


@dataclass
class FoldedChunks:
    """Prompt chunks a decode step carries in its verify forward (chunked prefill): the rows and
    their chunk sizes, the prefill planned for them, their generators' states before it, and once
    the forward ran, their part of its output and their first tokens on the device (read back with
    the step's results)."""

    taken: list[tuple[Row, int]]
    batch: PrefillBatch
    states: list[dict[str, Any]]
    outputs: list[TargetOutput] = field(default_factory=list)
    first: torch.Tensor | None = None
    t0: float = 0.0
    planned_seconds: float = 0.0  # the forward, decode and chunks, as the cost models put it (0: none)


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
        *,
        proposer: DraftProposer | None = None,
        **overrides: Any,
    ) -> None:
        """`overrides` replace fields of `config` (EngineConfig's names: `mode="ar"`, ...). `proposer`
        drafts in the drafter's place (tests' and benchmarks' oracles); the drafter's context cache and
        features are kept either way."""
        cfg = replace(config or EngineConfig(), **overrides)
        if cfg.capture_taps is not None and not isinstance(cfg.capture_taps, tuple):
            cfg = replace(cfg, capture_taps=tuple(cfg.capture_taps))
        cfg.check()
        self.config = cfg
        mode, max_drafts = cfg.mode, cfg.max_drafts
        check_drafter(mode, drafter)
        self.target = target
        self.mode = mode
        self.drafter = drafter if mode not in ("ar", "ngram") else None
        # Prompt-lookup copies: the only proposals in `ngram` mode, an extra choice in domino/dflash.
        self.ngram = mode == "ngram" or (cfg.ngram and mode != "ar")
        self.ngram_max_n, self.ngram_min_n = cfg.ngram_max_n, cfg.ngram_min_n
        self.ngram_max_drafts = cfg.ngram_max_drafts if max_drafts is None else min(cfg.ngram_max_drafts, max_drafts)
        if self.ngram and self.ngram_max_drafts < 1:
            raise ValueError(f"ngram_max_drafts must be >= 1, got {self.ngram_max_drafts}")
        self.max_batch_size = cfg.max_batch_size
        self.max_model_len = cfg.max_model_len
        self.eos_token_ids = frozenset(int(t) for t in cfg.eos_token_ids)
        self.draft_forwards = 0  # steps that ran the drafter
        self.device = target.device
        dcfg = self.drafter.config if self.drafter is not None else None
        self.num_drafts = (
            0 if dcfg is None else dcfg.num_drafts if max_drafts is None else min(max_drafts, dcfg.num_drafts)
        )
        # The networks, their caches and the forwards over them (model/engine/runner.py).
        self.runner = ModelRunner(
            target, self.drafter, cfg, self.num_drafts, self.max_drafts_per_step, mode == "domino"
        )
        self.cache, self.draft_cache, self.static = self.runner.cache, self.runner.draft_cache, self.runner.static
        self.drafter_proposer = self.runner.drafter_proposer
        # Who drafts: the drafter's block (or `proposer` in its place) and the n-gram copies.
        self.proposer: DraftProposer | None = proposer or self.drafter_proposer
        self.ngram_proposer = NgramProposer()
        # adaptive: drafts per step from the drafter's confidence and measured step costs
        # (model/engine/policy.py); fixed: every draft up to the first below draft_threshold.
        self.policy = DraftPolicy(
            adaptive=cfg.draft_policy == "adaptive",
            num_drafts=self.num_drafts,
            draft_threshold=cfg.draft_threshold,
            ngram_max_n=cfg.ngram_max_n,
            ngram_max_drafts=self.ngram_max_drafts,
            prior=prior_curve_for(target.device, target.dtype, int4="int4" in target.packed_layers()),
        )
        # This device's step costs, measured before any row is admitted (model/engine/cost_probe.py).
        self.cost_probe: CostProbe | None = None
        if cfg.probe_costs and mode != "ar":
            batches = sorted({1, cfg.max_batch_size})
            self.cost_probe = self.runner.probe_costs(batches, verify_widths(self.max_drafts_per_step), TRUSTED_SAMPLES)
            self.policy.costs.seed(self.cost_probe.verify, self.cost_probe.draft)
        self.rows: list[Row] = []  # decoding row i lives in cache slot i
        # Chunked prefill (EngineConfig.max_num_batched_tokens): admitted rows whose prompt is not
        # all in the caches yet, oldest first, in the slots after the decoding rows'.
        self.chunk_probe: ChunkProbe | None = None
        self.token_budget = self._token_budget() if not self.runner.capture else None
        self.prefilling: list[Row] = []
        # Chunked prefill's clock: the wall time of recent decode steps without chunks (the streams'
        # usual gap), and of steps that carried chunks over their forward as the cost models planned
        # it (host work and the drafter ride on top, and the models miss late in a long prompt, where
        # attention over the prefix grows: the chunk sizes follow what steps really took).
        self.recent_decode_seconds: deque[float] = deque(maxlen=32)
        self.recent_chunk_overruns: deque[float] = deque(maxlen=4)
        self.num_prefill_chunks = 0  # prompt chunks forwarded (a row's next tokens; one prefill takes several)
        self.last_prefill_tokens = 0  # prompt tokens the last step forwarded (whole prompts or chunks)
        # Chunks a decode step's verify carried, and their prefill's result.
        self._folded: tuple[FoldedChunks, PrefillResult] | None = None
        self.scheduler = Scheduler(
            cfg.max_batch_size, self.runner.blocks, self.runner.lookahead, self.runner.share_prefixes
        )
        self.num_preemptions = 0  # rows taken out of the batch for want of KV blocks, to be recomputed
        self.kv_bytes_read = 0  # keys/values its steps' attention read (model/nn/attention.py: KV_READS)
        self._seed_source = torch.Generator().manual_seed(torch.seed() % (2**63))
        self.last_timing: StepTiming | None = None

    def _token_budget(self) -> int | None:
        """The chunked-prefill budget: as configured, or for "auto" the largest chunk a decode step
        of the largest batch carries for at most CHUNK_STALL x its own cost (model/engine/cost_probe.py;
        timed now when costs are probed: the step at the middle verify width, one token in `ar`),
        else the device's default."""
        budget = self.config.max_num_batched_tokens
        if budget != "auto":
            assert budget is None or isinstance(budget, int)
            return budget
        if not self.config.probe_costs:
            return DEFAULT_TOKEN_BUDGET.get(self.device.type, DEFAULT_TOKEN_BUDGET["cuda"])
        b = self.max_batch_size
        costs = self.cost_probe or self.runner.probe_costs([b], [1], TRUSTED_SAMPLES)
        widths = sorted(t for batch, t in costs.verify if batch == b)
        t = widths[len(widths) // 2]  # a typical drafting step: 2 drafts of up to 8, say
        self.chunk_probe = self.runner.probe_chunk_budget((b, t, min(costs.verify[(b, t)])))
        return self.chunk_probe.budget

    def chunking_summary(self) -> str:
        """The start-up log's line on chunked prefill: the budget and where it came from."""
        if self.token_budget is None:
            return "chunked prefill: off (whole prompts, each admission a step of its own)"
        if self.chunk_probe is not None:
            return self.chunk_probe.summary()
        source = "default for this device" if self.config.max_num_batched_tokens == "auto" else "as set"
        return f"chunked prefill: {self.token_budget} tokens a step ({source})"

    # -- public API ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_ids, params, self.target.vocab_size, self.max_model_len)
        if any(row.request_id == request_id for row in [*self.scheduler, *self.rows, *self.prefilling]):
            raise ValueError(f"request id {request_id!r} is already running or waiting")
        seed = (
            params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        row = Row(request_id, list(prompt_ids), params, seed_generator(seed), frozenset(stop_ids))
        row.processor = new_row_processor(params, row.prompt_ids, row.stop_ids, self.target.vocab_size, self.device)
        if self.ngram:
            row.ngram = NgramIndex(self.ngram_max_n, self.ngram_min_n)
            row.ngram_acceptance = NgramAcceptance(self.ngram_max_n, self.ngram_max_drafts)
        row.stats.accepted_per_position = [0] * self.max_drafts_per_step
        self.scheduler.add(row)

    def abort(self, request_id: str) -> None:
        """Cancel a request; it leaves the batch at the start of the next step."""
        for row in [*self.scheduler, *self.rows, *self.prefilling]:
            if row.request_id == request_id:
                row.aborted = True

    def has_unfinished(self) -> bool:
        return bool(self.rows or self.prefilling or len(self.scheduler))

    @property
    def max_drafts_per_step(self) -> int:
        """The most drafts one row may verify in a step, from either proposer."""
        return max(self.num_drafts, self.ngram_max_drafts if self.ngram else 0)

    @property
    def num_running(self) -> int:
        return len(self.rows) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler)

    @property
    def kv_blocks(self) -> BlockPool:
        """KV blocks in use and free (model/kv/blocks.py)."""
        return self.runner.blocks.pool

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        on_output: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[tuple[list[int], RequestStats, str | None]]:
        """Run prompts to completion (tests, benchmarks, data generation); `on_output(i, out)` sees
        every step's output for prompt i (e.g. the features captured for training data)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}" for i in range(len(prompts))]
        index = {rid: i for i, rid in enumerate(ids)}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        results: dict[str, tuple[list[int], RequestStats, str | None]] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if on_output is not None:
                    on_output(index[out.request_id], out)
                if out.finished:
                    if out.finish_reason == "error":
                        raise RuntimeError(out.error)
                    results[out.request_id] = (tokens[out.request_id], out.stats, out.finish_reason)
        return [results[rid] for rid in ids]

    # -- internals ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        counted = KV_READS.bytes
        self.last_prefill_tokens = 0
        try:
            return self._step()
        finally:
            self.kv_bytes_read += KV_READS.bytes - counted

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._drop_aborted(outputs)
        if self.token_budget is not None:
            return self._chunked_step(outputs)
        new = self.scheduler.admit(self.rows)
        if new:
            states = [row.generator.bit_generator.state for row in new]
            running = len(self.rows)
            try:
                outputs.extend(self._prefill(new))
            except Exception:  # noqa: BLE001 - retry one by one so a bad request fails alone
                del self.rows[running:]
                for row, state in zip(new, states):
                    row.generator.bit_generator.state = state  # the retry draws the same random numbers
                for row in new:
                    running = len(self.rows)
                    try:
                        outputs.extend(self._prefill([row]))
                    except Exception as exc:  # noqa: BLE001
                        del self.rows[running:]
                        self.scheduler.release(row)
                        outputs.append(self._error_output(row, exc))
        elif self.rows:
            self._decode_running(outputs)
        return outputs

    def _chunked_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Chunked prefill: admit into the prefilling rows, decode the decoding rows, then spend
        what is left of the token budget on prompt chunks, oldest request first. On the dynamic
        path the chunks ride in the decode's verify forward (one pass through the weights a step);
        with static shapes, or when that fold fails, they go in a prefill of their own after it."""
        new = self.scheduler.admit([*self.rows, *self.prefilling])
        if new:
            self.policy.on_admit()
            for row in new:  # its slot holds its blocks and shared positions from now on
                self.runner.seat(row, len(self.rows) + len(self.prefilling))
                self.prefilling.append(row)
        decoded: tuple[int, int] | None = None  # the decode's rows x tokens, if any
        self.last_timing = None  # this step's: the decode's, else the prefill's
        self._folded = None
        start = time.perf_counter()
        if self.rows:
            decoded = (len(self.rows), self.max_drafts_per_step + 1)  # a bound, if the step fails
            fold = self.prefilling and self.static is None and self.config.fold_chunks
            self._decode_running(outputs, self._fold_chunks if fold else None)
            if self.last_timing is not None and self.last_timing.kind == "decode":
                decoded = (self.last_timing.batch_size, self.last_timing.num_drafts + 1)
        folded, self._folded = self._folded, None
        if folded is not None:
            chunks, result = folded
            outputs.extend(self._after_chunks(chunks.taken, result, chunks.t0))
            if chunks.planned_seconds > 0:
                self.recent_chunk_overruns.append((time.perf_counter() - start) / chunks.planned_seconds)
        elif self.prefilling:
            # A step with no decoding rows has no stream to stall: its prompts go in whole.
            outputs.extend(self._prefill_chunks(decoded))
        elif decoded is not None:
            self.recent_decode_seconds.append(time.perf_counter() - start)
        return outputs

    @property
    def _least_chunk(self) -> int:
        """The prompt tokens a step forwards however much it decodes, so that a prompt never starves."""
        assert self.token_budget is not None
        return max(1, self.token_budget // 4)

    def _chunk_budget(self, rows: int, width: int) -> float:
        """Prompt tokens a step that decodes `rows` x `width` tokens may forward: what is left of
        the budget, and at least a quarter of it, so that a prompt never starves behind decoding.
        With the budget measured ("auto"), also no more than the chunk the cost model
        (model/engine/cost_probe.py) fits in what this step's decode leaves of (1 + STEP_STALL) x
        the streams' usual step, so the streams' gap grows alike with 1 row decoding or 16."""
        least = self._least_chunk
        left = self._budget_left(rows, width)
        if self.chunk_probe is not None:
            # The whole step within (1 + STEP_STALL) x the streams' usual gap (the median of recent
            # decode steps without chunks: what a stall is measured against): a wide drafting step,
            # dearer than usual, leaves its chunk less room; steps that ran over their plan, less.
            step_s = self.policy.costs.verify(rows, width)
            usual = statistics.median(self.recent_decode_seconds) if self.recent_decode_seconds else step_s
            chunk_s = (1 + STEP_STALL) * usual / self.chunk_overrun - step_s
            left = min(left, max(least, self.chunk_probe.tokens_in(max(0.0, chunk_s))))
        return left

    def _budget_left(self, rows: int, width: int) -> int:
        """What a decode of `rows` x `width` tokens leaves of the token budget (at least a quarter)."""
        assert self.token_budget is not None
        return max(self.token_budget - rows * width, self._least_chunk)

    @property
    def chunk_overrun(self) -> float:
        """How much longer than their forward as planned the recent steps carrying chunks took
        (median; 1 before any, held within [0.5, 2] so one odd step cannot stop or flood chunking)."""
        if not self.recent_chunk_overruns:
            return 1.0
        return min(2.0, max(0.5, statistics.median(self.recent_chunk_overruns)))

    def _take_chunks(self, decoded: tuple[int, int] | None) -> list[tuple[Row, int]]:
        """The prefilling rows' next chunks beside a decode of `decoded` rows x tokens, within
        `_chunk_budget` (None, a step without decoding rows: the rest of every prompt), oldest
        first: a row gets tokens only once every older one is done, so all but the last row taken
        finish. With the budget measured ("auto"), a token counts what it costs after the positions
        before it (`ChunkProbe.cost`), so that chunks late in a long prompt are shorter. A prompt
        not begun whose tokens fit in what decoding left of the token budget (`_budget_left`) goes
        whole: the budget was sized for such a step (CHUNK_STALL), and cutting a short prompt only
        delays its first token (served at concurrency 16: 0.89x the unchunked throughput); the clock
        (`_chunk_budget`) holds the long prompts, whose late chunks cost more. A prompt scored for its
        logprobs is taken whole and alone (padding beside other rows would move its scores in the
        last bits)."""
        taken: list[tuple[Row, int]] = []
        probe = self.chunk_probe if self.chunk_probe is not None and self.chunk_probe.growth > 0 else None
        left: float = self._chunk_budget(*decoded) if decoded is not None else math.inf
        whole_within: float = self._budget_left(*decoded) if decoded is not None else 0.0
        for row in self.prefilling:
            if left <= 0:
                break
            remaining = cached_tokens(row) - row.prefilled
            scored = scores_prompt(row)
            if scored and taken:
                break  # next step, alone
            if scored or left == math.inf:
                n = remaining
            elif row.prefilled == row.shared_tokens and remaining <= whole_within:
                n = remaining  # a short prompt, whole
            elif probe is not None:  # late in a long prompt a token costs more (its attention)
                n = min(remaining, probe.tokens_within(left, row.prefilled))
            else:
                n = min(remaining, int(left))
            taken.append((row, n))
            left -= probe.cost(n, row.prefilled) if probe is not None else n
            whole_within -= n
            if scored:
                break
        return taken

    def _fold_chunks(self, rows: int, width: int) -> FoldedChunks | None:
        """The chunks a decode step of `rows` x `width` tokens carries in its verify forward, planned
        (model/engine/prefill.py: `Prefiller.plan`); None when they must go alone (a scored prompt)."""
        taken = self._take_chunks((rows, width))
        if not taken or any(scores_prompt(row) for row, _ in taken):
            return None
        plan = [row for row, _ in taken]
        batch = self.runner.prefiller.plan(plan, len(self.rows), chunk=[n for _, n in taken])
        chunks = FoldedChunks(taken, batch, [row.generator.bit_generator.state for row in plan])
        probe = self.chunk_probe
        if probe is not None and probe.seconds_of(1) > 0:
            chunk_s = probe.seconds_of(sum(probe.cost(n, row.prefilled) for row, n in taken))
            chunks.planned_seconds = self.policy.costs.verify(rows, width) + chunk_s
        return chunks

    def _pick_folded(self, chunks: FoldedChunks) -> bool:
        """The folded chunks' first tokens chosen on the device, from their part of the verify
        forward; False if that fails (the rows are seated again, their draws undone)."""
        try:
            chunks.first = self.runner.prefiller.pick_first(chunks.batch, chunks.outputs)
        except Exception:  # noqa: BLE001 - the chunks are retried alone, after the decode
            self._undo_folded(chunks)
            return False
        return True

    def _finish_folded(self, chunks: FoldedChunks, first_tokens: list[int]) -> None:
        """The folded chunks' prefill completed with their first tokens (read with the step's
        results), before the decode rows' caches move; if that fails, the chunks go in a prefill of
        their own after the decode (`_chunked_step`)."""
        try:
            result = self.runner.prefiller.finish(chunks.batch, chunks.outputs, first_tokens=first_tokens)
        except Exception:  # noqa: BLE001 - the chunks are retried alone, after the decode
            self._undo_folded(chunks)
            return
        self._folded = (chunks, result)

    def _undo_folded(self, chunks: FoldedChunks) -> None:
        for (row, _), state in zip(chunks.taken, chunks.states):
            row.generator.bit_generator.state = state
        self._reseat_prefilling()

    def _reseat_prefilling(self) -> None:
        """Each prefilling row back in its slot after the decoding rows, with its length."""
        for j, row in enumerate(self.prefilling):
            self.runner.seat(row, len(self.rows) + j)

    def _prefill_chunks(self, decoded: tuple[int, int] | None) -> list[RequestOutput]:
        """Forward the prefilling rows' next chunks beside a decode of `decoded` rows x tokens (None:
        all of every prompt; `_take_chunks`) in one prefill (forwards grouped as
        `prefill_split_tokens` says, like whole prompts); the rows whose prompt is in join the
        decoding rows in the slots they hold. If the prefill fails, each row's chunk is retried
        alone, so a bad one fails alone."""
        taken = self._take_chunks(decoded)
        t0 = time.perf_counter()
        rows = [row for row, _ in taken]
        states = [row.generator.bit_generator.state for row in rows]
        try:
            result = self.runner.prefiller.run(rows, len(self.rows), chunk=[n for _, n in taken])
        except Exception:  # noqa: BLE001 - retried row by row below
            for row, state in zip(rows, states):
                row.generator.bit_generator.state = state  # the retry draws the same random numbers
            self._reseat_prefilling()  # the failed prefill placed them in its order
            return self._prefill_chunks_alone(taken, t0)
        return self._after_chunks(taken, result, t0)

    def _after_chunks(self, taken: list[tuple[Row, int]], result: PrefillResult, t0: float) -> list[RequestOutput]:
        """The chunks of `taken` are in: the rows whose prompt is done join the decoding rows."""
        rows = [row for row, _ in taken]
        self.num_prefill_chunks += len(taken)
        self.last_prefill_tokens += sum(n for _, n in taken)
        # The prefill sorted its rows by chunk length: the finished ones take the first slots (they
        # join the decoding rows), the unfinished one (the last taken, if any) the next.
        done = {id(row) for row in rows if row.prefilled == cached_tokens(row)}
        finished = [row for row in rows if id(row) in done]
        for j, row in enumerate([*finished, *(row for row in rows if id(row) not in done)]):
            self.runner.seat(row, len(self.rows) + j)
        self.prefilling = [row for row in self.prefilling if id(row) not in done]
        return self._join_decoding(finished, result, t0)

    def _prefill_chunks_alone(self, taken: list[tuple[Row, int]], t0: float) -> list[RequestOutput]:
        """The chunks of `taken` forwarded one row at a time; a chunk that fails fails its request."""
        outputs: list[RequestOutput] = []
        for row, n in taken:
            if not self.prefilling or self.prefilling[0] is not row:
                break  # an older row failed and left, or is not done: this one waits
            state = row.generator.bit_generator.state
            try:
                result = self.runner.prefiller.run([row], len(self.rows), chunk=[n])
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                row.generator.bit_generator.state = state
                self._remove_prefilling(0)
                outputs.append(self._error_output(row, exc))
                continue
            self.num_prefill_chunks += 1
            self.last_prefill_tokens += n
            if row.prefilled < cached_tokens(row):
                break
            self.prefilling.pop(0)
            outputs.extend(self._join_decoding([row], result, t0))
        return outputs

    def _join_decoding(self, finished: list[Row], result: PrefillResult, t0: float) -> list[RequestOutput]:
        """Rows whose prompt is in (all in `result`), already in the slots after the decoding rows:
        they decode from now on, with the first token their prefill chose."""
        base = len(self.rows)
        self.rows.extend(finished)
        outputs, done = [], []
        for j, row in enumerate(finished):
            output = self._first_output(row, result, result.rows.index(row))
            if output is not None:
                outputs.append(output)
                if output.finished:
                    done.append(base + j)
        self._remove_rows(done)
        if self.last_timing is None or self.last_timing.kind != "decode":  # a decode this step keeps its timing
            self.last_timing = StepTiming("prefill", len(finished), 0.0, time.perf_counter() - t0)
        return outputs

    def _remove_prefilling(self, k: int) -> None:
        """Prefilling row k leaves: its blocks go back, the rows after it move down a slot."""
        self.scheduler.release(self.prefilling.pop(k))
        base = len(self.rows)
        for j in range(k, len(self.prefilling)):
            self.runner.move_row(base + j + 1, base + j)

    def _decode_running(
        self, outputs: list[RequestOutput], fold: Callable[[int, int], FoldedChunks | None] | None = None
    ) -> None:
        """One decode step of every decoding row: first the blocks each grows into (preempting the
        newest when they run out), then the step, retried row by row if it fails (without `fold`:
        prompt chunks to carry in the verify forward, given the decode's tokens)."""
        if self.rows:
            preempted = self.scheduler.preempt_for_step(self.rows)  # back in the queue, to be recomputed
            self._remove_rows([self.rows.index(row) for row in preempted])
            self.num_preemptions += len(preempted)
        if self.rows:
            self.runner.vacate(len(self.rows) + len(self.prefilling))
            states = [row.generator.bit_generator.state for row in self.rows]
            try:
                self.runner.place(self.rows)  # the blocks each row grew into
                outputs.extend(self._decode(fold=fold))
            except Exception:  # noqa: BLE001 - retry row by row; caches only advance on success
                for row, state in zip(self.rows, states):
                    row.generator.bit_generator.state = state  # the retry draws the same random numbers
                for i in range(len(self.rows)):
                    try:
                        self.runner.place(self.rows[i : i + 1], i)
                        outputs.extend(self._decode(i, i + 1, finalize=False))
                    except Exception as exc:  # noqa: BLE001
                        outputs.append(self._error_output(self.rows[i], exc))
                finished = {o.request_id for o in outputs if o.finished}
                self._remove_rows([i for i, r in enumerate(self.rows) if r.request_id in finished])

    def _error_output(self, row: Row, exc: Exception) -> RequestOutput:
        return RequestOutput(row.request_id, [], True, "error", row.stats, error=f"{type(exc).__name__}: {exc}")

    def _drop_aborted(self, outputs: list[RequestOutput]) -> None:
        for row in self.scheduler.drop_aborted():
            outputs.append(RequestOutput(row.request_id, [], True, "abort", row.stats))
        gone = [i for i, r in enumerate(self.rows) if r.aborted]
        for i in gone:
            row = self.rows[i]
            outputs.append(RequestOutput(row.request_id, [], True, "abort", row.stats))
        self._remove_rows(gone)
        for k in reversed([k for k, r in enumerate(self.prefilling) if r.aborted]):
            outputs.append(RequestOutput(self.prefilling[k].request_id, [], True, "abort", self.prefilling[k].stats))
            self._remove_prefilling(k)

    def _remove_rows(self, indices: list[int]) -> None:
        """Free slots by moving the last row into each hole (one row copy per departure)."""
        for i in sorted(set(indices), reverse=True):
            self.scheduler.release(self.rows[i])
            last = len(self.rows) - 1
            if i != last:
                self.runner.move_row(last, i)
                self.rows[i] = self.rows[last]
            self.rows.pop()
            for j in range(len(self.prefilling)):  # the prefilling rows follow the decoding ones
                self.runner.move_row(last + 1 + j, last + j)

    def _prefill(self, new: list[Row]) -> list[RequestOutput]:
        """Admit rows into the slots after the running ones (model/engine/prefill.py) and commit
        each new one's first token (a preempted row resumes with the token it had)."""
        self.policy.on_admit()
        t0 = time.perf_counter()
        lo = len(self.rows)
        before = sum(row.prefilled for row in new)
        result = self.runner.prefiller.run(new, lo)
        self.last_prefill_tokens += sum(row.prefilled for row in new) - before
        self.rows.extend(result.rows)
        outputs, done = [], []
        for i, row in enumerate(result.rows):
            output = self._first_output(row, result, i)
            if output is not None:
                outputs.append(output)
                if output.finished:
                    done.append(lo + i)
        self.last_timing = StepTiming("prefill", len(new), 0.0, time.perf_counter() - t0)
        self._remove_rows(done)
        return outputs

    def _first_output(self, row: Row, result: PrefillResult, i: int) -> RequestOutput | None:
        """Commit the first token a prefill chose for row `result.rows[i]`; None for a preempted row
        recomputed (it goes on from its anchor)."""
        tok = result.first_tokens[i]
        if tok is None:
            return None
        if row.params.max_new_tokens == 0:  # scoring only: nothing is generated
            output = RequestOutput(row.request_id, [], True, "length", row.stats)
        else:
            output = commit(row, [tok], result.logprobs[i])
        output.prompt_logprobs, output.features = result.prompt_logprobs[i], result.features[i]
        row.anchor = tok
        return output

    @torch.inference_mode()
    def _decode(
        self,
        lo: int = 0,
        hi: int | None = None,
        finalize: bool = True,
        fold: Callable[[int, int], FoldedChunks | None] | None = None,
    ) -> list[RequestOutput]:
        """One speculative step for rows lo..hi-1: choose -> draft -> verify -> accept -> emit.
        `fold(rows, width)`: prompt chunks planned for the verify forward to carry (chunked prefill)."""
        step = self._begin_step(lo, len(self.rows) if hi is None else hi)
        timer = PhaseTimer(self.device)
        self._choose(step)
        chosen = step.load(self.device, choice_arrays(step))  # the step's one copy to the device
        self._draft(step, timer)
        step.drafts = assemble_drafts(step, chosen)
        r, k = step.drafts.tokens.shape
        chunks = fold(r, k + 1) if fold is not None else None
        carried = chunks is not None
        out = self._verify(step, timer, chunks)
        if chunks is not None and not self._pick_folded(chunks):
            chunks = None  # they go in a prefill of their own after the decode
        self._accept(step, out, chunks)
        # The results are on the host: the phases' marks are complete (model/engine/timing.py).
        draft_s = timer.seconds("draft") if step.draft is not None else 0.0
        verify_s = timer.seconds("verify")
        if step.draft is not None:
            a, b = step.draft_span
            self.policy.costs.observe_draft(b - a, draft_s)
        if not carried:  # a forward that carried prompt chunks says nothing of a verify's cost
            self.policy.costs.observe_verify(r, k + 1, verify_s)
        self.policy.observe(step)
        self.last_timing = StepTiming("decode", r, draft_s, verify_s, k)
        outputs, done = self._emit(step, out)
        if finalize:
            self._remove_rows(done)
        return outputs

    def _begin_step(self, lo: int, hi: int) -> DecodeStep:
        """The policy's plan for rows lo..hi-1 and the step's random draws."""
        rows = self.rows[lo:hi]
        # A seeded request must choose the same alone or in a batch: never pause drafting under it,
        # and always draft (and draw uniforms for) the full block.
        seeded = any(row.params.seeded for row in rows)
        plan = self.policy.plan([row.params.greedy for row in rows], seeded)
        ngram_width = self.ngram_max_drafts if self.ngram and not plan.probe else 0
        return DecodeStep.begin(lo, hi, rows, plan, ngram_width)

    def _choose(self, step: DecodeStep) -> None:
        """Each row's n-gram copy, the rows the drafter will draft, and how many drafts each row
        verifies and whose: the policy's choice, from the host alone (model/engine/policy.py)."""
        step.copies = self.ngram_proposer.propose(step.rows, step.budgets, step.ngram_width)
        step.copy_accept = self.policy.copy_estimates(step.rows, step.copies, step.ngram_width)
        span = self.policy.drafter_rows(step) if self.proposer is not None else None
        step.draft_span = span if span is not None else (0, 0)
        step.choice = self.policy.choose(step)

    def _draft(self, step: DecodeStep, timer: PhaseTimer) -> None:
        """The drafter's block for the rows the policy lets it draft (step.draft_span), timed as
        the phase "draft"."""
        a, b = step.draft_span
        if b == a or self.proposer is None:
            return
        lo, rows, anchors, sampling, d = step.lo, step.rows, step.anchors, step.sampling, step.drafter_slots
        with timer.phase("draft"):
            if self.static is not None and lo == 0:
                # Static shapes: a full block for every row (padding rows cost nothing on a GPU);
                # sampling rows' uniforms cover the d slots kept.
                slots = self.num_drafts if sampling.all_greedy else d
                draft = self.proposer.propose(lo, rows, anchors, sampling, slots).select(a, b, d)
            else:
                rows_ab = sampling.span(a, b)
                draft = self.proposer.propose(lo + a, rows[a:b], anchors[a:b], rows_ab, d)
        if draft.confidence is None:
            raise ValueError("the drafter's proposal has no confidence per slot: the policy needs it")
        step.draft = draft
        self.draft_forwards += 1

    def _verify(self, step: DecodeStep, timer: PhaseTimer, chunks: FoldedChunks | None = None) -> TargetOutput:
        """One target forward over [anchor, drafts] per row, timed as the phase "verify"; with
        `chunks`, their prefill groups go through the same forward (their outputs kept in `chunks`)."""
        assert step.drafts is not None
        tokens = torch.cat([step.anchors[:, None], step.drafts.tokens], dim=1)
        with timer.phase("verify"):
            if chunks is None:
                return self.runner.verify(step.lo, tokens)
            chunks.t0 = time.perf_counter()
            out, *chunks.outputs = self.runner.verify_packed(step.lo, tokens, chunks.batch.row_groups())
            return out

    def _accept(self, step: DecodeStep, out: TargetOutput, chunks: FoldedChunks | None = None) -> None:
        """The rejection sampler over the rows' processed scores; its results on the host (one
        device->host copy, with the first tokens of folded chunks that finish a prompt) and the
        caches advanced by them, the folded chunks' first."""
        assert step.drafts is not None
        scores = process_logits([row.processor for row in step.rows], out.logits, step.drafts.tokens)
        step.accepted, step.bonus = accepted, bonus = accept(scores, step, self.runner.draft_vocab_ids)
        confidence = step.draft.confidence if step.draft is not None else None
        first = chunks.first if chunks is not None else None
        step.results = results = StepResults.read(
            accepted, bonus, step.drafts.counts, step.drafts.tokens, confidence, first
        )
        results.logprobs = [
            token_logprobs(out.logits[i], results.new_tokens[i], row.params.logprobs)
            if row.params.logprobs is not None
            else None
            for i, row in enumerate(step.rows)
        ]
        if chunks is not None:
            self._finish_folded(chunks, results.extra)
        self.runner.advance(step.lo, step.hi, out, accepted, results.accepted)

    def _emit(self, step: DecodeStep, out: TargetOutput) -> tuple[list[RequestOutput], list[int]]:
        """Commit each row's tokens and record the step in its statistics; (outputs, slots of finished rows)."""
        choice, results = step.choice, step.results
        assert choice is not None and results is not None
        outputs, done = [], []
        for i, row in enumerate(step.rows):
            accepted, drafted = results.accepted[i], results.counts[i]
            proposer = None if drafted == 0 else ("ngram" if choice.use_ngram[i] else "drafter")
            output = commit(row, results.new_tokens[i], results.logprobs[i])
            row.anchor = results.bonus[i]
            row.stats.record_verify(proposer, drafted, accepted)
            output.step_draft_tokens, output.step_accepted = drafted, list(range(accepted))
            output.is_verify_step, output.step_proposer = True, proposer
            outputs.append(output)
            if self.runner.capture:
                assert out.features is not None
                output.features = out.features[i, : accepted + 1].to(torch.float16).cpu()
            if output.finished:
                done.append(step.lo + i)
        return outputs, done
