"""Static-shape steps for accelerators: fixed (batch, tokens, span) buckets, persistent input buffers and,
on CUDA, one captured graph per bucket (docs/design.md §3, "Static shapes and CUDA graphs").

On a GPU an eager verify forward costs ~10x its memory-bandwidth floor at batch 1: the time goes
into launching hundreds of small kernels from Python, not into the kernels. Replaying a captured
CUDA graph launches them all at once. A graph replays fixed shapes on fixed buffers, so here:

- verify runs T in {1, 2, 3, 5, 9, ..., W + 1} (W: the most drafts a row may verify) and batches
  padded to 1, 2, 4, 8, ... rows; padding tokens and padding rows are computed and never counted
  (at batch 16 a forward over 17 tokens per row is no longer free, so short drafts get short T);
- attention spans a fixed number of positions (`span=` forwards: no read of the row lengths back to
  the host, which a graph cannot contain): with slots the whole capacity; with paged storage the
  smallest of a few spans (growing 4x up to the capacity) that holds the longest live row and the
  step's tokens, chosen on the host from the lengths' host mirror. Row lengths and block tables live
  in the caches' device tensors, which the graphs read at replay, so they are written in place and
  never copied in; slots past the live rows (the padding rows) hold length 0 and, paged, only the
  trash block, so a padding row never writes into a live row's blocks;
- inputs are copied into each bucket's persistent buffers and outputs are that bucket's own
  buffers, valid until its next replay (each graph has a private memory pool, so no other graph's
  replay overwrites them);
- the drafter's proposal has buckets for greedy batches and, per top-k/top-p or not, for batches
  with sampling rows, whose parameters and random draws are inputs like the anchors; the sampling
  buckets write their distributions into one shared buffer and share one memory pool (one replays
  per step, and its outputs are read before the next).

On the CPU the same functions run eagerly on the same padded shapes (tested token-identical to the
dynamic path); the CPU default stays dynamic because there padding costs real time.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.engine.sampling import SamplingBatch
from model.nn.attention import KV_READS

log = logging.getLogger("domino.static")

Tensors = tuple[torch.Tensor, ...]


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_batch_size."""
    sizes = [1]
    while sizes[-1] < max_batch_size:
        sizes.append(sizes[-1] * 2)
    return sizes


def verify_widths(max_drafts: int) -> list[int]:
    """Verify widths T = drafts + 1: 1 (no drafts), 2, 3, 5, 9, ... and the widest, W + 1."""
    widths = {1, max_drafts + 1}
    t = 2
    while t <= max_drafts + 1:
        widths.add(t)
        t = 2 * t - 1  # 2, 3, 5, 9, 17: one more than a power of two drafts
    return sorted(widths)


