"""200 RAG requests from 16 concurrent clients over shared passages: none lost, every answer
the one the same request gets alone, and the server's memory stays bounded.

The shared server's KV pool (16,384 tokens) holds every passage here; the same burst under
eviction, on a tiny pool, is in tests/test_chunk_cache_eviction.py.
"""

from __future__ import annotations

import pytest

from tests.load_burst import MAX_RSS_GROWTH, ask, run_burst

pytestmark = pytest.mark.server

REQUESTS = 200
CLIENTS = 16

PASSAGES = {
    "eiffel": {"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron tower in Paris, France."},
    "ben": {"title": "Big Ben", "text": "Big Ben is the bell of the clock tower in London."},
    "opera": {"title": "Sydney Opera House", "text": "The Sydney Opera House is a theatre in Sydney."},
}
QUESTIONS = ["Where is the Eiffel Tower?", "Where is Big Ben?", "Which city has the opera house?",
             "What is Big Ben?"]
ARRANGEMENTS = [["eiffel", "ben"], ["ben", "opera", "eiffel"], ["opera", "eiffel"]]


def variants() -> list[dict]:
    """Every question with every arrangement: the same passages at different positions."""
    return [{"question": question, "documents": [PASSAGES[name] for name in names],
             "policy": "naive", "max_tokens": 4, "temperature": 0}
            for question in QUESTIONS for names in ARRANGEMENTS]


def test_concurrent_answers_equal_serial_answers_and_memory_stays_bounded(picrag_server):
    bodies = variants()
    with picrag_server.client(timeout=600) as client:
        serial = [ask(client, body) for body in bodies]  # also warms the chunk cache and allocator
    burst = run_burst(picrag_server, bodies, REQUESTS, CLIENTS)
    print(burst.report())
    answers = burst.answers
    assert len(answers) == REQUESTS
    mismatches = [(bodies[i]["question"], got, serial[i]) for i, got in answers if got[:2] != serial[i][:2]]
    assert not mismatches, mismatches[:5]
    # The passages were compiled by the serial pass: every concurrent request reused them.
    assert all(reused > 0 for _, (_, _, reused) in answers)
    assert burst.peak_rss - burst.baseline_rss < MAX_RSS_GROWTH
