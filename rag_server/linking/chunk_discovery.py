"""Finding reusable passages inside a whole prompt that nobody annotated.

Chat apps, LangChain's and LlamaIndex's "stuff the documents" chains and every OpenAI client send
their documents inside the message text. This module finds them in the prompt's own token ids
(the ids SGLang would compute from the request, unchanged), so the link pipeline can serve them
from the chunk store like annotated passages.

How a prompt is cut:
1. **Units.** The prompt is cut where a paragraph begins: at the whitespace run of a blank line
   (two or more newlines), and at a single newline before a line that opens a document in the
   forms RAG frameworks emit ("[3] ...", "Document ...", "Source: ...", "<document ...>", "---").
   The break's whitespace tokens end the unit before it, as a passage compiled on its own ends
   with its blank line (retrieval.prompt_layout), so a passage and its separator are one chunk
   wherever it stands; a tokenizer that folds the break into the token before (Qwen's ".\\n\\n")
   gives the same cut. Special tokens (the chat template's message boundaries) are never inside
   a unit: a unit lies inside one message.
2. **Chunks.** A unit of at least `min_chunk_tokens` tokens is a chunk; a shorter one joins the
   next chunk of its message (a title line, a source line), or stays ordinary prompt when no
   chunk follows it in that message (the question, the answer cue). The prompt's question is
   never a chunk, whatever its length: linked, it would be computed blind to the documents
   before it, which the answer reads it with (a dev question of 32 tokens or more was linked
   before this rule, and doubled naive's and the repair's KL to `full` on those questions). The
   question is the last unit of the prompt's last region when that unit asks (`QUESTION`: a
   line that opens with a question or answer cue, or ends with a question mark) or is the only
   unit of its region (the user's turn after documents stuffed into the system message). A
   last unit that does neither, a document ending the message with nothing after it (LMCache's
   blend workload), stays a passage: computing it instead costs a document's prefill on every
   request (2.2-3.5x the annotated form's TTFT on that workload, measured).
3. **Stable tokens.** A chunk is kept only if its text less the whitespace it ends with,
   tokenized alone, gives exactly the ids it has in the prompt (so the same passage has the same
   ids wherever it stands: the store shares nothing else); otherwise it is merged with the chunk
   after it and checked again, and one that never holds is left ordinary. (A tokenizer splits a
   blank line before a word the same way in every context, and not at the end of a text, so the
   separator is checked as it stands in the prompt.)
4. **One run.** The engine grafts chunks that follow one another from the end of the prompt's
   cached head, so one run of back-to-back chunks is linked: the longest (by tokens) outside the
   prompt's first region (the system prompt, which the prefix cache serves exactly), else the
   longest in it. The head before it (system prompt, chat template) stays on the prefix cache,
   and what follows it is computed as the question is.
5. **The tail.** The run's last passage often ends its message with no blank line after it (the
   documents of LMCache's blend workload, a permutation's last; documents stuffed into a system
   message). It is stored with the separator
   the chunk before it ends with (the link's `tail`, picrag_core.link_hints): the same stored
   chunk as where the passage stands elsewhere, and its own tokens' KV the causal prefix of it.

Each chunk is keyed by all of its tokens (picrag_core.chunk_key), so only chunks whose whole
token sequences are equal share KV: two passages that share windows, or a tiny vocabulary's
look-alike passages, never do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from picrag_core.request_bounds import MAX_CHUNK_SPANS

# A line that opens a document in the formats common RAG frameworks and prompts emit.
DOCUMENT_OPENER = re.compile(r"(?:\[\d{1,4}\]|(?:Document|Doc|Source|Passage|Context)\b|<doc|<document|---)",
                             re.IGNORECASE)
# A paragraph that asks: a line opening with a question or answer cue ("Question:", "Query:",
# "Q:", "Answer:", "A:"), or ending with a question mark. A document read as a question is
# computed, as `full` computes it (the safe side); a question in none of these forms, after
# documents in its own message, is linked (frontend.md says so).
QUESTION = re.compile(r"^[ \t]*(?:question|query|q|answer|a)[ \t]*:|\?[ \t]*$", re.IGNORECASE | re.MULTILINE)
DEFAULT_MIN_CHUNK_TOKENS = 32
# Fewer chunk tokens than this in the linked run: the prompt is left to the prefix cache (a
# link's fixed costs, a compile round trip and the policy's own step, outweigh so little reuse).
DEFAULT_MIN_LINKED_TOKENS = 128


@dataclass(frozen=True)
class DiscoverySettings:
    """`picrag serve --discover-chunks`, `--discover-min-chunk-tokens`, `--discover-min-linked-tokens`."""

    enabled: bool = True
    min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS
    min_linked_tokens: int = DEFAULT_MIN_LINKED_TOKENS
    max_chunks: int = MAX_CHUNK_SPANS  # the engine's bound on chunk spans per link


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt's token ids with, for each, the span of `text` it stands for, and which ids are
    special (never part of a passage)."""

    text: str
    ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]
    special: frozenset[int]
    # Character ranges of `text` that may hold passages (a chat's message contents; a plain
    # text's stretches between special tokens, less a role line after one).
    regions: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Discovered:
    chunks: tuple[tuple[int, int], ...]  # token spans of the prompt, back to back
    candidates: int  # chunks found before the run was chosen (for the usage report and logs)
    tail: tuple[int, ...] = ()  # the separator the last chunk is stored with (module docstring, 5)

    @property
    def chunk_tokens(self) -> int:
        return sum(end - start for start, end in self.chunks)


