"""An SGLang DSL program against picrag: passages marked as reusable chunks.

    python examples/dsl_rag.py [URL]        (default http://127.0.0.1:8000)

The program is plain SGLang DSL on `sgl.RuntimeEndpoint`; `chunk()` is the only picrag piece.
Both questions share the two passages: the second run reuses their KV though the passages
sit behind a different question list, and the fork/join at the end shows the DSL's
`concate_and_append` join working against picrag.
"""

import sys

import sglang as sgl

from rag_server.dsl import chunk

PASSAGES = [
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."),
    ("Big Ben", "Big Ben is the nickname for the Great Bell of the clock at the Palace of Westminster in London."),
]


@sgl.function
def rag_answer(s, question, passages):
    s += sgl.system("You answer questions using the documents provided. Answer with at most 5 words.")
    with s.user():
        s += "Documents:\n\n"
        for title, text in passages:
            s += chunk(text, title)
        s += "Question: " + question
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0, stop="\n"))


@sgl.function
def forked_notes(s, passages):
    s += "Notes on two landmarks.\n"
    forks = s.fork(len(passages))
    for fork, (title, text) in zip(forks, passages):
        fork += f"{title}: {text}\n"
    forks.join(mode="concate_and_append")
    s += "The landmark in Paris is the" + sgl.gen("landmark", max_tokens=4, temperature=0)


def main(url: str) -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    for question in ("Where is the Eiffel Tower?", "Where is Big Ben?"):
        state = rag_answer.run(question=question, passages=PASSAGES)
        usage = state.get_meta_info("answer").get("cached_tokens_details") or {}
        print(f"Q: {question}\nA: {state['answer'].strip()}\n"
              f"   reused {usage.get('picrag_reused_tokens')} prompt tokens, computed {usage.get('picrag_computed_tokens')}")
    state = forked_notes.run(passages=PASSAGES)
    print(f"fork/join: the landmark in Paris is the{state['landmark']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
