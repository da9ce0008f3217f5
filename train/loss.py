"""The training objective (docs/design.md §1.5) and its schedules.

Every block `[x_a, MASK...]` sees the context features of positions < a and itself (blocks never
see each other); slot j's label is x_{a+1+j} (shift_label) or x_{a+j}; the Domino head is
teacher-forced over the ground-truth block tokens; the loss moves from the base logits to the
corrected ones as λ falls from 1 to 0 over the first half. Optionally each slot's loss mixes the
hard label with the target's own top-k distribution (distillation) and decays with the slot index.
"""

from __future__ import annotations

import math
import random

import torch

from model.nn.drafter import Drafter


def lambda_schedule(progress: float, until: float = 0.5) -> float:
    """Weight of the base-logit loss: 1 -> 0 linearly over the first `until` of training (half by
    default; a run continuing a trained drafter can shorten it, its head needs no re-anchoring)."""
    if until <= 0:
        return 0.0
    return max(0.0, 1.0 - progress / until)


def lr_schedule(progress: float, warmup: float) -> float:
    """Multiplier of the peak learning rate at `progress` in [0, 1]: linear warm-up over the first
    `warmup` fraction, then cosine decay to 0."""
    if progress < warmup:
        return max(progress, 1e-3 * warmup) / warmup
    rest = (progress - warmup) / max(1e-9, 1.0 - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, rest)))


def training_progress(step: int, total_steps: int, elapsed_s: float, time_budget_s: float | None) -> float:
    """Fraction of training done: by steps, or by wall time when a budget is set (whichever is further),
    so a time-boxed run still warms up, anneals and ends on schedule."""
    progress = step / total_steps
    if time_budget_s:
        progress = max(progress, elapsed_s / time_budget_s)
    return min(1.0, progress)


def default_gamma(block_size: int) -> float:
    """Per-slot loss decay exp(-j / γ): the DFlash recipe's γ ≈ 7 for B = 16, ≈ 4 for B = 8 (later
    slots are reached only when every earlier one is accepted, so they matter less)."""
    return 0.45 * block_size


def sample_batch(
    picked: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None, torch.Tensor | None]],
    anchors: int,
    rng: random.Random,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Pad picked sequences (ids [N], features [N, K*H], answer start, optional top-k ids/log-probs
    [N, k]) into a batch: ids [S, N], feats [S, N, K*H] float32, lengths [S], anchors [S, M]
    (-1 = none) and, when every sequence has them, soft_ids/soft_logp [S, N, k]."""
    seqs = len(picked)
    n = max(len(p[0]) for p in picked)
    kh = picked[0][1].shape[1]
    batch = {
        "ids": torch.zeros(seqs, n, dtype=torch.long),
        "feats": torch.zeros(seqs, n, kh),
        "lengths": torch.zeros(seqs, dtype=torch.long),
        "anchors": torch.full((seqs, anchors), -1, dtype=torch.long),
    }
    with_soft = all(p[3] is not None for p in picked)
    if with_soft:
        k = picked[0][3].shape[1]  # type: ignore[union-attr]
        batch["soft_ids"] = torch.zeros(seqs, n, k, dtype=torch.long)
        batch["soft_logp"] = torch.full((seqs, n, k), float("-inf"))
    for r, (ids, feats, answer_start, soft_ids, soft_logp) in enumerate(picked):
        batch["ids"][r, : len(ids)] = ids
        batch["feats"][r, : len(ids)] = feats.float()
        batch["lengths"][r] = len(ids)
        if with_soft:
            batch["soft_ids"][r, : len(ids)] = soft_ids.long()  # type: ignore[union-attr]
            batch["soft_logp"][r, : len(ids)] = soft_logp.float()  # type: ignore[union-attr]
        # Anchors are committed answer positions with at least one label after them.
        choices = range(max(1, answer_start - 1), len(ids) - 1)
        chosen = rng.sample(choices, min(anchors, len(choices)))
        batch["anchors"][r, : len(chosen)] = torch.tensor(sorted(chosen), dtype=torch.long)
    return {k: v.to(device) for k, v in batch.items()}


def soft_targets(
    soft_ids: torch.Tensor, soft_logp: torch.Tensor, dist_pos: torch.Tensor, vocab_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k distribution at positions dist_pos [S, M, B], renormalised over the
    tokens the drafter can propose: (draft-vocabulary ids [S, M, B, k], probabilities)."""
    s, m, b = dist_pos.shape
    k = soft_ids.shape[-1]
    index = dist_pos.reshape(s, m * b, 1).expand(-1, -1, k)
    ids = soft_ids.gather(1, index).view(s, m, b, k)
    logp = soft_logp.gather(1, index).view(s, m, b, k)
    if vocab_map is not None:
        ids = vocab_map[ids]
        logp = logp.masked_fill(ids < 0, float("-inf"))
    probs = torch.softmax(logp, dim=-1).nan_to_num(0.0)  # a slot with no proposable token: all zero
    return ids.clamp_min(0), probs


