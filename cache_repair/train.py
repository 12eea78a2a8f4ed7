"""Training and evaluation of a repair network on the pairs of `cache_repair.pairs`.

One step is one group (one request's chunks). The loss is the weighted sum of two terms:
- residual: the MSE between the network's output and (joint - stale) / delta_sigma in
  normalised RoPE-free coordinates, over every chunk token, layer, head, K and V;
- answer (serving-shaped pairs only, which carry a question): the KL between the joint
  prefill's next-token distribution and the frozen LLM's on the repaired KV, at the last
  `kl_positions` prompt positions (`cache_repair.answer_loss`), back-propagated through the
  frozen LLM into the network.
Training may draw on several pairs folders made for the same model and serving head (for
example random and retrieved distractors): their training splits are pooled; the first folder
gives the validation split and the normalisation statistics (only scales, so one folder's serve
for all).
A run may start from a trained checkpoint (`init`, fine-tuning: for example the answer term on
top of a network trained on the residual alone): its weights, geometry and statistics, the last
because the network's outputs are in the coordinates they define.
The out dir holds a resumable training state
(train_state.pt: network, optimizer, scheduler, step, statistics) written at every
validation, and at the end the checkpoint that serving loads (`picrag_core.repair.checkpoint`).

Quality is reported as the per-layer relative KV error ||repaired - joint|| / ||stale - joint||
over a split (1.0 is the stale cache, 0.0 a perfect repair) and, on serving-shaped pairs, as
the exact first-token KL (full vocabulary) to the joint prefill and the share of groups whose
greedy first token is the joint prefill's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from picrag_core.repair.checkpoint import load_repairer, save_checkpoint
from picrag_core.repair.config import RepairConfig, TrainOptions, read_token_embedding
from picrag_core.repair.network import RepairNetwork, in_precision
from picrag_core.repair.normalization import CONTEXT_FREE_RATIO, KVStats, KVStatsAccumulator
from cache_repair.answer_loss import FrozenReader, answer_kl
from cache_repair.pairs import Pair, pairs_model, read_manifest, shard_paths

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
STATS_FILE = "train_kv_stats.safetensors"  # in the pairs folder
LOG_FILE = "train_log.jsonl"


class TrainError(ValueError):
    pass


def lr_factor(step: int, options: TrainOptions) -> float:
    """Linear warm-up to the full rate, then cosine decay to 0 at the last step."""
    if step < options.warmup:
        return (step + 1) / options.warmup
    progress = (step - options.warmup) / max(1, options.steps - options.warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def compute_stats(paths: list[Path]) -> KVStats:
    accumulator = KVStatsAccumulator()
    for path in tqdm(paths, desc="KV statistics", unit="group"):
        pair = Pair.load(path)
        accumulator.add(pair.stale_k, pair.stale_v, pair.target_k, pair.target_v)
    return accumulator.finish()


def training_stats(pairs_dir: Path, train_paths: list[Path]) -> KVStats:
    """The statistics of the training split, computed once per pairs folder (every run on
    the same pairs gets the same ones) and kept beside the pairs."""
    path = Path(pairs_dir) / STATS_FILE
    if path.is_file():
        return KVStats.from_tensors(load_file(path))
    stats = compute_stats(train_paths)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(stats.tensors(), tmp)
    os.replace(tmp, path)
    return stats


def pair_outputs(network: RepairNetwork, stats: KVStats, pair: Pair) -> tuple[torch.Tensor, torch.Tensor]:
    """(prediction, target), both normalised and stacked as [2, T, L, H, D] (K, V)."""
    stale_k, stale_v = stats.normalise(pair.stale_k, pair.stale_v)
    target = torch.stack(stats.normalise_delta(pair.target_k - pair.stale_k, pair.target_v - pair.stale_v))
    return torch.stack(network(stale_k, stale_v, pair.token_ids, pair.chunk_ids)), target


def repaired_logits(reader: FrozenReader, stats: KVStats, pair: Pair, prediction: torch.Tensor) -> torch.Tensor:
    """The frozen LLM's logits over the pair's question on stale + the predicted residual."""
    if pair.question_ids is None:
        raise TrainError("these pairs have no questions: make serving-shaped pairs (picrag repair pairs)")
    if pair.start != reader.head_tokens:
        raise TrainError(f"the pair's chunks start at {pair.start}, after a head of {reader.head_tokens} tokens")
    res_k, res_v = stats.denormalise_residual(prediction[0], prediction[1])
    return reader.question_logits(pair.stale_k + res_k, pair.stale_v + res_v, pair.question_ids)


def step_loss(network: RepairNetwork, stats: KVStats, pair: Pair, options: TrainOptions,
              reader: FrozenReader | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted training loss of one group and its terms' values."""
    prediction, target = pair_outputs(network, stats, pair)
    residual = F.mse_loss(prediction, target)
    loss, parts = options.residual_weight * residual, {"residual": residual.item()}
    if reader is not None and options.kl_weight:
        kl = answer_kl(repaired_logits(reader, stats, pair, prediction), pair.teacher_logits, options.kl_positions)
        loss = loss + options.kl_weight * kl
        parts["kl"] = kl.item()
    return loss, parts


