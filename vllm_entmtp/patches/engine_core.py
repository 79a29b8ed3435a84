"""entmtp's draft tokens travel back to the engine core with the step's sampled tokens, not by a second call.

vLLM 0.32 without async scheduling asks the workers for a step's draft tokens in a call of its own after the step
(``EngineCore.post_step`` -> ``model_executor.take_draft_token_ids()``): one more round trip between the engine
core and the worker processes every step, whether anything was drafted or not. Served on a 2-core CPU
(2026-12-03, bfloat16, 32 running) it took 2.5 ms a step, 2-3 % of that step (and, if it costs the same with one
request, 8 % of a one-request step), where plain decoding's ``post_step`` does nothing.

Here the worker puts the same :class:`vllm.v1.outputs.DraftTokenIds` (what ``take_draft_token_ids`` returns, None
when nothing was drafted) on the step's ``ModelRunnerOutput`` as :data:`ATTR` (:func:`attach_drafts`, called by the
runner patch's ``sample_tokens`` for entmtp's runners only); the engine core's scheduler keeps it when it reads the
output (:func:`stash_drafts`), and ``post_step`` hands it to the scheduler instead of calling the workers
(:func:`hand_stashed_drafts`). An output without the attribute (other methods, async scheduling, an output
without requests) and an engine core that pipelines steps (a batch queue) leave ``post_step`` as vLLM wrote it.
The worker's drafts stay where they were, so a ``take_draft_token_ids`` call still returns them.
"""
from __future__ import annotations

#: The attribute of a ``ModelRunnerOutput`` that carries the step's ``DraftTokenIds`` (or None) from an entmtp
#: worker to the engine core.
ATTR = "entmtp_draft_token_ids"
_STASH = "_entmtp_draft_token_ids"
_MISSING = object()


def attach_drafts(runner, output) -> None:
    """Worker side: put ``runner.take_draft_token_ids()`` on ``output`` when it is a plain ``ModelRunnerOutput`` of
    a step with requests (not the shared empty output, not an async output)."""
    from vllm.v1.outputs import ModelRunnerOutput

    if type(output) is ModelRunnerOutput and output.req_ids:
        setattr(output, ATTR, runner.take_draft_token_ids())


def stash_drafts(scheduler, model_runner_output) -> None:
    """Engine core: keep the drafts an output carries (or that it carries none) for this step's ``post_step``."""
    setattr(scheduler, _STASH, getattr(model_runner_output, ATTR, _MISSING))


def hand_stashed_drafts(engine_core, model_executed: bool) -> bool:
    """Engine core, ``post_step``: give the scheduler the drafts stashed from this step's output, where vLLM would
    have asked the workers for them. True: done (the workers are not called); False: nothing stashed, vLLM's
    ``post_step`` runs."""
    scheduler = engine_core.scheduler
    drafts = getattr(scheduler, _STASH, _MISSING)
    if drafts is _MISSING:
        return False
    setattr(scheduler, _STASH, _MISSING)
    if getattr(engine_core, "batch_queue", None) is not None:  # pipelined steps: the output read may be an older
        return False  # step's than the workers' latest drafts; vLLM asks the workers, as it does
    if engine_core.check_for_draft_tokens and not engine_core.async_scheduling and model_executed \
            and drafts is not None:
        scheduler.update_draft_token_ids(drafts)
    return True


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, "_entmtp_patched", False):
        return
    orig_update, orig_post_step = Scheduler.update_from_output, EngineCore.post_step

    def update_from_output(self, scheduler_output, model_runner_output):
        stash_drafts(self, model_runner_output)
        return orig_update(self, scheduler_output, model_runner_output)

    def post_step(self, model_executed: bool) -> None:
        if not hand_stashed_drafts(self, model_executed):
            orig_post_step(self, model_executed)

    Scheduler.update_from_output = update_from_output
    EngineCore.post_step = post_step
    EngineCore._entmtp_patched = True
