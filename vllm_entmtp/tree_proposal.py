"""Draft tokens of per-request trees from the heads' top-k tokens (torch only).

With Medusa heads every head reads only the target's hidden state at the last accepted position, so the token
of a node depends on its depth and rank alone: node ``(r0, ..., rd)`` carries head ``d``'s rank-``rd`` token,
whatever its ancestors are (Cai et al. 2024, arXiv 2401.10774, section 2.1.2; Medusa's ``tree_indices`` in
``generate_medusa_buffers``, ``medusa/model/utils.py``, index the same flat top-k candidates). Hydra heads,
whose proposals depend on the path, will need a different builder.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_entmtp.trees import Tree


def needed_topk(trees: Sequence[Tree | None]) -> int:
    """The ``K`` of the top-k the heads must produce for these trees: 1 + the largest rank; 0 if all are None."""
    return max((max(t.max_rank_per_depth) + 1 for t in trees if t is not None), default=0)


def needed_heads(trees: Sequence[Tree | None]) -> int:
    """How many heads these trees use: the largest depth; 0 if all are None."""
    return max((t.depth for t in trees if t is not None), default=0)


def build_tree_drafts(topk_ids: torch.Tensor, trees: Sequence[Tree | None]) -> list[list[int]]:
    """Per-request draft tokens, one per tree node, in the tree's canonical node order.

    Args:
        topk_ids: ``[num_heads, B, K]`` int64 (any integer dtype, any device): ``topk_ids[d, b, r]`` is head
            ``d``'s rank-``r`` token for request ``b``.
        trees: ``B`` entries, the tree of each request, or None for a request that drafts nothing.

    Returns:
        ``B`` lists; list ``b`` has ``trees[b].num_nodes`` token ids (node ``j`` at index ``j - 1``; its token is
        ``topk_ids[len(path) - 1, b, path[-1]]``), or ``[]`` for None. One device-to-host copy in all.

    Raises:
        ValueError: ``topk_ids`` is not 3-D integer, ``len(trees) != B``, or a tree is deeper than
            ``num_heads`` or uses a rank ``>= K`` (naming the request and the tree's needs).
    """
    if topk_ids.dim() != 3 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor [num_heads, B, K], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    num_heads, b, k = topk_ids.shape
    if len(trees) != b:
        raise ValueError(f"topk_ids has B={b} requests but {len(trees)} trees were given")
    flat_index: list[int] = []
    sizes: list[int] = []
    for i, t in enumerate(trees):
        if t is None:
            sizes.append(0)
            continue
        if t.depth > num_heads:
            raise ValueError(f"request {i}: its tree has depth {t.depth} but topk_ids has only {num_heads} heads")
        if max(t.max_rank_per_depth) >= k:
            raise ValueError(f"request {i}: its tree uses rank {max(t.max_rank_per_depth)} but topk_ids has only "
                             f"top-{k}; ask the heads for needed_topk(trees) = {needed_topk(trees)}")
        base = i * k
        flat_index.extend((d - 1) * b * k + base + r for d, r in zip(t.depths, t.ranks))
        sizes.append(t.num_nodes)
    if not flat_index:
        return [[] for _ in trees]
    idx = torch.tensor(flat_index, dtype=torch.long, device=topk_ids.device)
    tokens = topk_ids.reshape(-1).index_select(0, idx).tolist()
    out: list[list[int]] = []
    start = 0
    for n in sizes:
        out.append(tokens[start:start + n])
        start += n
    return out
