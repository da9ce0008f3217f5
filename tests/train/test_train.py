"""Training pipeline: gen -> fit -> eval end to end on a tiny target; one logit function for train and infer.

Over 500 lines: gen, features, fit, eval and their resume paths each need a real run of the stage
on a tiny target."""

from __future__ import annotations

import csv
import gzip
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from model.engine.sampling import SamplingBatch
from model.load.checkpoint import load_drafter
from model.load.loading import cpu_has_native_bf16
from model.nn.drafter import Drafter, head_parameters, new_context_cache
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target
from train.cli import build_parser, fit_config, gen_config, main
from train.config import DataConfig, DrafterSpec, FitConfig, GenConfig
from train.evaluate import evaluate, heldout_slice, offline_walk, slot_acceptance
from train.features import ShardFeatures, compute_features, shard_features_dir, store_features
from train.fit import amp_enabled
from train.init import deepen, rebuild_draft_vocab, widen_draft_vocab, widen_head
from train.loss import (
    default_gamma,
    lambda_schedule,
    lr_schedule,
    sample_batch,
    soft_targets,
    training_loss,
    training_progress,
)
from train.shards import read_shard, shard_path, shard_paths


def test_schedules() -> None:
    assert lambda_schedule(0.0) == 1.0
    assert lambda_schedule(0.25) == 0.5
    assert lambda_schedule(0.5) == 0.0 and lambda_schedule(0.9) == 0.0
    # A run continuing a trained drafter re-anchors on the base logits only briefly, or not at all.
    assert lambda_schedule(0.05, until=0.1) == 0.5 and lambda_schedule(0.1, until=0.1) == 0.0
    assert lambda_schedule(0.0, until=0.0) == 0.0
    assert lr_schedule(0.01, 0.04) == 0.25 and lr_schedule(0.04, 0.04) == 1.0
    assert 0 < lr_schedule(0.0, 0.04) < 0.01
    assert abs(lr_schedule(0.52, 0.04) - 0.5) < 1e-9
    assert lr_schedule(1.0, 0.04) == 0.0
    # Progress follows steps, or wall time when a budget is set, whichever is further.
    assert training_progress(10, 100, 999.0, None) == 0.1
    assert training_progress(10, 100, 30.0, 60.0) == 0.5
    assert training_progress(90, 100, 30.0, 60.0) == 0.9
    assert training_progress(10, 100, 120.0, 60.0) == 1.0


def test_cli_flags_build_the_typed_configs() -> None:
    """The flags' defaults are the configs' own, and each flag lands in its field."""
    parser = build_parser()
    required = ["--out", "o", "--run-dir", "r"]
    expected = FitConfig(out=Path("o"), run_dir=Path("r"), data=DataConfig([Path("a"), Path("b")]))
    assert fit_config(parser.parse_args(["fit", "--data", "a,b", *required])) == expected
    flags = ["--taps", "1,3", "--no-head", "--lr", "1e-3", "--stored-only", "--init-from", "d", "--gamma", "0"]
    cfg = fit_config(parser.parse_args(["fit", "--data", "a", *required, *flags]))
    assert cfg.drafter == DrafterSpec(init_from="d", taps=[1, 3], head=False)
    assert (cfg.lr, cfg.gamma, cfg.data.stored_only, cfg.data.dirs) == (1e-3, 0.0, True, [Path("a")])
    assert gen_config(parser.parse_args(["gen", "--out", "d"])) == GenConfig(out=Path("d"))


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

    cache = new_context_cache(cfg, 1, 64, torch.float32, "cpu")
    with torch.no_grad():
        drafter.append_context(cache, 0, feats[:, :ctx_len], torch.tensor([ctx_len]), [ctx_len])
        block = torch.full((1, cfg.block_size), cfg.mask_token_id)
        block[0, 0] = anchor
        hidden = drafter.forward_block(cache, 0, block)
        greedy = SamplingBatch(torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long))
        result = drafter.draft(hidden, block[:, 0], greedy, return_logits=True)

        # The same block as a training sequence: context, anchor, then the drafts as ground truth.
        seq = torch.cat([context_ids, torch.tensor([anchor]), result.tokens[0]])[None]
        seq_feats = (
            feats[:, : seq.shape[1]]
            if feats.shape[1] >= seq.shape[1]
            else torch.cat([feats, torch.zeros(1, seq.shape[1] - feats.shape[1], feats.shape[2])], 1)
        )
        batch = {
            "ids": seq,
            "feats": seq_feats,
            "lengths": torch.tensor([seq.shape[1]]),
            "anchors": torch.tensor([[ctx_len]]),
        }
        out = training_loss(drafter, batch, lam=0.0, vocab_map=None)
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


