"""The prompt lookup's calibration: how the lookup draft source (:mod:`vllm_entmtp.lookup`) would have drafted on
the calibration prompts, position by position, and the per-token acceptance probability a request starts with
(``lookup_prior`` when the user does not give one).

At every generated position ``t`` of a prompt's greedy continuation, the lookup runs over the prompt and the
tokens before ``t`` (what the request holds there) and its draft is scored against the tokens the target then
emitted: drafted tokens count as accepted up to the first that differs (a rejection); a draft that runs past the
continuation's end is cut there, with no rejection seen (:func:`~vllm_entmtp.lookup.score_draft`, as the
runtime scores the lookup drafts it did not send). The acceptance probability is the estimator the
runtime's per-request record uses (:meth:`~vllm_entmtp.lookup.PromptLookup.acceptance_probability`): accepted
tokens over accepted tokens plus rejections, the maximum-likelihood ``p`` of chains accepted token by token with
probability ``p`` until the first rejection.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PRIOR_RANGE = (0.02, 0.98)  # a prior must be inside (0, 1) (PromptLookup refuses 0 and 1)


def lookup_statistics(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], min_n: int, max_n: int,
                      max_tokens: int) -> dict:
    """The lookup's statistics over ``(prompt ids, generated ids)`` pairs.

    Returns:
        ``{"prompt_lookup_min", "prompt_lookup_max", "max_tokens", "positions", "drafts", "coverage" (drafts per
        position), "drafted_tokens", "accepted_tokens", "rejections", "mean_accepted" (accepted draft tokens per
        draft, bonus excluded; None without drafts), "acceptance_probability" (None without drafts), "prior"
        (the acceptance probability clipped to :data:`PRIOR_RANGE`; None without drafts)}``.
    """
    from vllm_entmtp.lookup import PromptLookup, score_draft

    lk = PromptLookup(min_n, max_n, max_tokens=max_tokens)
    positions = drafts = drafted = accepted = rejections = 0
    for prompt, generated in sequences:
        ctx = np.asarray([*prompt, *generated], dtype=np.int32)
        p, gen = len(prompt), list(generated)
        for t in range(len(gen)):
            positions += 1
            draft = lk.propose(ctx[:p + t])
            if not draft:
                continue
            m, rejected = score_draft(draft, gen[t:t + len(draft)])
            drafts += 1
            drafted += len(draft)
            accepted += m
            rejections += 1 if rejected else 0
    prob = accepted / (accepted + rejections) if accepted + rejections else None
    lo, hi = PRIOR_RANGE
    return {"prompt_lookup_min": min_n, "prompt_lookup_max": max_n, "max_tokens": max_tokens,
            "positions": positions, "drafts": drafts, "coverage": round(drafts / positions, 4) if positions else 0.0,
            "drafted_tokens": drafted, "accepted_tokens": accepted, "rejections": rejections,
            "mean_accepted": round(accepted / drafts, 4) if drafts else None,
            "acceptance_probability": None if prob is None else round(prob, 4),
            "prior": None if prob is None else round(min(max(prob, lo), hi), 4)}
