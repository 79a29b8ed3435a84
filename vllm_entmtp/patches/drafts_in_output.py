"""The step's draft tokens travel with the model runner's output, not in a second call to the worker.

Without async scheduling (always so on CPU: vLLM-CPU turns it off, and vLLM turns it off for the ``medusa``
method entmtp runs as), vLLM's engine core asks the worker for the next step's draft tokens after every step
(``EngineCore.post_step`` -> ``executor.take_draft_token_ids()``): with the multiprocess executor (``vllm
serve``) that is one more round trip through the message queues per step, in which both processes wait on each
other. On a 2-core CPU it made a speculative server that drafts nothing 4-11 % slower than plain decoding at 16
and 32 requests (``benchmarks/results/compare-2026-12-02e/``), a cost plain decoding does not pay.

Here the worker attaches what ``take_draft_token_ids()`` would return (the same object: the runner's drafts
and request ids right after ``sample_tokens``, nothing runs in between) to the ``ModelRunnerOutput`` it returns
(:data:`DRAFTS_ATTR`; pickled with it), the scheduler keeps it when it reads the output, and ``post_step`` hands
it to the scheduler instead of asking the worker. An output without it (vLLM's own methods, an output made
elsewhere) takes vLLM's path. Only entmtp's runners attach drafts, only without async scheduling and pipeline
parallelism (there vLLM moves draft tokens otherwise).

| symbol | process | change |
|---|---|---|
| ``GPUModelRunner.sample_tokens`` | engine workers | entmtp's runners attach ``take_draft_token_ids()`` to the output |
| ``Scheduler.update_from_output`` | engine core | keeps the attached drafts (:data:`STASH_ATTR`) |
| ``EngineCore.post_step`` | engine core | uses the kept drafts; without them, vLLM's call to the worker |

Upstream: none known (vLLM's async scheduling, which moves drafts inside the worker, is off on CPU and for
``medusa``-style methods). Remove when vLLM returns draft tokens with the model output.
"""
from __future__ import annotations

DRAFTS_ATTR = "entmtp_draft_token_ids"
"""The attribute of a ``ModelRunnerOutput`` that carries the step's ``DraftTokenIds`` (or None: no drafts)."""
STASH_ATTR = "_entmtp_drafts"
"""The scheduler's attribute that keeps them from ``update_from_output`` to ``post_step``."""
_MISSING = object()
COUNTS = {"from_output": 0, "asked_worker": 0}
"""Steps of this process's engine core whose drafts came with the output, and steps that asked the worker
(vLLM's path); for tests (an engine core inside the caller's process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""


def attach_drafts(runner, output) -> None:
    """Worker side: attach ``runner.take_draft_token_ids()`` to ``output`` (a fresh ``ModelRunnerOutput``)."""
    setattr(output, DRAFTS_ATTR, runner.take_draft_token_ids())


def keep_drafts(scheduler, model_runner_output) -> None:
    """Engine-core side, when the scheduler reads a step's output: keep its attached drafts, if any."""
    setattr(scheduler, STASH_ATTR, getattr(model_runner_output, DRAFTS_ATTR, _MISSING))


def post_step(core, model_executed: bool, orig) -> None:
    """``EngineCore.post_step``: the drafts kept from this step's output go to the scheduler as vLLM's call to
    the worker would have given them; a step whose output had none runs vLLM's ``orig``."""
    drafts = getattr(core.scheduler, STASH_ATTR, _MISSING)
    wanted = core.check_for_draft_tokens and not core.async_scheduling and model_executed
    if drafts is _MISSING:
        COUNTS["asked_worker"] += bool(wanted)
        return orig(core, model_executed)
    setattr(core.scheduler, STASH_ATTR, _MISSING)
    if wanted:
        COUNTS["from_output"] += 1
        if drafts is not None:
            core.scheduler.update_draft_token_ids(drafts)
    return None


def apply() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    from vllm_entmtp.drafter import EntMTPProposer

    if getattr(gmr, "_entmtp_drafts_in_output", False):
        return
    R = gmr.GPUModelRunner
    orig_sample_tokens, orig_update, orig_post_step = (R.sample_tokens, Scheduler.update_from_output,
                                                      EngineCore.post_step)

    def sample_tokens(self, grammar_output):
        stepped = getattr(self, "execute_model_state", None) is not None  # else vLLM may return a shared constant
        out = orig_sample_tokens(self, grammar_output)
        if (stepped and type(out) is ModelRunnerOutput and out is not EMPTY_MODEL_RUNNER_OUTPUT
                and isinstance(getattr(self, "drafter", None), EntMTPProposer)
                and not self.use_async_scheduling and self.parallel_config.pipeline_parallel_size == 1):
            attach_drafts(self, out)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        keep_drafts(self, model_runner_output)
        return orig_update(self, scheduler_output, model_runner_output)

    def _post_step(self, model_executed: bool) -> None:
        return post_step(self, model_executed, orig_post_step)

    R.sample_tokens = sample_tokens
    Scheduler.update_from_output = update_from_output
    EngineCore.post_step = _post_step
    gmr._entmtp_drafts_in_output = True
