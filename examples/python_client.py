"""A Python client for /rag/query: one answer, then the same question streamed.

    python examples/python_client.py [URL]        (default http://127.0.0.1:8000)
"""

import json
import sys

import httpx

DOCUMENTS = [
    {"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."},
    {"title": "Big Ben", "text": "Big Ben is the nickname for the Great Bell of the clock at the Palace of Westminster in London."},
]


def ask(client: httpx.Client, question: str) -> dict:
    response = client.post("/rag/query", json={"question": question, "documents": DOCUMENTS, "max_tokens": 16})
    response.raise_for_status()
    return response.json()


def ask_streaming(client: httpx.Client, question: str) -> dict:
    body = {"question": question, "documents": DOCUMENTS, "max_tokens": 16, "stream": True}
    with client.stream("POST", "/rag/query", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            if event["type"] == "token":
                print(event["text"], end="", flush=True)
            elif event["type"] == "done":
                print()
                return event
            else:
                raise RuntimeError(event["message"])
    raise RuntimeError("stream ended without a final event")


def main(url: str) -> None:
    with httpx.Client(base_url=url, timeout=600) as client:
        result = ask(client, "Where is the Eiffel Tower?")
        print(f"answer: {result['answer']}")
        print(f"sources: {[s['title'] for s in result['sources']]}")
        print(f"usage: {result['usage']}  timings: {result['timings']}")
        done = ask_streaming(client, "Where is Big Ben?")
        print(f"streamed answer: {done['answer']} (reused {done['usage']['reused_tokens']} "
              f"of {done['usage']['prompt_tokens']} prompt tokens)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
