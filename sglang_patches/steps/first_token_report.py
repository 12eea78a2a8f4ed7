"""The first answer token's log-probabilities over the whole vocabulary, for links that ask.

SGLang returns top-k log-probabilities for every output token, and streams them cumulatively:
the whole vocabulary at 32 output tokens would be tens of megabytes per request. A benchmark
that wants the exact first-token KL between two policies needs one full distribution, once. A
link sent with ``"first_token_logprobs": true`` gets it: an AFTER hook on the scheduler's
result readback (`Scheduler._copy_result_to_cpu`, which every generation forward passes) takes
the log-softmax of the logits row of each such request whose prefill has just produced its
first token, and sglang_patches.steps.meta_info ships it in the ``meta_info`` of the request's finished
output (a stream's last event) as ``picrag_first_token_logprobs``, one per vocabulary id
(picrag_core.engine_report).
"""

from __future__ import annotations

from picrag_core.engine_report import encode_floats

HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler._copy_result_to_cpu"


def capture(_result, _scheduler, batch_result, batch) -> None:
    from sglang_patches.plan.link_plan import plan_of
    from sglang_patches.plan.link_state import state_of

    if not batch.forward_mode.is_extend() or batch_result.logits_output is None:
        return None
    logits = batch_result.logits_output.next_token_logits
    if logits is None:
        return None
    for row, req in enumerate(batch.reqs):
        plan = plan_of(req)
        # A re-prefill after retraction (output_ids already hold the answer so far) is no first
        # token. A chunked prefill passes here once per piece: each piece's row replaces the one
        # before, and SGLang emits nothing for a request before its last piece has run, so the
        # row sent is the last piece's, the first answer token's.
        if plan is None or not plan.link.report_first_token or req.output_ids:
            continue
        state_of(req).stats.first_token_logprobs = encode_floats(logits[row].float().log_softmax(-1).cpu().numpy())
    return None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, capture, HookType.AFTER)
