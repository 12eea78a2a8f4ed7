"""SGLang DSL helpers: mark a passage as a reusable chunk, and retrieve passages.

    import sglang as sgl
    from rag_server.dsl import chunk, retrieve

    @sgl.function
    def rag(s, question, passages):
        s += sgl.system("Answer with at most 5 words.")
        with s.user():
            for p in passages:
                s += chunk(p.text, p.title)  # KV computed once, reused wherever it lands
            s += "Question: " + question
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))

    backend = sgl.RuntimeEndpoint("http://127.0.0.1:8000")
    sgl.set_default_backend(backend)
    state = rag.run(question=q, passages=retrieve(backend, q, k=3))

`chunk()` returns the passage formatted as in every picrag prompt (retrieval/prompt_layout.py),
wrapped in chunk markers (rag_server/api/chunk_markers.py) that the frontend turns into chunk
boundaries; so the DSL needs no change and the same passage hits the same cache entry as in
`/rag/query`. The markers stay in the program's text (`strip_markers` removes them for display).
"""

from __future__ import annotations

from typing import Any

import requests

from rag_server.api.chunk_markers import mark_chunk, strip_markers
from retrieval.passage import Passage
from retrieval.prompt_layout import PromptPassage, passage_text

__all__ = ["chunk", "retrieve", "strip_markers"]


def chunk(text: str, title: str = "") -> str:
    """The passage as a reusable chunk, to add to a program with `s += chunk(...)`."""
    if not isinstance(text, str) or not isinstance(title, str):
        # Also stops SGLang's prefix tracer, which calls programs with placeholder arguments.
        raise TypeError("chunk() takes the passage text (and title) as strings")
    return mark_chunk(passage_text(PromptPassage(title, text)))


def _base_url(where: Any) -> str:
    """A URL, an `sgl.RuntimeEndpoint`, or a program state running on one."""
    if isinstance(where, str):
        return where.rstrip("/")
    backend = getattr(getattr(where, "stream_executor", None), "backend", where)
    base_url = getattr(backend, "base_url", None)
    if not isinstance(base_url, str):
        raise TypeError(f"cannot find a picrag server URL in {where!r}")
    return base_url.rstrip("/")


def retrieve(where: Any, question: str, k: int = 5, timeout_s: float = 60.0) -> list[Passage]:
    """The `k` passages the server's index (`picrag serve --index DIR`) returns, best first."""
    response = requests.post(f"{_base_url(where)}/rag/retrieve", json={"question": question, "top_k": k},
                             timeout=timeout_s)
    if response.status_code != 200:
        raise RuntimeError(f"picrag /rag/retrieve answered {response.status_code}: {response.text[:300]}")
    return [Passage(p["id"], p["title"], p["text"], score=p["score"]) for p in response.json()["passages"]]
