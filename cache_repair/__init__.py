"""CacheRepair (arXiv 2609.35139), training half: training pairs, training, evaluation and the
shipped checkpoints (`checkpoints/<model folder name>`). A small network, trained once per LLM,
predicts a residual for the KV cache of every passage token so that KV computed for each
passage alone approaches the KV computed with the whole preceding context. The network and its
checkpoint format are shared with the engine (`picrag_core.repair`); this package imports them.
Deliberately empty: `picrag --help` imports the command line without loading torch.
"""
