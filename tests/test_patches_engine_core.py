"""vllm_entmtp/patches/engine_core.py: an entmtp step's draft tokens ride back on its ModelRunnerOutput, and the
engine core's post_step hands them to the scheduler without calling the workers again (engines that draft end to
end: tests/test_lossless.py)."""
from __future__ import annotations

import pickle
from types import SimpleNamespace

from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from vllm_entmtp.patches import apply_all, engine_core as ec


class Workers:
    """A model runner or an executor: hands out its drafts and counts the calls."""

    def __init__(self, drafts):
        self.drafts, self.calls = drafts, 0

    def take_draft_token_ids(self):
        self.calls += 1
        return self.drafts


class Scheduler:
    def __init__(self):
        self.updates = []

    def update_draft_token_ids(self, drafts):
        self.updates.append(drafts)


def core(drafts_from_workers=None, **kw):
    attrs = {"check_for_draft_tokens": True, "async_scheduling": False, "batch_queue": None, **kw}
    return SimpleNamespace(scheduler=Scheduler(), model_executor=Workers(drafts_from_workers), **attrs)


def test_drafts_ride_on_the_output_and_survive_pickling():
    drafts = DraftTokenIds(["a", "b"], [[5, 6], []])
    out = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[1], [2]])
    runner = Workers(drafts)
    ec.attach_drafts(runner, out)
    back = pickle.loads(pickle.dumps(out))  # how the worker's reply crosses to the engine core process
    assert getattr(back, ec.ATTR) == drafts
    ec.attach_drafts(runner, EMPTY_MODEL_RUNNER_OUTPUT)  # the shared empty output is left alone
    ec.attach_drafts(runner, SimpleNamespace(req_ids=["a"]))  # not a ModelRunnerOutput (e.g. async): left alone
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, ec.ATTR) and runner.calls == 1


def test_post_step_hands_the_stashed_drafts_to_the_scheduler_without_calling_the_workers():
    apply_all()
    drafts = DraftTokenIds(["a"], [[7, 8]])
    c = core(drafts_from_workers=DraftTokenIds(["a"], [[0]]))
    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    setattr(out, ec.ATTR, drafts)
    ec.stash_drafts(c.scheduler, out)
    EngineCore.post_step(c, True)  # the patched post_step
    assert c.scheduler.updates == [drafts] and c.model_executor.calls == 0
    EngineCore.post_step(c, True)  # the stash is used once; without one, vLLM's post_step asks the workers
    assert c.model_executor.calls == 1 and c.scheduler.updates[-1].draft_token_ids == [[0]]


def test_what_vllm_would_not_hand_over_is_not_handed_over():
    none_drafted = core()
    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    setattr(out, ec.ATTR, None)  # nothing drafted this step
    ec.stash_drafts(none_drafted.scheduler, out)
    assert ec.hand_stashed_drafts(none_drafted, True) and none_drafted.scheduler.updates == []
    for kw, executed in (({"async_scheduling": True}, True), ({}, False)):  # vLLM's post_step does nothing there
        c = core(**kw)
        setattr(out, ec.ATTR, DraftTokenIds(["a"], [[1]]))
        ec.stash_drafts(c.scheduler, out)
        assert ec.hand_stashed_drafts(c, executed) and c.scheduler.updates == []
    other_method = core()
    ec.stash_drafts(other_method.scheduler, ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))
    assert not ec.hand_stashed_drafts(other_method, True)  # no attribute: vLLM's post_step runs
    pipelined = core()
    pipelined.batch_queue = object()
    ec.stash_drafts(pipelined.scheduler, out)
    assert not ec.hand_stashed_drafts(pipelined, True)  # a batch queue: vLLM asks the workers
