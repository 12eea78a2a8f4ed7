"""The `openai` package against picrag's `/v1/chat/completions`: SGLang's chat untouched without
the `picrag` field, RAG (the /rag/query answer, streamed or not) with it."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.server

DOCUMENTS = [
    {"title": "Nile", "text": "The Nile is a major north-flowing river in northeastern Africa, flowing into the Mediterranean Sea."},
    {"title": "Amazon", "text": "The Amazon River in South America is the largest river by discharge volume of water in the world."},
]
QUESTION = "Which river flows into the Mediterranean Sea?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(picrag_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{picrag_server.url}/v1", api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_plain_chat_is_sglangs_own(client, model, picrag_server, default_model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert reply.model_extra.get("picrag") is None
    template = AutoTokenizer.from_pretrained(default_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    with picrag_server.client() as http:
        generated = http.post("/generate", json={
            "text": template, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}).json()
    assert reply.choices[0].message.content == generated["text"]
    assert reply.usage.prompt_tokens == generated["meta_info"]["prompt_tokens"]


def test_rag_chat_answers_like_rag_query_streamed_or_not(client, model, picrag_server):
    extension = {"documents": DOCUMENTS, "policy": "naive"}
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"picrag": extension})
    with picrag_server.client() as http:
        rag = http.post("/rag/query", json={"question": QUESTION, "documents": DOCUMENTS, "policy": "naive",
                                            "max_tokens": MAX_TOKENS}).json()
    content = reply.choices[0].message.content
    assert content.strip() == rag["answer"] and content.strip()
    assert reply.choices[0].finish_reason == rag["finish_reason"]
    assert reply.usage.prompt_tokens == rag["usage"]["prompt_tokens"]
    extra = reply.model_extra["picrag"]
    assert extra["sources"] == rag["sources"] and extra["policy"] == "naive"
    assert extra["usage"]["reused_tokens"] > 0

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"picrag": extension})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].model_extra["picrag"]["sources"] == rag["sources"]
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_system_message_and_history_shape_the_prompt(client, model):
    messages = [
        {"role": "system", "content": "Reply with one word."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": QUESTION},
    ]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"picrag": {"documents": DOCUMENTS, "policy": "full"}})
    single = client.chat.completions.create(model=model, messages=messages[-1:], max_tokens=4, temperature=0,
                                            extra_body={"picrag": {"documents": DOCUMENTS, "policy": "full"}})
    # Earlier turns and the system message are prompt tokens too.
    assert reply.usage.prompt_tokens > single.usage.prompt_tokens


@pytest.mark.parametrize("messages, extension, message", [
    ([{"role": "assistant", "content": "Hi"}], {"documents": DOCUMENTS}, "the last message must be the user's"),
    ([{"role": "user", "content": "  "}], {"documents": DOCUMENTS}, "the last user message is empty"),
    ([{"role": "user", "content": "Q?"}], {"documents": DOCUMENTS, "policy": "bogus"}, "unknown policy 'bogus'"),
    ([{"role": "user", "content": "Q?"}], {"top_k": 0, "documents": DOCUMENTS}, "picrag.top_k"),
    ([{"role": "user", "content": "Q?"}], {"documents": DOCUMENTS, "extra": 1}, "picrag.extra: Extra inputs"),
    ([{"role": "user", "content": "Q?"}], {}, "no passage index is loaded"),
])
def test_bad_rag_chat_requests_are_openai_400s(client, model, messages, extension, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                       extra_body={"picrag": extension})
    assert message in error.value.body["message"]