@dataclass
class Evaluation:
    loss: float
    tokens: int
    groups: int
    # Per layer; None where stale and joint agree (context-free layers: nothing to repair).
    relative_k: list[float | None]
    relative_v: list[float | None]
    overall_k: float
    overall_v: float
    # Serving-shaped pairs: exact first-token KL to the joint prefill, and the share of groups
    # whose greedy first token matches it; None without a reader or questions.
    first_token_kl: float | None = None
    first_token_agreement: float | None = None
    # One entry per group (shard): its tokens, loss and, where measured, first-token KL and
    # agreement, so that a comparison of two checkpoints can be paired group by group.
    per_group: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RelativeError:
    """Sums of squares per layer: residual error, stale error and stale magnitude."""

    def __init__(self, layers: int):
        self.sums = torch.zeros(3, 2, layers, dtype=torch.float64)  # [error|delta|stale, K|V, L]

    def add(self, pair: Pair, res_k: torch.Tensor, res_v: torch.Tensor) -> None:
        for i, (res, stale, target) in enumerate(((res_k, pair.stale_k, pair.target_k),
                                                  (res_v, pair.stale_v, pair.target_v))):
            delta = (target - stale).double()
            for row, value in enumerate((res.double() - delta, delta, stale.double())):
                self.sums[row, i] += value.square().sum(dim=(0, 2, 3))

    def ratios(self) -> tuple[list[float | None], list[float | None], float, float]:
        error, delta, stale = self.sums
        per_layer = (error / delta.clamp_min(1e-30)).sqrt()
        repairable = delta.sqrt() >= CONTEXT_FREE_RATIO * stale.sqrt()
        layers = [[float(r) if ok else None for r, ok in zip(per_layer[i], repairable[i])] for i in range(2)]
        overall = [float((error[i][repairable[i]].sum() / delta[i][repairable[i]].sum().clamp_min(1e-30)).sqrt())
                   for i in range(2)]
        return layers[0], layers[1], overall[0], overall[1]


@torch.no_grad()
def evaluate(network: RepairNetwork, stats: KVStats, paths: list[Path], reader: FrozenReader | None = None,
             precision: torch.dtype = torch.float32) -> Evaluation:
    """`precision`: what the network's products run in (served in float32)."""
    was_training = network.training
    network.eval()
    errors = RelativeError(network.config.num_layers)
    loss_sum, elements, tokens = 0.0, 0, 0
    kls, agreements, per_group = [], [], []
    for path in paths:
        pair = Pair.load(path)
        with in_precision(torch.device("cpu"), precision):
            prediction, target = pair_outputs(network, stats, pair)
        prediction = prediction.float()
        group_loss = float(F.mse_loss(prediction, target, reduction="sum"))
        loss_sum += group_loss
        elements += target.numel()
        tokens += pair.tokens
        errors.add(pair, *stats.denormalise_residual(prediction[0], prediction[1]))
        figures = {"group": path.name, "tokens": pair.tokens, "loss": group_loss / target.numel()}
        if reader is not None and pair.question_ids is not None:
            logits = repaired_logits(reader, stats, pair, prediction)
            kls.append(float(answer_kl(logits, pair.teacher_logits, 1)))
            agreements.append(int(logits[-1].argmax()) == int(pair.teacher_logits[-1].argmax()))
            figures |= {"first_token_kl": kls[-1], "first_token_agreement": agreements[-1]}
        per_group.append(figures)
    network.train(was_training)
    rel_k, rel_v, overall_k, overall_v = errors.ratios()
    answers = (sum(kls) / len(kls), sum(agreements) / len(agreements)) if kls else (None, None)
    return Evaluation(loss_sum / elements, tokens, len(paths), rel_k, rel_v, overall_k, overall_v, *answers,
                      per_group=per_group)


