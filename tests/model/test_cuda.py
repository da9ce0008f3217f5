"""The engine on a CUDA device in bf16: greedy output against HF generate, and lossless sampling.

Skipped where no CUDA device is present (CI runs on CPUs). The checks are plain functions taking a
device, so they can also be run on the CPU (in bf16) by hand, e.g. when changing them.

bf16 and exactness: the engine verifies several tokens per forward with a ragged 4D mask while HF
generate runs one token at a time, so the two compute the same logits with different kernels and
roundings. Where the target's two best tokens are closer than that rounding error, greedy decoding
may legitimately pick either. A mismatch is therefore accepted only when it is such a near-tie,
judged against an fp32 forward of the same (bf16-rounded) weights, and when the engine's whole
output stays greedy under fp32 within the same tolerance; most sequences must still match exactly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from model.engine.engine import Engine, SamplingParams
from model.engine.requests import TokenLogprob
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target
from tests.model.test_engine import _prompts
from tests.model.test_sampling import ALPHA, _chi_square, _exact_joint, assert_power

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"),
]

MODES = ("ar", "dflash", "domino")


# -- greedy ------------------------------------------------------------------------------------


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def next_token_logprobs(model: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log-softmax [len(continuation), V] (fp32, CPU) of the positions that chose each continuation token."""
    dev = next(model.parameters()).device
    logits = model(torch.tensor([prompt + continuation], device=dev)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).cpu()


def judge_greedy(lp32: torch.Tensor, toks: list[int], ref: list[int], tol: float) -> tuple[int, float] | None:
    """None when toks == ref; (position, fp32 gap) when they part at a near-tie; else AssertionError.

    lp32 [len(toks), V]: fp32 logprobs along the engine's own output toks.
    """
    # The engine's whole output is greedy under fp32 up to rounding, also after a tie.
    gaps = lp32.max(-1).values - lp32.gather(-1, torch.tensor(toks)[:, None]).squeeze(-1)
    assert float(gaps.max()) <= tol, ("not greedy", toks, ref, gaps.tolist(), tol)
    if toks == ref:
        return None
    # Up to the first difference both saw the same prefix: there both choices must be near-tied.
    i = next(j for j, (a, b) in enumerate(zip(toks, ref)) if a != b)
    ref_gap = float(lp32[i].max() - lp32[i, ref[i]])
    pair_gap = abs(float(lp32[i, toks[i]] - lp32[i, ref[i]]))
    assert ref_gap <= tol and pair_gap <= tol, ("not a near-tie", i, toks, ref, pair_gap, tol)
    return i, pair_gap


def check_greedy(device: str, dtype: torch.dtype = torch.bfloat16, num_prompts: int = 8) -> dict[str, Any]:
    """Engine (ar / dflash / domino, batch 3 so rows join and leave) against HF generate."""
    model = tiny_target("qwen3").to(device, dtype)
    ref32 = copy.deepcopy(model).float()  # the same rounded weights, fp32 arithmetic
    prompts = _prompts(num_prompts)
    budgets = [20, 7, 13, 25, 4, 16, 11, 22, 18, 9][:num_prompts]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    # Rounding scale of the HF path: its logprobs against fp32 over the reference continuations.
    err_hf = max(
        float((next_token_logprobs(model, p, r) - next_token_logprobs(ref32, p, r)).abs().max())
        for p, r in zip(prompts, refs)
    )
    runs: dict[str, list[tuple[list[int], Any, list[Any]]]] = {}
    err_engine = 0.0
    for mode in MODES:
        drafter = tiny_drafter(domino=True).to(device, dtype) if mode != "ar" else None
        # Every draft verified (the adaptive policy may skip drafting for a random drafter).
        engine = Engine(
            TargetModel(model), drafter, mode=mode, max_batch_size=3, max_model_len=96, draft_policy="fixed"
        )
        ids = [f"{mode}-{i}" for i in range(len(prompts))]
        for rid, p, n in zip(ids, prompts, budgets):
            engine.add_request(rid, p, SamplingParams(max_new_tokens=n, logprobs=2))
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        lps: dict[str, list[Any]] = {rid: [] for rid in ids}
        stats: dict[str, Any] = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.finish_reason != "error", out.error
                tokens[out.request_id] += out.new_token_ids
                lps[out.request_id] += out.logprobs or []
                if out.finished:
                    stats[out.request_id] = out.stats
        runs[mode] = [(tokens[rid], stats[rid], lps[rid]) for rid in ids]
        # Rounding scale of the engine path: its reported top-2 logprobs against fp32.
        for p, (toks, _, lp) in zip(prompts, runs[mode]):
            lp32 = next_token_logprobs(ref32, p, toks)
            for i, tl in enumerate(lp):
                for tok, val in tl.top:
                    err_engine = max(err_engine, abs(val - float(lp32[i, tok])))
    # Both paths within err of fp32 on every logprob => a flip needs an fp32 gap <= 2 * err.
    tol = 2 * max(err_hf, err_engine)

    exact, ties = 0, []
    for mode in MODES:
        for p, n, ref, (toks, st, lp) in zip(prompts, budgets, refs, runs[mode]):
            assert len(toks) == n and len(lp) == n
            assert sum(st.acceptance_lengths) == n - 1  # the first token comes from prefill
            tie = judge_greedy(next_token_logprobs(ref32, p, toks), toks, ref, tol)
            if tie is None:
                exact += 1
            else:
                ties.append((mode, *tie))
    # The speculative modes verified multi-token blocks and accepted some drafts.
    for mode in ("dflash", "domino"):
        assert sum(st.accepted_tokens for _, st, _ in runs[mode]) > 0, mode
        assert max(max(st.acceptance_lengths, default=1) for _, st, _ in runs[mode]) >= 2, mode
    total = len(MODES) * len(prompts)
    # Near-ties are the exception: most sequences must be identical token for token.
    assert exact * 2 >= total, f"only {exact}/{total} exact; ties {ties}, tol {tol:.3g}"
    return {"exact": exact, "total": total, "ties": ties, "tol": tol, "err_hf": err_hf, "err_engine": err_engine}


