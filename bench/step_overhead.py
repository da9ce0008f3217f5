"""Host time per decode step outside the captured functions, and device->host reads per step:
`python -m bench.step_overhead` (issue 37, item 7: the baseline for a step with one host sync).

The engine runs over a tiny random model (bench/common.py's `TINY`: a 2-layer, 64-wide Qwen3 target;
for dflash/domino a 2-layer drafter) with static shapes on, so a step's model work runs inside the
bucket functions of model/engine/static.py (CUDA graphs on a GPU, the same functions eagerly on the CPU),
and whatever else the step does is host overhead: the policy, assembling drafts, acceptance, the
eager drafter of sampled rows, padding into the buckets and copying into their buffers, emitting.

Per (mode, draft policy, batch, greedy or sampled) case: every row is admitted first (the prefill
step is not measured), `--warmup` decode steps run, then `--steps` timed steps, then `--steps`
counted steps (counting slows every torch call down, so it never overlaps timing). Rows have
`ignore_eos` and a token budget that no row can reach before the end. Both draft policies run: the
engine's default `adaptive` one stops drafting where drafts do not pay (a random drafter's mostly do
not, so at batch 32 it drafts in few steps), `fixed` drafts a full block every step.

Host time: the wall time of `engine.step()` minus the time inside the captured part of each bucket,
the `StaticFunction`s that `StaticSteps.run_verify` / `run_propose` call (their graph's `replay()`
on CUDA, their function on the CPU), wrapped on the engine's own instances. On CUDA the probe
synchronizes before and after each replay and around `step()`, so eager kernels queued before a
replay count as host time and the replay's GPU time as captured time (each of those synchronizes
adds a few microseconds of host time). `run_ms` is the time inside `run_verify` / `run_propose`
(padding, buffer copies and the replay), for reference. `host_cpu_ms` is the same split in this
thread's CPU time (`time.thread_time`), which leaves out the time other processes take from it on a
shared machine (with one torch thread every CPU op runs on this thread).

Reads (bench/host_reads.py, which says exactly what counts): `reads` are the calls that bring the
values of a tensor on the engine's device to Python (`item`, `tolist`, `bool`, `cpu`, ...; on the
CPU every tensor: reads that would be device->host on CUDA, an upper bound), `device_reads` those of
tensors that live on the device on CUDA (on the CPU an estimate by residency tracking that leaves the
policy's host tensors out). Ops whose output shape depends on the data (`nonzero`, boolean masks)
count apart, as `shape_syncs` / `device_shape_syncs`; on CUDA every synchronizing CUDA call and
explicit `torch.cuda.synchronize()` counts as `cuda_syncs`. Calls inside the bucket functions are
not counted. Every count is kept per call site, so the report says which lines read.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bench import common
from bench.host_reads import Excluded, ReadCounter, cuda_sync_log
from bench.report import write_reports
from bench.step_overhead_report import COUNTS, Samples, markdown, summarize
from model.engine.config import EngineConfig
from model.engine.engine import Engine
from model.engine.requests import RequestOutput, SamplingParams
from model.engine.static import StaticFunction
from model.nn.drafter import Drafter
from model.nn.target import TargetModel

MODES = ("ar", "ngram", "dflash", "domino")
SAMPLINGS = {"greedy": 0.0, "sampled": 1.0}
POLICIES = ("adaptive", "fixed")


def build_models(
    mode: str, block_size: int, device: torch.device, dtype: torch.dtype
) -> tuple[TargetModel, Drafter | None]:
    """A fresh tiny target (and drafter) per case: the target's taps are set by its engine, and fresh
    models keep cases apart. Wide inits keep the target's logits far from ties and give the drafter
    drafts that are not near-uniform; the drafter (domino: with the Domino head and shifted labels,
    else a plain DFlash one) taps every target layer."""
    shapes = {**common.TINY, "block_size": block_size}
    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    target = common.build_target(shapes, dtype, device, initializer_range=0.2, rope_parameters=rope)
    if mode not in ("dflash", "domino"):
        return target, None
    torch.manual_seed(1)
    drafter = common.build_drafter(
        shapes,
        dtype,
        device,
        intermediate_size=96,
        rope_theta=10000.0,
        target_layer_ids=list(range(shapes["target_layers"])),
        projector_type="domino" if mode == "domino" else None,
        shift_label=mode == "domino",
    )
    return target, common.widen_init(drafter, std=0.2)


def prompts(batch: int, seed: int) -> list[list[int]]:
    """Random prompts of 16..31 tokens (never the drafter's mask token, the vocabulary's last)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 32, (batch,), generator=gen).tolist()
    return [torch.randint(0, common.TINY["vocab_size"] - 1, (n,), generator=gen).tolist() for n in lengths]


# -- where the time goes -------------------------------------------------------------------------


