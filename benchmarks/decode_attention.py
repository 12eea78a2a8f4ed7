"""One decode row's attention on CPU, by K/V layout: what `sglang_patches.attention.native.attend_decode`
was chosen on.

A decoding request's single query (SmolLM2-135M's shape by default: 9 query heads, 3 KV heads,
dim 64) attends to its row of K/V, one row per layer; between rounds a buffer larger than the
CPU's last-level cache is written, so rows come from memory as they do between decode steps,
when the model's weights have streamed through the cache. Variants:

  tokens-first + enable_gqa   rows [tokens, kv heads, dim], SDPA's GQA (the layout before)
  heads-first, grouped        rows [kv heads, tokens, dim], the query heads of each KV head
                              passed as that head's queries (attend_decode)
  heads-first, bmm            the same rows, matrix products and softmax instead of SDPA

    python benchmarks/decode_attention.py [--tokens 600] [--layers 30] [--rounds 40]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from sglang_patches.attention.native import attend_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--evict-mb", type=int, default=64, help="buffer written between rounds")
    args = parser.parse_args()
    heads, kv_heads, dim, n = args.heads, args.kv_heads, args.dim, args.tokens
    group, scale = heads // kv_heads, dim ** -0.5
    torch.manual_seed(0)
    queries = [torch.randn(heads, dim) for _ in range(args.layers)]
    tokens_first = [(torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for _ in range(args.layers)]
    heads_first = [(k.movedim(0, 1).contiguous(), v.movedim(0, 1).contiguous()) for k, v in tokens_first]
    evict = torch.empty(args.evict_mb * 2**20 // 4)

    def old(layer: int) -> torch.Tensor:
        key, value = tokens_first[layer]
        return sdpa(queries[layer][None, :, None], key.movedim(0, 1)[None], value.movedim(0, 1)[None],
                    scale=scale, enable_gqa=True)[0, :, 0]

    def grouped(layer: int) -> torch.Tensor:
        key, value = heads_first[layer]
        return attend_decode(queries[layer], key, value, scale)

    def bmm(layer: int) -> torch.Tensor:
        key, value = heads_first[layer]
        scores = torch.bmm(queries[layer].view(kv_heads, group, dim), key.transpose(1, 2)).mul_(scale)
        return torch.bmm(scores.softmax(-1), value).reshape(heads, dim)

    variants = {"tokens-first + enable_gqa": old, "heads-first, grouped": grouped, "heads-first, bmm": bmm}
    for layer in range(args.layers):  # all three compute the same attention
        torch.testing.assert_close(grouped(layer), old(layer), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(bmm(layer), old(layer), atol=1e-5, rtol=1e-4)
    print(f"{heads} query heads, {kv_heads} KV heads, dim {dim}, {n} tokens, {args.layers} rows, "
          f"{torch.get_num_threads()} threads; microseconds per row, median of {args.rounds} rounds")
    print("| variant | us per row |\n|---|---|")
    for name, attend in variants.items():
        times = []
        for _ in range(args.rounds):
            evict.fill_(1.0)
            started = time.perf_counter()
            for layer in range(args.layers):
                attend(layer)
            times.append((time.perf_counter() - started) / args.layers * 1e6)
        print(f"| {name} | {sorted(times)[len(times) // 2]:.0f} |")


if __name__ == "__main__":
    main()