def test_greedy_bf16_matches_hf_generate() -> None:
    summary = check_greedy("cuda", torch.bfloat16)
    print(f"bf16 greedy on CUDA: {summary}")


# -- sampling ----------------------------------------------------------------------------------


class OnDevice:
    """Lets tests.model.test_sampling._exact_joint (CPU token ids in, `.logits` out) use a device model."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.model(ids.to(self.device)).logits.float().cpu())


def check_sampling(
    device: str,
    dtype: torch.dtype,
    temperature: float,
    top_p: float,
    top_k: int,
    n: int,
    static_shapes: bool | None = None,
) -> tuple[float, float]:
    """tests/model/test_sampling's distribution test with the engine on `device` in `dtype`.

    The expected distribution comes from the same model in the same dtype on the same device
    (a plain HF forward), i.e. the distribution the target itself defines there.
    static_shapes: the engine's (None: its default, on for CUDA); when on, every bucket must be a
    captured graph and the verify graphs must have run. Returns (p-value, acceptance rate).
    """
    vocab, depth = 8, 3
    model = tiny_target(vocab=vocab, seed=3).to(device, dtype)
    drafter = tiny_drafter(vocab=vocab, block_size=4, std=0.3, seed=4).to(device, dtype)
    # Every draft verified, as in tests/model/test_sampling.py (the adaptive policy's draft count depends
    # on the sampled drafts' own probabilities, which biases sampling rows; see the issue report).
    engine = Engine(
        TargetModel(model),
        drafter,
        mode="domino",
        max_batch_size=128,
        max_model_len=16,
        draft_policy="fixed",
        static_shapes=static_shapes,
    )
    prompt = [1, 2, 3]
    params = [
        SamplingParams(max_new_tokens=5, temperature=temperature, top_p=top_p, top_k=top_k, seed=i) for i in range(n)
    ]
    results = engine.generate([prompt] * n, params)
    counts: dict[tuple, int] = {}
    for tokens, _, _ in results:
        key = tuple(tokens[:depth])
        counts[key] = counts.get(key, 0) + 1
    if engine.static is not None and device != "cpu":
        assert_all_graphs(engine)
        assert replayed_verify_buckets(engine), "no verify ran through a CUDA graph"
    drafted = sum(r[1].draft_tokens for r in results)
    accepted = sum(r[1].accepted_tokens for r in results)
    assert 0.03 < accepted / drafted < 0.97, (accepted, drafted)
    assert max(max(r[1].acceptance_lengths) for r in results) >= 3

    with torch.no_grad():
        expected = _exact_joint(OnDevice(model), prompt, depth, temperature, top_k, top_p)
        pvalue = _chi_square(counts, expected, n)
        assert pvalue > ALPHA, (pvalue, temperature, top_p, top_k)
    assert_power(counts, expected, n)
    return pvalue, accepted / drafted


@pytest.mark.slow
def test_speculative_sampling_bf16() -> None:
    """bf16, temperature only, the dynamic path. n is kept at 10k: the engine's multi-token verify
    and HF's forward round differently in bf16, a bias a much larger sample starts to resolve (seen
    on a CPU in bf16 at 20k: p = 0.01). The wrong-temperature check shows the test still has power
    at this size."""
    pvalue, rate = check_sampling("cuda", torch.bfloat16, 1.0, 1.0, 0, n=10_000, static_shapes=False)
    print(f"bf16 T=1 on CUDA, dynamic path: p-value {pvalue:.3g}, acceptance {rate:.3f}")


@pytest.mark.slow
def test_speculative_sampling_bf16_through_cuda_graphs() -> None:
    """The same test with every verify replayed from a captured CUDA graph (batches padded to
    buckets of up to 128 rows; sampling rows' proposals run the dynamic drafter path)."""
    pvalue, rate = check_sampling("cuda", torch.bfloat16, 1.0, 1.0, 0, n=10_000, static_shapes=True)
    print(f"bf16 T=1 on CUDA, CUDA graphs: p-value {pvalue:.3g}, acceptance {rate:.3f}")


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.7, 0.8, 0), (1.0, 1.0, 3)], ids=["top_p", "top_k"])
def test_speculative_sampling_truncated_fp32(temperature: float, top_p: float, top_k: int) -> None:
    """top-p / top-k on CUDA, in fp32: their support is a discontinuous function of the logits, and
    in bf16 the engine's and HF's roundings put a near-tied token on different sides of the cut (a
    CPU bf16 run sampled a sequence outside HF's bf16 top-3), which no exact test can allow for."""
    pvalue, rate = check_sampling("cuda", torch.float32, temperature, top_p, top_k, n=20_000)
    print(f"fp32 T={temperature} top_p={top_p} top_k={top_k} on CUDA: p-value {pvalue:.3g}, acceptance {rate:.3f}")


