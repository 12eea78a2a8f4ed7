"""The CacheRepair network, its normalisation, configuration and checkpoints: trained by
cache_repair/, run at serving time by sglang_patches.steps.kv_repair."""
