"""Draft-token proposal from MTP heads (engine-independent: torch only).

One step: the target model's hidden state at each request's last accepted position goes through the heads;
each request gets a chain of draft tokens, the heads' top-1 tokens in head order (Medusa, Cai et al. 2024,
section 2.1), cut to that request's budget and, optionally, where the chain's confidence falls below a
threshold. Trees replace chains in a later step of the design (docs/architecture.md).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_entmtp.heads.medusa import MedusaHeads


class ChainDrafter:
    """Proposes per-request chains of draft tokens from Medusa heads.

    Args:
        heads: the MTP heads, in the target's dtype.
        compute_logits: the target's lm_head: ``[N, hidden] -> [N, vocab]`` (float, any dtype). Used when the
            heads share it (``original_lm_head``); per-head lm_heads in the checkpoint are used otherwise.
        confidence_threshold: a chain stops before the first head whose path confidence (product of the
            heads' top-1 probabilities so far) is below it; 0 keeps every head.
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
    def propose(self, hidden: torch.Tensor, budgets: Sequence[int]) -> list[list[int]]:
        """Draft tokens per request.

        Args:
            hidden: ``[B, hidden_size]``, the target's final-norm hidden state at each request's last
                accepted position, in the target's dtype.
            budgets: ``B`` ints, the most draft tokens each request may carry this step (0 allowed).

        Returns:
            ``B`` lists of token ids; list ``i`` has at most ``min(budgets[i], num_heads)`` tokens.
        """
        b = hidden.shape[0]
        if b != len(budgets):
            raise ValueError(f"hidden has {b} rows but {len(budgets)} budgets were given")
        k = min(max(budgets, default=0), self.heads.num_heads)
        if k <= 0:
            return [[] for _ in range(b)]
        logits = self.head_logits(hidden, k)  # [k, B, V]
        if self.confidence_threshold > 0.0:
            probs = torch.softmax(logits.float(), dim=-1)
            top_p, top_ids = probs.max(dim=-1)  # [k, B]
            path = torch.cumprod(top_p, dim=0)
            keep = (path >= self.confidence_threshold).int()
            lengths = torch.cumprod(keep, dim=0).sum(0).tolist()  # leading heads above the threshold
        else:
            top_ids = logits.argmax(dim=-1)
            lengths = [k] * b
        ids = top_ids.t().tolist()  # [B, k]
        return [ids[i][: min(budgets[i], lengths[i])] for i in range(b)]
