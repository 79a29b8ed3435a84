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


def _greedy_batch(num_draft_tokens, vocab=64, seed=0, match=0.6, ties=False, dtype=torch.float32):
    """vLLM's inputs to ``RejectionSampler.forward`` for an all-greedy batch: logits (in ``dtype``, the served
    model's) with a row per draft token and a bonus row per request, draft tokens equal to their row's argmax with
    probability ``match``; with ``ties``, every row's maximum appears twice (before and after the first one,
    alternately)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    gen = torch.Generator().manual_seed(seed)
    rows = sum(num_draft_tokens) + len(num_draft_tokens)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    if ties:
        for r in range(rows):
            m = int(logits[r].argmax())
            logits[r, (m + (vocab // 3 if r % 2 else -vocab // 3)) % vocab] = logits[r, m]
    draft = []
    start = 0
    for n in num_draft_tokens:
        for j in range(n):
            best = int(logits[start + j].argmax())
            draft.append(best if torch.rand(1, generator=gen).item() < match else (best + 1) % vocab)
        start += n + 1
    ends = [sum(num_draft_tokens[:i + 1]) for i in range(len(num_draft_tokens))]
    meta = SpecDecodeMetadata.make_dummy([draft[e - n:e] for e, n in zip(ends, num_draft_tokens)],
                                         device=torch.device("cpu"))
    return meta, logits


def _sampling_metadata(**over):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    fields = dict(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
                  max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                  frequency_penalties=torch.zeros(0), presence_penalties=torch.zeros(0),
                  repetition_penalties=torch.zeros(0), output_token_ids=[], allowed_token_ids_mask=None,
                  bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    return SamplingMetadata(**(fields | over))


def _samplers():
    """vLLM's rejection sampler, and one marked for the fast path as entmtp's runners mark theirs."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_entmtp.patches import apply_all
    from vllm_entmtp.patches.sampler import GREEDY_FAST_PATH_ATTR

    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does before it samples
    apply_all()
    fast = RejectionSampler(Sampler())
    setattr(fast, GREEDY_FAST_PATH_ATTR, True)
    return RejectionSampler(Sampler()), fast


#: (draft tokens per request, tied maxima, the logits' dtype): bfloat16 is what `make serve` serves on CPUs with
#: AVX-512 BF16, and vLLM's CPU argmax kernel takes float32 logits only
FAST_PATH_CASES = [([3, 0, 5, 1], False, "float32"), ([0, 0], False, "float32"), ([4], False, "float32"),
                   ([1] * 16, False, "float32"), ([3, 0, 5, 1], True, "float32"), ([1] * 16, True, "float32"),
                   ([3, 0, 5, 1], False, "bfloat16"), ([1] * 16, True, "bfloat16"), ([2, 2], False, "float16")]


def compare_fast_path() -> dict:
    """Each of :data:`FAST_PATH_CASES` (5 seeds each) through vLLM's rejection sampler and a marked one, and a
    batch with an allowed-token mask through both; what the tests below assert."""
    from vllm_entmtp.patches.sampler import argmax_only

    vllms, fast = _samplers()
    sm = _sampling_metadata()
    out = {"argmax_only": argmax_only(sm), "cases": []}
    for num_draft_tokens, ties, dtype in FAST_PATH_CASES:
        for seed in range(5):
            meta, logits = _greedy_batch(num_draft_tokens, seed=seed, ties=ties, dtype=getattr(torch, dtype))
            before = logits.clone()
            want = vllms(meta, None, logits.clone(), sm).sampled_token_ids
            got = fast(meta, None, logits, sm)
            out["cases"].append({"case": [num_draft_tokens, ties, dtype, seed], "want": want.tolist(),
                                 "got": got.sampled_token_ids.tolist(),
                                 "same_dtype": got.sampled_token_ids.dtype == want.dtype,
                                 "no_logprobs": got.logprobs_tensors is None,
                                 "logits_unchanged": torch.equal(logits, before)})
    meta, logits = _greedy_batch([2, 3], match=1.0)
    mask = torch.zeros(2, logits.shape[1], dtype=torch.bool)
    mask[:, logits.argmax(dim=-1).unique()] = True  # every row's own maximum is not allowed
    masked = _sampling_metadata(allowed_token_ids_mask=mask)
    out["masked"] = {"vllm": vllms(meta, None, logits.clone(), masked).sampled_token_ids.tolist(),
                     "marked": fast(meta, None, logits.clone(), masked).sampled_token_ids.tolist(),
                     "unmasked": fast(meta, None, logits.clone(), sm).sampled_token_ids.tolist()}
    return out


_COMPARE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_patches_sampler import compare_fast_path
print("RESULT " + json.dumps(compare_fast_path()), flush=True)
"""


@pytest.fixture(scope="module")
def fast_path_runs() -> dict:
    """:func:`compare_fast_path` in a fresh process: vLLM's CPU kernel overrides (what its CPU worker installs before
    sampling) rebind kernels by scanning every loaded module, which fails on modules that other tests load
    (``vllm/triton_utils/dispatcher.py``)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    p = subprocess.run([sys.executable, "-c", _COMPARE, str(Path(__file__).parent)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_the_greedy_fast_path_returns_vllms_rejection_sampling_output(fast_path_runs):
    """For an all-greedy batch that asks for argmaxes only, entmtp's runners skip vLLM's copies of the logits;
    the accepted tokens, bonus tokens and placeholders are vLLM's (tied maxima too), and the logits are left as
    they were."""
    assert fast_path_runs["argmax_only"]
    cases = fast_path_runs["cases"]
    assert len(cases) == 5 * len(FAST_PATH_CASES)
    for c in cases:
        assert c["got"] == c["want"] and c["same_dtype"] and c["no_logprobs"] and c["logits_unchanged"], c
    assert any(-1 in row for c in cases for row in c["want"])  # rejected drafts (placeholders) were among them


def test_a_batch_that_asks_for_more_than_argmaxes_takes_vllms_path(fast_path_runs):
    """A marked sampler given a batch whose logits vLLM changes before the argmax (here an allowed-token mask
    that forbids each row's maximum) returns vLLM's output, which the argmaxes of the raw logits would not."""
    masked = fast_path_runs["masked"]
    assert masked["marked"] == masked["vllm"] and masked["unmasked"] != masked["vllm"], masked


def test_the_greedy_fast_path_is_left_when_the_batch_asks_for_more_than_argmaxes():
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    from vllm_entmtp.patches.sampler import argmax_only

    bias = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    min_tokens = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    idle = _sampling_metadata(logitsprocs=LogitsProcessors([bias, min_tokens]))
    assert argmax_only(idle)  # no request uses them
    bias.biases = {0: {5: 3.0}}
    assert not argmax_only(idle)
    bias.biases = {}
    min_tokens.min_toks = {0: (4, [], {2}, False)}
    assert not argmax_only(idle)

    class OwnProcessor:  # a processor entmtp does not know: taken as active
        def is_argmax_invariant(self) -> bool:
            return False

    assert not argmax_only(_sampling_metadata(logitsprocs=LogitsProcessors([OwnProcessor()])))
    busy = SimpleNamespace(has_tracked_requests=lambda: True)
    for over in ({"all_greedy": False}, {"max_num_logprobs": 0}, {"no_penalties": False},
                 {"bad_words_token_ids": {0: [[7]]}}, {"allowed_token_ids_mask": torch.zeros(1, 64, dtype=bool)},
                 {"logprob_token_ids": {0: [3]}}, {"thinking_budget_state_holder": busy}):
        assert not argmax_only(_sampling_metadata(**over)), over