def _breaks(text: str) -> list[tuple[int, int]]:
    """The character ranges where a unit may begin, in order: a blank line's whitespace run, and
    the newline before a document-opening line."""
    runs = {(m.start(), m.end()) for m in re.finditer(r"[ \t]*\n(?:[ \t]*\n)+", text)}
    for match in re.finditer(r"\n(?=[ \t]*\S)", text):
        if DOCUMENT_OPENER.match(text[match.end():match.end() + 16].lstrip(" \t")):
            runs.add((match.start(), match.end()))
    return sorted(runs)


def _whitespace(prompt: TokenizedPrompt, token: int) -> bool:
    """A token of the text that is only whitespace (a separator's)."""
    start, end = prompt.offsets[token]
    return end > start and prompt.ids[token] not in prompt.special and prompt.text[start:end].isspace()


def _cut_tokens(prompt: TokenizedPrompt) -> set[int]:
    """Token indices where a unit begins: for each break, the first token after its whitespace
    tokens (a tokenizer may also fold the whitespace into the token before)."""
    cuts = set()
    breaks = _breaks(prompt.text)
    index = 0
    for token, (char_start, char_end) in enumerate(prompt.offsets):
        if char_end <= char_start:  # special tokens and prefix ids span no text
            continue
        while index < len(breaks) and breaks[index][1] < char_start:
            index += 1
        if index < len(breaks) and breaks[index][0] <= char_start <= breaks[index][1] and not _whitespace(prompt, token):
            cuts.add(token)
            index += 1
    return cuts


def _trailing_whitespace(prompt: TokenizedPrompt, start: int, end: int) -> int:
    """How many of the span's last tokens are whitespace."""
    count = 0
    while end - count > start and _whitespace(prompt, end - count - 1):
        count += 1
    return count


def _units(prompt: TokenizedPrompt) -> list[list[tuple[int, int]]]:
    """Each region's units as token spans: a region is a stretch of passage text (a message's
    content, or a text between special tokens less a role line) and a unit never leaves one."""
    cuts = _cut_tokens(prompt)
    regions: list[list[tuple[int, int]]] = []
    units: list[tuple[int, int]] = []
    start = None
    current = None  # the region of the unit being built
    for index, (token, span) in enumerate(zip(prompt.ids, prompt.offsets)):
        region = None if token in prompt.special else _region_of(prompt.regions, span)
        if region != current or (start is not None and index in cuts):
            if start is not None:
                units.append((start, index))
            if region != current and units:
                regions.append(units)
                units = []
            start = None
            current = region
        if region is not None and start is None:
            start = index
    if start is not None:
        units.append((start, len(prompt.ids)))
    if units:
        regions.append(units)
    return regions


def _region_of(regions: Sequence[tuple[int, int]], span: tuple[int, int]):
    for region in regions:
        if region[0] <= span[0] and span[1] <= region[1] and span[1] > span[0]:
            return region
    return None


def _chunks_of_message(units: Sequence[tuple[int, int]], min_tokens: int) -> list[tuple[int, int]]:
    """Units of at least `min_tokens`, each with the short units before it joined on."""
    chunks = []
    pending = None  # the start of short units waiting for a chunk
    for start, end in units:
        if pending is None:
            pending = start
        if end - start >= min_tokens:
            chunks.append((pending, end))
            pending = None
    return chunks


def _stable(chunks: list[tuple[int, int]], prompt: TokenizedPrompt,
            encode: Callable[[str], list[int]]) -> list[tuple[int, int]]:
    """The chunks whose text (less the whitespace they end with) tokenizes alone to their ids, a
    failing one merged with the chunk right after it until it holds (or left out)."""
    kept = []
    index = 0
    while index < len(chunks):
        start, end = chunks[index]
        while True:
            body_end = end - _trailing_whitespace(prompt, start, end)
            text = prompt.text[prompt.offsets[start][0]:prompt.offsets[body_end - 1][1]] if body_end > start else ""
            if text and tuple(encode(text)) == prompt.ids[start:body_end]:
                kept.append((start, end))
                break
            if index + 1 < len(chunks) and chunks[index + 1][0] == end:
                index += 1
                end = chunks[index][1]
                continue
            break
        index += 1
    return kept


