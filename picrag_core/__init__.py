"""What every layer of picrag shares, and nothing else of picrag's: the wire format of link hints
(`link_hints`, with the reordered layout it names), the policy table (`policies`), the engine's
report schema (`engine_report`), the chunk key, the model store, fingerprint and file digest, the
RoPE re-rotation, and the CacheRepair network with its checkpoints (`repair`).

The engine (sglang_patches/, which runs inside SGLang), retrieval/, cache_repair/ and the
frontend (rag_server/) import it; it imports none of them (tests/test_layering.py).
"""
