"""The GPU check's correctness part (bench/gpu_check/driver.py): at the check's model shape (full Qwen3-8B
on the GPU) with the planted copy target, whose greedy next token needs attention over the cache.

- teacher-forced: graph verify against eager (dynamic) verify against HF's own forward, logits of
  the same [anchor, drafts] at the check's batch sizes (1 and 16 on CUDA), rows of ragged lengths,
  T = 1, 4, 12, 17 (4 and 12 pad into the 5 and 17 buckets);
- greedy identity: graph and eager engines (ar, and the oracle drafter at tau 4) against HF
  `generate`, requests joining one every other step into batch 4 and leaving as they finish;
  a difference passes only as a near-tie judged on an fp32 copy;
- no bucket fell back to eager (on CUDA every static bucket must be a captured graph).

Failures are recorded first and raised at the end, so one bad check does not hide the others.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from bench import common
from bench.gpu_check.planted import COPY_OFFSET, build_engine, copy_match, oracle_of
from bench.gpu_check.state import Check
from model.engine.engine import Engine, SamplingParams

WIDTHS = (1, 4, 12, 17)
PROMPT_LENS = (40, 57, 33, 90, 64, 35)
BUDGETS = (40, 12, 25, 33, 8, 20)
MAX_MODEL_LEN = 256


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(relative logit error allowed, fp32 logprob gap that counts as a near-tie)."""
    return (1e-4, 1e-3) if dtype == torch.float32 else (2e-2, 0.05)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bucket_report(engine: Engine) -> dict[str, Any] | None:
    """Warm-up counts and whether any bucket fell back to eager (only a failure on CUDA)."""
    if engine.static is None or engine.static.report is None:
        return None
    rep = engine.static.report
    replayed = sorted(f"{rb}x{t}@{c}" for (rb, t, c), f in engine.static.verify.items() if f.calls)
    fell_back = engine.static.use_graphs and rep.eager > 0
    return {"graphs": rep.graphs, "eager": rep.eager, "fell_back": fell_back, "verify_replayed": replayed}


def prefilled(target: Any, drafter: Any, variant: str, prompts: list[list[int]]) -> Engine:
    static_shapes, cuda_graphs = common.VARIANTS[variant]
    engine = Engine(target, drafter, mode="domino", max_batch_size=len(prompts), max_model_len=MAX_MODEL_LEN,
                    draft_policy="fixed", static_shapes=static_shapes, cuda_graphs=cuda_graphs)  # fmt: skip
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=64))
    while engine.num_waiting:
        engine.step()  # prefills only: nothing decodes while requests wait and there is room
    return engine


def teacher_forced(check: Check, target: Any, drafter: Any, batches: list[int]) -> None:
    rel_tol, _ = tolerances(target.dtype)
    gen = torch.Generator().manual_seed(check.args.seed + 7)
    failures = []
    for batch in batches:
        lengths = (COPY_OFFSET + torch.randint(0, 96, (batch,), generator=gen)).tolist()
        prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        engines = {v: prefilled(target, drafter, v, prompts) for v in ("eager", "graph")}
        order = [int(r.request_id) for r in engines["graph"].rows]
        anchors = {v: [r.anchor for r in e.rows] for v, e in engines.items()}
        expected = [prompts[i][len(prompts[i]) - COPY_OFFSET] for i in order]  # the copy rule's first token
        for t in WIDTHS:
            drafts = torch.randint(0, target.vocab_size, (batch, t - 1), generator=gen).tolist()
            rows = [[a] + d for a, d in zip(anchors["graph"], drafts)]
            tokens = torch.tensor(rows, device=target.device)
            logits = {v: e.runner.verify(0, tokens).logits.float().clone() for v, e in engines.items()}
            written = sorted(set(engines["eager"].cache.written))  # the last dynamic forward's layers
            hf, copy_hits = [], 0
            for r, i in enumerate(order):
                seq = prompts[i] + rows[r]
                n = len(prompts[i])
                hf.append(target.hf_model(input_ids=torch.tensor([seq], device=target.device)).logits[0, n:].float())
                want = torch.tensor([seq[p + 1 - COPY_OFFSET] for p in range(n, n + t)], device=target.device)
                copy_hits += int((logits["graph"][r].argmax(-1) == want).sum())
            ref = torch.stack(hf)
            rec = check.record(
                "teacher_forced",
                batch=batch,
                T=t,
                row_lengths=[lengths[i] for i in order],
                graph_vs_eager=rel_err(logits["graph"], logits["eager"]),
                graph_vs_hf=rel_err(logits["graph"], ref),
                eager_vs_hf=rel_err(logits["eager"], ref),
                argmax_graph_eq_hf=float((logits["graph"].argmax(-1) == ref.argmax(-1)).float().mean()),
                copy_rule_hits=copy_hits / (batch * t),
                anchors_agree=anchors["graph"] == anchors["eager"] == expected,
                cache_layers_written=len(written) == target.num_layers,
                tolerance=rel_tol,
            )
            ok = max(rec["graph_vs_eager"], rec["graph_vs_hf"], rec["eager_vs_hf"]) <= rel_tol
            ok = ok and rec["copy_rule_hits"] == 1.0 and rec["anchors_agree"] and rec["cache_layers_written"]
            if not ok:
                failures.append(f"teacher-forced batch {batch} T {t}")
        report = bucket_report(engines["graph"])
        check.record("buckets", engine=f"teacher-forced graph, batch {batch}", **(report or {}))
        if report and report["fell_back"]:
            failures.append(f"batch {batch}: a bucket fell back to eager")
        del engines
        common.free_memory(target.device)
    if failures:
        raise AssertionError("; ".join(failures))


