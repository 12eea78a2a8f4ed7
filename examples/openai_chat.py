"""The `openai` package against picrag: plain chat, RAG through the `picrag` extension, then
documents inside the message with no picrag field at all (picrag finds and reuses them).

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

    # What a chat app or a stuff-documents chain sends: the documents inside the message text.
    documents = [
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
        "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.",
        "Big Ben is the nickname for the Great Bell of the Great Clock of Westminster, at the north end of the "
        "Palace of Westminster in London, England. The name is often used for the clock and the tower too.",
        "The Colosseum is an elliptical amphitheatre in the centre of the city of Rome, Italy, just east of the "
        "Roman Forum. It is the largest ancient amphitheatre ever built, and could hold up to 50,000 people.",
    ]
    for order in (documents, documents[::-1]):
        plain_rag = client.chat.completions.create(
            model=model, max_tokens=16, temperature=0,
            messages=[{"role": "system", "content": "Answer from the documents."},
                      {"role": "user", "content": "\n\n".join(order) + "\n\nQuestion: Where is Big Ben?"}])
        found = plain_rag.model_extra["picrag"]
        print(f"documents in the message: {plain_rag.choices[0].message.content}")
        print(f"  {found['discovered']['chunks']} passages found, reused {found['usage']['reused_tokens']} "
              f"of {plain_rag.usage.prompt_tokens} prompt tokens")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
