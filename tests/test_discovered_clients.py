"""Clients that were not written for picrag, unmodified, get chunk reuse: the OpenAI SDK's chat
and completions, LangChain's stuff-documents chain and LlamaIndex's response synthesizer
(through `OpenAILike`) send their documents inside the prompt,
and the frontend finds them (rag_server/service/prompt_discovery.py). Through this path `full`'s
equivalent (a LegoLink that recomputes every chunk token) answers exactly as SGLang's own route,
the same documents in another order are served from the chunks the first request stored, and a
body that opts out, or sets a field this path does not translate, gets SGLang's own answer."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

pytestmark = pytest.mark.server

MAX_TOKENS = 10
# A LegoLink whose k covers every chunk recomputes them all: `full`'s answer through the link path.
COVERING = "legolink:100000"


@pytest.fixture(scope="module")
def client(picrag_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{picrag_server.url}/v1", api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def passages(musique) -> list[str]:
    """Four real Wikipedia passages of 60-110 words."""
    texts = [p["text"] for row in musique for p in row["passages"] if 60 <= len(p["text"].split()) <= 110]
    return texts[:4]


def user_message(passages: list[str], order: list[int], question: bool = True) -> str:
    documents = "\n\n".join(passages[i] for i in order)
    return documents + "\n\nQuestion: which island is named?" if question else documents


def chat(client, passages, order, control=None, question=True, **fields):
    extra = {"extra_body": {"picrag": control}} if control is not None else {}
    return client.chat.completions.create(
        model="default", messages=[{"role": "system", "content": "Answer in a few words."},
                                   {"role": "user", "content": user_message(passages, order, question)}],
        max_tokens=MAX_TOKENS, temperature=0, **fields, **extra)


def runtime_counter(runtime_url: str, name: str) -> float:
    text = httpx.get(f"{runtime_url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^picrag_{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


@pytest.mark.parametrize("question", [True, False], ids=["question-after", "documents-last"])
def test_chat_documents_are_found_and_reused_in_any_order(client, passages, picrag_server, question):
    # "documents-last" is the shape of LMCache's blend workload: nothing follows the last document,
    # so its separator is the link's tail.
    first = chat(client, passages, [0, 1, 2, 3], question=question)
    found = first.model_extra["picrag"]["discovered"]
    assert found["chunks"] == 4 and found["prompt_tokens"] == first.usage.prompt_tokens
    assert first.model_extra["picrag"]["usage"]["reused_tokens"] >= found["chunk_tokens"]
    computed = runtime_counter(picrag_server.runtime_url, "compile_chunk_misses")
    for order in ([2, 0, 3, 1], [3, 2, 1, 0]):
        again = chat(client, passages, order, question=question)
        assert again.model_extra["picrag"]["discovered"]["chunks"] == 4
        assert again.model_extra["picrag"]["usage"]["reused_tokens"] >= found["chunk_tokens"]
    # Each document is stored with the separator after it, whatever its place in the message:
    # another order computes nothing new.
    assert runtime_counter(picrag_server.runtime_url, "compile_chunk_misses") == computed


def test_the_covering_link_answers_like_sglangs_own_chat(client, passages):
    own = chat(client, passages, [1, 3, 0, 2], control={"discover": False})
    assert own.model_extra.get("picrag") is None
    linked = chat(client, passages, [1, 3, 0, 2], control={"discover": True, "policy": COVERING})
    assert linked.model_extra["picrag"]["discovered"]["chunks"] == 4
    assert linked.choices[0].message.content == own.choices[0].message.content
    assert linked.usage.prompt_tokens == own.usage.prompt_tokens
    assert linked.choices[0].finish_reason == own.choices[0].finish_reason

    stream = client.chat.completions.create(
        model="default", messages=[{"role": "system", "content": "Answer in a few words."},
                                   {"role": "user", "content": user_message(passages, [1, 3, 0, 2])}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"picrag": {"discover": True, "policy": COVERING}})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == own.choices[0].message.content
    assert [c.usage.prompt_tokens for c in chunks if c.usage] == [own.usage.prompt_tokens]


def test_completions_and_generate_text_find_the_same_passages(client, passages, picrag_server, tokenizer):
    prompt = "Background:\n\n" + "\n\n".join(passages) + "\n\nSummary:"
    own = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"picrag": {"discover": False}})
    linked = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"picrag": {"discover": True, "policy": COVERING}})
    assert linked.model_extra["picrag"]["discovered"]["chunks"] == 4
    assert linked.choices[0].text == own.choices[0].text and linked.usage.prompt_tokens == own.usage.prompt_tokens
    default = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert default.model_extra["picrag"]["policy"] == "cacherepair"

    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS},
            "return_logprob": True, "top_logprobs_num": 3}
    with picrag_server.client() as http:
        vanilla = http.post("/generate", json={**body, "picrag": {"discover": False}})
        text = http.post("/generate", json={**body, "picrag": {"discover": True, "policy": COVERING}})
        ids = http.post("/generate", json={**{k: v for k, v in body.items() if k != "text"},
                                           "input_ids": tokenizer(prompt)["input_ids"],
                                           "picrag": {"discover": True, "policy": COVERING}})
    assert vanilla.status_code == text.status_code == ids.status_code == 200
    assert "x-picrag-discovered" not in vanilla.headers
    assert text.headers["x-picrag-discovered"].startswith("chunks=4;") and ids.headers["x-picrag-discovered"]
    assert text.json()["output_ids"] == vanilla.json()["output_ids"] == ids.json()["output_ids"]
    reference = vanilla.json()["meta_info"]["output_top_logprobs"][0]
    for seen in (text.json()["meta_info"]["output_top_logprobs"][0], ids.json()["meta_info"]["output_top_logprobs"][0]):
        assert [t for _, t, *_ in seen] == [t for _, t, *_ in reference]
        assert max(abs(a[0] - b[0]) for a, b in zip(seen, reference)) < 1e-3


def test_langchain_stuff_documents_chain_is_served_from_the_chunk_cache(passages, picrag_server):
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{picrag_server.url}/v1", api_key="unused", model="default", temperature=0,
                     max_tokens=MAX_TOKENS, max_retries=0, timeout=600)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only this context:\n\n{context}"), ("human", "{input}")])
    chain = create_stuff_documents_chain(llm, prompt)
    with picrag_server.client() as http:
        def discovered() -> float:
            text = http.get("/picrag/metrics").text
            return float(re.search(r"^picrag_frontend_discovered_prompts_total ([0-9.]+)$", text, re.M).group(1))

        before = discovered()
        answer = chain.invoke({"context": [Document(page_content=p) for p in passages],
                               "input": "Which island is named?"})
        assert isinstance(answer, str) and answer.strip()
        assert discovered() == before + 1


def test_llamaindex_response_synthesizer_is_served_from_the_chunk_cache(passages, picrag_server, tokenizer):
    """LlamaIndex's own answer step (a compact response synthesizer over retrieved nodes, its
    default question-answering template) through `OpenAILike`: the nodes' texts are found in the
    prompt, and the same nodes in another order are served from the chunks the first call stored."""
    from llama_index.core import PromptHelper, get_response_synthesizer
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(api_base=f"{picrag_server.url}/v1", api_key="unused", model="default", is_chat_model=True,
                     temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=600, context_window=8192)
    # LlamaIndex counts tokens with tiktoken unless told otherwise, which downloads its encodings:
    # the served model's own tokenizer instead (configuration a user passes, not a change to the client).
    helper = PromptHelper(context_window=8192, num_output=MAX_TOKENS,
                          tokenizer=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    synthesizer = get_response_synthesizer(llm=llm, prompt_helper=helper, response_mode="compact")

    def ask(order: list[int]) -> str:
        nodes = [NodeWithScore(node=TextNode(text=passages[i]), score=1.0) for i in order]
        return str(synthesizer.synthesize("Which island is named?", nodes=nodes))

    with picrag_server.client() as http:
        def discovered() -> float:
            text = http.get("/picrag/metrics").text
            return float(re.search(r"^picrag_frontend_discovered_prompts_total ([0-9.]+)$", text, re.M).group(1))

        before = discovered()
        assert ask([0, 1, 2, 3]).strip()
        hits = runtime_counter(picrag_server.runtime_url, "chunk_hits")
        assert ask([2, 0, 3, 1]).strip()
        assert discovered() == before + 2
    # Every passage of the second call was stored by the first: four chunk hits at least.
    assert runtime_counter(picrag_server.runtime_url, "chunk_hits") - hits >= 4


def test_what_this_path_does_not_translate_keeps_sglangs_route(client, passages):
    with_logprobs = chat(client, passages, [0, 1, 2, 3], logprobs=True, top_logprobs=2)
    assert with_logprobs.model_extra.get("picrag") is None and with_logprobs.choices[0].logprobs is not None
    short = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi.\n\nThere."}],
                                           max_tokens=4, temperature=0)
    assert short.model_extra.get("picrag") is None


@pytest.mark.parametrize("control, message", [
    ({"discover": "yes"}, "picrag.discover"),
    ({"discover": True, "documents": []}, "picrag.documents"),
    ({"discover": True, "policy": "bogus"}, "picrag.policy"),
])
def test_a_bad_discovery_control_is_a_400_naming_it(picrag_server, passages, control, message):
    with picrag_server.client() as http:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"})):
            response = http.post(path, json={**body, "picrag": control})
            assert response.status_code == 400, (path, response.text)
            assert message in response.text