def training_loss(
    drafter: Drafter,
    batch: dict[str, torch.Tensor],
    lam: float,
    vocab_map: torch.Tensor | None,
    gamma: float | None = None,
    distill: float = 0.0,
    detach_head: bool = False,
) -> dict[str, torch.Tensor]:
    """Loss of a batch from `sample_batch`: S sequences with M anchors each.

    detach_head trains the head on a detached backbone: the backbone learns from CE(base) alone,
    exactly as a DFlash drafter does, the head from CE(base + correction), and λ is unused.

    distill > 0 mixes each slot's hard-label cross-entropy with the cross-entropy against the
    target's stored top-k distribution (same positions): (1 - distill) * CE(label) + distill * CE(p_target).
    """
    ids, feats, lengths, anchors = batch["ids"], batch["feats"], batch["lengths"], batch["anchors"]
    cfg = drafter.config
    s, n = ids.shape
    m, b = anchors.shape[1], cfg.block_size
    dev = ids.device
    valid_anchor = anchors >= 0
    a = anchors.clamp_min(0)
    offs = torch.arange(b, device=dev)
    positions = (a[:, :, None] + offs).reshape(s, m * b)  # [S, M*B]
    # Ground-truth tokens x_{a+j} and labels.
    gather_at = (a[:, :, None] + offs).clamp_max(n - 1)
    truth = ids.gather(1, gather_at.reshape(s, -1)).view(s, m, b)
    shift = 1 if cfg.shift_label else 0
    label_pos = a[:, :, None] + offs + shift
    labels = ids.gather(1, label_pos.clamp_max(n - 1).reshape(s, -1)).view(s, m, b)
    label_ok = (label_pos < lengths[:, None, None]) & valid_anchor[:, :, None]
    if not cfg.shift_label:
        label_ok[:, :, 0] = False  # the anchor slot is not a draft
    if vocab_map is not None:
        labels = vocab_map[labels]
        label_ok &= labels >= 0
    labels = labels.clamp_min(0)

    block = torch.full((s, m, b), cfg.mask_token_id if cfg.mask_token_id is not None else 0, device=dev)
    block[:, :, 0] = truth[:, :, 0]
    x = drafter.block_input(block.view(s * m, b)).view(s, m * b, -1)

    context = drafter.project_context(feats)
    ctx_kv = drafter.context_keys_values(context, torch.arange(n, device=dev).expand(s, n))
    key_pos = torch.arange(n, device=dev)
    ctx_visible = key_pos[None, None, :] < a[:, :, None]  # [S, M, N]
    same_block = torch.eye(m, dtype=torch.bool, device=dev)[:, None, :, None].expand(m, b, m, b).reshape(m * b, m * b)
    mask = torch.cat(
        [ctx_visible[:, :, None, :].expand(s, m, b, n).reshape(s, m * b, n), same_block.expand(s, -1, -1)], dim=-1
    )[:, None]

    def combine(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = ctx_kv[layer]
        return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)

    hidden = drafter.run_layers(x, positions, combine, mask).view(s, m, b, -1)
    base = drafter.base_logits(hidden)  # [S, M, B, V]
    weights = label_ok.float()
    if gamma:
        weights = weights * torch.exp(-offs.float() / gamma)
    denom = weights.sum().clamp_min(1.0)
    soft = None
    if distill > 0:
        # The target's distribution over slot j's token is its output after position label_pos - 1.
        soft = soft_targets(batch["soft_ids"], batch["soft_logp"], (label_pos - 1).clamp(0, n - 1), vocab_map)

    def ce(logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        losses = -logp.gather(-1, labels[..., None]).squeeze(-1)
        if soft is not None:
            soft_ce = -(logp.gather(-1, soft[0]) * soft[1]).sum(-1)
            losses = (1 - distill) * losses + distill * soft_ce
        return (losses * weights).sum() / denom

    out: dict[str, torch.Tensor] = {"base": ce(base)}
    final = base
    if cfg.has_head:
        gru_out, _ = drafter.prefix_gru(drafter.embed(truth.view(s * m, b)))
        # Detached, the final loss reaches only the head's own parameters, so a plain sum gives each
        # part exactly its own gradient.
        base_in, hidden_in = (base.detach(), hidden.detach()) if detach_head else (base, hidden)
        corrected = base_in + drafter.correction(hidden_in, gru_out.view(s, m, b, -1))
        p = cfg.pure_draft_prefix_len
        final = torch.cat([base_in[:, :, :p], corrected[:, :, p:]], dim=2)
        out["final"] = ce(final)
        if detach_head:
            out["loss"] = out["final"] + out["base"]
        else:
            out["loss"] = (1 - lam) * out["final"] + lam * out["base"]
    else:
        out["final"] = out["base"]
        out["loss"] = out["base"]
    out["final_logits"] = final.detach()
    with torch.no_grad():
        hit = (final.argmax(-1) == labels) & label_ok
        out["acc"] = hit.float().sum() / label_ok.float().sum().clamp_min(1.0)
    return out