@dataclass
class Probe:
    """Times the captured functions (timing pass) and excludes them from counting (so reads and
    syncs there, none on a graph, are not counted)."""

    device: torch.device
    timing: bool = False
    excluded: Excluded = field(default_factory=Excluded)
    captured_s: float = 0.0
    captured_cpu_s: float = 0.0  # this thread's CPU time (time.thread_time) inside the captured part
    run_s: float = 0.0
    verify_calls: int = 0
    propose_calls: int = 0
    dynamic_verifies: int = 0  # run_verify found no bucket: the dynamic forward ran (host time)

    def reset(self) -> None:
        self.captured_s = self.captured_cpu_s = self.run_s = 0.0
        self.verify_calls = self.propose_calls = self.dynamic_verifies = 0

    @contextlib.contextmanager
    def captured(self) -> Iterator[None]:
        if self.timing:
            common.synchronize(self.device)  # queued eager work is host time, not this function's
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            with self.excluded.region():
                yield
        finally:
            if self.timing:
                common.synchronize(self.device)
                self.captured_s += time.perf_counter() - t0
                self.captured_cpu_s += time.thread_time() - c0


class TimedGraph:
    """Stands in for a bucket's CUDA graph: its replay, timed."""

    def __init__(self, graph: torch.cuda.CUDAGraph, probe: Probe) -> None:
        self.graph, self.probe = graph, probe

    def replay(self) -> None:
        with self.probe.captured():
            self.graph.replay()


def _timed_fn(fn: Callable[..., Any], probe: Probe) -> Callable[..., Any]:
    def run(*inputs: torch.Tensor) -> Any:
        with probe.captured():
            return fn(*inputs)

    return run


def _timed_run(run: Callable[..., Any], probe: Probe, kind: str) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        if probe.timing:
            common.synchronize(probe.device)
        t0 = time.perf_counter()
        out = run(*args)
        if probe.timing:
            probe.run_s += time.perf_counter() - t0  # the captured part synchronized at its end
        if kind == "verify":
            probe.verify_calls += out is not None
            probe.dynamic_verifies += out is None
        else:
            probe.propose_calls += out is not None
        return out

    return wrapped


def install_probe(engine: Engine, probe: Probe) -> None:
    """Wrap the engine's own static steps (on the instances: model/engine/static.py is not touched): the
    captured part of every bucket, and run_verify / run_propose around them (the engine verifies
    through `engine.static`, its drafter proposer drafts through the same instance)."""
    steps = engine.static
    assert steps is not None, "static shapes are off"
    drafting = engine.drafter_proposer
    assert drafting is None or (drafting.static is steps and engine.proposer is drafting), "drafts bypass engine.static"
    buckets: list[StaticFunction] = [*steps.verify.values(), *steps.propose.values(), *steps.propose_sampled.values()]
    for bucket in buckets:
        if bucket.graph is not None:
            bucket.graph = TimedGraph(bucket.graph, probe)  # type: ignore[assignment]
        else:
            bucket.fn = _timed_fn(bucket.fn, probe)
    steps.run_verify = _timed_run(steps.run_verify, probe, "verify")  # type: ignore[method-assign]
    steps.run_propose = _timed_run(steps.run_propose, probe, "propose")  # type: ignore[method-assign]
    steps.run_propose_sampled = _timed_run(steps.run_propose_sampled, probe, "propose")  # type: ignore[method-assign]


# -- one case ------------------------------------------------------------------------------------


def check_decode(engine: Engine, outputs: list[RequestOutput], batch: int) -> int:
    """A measured step must be a decode step of the whole batch with no row finishing; its tokens."""
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    if errors:  # step() turns a failed step into error outputs
        raise RuntimeError(f"the engine failed a step: {errors[0]}")
    timing = engine.last_timing
    if timing is None or timing.kind != "decode" or timing.batch_size != batch:
        raise RuntimeError(f"expected a decode step of {batch} rows, got {timing}")
    bad = [o for o in outputs if o.finished]
    if bad:
        raise RuntimeError(f"a row finished during measurement: {bad[0].finish_reason} {bad[0].error or ''}")
    return sum(len(o.new_token_ids) for o in outputs)


def tokens_per_step_bound(block_size: int, ngram_max_drafts: int = EngineConfig.ngram_max_drafts) -> int:
    """The most tokens a row commits in one step: every draft of either proposer, plus the bonus."""
    return max(block_size, ngram_max_drafts) + 1


def timed_steps(engine: Engine, probe: Probe, steps: int, batch: int, s: Samples) -> None:
    device = probe.device
    gc.collect()
    probe.timing = True
    for _ in range(steps):
        probe.reset()
        common.synchronize(device)
        t0, c0, kv0 = time.perf_counter(), time.thread_time(), engine.kv_bytes_read
        outputs = engine.step()
        common.synchronize(device)
        s.step_s.append(time.perf_counter() - t0)
        s.kv_bytes_read.append(engine.kv_bytes_read - kv0)
        s.step_cpu_s.append(time.thread_time() - c0)
        s.captured_s.append(probe.captured_s)
        s.captured_cpu_s.append(probe.captured_cpu_s)
        s.run_s.append(probe.run_s)
        s.tokens += check_decode(engine, outputs, batch)
        s.verify_calls += probe.verify_calls
        s.propose_calls += probe.propose_calls
        s.dynamic_verifies += probe.dynamic_verifies
    probe.timing = False


