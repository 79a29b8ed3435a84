"""Acceptance of a draft tree against the target's outputs at every tree position (torch only).

Layout shared by all functions: a request's tree has ``N`` draft nodes numbered 1..N in canonical order
(``vllm_entmtp.trees``), node 0 is the root (the last accepted token); ``draft_tokens[j - 1]`` is node j's
token, ``parents[j - 1]`` its parent (``< j``). The target ran one forward over ``[root] + drafts`` with the
tree attention mask, so row ``i`` of its output (``i`` = 0..N) is the target's next-token distribution after
the path root -> ... -> node ``i``.

- ``greedy_accept``: temperature 0; the target's argmax decides (Medusa's greedy tree verification,
  ``evaluate_posterior`` in ``medusa/model/utils.py``, walked from the root instead of over leaf paths).
- ``tree_rejection_sample``: temperature > 0, lossless: the emitted tokens are distributed exactly as if the
  target had sampled them one by one. Multi-step speculative sampling of SpecInfer (Miao et al., ASPLOS 2024,
  arXiv 2305.09781, section 4.2) with deterministic (one-hot) drafts, which is sampling without replacement among
  siblings (as Sequoia's verification, Chen et al. 2024, arXiv 2402.12374).
- ``apply_sampling_params``: the target's logits -> the distribution vLLM samples from (temperature, top-k,
  top-p as in ``vllm/v1/sample/ops/topk_topp_sampler.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_entmtp.trees import children_lists

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM ``sampling_params._SAMPLING_EPS``)."""
MIN_TEMPERATURE = 1e-2
"""Positive temperatures below this are raised to it (vLLM ``sampling_params._MAX_TEMP``)."""


def _check_tree(draft_tokens: Sequence[int], parents: Sequence[int]) -> None:
    if len(draft_tokens) != len(parents):
        raise ValueError(f"{len(draft_tokens)} draft tokens but {len(parents)} parents")
    for j, p in enumerate(parents, start=1):
        if not 0 <= p < j:
            raise ValueError(f"parents[{j - 1}] = {p}: node {j}'s parent must be in 0..{j - 1} (parents come first)")


