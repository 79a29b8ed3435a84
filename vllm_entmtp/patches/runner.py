"""Patches of vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, which
``CPUModelRunner`` inherits), for ``entmtp`` only: each patched method calls vLLM's, then one function of the
step (:mod:`vllm_entmtp.step`) or the proposer (:class:`~vllm_entmtp.drafter.EntMTPProposer`). A runner whose
drafter is not entmtp's runs vLLM's methods unchanged.

| symbol | change |
|---|---|
| ``__init__`` | the ``MedusaProposer`` vLLM built for entmtp's inner method is replaced by :class:`EntMTPProposer`, with a handle on the runner (per-request sampling params), and its rejection sampler may take the all-greedy fast path (:mod:`vllm_entmtp.patches.sampler`); vLLM's own ``medusa`` method keeps its proposer and sampler |
| ``_prepare_inputs`` | a step in which no request has draft tokens is prepared as without speculation (:func:`prepare_without_drafts`: no ``SpecDecodeMetadata``); :func:`~vllm_entmtp.step.begin_step`: tree rows get positions root + depth and are recorded for the attention override |
| ``_sample`` | :func:`~vllm_entmtp.step.verify`: after vLLM's chain sampler, tree requests are verified by a tree walk (greedy) or tree rejection sampling, their accepted path's K/V moves to consecutive slots, and the step's signals are taken |
| ``propose_draft_token_ids`` | :meth:`~vllm_entmtp.drafter.EntMTPProposer.draft_step`: the heads read the last *accepted* node's hidden state |
| ``sample_tokens`` | the step's draft tokens ride back on its ``ModelRunnerOutput`` (:func:`~vllm_entmtp.patches.engine_core.attach_drafts`), so that the engine core need not call the workers again for them |

The attention override is registered here too, by an entmtp runner's ``__init__`` (:func:`use_tree_attention`:
``CPU_ATTN`` -> :class:`~vllm_entmtp.patches.tree_attention.TreeCPUAttentionBackend`): a plain engine, or any
other method's, runs vLLM's CPU attention without the override's per-layer calls, plugin installed or not.
"""
from __future__ import annotations

import time

import numpy as np


def prepare_without_drafts(runner, prepare, scheduler_output, num_scheduled_tokens):
    """vLLM's ``_prepare_inputs`` (``prepare``) as without speculation, for a step in which no request has draft
    tokens: no ``SpecDecodeMetadata`` (its index arrays and host-to-device copies, ~0.1 ms a step on a 2-core
    CPU) and the logits of each request's last row, which is what the speculative path selects for such a step.
    With no metadata, vLLM's ``_sample`` calls its sampler as plain decoding does, not its rejection sampler, which
    would copy the logits on the way (to float32, and for the greedy acceptance kernel: under cProfile, in-process
    at 32 requests on a 2-core CPU, 0.74 ms a step against the sampler's 0.38 ms); the bookkeeping after it reads
    one token per request either way.

    vLLM 0.32 decides by ``runner.speculative_config is not None``, so it is None during the call and restored
    after it. The one thing its speculative path writes besides the metadata, ``num_decode_draft_tokens`` (read
    by recurrent attention backends such as GDN and Mamba2), is written as that path writes it for a step
    without draft tokens: 0 for each request that decodes one token after its prompt, -1 for prompt chunks and
    padding."""
    spec = runner.speculative_config
    runner.speculative_config = None
    try:
        out = prepare(runner, scheduler_output, num_scheduled_tokens)
    finally:
        runner.speculative_config = spec
    n = runner.input_batch.num_reqs
    buf = getattr(runner, "num_decode_draft_tokens", None)
    if buf is not None:
        ib = runner.input_batch
        decode = (ib.num_computed_tokens_cpu[:n] >= ib.num_prompt_tokens[:n]) & (num_scheduled_tokens[:n] == 1)
        buf.np[:n] = np.where(decode, 0, -1)
        buf.np[n:].fill(-1)
        buf.copy_to_gpu()
    return out


#: vLLM's own class for ``CPU_ATTN``, put back for an engine without entmtp built after one with it.
VLLM_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
TREE_CPU_ATTN = "vllm_entmtp.patches.tree_attention.TreeCPUAttentionBackend"


