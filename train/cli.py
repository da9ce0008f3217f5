"""`domino-train`: regenerate answers (`gen`), store target features (`features`), train a drafter
(`fit`), measure it (`eval`). See docs/design.md, "Training"."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from model.loading import load_target, resolve_device, resolve_dtype
from model.target import TargetModel
from train.init import DEFAULT_BLOCK_SIZE


def features_cmd(args: argparse.Namespace) -> None:
    from train.features import store_features
    from train.fit import features_root

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, _ = load_target(args.target, resolve_dtype(args.dtype, device), device)
    root = features_root(Path(args.data), args.features_dir, several=False)
    shards = [int(x) for x in args.shards.split(",")] if args.shards else None
    taps = [int(t) for t in args.taps.split(",")]
    store_features(TargetModel(model), Path(args.data), root, taps, args.topk, shards, target_name=args.target)


def gen_cmd(args: argparse.Namespace) -> None:
    from train.gen import gen

    gen(args)


def fit_cmd(args: argparse.Namespace) -> None:
    from train.fit import fit

    fit(args)


def eval_cmd(args: argparse.Namespace) -> None:
    from train.evaluate import eval_cmd as run

    run(args)


def walk_cmd(args: argparse.Namespace) -> None:
    from train.evaluate import walk_cmd as run

    run(args)


def average_cmd(args: argparse.Namespace) -> None:
    from model.checkpoint import load_drafter, save_drafter
    from train.init import average_drafters

    paths = args.drafters.split(",")
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    drafters = [load_drafter(p, dtype=torch.float32) for p in paths]
    save_drafter(average_drafters(drafters, weights), args.out)
    logging.getLogger("domino.train").info("averaged %d drafters into %s", len(paths), args.out)


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
    w.add_argument("--data", required=True, help="directory of gen shards (shard 0's features must be stored)")
    w.add_argument("--features-dir", default=None)
    w.add_argument("--val-samples", type=int, default=64)
    w.add_argument("--val-tokens", type=int, default=128)
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
    f.add_argument(
        "--data", required=True, help="directory of gen shards, or several comma-separated (validation: the first's)"
    )
    f.add_argument("--features-dir", default=None, help="stored features (default: ~/.cache/domino-serve/features/…)")
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
    f.add_argument("--val-samples", type=int, default=64, help="validation sequences held out of the first shard")
    f.add_argument("--val-tokens", type=int, default=128, help="answer tokens walked per validation sequence")
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
