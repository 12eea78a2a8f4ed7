"""How well a CacheRepair checkpoint repairs each part of a chunk: the relative KV error
||repaired - joint|| / ||stale - joint|| of the chunk tokens grouped by their position inside
their chunk (the first token, the second, the 3rd-4th, the 5th-16th, the rest), in the
network's normalised coordinates (the ones its residual loss is taken in), over a pairs
folder's validation groups. Also each group's share of the tokens and of the squared
difference between stale and joint KV.

    python benchmarks/repair_error_by_position.py --pairs DIR --checkpoint CKPT_DIR [--groups N]

Reads pairs and a checkpoint; runs the network (float32), not the LLM.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
from pathlib import Path

import torch

from cache_repair.pairs import Pair, pairs_model, shard_paths
from cache_repair.train import pair_outputs
from picrag_core.repair.checkpoint import load_repairer
from picrag_core.repair.config import read_token_embedding

# Bucket i holds positions [EDGES[i], EDGES[i + 1]) inside a chunk.
EDGES = (0, 1, 2, 4, 16)
NAMES = ("1st", "2nd", "3rd-4th", "5th-16th", "17th on")


def positions_in_chunk(chunk_ids: torch.Tensor) -> torch.Tensor:
    """Each token's index inside its chunk (chunks are contiguous runs of equal ids)."""
    starts = torch.ones_like(chunk_ids, dtype=torch.bool)
    starts[1:] = chunk_ids[1:] != chunk_ids[:-1]
    index = torch.arange(len(chunk_ids))
    return index - torch.cummax(torch.where(starts, index, 0), dim=0).values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--groups", type=int, default=None, help="first N validation groups (default: all)")
    args = parser.parse_args()
    model_dir, fingerprint = pairs_model(args.pairs, None)
    repairer = load_repairer(args.checkpoint, read_token_embedding(model_dir), fingerprint)
    paths = shard_paths(args.pairs, "val")[: args.groups]
    # Per bucket: tokens, then for K and V the squared delta (joint - stale) and squared error.
    sums = torch.zeros(len(NAMES), 5, dtype=torch.float64)
    for path in paths:
        pair = Pair.load(path)
        with torch.no_grad():
            prediction, target = pair_outputs(repairer.network, repairer.stats, pair)
        bucket = torch.bucketize(positions_in_chunk(pair.chunk_ids), torch.tensor(EDGES[1:]), right=True)
        per_token = [target[0], (prediction - target)[0], target[1], (prediction - target)[1]]
        per_token = [t.double().square().sum(dim=(1, 2, 3)) for t in per_token]
        for i in range(len(NAMES)):
            rows = bucket == i
            sums[i] += torch.tensor([rows.sum(), *(t[rows].sum() for t in per_token)], dtype=torch.float64)
    delta_total = (sums[:, 1] + sums[:, 3]).sum()
    print(f"{len(paths)} validation groups of {args.pairs}, checkpoint {args.checkpoint}\n")
    print("| position in chunk | share of tokens | share of the stale-joint difference | rel. K | rel. V |")
    print("|---|---|---|---|---|")
    for name, (tokens, dk, ek, dv, ev) in zip(NAMES, sums.tolist()):
        print(f"| {name} | {tokens / sums[:, 0].sum():.1%} | {(dk + dv) / delta_total:.1%} | "
              f"{(ek / dk) ** 0.5:.3f} | {(ev / dv) ** 0.5:.3f} |")


if __name__ == "__main__":
    main()
