"""CacheRepair (arXiv 2609.35139), offline half: training pairs, the repair network, its training
and checkpoints. A small network, trained once per LLM, predicts a residual for the KV cache of
every passage token so that KV computed for each passage alone approaches the KV computed with
the whole preceding context. Deliberately empty: `picrag --help` imports the command line
without loading torch.
"""
