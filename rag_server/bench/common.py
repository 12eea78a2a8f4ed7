"""What `picrag bench quality` and `picrag bench load` share: questions, prompts, one timed request.

Both commands build prompts with the one layout every policy uses (retrieval/prompt_layout.py)
and send them as `input_ids` + `picrag.link` hints to the frontend's `/generate`. A linked
`/generate` takes the link pipeline `/rag/query` takes (rag_server/linking/pipeline.py: compile
the chunks the store lacks, link, relink on misses), without `/rag/query`'s retrieval and
passage fitting. Every request streams, so the client sees the first token when it is produced:
TTFT is client wall time from sending the request to the first streamed token, frontend compile
round trips included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import platform
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from rag_server.api.runtime_metrics import picrag_counters
from rag_server.linking import sse
from rag_server.linking.chunk_compiler import compile_request, segments_to_compile
from retrieval.prompt_layout import CompiledPrompt, PromptLayout, PromptPassage
from retrieval.qa_rows import QARow, QARowError, read_qa_rows
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import LinkRequest, link_hints
from picrag_core.policies import PolicyError, parse_policy, policy_names

logger = logging.getLogger(__name__)


class BenchError(RuntimeError):
    pass


Handler = Callable[[Any], int]


def reporting_errors(command: str) -> Callable[[Handler], Handler]:
    """A `picrag bench <command>` handler whose BenchError is one line on stderr and exit status 1."""
    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: Any) -> int:
            try:
                return handler(args)
            except BenchError as exc:
                print(f"picrag bench {command}: error: {exc}", file=sys.stderr)
                return 1
        return run
    return wrap


def command_line() -> str:
    """The command as typed, kept in each report so that its table can be made again."""
    return " ".join(["picrag", *sys.argv[1:]])


def add_server_arguments(parser, default_port: int) -> None:
    """Where a bench command finds its server (or starts one) and writes its results."""
    parser.add_argument("--url", default=None, help="a running picrag server; default: start one here")
    parser.add_argument("--model", default=None, metavar="PRESET|PATH",
                        help="model of the server started here; with --url, the tokenizer to use "
                        "(default: the server's model folder)")
    parser.add_argument("--port", type=int, default=default_port, help="port of the server started here")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")


@dataclass(frozen=True)
class PolicyChoice:
    name: str
    reason: str | None = None  # why it cannot run; None when the engine knows it (a server
    # without a CacheRepair checkpoint still refuses cacherepair: reported when it fails)

    @property
    def available(self) -> bool:
        return self.reason is None


def parse_policies(text: str) -> list[PolicyChoice]:
    choices: list[PolicyChoice] = []
    for name in policy_names(text):
        if any(c.name == name for c in choices):
            continue
        try:
            parse_policy(name)  # the engine's own parser: what it accepts can run
        except PolicyError as exc:
            choices.append(PolicyChoice(name, str(exc)))
        else:
            choices.append(PolicyChoice(name))
    if not choices:
        raise BenchError("--policies names no policy")
    return choices


def unavailable_entries(choices: Iterable[PolicyChoice]) -> list[dict[str, str]]:
    """The report's `unavailable` list: each policy that cannot run, with why."""
    return [{"policy": c.name, "reason": c.reason} for c in choices if not c.available]


def with_unrelated_distractors(rows: list[QARow], seed: int = 0) -> list[QARow]:
    """The same questions with every passage the dataset does not mark supporting replaced, in
    place, by a passage of another question (seeded): distractors off the question's topic, where
    the dev sets' own are on it."""
    rng = random.Random(seed)
    replaced = []
    for index, row in enumerate(rows):
        others = [p for j, other in enumerate(rows) if j != index for p in other.passages]
        passages = tuple(p if keep else rng.choice(others)
                         for p, keep in zip(row.passages, row.supporting or [False] * len(row.passages)))
        replaced.append(dataclasses.replace(row, passages=passages))
    return replaced


