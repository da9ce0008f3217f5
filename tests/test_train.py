"""Training pipeline: gen -> fit -> eval end to end on a tiny target; one logit function for train and infer."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import torch

from model.checkpoint import load_drafter
from model.drafter import DraftContextCache
from model.sampling import SamplingBatch
from model.target import TargetModel
from model.train import (
    compute_features,
    lambda_schedule,
    lr_schedule,
    main,
    read_shards,
    rebuild_draft_vocab,
    training_loss,
    training_progress,
)
from tests.helpers import tiny_drafter, tiny_target


def test_schedules() -> None:
    assert lambda_schedule(0.0) == 1.0
    assert lambda_schedule(0.25) == 0.5
    assert lambda_schedule(0.5) == 0.0 and lambda_schedule(0.9) == 0.0
    assert lr_schedule(0.01, 0.04) == 0.25 and lr_schedule(0.04, 0.04) == 1.0
    assert 0 < lr_schedule(0.0, 0.04) < 0.01
    assert abs(lr_schedule(0.52, 0.04) - 0.5) < 1e-9
    assert lr_schedule(1.0, 0.04) == 0.0
    # Progress follows steps, or wall time when a budget is set, whichever is further.
    assert training_progress(10, 100, 999.0, None) == 0.1
    assert training_progress(10, 100, 30.0, 60.0) == 0.5
    assert training_progress(90, 100, 30.0, 60.0) == 0.9
    assert training_progress(10, 100, 120.0, 60.0) == 1.0


def test_training_logits_equal_inference_logits() -> None:
    """Teacher forcing over the drafted tokens reproduces the drafting path's corrected logits."""
    torch.manual_seed(0)
    target = tiny_target()
    drafter = tiny_drafter(std=0.3)
    drafter.bind_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    cfg = drafter.config
    ctx_len = 9
    context_ids = torch.randint(0, 127, (ctx_len,))
    anchor = 17
    feats = torch.randn(1, ctx_len + cfg.block_size, len(cfg.target_layer_ids) * cfg.hidden_size)

    cache = DraftContextCache(cfg, 1, 64, torch.float32, "cpu")
    with torch.no_grad():
        drafter.append_context(cache, 0, feats[:, :ctx_len], torch.tensor([ctx_len]))
        block = torch.full((1, cfg.block_size), cfg.mask_token_id)
        block[0, 0] = anchor
        hidden = drafter.forward_block(cache, 0, block)
        greedy = SamplingBatch(torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long))
        result = drafter.draft(hidden, block[:, 0], greedy, return_logits=True)

        # The same block as a training sequence: context, anchor, then the drafts as ground truth.
        seq = torch.cat([context_ids, torch.tensor([anchor]), result.tokens[0]])[None]
        out = training_loss(
            drafter,
            seq,
            feats[:, : seq.shape[1]]
            if feats.shape[1] >= seq.shape[1]
            else torch.cat([feats, torch.zeros(1, seq.shape[1] - feats.shape[1], feats.shape[2])], 1),
            torch.tensor([seq.shape[1]]),
            torch.tensor([[ctx_len]]),
            lam=0.0,
            vocab_map=None,
        )
    torch.testing.assert_close(out["final_logits"][0, 0], result.logits[0], rtol=1e-4, atol=1e-4)


def _write_prompts(path: Path, vocab: int, n: int = 24) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]}) + "\n")


def _tau(target_dir: Path, drafter_dir: Path, prompts: Path, tmp: Path, name: str) -> float:
    out = tmp / f"{name}.json"
    main(
        [
            "eval",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--prompts",
            str(prompts),
            "--modes",
            "domino",
            "--limit",
            "8",
            "--max-new-tokens",
            "24",
            "--json",
            str(out),
        ]
    )
    return json.loads(out.read_text())["domino"]["tau"]


