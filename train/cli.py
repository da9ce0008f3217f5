"""`domino-train`: regenerate answers (`gen`), store target features (`features`), train a drafter
(`fit`), measure it (`eval`). See docs/design.md §1.5."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import torch

from model.load.loading import eos_token_ids, load_target, resolve_device, resolve_dtype
from model.nn.target import TargetModel
from train.config import DataConfig, DrafterSpec, FitConfig, GenConfig
from train.init import DEFAULT_BLOCK_SIZE

C = TypeVar("C")


def gen_cmd(args: argparse.Namespace) -> None:
    from train.gen import gen

    gen(gen_config(args))


def features_cmd(args: argparse.Namespace) -> None:
    from train.features import features_root, store_features

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, _ = load_target(args.target, resolve_dtype(args.dtype, device), device)
    root = features_root(Path(args.data), args.features_dir, several=False)
    taps, shards = _ints(args.taps), _ints(args.shards) if args.shards else None
    store_features(TargetModel(model), Path(args.data), root, taps, args.topk, shards, target_name=args.target)


def fit_cmd(args: argparse.Namespace) -> None:
    from train.fit import fit

    fit(fit_config(args))


def eval_cmd(args: argparse.Namespace) -> None:
    from model.load.checkpoint import load_drafter
    from model.load.prompts import load_prompt_file
    from train.evaluate import evaluate, heldout_slice

    device = resolve_device(args.device)
    model, tokenizer = load_target(args.target, torch.float32, device)
    target = TargetModel(model)
    drafter = load_drafter(args.drafter, dtype=torch.float32, target_config=model.config).to(device)
    # Slice first, so a slice holds the same prompts whatever the length filter.
    prompts = heldout_slice(load_prompt_file(Path(args.prompts), tokenizer), args.slice)
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    prompts = prompts[: args.limit] if args.limit else prompts
    modes = [m for m in args.modes.split(",") if m != "domino" or drafter.config.has_head]
    result = evaluate(target, drafter, prompts, modes, args.max_new_tokens, eos_token_ids(model, tokenizer))
    _print_json({"slice": args.slice, "max_new_tokens": args.max_new_tokens, **result}, args.json)


def walk_cmd(args: argparse.Namespace) -> None:
    """A drafter's offline τ on the validation samples fit holds out (the last `--val-samples` of
    the first shard, stored features needed), as the engine's walk and, with `--stride`, at fixed
    anchors."""
    from model.load.checkpoint import load_drafter
    from train.evaluate import offline_walk
    from train.samples import TrainingData

    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_target(args.target, torch.float32, "cpu")
    target = TargetModel(model)
    drafter = load_drafter(args.drafter, dtype=torch.float32, target_config=model.config)
    drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    # stored_only: the walk reads the features fit stored, and never computes any.
    data_cfg = DataConfig(_dirs(args.data), args.features_dir, stored_only=True, val_samples=args.val_samples)
    data = TrainingData(data_cfg, list(drafter.config.target_layer_ids), target, target_name=args.target)
    seqs = [(ids, f, start) for ids, f, start, _, _ in data.load(data.val, soft=False)]
    result: dict[str, object] = {"walk": offline_walk(drafter, seqs, args.val_tokens)}
    for stride in args.stride:
        result[f"every_{stride}"] = offline_walk(drafter, seqs, args.val_tokens, anchor_stride=stride)
    _print_json(result, args.json)


def average_cmd(args: argparse.Namespace) -> None:
    from model.load.checkpoint import load_drafter, save_drafter
    from train.init import average_drafters

    paths = args.drafters.split(",")
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    drafters = [load_drafter(p, dtype=torch.float32) for p in paths]
    save_drafter(average_drafters(drafters, weights), args.out)
    logging.getLogger("domino.train").info("averaged %d drafters into %s", len(paths), args.out)


# -- flags -> configs ----------------------------------------------------------------------------


def gen_config(args: argparse.Namespace) -> GenConfig:
    return _pick(GenConfig, args, out=Path(args.out), prompts=Path(args.prompts) if args.prompts else None)


def fit_config(args: argparse.Namespace) -> FitConfig:
    """The flags of `fit` as a FitConfig (the flags are named after its fields)."""
    return _pick(
        FitConfig,
        args,
        out=Path(args.out),
        run_dir=Path(args.run_dir),
        data=_pick(DataConfig, args, dirs=_dirs(args.data)),
        drafter=_pick(DrafterSpec, args, taps=_ints(args.taps) if args.taps else None, head=not args.no_head),
    )


def _pick(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """`cls` from the flags of its fields' names, and `given` for the rest."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.name not in given}, **given)  # type: ignore[arg-type]