def hf_generate(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def run_joining(engine: Engine, prompts: list[list[int]], budgets: list[int]) -> tuple[list[list[int]], set[int]]:
    """Greedy requests joining one every other step; their tokens and every decode batch size seen."""
    tokens: list[list[int]] = [[] for _ in prompts]
    pending, steps, seen = list(range(len(prompts))), 0, set()
    while pending or engine.has_unfinished():
        if pending and (steps % 2 == 0 or not engine.has_unfinished()):
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=budgets[i]))
        seen.add(engine.num_running)
        for out in engine.step():
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            tokens[int(out.request_id)] += out.new_token_ids
        steps += 1
    return tokens, seen - {0}


@torch.no_grad()
def near_tie(ref32: Any, prompt: list[int], toks: list[int], ref: list[int], tol: float) -> float | None:
    """The fp32 logprob gap between the two tokens where toks and ref first part; None if over tol."""
    i = next(j for j, (a, b) in enumerate(zip(toks, ref)) if a != b)
    ids = torch.tensor([prompt + toks[:i]], device=next(ref32.parameters()).device)
    lp = torch.log_softmax(ref32(input_ids=ids).logits[0, -1].float(), dim=-1)
    gap = abs(float(lp[toks[i]] - lp[ref[i]]))
    return gap if gap <= tol else None


def greedy_identity(check: Check, target: Any, drafter: Any, requests: int, max_budget: int) -> None:
    """`requests` of PROMPT_LENS / BUDGETS (budgets capped at max_budget) through batch 4."""
    _, tie_tol = tolerances(target.dtype)
    gen = torch.Generator().manual_seed(check.args.seed + 11)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS[:requests]]
    budgets = [min(b, max_budget) for b in BUDGETS[:requests]]
    refs = [hf_generate(target.hf_model, p, n) for p, n in zip(prompts, budgets)]
    check.record("hf_generate", copy_match=copy_match(prompts, refs), tokens=sum(budgets))
    # The judge: the same (rounded) weights in fp32 arithmetic.
    ref32 = target.hf_model if target.dtype == torch.float32 else copy.deepcopy(target.hf_model).float()
    failures = []
    for mode, variant in (("ar", "eager"), ("ar", "graph"), ("domino", "eager"), ("domino", "graph")):
        engine = build_engine(target, drafter, mode, variant, 4, MAX_MODEL_LEN)
        if (oracle := oracle_of(engine)) is not None:
            oracle.set_tau(4.0)  # multi-token verifies with rejections: rollback is exercised
        toks, seen = run_joining(engine, prompts, budgets)
        exact, ties, bad = 0, [], []
        for i, (p, t, r) in enumerate(zip(prompts, toks, refs)):
            if t == r:
                exact += 1
                continue
            gap = near_tie(ref32, p, t, r, tie_tol) if len(t) == len(r) else None
            (bad if gap is None else ties).append({"request": i, "gap": gap})
        report = bucket_report(engine)
        check.record("greedy", mode=mode, variant=variant, exact=exact, total=len(prompts), near_ties=ties,
                     mismatches=bad, copy_match=copy_match(prompts, toks), batch_sizes_seen=sorted(seen),
                     buckets=report, tie_tolerance=tie_tol)  # fmt: skip
        if bad or exact * 2 < len(prompts) or (report and report["fell_back"]):
            failures.append(f"greedy {mode} {variant}: {exact}/{len(prompts)} exact, {len(bad)} not near-ties")
        del engine
        common.free_memory(target.device)
    del ref32
    common.free_memory(target.device)
    if failures:
        raise AssertionError("; ".join(failures))
