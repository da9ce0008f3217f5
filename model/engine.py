"""Continuous-batching speculative decoding engine (docs/design.md §1.4, §3).

One `Engine` owns a target, an optional drafter and their per-row caches. `step()` either admits
waiting requests (one batched prefill) or advances every running row by one speculative step:
draft a block per row, verify all rows in one target forward, commit a different number of tokens
per row and roll the rest back by not advancing that row's cache length.

Modes: `domino` (Domino head on), `dflash` (head off: base logits only), `ngram` (only prompt-lookup
copies from each row's own context, no drafter), `ar` (no drafts: plain batched autoregressive
decoding through the same code path). In `domino`/`dflash` the n-gram copies are on by default too:
per row and step the policy verifies whichever proposal it expects to pay more (or none).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from model.drafter import DraftContextCache, Drafter, DraftResult
from model.logits_processors import RowProcessor, new_row_processor, process_logits
from model.ngram import NgramIndex
from model.policy import (
    NGRAM_PRIOR,
    AcceptanceCalibration,
    NgramAcceptance,
    StepCosts,
    best_shared_width,
    capped_gain,
    expected_accepted,
    prior_rate,
    stopping_drafts,
)
from model.sampling import (
    SamplingBatch,
    processed_probs,
    sample_with_uniform,
    verify_greedy,
    verify_sampling,
)
from model.target import TargetModel

MODES = ("domino", "dflash", "ngram", "ar")
PROPOSERS = ("drafter", "ngram")
MAX_LOGPROBS = 20


class ContextLengthError(ValueError):
    """prompt + max_new_tokens does not fit the engine's max_model_len."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many top alternatives per token (None: no logprobs)
    # Logits processors (model/logits_processors.py), applied to the target at every verify position.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # stop tokens are held back until this many tokens were generated
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that must not be generated
    grammar: Any = None  # model.grammar.Grammar: its matcher masks the target; None: free text

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


@dataclass
class RequestStats:
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify step: accepted + 1
    accepted_per_position: list[int] = field(default_factory=list)  # per draft slot
    # The same counts split by who proposed the drafts: "drafter" or "ngram".
    draft_tokens_by_proposer: dict[str, int] = field(default_factory=dict)
    accepted_tokens_by_proposer: dict[str, int] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None
    stop_token_id: int | None = None  # the stop/EOS token that ended the request, if any
    error: str | None = None
    step_draft_tokens: int = 0  # drafts verified for this request in this step
    step_accepted: list[int] = field(default_factory=list)  # accepted draft slots in this step
    is_verify_step: bool = False
    step_proposer: str | None = None  # "drafter" | "ngram" | None (no drafts verified this step)
    # With capture_taps: target features [n, K*H] of the inputs committed this step (the prompt at
    # prefill, then anchor + accepted drafts), i.e. of every position but the last token.
    features: torch.Tensor | None = None


@dataclass
class StepTiming:
    kind: str  # "prefill" | "decode"
    batch_size: int
    draft_seconds: float
    verify_seconds: float
    num_drafts: int = 0  # drafts per row in the verify forward (max over rows)


@dataclass
class _Row:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    anchor: int = -1
    stats: RequestStats = field(default_factory=RequestStats)
    aborted: bool = False
    ngram: NgramIndex | None = None  # prompt + output, indexed for prompt lookup
    ngram_acceptance: NgramAcceptance | None = None  # this row's own record of its copies
    processor: RowProcessor | None = None  # logits processors and their state (None: plain sampling)


@dataclass
class _NgramPlan:
    tokens: list[int]  # the copy proposed
    match_len: int
    accept: torch.Tensor  # [len(tokens)] estimated acceptance of each slot once reached