def counted_steps(
    engine: Engine, probe: Probe, counter: ReadCounter, steps: int, batch: int, s: Samples
) -> Counter[str]:
    """Count reads (and on CUDA syncs) per step; the CUDA syncs' sites."""
    counter.counting = True
    with cuda_sync_log(probe.device, probe.excluded) as syncs:
        for _ in range(steps):
            counter.new_step()
            before = {name: counter.total(key) for name, key in COUNTS.items()}
            n_syncs = len(syncs)
            with counter:
                outputs = engine.step()
            for name, key in COUNTS.items():
                s.counts[name].append(counter.total(key) - before[name])
            s.cuda_syncs.append(len(syncs) - n_syncs)
            check_decode(engine, outputs, batch)
    counter.counting = False
    return Counter(syncs)


def run_case(
    mode: str,
    batch: int,
    sampling: str,
    policy: str,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    budget = (args.warmup + 2 * args.steps + 1) * tokens_per_step_bound(args.block_size)
    rows = prompts(batch, args.seed)
    target, drafter = build_models(mode, args.block_size, device, dtype)
    probe = Probe(device)
    counter = ReadCounter(device, probe.excluded)
    # On the CPU, residency tracking from the engine's construction on, so that its host-side state
    # (the policy's tables) is known to be host state. CUDA needs none (and captures graphs here).
    with counter if device.type == "cpu" else contextlib.nullcontext():
        config = EngineConfig(
            mode=mode,
            max_batch_size=batch,
            max_model_len=max(map(len, rows)) + budget,
            draft_policy=policy,
            static_shapes=True,
        )
        engine = Engine(target, drafter, config)
        for i, prompt in enumerate(rows):
            params = SamplingParams(max_new_tokens=budget, temperature=SAMPLINGS[sampling], ignore_eos=True)
            engine.add_request(f"row-{i}", prompt, params)
        engine.step()  # one prefill admits every row (max_batch_size == batch)
    if engine.num_running != batch or engine.num_waiting:
        raise RuntimeError(f"prefill admitted {engine.num_running} of {batch} rows")
    install_probe(engine, probe)
    for _ in range(args.warmup):
        check_decode(engine, engine.step(), batch)
    s = Samples()
    timed_steps(engine, probe, args.steps, batch, s)
    sync_sites = counted_steps(engine, probe, counter, args.steps, batch, s)
    case = {"policy": policy, "mode": mode, "batch": batch, "sampling": sampling, "temperature": SAMPLINGS[sampling]}
    cuda_sites = sync_sites if device.type == "cuda" else None
    return summarize(case, s, counter.counts, cuda_sites, engine.max_drafts_per_step)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.step_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: ar,ngram,dflash,domino")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--samplings", default="greedy,sampled", help="greedy (temperature 0), sampled (temperature 1)")
    p.add_argument(
        "--policies",
        default="adaptive,fixed",
        help="draft policies (adaptive: the engine's default, which pauses drafting that does not pay, as a "
        "random drafter's does not; fixed: a full block every step)",
    )
    p.add_argument("--steps", type=int, default=30, help="timed (and then counted) decode steps per case")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--block-size", type=int, default=6, help="the drafter's block size")
    common.add_output_args(p)  # --threads, --seed, --json, --markdown
    p.set_defaults(threads=1)  # one torch thread: every CPU op runs on the timed thread
    args = p.parse_args(argv)
    args.modes, args.samplings = common.parse_names(args.modes), common.parse_names(args.samplings)
    args.batches, args.policies = common.parse_ints(args.batches), common.parse_names(args.policies)
    for name, values, allowed in (
        ("--modes", args.modes, MODES),
        ("--samplings", args.samplings, SAMPLINGS),
        ("--policies", args.policies, POLICIES),
    ):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            p.error(f"{name}: unknown {unknown}; choose from {list(allowed)}")
    if not (args.modes and args.batches and args.samplings and args.policies):
        p.error("--modes, --batches, --samplings and --policies need at least one value each")
    if args.steps < 1 or args.warmup < 0 or any(b < 1 for b in args.batches):
        p.error("--steps and --batches must be >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device, dtype = common.device_and_dtype(args.device, args.dtype)
    env = common.host_environment(device, dtype)  # the load average at the start; the end's below
    results = []
    for mode in args.modes:
        # ar never drafts: one policy is enough.
        for policy in args.policies[:1] if mode == "ar" else args.policies:
            for batch in args.batches:
                for sampling in args.samplings:
                    r = run_case(mode, batch, sampling, policy, args, device, dtype)
                    print(
                        f"{mode:>6} {policy:>8} batch {batch:>2} {sampling:>7}: host {r['host_ms']['median']:.2f} "
                        f"ms/step (step {r['step_ms']['median']:.2f}), reads {r['reads']['mean']:.1f}/step",
                        file=sys.stderr,
                    )
                    results.append(r)
    env["load_average_end"] = common.load_average()
    result = {"benchmark": "step_overhead", "environment": env, "config": common.flags(args), "results": results}
    report = markdown(result)
    write_reports(result, report, args.json, args.markdown)
    print(report)
    return result


if __name__ == "__main__":
    main()