def test_gen_fit_eval_end_to_end(tiny_target_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_target_dir).vocab_size
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, vocab)
    data = tmp_path / "data"
    main(
        [
            "gen",
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(data),
            "--shard-size",
            "8",
            "--batch-size",
            "8",
            "--max-new-tokens",
            "32",
            "--taps",
            "2",
        ]
    )
    samples = read_shards(data, taps=[2])
    # Features recorded while generating equal a fresh full-sequence pass (fp16 storage).
    from transformers import AutoModelForCausalLM

    tm = TargetModel(AutoModelForCausalLM.from_pretrained(tiny_target_dir))
    fresh = compute_features(tm, [s["prompt"] + s["answer"] for s in samples[:4]], [2])
    for sample, ref in zip(samples[:4], fresh):
        assert sample["features"].shape[0] == len(sample["prompt"]) + len(sample["answer"]) - 1
        torch.testing.assert_close(sample["features"].float(), ref[:-1].float(), rtol=1e-2, atol=1e-2)
    assert len(samples) == 24 and all(len(s["answer"]) >= 1 for s in samples)
    assert len(list(data.glob("shard-*.jsonl.gz"))) == 3
    # Resumable: a second run finds every shard done and regenerates nothing.
    before = {p: p.stat().st_mtime_ns for p in data.glob("shard-*")}
    main(
        [
            "gen",
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(data),
            "--shard-size",
            "8",
            "--batch-size",
            "8",
            "--max-new-tokens",
            "32",
            "--taps",
            "2",
        ]
    )
    assert before == {p: p.stat().st_mtime_ns for p in data.glob("shard-*")}

    common = [
        "fit",
        "--target",
        str(tiny_target_dir),
        "--data",
        str(data),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--gru-size",
        "32",
        "--rank",
        "16",
        "--draft-vocab",
        "0",
        "--batch-seqs",
        "4",
        "--anchors",
        "8",
        "--lr",
        "3e-3",
        "--steps",
        "120",
        "--save-every",
        "40",
    ]
    untrained = tmp_path / "untrained"
    main([*common, "--out", str(untrained), "--run-dir", str(tmp_path / "run0"), "--stop-after", "0"])
    trained = tmp_path / "drafter"
    run = tmp_path / "run"
    main([*common, "--out", str(trained), "--run-dir", str(run), "--stop-after", "50"])
    assert torch.load(run / "state.pt", weights_only=False)["step"] == 50
    main([*common, "--out", str(trained), "--run-dir", str(run)])  # resumes at step 50
    rows = list(csv.DictReader((run / "log.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 121))
    losses = [float(r["loss"]) for r in rows]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    assert float(rows[0]["lambda"]) == 1.0 and float(rows[-1]["lambda"]) == 0.0
    assert (run / "loss.png").stat().st_size > 0

    drafter = load_drafter(trained, target_config=AutoConfig.from_pretrained(tiny_target_dir))
    assert drafter.config.has_head and drafter.config.use_mask_embedding
    assert load_drafter(trained).fc.weight.dtype == torch.float32  # stored bf16, loaded as asked
    tau_untrained = _tau(tiny_target_dir, untrained, prompts, tmp_path, "u")
    tau_trained = _tau(tiny_target_dir, trained, prompts, tmp_path, "t")
    print(f"tiny target: tau untrained {tau_untrained:.2f}, trained {tau_trained:.2f}")
    assert tau_trained > tau_untrained + 0.2


def test_target_model_wrapper_is_reused(tiny_target_dir: Path) -> None:
    """Eval and gen share the engine path; the wrapper exposes what training needs."""
    from transformers import AutoModelForCausalLM

    t = TargetModel(AutoModelForCausalLM.from_pretrained(tiny_target_dir))
    assert t.num_layers >= 2 and t.vocab_size > 100


def test_rebuild_draft_vocab_keeps_learned_rows_of_kept_tokens() -> None:
    from tests.helpers import tiny_drafter

    drafter = tiny_drafter(vocab=64, draft_vocab_size=8)
    with torch.no_grad():
        drafter.draft_vocab_ids.copy_(torch.arange(8))  # tokens 0..7
        drafter.embed_proj[2].weight.copy_(torch.arange(8, dtype=torch.float32)[:, None] + 1)
    counts = torch.zeros(64, dtype=torch.long)
    counts[[3, 5, 40, 41, 42, 43, 44, 45]] = 10  # keeps 3 and 5, adds six new tokens
    counts[7] = 1  # rarer than all of those: dropped
    rebuild_draft_vocab(drafter, counts)
    assert drafter.draft_vocab_ids.tolist() == [3, 5, 40, 41, 42, 43, 44, 45]
    rows = drafter.embed_proj[2].weight[:, 0].tolist()
    assert rows == [4.0, 6.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