# -- static shapes and CUDA graphs -------------------------------------------------------------

GRAPH_MODES = ("ar", "ngram", "dflash", "domino")


def assert_all_graphs(engine: Engine) -> None:
    """Every static-shape bucket was captured: none fell back to eager (model/engine/static.py logs why)."""
    assert engine.static is not None and engine.static.use_graphs
    report = engine.static.report
    assert report is not None and report.graphs > 0 and report.eager == 0, report


def replayed_verify_buckets(engine: Engine) -> set[int]:
    """Batch buckets whose verify ran as a CUDA graph at least once."""
    assert engine.static is not None
    return {rb for (rb, _, _), f in engine.static.verify.items() if f.calls and f.graph is not None}


def cuda_engine(model: Any, mode: str, batch: int, graphs: bool, dtype: torch.dtype = torch.bfloat16) -> Engine:
    """An engine on the dynamic path (graphs False) or with every bucket a CUDA graph; a fresh
    drafter each (an engine sets the drafter's head flag for its mode)."""
    drafter = tiny_drafter(domino=True).to("cuda", dtype) if mode in ("dflash", "domino") else None
    engine = Engine(
        TargetModel(model),
        drafter,
        mode=mode,
        max_batch_size=batch,
        max_model_len=96,
        draft_policy="fixed",
        static_shapes=graphs,
        cuda_graphs=graphs,
    )
    if graphs:
        assert_all_graphs(engine)
    else:
        assert engine.static is None
    return engine


Run = tuple[list[list[int]], list[list[TokenLogprob]], list[int]]


