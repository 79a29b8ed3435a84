"""Patches of vLLM 0.32's rejection sampler (``vllm.v1.sample.rejection_sampler``).

``apply_sampling_constraints`` (every platform): with speculative decoding on, vLLM builds a rejection-sampling
step even when no request of the batch has draft tokens (the first step after a prompt; every step in which the
drafter proposes nothing). The target's draft-token logits are then an empty ``[0, vocab]`` tensor, and on CPU
a request with ``top_k`` and no ``top_p`` goes to ``apply_top_k_only``, whose ``k.max()`` of an empty tensor
raises: the engine died on the first sampled request with ``top_k`` (``{"temperature": 0.7, "top_k": 40}``),
with vLLM's own ``ngram`` method too. ``top_p`` takes a sorting path that copes with no rows, which is why
``top_k`` together with ``top_p`` ran. With no rows there is nothing to constrain: the patch returns them as
they are.

``expand_batch_to_tokens`` (CPU only):

vLLM's rejection sampler expands per-request sampling parameters (temperature, top-k, top-p) to one value per
draft token with ``expand_batch_to_tokens``. On CPU the Triton kernel behind it is replaced by
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands the C++ kernel ``output.to(torch.int64)``, a
*copy* for the int32 and float32 tensors it is given, and never copies the result back (its siblings
``_rejection_random_sample_kernel_impl`` and ``_sample_recovered_tokens_kernel_impl`` do). The expanded tensor
is therefore uninitialised memory, and the float parameters were truncated to integers on the way in: as soon as
a request samples (temperature > 0) with draft tokens in the batch, vLLM scales the target's logits by garbage
temperatures, and with ``top_k`` set it indexes out of bounds and the engine dies (seen with
``{"temperature": 0.8, "top_k": 50}``; ``tests/test_lossless.py`` runs that case).

The replacement computes the same thing with ``torch.repeat_interleave``. It runs only on CPU; GPUs keep the
Triton kernel.

``RejectionSampler.forward`` (entmtp's runners only, every platform): for a batch in which every request is
greedy and nothing but the argmax is asked of the logits (no logprobs, penalties, bad words, allowed-token mask,
active ``logit_bias`` or ``min_tokens``, thinking budget, draft probabilities or synthetic acceptance), vLLM's path
copies the bonus rows twice (an indexed copy, then a clone for raw-logit logprobs nobody reads) and the draft-token
rows twice, each ``[rows, vocab]``, before taking the argmaxes (the draft-token rows' with torch's argmax, on CPU
several times slower than vLLM's own greedy kernel). :func:`greedy_verify` takes vLLM's greedy argmax once over
all rows (of float32 logits, as vLLM's sampler does: one exact copy where the model serves bfloat16) and hands
vLLM's own greedy acceptance kernel the same inputs, so the output is the same tensor; any other batch runs vLLM's
forward. Measured: ``benchmarks/results/step-profile-2026-12-02b/``.
"""
from __future__ import annotations

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """``x[b]`` repeated for each of request ``b``'s tokens, with ``replace_from`` values turned into
    ``replace_to`` (vLLM's contract: ``x = [a, b, c]``, ``cu_num_tokens = [2, 5, 6]`` -> ``[a, a, b, b, b, c]``).

    Args:
        x: ``[batch]``, any dtype.
        cu_num_tokens: ``[batch]`` integer, cumulative token counts (the last one is ``num_tokens``).
        num_tokens: total number of tokens.

    Returns:
        ``[num_tokens]`` tensor of ``x``'s dtype and device.

    Raises:
        ValueError: ``cu_num_tokens`` does not match ``x`` or does not end at ``num_tokens``.
    """
    if cu_num_tokens.shape != x.shape:
        raise ValueError(f"cu_num_tokens {tuple(cu_num_tokens.shape)} does not match x {tuple(x.shape)}")
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    if int(counts.sum()) != num_tokens:
        raise ValueError(f"cu_num_tokens ends at {int(counts.sum())}, not at num_tokens={num_tokens}")
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = out.masked_fill(out == replace_from, replace_to)
    return out