def answer_reader(pairs_dir: Path, model_dir: Path) -> FrozenReader | None:
    """The frozen LLM behind the pairs' serving head, for pairs that carry questions."""
    manifest = read_manifest(pairs_dir)
    return FrozenReader(model_dir, manifest["head_ids"]) if "head_ids" in manifest else None


def _answer_text(result: Evaluation) -> str:
    if result.first_token_kl is None:
        return ""
    return f", first-token KL {result.first_token_kl:.4f}, greedy agreement {result.first_token_agreement:.0%}"


def pooled_train_paths(pairs_dir: Path, more_pairs: tuple[Path, ...]) -> list[Path]:
    """The training shards of `pairs_dir` and of every folder in `more_pairs`, refused unless
    all were made for the same model, network geometry and serving head."""
    first = read_manifest(pairs_dir)
    paths = shard_paths(pairs_dir, "train")
    for other_dir in more_pairs:
        other = read_manifest(other_dir)
        differ = [key for key in ("model_fingerprint", "repair_config", "head_ids") if other.get(key) != first.get(key)]
        if differ:
            raise TrainError(f"{other_dir} was made with another {', '.join(differ)} than {pairs_dir}")
        paths += shard_paths(other_dir, "train")
    return paths


@dataclass
class Trainer:
    pairs_dir: Path  # validation split and normalisation statistics from here
    out: Path
    options: TrainOptions
    model_dir: Path | None = None
    more_pairs: tuple[Path, ...] = ()  # further folders whose training splits are pooled in
    init: Path | None = None  # a checkpoint to start from instead of a fresh network
    history: list[dict[str, Any]] = field(default_factory=list)

    def run(self, resume: bool = False) -> Evaluation:
        manifest = read_manifest(self.pairs_dir)
        model_dir, fingerprint = pairs_model(self.pairs_dir, self.model_dir)
        train_paths = pooled_train_paths(self.pairs_dir, self.more_pairs)
        val_paths = shard_paths(self.pairs_dir, "val")
        config = RepairConfig.from_dict({**manifest["repair_config"], "width": self.options.width,
                                         "blocks": self.options.blocks, "compress_dim": self.options.compress_dim})
        self.out.mkdir(parents=True, exist_ok=True)
        state_path = self.out / STATE_FILE
        state = self._load_state(state_path, resume)
        embedding = read_token_embedding(model_dir)
        torch.manual_seed(self.options.seed)
        network = RepairNetwork(config, embedding)
        if state:
            stats = KVStats.from_tensors(state["stats"])
        elif self.init:
            stats = self._start_from(network, embedding, fingerprint)
        else:
            stats = training_stats(self.pairs_dir, shard_paths(self.pairs_dir, "train"))
        optimizer = torch.optim.AdamW(network.parameters(), lr=self.options.lr, betas=(0.9, 0.95), weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, self.options))
        start = 0
        if state:
            network.load_state_dict(state["network"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            start, self.history = state["step"], state["history"]
            logger.info("resuming %s at step %d of %d", self.out, start, self.options.steps)
        logger.info("repair network: %d trainable parameters, %d train / %d val groups",
                    network.trainable_parameters(), len(train_paths), len(val_paths))

        reader = answer_reader(self.pairs_dir, model_dir)
        if reader is None and self.options.kl_weight:
            logger.warning("%s has no questions: training on the residual term alone", self.pairs_dir)
        network.train()
        running: dict[str, float] = {}
        final = None
        with tqdm(range(start, self.options.steps), desc="picrag repair train", unit="step",
                  initial=start, total=self.options.steps) as bar:
            for step in bar:
                pair = Pair.load(self._shard_at(step, train_paths))
                loss, parts = step_loss(network, stats, pair, self.options, reader)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                for name, value in {"loss": loss.item(), **parts}.items():
                    running[name] = value if name not in running else 0.95 * running[name] + 0.05 * value
                bar.set_postfix({**{k: f"{v:.4f}" for k, v in running.items()},
                                 "lr": f"{scheduler.get_last_lr()[0]:.2e}"})
                done = step + 1
                if done % self.options.val_every == 0 or done == self.options.steps:
                    final = self._validate(network, stats, val_paths, done, running, reader)
                    self._save_state(state_path, network, optimizer, scheduler, stats, done)

        final = final or evaluate(network, stats, val_paths, reader)
        summary = {
            "steps": self.options.steps, "options": asdict(self.options), "pairs": self._pairs_names(),
            "init": self._init_name(), "train_groups": len(train_paths), "val_groups": len(val_paths),
            "final_train_loss": self.history[-1]["train_loss"] if self.history else None,
            "final_val_loss": final.loss, "val_relative_error": final.to_dict(),
            "trainable_parameters": network.trainable_parameters(),
        }
        save_checkpoint(self.out, network, config, stats, fingerprint, summary)
        logger.info("checkpoint written to %s (val loss %.4f, relative error K %.3f V %.3f%s)",
                    self.out, final.loss, final.overall_k, final.overall_v, _answer_text(final))
        return final

    def _start_from(self, network: RepairNetwork, embedding: torch.Tensor, fingerprint: str) -> KVStats:
        """Load `self.init`'s weights into `network`; its statistics (refused for another model
        or another network geometry)."""
        init = self.init
        trained = load_repairer(init, embedding, fingerprint)
        mine, theirs = network.config.to_dict(), trained.config.to_dict()
        differ = sorted(key for key in mine if mine[key] != theirs.get(key))
        if differ:
            raise TrainError(f"--init {init} has another network geometry ("
                             + "; ".join(f"{key}: {theirs.get(key)} there, {mine[key]} here" for key in differ) + ")")
        network.load_state_dict(trained.network.state_dict())
        logger.info("starting from the network and KV statistics of %s", init)
        return trained.stats

    def _init_name(self) -> str | None:
        return str(self.init) if self.init else None

    def _pairs_names(self) -> list[str]:
        return [str(d) for d in (self.pairs_dir, *self.more_pairs)]

    def _shard_at(self, step: int, paths: list[Path]) -> Path:
        # A fixed permutation per epoch, so a resumed run sees the same order as an uninterrupted one.
        epoch, index = divmod(step, len(paths))
        order = list(range(len(paths)))
        random.Random(f"{self.options.seed}:{epoch}").shuffle(order)
        return paths[order[index]]

    def _validate(self, network: RepairNetwork, stats: KVStats, val_paths: list[Path], step: int,
                  running: dict[str, float], reader: FrozenReader | None) -> Evaluation:
        result = evaluate(network, stats, val_paths, reader)
        entry = {"step": step, "train_loss": running.get("loss"), "train_residual": running.get("residual"),
                 "train_kl": running.get("kl"), "val_loss": result.loss, "val_relative_k": result.overall_k,
                 "val_relative_v": result.overall_v, "val_first_token_kl": result.first_token_kl,
                 "val_first_token_agreement": result.first_token_agreement}
        self.history.append(entry)
        with (self.out / LOG_FILE).open("a") as f:
            f.write(json.dumps(entry) + "\n")
        logger.info("step %d: train loss %.4f, val loss %.4f, relative error K %.3f V %.3f%s", step,
                    running.get("loss", float("nan")), result.loss, result.overall_k, result.overall_v,
                    _answer_text(result))
        return result

    def _load_state(self, path: Path, resume: bool) -> dict[str, Any] | None:
        if not path.is_file():
            if resume:
                logger.warning("no training state in %s: starting from scratch", self.out)
            return None
        if not resume:
            raise TrainError(f"{self.out} already holds a training run: pass --resume or use another --out")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("pairs", [str(self.pairs_dir)]) != self._pairs_names():
            raise TrainError(f"--resume with other pairs than the saved run's ({', '.join(state['pairs'])})")
        if state.get("init") != self._init_name():
            raise TrainError(f"--resume with another --init than the saved run's ({state.get('init')})")
        if state["options"] != asdict(self.options):
            changed = sorted(k for k, v in asdict(self.options).items() if state["options"].get(k) != v)
            raise TrainError(f"--resume with other options than the saved run ({', '.join(changed)}); "
                             f"saved: {state['options']}")
        return state

    def _save_state(self, path: Path, network: RepairNetwork, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, stats: KVStats, step: int) -> None:
        state = {"network": network.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "stats": stats.tensors(), "step": step,
                 "options": asdict(self.options), "pairs": self._pairs_names(), "history": self.history,
                 "init": self._init_name()}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)
