"""Patch of ``vllm.v1.worker.gpu_model_runner.build_logitsprocs``: vLLM's built-in ``min_p`` and ``logit_bias``
processors under entmtp.

With speculative decoding on, vLLM 0.32 builds only the ``min_tokens`` processor ("min_p and logit_bias
parameters won't work with speculative decoding") and refuses such requests. Under entmtp a request with
``min_p`` or ``logit_bias`` drafts nothing (:func:`vllm_entmtp.request_options.drafts_nothing`), so its one row
per step is the bonus row that vLLM's full sampler processes, where these processors apply exactly as without
speculation. The other requests' draft-token rows are untouched: vLLM's rejection sampler applies only
``min_tokens`` to them, and the processors change nothing for a request without their parameter.
"""
from __future__ import annotations


def apply() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

    if getattr(gmr.build_logitsprocs, "_entmtp_patched", False):
        return
    orig = gmr.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if getattr(vllm_config.speculative_config, "entmtp", None) is None or is_pooling_model \
                or custom_logitsprocs:
            return orig(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    build_logitsprocs._entmtp_patched = True
    gmr.build_logitsprocs = build_logitsprocs