def use_tree_attention(on: bool = True) -> None:
    """Register the tree-attention override for vLLM's CPU attention (``CPU_ATTN``) in this process (``on``), or put
    vLLM's class back where the override is registered (not ``on``: an engine without entmtp built after one with
    it in the same process, e.g. several ``LLM`` objects, must not run the override, which reads the process's one
    :data:`~vllm_entmtp.step.STEP`). Called by a runner's ``__init__``, before it builds the model (its attention
    layers pick their backend then; engines already built keep theirs); vLLM's cached backend choice is dropped
    when the registration changes. What is registered is read from vLLM's registry, so another plugin's
    ``CPU_ATTN`` is left as it is for engines without entmtp."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    registered = AttentionBackendEnum.CPU_ATTN.get_path()
    if on == (registered == TREE_CPU_ATTN):
        return
    from vllm.v1.attention import selector

    register_backend(AttentionBackendEnum.CPU_ATTN, TREE_CPU_ATTN if on else VLLM_CPU_ATTN)
    selector._cached_get_attn_backend.cache_clear()


def apply() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr

    from vllm_entmtp import step
    from vllm_entmtp.drafter import EntMTPProposer
    from vllm_entmtp.patches.engine_core import attach_drafts
    from vllm_entmtp.patches.sampler import GREEDY_FAST_PATH_ATTR

    if getattr(gmr, "_entmtp_patched", False):
        return
    R = gmr.GPUModelRunner
    orig_init, orig_prepare, orig_sample, orig_propose, orig_sample_tokens = (
        R.__init__, R._prepare_inputs, R._sample, R.propose_draft_token_ids, R.sample_tokens)

    def entmtp(runner) -> EntMTPProposer | None:
        d = getattr(runner, "drafter", None)
        return d if isinstance(d, EntMTPProposer) else None

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        spec = getattr(self, "speculative_config", None)
        is_entmtp = isinstance(getattr(self, "drafter", None), gmr.MedusaProposer) and getattr(spec, "entmtp", None)
        use_tree_attention(bool(is_entmtp))  # before load_model builds the target's attention layers
        if is_entmtp:
            step.STEP.reset({})  # nothing of an engine built earlier in the process carries over
            self.drafter = EntMTPProposer(vllm_config=self.vllm_config, device=self.device)
            self.drafter.runner = self
            # all-greedy batches skip vLLM's copies of the logits (patches/sampler.py, greedy_verify)
            setattr(self.rejection_sampler, GREEDY_FAST_PATH_ATTR, True)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        t0 = time.perf_counter()
        drafter = entmtp(self)
        if drafter is not None and not scheduler_output.scheduled_spec_decode_tokens:
            out = prepare_without_drafts(self, orig_prepare, scheduler_output, num_scheduled_tokens)
        else:
            out = orig_prepare(self, scheduler_output, num_scheduled_tokens)
        if drafter is not None:
            step.begin_step(self, scheduler_output)
            if drafter.step_hook is not None:
                drafter.step_hook(self, scheduler_output, t0)
        return out

    def _sample(self, logits, spec_decode_metadata):
        drafter = entmtp(self)
        if drafter is None:
            return orig_sample(self, logits, spec_decode_metadata)
        out = orig_sample(self, logits, spec_decode_metadata)
        step.verify(self, logits, spec_decode_metadata, out,
                    entropy=None if drafter.tracker is None else drafter.scheduler.policy == "entropy")
        return out

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        drafter = entmtp(self)
        if drafter is None:
            return orig_propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings)
        return drafter.draft_step(scheduler_output, sampled_token_ids, hidden_states, sample_hidden_states,
                                  spec_decode_metadata)

    def sample_tokens(self, grammar_output):
        out = orig_sample_tokens(self, grammar_output)
        if entmtp(self) is not None:
            attach_drafts(self, out)
        return out

    R.__init__ = __init__
    R._prepare_inputs = _prepare_inputs
    R.sample_tokens = sample_tokens
    R._sample = _sample
    R.propose_draft_token_ids = propose_draft_token_ids
    gmr._entmtp_patched = True
