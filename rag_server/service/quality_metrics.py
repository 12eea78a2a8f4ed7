"""Shadow quality as Prometheus metrics, served by the frontend at `GET /picrag/metrics` (SGLang's own
`/metrics` passes through unchanged on the same port).

- `picrag_shadow_first_token_kl` (histogram; labels policy, bucket): first-token KL(full || policy)
  of each shadow sample, exact over the whole vocabulary;
- `picrag_shadow_first_token_agreements_total` (labels policy, bucket): samples whose greedy
  first token equals full's (divide by the histogram's `_count` for the agreement rate);
- `picrag_shadow_requests_total`, `picrag_shadow_prefilled_tokens_total`,
  `picrag_shadow_skipped_capacity_total`, `picrag_shadow_failed_total`: the shadow cost.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from rag_server.service.first_token_quality import QualityRecord, Sample

KL_BUCKETS = (0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_COST_HELP = {
    "sent": ("picrag_shadow_requests", "shadow pairs sent (one full and one policy request, one token each)"),
    "prefilled_tokens": ("picrag_shadow_prefilled_tokens", "prompt tokens the runtime computed for shadows"),
    "skipped_capacity": ("picrag_shadow_skipped_capacity", "sampled requests not shadowed: server busy or cap reached"),
    "failed": ("picrag_shadow_failed", "shadow requests the runtime refused or failed"),
}


class _CostCollector:
    def __init__(self, record: QualityRecord):
        self.record = record

    def collect(self):
        for key, (name, documentation) in _COST_HELP.items():
            yield CounterMetricFamily(name, documentation, value=getattr(self.record.cost, key))


class QualityMetrics:
    """A registry of its own: several apps in one process (tests) never share metrics."""

    def __init__(self, record: QualityRecord):
        self.registry = CollectorRegistry()
        self.kl = Histogram("picrag_shadow_first_token_kl", "first-token KL(full || policy) of shadow samples "
                            "(exact, over the whole vocabulary)", ["policy", "bucket"],
                            buckets=KL_BUCKETS, registry=self.registry)
        self.agreements = Counter("picrag_shadow_first_token_agreements", "shadow samples whose greedy first "
                                  "token equals full's", ["policy", "bucket"], registry=self.registry)
        self.registry.register(_CostCollector(record))
        record.on_sample(self._observe)

    def _observe(self, sample: Sample, bucket: str) -> None:
        self.kl.labels(sample.policy, bucket).observe(sample.kl)
        counter = self.agreements.labels(sample.policy, bucket)  # exported from the first sample, 0 or not
        if sample.agrees:
            counter.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
