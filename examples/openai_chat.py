"""The `openai` package against picrag: plain chat, then RAG through the `picrag` extension.

    python examples/openai_chat.py [URL]        (default http://127.0.0.1:8000)
"""

import sys

from openai import OpenAI

DOCUMENTS = [
    {"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."},
    {"title": "Big Ben", "text": "Big Ben is the nickname for the Great Bell of the clock at the Palace of Westminster in London."},
]


def main(url: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id

    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    print(f"plain chat: {plain.choices[0].message.content}")

    rag = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Where is Big Ben?"}], max_tokens=16, temperature=0,
        extra_body={"picrag": {"documents": DOCUMENTS}})
    picrag = rag.model_extra["picrag"]
    print(f"rag chat: {rag.choices[0].message.content}")
    print(f"  sources: {[s['title'] for s in picrag['sources']]}, reused {picrag['usage']['reused_tokens']} "
          f"of {rag.usage.prompt_tokens} prompt tokens")

    print("rag chat, streamed: ", end="")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Where is the Eiffel Tower?"}], max_tokens=16,
        temperature=0, stream=True, extra_body={"picrag": {"documents": DOCUMENTS}})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