# A sentence ends at . ! or ? followed by space and a capital, a digit or a quote (abbreviations
# such as "St. Paul" end one too early: a shorter passage, which is what the option asks for).
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def with_first_sentences(rows: list[QARow], sentences: int) -> list[QARow]:
    """The same questions with every passage cut to its first `sentences` sentences: the short
    passages of chat snippets and the README's examples, on questions with gold answers."""
    def cut(passage):
        return dataclasses.replace(passage, text=" ".join(SENTENCE_END.split(passage.text.strip())[:sentences]))
    return [dataclasses.replace(row, passages=tuple(cut(p) for p in row.passages)) for row in rows]


def add_dataset_arguments(parser) -> None:
    """The questions a bench command reads (`read_rows`)."""
    parser.add_argument("--dataset", type=Path, required=True, metavar="FILE.jsonl",
                        help="rows {id, question, answers, passages: [{title, text}]}")
    parser.add_argument("--max-passages", type=int, default=None, help="first N passages of each question")


def read_rows(path: Path, limit: int | None, max_passages: int | None) -> list[QARow]:
    try:
        rows = read_qa_rows(path, limit)
    except QARowError as exc:
        raise BenchError(str(exc)) from exc
    for row in rows:
        if not row.passages:
            raise BenchError(f"{path}: row {row.id} has no passages (the benchmark needs inline passages)")
    if not rows:
        raise BenchError(f"{path}: no questions")
    return [dataclasses.replace(row, passages=row.passages[:max_passages], supporting=row.supporting[:max_passages])
            for row in rows]


def model_path_of(url: str, model: str | None) -> Path:
    """The model folder whose tokenizer builds the prompts: --model, else the server's own."""
    from picrag_core.model_store import resolve_model

    if model is not None:
        return resolve_model(model)
    info = httpx.get(f"{url}/get_model_info", timeout=30).json()
    path = Path(info["model_path"])
    if not (path / "config.json").is_file():
        raise BenchError(f"the server's model {path} is not a local folder here: pass --model")
    return path


def load_layout(model_dir: Path, passage_bos: bool = False) -> PromptLayout:
    from transformers import AutoTokenizer

    return PromptLayout(AutoTokenizer.from_pretrained(model_dir), passage_bos=passage_bos)


@dataclass
class Measured:
    """One streamed, greedy, linked request as the client saw it."""

    text: str
    ttft_s: float
    report: EngineReport  # of the last event
    # The first answer token's log-probabilities over the whole vocabulary, when asked for (sent
    # in the last event).
    first_logprobs: np.ndarray | None = None
    output_ids: tuple[int, ...] = ()  # the answer's token ids (SGLang's last event holds them all)


def measure(client: httpx.Client, prompt: CompiledPrompt, policy: str | None, max_tokens: int,
            first_token_distribution: bool = False) -> Measured:
    """`prompt` linked under `policy`, or sent as a plain prompt (None: stock SGLang's request).
    `first_token_distribution` asks the engine for the first answer token's log-probabilities over
    the whole vocabulary (sglang_patches.steps.first_token_report; linked requests only)."""
    body: dict[str, Any] = {
        "input_ids": prompt.input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens},
        "stream": True,
    }
    if policy is not None:
        body["kv_hints"] = link_hints(policy, list(prompt.chunks), report_first_token=first_token_distribution,
                                       tail=prompt.tail)
    name = policy or "plain prompt"
    started = time.perf_counter()
    ttft = None
    first_logprobs = None
    text, report, output_ids = "", EngineReport(), ()
    with client.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            raise BenchError(f"/generate ({name}) answered {response.status_code}: {response.read()[:300]!r}")
        for event in sse.events(response.iter_lines()):
            if "error" in event:
                raise BenchError(f"/generate ({name}) failed: {event['error']}")
            if ttft is None:
                ttft = time.perf_counter() - started
            text, report = event.get("text", ""), EngineReport.of(event.get("meta_info"))
            output_ids = tuple(event.get("output_ids") or output_ids)
            if report.first_token_logprobs is not None:
                first_logprobs = report.first_token_logprobs
    if ttft is None:
        raise BenchError(f"/generate ({name}) streamed no output")
    if first_token_distribution and first_logprobs is None:
        raise BenchError(f"/generate ({name}) sent no first-token distribution")
    return Measured(text=text, ttft_s=ttft, report=report, first_logprobs=first_logprobs, output_ids=output_ids)


