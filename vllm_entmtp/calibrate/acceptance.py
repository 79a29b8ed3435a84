"""Expected accepted draft tokens of a tree from a rank table, and the greedy tree search.

A bin's table ``P[d][r]`` is the share of positions where head ``d``'s rank-``r`` token is the true one. Under the
independence assumption of Medusa's tree search a node ``(r_0, ..., r_d)`` is accepted with probability
``prod_i P[i][r_i]`` and a tree's expected accepted draft tokens are the sum over its nodes; growing a tree one
node at a time by that probability gives one nested tree per node budget (Medusa, Cai et al. 2024, section
2.3.3). Plain Python on lists of floats.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

Path_ = tuple[int, ...]


def _check_table(P: Sequence[Sequence[float]]) -> tuple[int, int]:
    if not P or not P[0]:
        raise ValueError("P must be a non-empty [heads][ranks] table")
    width = len(P[0])
    for d, row in enumerate(P):
        if len(row) != width:
            raise ValueError(f"P[{d}] has {len(row)} ranks, P[0] has {width}: rows must be equally long")
        for r, x in enumerate(row):
            if not (isinstance(x, (int, float)) and 0.0 <= x <= 1.0):
                raise ValueError(f"P[{d}][{r}] = {x!r} is not a probability in [0, 1]")
    return len(P), width


def node_probability(path: Sequence[int], P: Sequence[Sequence[float]]) -> float:
    """Probability that node ``path = (r_0, ..., r_d)`` is accepted: ``prod_i P[i][r_i]``.

    Args:
        path: top-k ranks, one per head (as in a tree-set file).
        P: ``[heads][ranks]`` floats; ``P[i][r]`` is the share of positions where the true token is head ``i``'s
            rank-``r`` token (given, for Hydra heads, that the path up to it is right).

    Returns:
        A float in [0, 1]; 0 for a path deeper than ``P`` or with a rank outside it (a "miss").

    A node is accepted iff its own token and every ancestor's is the target's token; taking the depths as
    independent is the assumption of Medusa's tree search (Cai et al. 2024, section 2.3.3) and Hydra's.
    """
    p = 1.0
    for d, r in enumerate(path):
        if d >= len(P) or r >= len(P[d]):
            return 0.0
        p *= P[d][r]
    return p


def expected_accepted(paths: Sequence[Sequence[int]], P: Sequence[Sequence[float]]) -> float:
    """Expected accepted draft tokens per step of the tree ``paths``: ``sum over nodes of node_probability``.

    Exactly one rank is right per depth, so siblings exclude each other and the accepted nodes form one path
    from the root; its expected length is the sum of the nodes' acceptance probabilities. The bonus token is
    not included: expected tokens per step = ``1 + expected_accepted``.
    """
    return sum(node_probability(p, P) for p in paths)


def greedy_tree(P: Sequence[Sequence[float]], max_nodes: int, max_depth: int | None = None
                ) -> list[tuple[Path_, float]]:
    """Grow a tree one node at a time, always adding the frontier node of largest acceptance probability.

    The frontier holds the children of the root and of the nodes added so far whose left sibling (rank
    ``r - 1`` under the same parent) is present, so every tree has its left siblings. Ties go to the node
    first in canonical order (shorter, then lexicographically smaller). Nodes of probability 0 are added too
    (after every positive one), so the result has ``max_nodes`` nodes unless the ``[depth][rank]`` grid runs
    out. Medusa's greedy search (``explore_graph`` in FasterDecoding/Medusa ``medusa/eval/gen_results.py``;
    Cai et al. 2024, section 2.3.3); Sequoia (Chen et al. 2024) shows it is optimal among trees with the left
    sibling property under a positional acceptance model.

    Args:
        P: ``[heads][ranks]`` acceptance table (see :func:`node_probability`).
        max_nodes: nodes to add, >= 1.
        max_depth: deepest path (default: ``len(P)``, one rank per head).

    Returns:
        ``(path, probability)`` in adding order. Every prefix is a tree (nested trees: the ``n``-node tree is
        the first ``n`` entries), and each probability is at most its parent's.
    """
    heads, width = _check_table(P)
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
    depth = heads if max_depth is None else min(max_depth, heads)
    if depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth!r}")
    value: dict[Path_, float] = {(): 1.0}
    heap: list[tuple[float, int, Path_]] = [(-float(P[0][0]), 1, (0,))]
    out: list[tuple[Path_, float]] = []
    while heap and len(out) < max_nodes:
        neg, _, path = heapq.heappop(heap)
        value[path] = -neg
        out.append((path, -neg))
        d, r = len(path) - 1, path[-1]
        if r + 1 < width:  # right sibling: its left sibling (this node) is now present
            sib = path[:-1] + (r + 1,)
            heapq.heappush(heap, (-value[path[:-1]] * P[d][r + 1], len(sib), sib))
        if len(path) < depth:  # first child
            heapq.heappush(heap, (-value[path] * P[d + 1][0], len(path) + 1, path + (0,)))
    return out
