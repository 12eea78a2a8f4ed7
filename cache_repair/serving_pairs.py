"""Serving-shaped training pairs: the groups of a plan (`cache_repair.data_mix`: NQ questions
with distractors, multi-hop rows with their own passages), prefilled with the real LLM.

Per group, the prompt is exactly what the server sends for the group's question and passages
(`retrieval.prompt_layout.PromptLayout` with the served model's tokenizer and the server's
default system prompt): `[head][passage 1]...[passage k][question + tail]`, each passage in its
group's form (`cache_repair.passage_forms`: ending as the annotated layout compiles it, or as the
frontend finds it inside a message).

- stale: each passage prefilled alone at positions 0..n-1, once per distinct passage and cap for
  the whole plan however many groups or rows hold it (`chunks/<key>.safetensors`, the key from
  `cache_repair.serving_plan.chunk_key`: stale_k, stale_v fp16, token_ids), as the chunk store
  holds it;
- target: the joint prefill of the whole prompt; its chunk tokens' K/V (fp16) and its logits
  at every question position (fp32, full vocabulary) go into the group's shard
  (`<split>/<index>.safetensors`, the `cache_repair.pairs.Pair` format).

K is rotated back to RoPE-free coordinates by each token's own position, as in every pair.
The plan is fixed in manifest.json before the first prefill; a rerun with the same options
skips every chunk and shard already written, so an interrupted run resumes where it stopped.
Disk use is estimated from the plan before any prefill and refused above `max_disk_gb`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict
from functools import partial
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cache_repair.data_mix import DataSpec, Source, plan_mix, read_source
from cache_repair.groups import SPLITS, GroupShape, distractor_rows, retrieval_similarity
from cache_repair.passage_forms import ALONE, found_ids
from cache_repair.pairs import (
    DEFAULT_DATA,
    MANIFEST_FILE,
    PairMaker,
    PairsError,
    chunk_name,
    check_resumable,
    save_shard,
    shard_name,
)
from cache_repair.row_groups import RowVariants
from cache_repair.serving_plan import ServedGroup, ServingPlan
from picrag_core.model_fingerprint import model_fingerprint
from picrag_core.repair.network import chunk_ids_for
from retrieval.qa_rows import QARow

logger = logging.getLogger(__name__)

FORMAT = 3  # 3: chunks keyed by passage identity, several data files
LAYOUT = "serving"
_FP16, _FP32, _INT64 = 2, 4, 8


def shard_bytes(tokens: int, question_tokens: int, values_per_token: int, vocab: int) -> int:
    """Tensor bytes of one group's shard: target K and V (fp16), token and chunk ids, the
    question's ids and logits (fp32)."""
    return tokens * (2 * values_per_token * _FP16 + 2 * _INT64) + question_tokens * (vocab * _FP32 + _INT64)


def chunk_bytes(tokens: int, values_per_token: int) -> int:
    """Tensor bytes of one passage's stale K and V (fp16) and token ids."""
    return tokens * (2 * values_per_token * _FP16 + _INT64)


