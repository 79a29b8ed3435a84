"""entmtp's per-request options (vllm_entmtp/request_options.py) and their check in vLLM's SamplingParams
(vllm_entmtp/patches/sampling_params.py): a bad value is refused before the request reaches the engine."""
import pytest

from vllm_entmtp.request_options import (REQUEST_DRAFT_TOKENS_KEY, REQUEST_TREE_KEY, RequestOptionError,
                                         drafts_nothing, validate_request_options)

TREES = {"b0n1", "b0n2", "b1n4"}


@pytest.mark.parametrize("extra", [None, {}, {REQUEST_DRAFT_TOKENS_KEY: 0}, {REQUEST_DRAFT_TOKENS_KEY: 7},
                                   {REQUEST_TREE_KEY: "b1n4"}, {REQUEST_TREE_KEY: "none"},
                                   {"someone_elses_key": [1, 2]}])
def test_good_options_pass(extra):
    validate_request_options(extra, TREES)


@pytest.mark.parametrize("extra, key, allowed", [
    ({REQUEST_DRAFT_TOKENS_KEY: -1}, REQUEST_DRAFT_TOKENS_KEY, "an integer >= 0"),
    ({REQUEST_DRAFT_TOKENS_KEY: 2.5}, REQUEST_DRAFT_TOKENS_KEY, "an integer >= 0"),
    ({REQUEST_DRAFT_TOKENS_KEY: True}, REQUEST_DRAFT_TOKENS_KEY, "an integer >= 0"),
    ({REQUEST_DRAFT_TOKENS_KEY: "3"}, REQUEST_DRAFT_TOKENS_KEY, "an integer >= 0"),
    ({REQUEST_TREE_KEY: "b9n99"}, REQUEST_TREE_KEY, "b0n1, b0n2, b1n4"),
    ({REQUEST_TREE_KEY: 3}, REQUEST_TREE_KEY, "'none' or one of"),
    ({"entmtp_num_draft_token": 2}, "entmtp_num_draft_token", REQUEST_DRAFT_TOKENS_KEY),
])
def test_bad_options_name_the_key_and_what_is_allowed(extra, key, allowed):
    with pytest.raises(RequestOptionError) as e:
        validate_request_options(extra, TREES)
    assert e.value.key == key and key in str(e.value) and allowed in str(e.value)


def test_a_tree_id_needs_a_scheduled_tree_set():
    validate_request_options({REQUEST_TREE_KEY: "none"}, None)
    with pytest.raises(RequestOptionError, match="schedules no tree set; allowed: 'none'"):
        validate_request_options({REQUEST_TREE_KEY: "b0n1"}, None)


def test_min_p_and_logit_bias_draft_nothing():
    from vllm import SamplingParams

    assert drafts_nothing(SamplingParams(min_p=0.1)) and drafts_nothing(SamplingParams(logit_bias={5: 1.0}))
    assert not drafts_nothing(SamplingParams(temperature=0.7, top_k=40)) and not drafts_nothing(None)


def test_vllm_checks_them_for_entmtp_and_serves_min_p_and_logit_bias(target_model_config, default_heads):
    """A request's SamplingParams are verified against the engine's speculative config: for entmtp a bad option
    is a VLLMValidationError naming it (HTTP 400 in the OpenAI server), and min_p/logit_bias pass, which vLLM
    refuses for its own methods."""
    from vllm import SamplingParams
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.exceptions import VLLMValidationError

    from vllm_entmtp.patches import apply_all

    apply_all()
    targets = {"target_model_config": target_model_config, "target_parallel_config": ParallelConfig()}
    entmtp = SpeculativeConfig(method="entmtp", **targets)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, **targets)

    def verify(spec, **kw):
        SamplingParams(**kw).verify(target_model_config, spec, None, None)

    verify(entmtp, min_p=0.1, logit_bias={5: 2.0}, extra_args={REQUEST_TREE_KEY: "b0n2"})
    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        verify(ngram, min_p=0.1)
    with pytest.raises(VLLMValidationError) as e:
        verify(entmtp, extra_args={REQUEST_TREE_KEY: "no-such-tree"})
    assert e.value.parameter == REQUEST_TREE_KEY and "allowed: 'none' or one of" in str(e.value)
    with pytest.raises(VLLMValidationError) as e:
        verify(entmtp, extra_args={REQUEST_DRAFT_TOKENS_KEY: -2})
    assert e.value.parameter == REQUEST_DRAFT_TOKENS_KEY
