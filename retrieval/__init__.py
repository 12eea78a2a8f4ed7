"""picrag retrieval: corpus ingestion, token-aware chunking, embeddings and a persisted FAISS index.

Modules: `passage` (Passage, content ids), `ingest` (corpus files to documents), `chunking`
(documents to passages within a token budget), `embedder` (sentence-transformers vectors),
`index` (FAISS index on disk), `retriever` (the search API), `cli` (`picrag index ...`).
"""