class ServingPairs:
    """The token ids of a plan, and the prefills that turn them into chunk files and shards."""

    def __init__(self, maker: PairMaker, rows: list[list[QARow]], plan: ServingPlan):
        """`rows[d]`: data file d's rows as the plan indexes them."""
        self.maker, self.rows, self.plan = maker, rows, plan
        self.chunk_ids = {key: self._passage_ids(key) for key in tqdm(sorted(plan.chunks), desc="tokenizing passages",
                                                                      unit="passage", leave=False)}

    def _passage_ids(self, key: str) -> list[int]:
        passage, source = self.plan.passage(self.rows, key), self.plan.chunks[key]
        ids_of = self.maker.layout.passage_ids if source.form == ALONE else partial(found_ids, self.maker.layout)
        return ids_of(passage) if source.cap is None else self.maker.passage_ids(passage, source.cap, ids_of)

    def question_ids(self, group: ServedGroup) -> list[int]:
        return self.maker.layout.question_ids(self.rows[group.data][group.row].question)

    def disk_bytes(self) -> tuple[int, dict[str, list[int]]]:
        """(bytes of every chunk file, bytes of every shard per split)."""
        config, vocab = self.maker.config, self.maker.lm_head.out_features
        values = config.num_layers * config.num_kv_heads * config.head_dim
        chunks = sum(chunk_bytes(len(ids), values) for ids in self.chunk_ids.values())
        shards = {split: [shard_bytes(sum(len(self.chunk_ids[key]) for key in g.chunks), len(self.question_ids(g)),
                                      values, vocab)
                          for g in self.plan.groups[split]] for split in SPLITS}
        return chunks, shards

    def write_chunk(self, out: Path, key: str) -> None:
        ids = self.chunk_ids[key]
        keys, values, _ = self.maker.prefill(ids, 0, len(ids))
        save_shard(out / chunk_name(key), {"stale_k": keys, "stale_v": values},
                   {"token_ids": torch.tensor(ids, dtype=torch.int64)}, {"chunk": key})

    def write_group(self, out: Path, split: str, index: int, fingerprint: str) -> int:
        """Prefill the group's whole prompt; returns its chunk tokens."""
        group = self.plan.groups[split][index]
        head, chunks, question = self.maker.layout.head_ids, [self.chunk_ids[key] for key in group.chunks], \
            self.question_ids(group)
        flat = [t for ids in chunks for t in ids]
        start, end = len(head), len(head) + len(flat)
        keys, values, logits = self.maker.prefill(head + flat + question, start, end, logits_from=end)
        exact = {
            "token_ids": torch.tensor(flat, dtype=torch.int64),
            "chunk_ids": chunk_ids_for([len(ids) for ids in chunks]),
            "question_ids": torch.tensor(question, dtype=torch.int64),
            "teacher_logits": logits,
        }
        metadata = {"split": split, "group": str(index), "chunks": json.dumps(list(group.chunks)),
                    "data": str(group.data), "question_row": str(group.row), "start": str(start),
                    "model_fingerprint": fingerprint}
        save_shard(out / shard_name(split, index), {"target_k": keys, "target_v": values}, exact, metadata)
        return len(flat)


def read_sources(data: Sequence[DataSpec], shape: GroupShape, distractor_pool: str | None) -> list[Source]:
    """The data files' rows; a distractor pool's passages follow every NQ-like file's questions."""
    sources = [read_source(spec) for spec in data]
    if distractor_pool is None:
        return sources
    if shape.distractors != "retrieved":
        raise PairsError("a distractor pool is for retrieved distractors (--distractors retrieved)")
    if all(source.multi_hop for source in sources):
        raise PairsError("a distractor pool is for NQ-like data (one passage a question): multi-hop rows "
                         "bring their own passages")
    from cache_repair.distractor_pool import describe, read_pool

    pool = distractor_rows(read_pool(distractor_pool))
    logger.info("pairs: distractors also retrieved from %d passages (%s)", len(pool), describe(distractor_pool))
    for source in sources:
        if not source.multi_hop:
            source.rows += pool
    return sources