PAUSE_MIN, PAUSE_MAX = 8, 64  # steps of plain decoding after drafting stopped paying
# Per decode step, the engine-wide record of n-gram acceptance ages by this factor (half-life
# ~350 steps without copies), so a match length written off on old text is tried again.
NGRAM_FADE = 0.998


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        mode: str = "domino",
        max_batch_size: int = 8,
        max_model_len: int = 2048,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        draft_threshold: float = 0.0,
        max_drafts: int | None = None,
        draft_policy: str = "adaptive",
        capture_taps: list[int] | None = None,
        ngram: bool = True,
        ngram_max_n: int = 4,
        ngram_min_n: int = 1,
        ngram_max_drafts: int = 8,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode not in ("ar", "ngram") and drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter")
        if mode == "domino" and drafter is not None and not drafter.config.has_head:
            raise ValueError("mode 'domino' needs a Domino drafter (projector_type 'domino'); use 'dflash'")
        self.target = target
        self.mode = mode
        self.drafter = drafter if mode not in ("ar", "ngram") else None
        # Prompt-lookup copies: the only proposals in `ngram` mode, an extra choice in domino/dflash.
        self.ngram = mode == "ngram" or (ngram and mode != "ar")
        self.ngram_max_n, self.ngram_min_n = ngram_max_n, ngram_min_n
        self.ngram_max_drafts = ngram_max_drafts if max_drafts is None else min(ngram_max_drafts, max_drafts)
        if self.ngram and self.ngram_max_drafts < 1:
            raise ValueError(f"ngram_max_drafts must be >= 1, got {self.ngram_max_drafts}")
        # Observed acceptance of greedy rows' copies, by match length and slot (engine-wide).
        self.ngram_acceptance = NgramAcceptance(ngram_max_n, max(self.ngram_max_drafts, 1))
        self.ngram_prior = NGRAM_PRIOR  # acceptance assumed before any copy was verified
        self._drafter_gain: float | None = None  # recent expected accepted drafts per drafted row
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.draft_threshold = draft_threshold
        if draft_policy not in ("adaptive", "fixed"):
            raise ValueError(f"draft_policy must be 'adaptive' or 'fixed', got {draft_policy!r}")
        # adaptive: drafts per step from the drafter's confidence and measured step costs
        # (model/policy.py); fixed: every draft up to the first below draft_threshold.
        self.draft_policy = draft_policy
        self.costs = StepCosts()
        self.calibration = AcceptanceCalibration()
        self._skip_drafting = 0  # steps left to decode without drafting, after drafting stopped paying
        self._no_gain_streak = 0
        self._pause_len = PAUSE_MIN  # doubles while probes keep finding that drafting does not pay
        self._draft_width = 0  # slots drafted per step under the adaptive policy (set below)
        self.draft_forwards = 0  # steps that ran the drafter
        self.device = target.device
        block = 1
        if self.drafter is not None:
            cfg = self.drafter.config
            target.set_taps(cfg.target_layer_ids)
            self.drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
            self.drafter.use_head = mode == "domino"
            block = cfg.block_size
            self.num_drafts = cfg.num_drafts if max_drafts is None else min(max_drafts, cfg.num_drafts)
            self._draft_width = self.num_drafts
            self.mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else 0
        else:
            # Training data generation records the target's features without a drafter.
            target.set_taps(capture_taps or [])
            self.num_drafts = 0
        self.capture = bool(capture_taps)
        self.want_features = self.drafter is not None or self.capture
        # Room for a full block of scratch keys behind the longest allowed context.
        capacity = max_model_len + block + 1
        self.cache = target.new_cache(max_batch_size, capacity)
        self.draft_cache = (
            DraftContextCache(self.drafter.config, max_batch_size, capacity, target.dtype, self.device)
            if self.drafter is not None
            else None
        )
        self.rows: list[_Row] = []  # row i lives in cache slot i
        self.waiting: deque[_Row] = deque()
        self._seed_source = torch.Generator().manual_seed(torch.seed() % (2**63))
        self.last_timing: StepTiming | None = None

    # -- public API ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.target.vocab_size})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the maximum context length of {self.max_model_len} tokens"
            )
        seed = (
            params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        row = _Row(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            generator=torch.Generator().manual_seed(seed),
            stop_ids=frozenset(stop_ids),
        )
        row.processor = new_row_processor(params, row.prompt_ids, row.stop_ids, self.target.vocab_size, self.device)
        if self.ngram:
            row.ngram = NgramIndex(self.ngram_max_n, self.ngram_min_n)
            row.ngram_acceptance = NgramAcceptance(self.ngram_max_n, self.ngram_max_drafts)
        row.stats.accepted_per_position = [0] * self.max_drafts_per_step
        self.waiting.append(row)

    def abort(self, request_id: str) -> None:
        """Cancel a request; it leaves the batch at the start of the next step."""
        for row in list(self.waiting) + self.rows:
            if row.request_id == request_id:
                row.aborted = True

    def has_unfinished(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def max_drafts_per_step(self) -> int:
        """The most drafts one row may verify in a step, from either proposer."""
        return max(self.num_drafts, self.ngram_max_drafts if self.ngram else 0)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

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
        outputs: list[RequestOutput] = []
        self._drop_aborted(outputs)
        if self.waiting and len(self.rows) < self.max_batch_size:
            free = self.max_batch_size - len(self.rows)
            new = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            states = [row.generator.get_state() for row in new]
            try:
                outputs.extend(self._prefill(new))
            except Exception:  # noqa: BLE001 - retry one by one so a bad request fails alone
                del self.rows[len(self.rows) - len(new) :]
                for row, state in zip(new, states):
                    row.generator.set_state(state)  # the retry draws the same random numbers
                for row in new:
                    try:
                        outputs.extend(self._prefill([row]))
                    except Exception as exc:  # noqa: BLE001
                        if self.rows and self.rows[-1] is row:
                            self.rows.pop()
                        outputs.append(self._error_output(row, exc))
        elif self.rows:
            states = [row.generator.get_state() for row in self.rows]
            try:
                outputs.extend(self._decode())
            except Exception:  # noqa: BLE001 - retry row by row; caches only advance on success
                for row, state in zip(self.rows, states):
                    row.generator.set_state(state)  # the retry draws the same random numbers
                failed = []
                for i in range(len(self.rows)):
                    try:
                        outputs.extend(self._decode(i, i + 1, finalize=False))
                    except Exception as exc:  # noqa: BLE001
                        failed.append(i)
                        outputs.append(self._error_output(self.rows[i], exc))
                finished = {o.request_id for o in outputs if o.finished}
                self._remove_rows([i for i, r in enumerate(self.rows) if r.request_id in finished])
        return outputs

    def _error_output(self, row: _Row, exc: Exception) -> RequestOutput:
        return RequestOutput(row.request_id, [], True, "error", row.stats, error=f"{type(exc).__name__}: {exc}")

    def _drop_aborted(self, outputs: list[RequestOutput]) -> None:
        for row in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(row)
            outputs.append(RequestOutput(row.request_id, [], True, "abort", row.stats))
        gone = [i for i, r in enumerate(self.rows) if r.aborted]
        for i in gone:
            row = self.rows[i]
            outputs.append(RequestOutput(row.request_id, [], True, "abort", row.stats))
        self._remove_rows(gone)

    def _remove_rows(self, indices: list[int]) -> None:
        """Free slots by moving the last row into each hole (one row copy per departure)."""
        for i in sorted(set(indices), reverse=True):
            last = len(self.rows) - 1
            if i != last:
                self.cache.move_row(last, i)
                if self.draft_cache is not None:
                    self.draft_cache.move_row(last, i)
                self.rows[i] = self.rows[last]
            self.rows.pop()

    def _sampling_batch(self, rows: list[_Row], uniforms: torch.Tensor | None) -> SamplingBatch:
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=dev),
            top_p=torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=dev),
            top_k=torch.tensor([r.params.top_k for r in rows], dtype=torch.long, device=dev),
            uniforms=uniforms,
        )

    def _draw_uniforms(self, rows: list[_Row], count: int) -> torch.Tensor:
        """`count` uniforms per sampling row from that row's own generator (a fixed number per step).

        Greedy rows get zeros and never touch their generators: no per-row work in greedy batches."""
        sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
        if not sampled:
            return torch.zeros(len(rows), count, device=self.device)
        u = torch.zeros(len(rows), count)
        u[sampled] = torch.stack([torch.rand(count, generator=rows[i].generator) for i in sampled])
        return u.to(self.device)

    def _sample_target(self, logits: torch.Tensor, sampling: SamplingBatch, u: torch.Tensor) -> torch.Tensor:
        """One token per row from target logits [R, V] (greedy rows: argmax)."""
        ids = logits.argmax(-1)
        if sampling.all_greedy:
            return ids
        temperature = torch.where(sampling.greedy, torch.ones_like(sampling.temperature), sampling.temperature)
        probs = processed_probs(logits, temperature, sampling.top_k, sampling.top_p)
        return torch.where(sampling.greedy, ids, sample_with_uniform(probs, u))

    def _logprobs(self, logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
        """Target log-probabilities (raw logits, before temperature) of committed tokens.

        logits [n, V] are the target's logits at the positions that produced token_ids."""
        lp = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)
        chosen = lp.gather(-1, torch.tensor(token_ids, device=lp.device)[:, None]).squeeze(-1).tolist()
        out = []
        if top_n > 0:
            top_v, top_i = lp.topk(top_n, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in token_ids]
        for tok, val, top in zip(token_ids, chosen, tops):
            out.append(TokenLogprob(tok, val, top))
        return out

    def _commit(self, row: _Row, tokens: list[int]) -> tuple[list[int], str | None, int | None]:
        """Append tokens to a row, stopping exactly at a stop token or the token budget."""
        emitted: list[int] = []
        for tok in tokens:
            row.output_ids.append(tok)
            emitted.append(tok)
            if tok in row.stop_ids:
                return emitted, "stop", tok
            if len(row.output_ids) >= row.params.max_new_tokens:
                return emitted, "length", None
        return emitted, None, None

    @torch.inference_mode()
    def _prefill(self, new: list[_Row]) -> list[RequestOutput]:
        """Admit rows: one batched prompt forward, first token sampled from its last position."""
        # New text may suit the drafter better: probe again soon.
        self._pause_len = PAUSE_MIN
        self._skip_drafting = min(self._skip_drafting, PAUSE_MIN)
        lo = len(self.rows)
        self.rows.extend(new)
        t0 = time.perf_counter()
        lens = torch.tensor([len(r.prompt_ids) for r in new], device=self.device)
        tokens = torch.zeros(len(new), int(lens.max()), dtype=torch.long, device=self.device)
        for i, r in enumerate(new):
            tokens[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, device=self.device)
        self.cache.lengths[lo : lo + len(new)] = 0
        out = self.target.forward(self.cache, lo, tokens, logits_at=lens - 1, want_features=self.want_features)
        logits = out.logits[:, 0]
        sampling = self._sampling_batch(new, None)
        u = self._draw_uniforms(new, 1)[:, 0]
        scores = process_logits([r.processor for r in new], logits[:, None], None)[:, 0]
        first = self._sample_target(scores, sampling, u).tolist()
        logprobs = [
            self._logprobs(logits[i : i + 1], [tok], row.params.logprobs) if row.params.logprobs is not None else None
            for i, (row, tok) in enumerate(zip(new, first))
        ]
        # All work is done: now advance the caches.
        self.cache.lengths[lo : lo + len(new)] = lens
        if self.drafter is not None:
            assert self.draft_cache is not None and out.features is not None
            self.draft_cache.lengths[lo : lo + len(new)] = 0
            self.drafter.append_context(self.draft_cache, lo, out.features, lens)
        outputs, done = [], []
        for i, (row, tok) in enumerate(zip(new, first)):
            emitted, reason, stop_tok = self._commit(row, [tok])
            if row.processor is not None:
                row.processor.commit(emitted)
            row.anchor = tok
            outputs.append(
                RequestOutput(row.request_id, emitted, reason is not None, reason, row.stats, logprobs[i], stop_tok)
            )
            if self.capture:
                assert out.features is not None
                outputs[-1].features = out.features[i, : len(row.prompt_ids)].to(torch.float16).cpu()
            if reason is not None:
                done.append(lo + i)
        self.last_timing = StepTiming("prefill", len(new), 0.0, time.perf_counter() - t0)
        self._remove_rows(done)
        return outputs

    def _propose(
        self, lo: int, rows: list[_Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> DraftResult:
        """Draft the first `num_slots` slots of one block per row (slots lo..). Subclasses may
        propose differently (tests' oracle)."""
        assert self.drafter is not None and self.draft_cache is not None
        block = torch.full(
            (len(rows), self.drafter.config.block_size), self.mask_token_id, dtype=torch.long, device=self.device
        )
        block[:, 0] = anchors
        hidden = self.drafter.forward_block(self.draft_cache, lo, block)
        return self.drafter.draft(hidden, anchors, sampling, num_slots=num_slots)

    def _ngram_plan(self, rows: list[_Row], budgets: list[int], width: int) -> list[_NgramPlan | None]:
        """Each row's n-gram proposal (at most `width` tokens, within its budget) and its expected
        acceptance per slot: greedy rows shrink their own record towards the engine-wide one;
        sampling rows use their own record only, so a seeded row decides the same in any batch."""
        plans: list[_NgramPlan | None] = []
        for row, budget in zip(rows, budgets):
            index, record = row.ngram, row.ngram_acceptance
            if index is None or record is None or width == 0 or budget == 0:
                plans.append(None)
                continue
            # Catch the index up with what was committed since (prompt first, then the output).
            seen, plen = len(index), len(row.prompt_ids)
            if seen < plen:
                index.extend(row.prompt_ids[seen:])
                seen = plen
            index.extend(row.output_ids[seen - plen :])
            index_prop = index.propose(min(width, budget))
            if index_prop is None:
                plans.append(None)
                continue
            n, slots = index_prop.match_len, len(index_prop.tokens)
            if row.params.temperature > 0:
                est = record.estimate(n, slots, self.ngram_prior)
            else:
                est = record.estimate(n, slots, self.ngram_acceptance.estimate(n, slots, self.ngram_prior))
            plans.append(_NgramPlan(index_prop.tokens, n, est.float()))
        return plans

    def _drafter_span(self, r: int, d: int, any_seeded: bool, plans: list[_NgramPlan | None]) -> tuple[int, int] | None:
        """Rows lo+a..lo+b-1 that run the drafter this step (one contiguous span of slots), or None."""
        if self.drafter is None or d == 0:
            return None
        if any_seeded:
            # A seeded row's choice must not depend on the batch: draft every row, never pause.
            return 0, r
        if self._skip_drafting > 0:
            self._skip_drafting -= 1
            return None
        if self.draft_policy == "fixed" or self._drafter_gain is None:
            return 0, r
        # Rows whose n-gram match is expected to accept at least what the drafter lately did skip it.
        want = [
            i
            for i, plan in enumerate(plans)
            if plan is None or float(expected_accepted(plan.accept[None])[0, -1]) < self._drafter_gain
        ]
        return (min(want), max(want) + 1) if want else None

    @torch.inference_mode()
    def _decode(self, lo: int = 0, hi: int | None = None, finalize: bool = True) -> list[RequestOutput]:
        hi = len(self.rows) if hi is None else hi
        rows = self.rows[lo:hi]
        r = len(rows)
        dev = self.device
        # A seeded request must choose the same alone or in a batch: never pause drafting under it,
        # and always draft (and draw uniforms for) the full block.
        any_seeded = any(row.params.seed is not None and row.params.temperature > 0 for row in rows)
        full = any_seeded or self.draft_policy == "fixed"
        d = self.num_drafts if full else self._draft_width
        nw = self.ngram_max_drafts if self.ngram else 0
        width = max(d, nw)
        uniforms = self._draw_uniforms(rows, 2 * width + 1)  # draft slots, acceptance tests, final token
        sampling = self._sampling_batch(rows, uniforms[:, :d])
        anchors = torch.tensor([row.anchor for row in rows], dtype=torch.long, device=dev)
        budgets = [max(0, row.params.max_new_tokens - len(row.output_ids) - 1) for row in rows]
        greedy_rows = [row.params.temperature <= 0 for row in rows]

        t0 = time.perf_counter()
        if nw:
            self.ngram_acceptance.fade(NGRAM_FADE)
        plans = self._ngram_plan(rows, budgets, nw)
        span = self._drafter_span(r, d, any_seeded, plans)
        draft = None
        a, b = span if span is not None else (0, 0)
        t_draft = time.perf_counter()
        if span is not None:
            draft = self._propose(lo + a, rows[a:b], anchors[a:b], sampling.rows(torch.arange(a, b, device=dev)), d)
            self.draft_forwards += 1
            self.costs.observe_draft(b - a, time.perf_counter() - t_draft)
        t1 = time.perf_counter()
        counts, use_ngram = self._choose(rows, plans, draft, a, b, d, budgets, greedy_rows, full)
        k = max(counts, default=0)

        # Drafts per row from its proposer (padding past a row's count is verified but never counted).
        drafts = torch.zeros(r, k, dtype=torch.long, device=dev)
        token_probs = torch.ones(r, k, device=dev)
        if draft is not None and k > 0:
            kd = min(k, d)
            drafts[a:b, :kd] = draft.tokens[:, :kd]
            token_probs[a:b, :kd] = draft.token_probs[:, :kd].float()
        ngram_mask = torch.tensor(use_ngram, dtype=torch.bool)
        if k > 0 and bool(ngram_mask.any()):
            copied = torch.zeros(r, k, dtype=torch.long)
            for i, plan in enumerate(plans):
                if use_ngram[i] and plan is not None:
                    copied[i, : counts[i]] = torch.tensor(plan.tokens[: counts[i]])
            ngram_mask = ngram_mask.to(dev)
            drafts = torch.where(ngram_mask[:, None], copied.to(dev), drafts)
            token_probs = torch.where(ngram_mask[:, None], torch.ones_like(token_probs), token_probs)
        ngram_mask = ngram_mask.to(dev)
        num_drafts = torch.tensor(counts, dtype=torch.long, device=dev)
        tokens = torch.cat([anchors[:, None], drafts], dim=1)

        t_fwd = time.perf_counter()
        out = self.target.forward(self.cache, lo, tokens, want_features=self.want_features)
        if out.logits.is_cuda:
            torch.cuda.synchronize()  # time the work, not the launch
        self.costs.observe_verify(r, k + 1, time.perf_counter() - t_fwd)
        logits = out.logits  # [R, k + 1, V]
        scores = process_logits([row.processor for row in rows], logits, drafts)  # what the rows choose from

        accepted = torch.zeros(r, dtype=torch.long, device=dev)
        bonus = torch.zeros(r, dtype=torch.long, device=dev)
        greedy = sampling.greedy
        if bool(greedy.any()):
            g = greedy.nonzero().squeeze(1)
            acc_g, bonus_g = verify_greedy(scores[g], drafts[g], num_drafts[g])
            accepted[g], bonus[g] = acc_g, bonus_g
            if k > 0 and draft is not None:
                # Calibrate the drafter on the greedy rows that verified its drafts.
                mine = [i for i in g.tolist() if a <= i < b and not use_ngram[i]]
                if mine:
                    idx = torch.tensor(mine, device=dev)
                    self.calibration.observe(
                        draft.confidence[idx - a, : min(k, d)].float(), num_drafts[idx], accepted[idx]
                    )
        if not bool(greedy.all()):
            s = (~greedy).nonzero().squeeze(1)
            p = processed_probs(scores[s], sampling.temperature[s], sampling.top_k[s], sampling.top_p[s])
            acc_s, bonus_s = verify_sampling(
                p,
                drafts[s],
                token_probs[s],
                self._draft_dists(draft, s, a, b, d, k),
                num_drafts[s],
                uniforms[s, width : width + k],
                uniforms[s, 2 * width],
                self.drafter.draft_vocab_ids
                if self.drafter is not None and self.drafter.config.draft_vocab_size
                else None,
                onehot=ngram_mask[s],
            )
            accepted[s], bonus[s] = acc_s, bonus_s

        acc_list, bonus_list = accepted.tolist(), bonus.tolist()
        drafts_list = drafts.tolist()
        new_tokens = [drafts_list[i][: acc_list[i]] + [bonus_list[i]] for i in range(r)]
        logprobs = [
            self._logprobs(logits[i], new_tokens[i], row.params.logprobs) if row.params.logprobs is not None else None
            for i, row in enumerate(rows)
        ]

        # All work is done: now advance the caches (rejected positions are simply not counted).
        # The drafter's context first, rolled back if it fails: the target cache then moves only once
        # nothing can fail, so a retry of this step (step() retries row by row) starts where it did.
        if self.drafter is not None:
            assert self.draft_cache is not None and out.features is not None
            draft_lengths = self.draft_cache.lengths[lo:hi].clone()
            try:
                self.drafter.append_context(self.draft_cache, lo, out.features, accepted + 1)
            except BaseException:
                self.draft_cache.lengths[lo:hi] = draft_lengths
                raise
        self.cache.lengths[lo:hi] += accepted + 1
        t2 = time.perf_counter()
        self.last_timing = StepTiming("decode", r, t1 - t0, t2 - t1, k)

        outputs, done = [], []
        for i, row in enumerate(rows):
            a_i, n_i = acc_list[i], counts[i]
            proposer = None if n_i == 0 else ("ngram" if use_ngram[i] else "drafter")
            plan = plans[i]
            if proposer == "ngram" and plan is not None and row.ngram_acceptance is not None:
                row.ngram_acceptance.observe(plan.match_len, n_i, a_i)
                if greedy_rows[i]:
                    self.ngram_acceptance.observe(plan.match_len, n_i, a_i)
            emitted, reason, stop_tok = self._commit(row, new_tokens[i])
            if row.processor is not None:
                row.processor.commit(emitted)
            row.anchor = bonus_list[i]
            st = row.stats
            st.verify_steps += 1
            st.draft_tokens += n_i
            st.accepted_tokens += a_i
            if proposer is not None:
                st.draft_tokens_by_proposer[proposer] = st.draft_tokens_by_proposer.get(proposer, 0) + n_i
                st.accepted_tokens_by_proposer[proposer] = st.accepted_tokens_by_proposer.get(proposer, 0) + a_i
            st.acceptance_lengths.append(a_i + 1)
            for j in range(a_i):
                st.accepted_per_position[j] += 1
            lp = logprobs[i][: len(emitted)] if logprobs[i] is not None else None
            outputs.append(
                RequestOutput(
                    row.request_id,
                    emitted,
                    reason is not None,
                    reason,
                    st,
                    lp,
                    stop_tok,
                    step_draft_tokens=n_i,
                    step_accepted=list(range(a_i)),
                    is_verify_step=True,
                    step_proposer=proposer,
                )
            )
            if self.capture:
                assert out.features is not None
                outputs[-1].features = out.features[i, : a_i + 1].to(torch.float16).cpu()
            if reason is not None:
                done.append(lo + i)
        if finalize:
            self._remove_rows(done)
        return outputs

    def _draft_dists(
        self, draft: DraftResult | None, s: torch.Tensor, a: int, b: int, d: int, k: int
    ) -> torch.Tensor | None:
        """The drafter's distributions [S, k, Vd] for sampling rows s (rows it did not draft: zeros)."""
        if draft is None or draft.draft_probs is None or k == 0:
            return None
        idx = s.tolist()
        if k <= d and all(a <= i < b for i in idx):
            return draft.draft_probs[s - a, :k]
        full = draft.draft_probs.new_zeros(len(idx), k, draft.draft_probs.shape[-1])
        kd = min(k, d)
        for j, i in enumerate(idx):
            if a <= i < b:
                full[j, :kd] = draft.draft_probs[i - a, :kd]
        return full

    def _choose(
        self,
        rows: list[_Row],
        plans: list[_NgramPlan | None],
        draft: DraftResult | None,
        a: int,
        b: int,
        d: int,
        budgets: list[int],
        greedy_rows: list[bool],
        full: bool,
    ) -> tuple[list[int], list[bool]]:
        """Drafts to verify per row, and whether they are the row's n-gram copy (else the drafter's)."""
        r = len(rows)
        counts, use_ngram = [0] * r, [False] * r
        ngram_len = [len(p.tokens) if p is not None else 0 for p in plans]
        conf = draft.confidence[:, :d].float().cpu() if draft is not None else torch.zeros(0, d)
        in_span = [a <= i < b and draft is not None for i in range(r)]
        if self.draft_policy == "fixed":
            # Fixed: the drafter's block wherever it ran (up to the first doubtful slot), else the copy.
            confident = (conf >= self.draft_threshold).long().cumprod(-1).sum(-1).tolist() if draft is not None else []
            for i in range(r):
                if in_span[i]:
                    counts[i] = min(confident[i - a], budgets[i])
                elif ngram_len[i]:
                    counts[i], use_ngram[i] = ngram_len[i], True
            return counts, use_ngram

        width = max([d if draft is not None else 0, *ngram_len])
        budget_t = torch.tensor(budgets)
        gain_d = torch.zeros(r, width + 1, dtype=torch.float64)
        if draft is not None:
            calibrated = self.calibration.calibrate(conf).double()
            gain_d[a:b] = capped_gain(expected_accepted(calibrated), width, budget_t[a:b])
            # What the drafter is expected to add per row at full width: rows whose copy promises
            # more skip the next drafter forward (`_drafter_span`).
            mean_gain = float(expected_accepted(calibrated)[:, -1].mean())
            self._drafter_gain = mean_gain if self._drafter_gain is None else 0.8 * self._drafter_gain + 0.2 * mean_gain
        gain_n = torch.zeros(r, width + 1, dtype=torch.float64)
        for i, plan in enumerate(plans):
            if plan is not None:
                gain_n[i] = capped_gain(expected_accepted(plan.accept[None].double()), width, torch.tensor([width]))[0]

        # Sampling rows: a row-local, lossless rule. The count of each proposer is a stopping time
        # of its own draft sequence (`stopping_drafts`); which proposer is chosen depends only on
        # what is known before the first draft is drawn: the copy and its estimates, and the
        # drafter's first-slot confidence (later slots may depend on drawn drafts).
        for i in range(r):
            if greedy_rows[i]:
                continue
            plan = plans[i]
            n_count = 0
            rate_n = 0.0
            if plan is not None:
                n_count = int(stopping_drafts(plan.accept[None], torch.tensor([ngram_len[i]]), draft_cost=0.0)[0])
                rate_n = float(prior_rate(plan.accept[None], torch.tensor([n_count]), 0.0)[0])
            if in_span[i]:
                c = conf[i - a]
                geometric = c[:1].expand(d)[None]
                g_count = stopping_drafts(geometric, torch.tensor([budgets[i]]), draft_cost=0.0)
                rate_d = float(prior_rate(geometric, g_count, 0.0)[0])
                if plan is not None and n_count > 0 and rate_n > rate_d:
                    counts[i], use_ngram[i] = n_count, True
                else:
                    counts[i] = int(stopping_drafts(c[None], torch.tensor([budgets[i]]))[0])
            elif n_count > 0:
                counts[i], use_ngram[i] = n_count, True

        # Greedy rows: their output never depends on the drafts, so choose for the batch: the shared
        # width with the best expected token rate, each row taking the better proposer at that width.
        greedy_idx = [i for i in range(r) if greedy_rows[i]]
        if greedy_idx:
            best = torch.maximum(gain_d[greedy_idx], gain_n[greedy_idx])
            draft_cost = self.costs.draft(b - a) if draft is not None else 0.0
            shared, _rate = best_shared_width(best, self.costs, draft_cost)
            # Sampling rows may widen the forward: greedy rows use the padded width for free.
            k = max([shared, *counts])
            for i in greedy_idx:
                if k == 0:
                    break
                if gain_n[i, k] > gain_d[i, k]:
                    counts[i], use_ngram[i] = min(k, ngram_len[i]), True
                elif gain_d[i, k] > 0:
                    counts[i] = min(k, d, budgets[i])

        if draft is not None:
            self._adapt_drafting(max([counts[i] for i in range(a, b) if not use_ngram[i]], default=0), d, full)
        return counts, use_ngram

    def _adapt_drafting(self, used: int, d: int, full: bool) -> None:
        """After a drafter forward that had `used` of its `d` slots verified (at most, over rows)."""
        if used == 0:
            # Speculation did not pay for several steps running: decode plainly for a while.
            # (A decision from past steps only, so it is lossless for sampling rows too.)
            # The first pause needs 3 such steps; a probe after a pause needs one, and
            # each failed probe doubles the next pause (a drafter that never pays costs
            # one draft every PAUSE_MAX steps).
            self._no_gain_streak += 1
            if self._no_gain_streak >= (3 if self._pause_len == PAUSE_MIN else 1):
                self._skip_drafting, self._no_gain_streak = self._pause_len, 0
                self._pause_len = min(2 * self._pause_len, PAUSE_MAX)
        else:
            self._no_gain_streak = 0
            self._pause_len = PAUSE_MIN
        # Draft only as many slots as the policy has lately used (logits and head steps
        # for slots that are never verified are wasted): grow when all were used.
        if used >= d and self._draft_width < self.num_drafts:
            self._draft_width += 1
        elif used <= d - 2 and not full:
            self._draft_width = max(1, self._draft_width - 1)
