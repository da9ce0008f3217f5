"""`domino-train`: regenerate answers with the target (`gen`), train a drafter (`fit`), measure it (`eval`).

DESIGN §1.5: the target is frozen; labels are the target's own greedy answers; each training block
is `[x_a, MASK, ...]` at a random answer position a, sees the context features of positions < a
and itself; the Domino head is teacher-forced over the ground-truth block tokens; the loss moves
from the base logits to the corrected ones as λ falls from 1 to 0 over the first half.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.checkpoint import load_drafter, save_drafter
from model.drafter import Drafter, DrafterConfig, default_target_layer_ids
from model.engine import Engine, RequestOutput, SamplingParams
from model.loading import chat_prompt_ids, eos_token_ids, load_target, resolve_device, resolve_dtype
from model.target import TargetModel

log = logging.getLogger("domino.train")


# ---------------------------------------------------------------------------------------------
# gen: regenerate answers with the target
# ---------------------------------------------------------------------------------------------
def _shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.jsonl.gz"


def read_shards(
    data_dir: Path, taps: list[int] | None = None, features_dir: Path | None = None
) -> list[dict[str, Any]]:
    """All regenerated samples: {"i": prompt index, "prompt": [ids], "answer": [ids]}, plus
    "features" [n - 1, K*H] when gen stored them for these taps."""
    samples = []
    for path in sorted(data_dir.glob("shard-*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            shard = [json.loads(line) for line in f]
        if taps:
            fpath = _features_path(features_dir or data_dir / "features", path, taps)
            if fpath.exists():
                for sample, feats in zip(shard, torch.load(fpath)):
                    sample["features"] = feats
        samples.extend(shard)
    return samples


def _features_path(features_dir: Path, shard: Path, taps: list[int]) -> Path:
    return features_dir / (shard.name.removesuffix(".jsonl.gz") + ".taps-" + "-".join(map(str, taps)) + ".pt")


def _generate_with_features(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[tuple[list[int], torch.Tensor | None]]:
    """Answers, plus the target features of every position but the last when the engine captures them."""
    feats: list[list[torch.Tensor]] = [[] for _ in prompts]

    def keep(i: int, out: RequestOutput) -> None:
        if out.features is not None:
            feats[i].append(out.features)

    results = engine.generate(prompts, params, on_output=keep)
    return [(tokens, torch.cat(f) if f else None) for (tokens, _, _), f in zip(results, feats)]


def gen(args: argparse.Namespace) -> None:
    from model.data import load_sharegpt_prompts, split_sharegpt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    model, tokenizer = load_target(args.target, resolve_dtype(args.dtype, device), device)
    taps = [int(t) for t in args.taps.split(",")] if args.taps else []
    features_dir = Path(args.features_dir) if args.features_dir else out / "features"
    if args.prompts:
        prompts: list[Any] = load_prompt_file(Path(args.prompts), tokenizer)
    else:
        # ShareGPT first human turns; the held-out slice (bench/prompts) is never trained on.
        prompts, _heldout = split_sharegpt(load_sharegpt_prompts(), heldout=args.heldout, seed=0)
    engine = Engine(
        TargetModel(model),
        None,
        mode="ar",
        max_batch_size=args.batch_size,
        max_model_len=args.max_prompt_tokens + args.max_new_tokens,
        eos_token_ids=eos_token_ids(model, tokenizer),
        capture_taps=taps or None,
    )
    total = min(len(prompts), args.limit or len(prompts))
    num_shards = math.ceil(total / args.shard_size)
    todo = [k for k in range(args.first_shard, num_shards) if not _shard_path(out, k).exists()]
    log.info("%d train prompts, %d shards of %d, %d to do", len(prompts), num_shards, args.shard_size, len(todo))
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def shard_prompts(k: int) -> int:
        return min(args.shard_size, total - k * args.shard_size)

    bar = tqdm(total=sum(shard_prompts(k) for k in todo), desc="gen", unit="answer")
    started, last_shard_s = time.perf_counter(), 0.0
    for k in todo:
        t0 = time.perf_counter()
        if args.time_budget_s and t0 - started + last_shard_s > args.time_budget_s:
            log.info("time budget reached: stopping before shard %d (rerun to resume)", k)
            break
        batch = []
        for i in range(k * args.shard_size, min((k + 1) * args.shard_size, total)):
            ids = prompts[i] if args.prompts else chat_prompt_ids(tokenizer, [{"role": "user", "content": prompts[i]}])
            if len(ids) <= args.max_prompt_tokens:
                batch.append((i, ids))
        results = _generate_with_features(engine, [ids for _, ids in batch], params)
        if taps:
            # Features first: a shard file without its features would be recomputed, never wrong.
            features_dir.mkdir(parents=True, exist_ok=True)
            fpath = _features_path(features_dir, _shard_path(out, k), taps)
            torch.save([f for _, f in results], fpath.with_suffix(".tmp"))
            os.replace(fpath.with_suffix(".tmp"), fpath)
        tmp = _shard_path(out, k).with_suffix(".tmp")
        with gzip.open(tmp, "wt") as f:
            for (i, ids), (answer, _) in zip(batch, results):
                f.write(json.dumps({"i": i, "prompt": ids, "answer": answer}) + "\n")
        os.replace(tmp, _shard_path(out, k))
        new_tokens = sum(len(r[0]) for r in results)
        last_shard_s = time.perf_counter() - t0
        bar.update(shard_prompts(k))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()


# ---------------------------------------------------------------------------------------------
# fit: train a drafter
# ---------------------------------------------------------------------------------------------
def lambda_schedule(progress: float) -> float:
    """Weight of the base-logit loss: 1 -> 0 linearly over the first half of training."""
    return max(0.0, 1.0 - progress / 0.5)


def lr_schedule(progress: float, warmup: float) -> float:
    """Multiplier of the peak learning rate at `progress` in [0, 1]: linear warm-up over the first
    `warmup` fraction, then cosine decay to 0."""
    if progress < warmup:
        return max(progress, 1e-3 * warmup) / warmup
    rest = (progress - warmup) / max(1e-9, 1.0 - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, rest)))


def training_progress(step: int, total_steps: int, elapsed_s: float, time_budget_s: float | None) -> float:
    """Fraction of training done: by steps, or by wall time when a budget is set (whichever is further),
    so a time-boxed run (a lent GPU) still warms up, anneals and ends on schedule."""
    progress = step / total_steps
    if time_budget_s:
        progress = max(progress, elapsed_s / time_budget_s)
    return min(1.0, progress)


@torch.inference_mode()
def compute_features(
    target: TargetModel,
    sequences: list[list[int]],
    taps: list[int],
    batch_tokens: int = 4096,
    out_device: torch.device | str = "cpu",
    progress: bool = True,
) -> list[torch.Tensor]:
    """Concatenated tap hidden states [N, K*H] (fp16, on `out_device`) of each full sequence, by
    length-sorted batches.

    Right padding needs no mask: causal attention never looks at later (padded) positions."""
    hf = target.hf_model
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    feats: list[torch.Tensor | None] = [None] * len(sequences)
    batch: list[int] = []

    def flush() -> None:
        n = max(len(sequences[i]) for i in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long, device=target.device)
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
        out = hf.model(input_ids=ids, output_hidden_states=True)
        cat = torch.cat([out.hidden_states[t + 1] for t in taps], dim=-1)
        for row, i in enumerate(batch):
            feats[i] = cat[row, : len(sequences[i])].to(device=out_device, dtype=torch.float16)

    for i in tqdm(order, desc="features", unit="seq", disable=not progress):
        if batch and (len(batch) + 1) * len(sequences[i]) > batch_tokens:
            flush()
            batch = []
        batch.append(i)
    if batch:
        flush()
    return feats  # type: ignore[return-value]


def warm_start(drafter: Drafter, target: TargetModel) -> None:
    """Copy the target's top decoder layer into every draft layer; `fc` passes the last tap through."""
    top = target.decoder.layers[-1]
    src = {k: v for k, v in top.state_dict().items()}
    with torch.no_grad():
        for layer in drafter.layers:
            for name, param in layer.state_dict().items():
                if name in src and src[name].shape == param.shape:
                    param.copy_(src[name])
        h = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -h:] = torch.eye(h)
        drafter.norm.weight.copy_(target.decoder.norm.weight)


