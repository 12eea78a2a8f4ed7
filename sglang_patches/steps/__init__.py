"""The link steps that run inside SGLang's forward and the reports they write: true positions,
CacheBlend, CacheRepair's residual, the question's attention, the first-token report,
meta_info, and the per-batch annotations that carry them to the attention backends."""
