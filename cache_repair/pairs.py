"""Training pairs from the real LLM: each group's chunk KV computed alone (stale) and jointly.

A group is a few NQ gold passages laid out exactly as at serving time
(`retrieval.prompt_layout`): stale = each passage prefilled alone at positions 0..n-1 (no
head, no BOS), joint = head + passage 1 + passage 2 + ... in one prefill. K is taken after
RoPE from the cache and rotated back by each token's own position (local for stale, global
for joint), so both live in RoPE-free coordinates where the only difference left is the
context the chunk did not see. One shard per group, fp16:

    stale_k, stale_v, target_k, target_v   [T, L, H, D]   (T = the group's chunk tokens)
    token_ids, chunk_ids                   [T] int64

The group plan (which passages, seeded) is fixed in manifest.json before any prefill, so an
interrupted run resumes by skipping the shards already written. Validation groups draw from
their own passages, never used in training.

Serving-shaped pairs (`cache_repair.serving_pairs`) share this shard format and add the
question: `question_ids` [Q], the joint prefill's `teacher_logits` [Q, vocab] (fp32) at the
question's positions, and `start` (the prompt position of the first chunk token). Their stale
KV is stored once per distinct passage and cap (`chunks/<key>.safetensors`) and named in the
shard's metadata.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from cache_repair.groups import training_rows
from picrag_core.repair.config import RepairConfig, read_hf_config
from picrag_core.repair.network import chunk_ids_for
from retrieval.prompt_layout import PromptLayout, PromptPassage
from picrag_core.model_fingerprint import model_fingerprint
from picrag_core.rope_shift import KeyShifter

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val")
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "qa" / "nq_open_oracle.train.jsonl"
MIN_GROUP, MAX_GROUP = 2, 6
_FORMAT = 1


class PairsError(ValueError):
    pass


@dataclass
class Pair:
    """One group's chunk tokens; K in RoPE-free coordinates. Serving-shaped groups also carry
    their question and the joint prefill's logits over it."""

    stale_k: torch.Tensor
    stale_v: torch.Tensor
    target_k: torch.Tensor
    target_v: torch.Tensor
    token_ids: torch.Tensor
    chunk_ids: torch.Tensor
    question_ids: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None
    start: int = 0

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        tensors = {name: getattr(self, name) for name in ("stale_k", "stale_v", "target_k", "target_v")}
        save_shard(path, tensors, {"token_ids": self.token_ids, "chunk_ids": self.chunk_ids}, metadata)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32) -> Pair:
        path = Path(path)
        t = load_file(path)
        if "stale_k" not in t:  # serving-shaped: stale KV lives once per passage
            with safe_open(path, "pt") as f:
                metadata = f.metadata()
            chunks = [load_file(path.parents[1] / chunk_name(key)) for key in json.loads(metadata["chunks"])]
            t["stale_k"] = torch.cat([c["stale_k"] for c in chunks])
            t["stale_v"] = torch.cat([c["stale_v"] for c in chunks])
            t["start"] = torch.tensor(int(metadata["start"]))
        return cls(*(t[n].to(dtype) for n in ("stale_k", "stale_v", "target_k", "target_v")),
                   t["token_ids"], t["chunk_ids"], t.get("question_ids"), t.get("teacher_logits"),
                   int(t.get("start", 0)))

    @property
    def tokens(self) -> int:
        return self.token_ids.shape[0]


def chunk_name(key: int | str) -> str:
    """A chunk's stale KV file: named by its identity (`cache_repair.serving_plan.chunk_key`);
    pairs folders of format 2 named it by its NQ row, and still train."""
    return f"chunks/{key:05d}.safetensors" if isinstance(key, int) else f"chunks/{key}.safetensors"


def save_shard(path: Path, kv: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
               metadata: dict[str, str]) -> None:
    """KV tensors in fp16 (refused if they overflow), `exact` ones as they are; written to a
    temporary name and renamed, so an interrupted run never leaves a half-written shard."""
    tensors = {}
    for name, tensor in kv.items():
        tensors[name] = tensor.to(torch.float16).contiguous()
        if not torch.isfinite(tensors[name]).all():
            raise PairsError(f"{name} overflows fp16 in {path.name}")
    tensors.update({name: tensor.contiguous() for name, tensor in exact.items()})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


