"""The real server on the default model agrees with a direct transformers forward."""

import pytest
import torch

pytestmark = pytest.mark.server

PROMPT = "<|im_start|>user\nWrite a short paragraph about the city of Paris.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_model(served_model_dir):
    """transformers on the model the shared server serves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)
    model = AutoModelForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32).eval()
    return tokenizer, model


def hf_greedy(model, input_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([input_ids]), max_new_tokens=n, do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(input_ids):].tolist()


def test_greedy_generate_matches_transformers(picrag_server, hf_model):
    tokenizer, model = hf_model
    input_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    n = 16
    with picrag_server.client() as client:
        response = client.post(
            "/generate",
            json={
                "input_ids": input_ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": n},
            },
        )
    response.raise_for_status()
    served = response.json()["output_ids"]
    expected = hf_greedy(model, input_ids, n)
    # The prompt asks for a paragraph, so neither side stops early.
    assert len(served) == len(expected) == n
    assert served == expected, (tokenizer.decode(served), tokenizer.decode(expected))


def test_text_generate_and_model_info_pass_through(picrag_server, hf_model):
    tokenizer, model = hf_model
    with picrag_server.client() as client:
        info = client.get("/get_model_info").json()
        assert info["model_type"] == "llama"
        out = client.post(
            "/generate",
            json={"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
        ).json()
    assert out["meta_info"]["completion_tokens"] == 4
    # SGLang tokenized the text as the model's tokenizer does, and answered as transformers does.
    expected = hf_greedy(model, tokenizer("The capital of France is")["input_ids"], 4)
    assert out["text"] == tokenizer.decode(expected)


def test_streaming_generate_relays_server_sent_events(picrag_server):
    with picrag_server.client() as client, client.stream(
        "POST", "/generate",
        json={"text": "Count: one, two,", "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 5}},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 2
