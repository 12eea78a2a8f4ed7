"""CacheRepair at serving time: the repair network, its normalisation, checkpoints, and the
link step that adds its residual to grafted chunk KV. Training lives in `cache_repair/`, which
imports this package (never the other way round)."""