def run_requests(engine: Engine, prompts: list[list[int]], budgets: list[int], join_every: int = 0) -> Run:
    """Greedy requests with top-2 logprobs: all queued at once (join_every 0), or one joining every
    `join_every` steps. Returns tokens and logprobs per request and the batch size of every decode step."""
    ids = [str(i) for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    lps: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
    pending = list(range(len(prompts)))
    sizes: list[int] = []
    steps = 0
    while pending or engine.has_unfinished():
        if pending and (join_every == 0 or steps % join_every == 0):
            joining = pending if join_every == 0 else pending[:1]
            for i in joining:
                engine.add_request(ids[i], prompts[i], SamplingParams(max_new_tokens=budgets[i], logprobs=2))
            pending = pending[len(joining) :]
        if engine.num_running and not (engine.num_waiting and engine.num_running < engine.max_batch_size):
            sizes.append(engine.num_running)  # this step decodes (a prefill comes first when there is room)
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens[out.request_id] += out.new_token_ids
            lps[out.request_id] += out.logprobs or []
        steps += 1
    return [tokens[rid] for rid in ids], [lps[rid] for rid in ids], sizes


def logprob_error(ref32: Any, prompt: list[int], toks: list[int], lps: list[TokenLogprob]) -> float:
    """Largest gap between the engine's reported top-2 logprobs and fp32's along its own output."""
    lp32 = next_token_logprobs(ref32, prompt, toks)
    return max((abs(val - float(lp32[i, tok])) for i, tl in enumerate(lps) for tok, val in tl.top), default=0.0)


def judge_graph_against_eager(ref32: Any, prompts: list[list[int]], eager: Run, graph: Run) -> dict[str, Any]:
    """Both runs greedy under fp32 within their rounding; the graph run equal to the eager one token
    for token, or parted from it at a near-tie only; most requests exactly equal."""
    err = max(
        logprob_error(ref32, p, toks, lp) for run in (eager, graph) for p, toks, lp in zip(prompts, run[0], run[1])
    )
    tol = 2 * err  # each path within err of fp32 => a flip needs an fp32 gap <= 2 * err
    exact, ties = 0, []
    for i, (p, e_toks, g_toks) in enumerate(zip(prompts, eager[0], graph[0])):
        assert len(g_toks) == len(e_toks), (i, e_toks, g_toks)
        assert judge_greedy(next_token_logprobs(ref32, p, e_toks), e_toks, e_toks, tol) is None
        tie = judge_greedy(next_token_logprobs(ref32, p, g_toks), g_toks, e_toks, tol)
        if tie is None:
            exact += 1
        else:
            ties.append((i, *tie))
    assert exact * 2 >= len(prompts), f"only {exact}/{len(prompts)} exact; ties {ties}, tol {tol:.3g}"
    return {"exact": exact, "total": len(prompts), "ties": ties, "tol": tol}


@pytest.fixture(scope="module")
def bf16_qwen3() -> tuple[Any, Any]:
    """A tiny random Qwen3 in bf16 on CUDA, and the same rounded weights in fp32 (the judge)."""
    model = tiny_target("qwen3").to("cuda", torch.bfloat16)
    return model, copy.deepcopy(model).float()


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_cuda_graphs_match_eager_bf16(bf16_qwen3: tuple[Any, Any], mode: str) -> None:
    """8 requests through batch 3 (padded to bucket 4, rows leaving and joining as others finish):
    CUDA-graph replays against the dynamic path."""
    model, ref32 = bf16_qwen3
    prompts = _prompts(8)
    budgets = [20, 7, 13, 25, 4, 16, 11, 22]
    eager = run_requests(cuda_engine(model, mode, 3, graphs=False), prompts, budgets)
    engine = cuda_engine(model, mode, 3, graphs=True)
    graph = run_requests(engine, prompts, budgets)
    summary = judge_graph_against_eager(ref32, prompts, eager, graph)
    assert engine.static is not None and replayed_verify_buckets(engine)
    if mode in ("dflash", "domino"):
        assert any(f.calls for f in engine.static.propose.values()), "the greedy proposal never replayed"
    print(f"{mode}: graphs vs eager {summary}, warm-up {engine.static.report}")


@pytest.mark.parametrize("mode", ["ar", "domino"])
def test_cuda_graphs_rows_join_and_leave_across_buckets(bf16_qwen3: tuple[Any, Any], mode: str) -> None:
    """One request joins every other step into batch 4: decode batches grow 1 -> 2 -> 3 -> 4 and
    shrink again, replaying the graphs of buckets 1, 2 and 4 in turn."""
    model, ref32 = bf16_qwen3
    prompts = _prompts(8)
    budgets = [20, 7, 13, 25, 4, 16, 11, 22]
    eager = run_requests(cuda_engine(model, mode, 4, graphs=False), prompts, budgets, join_every=2)
    engine = cuda_engine(model, mode, 4, graphs=True)
    graph = run_requests(engine, prompts, budgets, join_every=2)
    judge_graph_against_eager(ref32, prompts, eager, graph)
    assert {1, 2, 4} <= set(graph[2]), graph[2]
    assert replayed_verify_buckets(engine) == {1, 2, 4}
    if mode == "domino":
        assert engine.static is not None
        assert {rb for (rb, _), f in engine.static.propose.items() if f.calls} == {1, 2, 4}


@pytest.mark.parametrize("mode", ["ar", "domino"])
def test_cuda_graphs_batch_shrinks_mid_decode(bf16_qwen3: tuple[Any, Any], mode: str) -> None:
    """Four rows start together and finish one by one (budgets 4, 20, 40, 60) while the others keep
    decoding: the batch drops from bucket 4 (4 and 3 rows) to 2 to 1, each finished row's slot
    refilled by a move of the last row, and no one's output changes."""
    model, ref32 = bf16_qwen3
    prompts = _prompts(4)
    budgets = [60, 4, 20, 40]
    eager = run_requests(cuda_engine(model, mode, 4, graphs=False), prompts, budgets)
    engine = cuda_engine(model, mode, 4, graphs=True)
    graph = run_requests(engine, prompts, budgets)
    judge_graph_against_eager(ref32, prompts, eager, graph)
    sizes = graph[2]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 4 and {4, 2, 1} <= set(sizes), sizes
    assert [len(t) for t in graph[0]] == budgets
    assert replayed_verify_buckets(engine) == {1, 2, 4}
    if mode == "domino":
        assert engine.static is not None
        assert {rb for (rb, _), f in engine.static.propose.items() if f.calls} == {1, 2, 4}


def test_capture_failure_falls_back_to_eager() -> None:
    """A function that reads a device value back cannot be captured: StaticFunction must run it
    eagerly instead and leave the process as before (the default stream current again, and later
    captures still working)."""
    from model.engine.static import StaticFunction

    x = torch.arange(4, device="cuda", dtype=torch.float32)

    def syncing(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (t * float(t.sum()),)  # float(): a host read, which a capture cannot contain

    failed = StaticFunction("syncing", syncing, (x,), graph=True)
    assert failed.graph is None
    assert torch.cuda.current_stream() == torch.cuda.default_stream(), "the capture stream is still current"
    (out,) = failed(x + 1)  # eagerly on the new input: [1, 2, 3, 4] * 10
    assert out.tolist() == [10.0, 20.0, 30.0, 40.0]
    doubled = StaticFunction("double", lambda t: (t * 2,), (x,), graph=True)
    assert doubled.graph is not None
    (out,) = doubled(x + 1)
    assert torch.equal(out, (x + 1) * 2)


def test_a_decode_step_waits_for_the_device_only_to_read_its_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft and verify are timed by CUDA events read after the results' copy (model/engine/timing.py):
    no torch.cuda.synchronize() in a decode step, and the policy still gets both costs."""
    model = tiny_target().to("cuda")
    engine = Engine(TargetModel(model), tiny_drafter(domino=True).to("cuda"), mode="domino", max_batch_size=2)
    engine.generate(_prompts(2), SamplingParams(max_new_tokens=4))  # warm: allocations, the first steps
    calls: list[str] = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append("sync"), real(*a, **k))[1])
    for i, prompt in enumerate(_prompts(2)):
        engine.add_request(f"timed-{i}", prompt, SamplingParams(max_new_tokens=12))
    engine.step()  # the prefill
    decode_steps = 0
    while engine.has_unfinished():
        engine.step()
        timing = engine.last_timing
        assert timing is not None and timing.kind == "decode" and timing.verify_seconds > 0
        decode_steps += 1
    assert decode_steps > 0 and calls == []
    assert engine.policy.costs.verify_s and engine.policy.costs.draft_s


# -- the cost benchmark ------------------------------------------------------------------------


def test_gpu_costs_runs_on_cuda(tmp_path: Path) -> None:
    from bench.gpu_check.costs import MODES as BENCH_MODES
    from bench.gpu_check.costs import main

    out = tmp_path / "costs.json"
    main(
        [
            "--scale", "16", "--device", "cuda", "--contexts", "128", "--batch-sizes", "2",
            "--repeats", "2", "--warmup", "1", "--json", str(out), "--markdown", str(tmp_path / "costs.md"),
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["environment"]["dtype"] == "bfloat16" and result["environment"]["device"].startswith("cuda")
    (row,) = result["rows"]
    assert all(t > 0 for t in row["target_ms"].values())
    assert all(row["engine"][m]["step_ms"] > 0 for m in BENCH_MODES)
    assert row["projection"]["domino"]["speedup"] > 0
    # The graph engines captured every bucket; the static ones built them eagerly.
    for w in result["warmup"]:
        if w["variant"] == "graph":
            assert w["graphs"] > 0 and w["eager"] == 0, w
        else:
            assert w["graphs"] == 0 and w["eager"] > 0, w
    assert all(t > 0 for times in row["graph_vs_eager"].values() for t in times.values())


def test_planted_oracle_runs_through_graphs_on_cuda() -> None:
    """The oracle in bf16: the planted target stays greedy-exact through the graphs, and the
    acceptance lengths are exactly the scheduled ones."""
    from tests.helpers import planted_records

    for batch in (1, 2):
        for r in planted_records(
            "cuda", ["eager", "graph"], [1.0, 4.0, 7.17], batch, max_new_tokens=40, max_model_len=128
        ):
            assert r["copy_match"] == 1.0 and r["tau"] == pytest.approx(r["tau_expected"]), r
            if r["variant"] == "graph":
                assert r["warmup"]["graphs"] > 0 and r["warmup"]["eager"] == 0, r
