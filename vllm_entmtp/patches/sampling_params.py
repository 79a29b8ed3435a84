"""Patch of ``vllm.sampling_params.SamplingParams._validate_spec_decode``: entmtp's request checks.

vLLM calls it from ``SamplingParams.verify`` for every request, in the front end, before the request reaches
the engine; a ``VLLMValidationError`` becomes HTTP 400 naming the parameter. For entmtp (the speculative config
carries ``entmtp``):

- ``min_p`` and ``logit_bias``, which vLLM 0.32 refuses whenever speculative decoding is on (its rejection
  sampler does not apply them to draft-token rows), are served: such a request drafts nothing
  (:func:`vllm_entmtp.request_options.drafts_nothing`, in the runner), so vLLM's full sampler handles its one row
  per step, as without speculation, while the rest of the batch keeps drafting;
- the request's ``entmtp_*`` options (``vllm_xargs``) are checked (:mod:`vllm_entmtp.request_options`).

Every other method keeps vLLM's check.
"""
from __future__ import annotations

import functools

from vllm_entmtp.request_options import RequestOptionError, validate_request_options


@functools.lru_cache(maxsize=8)
def _tree_ids(tree_set_path: str) -> frozenset[str]:
    from vllm_entmtp.trees import load_tree_set

    return frozenset(load_tree_set(tree_set_path).ids)


def scheduled_tree_ids(speculative_config) -> frozenset[str] | None:
    """The ids of the tree set entmtp schedules from, or None when it schedules none (policy ``static``)."""
    options = getattr(speculative_config, "entmtp", None)
    path = getattr(speculative_config, "entmtp_tree_set_path", None)
    if options is None or options.policy == "static" or path is None:
        return None
    return _tree_ids(str(path))


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    if getattr(SamplingParams, "_entmtp_patched", False):
        return
    orig = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config) -> None:
        if getattr(speculative_config, "entmtp", None) is None:
            return orig(self, speculative_config)
        try:
            validate_request_options(self.extra_args, scheduled_tree_ids(speculative_config))
        except RequestOptionError as e:
            raise VLLMValidationError(str(e), parameter=e.key, value=e.value) from None

    SamplingParams._validate_spec_decode = _validate_spec_decode
    SamplingParams._entmtp_patched = True
