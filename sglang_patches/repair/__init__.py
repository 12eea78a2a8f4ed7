"""CacheRepair at serving time: the link step that adds the repair network's residual to grafted
chunk KV (`kv_repair`). The network and its checkpoints are picrag_core.repair, which training
(cache_repair/) shares."""