def _gen_args(target_dir: Path, prompts: Path, data: Path) -> list[str]:
    return [
        "gen",
        "--target",
        str(target_dir),
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
    ]


def _with(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with the value after `flag` replaced."""
    at = args.index(flag) + 1
    return [*args[:at], value, *args[at + 1 :]]


def test_gen_fit_eval_end_to_end(tiny_target_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(tiny_target_dir).vocab_size
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, vocab)
    data = tmp_path / "data"
    # Jobs can split a directory by shard ranges: this one writes shard 1 alone.
    main([*_gen_args(tiny_target_dir, prompts, data), "--first-shard", "1", "--last-shard", "1"])
    assert [p.name for p in shard_paths(data)] == ["shard-00001.jsonl.gz"]
    middle = shard_paths(data)[0].stat().st_mtime_ns
    main(_gen_args(tiny_target_dir, prompts, data))
    assert shard_paths(data)[1].stat().st_mtime_ns == middle  # the other job's shard is kept
    samples = [s for p in shard_paths(data) for s in read_shard(p)]
    assert len(samples) == 24 and all(len(s["answer"]) >= 1 for s in samples)
    assert len(shard_paths(data)) == 3
    # Resumable: a second run finds every shard done and regenerates nothing.
    before = {p: p.stat().st_mtime_ns for p in data.glob("shard-*")}
    main(_gen_args(tiny_target_dir, prompts, data))
    assert before == {p: p.stat().st_mtime_ns for p in data.glob("shard-*")}

    features = tmp_path / "features"
    common = [
        "fit",
        "--target",
        str(tiny_target_dir),
        "--data",
        str(data),
        "--features-dir",
        str(features),
        "--layers",
        "1",
        "--taps",
        "2",
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
        "--eval-every",
        "40",
        "--val-samples",
        "4",
    ]
    untrained = tmp_path / "untrained"
    main([*common, "--out", str(untrained), "--run-dir", str(tmp_path / "run0"), "--stop-after", "0"])
    # fit stored the features of every shard once; they equal a fresh full-sequence pass.
    tm = TargetModel(AutoModelForCausalLM.from_pretrained(tiny_target_dir))
    store = ShardFeatures.open(shard_features_dir(features, shard_paths(data)[0], [2]))
    first = read_shard(shard_paths(data)[0])
    fresh = compute_features(tm, [s["prompt"] + s["answer"] for s in first[:4]], [2], progress=False)
    for row, (sample, ref) in enumerate(zip(first[:4], fresh)):
        f, top_ids, top_logp = store.sequence(row)
        assert f.shape[0] == len(sample["prompt"]) + len(sample["answer"])
        torch.testing.assert_close(f.float(), ref.float(), rtol=1e-2, atol=1e-2)
        # The stored top-1 of every answer position is the next answer token (greedy labels).
        start = len(sample["prompt"]) - 1
        assert top_ids[start:-1, 0].tolist() == sample["answer"]
        assert bool((top_logp[start:, 0] <= 0).all()) and bool((top_logp[start:, 0] >= top_logp[start:, 1]).all())

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
    # The schedule continued across the resume: no second warm-up at step 51.
    assert float(rows[50]["lr"]) < float(rows[10]["lr"])
    assert (run / "loss.png").stat().st_size > 0
    # --amp auto: bf16 autocast where this CPU multiplies bf16 natively, recorded with the run.
    amp = json.loads((run / "summary.json").read_text())["amp"]
    assert amp == ("bf16" if cpu_has_native_bf16() else "off")
    val = list(csv.DictReader((run / "val.csv").open()))
    assert [int(r["step"]) for r in val] == [40, 50, 80, 120]  # every 40 steps and where a run stopped
    best = max(float(r["val_tau"]) for r in val)
    assert json.loads((trained / "train_val.json").read_text())["tau"] == pytest.approx(best, abs=1e-4)

    drafter = load_drafter(trained, target_config=AutoConfig.from_pretrained(tiny_target_dir))
    assert drafter.config.has_head and drafter.config.use_mask_embedding
    assert load_drafter(trained).fc.weight.dtype == torch.float32  # stored bf16, loaded as asked
    tau_untrained = _tau(tiny_target_dir, untrained, prompts, tmp_path, "u")
    tau_trained = _tau(tiny_target_dir, trained, prompts, tmp_path, "t")
    print(f"tiny target: tau untrained {tau_untrained:.2f}, trained {tau_trained:.2f}")
    assert tau_trained > tau_untrained + 0.2
    _check_offline_walk_equals_engine(tiny_target_dir, trained, data)
    # --block-size re-blocks an --init-from drafter: the same weights, fewer drafts per block.
    reblocked = tmp_path / "reblocked"
    args = [*_with(common, "--block-size", "2"), "--init-from", str(trained), "--stop-after", "0"]
    main([*args, "--out", str(reblocked), "--run-dir", str(tmp_path / "run2")])
    before, after = load_drafter(trained), load_drafter(reblocked)
    assert (before.config.block_size, after.config.block_size) == (4, 2)
    torch.testing.assert_close(after.fc.weight, before.fc.weight)
    # A head can only be widened: a smaller --rank is a one-line error, not a traceback.
    narrower = [*_with(common, "--rank", "8"), "--init-from", str(trained), "--stop-after", "0"]
    with pytest.raises(SystemExit, match="only be widened"):
        main([*narrower, "--out", str(tmp_path / "narrow"), "--run-dir", str(tmp_path / "run-narrow")])
    # --layers deepens an --init-from drafter: one more layer, the old ones kept.
    deeper = [*_with(common, "--layers", "2"), "--init-from", str(trained), "--stop-after", "0"]
    main([*deeper, "--out", str(tmp_path / "deeper"), "--run-dir", str(tmp_path / "run-deeper")])
    deepened = load_drafter(tmp_path / "deeper")
    assert (before.config.num_hidden_layers, deepened.config.num_hidden_layers) == (1, 2)
    torch.testing.assert_close(deepened.layers[0].mlp.up_proj.weight, before.layers[0].mlp.up_proj.weight)
    assert not deepened.layers[1].mlp.down_proj.weight.any()
    # Several gen directories train together; validation stays the first one's.
    more = tmp_path / "more"
    more.mkdir()
    shutil.copy(shard_paths(data)[1], more / shard_paths(data)[0].name)
    both = _with(common, "--data", f"{data},{more}")
    run3 = tmp_path / "run3"
    main([*both, "--out", str(tmp_path / "both"), "--run-dir", str(run3), "--stop-after", "1"])
    summary = json.loads((run3 / "summary.json").read_text())
    assert summary["train_samples"] == json.loads((run / "summary.json").read_text())["train_samples"] + 8
    assert (features / "more").is_dir() and (features / "data").is_dir()  # one folder per data directory
    # Validation is always the first shard's last samples: with only shard 1 stored, fit refuses to
    # start rather than validate on samples an earlier run trained on.
    partial = tmp_path / "partial"
    main(
        ["features", "--target", str(tiny_target_dir), "--data", str(data), "--taps", "2"]
        + ["--features-dir", str(partial), "--shards", "1"]
    )
    stored_one = [*_with(common, "--features-dir", str(partial)), "--stored-only", "--stop-after", "0"]
    with pytest.raises(SystemExit, match="validation comes from .*shard-00000"):
        main([*stored_one, "--out", str(tmp_path / "partial-out"), "--run-dir", str(tmp_path / "run-partial")])
    # `walk` replays fit's own validation: the same τ as the best validation row.
    walk_json = tmp_path / "walk.json"
    walk_args = ["--data", str(data), "--features-dir", str(features), "--val-samples", "4", "--stride", "3"]
    main(["walk", "--target", str(tiny_target_dir), "--drafter", str(trained), *walk_args, "--json", str(walk_json)])
    walked = json.loads(walk_json.read_text())
    assert walked["walk"]["tau"] == pytest.approx(best, abs=2e-2)  # bf16-stored weights vs fit's fp32 ones
    assert walked["every_3"]["steps"] > 0


def _check_offline_walk_equals_engine(target_dir: Path, drafter_dir: Path, data: Path) -> None:
    """The offline walk over the target's own greedy answers reproduces the engine's full-block
    greedy τ and per-slot acceptance, without running the target."""
    from model.load.loading import eos_token_ids, load_target

    model, tokenizer = load_target(str(target_dir))
    target = TargetModel(model)
    drafter = load_drafter(drafter_dir, dtype=torch.float32, target_config=model.config)
    drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    samples = read_shard(shard_paths(data)[0])
    prompts = [s["prompt"] for s in samples]
    engine = evaluate(target, drafter, prompts, ["domino"], 24, eos_token_ids(model, tokenizer))["domino"]
    seqs = [s["prompt"] + s["answer"] for s in samples]
    # fp32 features, as the engine has them (stored fp16 ones may flip near-tied drafts).
    feats = compute_features(target, seqs, drafter.config.target_layer_ids, progress=False, dtype=torch.float32)
    walk = offline_walk(drafter, [(torch.tensor(q), f, len(p)) for q, f, p in zip(seqs, feats, prompts)], 24)
    assert walk["tau"] > 1.1  # drafts were accepted: the comparison is not vacuous
    assert walk["steps"] == engine["steps"]
    assert walk["tau"] == pytest.approx(engine["tau"], abs=1e-9)
    assert walk["tau_per_slot"] == engine["tau_per_slot"]
    # Fixed anchors (the design notes' curve): one block every `stride` answer tokens, whatever
    # was accepted; a block's length never depends on where the walk would have gone.
    spans = [min(len(s["answer"]), 24) - 1 for s in samples]
    for stride in (1, 3):
        fixed = offline_walk(
            drafter, [(torch.tensor(q), f, len(p)) for q, f, p in zip(seqs, feats, prompts)], 24, anchor_stride=stride
        )
        assert fixed["steps"] == sum(-(-n // stride) for n in spans if n > 0)


def test_distillation_targets_and_loss() -> None:
    """Soft labels come from the target's top-k at the position before each label, renormalised over
    the draft vocabulary; distill = 0 is exactly the hard-label loss."""
    soft_ids = torch.tensor([[[5, 2, 9], [1, 2, 3]]])  # [S=1, N=2, k=3]
    soft_logp = torch.log(torch.tensor([[[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]]))
    vocab_map = torch.full((10,), -1)
    vocab_map[torch.tensor([2, 5, 1])] = torch.tensor([0, 1, 2])  # 9 and 3 are not proposable
    ids, probs = soft_targets(soft_ids, soft_logp, torch.tensor([[[0, 1]]]), vocab_map)
    assert ids[0, 0, 0].tolist()[:2] == [1, 0] and ids[0, 0, 1].tolist()[:2] == [2, 0]
    torch.testing.assert_close(probs[0, 0, 0], torch.tensor([0.625, 0.375, 0.0]))
    torch.testing.assert_close(probs[0, 0, 1], torch.tensor([0.75, 0.25, 0.0]))

    torch.manual_seed(0)
    drafter = tiny_drafter(std=0.3)
    target = tiny_target()
    drafter.bind_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    n, kh = 20, len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    ids_seq = torch.randint(3, 100, (n,))
    top = torch.randint(3, 100, (n, 4))
    logp = torch.log_softmax(torch.randn(n, 4), -1)
    batch = sample_batch([(ids_seq, torch.randn(n, kh), 5, top, logp)], 6, random.Random(0))
    hard = training_loss(drafter, batch, 0.5, None, gamma=default_gamma(drafter.config.block_size))
    mixed0 = training_loss(drafter, batch, 0.5, None, gamma=default_gamma(drafter.config.block_size), distill=0.0)
    mixed = training_loss(drafter, batch, 0.5, None, gamma=default_gamma(drafter.config.block_size), distill=0.7)
    assert hard["loss"].item() == pytest.approx(mixed0["loss"].item())
    assert mixed["loss"].item() != pytest.approx(hard["loss"].item())
    mixed["loss"].backward()  # differentiable through the soft term


def test_heldout_slices_and_slot_acceptance() -> None:
    prompts = [[i] for i in range(10)]
    assert heldout_slice(prompts, "validation") == prompts[:5] and heldout_slice(prompts, "test") == prompts[5:]
    assert slot_acceptance([1, 2, 3, 1], 3) == [0.5, 0.25, 0.0]


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


def test_widening_the_draft_vocabulary_keeps_learned_rows_and_proposes_new_tokens(tmp_path: Path) -> None:
    """fit --init-from D --draft-vocab N: every token of D stays with its learned correction row, the
    most frequent others join with the mean row, slot 0 can propose them at once, and the wider
    drafter saves and loads."""
    from model.load.checkpoint import load_drafter, save_drafter
    from tests.helpers import tiny_drafter

    torch.manual_seed(0)
    drafter = tiny_drafter(vocab=64, draft_vocab_size=8)
    with torch.no_grad():
        drafter.draft_vocab_ids.copy_(torch.arange(8))  # tokens 0..7
        drafter.embed_proj[2].weight.copy_(torch.arange(8, dtype=torch.float32)[:, None] + 1)
    counts = torch.zeros(64, dtype=torch.long)
    counts[[40, 41, 42, 43]] = 10
    counts[50] = 5  # the fifth most frequent newcomer: left out at size 12
    widen_draft_vocab(drafter, counts, 12)
    assert drafter.config.draft_vocab_size == 12
    assert drafter.draft_vocab_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 40, 41, 42, 43]
    rows = drafter.embed_proj[2].weight[:, 0].tolist()
    assert rows == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 4.5, 4.5, 4.5, 4.5]
    # Slot 0 has no correction: a hidden state that points at token 42's LM-head row proposes it.
    lm_head = torch.randn(64, drafter.config.hidden_size)
    drafter.bind_target(torch.randn(64, drafter.config.hidden_size), lm_head)
    assert int(drafter.to_full_vocab(drafter.base_logits(10 * lm_head[42]).argmax())) == 42
    save_drafter(drafter, tmp_path / "wide", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "wide", dtype=torch.float32)
    assert loaded.draft_vocab_ids.tolist() == drafter.draft_vocab_ids.tolist()
    torch.testing.assert_close(loaded.embed_proj[2].weight, drafter.embed_proj[2].weight)
    with pytest.raises(ValueError, match="only be widened"):
        widen_draft_vocab(drafter, counts, 8)


def test_bf16_autocast_step_tracks_fp32() -> None:
    """fit's bf16 autocast (`--amp`): the loss and gradients follow the fp32 step closely, the matmuls
    really run in bf16, and the weights and their gradients stay fp32 for the optimizer."""
    torch.manual_seed(0)
    drafter = tiny_drafter(std=0.3)
    target = tiny_target()
    drafter.bind_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    n, kh = 24, len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    batch = sample_batch([(torch.randint(3, 100, (n,)), torch.randn(n, kh), 5, None, None)], 8, random.Random(0))
    gamma = default_gamma(drafter.config.block_size)

    def step(amp: bool) -> tuple[float, dict[str, torch.Tensor], torch.dtype]:
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = training_loss(drafter, batch, 0.5, None, gamma=gamma)
        out["loss"].backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        return out["loss"].item(), grads, out["final_logits"].dtype

    loss32, grads32, dtype32 = step(amp=False)
    loss16, grads16, dtype16 = step(amp=True)
    assert dtype32 == torch.float32 and dtype16 == torch.bfloat16  # autocast reached the LM head
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    assert set(grads16) == set(grads32)
    for name, g in grads16.items():
        assert g.dtype == torch.float32, name
        cos = torch.nn.functional.cosine_similarity(g.flatten(), grads32[name].flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))
    assert amp_enabled("off", "cpu") is False and amp_enabled("bf16", "cpu") is True
    assert amp_enabled("auto", "cpu") is cpu_has_native_bf16()


def _bound_drafter_and_batch() -> tuple[Drafter, dict[str, torch.Tensor]]:
    """A tiny Domino drafter bound to a tiny target, and one training batch of 8 blocks."""
    torch.manual_seed(0)
    drafter = tiny_drafter(std=0.3)
    target = tiny_target()
    drafter.bind_target(target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    n, kh = 24, len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    batch = sample_batch([(torch.randint(3, 100, (n,)), torch.randn(n, kh), 5, None, None)], 8, random.Random(0))
    return drafter, batch


def test_detached_head_leaves_the_backbone_a_dflash_gradient() -> None:
    """fit --detach-head: the backbone's gradient is exactly that of CE(base), as in a DFlash fit,
    the head still learns, and without it the final loss does reach the backbone."""
    drafter, batch = _bound_drafter_and_batch()
    head = {id(p) for p in head_parameters(drafter)}
    assert head and len(head) < len(list(drafter.parameters()))

    def grads(key: str, lam: float, detach: bool) -> dict[str, torch.Tensor]:
        drafter.zero_grad(set_to_none=True)
        training_loss(drafter, batch, lam, None, gamma=1.1, detach_head=detach)[key].backward()
        return {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}

    base_only = grads("base", 0.0, False)
    detached = grads("loss", 0.0, True)
    joint = grads("loss", 0.0, False)
    backbone = [name for name, p in drafter.named_parameters() if id(p) not in head]
    for name in backbone:
        torch.testing.assert_close(detached[name], base_only[name], msg=name)
    assert all(detached[name].abs().sum() > 0 for name, p in drafter.named_parameters() if id(p) in head)
    assert any(not torch.allclose(joint[name], base_only[name]) for name in backbone)


def test_widening_the_head_keeps_its_output_and_lets_the_new_rank_learn() -> None:
    """fit --init-from D --rank R: the widened drafter computes exactly what D did, and the new
    correction units get a gradient at once (zero W1 rows and zero W2 columns would never move)."""
    drafter, batch = _bound_drafter_and_batch()
    old_rank = drafter.config.emb_dim
    with torch.no_grad():
        before = training_loss(drafter, batch, 0.5, None, gamma=1.1)["final_logits"]
    widen_head(drafter, 4 * old_rank)
    assert drafter.config.emb_dim == 4 * old_rank
    assert drafter.embed_proj[0].weight.shape[0] == drafter.embed_proj[2].weight.shape[1] == 4 * old_rank
    out = training_loss(drafter, batch, 0.5, None, gamma=1.1)
    torch.testing.assert_close(out["final_logits"], before, rtol=1e-5, atol=1e-5)  # summation order only
    out["loss"].backward()
    assert drafter.embed_proj[2].weight.grad[:, old_rank:].abs().sum() > 0
    with pytest.raises(ValueError, match="only be widened"):
        widen_head(drafter, old_rank)


def test_deepening_keeps_the_output_and_lets_the_new_layer_learn() -> None:
    """fit --init-from D --layers L: the deeper drafter computes exactly what D did (the new layer's
    residual branches start at zero), and the zeroed projections get a gradient at once."""
    drafter, batch = _bound_drafter_and_batch()
    with torch.no_grad():
        before = training_loss(drafter, batch, 0.5, None, gamma=1.1)["final_logits"]
    old = len(drafter.layers)
    deepen(drafter, old + 1)
    assert drafter.config.num_hidden_layers == len(drafter.layers) == old + 1
    new = drafter.layers[-1]
    assert new.self_attn.q_proj.weight.data_ptr() != drafter.layers[-2].self_attn.q_proj.weight.data_ptr()
    out = training_loss(drafter, batch, 0.5, None, gamma=1.1)
    torch.testing.assert_close(out["final_logits"], before, rtol=1e-5, atol=1e-5)
    out["loss"].backward()
    assert new.self_attn.o_proj.weight.grad.abs().sum() > 0 and new.mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="only be deepened"):
        deepen(drafter, old)


def test_features_select_shards_by_number_across_gaps(tmp_path: Path) -> None:
    """`features --shards 60` stores shard-00060 even when shards 1-59 were never generated."""
    target = TargetModel(tiny_target())
    data = tmp_path / "data"
    data.mkdir()
    for index in (0, 60):
        with gzip.open(shard_path(data, index), "wt") as f:
            f.write(json.dumps({"i": index, "prompt": [1, 2, 3], "answer": [4, 5, 6, 7]}) + "\n")
    root = tmp_path / "features"
    store_features(target, data, root, [2], topk=4, shards=[60])
    stored = sorted(p.name for p in root.iterdir())
    assert stored == ["shard-00060.taps-2"], stored
    with pytest.raises(FileNotFoundError, match="shard-00007"):
        store_features(target, data, root, [2], topk=4, shards=[7])


def test_average_writes_the_mean_of_like_drafters_and_refuses_unlike_ones(tmp_path: Path) -> None:
    """domino-train average: every floating-point weight of the output is the weighted mean of the
    inputs' (here exactly, in the bf16 the checkpoints are stored in), the draft vocabulary is kept,
    and drafters with another vocabulary or config are refused rather than blended."""
    from model.load.checkpoint import save_drafter

    a, b = tiny_drafter(seed=1, draft_vocab_size=64), tiny_drafter(seed=2, draft_vocab_size=64)
    with torch.no_grad():
        a.draft_vocab_ids.copy_(torch.arange(64) + 3)
        b.draft_vocab_ids.copy_(torch.arange(64) + 3)
    save_drafter(a, tmp_path / "a")
    save_drafter(b, tmp_path / "b")
    main(
        [
            "average",
            "--drafters",
            f"{tmp_path / 'a'},{tmp_path / 'b'}",
            "--weights",
            "1,3",
            "--out",
            str(tmp_path / "m"),
        ]
    )
    la, lb, mean = (load_drafter(tmp_path / n) for n in ("a", "b", "m"))
    assert mean.config == la.config
    for name, tensor in mean.state_dict().items():
        if tensor.is_floating_point():
            expected = ((la.state_dict()[name] + 3 * lb.state_dict()[name]) / 4).bfloat16().float()
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)
    assert torch.equal(mean.draft_vocab_ids, torch.arange(64) + 3)
    assert not torch.equal(mean.layers[0].mlp.up_proj.weight, la.layers[0].mlp.up_proj.weight)

    with torch.no_grad():
        b.draft_vocab_ids.copy_(torch.arange(64))
    save_drafter(b, tmp_path / "other_vocab")
    with pytest.raises(ValueError, match="draft vocabulary"):
        main(["average", "--drafters", f"{tmp_path / 'a'},{tmp_path / 'other_vocab'}", "--out", str(tmp_path / "x")])
    save_drafter(tiny_drafter(seed=2, draft_vocab_size=64, emb_dim=16), tmp_path / "other_rank")
    with pytest.raises(ValueError, match="another config"):
        main(["average", "--drafters", f"{tmp_path / 'a'},{tmp_path / 'other_rank'}", "--out", str(tmp_path / "y")])
