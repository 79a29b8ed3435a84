"""Draft-token proposal from MTP heads (engine-independent: torch only).

One step: the target model's hidden state at each request's last accepted position goes through the heads
(one matmul with the shared lm_head for all heads at once); each request gets the tree chosen for it, its
nodes' tokens taken from the heads' top-k (Medusa, Cai et al. 2024, section 2.1.2: the node with path
``(r_0, ..., r_d)`` carries head ``d``'s rank-``r_d`` token). A chain of ``n`` draft tokens is the tree
``[[0], [0, 0], ...]``; chains may be cut where their confidence falls below a threshold.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_entmtp.heads.medusa import MedusaHeads
from vllm_entmtp.tree_proposal import build_tree_drafts, needed_heads, needed_topk
from vllm_entmtp.trees import Tree


class MTPDrafter:
    """Proposes per-request draft trees (chains included) from Medusa heads.

    Args:
        heads: the MTP heads, in the target's dtype.
        compute_logits: the target's lm_head: ``[N, hidden] -> [N, vocab]`` (float, any dtype). Used when the
            heads share it (``original_lm_head``); per-head lm_heads in the checkpoint are used otherwise.
        confidence_threshold: a *chain* stops before the first head whose path confidence (product of the
            heads' top-1 probabilities so far) is below it; 0 keeps every head. Trees are not cut.
    """

    def __init__(self, heads: MedusaHeads, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 confidence_threshold: float = 0.0):
        self.heads = heads
        self.compute_logits = compute_logits
        self.confidence_threshold = float(confidence_threshold)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads: ``hidden [B, H] -> [num_heads, B, vocab]``."""
        x = self.heads(hidden)[:num_heads]  # [k, B, H]
        k, b, h = x.shape
        if self.heads.lm_heads is not None:
            return torch.stack([self.heads.lm_heads[i](x[i]) for i in range(k)])
        return self.compute_logits(x.reshape(k * b, h)).view(k, b, -1)

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, trees: Sequence[Tree | None]) -> list[list[int]]:
        """Draft tokens per request, one per node of its tree.

        Args:
            hidden: ``[B, hidden_size]``, the target's final-norm hidden state at each request's last accepted
                position, in the target's dtype.
            trees: ``B`` entries: the request's tree (node order = canonical breadth-first order), or None for
                no draft tokens. Depth must not exceed the number of heads.

        Returns:
            ``B`` token-id lists (``[]`` for None; a chain may come back shorter, see ``confidence_threshold``).

        Raises:
            ValueError: ``len(trees) != B``, or a tree deeper than the heads.
        """
        b = hidden.shape[0]
        if b != len(trees):
            raise ValueError(f"hidden has {b} rows but {len(trees)} trees were given")
        k_heads = needed_heads(trees)
        if k_heads == 0:
            return [[] for _ in range(b)]
        if k_heads > self.heads.num_heads:
            raise ValueError(f"a tree of depth {k_heads} needs {k_heads} heads; there are {self.heads.num_heads}")
        return self.draft(self.head_logits(hidden, k_heads), trees)

    @torch.inference_mode()
    def draft(self, logits: torch.Tensor, trees: Sequence[Tree | None]) -> list[list[int]]:
        """Draft tokens from precomputed head logits ``[k, B, vocab]`` (``k`` >= the trees' depth)."""
        trees = list(trees)
        if needed_heads(trees) == 0:
            return [[] for _ in trees]
        if self.confidence_threshold > 0.0:
            top_p = torch.softmax(logits.float(), dim=-1).amax(dim=-1)  # [k, B]
            keep = (torch.cumprod(top_p, dim=0) >= self.confidence_threshold).int()
            confident = torch.cumprod(keep, dim=0).sum(0).tolist()  # leading heads above the threshold
            for i, t in enumerate(trees):
                if t is not None and t.num_nodes == t.depth:  # a chain
                    n = min(t.num_nodes, confident[i])
                    trees[i] = t.prefix(n) if n > 0 else None
        k_top = needed_topk(trees)
        if k_top == 0:
            return [[] for _ in trees]
        topk_ids = logits.topk(k_top, dim=-1).indices if k_top > 1 else logits.argmax(-1, keepdim=True)
        return build_tree_drafts(topk_ids, trees)

    @staticmethod
    def head_top1_probs(logits: torch.Tensor) -> torch.Tensor:
        """``[k, B, vocab]`` head logits -> ``[B, k]`` float32: each head's top-1 probability."""
        return torch.softmax(logits.float(), dim=-1).amax(dim=-1).t()

    def propose_chains(self, hidden: torch.Tensor, budgets: Sequence[int]) -> list[list[int]]:
        """Chains of the heads' top-1 tokens, at most ``budgets[i]`` (capped at the number of heads) each."""
        n = self.heads.num_heads
        return self.propose(hidden, [Tree.chain(min(x, n)) if x > 0 else None for x in budgets])
