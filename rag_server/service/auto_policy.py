"""The `auto` policy: per request, the cheapest policy whose expected first-token KL to `full`, for a
prompt of that size, is within the server's quality target (`picrag serve --quality-target`).

Expected KL comes from a calibration table per model (and CacheRepair checkpoint): JSON files in
rag_server/calibration/ named after the model folder, written by `picrag bench calibrate` (from
stored dev-set runs) or `picrag bench quality --write-calibration` (from one run). The table lists
policies cheapest first (`cost_order`, from measured TTFT speed-ups) and their mean KL per
prompt-size bucket (rag_server/service/first_token_quality.py). Shadow samples replace a table
value once a (policy, bucket) has `min_samples` of them: their running mean is what live traffic
shows. A bucket the table did not measure takes the nearest measured bucket's value. A policy
this server cannot run is skipped; `full` serves when nothing qualifies.

`auto` is a frontend choice: the engine only ever sees the policy it picked.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rag_server.linking.policy_resolver import AUTO
from rag_server.linking.policy_resolver import AUTO_FALLBACK as FALLBACK
from rag_server.service.first_token_quality import BUCKET_BOUNDS, QualityRecord, bucket_labels, size_bucket
from picrag_core.policies import Policy, PolicyError, parse_policy

logger = logging.getLogger(__name__)

CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibration"
DEFAULT_MIN_SAMPLES = 20
FALLBACK_POLICY = parse_policy(FALLBACK)


class CalibrationError(ValueError):
    """A calibration table that cannot be read or names unknown policies or buckets."""


@dataclass(frozen=True)
class CalibrationTable:
    model: str
    cost_order: tuple[str, ...]  # canonical policy names, cheapest first
    kl: Mapping[str, Mapping[str, float]]  # policy -> bucket label -> mean first-token KL
    bounds: tuple[int, ...] = BUCKET_BOUNDS
    repair_checkpoint: Optional[str] = None  # the checkpoint folder name the repairing rows used
    source: str = ""  # how the numbers were measured
    # Every row's policy, parsed once when the table is read: `auto` consults it on every request.
    policies: Mapping[str, Policy] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        labels = set(bucket_labels(self.bounds))
        for name in self.cost_order:
            if name not in self.kl:
                raise CalibrationError(f"policy {name} is in cost_order but has no KL row")
        policies = {name: parse_policy(name) for name in self.kl}
        for name, row in self.kl.items():
            if policies[name].name != name:
                raise CalibrationError(f"policy {name!r} is not written canonically ({policies[name].name})")
            if set(row) - labels:
                raise CalibrationError(f"policy {name}: unknown buckets {sorted(set(row) - labels)}")
        object.__setattr__(self, "policies", policies)

    @classmethod
    def read(cls, path: Path) -> CalibrationTable:
        try:
            data = json.loads(path.read_text())
            return cls(model=data["model"], cost_order=tuple(data["cost_order"]), kl=data["kl"],
                       bounds=tuple(data.get("buckets", BUCKET_BOUNDS)),
                       repair_checkpoint=data.get("repair_checkpoint"), source=data.get("source", ""))
        except (OSError, ValueError, KeyError, TypeError, PolicyError) as exc:
            raise CalibrationError(f"calibration table {path}: {exc}") from exc

    def as_json(self) -> dict[str, Any]:
        return {"model": self.model, "repair_checkpoint": self.repair_checkpoint, "source": self.source,
                "buckets": list(self.bounds), "cost_order": list(self.cost_order),
                "kl": {name: dict(row) for name, row in self.kl.items()}}

    def without_repair(self) -> CalibrationTable:
        """The table less its repairing policies (their KL belongs to another checkpoint)."""
        keep = [name for name in self.cost_order if not self.policies[name].family.repairs]
        return CalibrationTable(self.model, tuple(keep), {name: self.kl[name] for name in keep}, self.bounds,
                                None, self.source)

    def table_kl(self, policy: str, bucket: str) -> Optional[tuple[float, str]]:
        """(KL, the bucket it was measured on): `bucket`'s own, else the nearest measured one."""
        row = self.kl.get(policy) or {}
        labels = bucket_labels(self.bounds)
        index = labels.index(bucket)
        for label in sorted(row, key=lambda label: (abs(labels.index(label) - index), labels.index(label))):
            return float(row[label]), label
        return None


