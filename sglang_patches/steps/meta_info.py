"""Report each request's chunk-cache accounting in SGLang's response ``meta_info``.

SGLang already ships a per-request dict of cache details from the scheduler to the HTTP
server (``meta_info.cached_tokens_details``); an AFTER hook on the one method that builds it
adds picrag's flat fields (`sglang_patches.plan.link_plan.LinkStats.as_meta`), and a link's
first-token distribution (sglang_patches.steps.first_token_report), its question's attention over
the prompt (sglang_patches.steps.context_attention) or its last positions' distributions
(sglang_patches.steps.span_report) when it asked for them: the schema and its
decoder are picrag_core.engine_report. tests/test_sglang_seams.py checks
the signature of every function picrag hooks.
"""

from __future__ import annotations

HOOK_TARGET = (
    "sglang.srt.managers.scheduler_components.output_streamer."
    "SchedulerOutputStreamer.get_cached_tokens_details"
)


def add_link_stats(result, _streamer, req):
    from sglang_patches.steps.context_attention import encode as encode_attention
    from picrag_core.engine_report import ATTENTION_KEY, FIRST_TOKEN_KEY, SPAN_KEY
    from sglang_patches.plan.link_plan import plan_of
    from sglang_patches.plan.link_state import state_of

    plan, state = plan_of(req), state_of(req)
    if plan is None:
        return result
    stats = state.stats
    meta = {**(result or {"device": 0, "host": 0}), **stats.as_meta()}
    if req.finished():
        state.answered()
        # A request's one-shot reports go with its finished output, built once and never folded
        # away: SGLang's HTTP side folds the outputs a slow reader has not taken yet into the
        # newest and keeps only that one's meta_info, so a stream's first event could lose them
        # (a bench beside other work lost a first-token distribution so once).
        if stats.first_token_logprobs is not None:
            meta[FIRST_TOKEN_KEY] = stats.first_token_logprobs
        report = stats.context_attention
        if report is not None and report.sums is not None:
            meta[ATTENTION_KEY] = encode_attention(report, len(req.origin_input_ids), plan.order)
        if stats.span is not None:
            meta[SPAN_KEY] = stats.span.encode()
    return meta


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, add_link_stats, HookType.AFTER)