def constraints_skipping_empty(orig):
    """vLLM's ``apply_sampling_constraints``, returning a batch with no draft-token rows unchanged."""

    def apply_sampling_constraints(logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return orig(logits, cu_num_draft_tokens, sampling_metadata)

    apply_sampling_constraints.__wrapped__ = orig
    return apply_sampling_constraints


#: Set on a runner's ``RejectionSampler`` (by the runner patch, for entmtp) to let it take :func:`greedy_verify`.
GREEDY_FAST_PATH_ATTR = "_entmtp_greedy_fast_path"


def argmax_only(sampling_metadata) -> bool:
    """Whether sampling this batch is the argmax of the raw logits, row by row, and nothing else is read: all
    requests greedy, no logprobs, no penalties, bad words or allowed-token mask, no thinking budget, and vLLM's
    argmax-changing processors idle (``logit_bias`` and ``min_tokens`` with no request using them; any other
    such processor counts as active)."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    sm = sampling_metadata
    if not sm.all_greedy or sm.max_num_logprobs is not None or sm.logprob_token_ids or not sm.no_penalties \
            or sm.allowed_token_ids_mask is not None or sm.bad_words_token_ids:
        return False
    holder = sm.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    for proc in sm.logitsprocs.non_argmax_invariant:
        if isinstance(proc, LogitBiasLogitsProcessor) and not proc.biases:
            continue
        if isinstance(proc, MinTokensLogitsProcessor) and not proc.min_toks:
            continue
        return False
    return True


def greedy_verify(metadata, logits: torch.Tensor):
    """vLLM's all-greedy rejection sampling without vLLM's copies of the logits (float32 ones are not copied):
    ``logits`` ``[draft tokens + requests, vocab]`` as vLLM's ``RejectionSampler.forward`` takes them; returns its
    ``SamplerOutput`` (``[requests, max_spec_len + 1]`` int32, placeholders after a request's accepted tokens and
    bonus token)."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.sampler import Sampler

    # vLLM's greedy argmax (on CPU its own kernel, several times faster than torch's there), row by row over all
    # rows: the bonus rows' tokens are vLLM's; on the draft-token rows vLLM takes torch's argmax, which picks the
    # same index, ties included (the first maximum; tests/test_patches_sampler.py)
    # vLLM takes both argmaxes over float32 logits (its CPU kernel accepts nothing else); from bfloat16 or float16
    # the cast is exact, so the indices are those of the served dtype's logits
    argmax = Sampler.greedy_sample(logits.float()).long()
    bonus = argmax[metadata.bonus_logits_indices].to(torch.int32).unsqueeze(-1)  # as vLLM's Sampler returns it
    out = torch.full((len(metadata.num_draft_tokens), metadata.max_spec_len + 1), rs.PLACEHOLDER_TOKEN_ID,
                     dtype=torch.int32, device=logits.device)
    rs._rejection_greedy_sample(out, metadata.cu_num_draft_tokens, metadata.draft_token_ids,
                                argmax[metadata.target_logits_indices], bonus, None, metadata.max_spec_len, None,
                                None)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def forward_with_greedy_fast_path(orig):
    """``RejectionSampler.forward`` that takes :func:`greedy_verify` where the sampler is marked
    (:data:`GREEDY_FAST_PATH_ATTR`) and the batch asks for nothing but argmaxes (:func:`argmax_only`)."""

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if getattr(self, GREEDY_FAST_PATH_ATTR, False) and draft_probs is None and not self.synthetic_mode \
                and argmax_only(sampling_metadata):
            return greedy_verify(metadata, logits)
        return orig(self, metadata, draft_probs, logits, sampling_metadata)

    forward.__wrapped__ = orig
    return forward


def apply() -> None:
    from vllm.platforms import current_platform

    import vllm.v1.sample.rejection_sampler as rs

    if getattr(rs, "_entmtp_patched", False):
        return
    rs.apply_sampling_constraints = constraints_skipping_empty(rs.apply_sampling_constraints)
    rs.RejectionSampler.forward = forward_with_greedy_fast_path(rs.RejectionSampler.forward)
    if current_platform.is_cpu():
        rs.expand_batch_to_tokens = expand_batch_to_tokens
    rs._entmtp_patched = True