def span_buckets(capacity: int, smallest: int | None) -> list[int]:
    """The spans static steps attend over: the capacity alone (`smallest` None: slots, which hold
    a row's keys at fixed addresses anyway), or the capacity divided by 4, 16, ... down to no less
    than `smallest` (paged: a step reads about what its longest row needs, at most 4x)."""
    spans = [capacity]
    while smallest is not None and spans[0] // 4 >= smallest:
        spans.insert(0, spans[0] // 4)
    return spans


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n, or None when n is larger than all of them."""
    return next((b for b in buckets if b >= n), None)


class StaticFunction:
    """fn(*inputs) -> tensors, run on persistent input buffers of fixed shapes.

    With `graph`, fn is captured once into a CUDA graph (after warm-up runs on a side stream, as
    torch.cuda.graphs requires) and every call replays it; if capture fails (an op that syncs with
    the host, an unsupported kernel) the function falls back to eager and says so in the log.
    """

    def __init__(
        self, name: str, fn: Callable[..., Tensors], inputs: Tensors, graph: bool, pool: object | None = None
    ) -> None:
        """`pool`: a graph memory pool shared with other functions' graphs (their intermediates
        share memory; their outputs stay each its own), else a private one."""
        self.name = name
        self.pool = pool
        self.fn = fn
        self.inputs = tuple(x.clone() for x in inputs)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Tensors = ()
        self.calls = 0
        self.kv_bytes_read = 0  # what one run's attention reads, counted at capture (a replay runs no Python)
        if graph:
            try:
                self._capture()
            except Exception as exc:  # noqa: BLE001 - serve eagerly rather than not at all
                log.warning("CUDA graph capture of %s failed, running it eagerly: %s", name, exc)
                self.graph = None
                torch.cuda.synchronize()

    def _capture(self) -> None:
        caller = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(*self.inputs)
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        counted = KV_READS.bytes
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs = self.fn(*self.inputs)
            self.kv_bytes_read = KV_READS.bytes - counted
        finally:
            # A failed capture raises from inside torch.cuda.graph's exit, before it switches
            # back from its capture stream: make the caller's stream current again either way.
            torch.cuda.set_stream(caller)
        self.graph = graph

    def __call__(self, *inputs: torch.Tensor) -> Tensors:
        self.calls += 1
        for buffer, x in zip(self.inputs, inputs):
            buffer.copy_(x)
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        KV_READS.bytes += self.kv_bytes_read
        return self.outputs


@dataclass
class WarmupReport:
    graphs: int
    eager: int
    seconds: float
    memory_bytes: int  # growth of the allocator's reserved memory: the graphs' private pools too


class StaticSteps:
    """The engine's static-shape functions, one per bucket: target verify per (batch, T, span) and
    the drafter's greedy proposal (backbone + head loop, every slot) per (batch, span).

    `verify_fn(tokens [Rb, T], span) -> (logits, features...)` and `propose_fn(anchors [Rb], span)
    -> (tokens, token_probs, confidence)` run rows 0..Rb-1 of the engine's caches. With
    `sampled_fn(anchors, temperature, top_p, top_k, uniforms [Rb, num_drafts], span, filters) ->
    (tokens, token_probs, confidence, distributions)` the proposal of batches with sampling rows
    has buckets too, per (batch, span, filters): the rows' parameters and random draws are inputs,
    `filters` whether the top-k/top-p masks run.
    """

    def __init__(
        self,
        verify_fn: Callable[[torch.Tensor, int], Tensors],
        propose_fn: Callable[[torch.Tensor, int], Tensors] | None,
        max_batch_size: int,
        verify_widths: list[int],
        spans: list[int],
        device: torch.device,
        graphs: bool,
        sampled_fn: Callable[..., Tensors] | None = None,
        num_drafts: int = 0,
    ) -> None:
        self.batch_sizes = batch_buckets(max_batch_size)
        self.verify_widths = sorted(set(verify_widths))
        self.spans = sorted(set(spans))
        self.device = device
        self.use_graphs = graphs and device.type == "cuda"
        self._verify_fn, self._propose_fn, self._sampled_fn = verify_fn, propose_fn, sampled_fn
        self.num_drafts = num_drafts
        self.verify: dict[tuple[int, int, int], StaticFunction] = {}
        self.propose: dict[tuple[int, int], StaticFunction] = {}
        self.propose_sampled: dict[tuple[int, int, bool], StaticFunction] = {}
        self._sampled_pool: object | None = None
        self.report: WarmupReport | None = None

    def warm_up(self) -> WarmupReport:
        """Build (and on CUDA capture) every bucket now, at start-up, not under the first requests."""
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_reserved(self.device) if self.use_graphs else 0
        for rb, c in itertools.product(self.batch_sizes, self.spans):
            for t in self.verify_widths:
                tokens = torch.zeros(rb, t, dtype=torch.long, device=self.device)
                fn = functools.partial(self._verify_fn, span=c)
                self.verify[(rb, t, c)] = StaticFunction(f"verify[{rb}x{t}@{c}]", fn, (tokens,), self.use_graphs)
            if self._propose_fn is not None:
                anchors = torch.zeros(rb, dtype=torch.long, device=self.device)
                fn = functools.partial(self._propose_fn, span=c)
                self.propose[(rb, c)] = StaticFunction(f"propose[{rb}@{c}]", fn, (anchors,), self.use_graphs)
            if self._sampled_fn is not None:
                if self.use_graphs and self._sampled_pool is None:
                    # One pool for the sampling proposals' graphs: each holds [R, V] intermediates
                    # per draft slot (sorting for top-k/top-p), and only one replays at a time.
                    self._sampled_pool = torch.cuda.graph_pool_handle()
                inputs = sampled_inputs(rb, self.num_drafts, self.device)
                for filters in (False, True):
                    fn = functools.partial(self._sampled_fn, span=c, filters=filters)
                    name = f"propose_sampled[{rb}@{c}{', filtered' if filters else ''}]"
                    self.propose_sampled[(rb, c, filters)] = StaticFunction(
                        name, fn, inputs, self.use_graphs, self._sampled_pool
                    )
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        functions = [*self.verify.values(), *self.propose.values(), *self.propose_sampled.values()]
        graphs = sum(f.graph is not None for f in functions)
        mem = (torch.cuda.memory_reserved(self.device) - mem0) if self.use_graphs else 0
        self.report = WarmupReport(graphs, len(functions) - graphs, time.perf_counter() - t0, mem)
        log.info(
            "static-shape steps ready: %d buckets (%d CUDA graphs, %d eager) in %.1f s, %.0f MiB",
            len(functions),
            graphs,
            len(functions) - graphs,
            self.report.seconds,
            mem / 2**20,
        )
        return self.report

    def span_for(self, positions: int) -> int:
        """The smallest span holding `positions` (the longest live row plus what the step writes);
        the largest span, the capacity, where none does (writes past it are clamped, never counted)."""
        return bucket_for(positions, self.spans) or self.spans[-1]

    def run_verify(self, tokens: torch.Tensor, longest: int) -> Tensors | None:
        """Verify tokens [R, k] padded into its bucket, rows up to `longest` positions long before
        it; outputs cut back to [R, k, ...]. None when no bucket holds it (the caller runs the
        dynamic path)."""
        r, k = tokens.shape
        rb = bucket_for(r, self.batch_sizes)
        t = bucket_for(k, self.verify_widths)
        if rb is None or t is None:
            return None
        fn = self.verify.get((rb, t, self.span_for(longest + t)))
        if fn is None:
            return None
        padded = torch.zeros(rb, t, dtype=tokens.dtype, device=tokens.device)
        padded[:r, :k] = tokens
        return tuple(x[:r, :k] for x in fn(padded))

    def run_propose(self, anchors: torch.Tensor, positions: int) -> Tensors | None:
        """Greedy drafts of a full block for rows 0..R-1 (padded into a bucket) whose context and
        block take up to `positions` positions, or None."""
        r = anchors.shape[0]
        rb = bucket_for(r, self.batch_sizes)
        fn = self.propose.get((rb, self.span_for(positions))) if rb is not None else None
        if fn is None:
            return None
        padded = torch.zeros(rb, dtype=anchors.dtype, device=anchors.device)
        padded[:r] = anchors
        return tuple(x[:r] for x in fn(padded))

    def run_propose_sampled(
        self, anchors: torch.Tensor, sampling: SamplingBatch, positions: int, filters: bool
    ) -> Tensors | None:
        """Drafts of a full block for rows 0..R-1 of which some sample: `sampling`'s parameters and
        uniforms ([R, d], d <= num_drafts: later slots draw zeros, slots the caller drops) padded
        into a bucket's inputs (padding rows greedy), or None."""
        r = anchors.shape[0]
        rb = bucket_for(r, self.batch_sizes)
        fn = self.propose_sampled.get((rb, self.span_for(positions), filters)) if rb is not None else None
        if fn is None or sampling.uniforms is None:
            return None
        anchors_b, temperature, top_p, top_k, uniforms = sampled_inputs(rb, self.num_drafts, anchors.device)
        anchors_b[:r] = anchors
        temperature[:r] = sampling.temperature
        top_p[:r] = sampling.top_p
        top_k[:r] = sampling.top_k
        uniforms[:r, : sampling.uniforms.shape[1]] = sampling.uniforms
        return tuple(x[:r] for x in fn(anchors_b, temperature, top_p, top_k, uniforms))


def sampled_inputs(rows: int, num_drafts: int, device: torch.device) -> Tensors:
    """A sampling proposal bucket's inputs for `rows` greedy rows: anchors, temperature, top_p,
    top_k [rows] and uniforms [rows, num_drafts]."""
    return (
        torch.zeros(rows, dtype=torch.long, device=device),
        torch.zeros(rows, device=device),
        torch.ones(rows, device=device),
        torch.zeros(rows, dtype=torch.long, device=device),
        torch.zeros(rows, num_drafts, device=device),
    )