def shipped_table(model_path: Path, repair_checkpoint: Optional[Path]) -> Optional[CalibrationTable]:
    """The table shipped for the model folder's name, its repairing rows dropped unless the server
    serves the checkpoint they were measured with; None when none is shipped."""
    path = CALIBRATION_DIR / f"{model_path.name}.json"
    if not path.is_file():
        return None
    from rag_server.launch.repair_checkpoint import SHIPPED_DIR

    table = CalibrationTable.read(path)
    measured_with = SHIPPED_DIR / (table.repair_checkpoint or "")
    if table.repair_checkpoint and (repair_checkpoint is None or repair_checkpoint.resolve() != measured_with.resolve()):
        logger.info("calibration %s: repairing policies left out (measured with the shipped checkpoint %s)",
                    path.name, table.repair_checkpoint)
        return table.without_repair()
    return table


@dataclass(frozen=True)
class AutoChoice:
    policy: Policy
    reason: str  # for the response: "auto: cacherepair (expected KL 0.20 <= target 0.25 for 1024-2048 tokens)"


@dataclass
class AutoPolicy:
    target: float  # the largest expected first-token KL a request may be served with
    table: Optional[CalibrationTable]
    record: QualityRecord = field(default_factory=QualityRecord)  # shadow samples
    min_samples: int = DEFAULT_MIN_SAMPLES

    def __post_init__(self):
        if math.isnan(self.target) or self.target < 0:
            raise ValueError(f"quality target must be a KL >= 0, not {self.target}")

    def expected_kl(self, policy: str, bucket: str) -> Optional[tuple[float, str]]:
        """(expected KL, where it comes from) of `policy` on prompts of `bucket`; None: unknown."""
        count, mean = self.record.observed(policy, bucket)
        if count >= self.min_samples and mean is not None:
            return mean, f"mean of {count} shadow samples"
        measured = self.table.table_kl(policy, bucket) if self.table else None
        if measured is None:
            return None
        kl, label = measured
        return kl, "calibration table" if label == bucket else f"calibration table, nearest measured size {label}"

    def choose(self, prompt_tokens: int, unavailable: Mapping[str, str] = {}) -> AutoChoice:
        """The policy for a prompt of `prompt_tokens` tokens; `unavailable`: families never
        picked (the policy resolver's `auto_excluded`)."""
        bounds = self.table.bounds if self.table else BUCKET_BOUNDS
        bucket = size_bucket(prompt_tokens, bounds)
        target = f"target {self.target:g} for {bucket} tokens"
        if self.table is None:
            return AutoChoice(FALLBACK_POLICY, f"{AUTO}: {FALLBACK} (no calibration table for this model)")
        closest: Optional[tuple[float, str]] = None
        for name in self._candidates(unavailable):
            expected = self.expected_kl(name, bucket)
            if expected is None:
                continue
            kl, source = expected
            if kl <= self.target:
                return AutoChoice(self.table.policies[name], f"{AUTO}: {name} (expected KL {kl:.3f} <= {target}; {source})")
            if closest is None or kl < closest[0]:
                closest = (kl, name)
        best = f"; lowest expected: {closest[1]} {closest[0]:.3f}" if closest else ""
        return AutoChoice(FALLBACK_POLICY, f"{AUTO}: {FALLBACK} (no policy within {target}{best})")

    def _candidates(self, unavailable: Mapping[str, str]) -> Sequence[str]:
        assert self.table is not None
        policies = self.table.policies
        return [name for name in self.table.cost_order if policies[name].family.name not in unavailable]