def greedy_accept(draft_tokens: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Longest tree path the target's greedy choices agree with.

    Args:
        draft_tokens: ``N`` token ids, node order.
        parents: ``N`` parent indices (0 = root), each smaller than its node's index.
        target_argmax: ``N + 1`` token ids; entry ``i`` is the target's argmax at row ``i`` (0 = root).

    Returns:
        The accepted node indices (1-based) from the root down. From the current node (start: root), the
        first child in node order whose token equals ``target_argmax[current]`` is taken; the walk stops
        when no child matches (so of duplicate siblings only the first is ever taken). The token to emit
        after them (the target's own, "bonus" or correction) is ``target_argmax[accepted[-1] if accepted
        else 0]``.

    Raises:
        ValueError: inconsistent lengths or a parent index not smaller than its node's.
    """
    _check_tree(draft_tokens, parents)
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"target_argmax needs {len(draft_tokens) + 1} entries (root + one per node), "
                         f"got {len(target_argmax)}")
    children = children_lists(parents)
    accepted: list[int] = []
    node = 0
    while True:
        want = target_argmax[node]
        nxt = next((c for c in children[node] if draft_tokens[c - 1] == want), None)
        if nxt is None:
            return accepted
        accepted.append(nxt)
        node = nxt


def tree_rejection_sample(draft_tokens: Sequence[int], parents: Sequence[int], target_probs: torch.Tensor,
                          generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless recursive rejection sampling of a tree of deterministic drafts.

    At the current node (start: root) the residual ``p`` is the node's row of ``target_probs``. Each child
    ``c`` in node order, with token ``x``, is accepted with probability ``p(x) / sum(p)``; on acceptance the
    walk moves to ``c`` and ``p`` becomes ``c``'s row; on rejection ``p(x)`` is set to 0 (a duplicate sibling
    of a rejected token then has ``p(x) = 0`` and is rejected). When no child is accepted (or the node is a
    leaf) the next token is drawn from the residual ``p``: the bonus token when nothing at that node was
    rejected, else the recovered token. With ``target_probs`` one-hot (greedy) this equals ``greedy_accept``.

    Args:
        draft_tokens: ``N`` token ids in ``[0, V)``, node order.
        parents: ``N`` parent indices (0 = root), each smaller than its node's index.
        target_probs: ``[N + 1, V]`` float (float32 expected; rows need not sum exactly to 1, sums are taken
            in float64): row ``i`` is the target's sampling distribution after node ``i``, already processed
            by temperature/top-k/top-p (``apply_sampling_params``).
        generator: source of randomness on ``target_probs.device`` (None: torch's default generator).
            ``num_nodes + 1`` float64 uniforms are drawn up front, in one call: one per node for its
            acceptance test, the last for the inverse-CDF draw of the next token.

    Returns:
        ``(accepted, next_token)``: accepted node indices (1-based, root to deepest) and the token emitted
        after them. The emitted sequence is ``[draft_tokens[j - 1] for j in accepted] + [next_token]``.

    Raises:
        ValueError: inconsistent shapes, a parent index not smaller than its node's, a token outside the
            vocabulary, or a row visited with a negative/non-finite entry or zero total mass.
    """
    _check_tree(draft_tokens, parents)
    n = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be [num_nodes + 1, V] = [{n + 1}, V], got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    for j, t in enumerate(draft_tokens, start=1):
        if not 0 <= t < vocab:
            raise ValueError(f"draft token of node {j} is {t}, outside the vocabulary [0, {vocab})")
    children = children_lists(parents)
    device = target_probs.device
    # One uniform per node for its acceptance test (each node is tested at most once), one for the final draw.
    uniforms = torch.rand(n + 1, generator=generator, device=device, dtype=torch.float64).tolist()

    # One host sync for the whole walk: each node's probability under its parent's row, and every row's total
    # and minimum (a gather and two reductions over [N + 1, V], on target_probs' device).
    flat = torch.tensor([p * vocab + t for p, t in zip(parents, draft_tokens)], dtype=torch.long, device=device)
    stats = torch.cat([target_probs.reshape(-1)[flat].to(torch.float64),
                       target_probs.sum(dim=1, dtype=torch.float64),
                       target_probs.amin(dim=1).to(torch.float64)]).tolist()
    node_prob, totals, lows = stats[:n], stats[n:2 * n + 1], stats[2 * n + 1:]

    accepted: list[int] = []
    node = 0
    while True:
        total, low = totals[node], lows[node]
        if not (0.0 < total < float("inf") and low >= 0.0):
            raise ValueError(f"target_probs row {node} is not a distribution (sum {total}, min {low})")
        rejected: list[int] = []
        last_with_mass = -1  # the last rejected token of positive probability
        moved = False
        for c in children[node]:
            x, px = draft_tokens[c - 1], node_prob[c - 1]
            if x in rejected:
                continue  # p(x) is already 0: rejected with certainty
            if px > 0.0 and uniforms[c - 1] * total < px:
                accepted.append(c)
                node = c
                moved = True
                break
            rejected.append(x)
            if px > 0.0:
                last_with_mass = x
            total -= px
        if not moved:
            nxt = _draw(target_probs[node], rejected, uniforms[n])
            # None: the rejected tokens held all of the row's mass, so in exact arithmetic the last of them with
            # positive probability would have been accepted with certainty; only float round-off gets here.
            return accepted, last_with_mass if nxt is None else nxt


def _draw(row: torch.Tensor, zeroed: list[int], u: float) -> int | None:
    """Inverse-CDF draw from ``row`` ([V] float, >= 0) with the entries ``zeroed`` set to 0, given ``u`` in
    [0, 1); never a token of zero mass. None if nothing is left (all mass in ``zeroed``)."""
    if zeroed:
        row = row.clone()
        row[zeroed] = 0.0
    cdf = torch.cumsum(row, dim=0, dtype=torch.float64)  # [V]
    top = cdf[-1:]
    # First token whose cdf exceeds u * total; capped at the last token of positive mass (float round-off).
    idx = torch.minimum(torch.searchsorted(cdf, top * u, right=True), torch.searchsorted(cdf, top, right=False))
    i, mass = torch.cat([idx.to(torch.float64), top]).tolist()
    return int(i) if mass > 0.0 else None


def apply_sampling_params(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                          top_p: float | None = None) -> torch.Tensor:
    """The distribution vLLM samples from, for one request's logits.

    Follows vLLM 0.32: ``temperature < 1e-5`` is greedy (a one-hot at the argmax, first index on ties), a
    positive temperature below ``1e-2`` is raised to ``1e-2`` (``SamplingParams.__post_init__``); logits are
    divided by the temperature, then top-k keeps every logit ``>=`` the k-th largest (ties kept), then top-p
    drops the tokens whose ascending cumulative probability is ``<= 1 - top_p`` but always keeps the most
    likely one (``apply_top_k_top_p_pytorch`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``), then softmax.

    Args:
        logits: ``[N, V]`` float (computed in float32; not modified).
        temperature: ``>= 0``.
        top_k: ``None`` or ``<= 0`` or ``>= V``: off.
        top_p: ``None`` or ``>= 1``: off; else in ``(0, 1)``.

    Returns:
        ``[N, V]`` float32 probabilities, rows summing to 1.

    Raises:
        ValueError: a negative or non-finite temperature, ``top_p <= 0``, or ``logits`` not 2-D.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    t = float(temperature)
    if not t >= 0.0 or t == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_p is not None and not float(top_p) > 0.0:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p!r}")
    x = logits.to(torch.float32)
    vocab = x.shape[1]
    if t < SAMPLING_EPS:
        out = torch.zeros_like(x)
        out.scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)
        return out
    x = x / max(t, MIN_TEMPERATURE)
    use_k = top_k is not None and 0 < int(top_k) < vocab
    use_p = top_p is not None and float(top_p) < 1.0
    if use_k or use_p:
        # Same steps as vLLM, in its order, on one ascending sort (so that exact ties fall the same way).
        srt, idx = x.sort(dim=1, descending=False)
        if use_k:
            srt = srt.masked_fill(srt < srt[:, vocab - int(top_k)].unsqueeze(1), float("-inf"))
        if use_p:
            drop = srt.softmax(dim=1).cumsum(dim=1) <= 1.0 - float(top_p)
            drop[:, -1] = False
            srt = srt.masked_fill(drop, float("-inf"))
        x = x.scatter(1, idx, srt)
    return x.softmax(dim=1)