def _dirs(text: str) -> list[Path]:
    """One or more comma-separated directories."""
    return [Path(d) for d in text.split(",") if d]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _print_json(result: dict[str, Any], path: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")


# -- parsers -------------------------------------------------------------------------------------


def _data_args(p: argparse.ArgumentParser, data_help: str) -> None:
    """--data and --features-dir: fit's samples and their stored features (walk reads the same ones)."""
    p.add_argument("--data", required=True, help=data_help)
    p.add_argument("--features-dir", default=None, help="stored features (default: ~/.cache/domino-serve/features/…)")


def _validation_args(p: argparse.ArgumentParser) -> None:
    """The validation slice fit holds out and walks: walk replays it, so both take the same defaults."""
    p.add_argument("--val-samples", type=int, default=64, help="validation sequences held out of the first shard")
    p.add_argument("--val-tokens", type=int, default=128, help="answer tokens walked per validation sequence")


def _average_parser(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("average", help="average the weights of drafters fine-tuned from one checkpoint")
    a.add_argument("--drafters", required=True, help="comma-separated drafter directories (same config and vocabulary)")
    a.add_argument("--weights", default=None, help="comma-separated weights (default: equal)")
    a.add_argument("--out", required=True)
    a.set_defaults(func=average_cmd)


def _walk_parser(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("walk", help="offline τ on fit's validation sequences (stored features), walk and fixed anchors")
    w.add_argument("--target", default="default")
    w.add_argument("--drafter", required=True)
    _data_args(w, "directory of gen shards (shard 0's features must be stored)")
    _validation_args(w)
    w.add_argument("--stride", type=int, action="append", default=[], help="also at anchors every N tokens")
    w.add_argument("--threads", type=int, default=None)
    w.add_argument("--json", default=None)
    w.set_defaults(func=walk_cmd)


def _gen_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("gen", help="regenerate answers with the target (resumable token-id shards)")
    g.add_argument("--target", default="default")
    g.add_argument("--out", required=True)
    g.add_argument("--prompts", default=None, help="JSONL prompt file instead of ShareGPT")
    g.add_argument(
        "--source",
        default="first-turns",
        choices=["first-turns", "later-turns"],
        help="ShareGPT prompts: opening human turns, or the later human turns of training conversations",
    )
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--shard-size", type=int, default=64)
    g.add_argument("--first-shard", type=int, default=0)
    g.add_argument("--last-shard", type=int, default=None, help="stop after this shard (default: the last)")
    g.add_argument("--limit", type=int, default=None, help="use only the first N train prompts")
    g.add_argument("--heldout", type=int, default=200)
    g.add_argument("--max-prompt-tokens", type=int, default=384)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    g.add_argument("--time-budget-s", type=float, default=None, help="start no shard that would end after this")
    g.set_defaults(func=gen_cmd)


def _features_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("features", help="store target features (+ top-k log-probs) of gen shards once, for fit")
    s.add_argument("--target", default="default")
    s.add_argument("--data", required=True, help="directory of gen shards")
    s.add_argument("--taps", required=True, help="comma-separated target layer ids")
    s.add_argument("--features-dir", default=None, help="default: ~/.cache/domino-serve/features/<data dir name>")
    s.add_argument("--topk", type=int, default=16)
    s.add_argument("--shards", default=None, help="comma-separated shard numbers, as in shard-00060 (default: all)")
    s.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    # bf16 on a CPU with AVX512-BF16 runs the target 2.7x faster than fp32 (measured on the 2-core
    # dev machine); the stored copies are fp16 either way.
    s.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 | auto")
    s.add_argument("--threads", type=int, default=None)
    s.set_defaults(func=features_cmd)


def _fit_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fit", help="train a drafter on regenerated answers (resumable)")
    f.add_argument("--target", default="default")
    _data_args(f, "directory of gen shards, or several comma-separated (validation: the first's)")
    f.add_argument("--stored-only", action="store_true", help="train only on shards whose features are stored")
    f.add_argument("--online-features", action="store_true", help="a target forward per batch, nothing stored")
    f.add_argument("--topk", type=int, default=16, help="top-k log-probs stored with the features")
    f.add_argument("--out", required=True, help="best drafter so far (published layout, bf16)")
    f.add_argument("--run-dir", required=True, help="training state, log.csv, val.csv and loss.png")
    f.add_argument("--restart", action="store_true", help="ignore a saved state in --run-dir")
    f.add_argument("--init-from", default=None, help="start from an existing drafter checkpoint")
    f.add_argument("--no-head", action="store_true", help="train the plain DFlash baseline (no Domino head)")
    f.add_argument(
        "--detach-head",
        action="store_true",
        help="train the head on a detached backbone (the backbone learns from the base loss alone, as "
        "DFlash's does; λ unused)",
    )
    f.add_argument(
        "--layers",
        type=int,
        default=None,
        help="draft layers (default 1); with --init-from, deepens that drafter (new layers start as no-ops)",
    )
    f.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"default {DEFAULT_BLOCK_SIZE}; with --init-from, re-blocks that drafter (no weight depends on it)",
    )
    f.add_argument("--taps", default=None, help="comma-separated target layer ids (default: docs/design.md rule)")
    f.add_argument("--gru-size", type=int, default=256)
    f.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the head's correction rank (default 64); with --init-from, widens that drafter's head "
        "without changing its output",
    )
    f.add_argument("--shift-label", action=argparse.BooleanOptionalAction, default=True)
    f.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=True, help="per-head q/k RMSNorm")
    f.add_argument("--mask-token-id", type=int, default=None, help="default: a learned mask embedding")
    f.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft vocabulary size (default 8192; 0: full vocabulary); with --init-from, widens that drafter's",
    )
    f.add_argument("--rebuild-vocab", action="store_true", help="with --init-from: re-pick the draft vocabulary")
    f.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True)
    f.add_argument("--steps", type=int, default=2000)
    f.add_argument("--batch-seqs", type=int, default=1)
    f.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    f.add_argument("--lr", type=float, default=6e-4)
    f.add_argument("--weight-decay", type=float, default=0.0)
    f.add_argument("--warmup", type=float, default=0.04)
    f.add_argument("--clip", type=float, default=1.0)
    f.add_argument(
        "--base-loss-until", type=float, default=0.5, help="fraction of training over which λ falls from 1 to 0"
    )
    f.add_argument("--gamma", type=float, default=None, help="per-slot loss decay exp(-j/γ); default 0.45·B, 0: off")
    f.add_argument("--distill", type=float, default=0.0, help="weight of the target top-k soft labels in [0, 1]")
    _validation_args(f)
    f.add_argument("--eval-every", type=int, default=1000)
    f.add_argument("--save-every", type=int, default=200)
    f.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this many steps in this run")
    f.add_argument("--time-budget-s", type=float, default=None, help="train for this wall time (schedules follow it)")
    f.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    f.add_argument(
        "--amp",
        default="auto",
        choices=["auto", "bf16", "off"],
        help="bf16 autocast of the training forward/backward (weights and optimizer stay fp32); "
        "auto: on CUDA with bf16 and on CPUs with native bf16 matmuls",
    )
    f.add_argument("--threads", type=int, default=None)
    f.add_argument("--max-samples", type=int, default=None)
    f.add_argument("--seed", type=int, default=0)
    f.set_defaults(func=fit_cmd)


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="acceptance length per mode on held-out prompts (through the engine)")
    e.add_argument("--target", default="default")
    e.add_argument("--drafter", required=True)
    e.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    e.add_argument("--slice", default="test", choices=("validation", "test", "all"), help="held-out half to use")
    e.add_argument("--modes", default="domino,dflash")
    e.add_argument("--limit", type=int, default=40)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--max-prompt-tokens", type=int, default=384)
    e.add_argument("--json", default=None)
    e.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    e.set_defaults(func=eval_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="domino-train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_gen_parser, _features_parser, _fit_parser, _eval_parser, _walk_parser, _average_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
