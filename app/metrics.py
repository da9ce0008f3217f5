"""Prometheus collectors (vLLM's names and meanings under a `domino_` prefix, label `model_name`).

Everything lives on a dedicated registry so several apps (tests) can coexist in one process and
/metrics shows only the service's own series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, model_name: str, num_draft_positions: int, max_batch_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, name = self.registry, ["model_name"]

        def counter(metric: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(metric, doc, [*name, *extra], registry=r)

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric, doc, name, buckets=buckets, registry=r)

        # prometheus_client appends `_total` to counter names itself.
        self.num_drafts = counter("domino_spec_decode_num_drafts", "Verify steps (one per running request per step).")
        self.num_draft_tokens = counter("domino_spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("domino_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "domino_spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.", ("position",)
        )
        self.prompt_tokens = counter("domino_prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("domino_generation_tokens", "Tokens generated (stop tokens included).")
        self.request_success = counter(
            "domino_request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.request_errors = counter("domino_request_errors", "Requests that failed during generation.")

        self.acceptance_length = histogram(
            "domino_acceptance_length",
            "Tokens committed per verify step per request (accepted drafts + 1).",
            tuple(float(b) for b in range(1, num_draft_positions + 2)),
        )
        self.ttft = histogram("domino_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram(
            "domino_inter_token_latency_seconds",
            "Gap between token deliveries, divided by the tokens delivered together.",
            LATENCY_BUCKETS,
        )
        self.e2e = histogram("domino_e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue_time = histogram("domino_request_queue_time_seconds", "Arrival to prefill.", LATENCY_BUCKETS)
        self.batch_size = histogram(
            "domino_batch_size",
            "Requests verified together per decode step.",
            tuple(float(b) for b in sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch_size}) if b <= max_batch_size),
        )
        self.draft_seconds = histogram("domino_draft_step_seconds", "Drafting time per decode step.", STEP_BUCKETS)
        self.verify_seconds = histogram(
            "domino_verify_step_seconds", "Target verify time per decode step.", STEP_BUCKETS
        )
        self.running = Gauge("domino_num_requests_running", "Requests in the running batch.", name, registry=r)
        self.waiting = Gauge("domino_num_requests_waiting", "Requests admitted but not yet running.", name, registry=r)

        # Bind labels once: cheaper per observation, and every series exists (at 0) from the start,
        # so rate() and ratios work before the first request.
        self.model_name = m = model_name
        self.c_num_drafts = self.num_drafts.labels(m)
        self.c_draft_tokens = self.num_draft_tokens.labels(m)
        self.c_accepted = self.num_accepted_tokens.labels(m)
        self.c_accepted_pos = [self.accepted_per_pos.labels(m, str(p)) for p in range(num_draft_positions)]
        self.c_prompt_tokens = self.prompt_tokens.labels(m)
        self.c_generation_tokens = self.generation_tokens.labels(m)
        self.c_success = {reason: self.request_success.labels(m, reason) for reason in ("stop", "length", "abort")}
        self.c_errors = self.request_errors.labels(m)
        self.h_acceptance = self.acceptance_length.labels(m)
        self.h_ttft = self.ttft.labels(m)
        self.h_itl = self.itl.labels(m)
        self.h_e2e = self.e2e.labels(m)
        self.h_queue = self.queue_time.labels(m)
        self.h_batch = self.batch_size.labels(m)
        self.h_draft = self.draft_seconds.labels(m)
        self.h_verify = self.verify_seconds.labels(m)
        self.g_running = self.running.labels(m)
        self.g_waiting = self.waiting.labels(m)

    def accepted_position(self, position: int) -> Counter:
        while position >= len(self.c_accepted_pos):  # a drafter proposing more than announced
            self.c_accepted_pos.append(self.accepted_per_pos.labels(self.model_name, str(len(self.c_accepted_pos))))
        return self.c_accepted_pos[position]
