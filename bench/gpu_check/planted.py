"""End-to-end decoding at Qwen3-8B / Domino-b16 shapes with acceptance forced to a chosen tau: what
the GPU check's correctness and e2e parts (bench/gpu_check/parts.py) decode with.

Random weights accept nothing, so the target is given a planted greedy rule and the drafts are
made to follow it for a scheduled number of slots:

- planted target (`plant_copy`): the greedy next token at position i is the token at i + 1 - 32,
  so the target continues its context with period 32. Layer 0's attention finds that position by
  RoPE position alone and copies the token from the KV cache; a match tests attention, positions
  and the cache, not just the current token. The embedding rows are large (they dominate the
  residual stream, whatever the random layers add), so the margin is wide in bf16 too. Only weight
  values change: every layer still runs at full size, so costs are real;
- oracle drafter (`OracleProposer`): the real drafter runs every step (its static-shape bucket /
  CUDA graph where the engine has one), then its drafts are replaced by the target's own greedy
  continuation of each row for the first a_s slots of step s and a wrong token after, with
  a_s = floor((s + 1)(tau - 1)) - floor(s (tau - 1)): acceptance length tau on average, exactly (a
  row's last steps are cut by its token budget; `tau_expected` allows for it).

`measure` decodes the same prompts at batch size B (all rows admitted in one prefill, equal budgets,
so they finish together); tokens/s counts the tokens after each row's first over the time after the
prefill. Engines (`build_engine`): `ar` or the oracle, as `eager` (the dynamic path), `static`
(static-shape buckets run eagerly) or `graph` (the buckets replayed as CUDA graphs; on the CPU the
same code as static). Static-shape engines attend over their whole capacity, so a short run is not
made cheaper by a small cache.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench import common
from model.engine.engine import Engine, SamplingParams
from model.engine.proposers import DraftProposer, Proposal
from model.engine.row import Row
from model.engine.sampling import SamplingBatch
from model.nn.drafter import Drafter
from model.nn.target import TargetModel

# -- the planted target ------------------------------------------------------------------------

COPY_OFFSET = 32  # the planted rule: next token at position i = the token at i + 1 - COPY_OFFSET
COPY_FREQS = 8  # RoPE frequency pairs the planted head uses: the fastest, sharpest in position


@torch.no_grad()
def plant_copy(target: TargetModel, seed: int, embed_rms: float, offset: int = COPY_OFFSET, gain: float = 8.0) -> None:
    """Make the target's greedy next token at position i the token at position i + 1 - offset: it
    continues its context with period `offset`. A match therefore needs layer 0's attention to read
    the right earlier position back from the KV cache (by RoPE position alone), not just the token.

    Embedding rows: random unit directions u_v (orthogonal to one shared direction c) plus c, times
    embed_rms * sqrt(H): they dominate the residual stream whatever the random layers add. Layer 0:
    q and k read only c, so they are the same for every token; after q_norm / k_norm (gain `gain`) and
    RoPE their score is gain^2 sqrt(d) * mean_f cos(theta_f (delta - (offset - 1))) over the fastest
    COPY_FREQS frequencies: one sharp peak at delta = offset - 1. v reads u_v (not c), o_proj writes
    the copied token's code d_v (3x the embedding's norm) and LM head row v is d_v's direction.
    Only weight values change: every layer still runs at full size, so costs are real."""
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    vocab, hidden = embed.shape
    dev, dt = embed.device, embed.dtype
    gen = torch.Generator(device=dev).manual_seed(seed)
    attn = target.decoder.layers[0].self_attn
    hd = target.head_dim
    heads, kv_heads = attn.q_proj.weight.shape[0] // hd, attn.k_proj.weight.shape[0] // hd
    c = torch.randn(hidden, generator=gen, device=dev)
    c /= c.norm()
    alpha, beta = 0.8, 0.6  # |alpha u + beta c| = 1: the normalised layer-0 input is sqrt(H) (alpha u + beta c)
    for lo in range(0, vocab, 8192):  # in chunks: no full-vocabulary fp32 copy at full size
        u = torch.randn(min(8192, vocab - lo), hidden, generator=gen, device=dev)
        u -= (u @ c)[:, None] * c
        u /= u.norm(dim=-1, keepdim=True)
        embed[lo : lo + len(u)] = (embed_rms * hidden**0.5 * (alpha * u + beta * c)).to(dt)
    for norm in (target.decoder.layers[0].input_layernorm, target.decoder.norm, attn.q_norm, attn.k_norm):
        norm.weight.fill_(1.0)
    attn.q_norm.weight.fill_(gain)
    attn.k_norm.weight.fill_(gain)
    # q = q_vec, k = k_vec for every token (they read c only); z_q = 1, z_k = e^{i theta D} per frequency.
    theta = target.decoder.rotary_emb.inv_freq.float().to(dev)[:COPY_FREQS]
    q_vec, k_vec = torch.zeros(hd, device=dev), torch.zeros(hd, device=dev)
    q_vec[:COPY_FREQS] = 1.0
    k_vec[:COPY_FREQS] = torch.cos(theta * (offset - 1))
    k_vec[hd // 2 : hd // 2 + COPY_FREQS] = torch.sin(theta * (offset - 1))
    read_c = c[None, :] / (beta * hidden**0.5)
    attn.q_proj.weight.copy_((q_vec.repeat(heads)[:, None] * read_c).to(dt))
    attn.k_proj.weight.copy_((k_vec.repeat(kv_heads)[:, None] * read_c).to(dt))
    w_v = torch.randn(kv_heads * hd, hidden, generator=gen, device=dev) / hidden**0.5
    w_v -= (w_v @ c)[:, None] * c[None, :]  # values carry the token, not the shared part
    w_o = torch.randn(hidden, heads * hd, generator=gen, device=dev) / (heads * hd) ** 0.5
    # Each query head reads kv head h // rep (transformers' repeat_kv): o_proj of one kv head's value.
    w_ov = w_o.view(hidden, kv_heads, heads // kv_heads, hd).sum(2).reshape(hidden, kv_heads * hd) @ w_v
    sample = embed[:1024].float() / embed_rms
    factor = 3.0 * embed_rms * hidden**0.5 / float((sample @ w_ov.T).norm(dim=-1).mean())
    w_o *= factor
    w_ov *= factor
    attn.v_proj.weight.copy_(w_v.to(dt))
    attn.o_proj.weight.copy_(w_o.to(dt))
    for lo in range(0, vocab, 8192):
        d = embed[lo : lo + 8192].float() / embed_rms @ w_ov.T  # the copied token's code in the residual
        head[lo : lo + len(d)] = (d / d.norm(dim=-1, keepdim=True)).to(head.dtype)


def copy_continuation(seq: list[int], offset: int, n: int) -> list[int]:
    """The planted target's greedy continuation of `seq`: n tokens, each the one `offset` back."""
    ext = list(seq[-offset:])
    for _ in range(n):
        ext.append(ext[-offset])
    return ext[-n:] if n else []