def span_logprobs(client: httpx.Client, prompt: CompiledPrompt, policy: str, answer_ids: Sequence[int]) -> np.ndarray:
    """Teacher forcing in one request: `prompt` linked under `policy`, followed by `answer_ids`
    but its last token; row j of the result is the next token's log-probabilities over the whole
    vocabulary after the prompt and answer_ids[:j] (sglang_patches.steps.span_report)."""
    positions = max(1, len(answer_ids))
    body = {
        "input_ids": prompt.input_ids + list(answer_ids[:positions - 1]),
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "kv_hints": link_hints(policy, list(prompt.chunks), tail=prompt.tail, report_span=positions),
    }
    response = client.post("/generate", json=body)
    if response.status_code != 200:
        raise BenchError(f"/generate ({policy}, answer span) answered {response.status_code}: {response.text[:300]!r}")
    try:
        rows = EngineReport.of(response.json().get("meta_info")).span_rows(positions)
    except ValueError as exc:
        raise BenchError(f"/generate ({policy}, answer span): {exc}") from exc
    if rows is None:
        raise BenchError(f"/generate ({policy}) sent no answer-span distributions")
    return rows


def warm_chunks(client: httpx.Client, layout: PromptLayout, prompt: CompiledPrompt, policy: str) -> None:
    """Put the pieces `policy` links (head and chunks, as the frontend compiles them: legolink0's
    behind its sink tokens) into the chunk store with `picrag.compile` requests.

    Only the pieces are compiled, never the measured prompt, so no measured request is an exact
    repeat that SGLang's prefix matching would answer on its own."""
    link = LinkRequest.of(policy, prompt.chunks, sink_token=layout.tokenizer.bos_token_id, tail=prompt.tail)
    segments = segments_to_compile(prompt.input_ids, link)
    for start in range(0, len(segments), 16):  # a few batched requests, not one per piece
        response = client.post("/generate", json=compile_request(segments[start:start + 16]))
        if response.status_code != 200:
            raise BenchError(f"warm-up compile ({policy}) answered {response.status_code}: {response.text[:300]}")


def chunk_counters(client: httpx.Client, route: str = "/metrics") -> dict[str, float]:
    """picrag's Prometheus counters (`picrag_<name>_total`) by name: the engine's on `/metrics`,
    the frontend's on `/picrag/metrics`; {} where the route is off or absent."""
    response = client.get(route)
    return picrag_counters(response.text) if response.status_code == 200 else {}


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats to `digits` decimals, None as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_table(columns: Sequence[str], rows: Iterable[Sequence[str]], unavailable: Sequence[dict[str, str]]) -> str:
    """A Markdown table whose first column is the policy; a policy that could not run gets one
    row saying why."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [f"| {entry['policy']} | unavailable: {entry['reason']} |" + " |" * (len(columns) - 2)
              for entry in unavailable]
    return "\n".join(lines) + "\n"


def write_report(out: Path, name: str, report: dict[str, Any], table: str) -> int:
    """`<name>.json` and `<name>.md` written to `out`, the table printed: a reading command's end."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
    print(table)
    print(f"-> {out}/{name}.json, {name}.md", file=sys.stderr)
    return 0


def machine_description() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            # Shared machines: other work running at the same time skews every timing.
            "load_average_1_5_15": [round(v, 2) for v in os.getloadavg()],
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


@contextlib.contextmanager
def server(url: str | None, model: str | None, port: int, log: Path,
           serve_args: Sequence[str] = ()) -> Iterator[str]:
    """The given server's URL, or one started here (and stopped afterwards) on `model`, with
    `serve_args` added to its `picrag serve` command line."""
    if url is not None:
        yield url.rstrip("/")
        return
    from rag_server.launch.serve_process import ServeStartError, start_picrag_serve

    args = (["--model", model] if model else []) + list(serve_args)
    logger.info("starting picrag serve on port %d (log %s)", port, log)
    try:
        process = start_picrag_serve(port, args, log)
    except ServeStartError as exc:
        raise BenchError(str(exc)) from exc
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def shuffled(passages: Sequence[PromptPassage], rng: random.Random) -> list[PromptPassage]:
    order = list(passages)
    rng.shuffle(order)
    return order
