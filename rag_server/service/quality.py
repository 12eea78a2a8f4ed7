"""What a server knows and does about answer quality while serving: one QualityRecord of shadow
samples (rag_server/service/shadow.py), read by the `auto` policy
(rag_server/service/auto_policy.py), `GET /picrag/quality` and `GET /picrag/metrics`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rag_server.linking.pipeline import LinkPipeline
from rag_server.service.auto_policy import AutoPolicy, CalibrationTable, shipped_table
from rag_server.service.first_token_quality import QualityRecord
from rag_server.service.quality_metrics import QualityMetrics
from rag_server.service.shadow import ShadowSampler, ShadowSettings

# About what the linking policies reach on the measured 10-passage sets (docs/benchmarks.md):
# `auto` then links rather than computes most prompts of the shipped models.
DEFAULT_QUALITY_TARGET = 0.3


@dataclass(frozen=True)
class QualitySettings:
    target: float = DEFAULT_QUALITY_TARGET  # `auto`: the largest expected first-token KL
    calibration: Optional[Path] = None  # a table file; default: the one shipped for the model
    repair_checkpoint: Optional[Path] = None  # the one the runtime serves (selects the table's repair rows)
    shadow: ShadowSettings = field(default_factory=ShadowSettings)


@dataclass
class QualityControl:
    record: QualityRecord
    auto: AutoPolicy
    shadow: ShadowSampler
    metrics: QualityMetrics

    @classmethod
    def open(cls, settings: QualitySettings, model_dir: Optional[Path], pipeline: LinkPipeline) -> QualityControl:
        if settings.calibration is not None:
            table: Optional[CalibrationTable] = CalibrationTable.read(settings.calibration)
        else:
            table = shipped_table(model_dir, settings.repair_checkpoint) if model_dir else None
        record = QualityRecord()
        shadow = ShadowSampler(pipeline, record, settings.shadow, calibrated=table.cost_order if table else ())
        return cls(record, AutoPolicy(settings.target, table, record), shadow, QualityMetrics(record))