@torch.no_grad()
def check_planted(
    target: TargetModel, seed: int, offset: int = COPY_OFFSET, rows: int = 2, extra: int = 48
) -> dict[str, Any]:
    """One HF forward over random tokens: the share of positions with a source (i >= offset - 1)
    whose greedy next token is the one offset back, and the smallest top-2 logit margin there."""
    length = offset + extra
    gen = torch.Generator(device=target.device).manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (rows, length), generator=gen, device=target.device)
    logits = target.hf_model(input_ids=ids).logits.float()[:, offset - 1 : -1]
    top = logits.topk(2, dim=-1)
    return {
        "rule": f"next token = the token {offset} positions back",
        "greedy_is_copy": float((top.indices[..., 0] == ids[:, : length - offset]).float().mean()),
        "min_margin": float((top.values[..., 0] - top.values[..., 1]).min()),
    }


# -- the oracle --------------------------------------------------------------------------------


def accepted_at(tau: float, step: int) -> int:
    """Drafts right in step `step`: the schedule's mean over steps is tau - 1."""
    return math.floor((step + 1) * (tau - 1) + 1e-9) - math.floor(step * (tau - 1) + 1e-9)


def expected_acceptance(tau: float, max_new_tokens: int, num_drafts: int) -> list[int]:
    """One row's acceptance lengths under the schedule: the first token comes from the prefill, and
    each step verifies at most the row's remaining budget - 1 drafts (the engine's fixed policy)."""
    lengths, made, step = [], 1, 0
    while made < max_new_tokens:
        drafts = min(num_drafts, max_new_tokens - made - 1)
        lengths.append(min(accepted_at(tau, step), drafts) + 1)
        made += lengths[-1]
        step += 1
    return lengths


