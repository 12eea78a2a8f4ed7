"""The model matrix: every decoder family picrag serves, as a tiny random-weight model on the
real runtime with picrag's plugin, one family after another (tests/tiny_models.py says what
each family adds: rope scaling, q/k norms, fused projections, partial rotary, multipliers).
Each runtime is forked from the worker's process that imported SGLang once (tests/zygote.py:
the same server, arguments and plugin as `picrag serve` starts, in seconds instead of the
40 s of imports a spawned runtime takes); requests go to the runtime, the trust boundary, as
the frontend forwards them, and the start-up self-check runs against it as `picrag serve` runs it.

Per family, on one prompt (a head, two chunks, a question):
- `full` equals transformers' forward of the same prompt (the runtime computes the family right
  at all: a tiny Qwen3-MoE failed this, with all-equal logits, and is refused on CPU);
- the start-up self-check passes (keys re-rotated by the model's own rotary embedding equal
  fresh keys; naive at offset 0 equals the prefix cache; legolink covering every chunk equals full);
- `legolink:K` with K covering every chunk equals `full`;
- `cacheblend:1.0` equals `full` and `cacheblend:0.3` reuses chunk tokens where CacheBlend's
  layer hook reaches the family; elsewhere cacheblend is refused with a 400 naming the reason;
- `naive` equals an independent transformers computation of its definition: the head as a
  prefix, each chunk computed alone (at its prompt positions: RoPE is relative, so the same as
  alone at 0.. and re-rotated), the question over their concatenated KV;
- `cacherepair` with an untrained (zero-output) network equals `naive`;
- a family the model forbids (picrag_core.model_support: Gemma 3's sliding windows forbid chunk
  reuse) is answered 400 with the reason, and `full` still equals transformers.
A model the runtime would compute wrongly is refused by `picrag serve` at start: Qwen3-MoE on
CPU, and Mistral v0.1 served past its window (SGLang's Llama classes ignore the window; within
it, with --context-length, it is in the matrix above).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.chunk_requests import first_token_top, picrag_meta
from tests.conftest import worker_zygote, write_zero_repair_checkpoint
from tests.tiny_models import FAMILIES, REFUSED_ON_CPU, make_tiny_model
from picrag_core.link_hints import LinkRequest, runtime_request
from picrag_core.model_support import model_refusals
from rag_server.launch.model_check import served_model_traits
from rag_server.launch.runtime import CPU_ATTENTION_BACKEND, RuntimeConfig
from rag_server.launch.selfcheck import run_self_check, self_check_layout
from rag_server.linking.chunk_compiler import compile_request, segments_to_compile
from rag_server.linking.policy_resolver import engine_refusals

pytestmark = pytest.mark.server

# fp32 on both sides; SGLang's kernels and transformers' order their sums differently.
LOGPROB_TOLERANCE = 2e-4
TOP = 5


def prompt() -> tuple[list[int], list[tuple[int, int]]]:
    rng = random.Random(7)
    words = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    head, first, second, question = [1, *words(9)], words(30), words(24), words(8)
    start = len(head)
    chunks = [(start, start + len(first)), (start + len(first), start + len(first) + len(second))]
    return head + first + second + question, chunks


def linked(client, input_ids, policy: str, chunks) -> dict:
    """`policy`'s answer from the runtime as the frontend asks for it: the pieces it reuses
    compiled first, then the link, its prompt in the runtime's layout."""
    link = LinkRequest.of(policy, chunks)
    pieces = segments_to_compile(input_ids, link)
    if pieces:
        assert client.post("/generate", json=compile_request(pieces)).status_code == 200
    runtime_ids, hints = runtime_request(input_ids, link)
    response = client.post("/generate", json={
        "input_ids": runtime_ids, "kv_hints": hints, "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True, "top_logprobs_num": TOP})
    assert response.status_code == 200, response.text
    return response.json()


def assert_same(got: dict[int, float], expected: dict[int, float], what: str) -> None:
    """Two first-token top log-probabilities: the same tokens, values within the tolerance."""
    assert set(got) == set(expected), (what, got, expected)
    worst = max(abs(got[token] - logprob) for token, logprob in expected.items())
    assert worst <= LOGPROB_TOLERANCE, f"{what}: first-token log-probabilities differ by {worst:.3g}"


def top_of(logits: torch.Tensor) -> dict[int, float]:
    values, tokens = logits.log_softmax(-1).topk(TOP)
    return dict(zip(tokens.tolist(), values.tolist()))


@torch.no_grad()
def full_reference(model, input_ids: list[int]) -> dict[int, float]:
    return top_of(model(torch.tensor([input_ids])).logits[0, -1])


@torch.no_grad()
def naive_reference(model, input_ids: list[int], chunks) -> dict[int, float]:
    """naive's first-token top log-probabilities, computed with transformers."""
    from transformers import DynamicCache

    pieces = [(0, chunks[0][0]), *chunks]
    cache = DynamicCache(config=model.config)
    for start, end in pieces:
        alone = model(torch.tensor([input_ids[start:end]]), position_ids=torch.arange(start, end)[None],
                      past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
        for layer, stored in enumerate(alone.layers):
            cache.update(stored.keys, stored.values, layer)
    tail = chunks[-1][1]
    return top_of(model(torch.tensor([input_ids[tail:]]), position_ids=torch.arange(tail, len(input_ids))[None],
                        past_key_values=cache, use_cache=True).logits[0, -1])


@pytest.fixture(scope="module")
def tokenizer_dir(default_model_dir):
    return default_model_dir


def refusal(client, input_ids, policy: str, chunks) -> str:
    """The runtime's 400 for a link it must refuse before any compute."""
    runtime_ids, hints = runtime_request(input_ids, LinkRequest.of(policy, chunks))
    response = client.post("/generate", json={"input_ids": runtime_ids, "kv_hints": hints,
                                              "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 400, response.text
    return response.text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_policy_is_exact_on_the_family(family, tokenizer_dir, tmp_path):
    import httpx
    from transformers import AutoModelForCausalLM

    context_length = FAMILIES[family].context_length
    model_dir = make_tiny_model(family, tmp_path / family, tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    traits = served_model_traits(model_dir, CPU_ATTENTION_BACKEND, context_length)  # what picrag serve checks first
    refused = model_refusals(traits)  # family -> why the engine must answer 400
    reuses = "naive" not in refused
    checkpoint = write_zero_repair_checkpoint(model_dir, tmp_path / "zero-repair") if reuses else None
    runtime = worker_zygote().start_runtime(RuntimeConfig(model_dir, max_total_tokens=4096,
                                                          context_length=context_length,
                                                          repair_checkpoint=checkpoint), family)
    try:
        unavailable = engine_refusals(CPU_ATTENTION_BACKEND, None if reuses else "no checkpoint", traits)
        selfcheck = run_self_check(runtime.url, self_check_layout(model_dir), unavailable)
        assert selfcheck.passed, selfcheck
        with httpx.Client(base_url=runtime.url, timeout=600) as client:
            input_ids, chunks = prompt()
            full = first_token_top(linked(client, input_ids, "full", chunks))
            assert_same(full, full_reference(model, input_ids), "full against transformers")

            covering = max(end - start for start, end in chunks)
            expected = {f"legolink:{covering}": lambda: full, "cacheblend:1.0": lambda: full,
                        "naive": lambda: naive_reference(model, input_ids, chunks)}
            for policy, reference in expected.items():
                name = LinkRequest.of(policy, chunks).family.name
                if name in refused:
                    assert refused[name] in refusal(client, input_ids, policy, chunks), policy
                else:
                    assert_same(first_token_top(linked(client, input_ids, policy, chunks)), reference(), policy)

            if "cacheblend" not in refused:
                blended = linked(client, input_ids, "cacheblend:0.3", chunks)
                # The layer hook ran: later layers skipped most chunk tokens.
                assert picrag_meta(blended).reused_tokens > 0, blended["meta_info"]
            if reuses:
                naive = linked(client, input_ids, "naive", chunks)
                assert picrag_meta(naive).reused_tokens >= sum(end - start for start, end in chunks)
                assert_same(first_token_top(linked(client, input_ids, "cacherepair", chunks)), first_token_top(naive),
                            "cacherepair (zero network)")
            else:
                assert refused["cacherepair"] in refusal(client, input_ids, "cacherepair", chunks)
    finally:
        runtime.stop()


def serve_refusal(model_dir) -> str:
    """What `picrag serve` says on stderr when it exits 2 at start."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rag_server.cli", "serve", "--model", str(model_dir), "--no-index",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    return done.stderr


@pytest.mark.parametrize("family", sorted(REFUSED_ON_CPU))
def test_a_family_the_runtime_cannot_compute_is_refused_at_start(family, tokenizer_dir, tmp_path):
    stderr = serve_refusal(make_tiny_model(family, tmp_path / family, tokenizer_dir))
    assert "experts" in stderr and "zero hidden states" in stderr, stderr[-2000:]


def test_a_window_the_runtime_ignores_is_refused_past_it(tokenizer_dir, tmp_path):
    """Mistral v0.1's window, served with the config's whole context, would be computed as
    whole-context attention past it: picrag serve refuses and says how to serve it."""
    stderr = serve_refusal(make_tiny_model("mistral-v0.1", tmp_path / "mistral", tokenizer_dir))
    assert "attends over the whole context" in stderr and "--context-length 256" in stderr, stderr[-2000:]
