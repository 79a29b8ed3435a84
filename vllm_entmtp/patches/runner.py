"""Patch of the V1 model runner's drafter: ``vllm.v1.worker.gpu_model_runner.MedusaProposer``.

The runner builds its drafter with ``MedusaProposer(vllm_config=..., device=...)`` (looked up in the module's
globals) when the method is ``medusa``, which is what ``entmtp`` runs as (see ``config.py``). Replacing that
global with :class:`EntMTPProposer` gives the runner our drafter; the runner's ``medusa`` branch of
``propose_draft_token_ids`` then hands it the hidden state of each request's last accepted token. The CPU runner
(``CPUModelRunner``) inherits all of it. See the table in :mod:`vllm_entmtp.patches`.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm_entmtp")

#: ``SamplingParams.extra_args`` key (``vllm_xargs`` in the OpenAI API) capping one request's draft tokens.
REQUEST_DRAFT_TOKENS_KEY = "entmtp_num_draft_tokens"


def _make_proposer_class():
    from vllm.v1.spec_decode.medusa import MedusaProposer

    from vllm_entmtp.heads.medusa import load_heads
    from vllm_entmtp.proposer import ChainDrafter

    class EntMTPProposer(MedusaProposer):
        """vLLM drafter for ``entmtp``: the project's MTP heads, sharing the target's lm_head.

        ``propose`` returns a list of per-request draft-token lists of varying length (0 allowed), which
        vLLM's scheduler and verification accept (as they do from its ngram proposer).
        """

        runner = None  # set by the runner patch: per-request state lives there

        def load_model(self, target_model: torch.nn.Module) -> None:
            spec = self.spec_config
            text_cfg = self.vllm_config.model_config.hf_text_config
            heads = load_heads(spec.entmtp_heads, hidden_size=text_cfg.hidden_size,
                               vocab_size=text_cfg.vocab_size, dtype=self.dtype, device=self.device)
            self.model = heads
            self.drafter = ChainDrafter(heads, target_model.compute_logits,
                                        confidence_threshold=spec.entmtp.draft_confidence_threshold)
            logger.info("entmtp: loaded %d MTP heads from %s", heads.num_heads, spec.entmtp_heads)

        def _request_budgets(self, num_speculative_tokens: int, n: int) -> list[int]:
            budgets = [min(num_speculative_tokens, self.num_speculative_tokens)] * n
            runner = self.runner
            if runner is None:
                return budgets
            for i, req_id in enumerate(runner.input_batch.req_ids[:n]):
                req = runner.requests.get(req_id)
                extra = getattr(getattr(req, "sampling_params", None), "extra_args", None) or {}
                if REQUEST_DRAFT_TOKENS_KEY in extra:
                    v = extra[REQUEST_DRAFT_TOKENS_KEY]
                    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                        budgets[i] = min(budgets[i], v)
                    else:  # a bad request must not take the engine down: ignore, say so
                        logger.warning("entmtp: request %s: %s=%r is not an int >= 0; ignored",
                                       req_id, REQUEST_DRAFT_TOKENS_KEY, v)
            return budgets

        def propose(self, num_speculative_tokens, target_hidden_states, sampling_metadata,
                    slot_mappings=None) -> list[list[int]]:
            n = target_hidden_states.shape[0]
            return self.drafter.propose(target_hidden_states, self._request_budgets(num_speculative_tokens, n))

        @torch.inference_mode()
        def dummy_run(self, num_tokens: int) -> None:
            hidden = torch.zeros((min(num_tokens, 8), self.hidden_size), dtype=self.dtype, device=self.device)
            self.drafter.head_logits(hidden, self.model.num_heads)

    return EntMTPProposer


def apply() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr

    if getattr(gmr, "_entmtp_patched", False):
        return
    proposer_cls = _make_proposer_class()
    gmr.MedusaProposer = proposer_cls
    runner_cls = gmr.GPUModelRunner
    orig_init = runner_cls.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, proposer_cls):
            drafter.runner = self

    runner_cls.__init__ = __init__
    gmr._entmtp_patched = True