class OracleProposer:
    """Runs the real drafter, then proposes the planted target's greedy continuation of each row
    (`copy_continuation` of its prompt + output) right for `accepted_at(tau, step)` slots and
    wrong after (a model.engine.proposers.DraftProposer in the drafter's place)."""

    def __init__(
        self,
        inner: DraftProposer,
        num_drafts: int,
        vocab_size: int,
        tau: float = 1.0,
        offset: int = COPY_OFFSET,
        knows_confidence: bool = False,
    ) -> None:
        self.inner, self.num_drafts, self.vocab_size, self.offset = inner, num_drafts, vocab_size, offset
        # The adaptive policy drafts by the drafter's confidence, which a random drafter has none
        # of: with knows_confidence the oracle reports 0.95 for its right slots and 0.05 after.
        self.knows_confidence = knows_confidence
        self.set_tau(tau)

    def set_tau(self, tau: float) -> None:
        if not 1 <= tau <= self.num_drafts + 1:
            raise ValueError(f"tau must be in [1, {self.num_drafts + 1}], got {tau}")
        self.tau, self.proposals = tau, 0

    def propose(
        self, lo: int, rows: Sequence[Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> Proposal:
        draft = self.inner.propose(lo, rows, anchors, sampling, num_slots)  # the drafter's real cost
        tails = [(row.prompt_ids + row.output_ids)[-self.offset :] for row in rows]  # output_ids[-1]: the anchor
        right = torch.tensor([copy_continuation(t, self.offset, num_slots) for t in tails], device=anchors.device)
        right = right.reshape(len(rows), num_slots)
        slots = torch.arange(num_slots, device=anchors.device)
        good = accepted_at(self.tau, self.proposals)
        self.proposals += 1
        tokens = torch.where(slots[None, :] < good, right, (right + 1) % self.vocab_size)
        confidence = draft.confidence
        if self.knows_confidence and confidence is not None:
            known = torch.where(slots < good, 0.95, 0.05).to(confidence.dtype)
            confidence = known[None, : confidence.shape[1]].expand_as(confidence).contiguous()
        return Proposal(tokens, draft.token_probs, draft.draft_probs, confidence)


def oracle_engine(
    target: TargetModel, drafter: Drafter, *, tau: float = 1.0, knows_confidence: bool = False, **config: Any
) -> Engine:
    """An engine whose drafts are the oracle's; the real drafter still runs (and is timed) inside."""
    engine = Engine(target, drafter, **config)
    assert engine.drafter_proposer is not None
    engine.proposer = OracleProposer(
        engine.drafter_proposer, engine.num_drafts, target.vocab_size, tau, knows_confidence=knows_confidence
    )
    return engine


def oracle_of(engine: Engine) -> OracleProposer | None:
    return engine.proposer if isinstance(engine.proposer, OracleProposer) else None


# -- runs --------------------------------------------------------------------------------------


def decode(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """Decode every prompt at once; tokens/s after the prefill, and each row's tokens and stats."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    lengths: dict[str, list[int]] = {}

    def collect(outputs: list[Any]) -> None:
        for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                lengths[out.request_id] = list(out.stats.acceptance_lengths)

    collect(engine.step())  # the prefill: every row is admitted together
    if engine.num_waiting:
        raise RuntimeError("max_batch_size must hold every prompt")
    common.synchronize(engine.device)
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        collect(engine.step())
        steps += 1
    common.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    decoded = sum(len(t) - 1 for t in tokens.values())
    all_lengths = [n for rid in ids for n in lengths.get(rid, [])]
    return {
        "tokens_per_s": decoded / seconds if seconds > 0 else math.inf,
        "seconds": seconds,
        "steps": steps,
        "step_ms": 1e3 * seconds / max(steps, 1),
        "decoded_tokens": decoded,
        "tau": sum(all_lengths) / max(len(all_lengths), 1),
        "tokens": [tokens[rid] for rid in ids],
        "acceptance_lengths": [lengths.get(rid, []) for rid in ids],
    }


def copy_match(prompts: list[list[int]], outputs: list[list[int]], offset: int = COPY_OFFSET) -> float:
    """Share of generated tokens equal to the token `offset` back (1.0: the engine decoded greedily)."""
    hits = total = 0
    for prompt, toks in zip(prompts, outputs):
        seq = prompt + toks
        hits += sum(seq[p] == seq[p - offset] for p in range(len(prompt), len(seq)))
        total += len(toks)
    return hits / max(total, 1)


def timed_runs(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int, repeats: int, num_drafts: int
) -> dict[str, Any]:
    """One warm-up decode, then the median of `repeats` (tau, expected tau and output checks kept)."""
    decode(engine, prompts, min(max_new_tokens, 2 * num_drafts + 2))  # warm-up: kernels, allocator
    runs = []
    for _ in range(repeats):
        if (oracle := oracle_of(engine)) is not None:
            oracle.set_tau(oracle.tau)  # the schedule restarts with every run
        runs.append(decode(engine, prompts, max_new_tokens))
    best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    out = {k: v for k, v in best.items() if k not in ("tokens", "acceptance_lengths")}
    out["tokens_per_s_all"] = [r["tokens_per_s"] for r in runs]
    out["copy_match"] = min(copy_match(prompts, r["tokens"]) for r in runs)
    out["acceptance_lengths_row0"] = best["acceptance_lengths"][0]
    return out


def build_engine(
    target: TargetModel,
    drafter: Drafter | None,
    mode: str,
    variant: str,
    batch: int,
    max_model_len: int,
    draft_policy: str = "fixed",
) -> Engine:
    static_shapes, cuda_graphs = common.VARIANTS[variant]
    shared: dict[str, Any] = {
        "max_batch_size": batch,
        "max_model_len": max_model_len,
        "static_shapes": static_shapes,
        "cuda_graphs": cuda_graphs,
    }
    if mode == "ar":
        return Engine(target, None, mode="ar", **shared)
    # fixed: every draft is verified (full blocks, as the published numbers); no n-gram copies.
    # adaptive: the policy sees the oracle's own confidence (right slots high, wrong ones low).
    assert drafter is not None
    return oracle_engine(
        target, drafter, mode=mode, draft_policy=draft_policy, ngram=False, knows_confidence=draft_policy == "adaptive",
        **shared,
    )  # fmt: skip


def measure(
    engine: Engine,
    prompts: list[list[int]],
    tau: float,
    max_new_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """One (engine, tau) record: tokens/s (median of `repeats`), step ms, tau measured / expected."""
    oracle = oracle_of(engine)
    num_drafts = engine.num_drafts if oracle is not None else 0
    if oracle is not None:
        oracle.set_tau(tau)
    rec: dict[str, Any] = {"tau_target": tau, "capacity": engine.cache.capacity}
    rec |= timed_runs(engine, prompts, max_new_tokens, repeats, num_drafts)
    lengths = expected_acceptance(tau, max_new_tokens, num_drafts)
    rec["tau_expected"] = sum(lengths) / max(len(lengths), 1)
    return rec


def build_planted(args: argparse.Namespace) -> tuple[TargetModel, Drafter, dict[str, Any], float]:
    """The planted target, the drafter, the planted rule's check and the build seconds."""
    device, dtype = common.start(args)
    shapes = common.scaled_shapes(args.scale, args.layers_scale)
    t0 = time.perf_counter()
    target = common.build_target(shapes, dtype, device)
    drafter = common.build_drafter(shapes, dtype, device)
    plant_copy(target, args.seed, args.embed_rms)
    planted = check_planted(target, args.seed + 1)
    return target, drafter, planted, time.perf_counter() - t0
