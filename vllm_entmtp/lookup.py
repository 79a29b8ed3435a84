"""Prompt lookup, entmtp's second draft source: per request, the tokens that followed the longest earlier match
of its last n tokens in its own prompt and output (as vLLM's ``ngram`` method: ``prompt_lookup_min`` <= n <=
``prompt_lookup_max``; among the longest matches the latest, where vLLM takes the earliest), and a per-request
record of how such drafts fare, from which the drafter weighs them against the MTP heads'
(:meth:`PromptLookup.expected`).

A lookup draft is a chain: it costs no forward of the heads, and it is verified like the heads' chains (greedy:
vLLM; sampling: :func:`vllm_entmtp.verify.tree_rejection_sample`, which treats every draft as one-hot, so a
lookup draft is verified losslessly too).

Expected accepted tokens: each drafted token is taken to be accepted with one per-request probability ``p``
(the tokens after a rejection are not), so a chain of ``n`` drafted tokens accepts
``p (1 - p^n) / (1 - p)`` on average. ``p`` is estimated from the request's lookup drafts as accepted tokens over
accepted tokens plus rejections (sums decayed over about ``window`` drafts), starting from a prior ``prior``
worth one rejection's observations. Every lookup draft counts, drafted or not: one that was not drafted (the
heads' draft was preferred) is scored against the tokens the target emitted next (:meth:`PromptLookup.
score_unsent`), so that the record follows the text even while the heads draft.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from vllm_entmtp.lifetimes import drop_missing

#: vLLM ngram's defaults when a user gives neither key are 5/5; entmtp's (a chain after any 2-4 token repeat)
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 4


def _latest_longest_match_py(tokens: np.ndarray, min_n: int, max_n: int) -> int:
    """Where the draft starts: after the latest earlier occurrence of the longest suffix of ``tokens`` of
    ``min_n`` to ``max_n`` tokens (-1: none). vLLM's ``ngram`` takes the earliest occurrence among the longest;
    the latest one is what a request that repeats its own output (lines, list items, code) goes on with, where
    the earliest is often the prompt's wording of it."""
    total = tokens.shape[0]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for pos in range(total - n - 1, -1, -1):  # the suffix itself starts at total - n
            j = 0
            while j < n and tokens[pos + j] == tokens[total - n + j]:
                j += 1
            if j == n:
                return pos + n
    return -1


def _latest_longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> int:
    """:func:`_latest_longest_match_py` by a byte search: the tokens as 4-byte integers, each suffix searched
    from the right with ``bytes.rfind`` (a hit that does not start on a token's first byte is skipped). Not
    numba, which vLLM's own ngram kernel uses: loading it (llvmlite) in the worker cost 164 MiB of resident
    memory (the worker's smaps, served, 2026-12-05: llvmlite's library 83 MiB, anonymous memory and heap 76 MiB
    more than plain decoding's worker), 4 % of the server's peak, where the memory target is 10 %."""
    total = tokens.shape[0]
    data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = data[(total - n) * 4:]
        end = (total - 1) * 4  # an earlier occurrence ends before the last token
        while (i := data.rfind(suffix, 0, end)) >= 0:
            if i % 4 == 0:
                return i // 4 + n
            end = i + len(suffix) - 1  # not on a token boundary: look further left
    return -1


def expected_chain_accepted(p: float, n: int) -> float:
    """Expected accepted tokens of an ``n``-token chain whose tokens are each accepted with probability ``p``
    until the first rejection."""
    if n <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(n)
    return p * (1.0 - p ** n) / (1.0 - p)


def calibrated_prior(option_prior: float, given: bool, calibration: dict, min_n: int, max_n: int
                     ) -> tuple[float, str]:
    """``(prior, where it comes from)``: the ``lookup_prior`` the user gave; else the tree set's ``build-trees``
    calibration of the lookup (``calibration["lookup"]``, :mod:`vllm_entmtp.calibrate.lookup`) when it matched the
    same n-gram lengths; else the option's default."""
    if given:
        return option_prior, "lookup_prior"
    cal = calibration.get("lookup") or {}
    if cal.get("prior") is not None and (cal.get("prompt_lookup_min"), cal.get("prompt_lookup_max")) == (min_n, max_n):
        return float(cal["prior"]), f"the tree set's calibration on {calibration.get('prompts', 'its prompts')}"
    return option_prior, "default"


