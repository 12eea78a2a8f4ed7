"""Report each request's chunk-cache accounting in SGLang's response ``meta_info``.

SGLang already ships a per-request dict of cache details from the scheduler to the HTTP
server (``meta_info.cached_tokens_details``); an AFTER hook on the one method that builds it
adds picrag's flat fields (`sglang_patches.link_plan.LinkStats.as_meta`), and a link's
first-token distribution (sglang_patches.first_token_report) or its question's attention over
the prompt (sglang_patches.context_attention) when it asked for them: the schema and its
decoder are picrag_core.engine_report. tests/test_sglang_seams.py checks
the signature of every function picrag hooks.
"""

from __future__ import annotations

HOOK_TARGET = (
    "sglang.srt.managers.scheduler_components.output_streamer."
    "SchedulerOutputStreamer.get_cached_tokens_details"
)


def add_link_stats(result, _streamer, req):
    from sglang_patches.context_attention import encode as encode_attention
    from picrag_core.engine_report import ATTENTION_KEY, FIRST_TOKEN_KEY
    from sglang_patches.first_token_report import take_for_output
    from sglang_patches.link_plan import plan_of

    plan = plan_of(req)
    if plan is None:
        return result
    if req.finished():
        plan.answered()
    stats = plan.stats
    meta = {**(result or {"device": 0, "host": 0}), **stats.as_meta()}
    first_token = take_for_output(stats, streamed=bool(req.stream), finished=req.finished())
    if first_token is not None:
        meta[FIRST_TOKEN_KEY] = first_token
    report = stats.context_attention
    # Like the first-token distribution: a stream carries it once, in its last event.
    if report is not None and report.sums is not None and (not req.stream or req.finished()):
        meta[ATTENTION_KEY] = encode_attention(report, len(req.origin_input_ids), plan.order)
        if req.stream:
            stats.context_attention = None
    return meta


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, add_link_stats, HookType.AFTER)
