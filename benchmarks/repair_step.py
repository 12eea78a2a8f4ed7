"""The CacheRepair step of a link, timed as the engine runs it: `repair_spans` over a KV pool of the
served model's shape, with the shipped checkpoint, for one prompt's chunks; every chunk's network
inputs computed from its stored KV (a chunk's first link) against inputs kept from an earlier link
(every later one: sglang_patches.tree.chunk_cache keeps them with the chunk's node).

    python benchmarks/repair_step.py [--preset smollm2-135m] [--chunks 5] [--tokens 285] [--repeats 5]

Prints the best time of each and their ratio. The pool's KV is random: the network's cost does not
depend on the values.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import time

import torch

from picrag_core.model_fingerprint import model_fingerprint
from picrag_core.model_store import DEFAULT_PRESET, ensure_model
from picrag_core.repair.checkpoint import load_repairer
from picrag_core.repair.config import read_token_embedding
from picrag_core.rope_shift import KeyShifter
from rag_server.launch.repair_checkpoint import SHIPPED_DIR
from sglang_patches.steps.kv_repair import RepairPart, RepairSpan, repair_spans


class Pool:
    """A KV pool of SGLang's interface: one K and one V buffer per layer."""

    start_layer = 0

    def __init__(self, slots: int, layers: int, heads: int, head_dim: int):
        self.layer_num = layers
        self.k = [torch.randn(slots, heads, head_dim) for _ in range(layers)]
        self.v = [torch.randn(slots, heads, head_dim) for _ in range(layers)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def spans(chunks: int, tokens: int, vocab: int) -> list[RepairSpan]:
    """One prompt: `chunks` stored chunks of `tokens` tokens, each grafted whole behind a 40-token head."""
    stored, grafted = 0, chunks * tokens
    return [RepairSpan(torch.arange(stored + i * tokens, stored + (i + 1) * tokens),
                       torch.randint(0, vocab, (tokens,)).tolist(), 40 + i * tokens,
                       [RepairPart(0, tokens, torch.arange(grafted + i * tokens, grafted + (i + 1) * tokens))])
            for i in range(chunks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=DEFAULT_PRESET)
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=285, help="tokens per chunk")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model = ensure_model(args.preset)
    repairer = load_repairer(SHIPPED_DIR / args.preset, read_token_embedding(model),
                             model_fingerprint(model, torch.float32))
    config = repairer.config
    torch.manual_seed(0)
    pool = Pool(2 * args.chunks * args.tokens, config.num_layers, config.num_kv_heads, config.head_dim)
    half = config.head_dim // 2
    angles = torch.outer(torch.arange(2 * args.chunks * args.tokens + 64).float(),
                         1.0 / (10000 ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)))
    shifter = KeyShifter(torch.cat((angles.cos(), angles.sin()), dim=-1), config.head_dim, 2 * half, True)
    prompt = spans(args.chunks, args.tokens, config.vocab_size)

    def best(keep: bool) -> float:
        times = []
        kept = None
        for _ in range(args.repeats + 1):  # the first: warm-up, and the inputs to keep
            step = [RepairSpan(s.stored_slots, s.token_ids, s.position,
                               [RepairPart(p.first, p.count, p.new_slots) for p in s.parts],
                               inputs=kept[i] if keep and kept else None) for i, s in enumerate(prompt)]
            started = time.perf_counter()
            repair_spans(repairer, pool, shifter, step)
            times.append(time.perf_counter() - started)
            kept = [s.inputs for s in step]
        return min(times[1:])

    computed, kept = best(False), best(True)
    print(f"{args.preset}: {args.chunks} chunks x {args.tokens} tokens, best of {args.repeats}")
    print(f"  inputs computed from the stored KV: {computed:.3f} s")
    print(f"  inputs kept from an earlier link:   {kept:.3f} s ({computed / kept:.2f}x faster)")


if __name__ == "__main__":
    main()
