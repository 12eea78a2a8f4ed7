"""The next token's log-probabilities after each of a prompt's last K positions, for links that ask.

A quality benchmark that scores a whole answer, not only its first token, teacher-forces every
policy on the reference's answer: the prompt, then the answer's first K - 1 tokens, and at each
of those K positions the distribution of the next token. SGLang computes logits for the last
position only (or, with input logprobs, the chosen token's and a top-k), so one request would
give one position. A link sent with ``"span_logprobs": K`` (picrag_core.link_hints) gets all K:
an AROUND hook on the logits processor applies the model's own LM head (`_get_logits`: its
scaling, soft-capping and vocabulary trim) to the final hidden states of the request's rows at
those positions, and sglang_patches.steps.meta_info ships the K rows, log-softmaxed, with the
finished output (picrag_core.engine_report).

The positions lie after every chunk (the link is refused otherwise), and the request's tree
match stops before them (sglang_patches.tree.chunk_cache), so they are computed in this
request's extend whatever the cache holds. Rows are picked by their position, so a chunked
prefill's pieces each give theirs, and CacheBlend's shrunk batch (which keeps every token after
the chunks) gives the same rows as any other family.
"""

from __future__ import annotations

import torch

from sglang_patches.steps.forward_annotations import annotations_of

HOOK_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"


@torch.no_grad()
def capture(original, processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
    annotations = annotations_of(logits_metadata)
    if annotations is not None and annotations.spans and logits_metadata.forward_mode.is_extend():
        from sglang.srt.layers.logits_processor import LogitsMetadata

        metadata = None
        positions = logits_metadata.positions
        start = 0
        for index, length in enumerate(logits_metadata.extend_seq_lens_cpu):
            report = annotations.spans.get(index)
            if report is not None:
                wanted = (positions[start : start + length] >= report.first_position).nonzero().squeeze(1) + start
                if len(wanted):
                    metadata = metadata or LogitsMetadata.from_forward_batch(logits_metadata)
                    logits = processor._get_logits(hidden_states[wanted], lm_head, metadata, use_logits_buffer=False)
                    report.rows.append(logits.float().log_softmax(-1).cpu())
            start += length
    return original(processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, capture, HookType.AROUND)
