"""`picrag repair pairs|train|eval`: the CacheRepair command group.

`register(subparsers)` adds the group to an argparse subparsers object; every subcommand sets
`func`, a handler that takes the parsed namespace and returns the exit code. Handlers import
torch and the model code when they run, so `picrag --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

Handler = Callable[[argparse.Namespace], int]

DEFAULT_GROUPS = 180
DEFAULT_VAL_GROUPS = 20
DEFAULT_MAX_PASSAGE_TOKENS = 200


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from sglang_patches.repair.config import TrainOptions

    parser = subparsers.add_parser(
        "repair", help="train and evaluate a CacheRepair network for a model",
        description="CacheRepair: a small network, trained once per LLM, that corrects the KV cache of "
        "passages computed alone towards the KV they would have with the preceding context.",
    )
    commands = parser.add_subparsers(dest="repair_command", metavar="COMMAND", required=True)

    pairs = commands.add_parser(
        "pairs", help="compute training pairs (stale and joint chunk KV) with the real model",
        description="Prefill random groups of NQ training passages alone and jointly, in the serving "
        "prompt layout, and write one shard per group. Resumable: existing shards are skipped.",
    )
    pairs.add_argument("--out", type=Path, required=True, metavar="DIR")
    pairs.add_argument("--model", default=None, metavar="PRESET|PATH", help="default: the default preset")
    pairs.add_argument("--groups", type=_positive_int, default=DEFAULT_GROUPS,
                       help=f"training groups of 2-6 passages (default {DEFAULT_GROUPS})")
    pairs.add_argument("--val-groups", type=_positive_int, default=DEFAULT_VAL_GROUPS,
                       help=f"validation groups, on passages never used for training (default {DEFAULT_VAL_GROUPS})")
    pairs.add_argument("--seed", type=int, default=0)
    pairs.add_argument("--max-passage-tokens", type=_positive_int, default=DEFAULT_MAX_PASSAGE_TOKENS,
                       help=f"cut longer passages at a word boundary (default {DEFAULT_MAX_PASSAGE_TOKENS})")
    pairs.add_argument("--data", type=Path, default=None, metavar="FILE.jsonl",
                       help="training passages in the shared QA format (default: nq_open_oracle.train.jsonl)")
    _threads_option(pairs)
    pairs.set_defaults(func=_guarded("pairs", _pairs))

    defaults = TrainOptions()
    train = commands.add_parser(
        "train", help="train a repair network on pairs; write a checkpoint",
        description="Train on the pairs' training split, validate on its validation split, write the "
        "checkpoint (weights, config + model fingerprint, KV statistics) to --out.",
    )
    train.add_argument("--pairs", type=Path, required=True, metavar="DIR")
    train.add_argument("--out", type=Path, required=True, metavar="CKPT_DIR")
    train.add_argument("--steps", type=_positive_int, default=defaults.steps, help="one group per step")
    train.add_argument("--lr", type=float, default=defaults.lr)
    train.add_argument("--width", type=_positive_int, default=defaults.width, help="network width d_b")
    train.add_argument("--blocks", type=_positive_int, default=defaults.blocks, help="transformer blocks")
    train.add_argument("--warmup", type=_positive_int, default=defaults.warmup, help="warm-up steps")
    train.add_argument("--val-every", type=_positive_int, default=defaults.val_every,
                       help="validate and save a resumable state every N steps")
    train.add_argument("--seed", type=int, default=defaults.seed)
    train.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    train.add_argument("--model", default=None, metavar="PRESET|PATH",
                       help="the pairs' model if its folder moved (default: the one in the pairs manifest)")
    _threads_option(train)
    train.set_defaults(func=_guarded("train", _train))

    evaluate = commands.add_parser(
        "eval", help="per-layer relative KV error of a checkpoint on pairs",
        description="Print ||repaired - joint|| / ||stale - joint|| per layer for K and V (1.0 before "
        "repair by definition) and write it as JSON.",
    )
    evaluate.add_argument("--pairs", type=Path, required=True, metavar="DIR")
    evaluate.add_argument("--checkpoint", type=Path, required=True, metavar="CKPT_DIR")
    evaluate.add_argument("--split", choices=["val", "train"], default="val")
    evaluate.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                          help="default: CKPT_DIR/eval_<split>.json")
    evaluate.add_argument("--model", default=None, metavar="PRESET|PATH",
                          help="default: the model folder in the pairs manifest")
    _threads_option(evaluate)
    evaluate.set_defaults(func=_guarded("eval", _eval))
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def _threads_option(parser: argparse.ArgumentParser) -> None:
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=_positive_int, default=cores,
                        help=f"torch threads (default: the {cores} usable cores)")


def _errors() -> tuple[type[Exception], ...]:
    # Every cache_repair error is a ValueError (bad pairs, checkpoint, model folder, options).
    from sglang_patches.model_store import ModelStoreError

    return ValueError, OSError, ModelStoreError


def _guarded(name: str, handler: Handler) -> Handler:
    """The handler with torch's thread count set and user errors reported as one line."""

    def run(args: argparse.Namespace) -> int:
        import torch

        torch.set_num_threads(args.threads)
        try:
            return handler(args)
        except _errors() as exc:
            print(f"picrag repair {name}: error: {exc}", file=sys.stderr)
            return 1

    return run