def _chosen_run(chunks: list[tuple[int, int]], first_region_end: int) -> list[tuple[int, int]]:
    """The run of back-to-back chunks to link: the longest (by tokens) outside the prompt's first
    region, else the longest in it. The first region is where a system prompt sits, which the
    prefix cache already serves exactly wherever it repeats: passages elsewhere (a user
    message's documents) are what it cannot; a prompt's only passages may still be there (a
    stuff-documents chain puts them in the system message)."""
    runs: list[list[tuple[int, int]]] = []
    for chunk in chunks:
        if runs and runs[-1][-1][1] == chunk[0]:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return max(runs, key=lambda run: (run[0][0] >= first_region_end, sum(end - start for start, end in run),
                                      -run[0][0]), default=[])


def discover(prompt: TokenizedPrompt, encode: Callable[[str], list[int]],
             settings: DiscoverySettings = DiscoverySettings()) -> Discovered:
    """The chunks a prompt's link reuses (none: leave it to the prefix cache). `encode` tokenizes
    a text alone, without special tokens, as the prompt's tokenizer does."""
    regions = _units(prompt)
    first_region_end = regions[0][-1][1] if regions else 0
    if regions and _is_question(prompt, regions[-1]):
        regions[-1] = regions[-1][:-1]
    candidates = [chunk for units in regions for chunk in _chunks_of_message(units, settings.min_chunk_tokens)]
    run = _chosen_run(_stable(candidates, prompt, encode), first_region_end)[:settings.max_chunks]
    # The engine computes the prompt's last token itself (its logits start the answer): a run
    # that reaches it would be cut there, so it ends before.
    if run and run[-1][1] == len(prompt.ids):
        run = run[:-1]
    found = Discovered(tuple(run), len(candidates), _tail(prompt, run))
    return found if found.chunk_tokens >= settings.min_linked_tokens else Discovered((), len(candidates))


def _is_question(prompt: TokenizedPrompt, units: list[tuple[int, int]]) -> bool:
    """Whether the last region's last unit is the prompt's question (module docstring, 2)."""
    start, end = units[-1]
    return len(units) == 1 or QUESTION.search(prompt.text[prompt.offsets[start][0]:prompt.offsets[end - 1][1]]) is not None


def _tail(prompt: TokenizedPrompt, run: list[tuple[int, int]]) -> tuple[int, ...]:
    """The separator the run's last chunk is stored with: the whitespace the chunk before it ends
    with, where the last ends with none (module docstring, 5)."""
    if len(run) < 2 or _trailing_whitespace(prompt, *run[-1]):
        return ()
    start, end = run[-2]
    return prompt.ids[end - _trailing_whitespace(prompt, start, end):end]


def tokenized(tokenizer, text: str, prefix_ids: Sequence[int] = (),
              regions: Sequence[tuple[int, int]] | None = None) -> TokenizedPrompt | None:
    """`text` tokenized with offsets by a fast tokenizer, after `prefix_ids` (special tokens the
    tokenizer puts before a text); `regions`: where passages may lie (default: `text_regions`).
    None where the tokenizer gives no offsets."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    prefix = tuple(prefix_ids)
    ids = tuple(encoded["input_ids"])
    offsets = tuple(tuple(span) for span in encoded["offset_mapping"])
    special = special_ids(tokenizer)
    if regions is None:
        regions = text_regions(text, ids, offsets, special)
    return TokenizedPrompt(text=text, ids=prefix + ids, offsets=((0, 0),) * len(prefix) + offsets,
                           special=special, regions=tuple(regions))


# A chat template's role line after a control token ("user\n", "assistant\n").
_ROLE_LINE = re.compile(r"[ \t]*[A-Za-z_][\w-]{0,31}[ \t]*\n")


def text_regions(text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]],
                 special: frozenset[int]) -> list[tuple[int, int]]:
    """A plain text's passage regions: the stretches between its special tokens that hold text,
    each less a role line that opens it right after a special token (a chat rendered into the
    text)."""
    bounds = [0]
    for token, (start, end) in zip(ids, offsets):
        if token in special:
            bounds += [start, end]
    bounds.append(len(text))
    regions = []
    for index in range(0, len(bounds), 2):
        start, end = bounds[index], bounds[index + 1]
        if index > 0:
            role = _ROLE_LINE.match(text, start, end)
            if role:
                start = role.end()
        if text[start:end].strip():  # the newline a template puts between messages holds no passage
            regions.append((start, end))
    return regions


def content_regions(text: str, contents: Sequence[str]) -> list[tuple[int, int]]:
    """Where each message content lies in a rendered chat, found in order (a content the
    template rewrote is not found, and holds no passages)."""
    regions = []
    cursor = 0
    for content in contents:
        if not content:
            continue
        found = text.find(content, cursor)
        if found >= 0:
            regions.append((found, found + len(content)))
            cursor = found + len(content)
    return regions


def special_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special tokens (BOS, EOS, the chat template's control tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)
