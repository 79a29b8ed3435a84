"""The step's signals for the tracker (:func:`vllm_entmtp.step._step_signals`): accepted draft tokens per request
and the entropy at each request's last accepted row, with and without draft tokens in the step."""
from types import SimpleNamespace

import pytest
import torch

from vllm_entmtp.entropy import entropy_nats
from vllm_entmtp.step import STEP, _step_signals


@pytest.fixture(autouse=True)
def fresh_step():
    STEP.reset({})
    yield
    STEP.reset({})


@pytest.mark.parametrize("entropy", [True, False])
def test_a_step_without_draft_tokens(entropy):
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    STEP.set_offsets(None, 3)  # no SpecDecodeMetadata (prepare_without_drafts): one row per request
    out = SimpleNamespace(sampled_token_ids=torch.tensor([[4], [7], [9]]))
    ent, accepted = _step_signals(logits, out, entropy)
    assert accepted == [0, 0, 0]
    if entropy:
        assert ent == pytest.approx(entropy_nats(logits).tolist())
    else:
        assert ent is None


@pytest.mark.parametrize("entropy", [True, False])
def test_a_step_with_draft_tokens_reads_each_requests_last_accepted_row(entropy):
    torch.manual_seed(0)
    # draft tokens 2, 0, 1: rows 0-2 (request 0), 3 (request 1), 4-5 (request 2)
    logits = torch.randn(6, 50)
    STEP.set_offsets([2, 0, 1], 3)
    # request 0 accepted one draft token (2 emitted), request 1 none, request 2 its draft (2 emitted)
    out = SimpleNamespace(sampled_token_ids=torch.tensor([[4, 5, -1], [7, -1, -1], [9, 3, -1]]))
    ent, accepted = _step_signals(logits, out, entropy)
    assert accepted == [1, 0, 1]
    if entropy:
        assert ent == pytest.approx(entropy_nats(logits[[1, 3, 5]]).tolist())
    else:
        assert ent is None