def _pairs(args: argparse.Namespace) -> int:
    from cache_repair.pairs import DEFAULT_DATA, generate_pairs
    from sglang_patches.model_store import resolve_model

    generate_pairs(args.out, resolve_model(args.model), args.groups, args.val_groups, args.seed,
                   args.max_passage_tokens, args.data or DEFAULT_DATA)
    return 0


def _train(args: argparse.Namespace) -> int:
    from sglang_patches.repair.config import TrainOptions
    from cache_repair.train import Trainer
    from sglang_patches.model_store import resolve_model

    options = TrainOptions(steps=args.steps, lr=args.lr, width=args.width, blocks=args.blocks,
                           warmup=args.warmup, val_every=args.val_every, seed=args.seed)
    model_dir = resolve_model(args.model) if args.model else None
    Trainer(args.pairs, args.out, options, model_dir).run(resume=args.resume)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from sglang_patches.repair.checkpoint import load_repairer
    from sglang_patches.repair.config import read_token_embedding
    from cache_repair.pairs import pairs_model, shard_paths
    from cache_repair.train import evaluate
    from sglang_patches.model_store import resolve_model

    model_dir, fingerprint = pairs_model(args.pairs, resolve_model(args.model) if args.model else None)
    repairer = load_repairer(args.checkpoint, read_token_embedding(model_dir), fingerprint)
    result = evaluate(repairer.network, repairer.stats, shard_paths(args.pairs, args.split))
    print(f"{args.split}: {result.groups} groups, {result.tokens} chunk tokens, loss {result.loss:.4f}")
    print("layer  K before  K after  V before  V after")
    for layer, (k, v) in enumerate(zip(result.relative_k, result.relative_v)):
        print(f"{layer:5d}  {_ratio(k, 1.0)}  {_ratio(k, k)}  {_ratio(v, 1.0)}  {_ratio(v, v)}")
    print(f"  all  {1.0:8.3f}  {result.overall_k:8.3f}  {1.0:8.3f}  {result.overall_v:8.3f}")
    out = args.out or Path(args.checkpoint) / f"eval_{args.split}.json"
    report = {"checkpoint": str(args.checkpoint), "pairs": str(args.pairs), "split": args.split,
              "model_fingerprint": fingerprint, "before": 1.0, **result.to_dict()}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out}")
    return 0


def _ratio(reference: float | None, value: float | None) -> str:
    # Context-free layers (stale == joint, e.g. layer 0) have nothing to repair.
    return f"{'-':>8s}" if reference is None else f"{value:8.3f}"