def rebuild_draft_vocab(drafter: Drafter, counts: torch.Tensor) -> None:
    """Make the draft vocabulary the most frequent tokens of `counts` [Vt]. The base logits borrow
    the target's LM-head rows, so any token set works at once; the head's learned correction rows
    are kept for tokens in both sets, and new tokens start with none."""
    size = drafter.config.draft_vocab_size
    assert size is not None
    new_ids = counts.argsort(descending=True, stable=True)[:size].sort().values
    with torch.no_grad():
        if drafter.config.has_head:
            weight = drafter.embed_proj[2].weight  # [V_draft, rank]
            old_row = torch.full((counts.numel(),), -1, dtype=torch.long)
            old_row[drafter.draft_vocab_ids.cpu()] = torch.arange(size)
            src = old_row[new_ids].to(weight.device)
            remapped = torch.zeros_like(weight)
            remapped[src >= 0] = weight[src[src >= 0]]
            weight.copy_(remapped)
        drafter.draft_vocab_ids.copy_(new_ids.to(drafter.draft_vocab_ids.device))


def make_drafter_config(args: argparse.Namespace, target: TargetModel, draft_vocab_size: int | None) -> DrafterConfig:
    tcfg = target.config
    taps = (
        [int(t) for t in args.taps.split(",")]
        if args.taps
        else default_target_layer_ids(target.num_layers, args.layers)
    )
    rope_theta = getattr(tcfg, "rope_theta", None) or (getattr(tcfg, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0
    )
    head = not args.no_head
    return DrafterConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=int(tcfg.num_attention_heads),
        num_key_value_heads=target.kv_heads,
        head_dim=target.head_dim,
        intermediate_size=int(tcfg.intermediate_size),
        vocab_size=target.vocab_size,
        block_size=args.block_size,
        target_layer_ids=taps,
        num_target_layers=target.num_layers,
        mask_token_id=args.mask_token_id,
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 8192)),
        projector_type="domino" if head else None,
        gru_hidden_dim=args.gru_size,
        emb_dim=args.rank,
        shift_label=args.shift_label,
        draft_vocab_size=draft_vocab_size,
        use_mask_embedding=args.mask_token_id is None,
    )


