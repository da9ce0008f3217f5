"""Measure a drafter: acceptance length τ through the engine on held-out prompts, and the same
greedy walk offline on stored target answers (no target forwards: cheap enough to pick checkpoints).

Held-out prompts (bench/prompts/sharegpt_heldout.jsonl) are split once: the first half is the
*validation* slice (choosing checkpoints, depth, block size), the second half the *test* slice
(reported only).
"""

from __future__ import annotations

import torch

from model.engine.engine import Engine, SamplingParams
from model.engine.sampling import SamplingBatch
from model.nn.drafter import Drafter
from model.nn.target import TargetModel

HELDOUT_SLICES = ("validation", "test", "all")


def heldout_slice(prompts: list[list[int]], name: str) -> list[list[int]]:
    """validation = first half of the held-out prompts, test = second half."""
    half = len(prompts) // 2
    return {"validation": prompts[:half], "test": prompts[half:], "all": prompts}[name]


def evaluate(
    target: TargetModel,
    drafter: Drafter,
    prompts: list[list[int]],
    modes: list[str],
    max_new_tokens: int,
    eos: list[int],
    batch_size: int = 8,
) -> dict[str, dict[str, object]]:
    """τ (tokens per verify step, all steps pooled) and per-slot acceptance per mode at T = 0, full blocks."""
    results: dict[str, dict[str, object]] = {}
    for mode in modes:
        engine = Engine(
            target,
            drafter,
            mode=mode,
            max_batch_size=batch_size,
            max_model_len=max(len(p) for p in prompts) + max_new_tokens,
            eos_token_ids=eos,
            draft_policy="fixed",  # τ of the drafter itself: every draft of every block is verified
            static_shapes=False,  # one short run per mode: capturing graphs would not pay back
        )
        out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
        lengths = [x for _, stats, _ in out for x in stats.acceptance_lengths]
        results[mode] = {
            "tau": sum(lengths) / max(1, len(lengths)),
            "steps": len(lengths),
            "prompts": len(prompts),
            "tau_per_slot": slot_acceptance(lengths, drafter.config.num_drafts),
        }
    return results


def slot_acceptance(lengths: list[int], num_drafts: int) -> list[float]:
    """Share of steps whose draft slot j was accepted, from per-step acceptance lengths (accepted + 1)."""
    steps = max(1, len(lengths))
    return [round(sum(1 for x in lengths if x - 1 > j) / steps, 4) for j in range(num_drafts)]


@torch.no_grad()
def offline_walk(
    drafter: Drafter,
    sequences: list[tuple[torch.Tensor, torch.Tensor, int]],
    max_new_tokens: int = 128,
    batch_size: int = 32,
    anchor_stride: int | None = None,
) -> dict[str, object]:
    """The engine's greedy walk (fixed policy, full blocks) replayed on stored target answers.

    With `anchor_stride` s the anchors are fixed instead (every s-th answer token, whatever was
    accepted): the measure of docs/design.md's CPU training curve. It reads higher than the walk,
    whose anchors follow each rejection, i.e. sit where the drafter just failed.

    sequences: (ids [N], target features [N, K*H], answer start p). When the answers are the
    target's own greedy output, the engine would commit exactly these tokens; each step drafts a
    block at the anchor x_a with context < a, accepts the longest prefix equal to x_{a+1..}, and
    moves past the bonus token, so τ here equals the engine's τ up to floating-point differences
    in the features.
    """
    drafter.eval()
    cfg = drafter.config
    dev = drafter.fc.weight.device
    lengths: list[int] = []
    for lo in range(0, len(sequences), batch_size):
        chunk = sequences[lo : lo + batch_size]
        lengths.extend(_walk_batch(drafter, chunk, max_new_tokens, dev, anchor_stride))
    return {
        "tau": sum(lengths) / max(1, len(lengths)),
        "steps": len(lengths),
        "sequences": len(sequences),
        "tau_per_slot": slot_acceptance(lengths, cfg.num_drafts),
    }


def _walk_batch(
    drafter: Drafter,
    chunk: list[tuple[torch.Tensor, torch.Tensor, int]],
    max_new_tokens: int,
    dev: torch.device,
    anchor_stride: int | None = None,
) -> list[int]:
    cfg = drafter.config
    s, b, d = len(chunk), cfg.block_size, cfg.num_drafts
    n = max(len(ids) for ids, _, _ in chunk)
    ids = torch.zeros(s, n + d + 1, dtype=torch.long, device=dev)
    feats = torch.zeros(s, n, chunk[0][1].shape[1], device=dev)
    anchor = torch.zeros(s, dtype=torch.long, device=dev)
    end = torch.zeros(s, dtype=torch.long, device=dev)  # positions < end are the generated answer
    draft_end = torch.zeros(s, dtype=torch.long, device=dev)  # drafts only at positions < draft_end
    for r, (seq, f, start) in enumerate(chunk):
        ids[r, : len(seq)] = seq.to(dev)
        feats[r, : len(seq)] = f.to(dev, torch.float32)
        anchor[r] = start
        end[r] = min(len(seq), start + max_new_tokens)
        # Like the engine: never draft past the token budget less the bonus, nor past the answer.
        draft_end[r] = min(len(seq), start + max_new_tokens - 1)
    ctx_kv = drafter.context_keys_values(drafter.project_context(feats), torch.arange(n, device=dev).expand(s, n))
    offs = torch.arange(b, device=dev)
    greedy = SamplingBatch(
        torch.zeros(s, device=dev), torch.ones(s, device=dev), torch.zeros(s, dtype=torch.long, device=dev)
    )
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else 0
    lengths: list[int] = []
    while True:
        active = anchor < end - 1
        if not bool(active.any()):
            return lengths
        a = anchor.clamp_max(n - 1)
        block = torch.full((s, b), mask_id, device=dev)
        block[:, 0] = ids.gather(1, a[:, None]).squeeze(1)
        visible = torch.cat(
            [torch.arange(n, device=dev)[None, :] < a[:, None], torch.ones(s, b, dtype=torch.bool, device=dev)], 1
        )

        def combine(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ck, cv = ctx_kv[layer]
            return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)

        hidden = drafter.run_layers(drafter.block_input(block), a[:, None] + offs, combine, visible[:, None, None, :])
        drafts = drafter.draft(hidden, block[:, 0], greedy).tokens  # [S, D]
        truth = ids.gather(1, a[:, None] + 1 + torch.arange(d, device=dev))
        valid = (a[:, None] + 1 + torch.arange(d, device=dev)) < draft_end[:, None]
        accepted = ((drafts == truth) & valid).long().cumprod(-1).sum(-1)
        lengths.extend((accepted[active] + 1).tolist())
        step = accepted + 1 if anchor_stride is None else torch.full_like(accepted, anchor_stride)
        anchor = torch.where(active, anchor + step, anchor)
