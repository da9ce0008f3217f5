"""Continuous-batching speculative decoding engine (DESIGN §1.4, §3).

One `Engine` owns a target, an optional drafter and their per-row caches. `step()` either admits
waiting requests (one batched prefill) or advances every running row by one speculative step:
draft a block per row, verify all rows in one target forward, commit a different number of tokens
per row and roll the rest back by not advancing that row's cache length.

Modes: `domino` (Domino head on), `dflash` (head off: base logits only), `ar` (no drafts: plain
batched autoregressive decoding through the same code path).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.drafter import DraftContextCache, Drafter, DraftResult
from model.policy import AcceptanceCalibration, StepCosts, best_shared_drafts, stopping_drafts
from model.sampling import (
    SamplingBatch,
    processed_probs,
    sample_with_uniform,
    verify_greedy,
    verify_sampling,
)
from model.target import TargetModel

MODES = ("domino", "dflash", "ar")
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


PAUSE_MIN, PAUSE_MAX = 8, 64  # steps of plain decoding after drafting stopped paying


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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "ar" and drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter")
        if mode == "domino" and drafter is not None and not drafter.config.has_head:
            raise ValueError("mode 'domino' needs a Domino drafter (projector_type 'domino'); use 'dflash'")
        self.target = target
        self.mode = mode
        self.drafter = drafter if mode != "ar" else None
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
        row.stats.accepted_per_position = [0] * self.num_drafts
        self.waiting.append(row)

    def abort(self, request_id: str) -> None:
        """Cancel a request; it leaves the batch at the start of the next step."""
        for row in list(self.waiting) + self.rows:
            if row.request_id == request_id:
                row.aborted = True

    def has_unfinished(self) -> bool:
        return bool(self.rows or self.waiting)

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
        first = self._sample_target(logits, sampling, u).tolist()
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
        uniforms = self._draw_uniforms(rows, 2 * d + 1)  # draft slots, acceptance tests, final token
        sampling = self._sampling_batch(rows, uniforms[:, :d])
        anchors = torch.tensor([row.anchor for row in rows], dtype=torch.long, device=dev)

        sampled_rows = ~sampling.greedy
        any_sampled = bool(sampled_rows.any())
        t0 = time.perf_counter()
        draft = None
        if d > 0 and (self._skip_drafting == 0 or any_seeded):
            draft = self._propose(lo, rows, anchors, sampling, d)
            self.draft_forwards += 1
        elif self._skip_drafting > 0:
            self._skip_drafting -= 1
        t1 = time.perf_counter()
        num_drafts = torch.zeros(r, dtype=torch.long, device=dev)
        if draft is not None:
            self.costs.observe_draft(r, t1 - t0)
            budget = torch.tensor([row.params.max_new_tokens - len(row.output_ids) - 1 for row in rows], device=dev)
            budget = budget.clamp_min(0)
            # Confidence = each slot's largest probability, known before that slot's draft is drawn:
            # any rule that stops at the first doubtful slot keeps sampling lossless.
            confidence = draft.confidence[:, :d].float()
            if self.draft_policy == "fixed":
                confident = (confidence >= self.draft_threshold).long().cumprod(-1).sum(-1)
                num_drafts = torch.minimum(confident, budget)
            else:
                greedy_idx = sampling.greedy.nonzero().squeeze(1)
                shared = 0
                if len(greedy_idx):
                    # Greedy output never depends on the draft count: pick the best rate for the batch.
                    calibrated = self.calibration.calibrate(confidence[greedy_idx])
                    shared, _rate = best_shared_drafts(calibrated, budget[greedy_idx], self.costs)
                num_drafts = torch.minimum(torch.full_like(budget, shared), budget)
                if any_sampled:
                    local = stopping_drafts(confidence, budget)
                    num_drafts = torch.where(sampled_rows, local, num_drafts)
                    # Greedy rows may use the padded width for free.
                    width = torch.full_like(budget, int(num_drafts.max()))
                    num_drafts = torch.where(sampled_rows, num_drafts, torch.minimum(width, budget))
                used = int(num_drafts.max())
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
        k = int(num_drafts.max())

        tokens = anchors[:, None]
        if k > 0:
            assert draft is not None
            tokens = torch.cat([tokens, draft.tokens[:, :k]], dim=1)
        t_fwd = time.perf_counter()
        out = self.target.forward(self.cache, lo, tokens, want_features=self.want_features)
        if out.logits.is_cuda:
            torch.cuda.synchronize()  # time the work, not the launch
        self.costs.observe_verify(r, k + 1, time.perf_counter() - t_fwd)
        logits = out.logits  # [R, k + 1, V]

        accepted = torch.zeros(r, dtype=torch.long, device=dev)
        bonus = torch.zeros(r, dtype=torch.long, device=dev)
        greedy = sampling.greedy
        drafts = tokens[:, 1:]
        if bool(greedy.any()):
            g = greedy.nonzero().squeeze(1)
            acc_g, bonus_g = verify_greedy(logits[g], drafts[g], num_drafts[g])
            accepted[g], bonus[g] = acc_g, bonus_g
            if k > 0 and draft is not None:
                self.calibration.observe(draft.confidence[g, :k].float(), num_drafts[g], acc_g)
        if not bool(greedy.all()):
            s = (~greedy).nonzero().squeeze(1)
            p = processed_probs(logits[s], sampling.temperature[s], sampling.top_k[s], sampling.top_p[s])
            acc_s, bonus_s = verify_sampling(
                p,
                drafts[s],
                draft.token_probs[s, :k] if draft is not None else torch.zeros(len(s), 0, device=dev),
                draft.draft_probs[s, :k] if draft is not None and draft.draft_probs is not None else None,
                num_drafts[s],
                uniforms[s, d : d + k],
                uniforms[s, 2 * d],
                self.drafter.draft_vocab_ids
                if self.drafter is not None and self.drafter.config.draft_vocab_size
                else None,
            )
            accepted[s], bonus[s] = acc_s, bonus_s

        acc_list, bonus_list, nd_list = accepted.tolist(), bonus.tolist(), num_drafts.tolist()
        drafts_list = drafts.tolist()
        new_tokens = [drafts_list[i][: acc_list[i]] + [bonus_list[i]] for i in range(r)]
        logprobs = [
            self._logprobs(logits[i], new_tokens[i], row.params.logprobs) if row.params.logprobs is not None else None
            for i, row in enumerate(rows)
        ]

        # All work is done: now advance the caches (rejected positions are simply not counted).
        self.cache.lengths[lo:hi] += accepted + 1
        if self.drafter is not None:
            assert self.draft_cache is not None and out.features is not None
            self.drafter.append_context(self.draft_cache, lo, out.features, accepted + 1)
        t2 = time.perf_counter()
        self.last_timing = StepTiming("decode", r, t1 - t0, t2 - t1, k)

        outputs, done = [], []
        for i, row in enumerate(rows):
            a = acc_list[i]
            emitted, reason, stop_tok = self._commit(row, new_tokens[i])
            row.anchor = bonus_list[i]
            st = row.stats
            st.verify_steps += 1
            st.draft_tokens += nd_list[i]
            st.accepted_tokens += a
            st.acceptance_lengths.append(a + 1)
            for j in range(a):
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
                    step_draft_tokens=nd_list[i],
                    step_accepted=list(range(a)),
                    is_verify_step=True,
                )
            )
            if self.capture:
                assert out.features is not None
                outputs[-1].features = out.features[i, : a + 1].to(torch.float16).cpu()
            if reason is not None:
                done.append(lo + i)
        if finalize:
            self._remove_rows(done)
        return outputs