def training_loss(
    drafter: Drafter,
    ids: torch.Tensor,
    feats: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    lam: float,
    vocab_map: torch.Tensor | None,
    gamma: float | None = None,
) -> dict[str, torch.Tensor]:
    """Loss of a batch: S sequences ids [S, N] with features [S, N, K*H], M anchors each ([S, M], -1 = none).

    Every block `[x_a, MASK...]` sees context positions < a and itself (blocks never see each
    other); labels are x_{a+1+j} (shift_label) or x_{a+j}; the head is teacher-forced over x_a...
    """
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

    def ce(logits: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
        return (losses * weights.reshape(-1)).sum() / denom

    out: dict[str, torch.Tensor] = {"base": ce(base)}
    final = base
    if drafter.config.has_head:
        gru_out, _ = drafter.prefix_gru(drafter.embed(truth.view(s * m, b)))
        corrected = base + drafter.correction(hidden, gru_out.view(s, m, b, -1))
        p = cfg.pure_draft_prefix_len
        final = torch.cat([base[:, :, :p], corrected[:, :, p:]], dim=2)
        out["final"] = ce(final)
        out["loss"] = (1 - lam) * out["final"] + lam * out["base"]
    else:
        out["final"] = out["base"]
        out["loss"] = out["base"]
    out["final_logits"] = final.detach()
    with torch.no_grad():
        hit = (final.argmax(-1) == labels) & label_ok
        out["acc"] = hit.float().sum() / label_ok.float().sum().clamp_min(1.0)
    return out


def _sample_batch(
    picked: list[tuple[torch.Tensor, torch.Tensor, int]], anchors: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ids [S, N], features [S, N, K*H], lengths [S] and anchors [S, M] of picked sequences."""
    seqs = len(picked)
    n = max(len(ids) for ids, _, _ in picked)
    kh, dev = picked[0][1].shape[1], picked[0][1].device
    ids_t = torch.zeros(seqs, n, dtype=torch.long)
    feats_t = torch.zeros(seqs, n, kh, device=dev)
    lengths = torch.zeros(seqs, dtype=torch.long)
    anchor_t = torch.full((seqs, anchors), -1, dtype=torch.long)
    for r, (ids, feats, answer_start) in enumerate(picked):
        ids_t[r, : len(ids)] = ids
        feats_t[r, : len(ids)] = feats.float()
        lengths[r] = len(ids)
        # Anchors are committed answer positions with at least one label after them.
        choices = list(range(max(1, answer_start - 1), len(ids) - 1))
        chosen = rng.sample(choices, min(anchors, len(choices)))
        anchor_t[r, : len(chosen)] = torch.tensor(sorted(chosen))
    return ids_t.to(dev), feats_t, lengths.to(dev), anchor_t.to(dev)


def fit(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 for the drafter's fp32 training matmuls
    model, _tok = load_target(args.target, torch.float32, device)
    for p in model.parameters():
        p.requires_grad_(False)
    target = TargetModel(model)
    samples = read_shards(Path(args.data))
    if args.max_samples:
        samples = samples[: args.max_samples]
    sequences = [s["prompt"] + s["answer"] for s in samples]
    answer_tokens = sum(len(s["answer"]) for s in samples)
    log.info("%d samples, %d answer tokens", len(samples), answer_tokens)

    state_path = run / "state.pt"
    resume = state_path.exists() and not args.restart
    if resume:
        state = torch.load(state_path, weights_only=False)
        drafter = Drafter(DrafterConfig(**state["config"]))
        drafter.load_state_dict(state["drafter"])
    elif args.init_from:
        drafter = load_drafter(args.init_from, dtype=torch.float32, target_config=model.config)
    else:
        vocab_size = min(args.draft_vocab, target.vocab_size) if args.draft_vocab else None
        drafter = Drafter(make_drafter_config(args, target, vocab_size))
        # Published-style init for the head; norms at one.
        for name, p in drafter.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            elif "norm" in name or name == "mask_embedding":
                torch.nn.init.ones_(p) if "norm" in name else torch.nn.init.normal_(p, std=0.02)
        if args.warm_start:
            warm_start(drafter, target)
    if drafter.config.draft_vocab_size is not None and not resume and (args.rebuild_vocab or not args.init_from):
        counts = torch.bincount(torch.tensor([t for seq in sequences for t in seq]), minlength=target.vocab_size)
        rebuild_draft_vocab(drafter, counts)
    cfg = drafter.config
    drafter.to(device)
    drafter.bind_target(target.embed_tokens.weight.detach(), target.lm_head.weight.detach())
    vocab_map = None
    if cfg.draft_vocab_size is not None:
        vocab_map = torch.full((target.vocab_size,), -1, dtype=torch.long)
        vocab_map[drafter.draft_vocab_ids] = torch.arange(cfg.draft_vocab_size)
        covered = int((vocab_map[torch.tensor([t for s in samples for t in s["answer"]])] >= 0).sum())
        log.info("draft vocabulary %d covers %.4f of answer tokens", cfg.draft_vocab_size, covered / answer_tokens)
        vocab_map = vocab_map.to(device)

    feats: list[torch.Tensor | None]
    if args.online_features:
        feats = [None] * len(samples)
        log.info("features: computed per batch (no stored copies)")
    else:
        features_dir = Path(args.features_dir) if args.features_dir else None
        stored = read_shards(Path(args.data), cfg.target_layer_ids, features_dir)
        if args.max_samples:
            stored = stored[: args.max_samples]
        # gen recorded every position but the last (never context for an anchor); compute what's missing.
        missing = [i for i, s in enumerate(stored) if "features" not in s]
        # Features stay on the training device (a GPU holds millions of positions; no per-step copies).
        computed = compute_features(target, [sequences[i] for i in missing], cfg.target_layer_ids, out_device=device)
        by_index = dict(zip(missing, computed))
        feats = [
            by_index[i] if i in by_index else torch.cat([s["features"], torch.zeros_like(s["features"][:1])]).to(device)
            for i, s in enumerate(stored)
        ]
        log.info("features: %d stored by gen, %d computed", len(stored) - len(missing), len(missing))
    data = [(torch.tensor(seq), f, len(s["prompt"])) for seq, f, s in zip(sequences, feats, samples)]

    optimizer = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad], lr=args.lr, weight_decay=args.weight_decay
    )
    step = 0
    if resume:
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        rng.setstate(state["rng"])
        log.info("resumed from %s at step %d", state_path, step)
    log_path = run / "log.csv"
    new_log = not log_path.exists() or not resume
    log_file = log_path.open("w" if new_log else "a", newline="")
    writer = csv.writer(log_file)
    if new_log:
        writer.writerow(["step", "loss", "loss_base", "loss_final", "acc", "lambda", "lr", "elapsed_s"])
    drafter.train()
    t0 = time.perf_counter() - (state.get("elapsed", 0.0) if resume else 0.0)
    # Under a time budget the step count is open-ended: show the count and rate only.
    bar = tqdm(total=None if args.time_budget_s else args.steps, initial=step, desc="fit", unit="step")
    stop_at = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    elapsed = time.perf_counter() - t0

    def save() -> None:
        log_file.flush()
        tmp = state_path.with_suffix(".tmp")
        torch.save(
            {
                "config": {k: v for k, v in vars(cfg).items()},
                "drafter": drafter.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "rng": rng.getstate(),
                "elapsed": elapsed,
            },
            tmp,
        )
        os.replace(tmp, state_path)
        save_drafter(drafter, args.out)
        plot_log(log_path, run / "loss.png")

    while step < stop_at:
        progress = training_progress(step, args.steps, elapsed, args.time_budget_s)
        if progress >= 1.0:
            break
        lam = lambda_schedule(progress) if cfg.has_head else 1.0
        lr = args.lr * lr_schedule(progress, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        picked = [data[rng.randrange(len(data))] for _ in range(args.batch_seqs)]
        if args.online_features:
            # Large data on a small machine: one target forward per batch instead of stored features.
            feats_now = compute_features(
                target, [p[0].tolist() for p in picked], cfg.target_layer_ids, out_device=device, progress=False
            )
            picked = [(ids, f, start) for (ids, _, start), f in zip(picked, feats_now)]
        ids, f, lengths, anchors = _sample_batch(picked, args.anchors, rng)
        out = training_loss(drafter, ids, f, lengths, anchors, lam, vocab_map, args.gamma)
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - t0
        writer.writerow(
            [
                step,
                f"{out['loss'].item():.4f}",
                f"{out['base'].item():.4f}",
                f"{out['final'].item():.4f}",
                f"{out['acc'].item():.4f}",
                f"{lam:.4f}",
                f"{lr:.3e}",
                f"{elapsed:.1f}",
            ]
        )
        bar.update(1)
        bar.set_postfix(loss=f"{out['loss'].item():.3f}", acc=f"{out['acc'].item():.3f}")
        if step % args.save_every == 0:
            save()
    save()
    bar.close()
    log_file.close()
    (run / "summary.json").write_text(
        json.dumps(
            {"steps": step, "samples": len(samples), "answer_tokens": answer_tokens, "wall_s": elapsed}, indent=2
        )
    )


def plot_log(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(log_path.open()))
    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("loss", "loss_base", "loss_final"):
        ax1.plot(steps, [float(r[key]) for r in rows], label=key, linewidth=0.8)
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy")
    ax1.legend()
    ax2.plot(steps, [float(r["lambda"]) for r in rows], label="λ (base-loss weight)")
    ax2.plot(steps, [float(r["acc"]) for r in rows], label="draft top-1 accuracy", linewidth=0.8)
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# eval: acceptance length on held-out prompts
# ---------------------------------------------------------------------------------------------
def load_prompt_file(path: Path, tokenizer: Any, limit: int | None = None) -> list[list[int]]:
    """JSONL lines {"prompt": str} | {"messages": [...]} | {"prompt_ids": [...]} -> token ids."""
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if "prompt_ids" in item:
            prompts.append(list(item["prompt_ids"]))
        elif "messages" in item:
            prompts.append(chat_prompt_ids(tokenizer, item["messages"]))
        else:
            prompts.append(list(tokenizer(item["prompt"])["input_ids"]))
        if limit and len(prompts) >= limit:
            break
    return prompts


def evaluate(
    target: TargetModel,
    drafter: Drafter,
    prompts: list[list[int]],
    modes: list[str],
    max_new_tokens: int,
    eos: list[int],
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """Mean acceptance length τ (tokens per verify step, all steps pooled) per mode at T = 0, full blocks."""
    results = {}
    for mode in modes:
        engine = Engine(
            target,
            drafter,
            mode=mode,
            max_batch_size=batch_size,
            max_model_len=max(len(p) for p in prompts) + max_new_tokens,
            eos_token_ids=eos,
            draft_policy="fixed",  # τ of the drafter itself: every draft of every block is verified
        )
        out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
        lengths = [x for _, stats, _ in out for x in stats.acceptance_lengths]
        results[mode] = {"tau": sum(lengths) / max(1, len(lengths)), "steps": len(lengths), "prompts": len(prompts)}
    return results


def eval_cmd(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    model, tokenizer = load_target(args.target, torch.float32, device)
    target = TargetModel(model)
    drafter = load_drafter(args.drafter, dtype=torch.float32, target_config=model.config).to(device)
    prompts = [p for p in load_prompt_file(Path(args.prompts), tokenizer) if len(p) <= args.max_prompt_tokens]
    prompts = prompts[: args.limit] if args.limit else prompts
    modes = [m for m in args.modes.split(",") if m != "domino" or drafter.config.has_head]
    result = evaluate(target, drafter, prompts, modes, args.max_new_tokens, eos_token_ids(model, tokenizer))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="domino-train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("gen", help="regenerate answers with the target (resumable token-id shards)")
    g.add_argument("--target", default="default")
    g.add_argument("--out", required=True)
    g.add_argument("--prompts", default=None, help="JSONL prompt file instead of ShareGPT")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--shard-size", type=int, default=64)
    g.add_argument("--first-shard", type=int, default=0)
    g.add_argument("--limit", type=int, default=None, help="use only the first N train prompts")
    g.add_argument("--heldout", type=int, default=200)
    g.add_argument("--max-prompt-tokens", type=int, default=384)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--taps", default=None, help="also store the target features of these layers (comma list)")
    g.add_argument("--features-dir", default=None, help="where features go (default: OUT/features; not committed)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    g.add_argument("--time-budget-s", type=float, default=None, help="start no shard that would end after this")
    g.set_defaults(func=gen)

    f = sub.add_parser("fit", help="train a drafter on regenerated answers (resumable)")
    f.add_argument("--target", default="default")
    f.add_argument("--data", required=True, help="directory of gen shards")
    f.add_argument("--features-dir", default=None, help="features stored by gen --taps (default: DATA/features)")
    f.add_argument("--out", required=True, help="drafter checkpoint directory (published layout, bf16)")
    f.add_argument("--run-dir", required=True, help="training state, log.csv and loss.png")
    f.add_argument("--restart", action="store_true", help="ignore a saved state in --run-dir")
    f.add_argument("--init-from", default=None, help="start from an existing drafter checkpoint")
    f.add_argument("--no-head", action="store_true", help="train the plain DFlash baseline (no Domino head)")
    f.add_argument("--layers", type=int, default=1)
    f.add_argument("--block-size", type=int, default=8)
    f.add_argument("--taps", default=None, help="comma-separated target layer ids (default: DESIGN rule)")
    f.add_argument("--gru-size", type=int, default=256)
    f.add_argument("--rank", type=int, default=64)
    f.add_argument("--shift-label", action=argparse.BooleanOptionalAction, default=True)
    f.add_argument("--mask-token-id", type=int, default=None, help="default: a learned mask embedding")
    f.add_argument("--draft-vocab", type=int, default=8192, help="0: full vocabulary")
    f.add_argument(
        "--rebuild-vocab", action="store_true", help="with --init-from: re-pick the draft vocabulary from this data"
    )
    f.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True)
    f.add_argument("--steps", type=int, default=2000)
    f.add_argument("--batch-seqs", type=int, default=4)
    f.add_argument("--anchors", type=int, default=32)
    f.add_argument("--lr", type=float, default=6e-4)
    f.add_argument("--weight-decay", type=float, default=0.0)
    f.add_argument("--warmup", type=float, default=0.04)
    f.add_argument("--clip", type=float, default=1.0)
    f.add_argument("--gamma", type=float, default=None, help="per-slot loss decay exp(-j/gamma)")
    f.add_argument("--save-every", type=int, default=200)
    f.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this many steps in this run")
    f.add_argument(
        "--time-budget-s", type=float, default=None, help="train for this wall time (schedules follow it), or --steps"
    )
    f.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    f.add_argument(
        "--online-features",
        action="store_true",
        help="compute target features per batch (no stored features; for data larger than memory)",
    )
    f.add_argument("--max-samples", type=int, default=None)
    f.add_argument("--seed", type=int, default=0)
    f.set_defaults(func=fit)

    e = sub.add_parser("eval", help="acceptance length per mode on held-out prompts")
    e.add_argument("--target", default="default")
    e.add_argument("--drafter", required=True)
    e.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    e.add_argument("--modes", default="domino,dflash")
    e.add_argument("--limit", type=int, default=40)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--max-prompt-tokens", type=int, default=384)
    e.add_argument("--json", default=None)
    e.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    e.set_defaults(func=eval_cmd)

    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
