"""The step's draft tokens travel with the model runner's output (vllm_entmtp/patches/drafts_in_output.py): the
engine core side, with stand-ins for vLLM's engine core, scheduler and executor. (In an engine:
tests/test_lossless.py::test_draft_tokens_reach_the_scheduler_with_the_output.)"""
from types import SimpleNamespace

import pytest

from vllm_entmtp.patches import drafts_in_output as dio


class Scheduler:
    def __init__(self):
        self.updates = []

    def update_draft_token_ids(self, drafts):
        self.updates.append(drafts)


def _core(async_scheduling=False):
    asked = []
    core = SimpleNamespace(scheduler=Scheduler(), check_for_draft_tokens=True, async_scheduling=async_scheduling,
                           model_executor=SimpleNamespace(take_draft_token_ids=lambda: asked.append(1) or "asked"))

    def orig(c, model_executed):  # vLLM's post_step
        if c.check_for_draft_tokens and not c.async_scheduling and model_executed:
            c.scheduler.update_draft_token_ids(c.model_executor.take_draft_token_ids())
    return core, asked, orig


@pytest.fixture(autouse=True)
def _counts():
    saved = dict(dio.COUNTS)
    yield
    dio.COUNTS.update(saved)


def test_drafts_that_came_with_the_output_reach_the_scheduler_without_asking_the_worker():
    core, asked, orig = _core()
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[5, 6], []])
    dio.keep_drafts(core.scheduler, SimpleNamespace(**{dio.DRAFTS_ATTR: drafts}))
    dio.post_step(core, True, orig)
    assert core.scheduler.updates == [drafts] and asked == []
    # kept for one step only: the next output without drafts takes vLLM's path
    dio.keep_drafts(core.scheduler, SimpleNamespace())
    dio.post_step(core, True, orig)
    assert core.scheduler.updates == [drafts, "asked"] and asked == [1]


def test_a_step_without_drafts_asks_nobody_and_updates_nothing():
    core, asked, orig = _core()
    dio.keep_drafts(core.scheduler, SimpleNamespace(**{dio.DRAFTS_ATTR: None}))  # the runner had no drafts
    before = dict(dio.COUNTS)
    dio.post_step(core, True, orig)
    assert core.scheduler.updates == [] and asked == []
    assert dio.COUNTS["from_output"] == before["from_output"] + 1


def test_no_update_where_vllm_would_not_update():
    for core, executed in ((_core()[0], False), (_core(async_scheduling=True)[0], True)):
        _, asked, orig = _core()
        dio.keep_drafts(core.scheduler, SimpleNamespace(**{dio.DRAFTS_ATTR: SimpleNamespace()}))
        dio.post_step(core, executed, orig)
        assert core.scheduler.updates == []


def test_the_runner_attaches_what_the_worker_call_would_return():
    runner = SimpleNamespace(take_draft_token_ids=lambda: ("ids", [[1, 2]]))
    out = SimpleNamespace()
    dio.attach_drafts(runner, out)
    assert getattr(out, dio.DRAFTS_ATTR) == ("ids", [[1, 2]])


def test_installed_in_vllm():
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.engine.core import EngineCore

    from vllm_entmtp.patches import apply_all

    apply_all()
    assert gmr._entmtp_drafts_in_output
    assert "keep_drafts" in VllmScheduler.update_from_output.__code__.co_names
    assert "post_step" in EngineCore.post_step.__code__.co_names
    assert "attach_drafts" in gmr.GPUModelRunner.sample_tokens.__code__.co_names