def generate_serving_pairs(
    out: Path, model_dir: Path, groups: int | None, val_groups: int, seed: int, shape: GroupShape,
    max_disk_gb: float, data: Sequence[DataSpec] = (DataSpec(DEFAULT_DATA),), maker: PairMaker | None = None,
    distractor_pool: str | None = None, variants: RowVariants = RowVariants(), nq_groups: int = 150,
    passage_form: str = ALONE,
) -> dict[str, Any]:
    """Write (or finish writing) the pairs of a plan into `out`; returns the manifest.
    `groups`: training groups, None for `cache_repair.data_mix`'s default (`nq_groups` when every
    file is NQ-like). `maker`: an already loaded PairMaker for `model_dir` (one is loaded otherwise).
    `distractor_pool`: more passages to retrieve NQ distractors from (`cache_repair.distractor_pool`).
    `passage_form`: how the groups' passages end (`cache_repair.passage_forms`)."""
    out = Path(out)
    sources = read_sources(data, shape, distractor_pool)
    similarity = None
    if shape.distractors == "retrieved":
        from retrieval.embedder import Embedder

        embedder = Embedder()
        similarity = {d: retrieval_similarity(source.rows, embedder, source.questions)
                      for d, source in enumerate(sources) if not source.multi_hop}
    plan = plan_mix(sources, groups, val_groups, shape, variants, seed, nq_groups, similarity).in_form(passage_form)
    counts = {split: len(plan.groups[split]) for split in SPLITS}
    fingerprint = model_fingerprint(model_dir, torch.float32)
    # "groups" holds one entry per group and split, as in every pairs manifest (`shard_paths`).
    settings = {"format": FORMAT, "layout": LAYOUT, "model_fingerprint": fingerprint,
                "data": [spec.to_dict() for spec in data], "seed": seed, "shape": asdict(shape),
                "variants": asdict(variants), **plan.to_dict()}
    if distractor_pool is not None:
        settings["distractor_pool"] = distractor_pool
    if passage_form != ALONE:  # absent from earlier manifests, which stay resumable
        settings["passage_form"] = passage_form
    manifest_path = out / MANIFEST_FILE
    check_resumable(out, settings)

    maker = maker or PairMaker(model_dir)
    pairs = ServingPairs(maker, [source.rows for source in sources], plan)
    chunk_total, shard_sizes = pairs.disk_bytes()
    total = chunk_total + sum(sum(sizes) for sizes in shard_sizes.values())
    sizes = [len(g.chunks) for split in SPLITS for g in plan.groups[split]]
    logger.info("pairs: %d train + %d val groups of %d-%d passages, %d distinct chunks: %.1f MB per group, "
                "%.2f GB in all (%.2f GB of passage KV)", counts["train"], counts["val"], min(sizes), max(sizes),
                len(plan.chunks), total / len(sizes) / 1e6, total / 1e9, chunk_total / 1e9)
    if total > max_disk_gb * 1e9:
        raise PairsError(f"these pairs need {total / 1e9:.1f} GB, above --max-disk-gb {max_disk_gb:g}: "
                         "use fewer --groups (or --variants, or NQ's --max-passage-tokens), or a larger "
                         "--max-disk-gb where the disk has room")
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if total > 0.95 * free:
        raise PairsError(f"these pairs need {total / 1e9:.1f} GB but {out} has {free / 1e9:.1f} GB free")

    manifest = {**settings, "model_dir": str(Path(model_dir).resolve()), "repair_config": maker.config.to_dict(),
                "head_tokens": len(maker.layout.head_ids), "head_ids": maker.layout.head_ids, "disk_bytes": total}
    for folder in (*SPLITS, "chunks"):
        (out / folder).mkdir(exist_ok=True)
    manifest_path.write_text(json.dumps(manifest) + "\n")

    # Validation first: a partial run can already be evaluated against.
    todo = [(split, i) for split in ("val", "train") for i in range(counts[split])
            if not (out / shard_name(split, i)).is_file()]
    logger.info("pairs: %d of %d groups to compute into %s", len(todo), len(sizes), out)
    started = time.monotonic()
    with tqdm(todo, desc="picrag repair pairs", unit="group") as bar:
        for split, i in bar:
            for key in plan.groups[split][i].chunks:
                if not (out / chunk_name(key)).is_file():
                    pairs.write_chunk(out, key)
            tokens = pairs.write_group(out, split, i, fingerprint)
            bar.set_postfix(split=split, tokens=tokens)
    logger.info("pairs: %s complete (%d train, %d val groups) in %.0f s", out, counts["train"], counts["val"],
                time.monotonic() - started)
    return manifest
