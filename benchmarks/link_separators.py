"""Learned separator tokens at link time: N key/value entries per layer, learned, placed before
every chunk of the linked prompt, with the LLM (and the repair network, if one is given) frozen.
They are trained on the answer KL (the frozen reader's next-token distributions over each
training group's question, against the joint prefill's) and judged on the validation groups'
exact first-token KL and greedy agreement, with and without them.

    python benchmarks/link_separators.py --pairs DIR [--checkpoint CKPT_DIR] [--tokens 4] [--steps 400]

Without --checkpoint the chunks keep their stale (naive) KV. The question it answers: can learned
tokens at the seams between independently computed passages (KV Packet's trailer idea, without
re-encoding the passages, so a step back-propagates through the question's tokens only) close
what the repair leaves? Holds every training group's chunk KV in memory (about 8 GB for
Qwen2.5-Coder-0.5B's 150 groups); about 0.75 s a step on 2 CPU cores for that model.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cache_repair.answer_loss import FrozenReader, answer_kl
from cache_repair.pairs import Pair, pairs_model, shard_paths
from cache_repair.train import answer_reader
from picrag_core.repair.checkpoint import load_repairer
from picrag_core.repair.config import read_token_embedding


@dataclass
class Group:
    k: torch.Tensor  # [T, L, H, D], RoPE-free: stale, or stale + the network's residual
    v: torch.Tensor
    chunk_starts: list[int]
    question_ids: torch.Tensor
    teacher_logits: torch.Tensor


def load_group(path: Path, repairer) -> Group:
    pair = Pair.load(path)
    k, v = pair.stale_k, pair.stale_v
    if repairer is not None:
        with torch.no_grad():
            res_k, res_v = repairer.network(k, v, pair.token_ids, pair.chunk_ids, scales=repairer.stats)
        k, v = k + res_k.float(), v + res_v.float()
    starts = torch.nonzero(torch.diff(pair.chunk_ids, prepend=pair.chunk_ids[:1] - 1))[:, 0].tolist()
    return Group(k, v, starts, pair.question_ids, pair.teacher_logits)


class Separators(torch.nn.Module):
    def __init__(self, groups: list[Group], tokens: int):
        super().__init__()
        # Each starts as the mean KV of the chunks' first tokens: in a chunk computed alone, the
        # token every later one attends to most.
        first_k = torch.cat([g.k[g.chunk_starts] for g in groups]).mean(0, keepdim=True)
        first_v = torch.cat([g.v[g.chunk_starts] for g in groups]).mean(0, keepdim=True)
        self.k = torch.nn.Parameter(first_k.repeat(tokens, 1, 1, 1))
        self.v = torch.nn.Parameter(first_v.repeat(tokens, 1, 1, 1))

    def interleave(self, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's chunk KV with the separators before every chunk."""
        bounds = [*group.chunk_starts, group.k.shape[0]]
        ks, vs = [], []
        for start, end in zip(bounds, bounds[1:]):
            ks += [self.k, group.k[start:end]]
            vs += [self.v, group.v[start:end]]
        return torch.cat(ks), torch.cat(vs)


def logits(reader: FrozenReader, group: Group, separators: Separators | None) -> torch.Tensor:
    k, v = (group.k, group.v) if separators is None else separators.interleave(group)
    return reader.question_logits(k, v, group.question_ids)


@torch.no_grad()
def evaluate(reader: FrozenReader, groups: list[Group], separators: Separators | None) -> tuple[float, float]:
    kls, agreements = [], []
    for group in groups:
        out = logits(reader, group, separators)
        kls.append(float(answer_kl(out, group.teacher_logits, 1)))
        agreements.append(int(out[-1].argmax()) == int(group.teacher_logits[-1].argmax()))
    return sum(kls) / len(kls), sum(agreements) / len(agreements)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, required=True, help="serving-shaped pairs (picrag repair pairs)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="repair the chunks first (default: naive)")
    parser.add_argument("--tokens", type=int, default=4, help="separator tokens before each chunk")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    order = random.Random(args.seed)

    model_dir, fingerprint = pairs_model(args.pairs, None)
    reader = answer_reader(args.pairs, model_dir)
    if reader is None:
        raise SystemExit(f"{args.pairs} holds no questions: make serving-shaped pairs (picrag repair pairs)")
    repairer = (load_repairer(args.checkpoint, read_token_embedding(model_dir), fingerprint)
                if args.checkpoint else None)
    started = time.monotonic()
    train = [load_group(path, repairer) for path in shard_paths(args.pairs, "train")]
    val = [load_group(path, repairer) for path in shard_paths(args.pairs, "val")]
    print(f"{len(train)} training and {len(val)} validation groups, chunks "
          f"{'repaired by ' + str(args.checkpoint) if repairer else 'stale (naive)'}, loaded in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    kl, agreement = evaluate(reader, val, None)
    print(f"validation, no separators: first-token KL {kl:.4f}, agreement {agreement:.0%}", flush=True)
    separators = Separators(train, args.tokens)
    kl, agreement = evaluate(reader, val, separators)
    print(f"validation, {args.tokens} separators at their start: first-token KL {kl:.4f}, "
          f"agreement {agreement:.0%}", flush=True)

    optimizer = torch.optim.Adam(separators.parameters(), lr=args.lr)
    queue: list[int] = []
    running = None
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        if not queue:
            queue = order.sample(range(len(train)), len(train))
        group = train[queue.pop()]
        loss = answer_kl(logits(reader, group, separators), group.teacher_logits, 0)  # every question position
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0:
            print(f"step {step}: training answer KL (all question positions, smoothed) {running:.4f}, "
                  f"{time.monotonic() - started:.0f} s", flush=True)
        if step % args.val_every == 0 or step == args.steps:
            kl, agreement = evaluate(reader, val, separators)
            print(f"  validation at step {step}: first-token KL {kl:.4f}, agreement {agreement:.0%}", flush=True)


if __name__ == "__main__":
    main()
