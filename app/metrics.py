"""Prometheus collectors (vLLM's names and meanings under a `domino_` prefix, label `model_name`).

Everything lives on a dedicated registry so several apps (tests) can coexist in one process and
/metrics shows only the service's own series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.ray_serve import REPLICA_GAUGES
from model.engine.requests import PROPOSERS

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Prompt tokens forwarded per step: powers of 4 to the longest contexts served, 2x apart at the
# budgets a chunked-prefill setting is likely to use (DOMINO_MAX_NUM_BATCHED_TOKENS).
PREFILL_TOKEN_BUCKETS = (1.0, 4.0, 16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 65536.0)
DRAFTS_PER_STEP_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 32.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """The attributes are the series of one model (labels bound once): cheaper per observation, and
    every series exists (at 0) from the start, so rate() and ratios work before the first request."""

    def __init__(self, model_name: str, num_draft_positions: int, max_batch_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._add_counters(num_draft_positions)
        self._add_histograms(num_draft_positions, max_batch_size)
        r, name = self.registry, ["model_name"]
        self.running = Gauge("domino_num_requests_running", "Requests in the running batch.", name, registry=r).labels(
            model_name
        )
        self.waiting = Gauge(
            "domino_num_requests_waiting", "Requests admitted but not yet running.", name, registry=r
        ).labels(model_name)
        # KV memory by blocks (DOMINO_KV_CACHE_MEMORY): what Grafana users look for as vLLM's
        # kv_cache_usage_perc (a fraction, despite the name).
        blocks = Gauge("domino_kv_cache_blocks", "KV cache blocks by state (used, free).", [*name, "state"], registry=r)
        self.kv_blocks_used, self.kv_blocks_free = blocks.labels(model_name, "used"), blocks.labels(model_name, "free")
        self.kv_usage = Gauge(
            "domino_kv_cache_usage_perc", "Fraction of the KV cache blocks in use (0-1).", name, registry=r
        ).labels(model_name)
        # One process serving is one replica, ready; behind Ray Serve, /metrics answers with the
        # deployment's counts instead (app/ray_serve.py REPLICA_GAUGES).
        for metric, doc in REPLICA_GAUGES.items():
            Gauge(metric, doc, name, registry=r).labels(model_name).set(1)

    def _counter(self, metric: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(metric, doc, ["model_name", *extra], registry=self.registry)

    def _histogram(self, metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(metric, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def _add_counters(self, num_draft_positions: int) -> None:
        counter, m = self._counter, self.model_name
        # prometheus_client appends `_total` to counter names itself.
        drafts = counter("domino_spec_decode_num_drafts", "Verify steps (one per running request per step).")
        # `proposer`: who proposed the drafts, the drafter ("drafter") or an n-gram copy ("ngram");
        # sums over it keep the meaning these counters had before the label.
        draft_tokens = counter("domino_spec_decode_num_draft_tokens", "Draft tokens verified.", ("proposer",))
        accepted = counter("domino_spec_decode_num_accepted_tokens", "Draft tokens accepted.", ("proposer",))
        self._accepted_per_pos = counter(
            "domino_spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.", ("position",)
        )
        prompt_tokens = counter("domino_prompt_tokens", "Prompt tokens prefilled.")
        cached_tokens = counter(
            "domino_prompt_tokens_cached", "Prompt tokens copied from the prefix cache instead of computed."
        )
        generation_tokens = counter("domino_generation_tokens", "Tokens generated (stop tokens included).")
        success = counter("domino_request_success", "Finished requests by finish reason.", ("finished_reason",))
        errors = counter("domino_request_errors", "Requests that failed during generation.")
        preemptions = counter(
            "domino_num_preemptions", "Running requests taken out of the batch for want of KV blocks, to be recomputed."
        )
        prefill_chunks = counter(
            "domino_prefill_chunks",
            "Prompt chunks forwarded by chunked prefill (DOMINO_MAX_NUM_BATCHED_TOKENS); more chunks than "
            "prompts: long prompts shared steps with decoding.",
        )
        kv_bytes_read = counter(
            "domino_kv_bytes_read", "Bytes of keys and values the engine's attention read (the span it attends over)."
        )
        self.num_drafts = drafts.labels(m)
        self.num_draft_tokens = {p: draft_tokens.labels(m, p) for p in PROPOSERS}
        self.num_accepted_tokens = {p: accepted.labels(m, p) for p in PROPOSERS}
        self.accepted_per_position = [self._accepted_per_pos.labels(m, str(p)) for p in range(num_draft_positions)]
        self.prompt_tokens = prompt_tokens.labels(m)
        self.prompt_tokens_cached = cached_tokens.labels(m)
        self.generation_tokens = generation_tokens.labels(m)
        self.request_success = {reason: success.labels(m, reason) for reason in ("stop", "length", "abort")}
        self.request_errors = errors.labels(m)
        self.preemptions = preemptions.labels(m)
        self.kv_bytes_read = kv_bytes_read.labels(m)
        self.prefill_chunks = prefill_chunks.labels(m)

    def _add_histograms(self, num_draft_positions: int, max_batch_size: int) -> None:
        histogram, m = self._histogram, self.model_name
        acceptance_length = histogram(
            "domino_acceptance_length",
            "Tokens committed per verify step per request (accepted drafts + 1).",
            tuple(float(b) for b in range(1, num_draft_positions + 2)),
        )
        ttft = histogram("domino_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        itl = histogram(
            "domino_inter_token_latency_seconds",
            "Gap between token deliveries, divided by the tokens delivered together.",
            LATENCY_BUCKETS,
        )
        e2e = histogram("domino_e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        queue_time = histogram("domino_request_queue_time_seconds", "Arrival to prefill.", LATENCY_BUCKETS)
        batch_size = histogram(
            "domino_batch_size",
            "Requests verified together per decode step.",
            tuple(float(b) for b in sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch_size}) if b <= max_batch_size),
        )
        draft_seconds = histogram("domino_draft_step_seconds", "Drafting time per decode step.", STEP_BUCKETS)
        verify_seconds = histogram("domino_verify_step_seconds", "Target verify time per decode step.", STEP_BUCKETS)
        prefill_tokens = histogram(
            "domino_prefill_tokens_per_step",
            "Prompt tokens forwarded by an engine step that prefilled (whole prompts or chunks); with "
            "DOMINO_MAX_NUM_BATCHED_TOKENS at most the budget (a prompt scored for its logprobs goes whole).",
            PREFILL_TOKEN_BUCKETS,
        )
        drafts_per_step = histogram(
            "domino_spec_decode_drafts_per_step",
            "Drafts per request in a decode step's verify forward (its width - 1): what the draft policy chose; "
            "0 while it decodes plainly (drafting paused, or a plain probe).",
            DRAFTS_PER_STEP_BUCKETS,
        )
        self.acceptance_length = acceptance_length.labels(m)
        self.time_to_first_token = ttft.labels(m)
        self.inter_token_latency = itl.labels(m)
        self.e2e_latency = e2e.labels(m)
        self.queue_time = queue_time.labels(m)
        self.batch_size = batch_size.labels(m)
        self.draft_seconds = draft_seconds.labels(m)
        self.verify_seconds = verify_seconds.labels(m)
        self.prefill_tokens_per_step = prefill_tokens.labels(m)
        self.drafts_per_step = drafts_per_step.labels(m)

    def accepted_position(self, position: int) -> Counter:
        while position >= len(self.accepted_per_position):  # a drafter proposing more than announced
            label = str(len(self.accepted_per_position))
            self.accepted_per_position.append(self._accepted_per_pos.labels(self.model_name, label))
        return self.accepted_per_position[position]
