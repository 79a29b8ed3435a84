"""The CPU replacement of vLLM's ``expand_batch_to_tokens`` (vllm_entmtp/patches/sampler.py)."""
import pytest
import torch

from vllm_entmtp.patches.sampler import expand_batch_to_tokens


def test_expands_each_request_value_over_its_tokens():
    x = torch.tensor([0.8, -1.0, 0.5], dtype=torch.float32)
    out = expand_batch_to_tokens(x, torch.tensor([2, 5, 6], dtype=torch.int32), 6, replace_from=-1, replace_to=1)
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.0, 1.0, 0.5])


def test_int32_top_k_and_requests_without_draft_tokens():
    k = torch.tensor([50, 0, 7, 3], dtype=torch.int32)
    out = expand_batch_to_tokens(k, torch.tensor([1, 1, 4, 4], dtype=torch.int32), 4)
    assert out.dtype == torch.int32 and out.tolist() == [50, 7, 7, 7]


def test_rejects_counts_that_do_not_add_up():
    with pytest.raises(ValueError, match="num_tokens=5"):
        expand_batch_to_tokens(torch.ones(2), torch.tensor([1, 3]), 5)
    with pytest.raises(ValueError, match="does not match"):
        expand_batch_to_tokens(torch.ones(2), torch.tensor([1, 2, 3]), 3)


def test_installed_in_vllms_rejection_sampler_on_cpu():
    import vllm.v1.sample.rejection_sampler as rs

    from vllm_entmtp.patches import apply_all

    apply_all()
    assert rs.expand_batch_to_tokens is expand_batch_to_tokens
    # and it is what the sampling constraints use: top-k 2 keeps two tokens per draft row
    from types import SimpleNamespace

    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3)
    meta = SimpleNamespace(all_greedy=False, temperature=torch.tensor([1.0, 0.5]),
                           top_k=torch.tensor([2, 3], dtype=torch.int32), top_p=None)
    out = rs.apply_sampling_constraints(logits, torch.tensor([1, 3], dtype=torch.int32), meta)
    assert torch.isinf(out).sum(dim=1).tolist() == [2, 1, 1]
    assert out[1, 3].item() == pytest.approx(8.0)  # temperature 0.5 for request 1's rows


def test_a_step_without_draft_tokens_and_top_k_alone_does_not_crash():
    """vLLM runs its rejection sampler on a step where no request has draft tokens (the first step after a
    prompt): zero draft-token rows. With ``top_k`` and no ``top_p`` its CPU path takes ``k.max()`` of an empty
    tensor and raised, killing the engine; with the patch the empty rows come back unchanged."""
    from types import SimpleNamespace

    import vllm.v1.sample.rejection_sampler as rs

    from vllm_entmtp.patches import apply_all

    apply_all()
    meta = SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.7, 0.7]),
                           top_k=torch.tensor([40, 5], dtype=torch.int32), top_p=None)
    empty, cu = torch.zeros(0, 8), torch.tensor([0, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="numel"):  # vLLM's own function, unpatched
        rs.apply_sampling_constraints.__wrapped__(empty.clone(), cu, meta)
    assert rs.apply_sampling_constraints(empty, cu, meta).shape == (0, 8)
