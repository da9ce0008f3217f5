"""The parts of the GPU check (bench/gpu_check/driver.py runs them in this order, each in its time box).

Every part records each measurement as soon as it has it (`check.record`), so a part cut off by its
box keeps what it measured. The planted Qwen3-8B-shaped target (bench/gpu_check/planted.py: the next
token is the one 32 positions back, so a match needs attention over the KV cache) is built once,
by the first part that needs it, and shared. The greedy-identity and teacher-forced checks live in
bench/gpu_check/correctness.py.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import transformers
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

from bench import common
from bench.gpu_check.correctness import greedy_identity, teacher_forced
from bench.gpu_check.planted import build_engine, build_planted, measure, oracle_of
from bench.gpu_check.state import Check, PartTimeout, Skip
from model.engine.engine import Engine
from model.engine.sampling import SamplingBatch
from model.engine.static import StaticFunction, bucket_for, verify_widths
from model.nn.target import cache_argument

# Sizes per device type; the CLI's --capacities etc. override them. The CPU ones only check that
# everything runs (at --scale 16): CPU figures are wall times, never GPU figures.
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {"capacities": [2048, 8192, 32768], "batch_sizes": [1, 16], "repeats": 50, "new_tokens": 256,
             "e2e_repeats": 3, "prompt_len": 128, "e2e_capacity": 2048, "greedy_requests": 6, "greedy_budget": 40},
    "cpu": {"capacities": [256, 512, 1024], "batch_sizes": [1, 4], "repeats": 3, "new_tokens": 40,
            "e2e_repeats": 1, "prompt_len": 32, "e2e_capacity": 256, "greedy_requests": 5, "greedy_budget": 16},
}  # fmt: skip
LONG_WIDTHS = (1, 17)  # verify widths timed at the longer capacities


def device_and_dtype(check: Check) -> tuple[torch.device, torch.dtype]:
    if "device" not in check.shared:
        check.shared["device"], check.shared["dtype"] = common.device_and_dtype(check.args.device, check.args.dtype)
    return check.shared["device"], check.shared["dtype"]


def sizes(check: Check) -> dict[str, Any]:
    device, _ = device_and_dtype(check)
    out = dict(SIZES["cuda" if device.type == "cuda" else "cpu"])
    for key in ("capacities", "batch_sizes", "repeats", "new_tokens", "e2e_repeats"):
        if getattr(check.args, key) is not None:
            out[key] = getattr(check.args, key)
    return out


def clock(device: torch.device) -> str:
    return "cuda_events" if device.type == "cuda" else "wall_time_cpu"


def model(check: Check) -> tuple[Any, Any]:
    """The planted target and the drafter, built on first use (the build is timed and recorded)."""
    if "model" not in check.shared:
        device_and_dtype(check)
        target, drafter, planted, build_s = build_planted(check.args)
        drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
        check.record("build", seconds=build_s, planted=planted, cache_kwarg=target.cache_kwarg,
                     params=sum(p.numel() for p in target.hf_model.parameters()), **memory(target.device))  # fmt: skip
        # Not fatal here: timings do not need the rule; correctness and e2e report it failing.
        check.shared["planted_ok"] = planted["greedy_is_copy"] == 1.0
        check.shared["model"] = (target, drafter)
    return check.shared["model"]


def memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}


# -- SDPA backend ------------------------------------------------------------------------------


def sdpa_choices(device: torch.device, dtype: torch.dtype, capacity: int) -> dict[str, str]:
    """The backend SDPA picks for the target's two verify shapes at this capacity: T = 1 (transformers'
    path, keys repeated per head, a mask) and T = 17 folded per kv head (model/nn/attention.py)."""
    from torch.nn.attention import SDPBackend

    names = {int(getattr(SDPBackend, n).value): n for n in dir(SDPBackend) if n.isupper()}
    s = common.scaled_shapes(1)  # full-size heads: the kernels' choice depends on them, not on --scale
    heads, kvh, hd, t = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], 17
    rep = heads // kvh

    def mk(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    shapes = {
        "verify_T1": (mk(1, heads, 1, hd), mk(1, heads, capacity, hd), mk(1, heads, capacity, hd), 1),
        "verify_T17_packed": (mk(1, kvh, rep * t, hd), mk(1, kvh, capacity, hd), mk(1, kvh, capacity, hd), rep * t),
    }
    out = {}
    for name, (q, k, v, rows) in shapes.items():
        mask = torch.zeros(1, 1, rows, capacity, device=device, dtype=dtype)
        out[name] = names.get(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)), "unknown")
    return out


def sdpa_pin(check: Check) -> list[Any]:
    """The backends to pin for every eager and graph run: the ones chosen for the verify shapes,
    plus each other backend whose presence changes neither choice (so that other shapes, prefill
    and HF's own forward, still find a kernel)."""
    if "sdpa" not in check.shared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        device, dtype = device_and_dtype(check)
        cap = sizes(check)["capacities"][0]
        chosen = sdpa_choices(device, dtype, cap)
        pin = [getattr(SDPBackend, n) for n in sorted(set(chosen.values()) - {"unknown"})]
        for extra in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION"):
            backend = getattr(SDPBackend, extra)
            if backend not in pin and pin:
                with sdpa_kernel([*pin, backend]):
                    if sdpa_choices(device, dtype, cap) == chosen:
                        pin.append(backend)
        check.shared["sdpa"] = pin
        check.record("sdpa", capacity=cap, chosen=chosen, pinned=[b.name for b in pin])
    return check.shared["sdpa"]


@contextlib.contextmanager
def pinned(check: Check) -> Iterator[None]:
    from torch.nn.attention import sdpa_kernel

    pin = sdpa_pin(check)
    with sdpa_kernel(pin) if pin else contextlib.nullcontext(), torch.inference_mode():
        yield


# -- timing ------------------------------------------------------------------------------------


def time_calls(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 3) -> dict[str, Any]:
    """Per-call ms of fn() (common.sample_ms): median, p10 and p90."""
    samples = common.sample_ms(fn, device, warmup, repeats)
    samples.sort()

    def q(p: float) -> float:
        return samples[min(len(samples) - 1, round(p * (len(samples) - 1)))]

    return {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "n": len(samples), "clock": clock(device)}


# -- parts -------------------------------------------------------------------------------------


def nvidia_smi() -> dict[str, str]:
    fields = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu,pstate"  # noqa: E501
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=15
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    return dict(zip(fields.split(","), (x.strip() for x in out.splitlines()[0].split(",")))) if out else {}


def part_env(check: Check) -> None:
    device, dtype = device_and_dtype(check)
    check.record(
        "versions",
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        device=str(device),
        device_name=common.device_name(device),
        dtype=str(dtype).removeprefix("torch."),
        cpu_threads=torch.get_num_threads(),
        # The keyword model/nn/target.py passes the cache under (inspected on this transformers).
        cache_kwarg=cache_argument(Qwen3Model.forward),
    )
    if device.type == "cuda":
        check.record("gpu", **nvidia_smi())
    sdpa_pin(check)


def part_correctness(check: Check) -> None:
    target, drafter = model(check)
    with pinned(check):
        sz = sizes(check)
        teacher_forced(check, target, drafter, sz["batch_sizes"])
        greedy_identity(check, target, drafter, sz["greedy_requests"], sz["greedy_budget"])
    if not check.shared["planted_ok"]:
        raise AssertionError("the planted copy rule does not hold (see the build record)")


def part_timings(check: Check) -> None:
    """Graph replays of verify and the proposal, through the engine's own static functions."""
    target, drafter = model(check)
    device = target.device
    sz = sizes(check)
    graphs = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(check.args.seed)
    block = drafter.config.block_size
    with pinned(check):
        for i, cap in enumerate(sz["capacities"]):
            batches = sz["batch_sizes"] if i == 0 else [1]
            widths = verify_widths(drafter.config.num_drafts) if i == 0 else LONG_WIDTHS
            # A dynamic engine: its caches and static functions are built here, one bucket at a time.
            engine = Engine(target, drafter, mode="domino", max_batch_size=max(batches), draft_policy="fixed",
                            max_model_len=cap - block - 1, static_shapes=False)  # fmt: skip
            ctx = engine.cache.capacity - 2 * (block + 1)  # nearly full: eager attends over about as much
            engine.cache.set_lengths(0, [ctx] * engine.cache.num_slots)
            assert engine.draft_cache is not None
            engine.draft_cache.set_lengths(0, [ctx] * engine.draft_cache.num_slots)
            base = {"capacity": engine.cache.capacity, "context": ctx}
            for rb in batches:
                for t in widths:
                    tokens = torch.randint(0, target.vocab_size, (rb, t), device=device, generator=gen)
                    verify = partial(engine.runner.static_verify, span=engine.cache.capacity)
                    fn = StaticFunction(f"verify[{rb}x{t}]", verify, (tokens,), graphs)
                    variant = "graph" if fn.graph is not None else "static"
                    check.record("verify", batch=rb, T=t, variant=variant, **base,
                                 **time_calls(partial(fn, tokens), device, sz["repeats"]))  # fmt: skip
                    if rb == 1 and i == 0 and t in LONG_WIDTHS:  # the dynamic path, as the CPU serves
                        eager = partial(target.forward, engine.cache, 0, tokens, taps=engine.runner.taps)
                        check.record("verify", batch=rb, T=t, variant="eager", **base,
                                     **time_calls(eager, device, sz["repeats"]))  # fmt: skip
                    del fn
                if i == 0:
                    time_proposals(check, engine, rb, graphs, base, sz["repeats"])
            del engine
            common.free_memory(device)


def time_proposals(check: Check, engine: Engine, rb: int, graphs: bool, base: dict, repeats: int) -> None:
    """The greedy proposal of a full block, head off (DFlash) and on (Domino), as graphs; the head's
    cost is their difference. At batch 1 also the eager (dynamic) proposal."""
    device = engine.device
    proposer = engine.drafter_proposer
    assert proposer is not None
    anchors = torch.randint(0, engine.target.vocab_size, (rb,), device=device)
    ms = {}
    for head in (False, True):
        proposer.use_head = head  # read while capturing: each graph keeps its own setting
        propose = partial(proposer.static_block, span=proposer.cache.capacity)
        fn = StaticFunction(f"propose[{rb}]", propose, (anchors,), graphs)
        rec = check.record("propose", batch=rb, head=head, variant="graph" if fn.graph is not None else "static",
                           **base, **time_calls(lambda fn=fn: fn(anchors), device, repeats))  # fmt: skip
        ms[head] = rec["median_ms"]
        if rb == 1:
            greedy = SamplingBatch.all_greedy_rows(rb, device)
            eager = partial(proposer.draft_block, 0, anchors, greedy, engine.num_drafts)
            check.record("propose", batch=rb, head=head, variant="eager", **base, **time_calls(eager, device, repeats))
        del fn
    proposer.use_head = True
    check.record("head", batch=rb, variant="graph" if graphs else "static", median_ms=ms[True] - ms[False],
                 clock=clock(device), how="propose head on - head off, medians")  # fmt: skip


def bare_step_ms(engine: Engine, batch: int, repeats: int) -> float | None:
    """GPU time of one full step's model work: the step's verify bucket (+ proposal) replayed back
    to back. Step wall minus this is the host's share."""
    if engine.static is None or not engine.static.use_graphs:
        return None  # on the CPU "bare" would be eager wall time: no GPU/host split to make
    rb = bucket_for(batch, engine.static.batch_sizes)
    assert rb is not None
    span = max(engine.static.spans)
    verify = engine.static.verify[(rb, max(engine.static.verify_widths), span)]
    propose = engine.static.propose.get((rb, span))

    def step() -> None:
        if propose is not None:
            propose(*propose.inputs)
        verify(*verify.inputs)

    return time_calls(step, engine.device, repeats)["median_ms"]


def part_e2e(check: Check) -> None:
    target, drafter = model(check)
    device = target.device
    sz = sizes(check)
    max_model_len = sz["e2e_capacity"] - drafter.config.block_size - 1
    graphs = device.type == "cuda"
    gen = torch.Generator().manual_seed(check.args.seed)
    with pinned(check):
        for batch in sz["batch_sizes"]:
            prompts = torch.randint(0, target.vocab_size, (batch, sz["prompt_len"]), generator=gen).tolist()
            runs = [("ar", "fixed", [1.0]), ("domino", "fixed", check.args.taus)]
            if batch == max(sz["batch_sizes"]):
                runs.append(("domino", "adaptive", [max(check.args.taus)]))
            ar_tps = None
            for mode, policy, taus in runs:
                engine = build_engine(target, drafter, mode, "graph", batch, max_model_len, draft_policy=policy)
                warm = common.static_warmup(engine)
                bare = bare_step_ms(engine, batch, sz["repeats"])
                for tau in taus:
                    rec = measure(engine, prompts, tau, sz["new_tokens"], sz["e2e_repeats"])
                    if mode == "ar":
                        ar_tps = rec["tokens_per_s"]
                    extra = {"speedup_vs_graph_ar": rec["tokens_per_s"] / ar_tps if ar_tps else None}
                    if bare is not None:
                        extra |= {"bare_step_ms": bare, "host_ms_per_step": rec["step_ms"] - bare}
                    fell_back = warm is not None and device.type == "cuda" and warm["eager"] > 0
                    check.record("e2e", batch=batch, mode=mode, policy=policy, variant="graph", warmup=warm,
                                 oracle=oracle_of(engine) is not None, fell_back_to_eager=fell_back,
                                 clock="wall" if graphs else "wall_time_cpu", **rec, **extra)  # fmt: skip
                del engine
                common.free_memory(device)


def run_pytest(check: Check, name: str, selection: str, limit: float) -> None:
    """tests/model/test_cuda.py -k selection in its own process (own session: killed as a group at
    `limit` or when the part's box ends), its output streamed into the log; one record."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/model/test_cuda.py",
           "-k", selection]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    root = common.REPO
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root,
                            start_new_session=True)  # fmt: skip
    kill = threading.Timer(max(limit, 1.0), lambda: os.killpg(proc.pid, signal.SIGKILL))
    kill.start()
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="")
            tail = (tail + [line.strip()])[-3:]
        rc = proc.wait()
    except PartTimeout:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        check.record("pytest", name=name, selection=selection, rc=None, timed_out=True, tail=tail)
        raise
    finally:
        kill.cancel()
        kill.join()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", " ".join(tail))}
    check.record("pytest", name=name, selection=selection, rc=rc, timed_out=rc == -signal.SIGKILL,
                 seconds=round(time.monotonic() - t0, 1), counts=counts, tail=tail)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"pytest {name}: exit {rc}: {tail[-1] if tail else ''}")


def part_cuda_tests(check: Check) -> None:
    if not torch.cuda.is_available():
        raise Skip("needs a CUDA device: torch.cuda.is_available() is False")
    check.shared.pop("model", None)  # the tests build their own tiny models; give back the big one
    common.free_memory(torch.device("cuda"))
    failed = None
    try:
        # Tiny-model tests and one chi-square (10k samples through CUDA graphs); not the two bench
        # smoke tests (this check runs the benches itself) nor the other chi-squares.
        run_pytest(check, "tiny_and_chi_square", "not capture_failure and not runs_on_cuda and "
                   "(not sampling or through_cuda_graphs)", check.part_remaining() - 25)  # fmt: skip
    except RuntimeError as exc:
        failed = exc
    # Last and alone: a deliberate capture failure must not leave a broken CUDA context to others.
    run_pytest(check, "capture_failure", "capture_failure", check.part_remaining())
    if failed is not None:
        raise failed


PART_FUNCTIONS: dict[str, Callable[[Check], None]] = {
    "env": part_env,
    "correctness": part_correctness,
    "timings": part_timings,
    "e2e": part_e2e,
    "cuda_tests": part_cuda_tests,
}