def score_draft(draft: Sequence[int], emitted: Sequence[int]) -> tuple[int, bool]:
    """``(accepted, rejected)`` of a draft scored against the tokens the target emitted from its position on: its
    tokens count as accepted while they equal the emitted ones; a mismatch is a rejection; a draft longer than
    what was emitted is cut there (no rejection seen)."""
    m = 0
    while m < len(emitted) and int(emitted[m]) == draft[m]:
        m += 1
    return m, m < len(emitted)


class PromptLookup:
    """N-gram prompt lookup over each request's tokens, with a per-request acceptance record.

    Args:
        min_n, max_n: the n-gram lengths matched (vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max``).
        max_tokens: the most tokens one lookup draft proposes.
        prior: a request's acceptance probability per drafted token before it has verified lookup drafts.
        window: window of the per-request EMAs (drafts).
    """

    def __init__(self, min_n: int = DEFAULT_LOOKUP_MIN, max_n: int = DEFAULT_LOOKUP_MAX, max_tokens: int = 4,
                 prior: float = 0.5, window: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        if max_tokens < 1:
            raise ValueError(f"prompt lookup: max_tokens must be >= 1, got {max_tokens}")
        if not 0.0 < prior < 1.0:
            raise ValueError(f"prompt lookup: prior must be in (0, 1), got {prior}")
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.prior = prior
        self._beta = 1.0 - 1.0 / window
        self._record: dict[str, list[float]] = {}  # request -> [decayed accepted tokens, decayed rejections]
        self._unsent: dict[str, tuple[list[int], int]] = {}  # request -> (lookup draft not drafted, its position)

    def propose(self, tokens: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """The draft after the longest earlier match of ``tokens``' last n tokens (none found: ``[]``)."""
        k = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        if k <= 0 or tokens.shape[0] <= self.min_n:
            return []
        start = _latest_longest_match(tokens, self.min_n, self.max_n)
        return tokens[start:start + k].tolist() if start >= 0 else []

    def propose_batch(self, token_ids: np.ndarray, num_tokens: Sequence[int], rows: Iterable[int],
                      budgets: Sequence[int]) -> dict[int, list[int]]:
        """Drafts for batch rows ``rows`` of ``token_ids`` (``[max_reqs, max_model_len]``, a row's first
        ``num_tokens[row]`` tokens are its prompt and output), at most ``budgets[row]`` tokens each."""
        out = {}
        for b in rows:
            d = self.propose(token_ids[b, :int(num_tokens[b])], budgets[b])
            if d:
                out[b] = d
        return out

    def acceptance_probability(self, req_id: str) -> float:
        """The request's estimated per-token acceptance probability of lookup drafts."""
        a, r = self._record.get(req_id) or self._prior_record()
        return a / (a + r)

    def _prior_record(self) -> list[float]:
        # the prior as one rejection's worth of observations: p / (1 - p) accepted tokens per rejection
        return [self.prior / (1.0 - self.prior), 1.0]

    def expected(self, req_id: str, n: int) -> float:
        """Expected accepted tokens of an ``n``-token lookup draft of ``req_id``."""
        return expected_chain_accepted(self.acceptance_probability(req_id), n)

    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        """A verified lookup draft of ``req_id``: ``drafted`` tokens, ``accepted`` of them (bonus excluded).
        Decayed sums (factor ``1 - 1/window`` per draft) of accepted tokens and of rejections; the prior decays
        with them."""
        st = self._record.setdefault(req_id, self._prior_record())
        b = self._beta
        st[0] = b * st[0] + accepted
        st[1] = b * st[1] + (1.0 if accepted < drafted else 0.0)

    def remember(self, req_id: str, draft: list[int], num_tokens: int) -> None:
        """A lookup draft of ``req_id`` that was not drafted (the heads' was, or none), proposed when the request
        had ``num_tokens`` tokens: :meth:`score_unsent` scores it against what the target then emitted."""
        self._unsent[req_id] = (draft, num_tokens)

    def forget_unsent(self, req_id: str) -> None:
        """``req_id``'s lookup draft remembered this step was drafted after all (weighed again): its verification
        scores it, not :meth:`score_unsent`."""
        self._unsent.pop(req_id, None)

    def score_unsent(self, req_id: str, tokens: np.ndarray) -> None:
        """Score ``req_id``'s remembered lookup draft against ``tokens`` (its prompt and output now) as if it had
        been verified: a draft token counts as accepted while it equals the token the target emitted there (for
        a sampled token as for a greedy one: a one-hot draft token ``x`` is accepted with probability ``p(x)``,
        the probability that the target samples ``x``). A mismatch is a rejection; a draft longer than what the
        target emitted since is cut there (no rejection seen)."""
        unsent = self._unsent.pop(req_id, None)
        if unsent is None:
            return
        draft, start = unsent
        emitted = tokens[start:start + len(draft)]
        if len(emitted) == 0:
            return
        m, rejected = score_draft(draft, emitted)
        self.observe(req_id, m + (1 if rejected else 0), m)

    def free_missing(self, live: set | dict) -> None:
        drop_missing(self._record, live)
        drop_missing(self._unsent, live)

    def tracked_ids(self) -> set[str]:
        return set(self._record) | set(self._unsent)


#: :class:`LookupRests`: steps in a row at a batch size whose lookup drafts the load rule all declined, after which
#: the search runs only every :data:`LOOKUP_REST_EVERY` steps there
LOOKUP_REST_AFTER = 8
LOOKUP_REST_EVERY = 8


class LookupRests:
    """Whether prompt lookup searches in a step, per batch size, under the measured load rule.

    The search and its weighing run in every step that does not rest (served at 32 running, a few tenths of a ms of
    a 50-80 ms step), also where the load rule then declines every draft it found: in-process at 32 running on
    HumanEval (2026-12-05, EPYC), 25-31 requests a step had a lookup draft and no step took one over dozens of
    steps. After :data:`LOOKUP_REST_AFTER` such steps in a row at a batch size, the search runs every
    :data:`LOOKUP_REST_EVERY` steps there (their drafts are weighed as usual, and the requests' lookup records go
    on learning from them), until a step takes a lookup draft again. Steps whose search found nothing do not
    count either way.
    """

    def __init__(self, after: int = LOOKUP_REST_AFTER, every: int = LOOKUP_REST_EVERY):
        if after < 1 or every < 1:
            raise ValueError(f"LookupRests needs after >= 1 and every >= 1, got {after}, {every}")
        self.after, self.every = after, every
        self._declined: dict[int, int] = {}  # batch size -> steps in a row whose lookup drafts were all declined
        self._waited: dict[int, int] = {}  # batch size -> steps without a search since the last one, while resting
        self.rested = 0  # steps that did not search (for the log)

    def searches(self, batch_size: int) -> bool:
        """Whether this step at ``batch_size`` requests searches; counts the step when it does not."""
        if self._declined.get(batch_size, 0) < self.after:
            return True
        waited = self._waited.get(batch_size, 0) + 1
        if waited >= self.every:
            self._waited[batch_size] = 0
            return True
        self._waited[batch_size] = waited
        self.rested += 1
        return False

    def record(self, batch_size: int, found: bool, taken: bool) -> None:
        """A step at ``batch_size`` searched: whether it ``found`` any lookup draft and whether the step ``taken``
        one (drafted it)."""
        if taken:
            self._declined[batch_size] = 0
            self._waited[batch_size] = 0
        elif found:
            self._declined[batch_size] = self._declined.get(batch_size, 0) + 1