def rope_cos_sin(hf_config: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """(cos_sin_cache [max_pos, rotary_dim], rotary_dim) of plain RoPE, as SGLang lays it out."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise PairsError(
            f"rope type {kind!r}: training pairs derotate keys with plain RoPE tables; "
            "scaled RoPE variants are not supported"
        )
    theta = params.get("rope_theta") or hf_config.get("rope_theta")
    if theta is None:
        raise PairsError("the model config names no rope_theta")
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    rotary_dim = int(head_dim * (params.get("partial_rotary_factor") or hf_config.get("partial_rotary_factor", 1.0)))
    # The same float32 products as the LLM's own rotary embedding, so derotation is exact.
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = torch.outer(torch.arange(hf_config["max_position_embeddings"], dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1), rotary_dim


class PairMaker:
    """Prefills groups with the real LLM and returns their stale/joint chunk KV."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_config = read_hf_config(model_dir)
        self.config = RepairConfig.for_model(model_dir)
        cos_sin, rotary_dim = rope_cos_sin(hf_config)
        self.shifter = KeyShifter(cos_sin, self.config.head_dim, rotary_dim, is_neox_style=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.layout = PromptLayout(self.tokenizer)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # The decoder alone: logits are only needed at a serving group's question positions.
        self.decoder, self.lm_head = model.model, model.lm_head

    def passage_ids(self, passage: PromptPassage, max_tokens: int,
                    ids_of: Callable[[PromptPassage], list[int]] | None = None) -> list[int]:
        """The passage's serving token ids (`ids_of`, default the layout's), its text cut at a
        word boundary to fit max_tokens (cutting the token list instead would drop the separator
        every passage ends with)."""
        ids_of = ids_of or self.layout.passage_ids
        ids = ids_of(passage)
        if len(ids) <= max_tokens:
            return ids
        words = passage.text.split()
        low, high = 0, len(words)  # the answer: the most words that still fit
        while low < high:
            middle = (low + high + 1) // 2
            if len(ids_of(PromptPassage(passage.title, " ".join(words[:middle])))) <= max_tokens:
                low = middle
            else:
                high = middle - 1
        ids = ids_of(PromptPassage(passage.title, " ".join(words[:low])))
        return ids if len(ids) <= max_tokens else ids[:max_tokens]

    @torch.inference_mode()
    def prefill(self, input_ids: list[int], first: int, last: int, logits_from: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K (RoPE-free) and V [last - first, L, H, D] of tokens first..last-1 of a prefill of
        input_ids from position 0, and the fp32 logits at positions logits_from.. if asked."""
        output = self.decoder(input_ids=torch.tensor([input_ids]), use_cache=True)
        cache = output.past_key_values
        keys = torch.stack([layer.keys[0, :, first:last] for layer in cache.layers], dim=0)  # [L, H, n, D]
        values = torch.stack([layer.values[0, :, first:last] for layer in cache.layers], dim=0)
        keys, values = keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3)  # [n, L, H, D]
        n, layers, heads, dim = keys.shape
        positions = torch.arange(first, first + n)
        keys = self.shifter.shift_each(keys.reshape(n, layers * heads, dim), -positions).view(n, layers, heads, dim)
        logits = None if logits_from is None else self.lm_head(output.last_hidden_state[0, logits_from:]).float()
        return keys.contiguous(), values.contiguous(), logits

    def make_pair(self, passages_ids: list[list[int]]) -> Pair:
        stale = [self.prefill(ids, 0, len(ids))[:2] for ids in passages_ids]
        head = self.layout.head_ids
        joint = head + [t for ids in passages_ids for t in ids]
        joint_k, joint_v, _ = self.prefill(joint, len(head), len(joint))
        return Pair(
            stale_k=torch.cat([k for k, _ in stale]), stale_v=torch.cat([v for _, v in stale]),
            target_k=joint_k, target_v=joint_v,
            token_ids=torch.tensor([t for ids in passages_ids for t in ids], dtype=torch.int64),
            chunk_ids=chunk_ids_for([len(ids) for ids in passages_ids]),
        )


def read_passages(path: Path) -> list[PromptPassage]:
    """The distinct passages of a shared-QA training file, in file order."""
    return list(dict.fromkeys(p for row in training_rows(path) for p in row.passages))


def plan_groups(passages: int, groups: int, val_groups: int, seed: int) -> dict[str, list[list[int]]]:
    """Passage indices of every group; validation passages are disjoint from training ones."""
    rng = random.Random(seed)
    order = list(range(passages))
    rng.shuffle(order)
    val_pool, train_pool = order[: val_groups * MAX_GROUP], order[val_groups * MAX_GROUP :]
    if len(train_pool) < MAX_GROUP:
        raise PairsError(f"{passages} passages are too few for {val_groups} validation groups")

    def draw(pool: list[int], count: int) -> list[list[int]]:
        # Passages are used once each before any repeats; reshuffled when the pool runs out.
        plan, queue = [], []
        for _ in range(count):
            size = rng.randint(MIN_GROUP, MAX_GROUP)
            if len(queue) < size:
                queue = queue + rng.sample(pool, len(pool))
            plan.append(queue[:size])
            queue = queue[size:]
        return plan

    return {"val": draw(val_pool, val_groups), "train": draw(train_pool, groups)}


def shard_name(split: str, index: int) -> str:
    return f"{split}/{index:05d}.safetensors"


def read_manifest(pairs_dir: Path) -> dict[str, Any]:
    path = Path(pairs_dir) / MANIFEST_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PairsError(f"no readable pairs manifest at {path} (run `picrag repair pairs`): {exc}") from exc


def check_resumable(out: Path, settings: dict) -> None:
    """Refuse to resume pairs in `out` that were made with other settings."""
    if not (out / MANIFEST_FILE).is_file():
        return
    existing = read_manifest(out)
    changed = [k for k, v in settings.items() if existing.get(k) != v]
    if changed:
        raise PairsError(f"{out} holds pairs made with other settings ({', '.join(changed)}); "
                         "use another --out or the same options")


def pairs_model(pairs_dir: Path, model_dir: Path | None = None) -> tuple[Path, str]:
    """(model folder, fingerprint) of the model the pairs were made with: the manifest's folder,
    or `model_dir` if it moved; refused if its weights or config changed since."""
    manifest = read_manifest(pairs_dir)
    model_dir = Path(model_dir or manifest["model_dir"])
    fingerprint = model_fingerprint(model_dir, torch.float32)
    if fingerprint != manifest["model_fingerprint"]:
        raise PairsError(f"{model_dir} has fingerprint {fingerprint}, but the pairs in {pairs_dir} were made "
                         f"with {manifest['model_fingerprint']}: pass --model with that model")
    return model_dir, fingerprint


def shard_paths(pairs_dir: Path, split: str) -> list[Path]:
    """The shards of a split; all of them must exist (a finished `picrag repair pairs` run)."""
    manifest = read_manifest(pairs_dir)
    paths = [Path(pairs_dir) / shard_name(split, i) for i in range(len(manifest["groups"][split]))]
    missing = sum(not p.is_file() for p in paths)
    if missing:
        raise PairsError(f"{pairs_dir}: {missing} of {len(paths)} {split} shards missing; "
                         "run `picrag repair pairs` again with the same options to finish")
    if not paths:
        raise PairsError(f"{pairs_dir} has no {split} shards")
    return paths


def generate_pairs(
    out: Path, model_dir: Path, groups: int, val_groups: int, seed: int, max_passage_tokens: int,
    data: Path = DEFAULT_DATA,
) -> dict[str, Any]:
    out = Path(out)
    passages = read_passages(data)
    plan = plan_groups(len(passages), groups, val_groups, seed)
    fingerprint = model_fingerprint(model_dir, torch.float32)
    # The data file by name: the same run resumed from another checkout must match.
    settings = {"format": _FORMAT, "model_fingerprint": fingerprint, "data": Path(data).name,
                "seed": seed, "max_passage_tokens": max_passage_tokens, "groups": plan}
    manifest_path = out / MANIFEST_FILE
    check_resumable(out, settings)
    maker = PairMaker(model_dir)
    manifest = {**settings, "model_dir": str(Path(model_dir).resolve()), "repair_config": maker.config.to_dict(),
                "head_tokens": len(maker.layout.head_ids)}
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")

    todo = [(split, i, group) for split in SPLITS for i, group in enumerate(plan[split])
            if not (out / shard_name(split, i)).is_file()]
    ids = {(split, i): [maker.passage_ids(passages[p], max_passage_tokens) for p in group] for split, i, group in todo}
    _check_disk(out, sum(len(t) for group in ids.values() for t in group), maker.config)
    logger.info("pairs: %d of %d groups to compute into %s", len(todo), groups + val_groups, out)
    with tqdm(todo, desc="picrag repair pairs", unit="group") as bar:
        for split, i, group in bar:
            pair = maker.make_pair(ids[split, i])
            pair.save(out / shard_name(split, i), {"split": split, "group": str(i), "passages": json.dumps(group),
                                                   "model_fingerprint": fingerprint})
            bar.set_postfix(split=split, tokens=pair.tokens)
    logger.info("pairs: %s complete (%d train, %d val groups)", out, groups, val_groups)
    return manifest


def _check_disk(out: Path, tokens: int, config: RepairConfig) -> None:
    # Four fp16 tensors of L*H*D values per token.
    needed = tokens * 4 * 2 * config.num_layers * config.num_kv_heads * config.head_dim
    free = shutil.disk_usage(out).free
    logger.info("pairs: %d chunk tokens to compute, about %.2f GB on disk", tokens, needed / 1e9)
    if needed > 0.95 * free:
        raise PairsError(f"pairs need about {needed / 1e9:.1f} GB but {out} has {free / 1e9:.1f} GB free; "
                         "use fewer --groups or a smaller --max-passage-tokens")
