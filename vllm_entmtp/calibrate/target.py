"""The target pass: the target model's greedy continuation of a prompt (transformers, float32, KV cache) and,
along it, each head's rank of the true token and the heads' top-1 probabilities as the runtime drafter sees them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

RANK_STORE_CAP = 1024
"""Ranks are stored capped at this value, so ``--max-rank`` up to it can change without recomputing."""
NO_LABEL = -1
"""Stored rank of a head at a position whose true token lies past the end of the continuation."""


def true_token_ranks(logits: torch.Tensor, cols: torch.Tensor, cap: int = RANK_STORE_CAP) -> torch.Tensor:
    """Rank of a chosen column per row: the number of strictly larger logits (0 = the argmax).

    Args:
        logits: ``[N, V]`` float.
        cols: ``int64 [N]`` column of the true token per row; -1 when the token is not in the head's vocabulary.
        cap: ranks are capped at this value (and -1 columns get it).

    Returns:
        ``int64 [N]`` in ``[0, cap]``.
    """
    picked = logits.gather(1, cols.clamp(min=0)[:, None])
    r = (logits > picked).sum(1)
    return torch.where(cols < 0, torch.full_like(r, cap), r.clamp(max=cap))


@dataclass
class TargetView:
    """What the statistics need from the target model (float32).

    Attributes:
        model: a transformers causal LM (``base_model`` gives the final-norm hidden states).
        lm_head: ``[vocab, hidden]`` weight of its output embedding.
        embed: its input embedding (token ids -> ``[.., hidden]``).
        eos_ids: token ids that end a continuation.
    """

    model: Any
    lm_head: torch.Tensor
    embed: Callable[[torch.Tensor], torch.Tensor]
    eos_ids: frozenset[int]

    @classmethod
    def of(cls, model, tokenizer=None) -> TargetView:
        eos: set[int] = set()
        for src in (getattr(model, "generation_config", None), model.config, tokenizer):
            e = getattr(src, "eos_token_id", None)
            eos.update(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
        return cls(model, model.get_output_embeddings().weight.detach(), model.get_input_embeddings(),
                   frozenset(int(x) for x in eos))


@torch.inference_mode()
def greedy_continuation(view: TargetView, prompt_ids: Sequence[int], max_tokens: int
                        ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy decoding with a KV cache.

    Returns:
        ``(tokens, hidden, entropy)``: the ``T <= max_tokens`` generated token ids (ending at an EOS token, which
        is kept), ``float32 [T, hidden]`` final-norm hidden states ``h_t`` (row ``t`` is the state whose logits
        chose ``tokens[t]``) and ``float32 [T]`` entropies (nats) of those next-token distributions.
    """
    from transformers import DynamicCache

    from vllm_entmtp.entropy import entropy_nats

    lm = view.model.get_output_embeddings()
    cache = DynamicCache(config=view.model.config)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    tokens, hidden, ent = [], [], []
    for _ in range(max_tokens):
        h = view.model.base_model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
        logits = lm(h[None]).float()
        y = int(logits[0].argmax())
        tokens.append(y)
        hidden.append(h.float())
        ent.append(entropy_nats(logits)[0])
        if y in view.eos_ids:
            break
        ids = torch.tensor([[y]], dtype=torch.long)
    return tokens, torch.stack(hidden), torch.stack(ent)


@torch.inference_mode()
def head_ranks(heads, view: TargetView, tokens: Sequence[int], hidden: torch.Tensor, chunk: int = 32
               ) -> torch.Tensor:
    """Rank of the true token per position and head along a greedy continuation.

    Args:
        heads: ``MedusaHeads`` (head ``d`` reads ``h_t``) or ``HydraHeads`` (head ``d`` reads ``h_t`` and the
            embeddings of the true path ``y_{t+1} .. y_{t+d+1}``, i.e. ``tokens[t .. t+d]``).
        tokens: the ``T`` generated tokens ``y_1 .. y_T`` (``tokens[t]`` is ``y_{t+1}``).
        hidden: ``float32 [T, hidden]``: ``hidden[t]`` is ``h_t``, whose target logits chose ``y_{t+1}``.

    Returns:
        ``int16 [T, heads]``: rank of ``y_{t+d+2}`` (``tokens[t + d + 1]``) in head ``d``'s logits at ``t``,
        capped at :data:`RANK_STORE_CAP`; :data:`NO_LABEL` where ``t + d + 1 >= T``.
    """
    from vllm_entmtp.heads.hydra import HydraHeads

    T, K = len(tokens), heads.num_heads
    y = torch.tensor(list(tokens), dtype=torch.long)
    out = torch.full((T, K), NO_LABEL, dtype=torch.int16)
    if not isinstance(heads, HydraHeads):  # every head reads h_t: one pass of all heads per chunk of positions
        for s in range(0, max(T - 1, 0), chunk):
            t = torch.arange(s, min(s + chunk, T - 1))
            logits = heads.logits(hidden[t], view.lm_head).float()  # [K, n, V]
            for d in range(K):
                ok = t + d + 1 < T
                out[t[ok], d] = true_token_ranks(logits[d][ok], y[t[ok] + d + 1]).to(torch.int16)
        return out
    w = heads.draft_lm_weight(view.lm_head)
    col_of = None  # target token id -> draft-vocabulary column (-1: not in it)
    if heads.token_map is not None:
        col_of = torch.full((view.lm_head.shape[0],), -1, dtype=torch.long)
        col_of[heads.token_map] = torch.arange(len(heads.token_map))
    for d in range(K):
        n = T - d - 1  # positions t = 0 .. n - 1 have a label
        for s in range(0, max(n, 0), chunk):
            t = torch.arange(s, min(s + chunk, n))
            label = y[t + d + 1]
            path = torch.stack([y[t + j] for j in range(d + 1)], dim=1)  # y_{t+1} .. y_{t+d+1}: [n, d + 1]
            x = heads.hidden_states(d, hidden[t], view.embed(path).float())
            cols = col_of[label] if col_of is not None else label
            out[t, d] = true_token_ranks(heads.logits(d, x, w).float(), cols).to(torch.int16)
    return out


def make_drafter(heads, view: TargetView):
    """The drafter the server runs (:func:`vllm_entmtp.proposer.make_drafter`, kernels measured on this machine
    included) for ``heads`` over the transformers target."""
    from vllm_entmtp.proposer import make_drafter as runtime_drafter

    w = view.lm_head
    return runtime_drafter(heads, embed=view.embed, lm_head_weight=w, compute_logits=lambda x: x @ w.t())


@torch.inference_mode()
def greedy_chain_top1(drafter, tokens: Sequence[int], hidden: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The heads' top-1 probabilities along their own greedy chain at every position, as the runtime sees them.

    Args:
        drafter: the runtime drafter (:func:`make_drafter`); its ``confidence`` is what the engine feeds the
            tracker each step.
        tokens: the ``T`` generated tokens; ``tokens[t]`` is the bonus token at position ``t``.
        hidden: ``float32 [T, hidden]``, ``h_t``.

    Returns:
        ``float32 [T, heads]``.
    """
    y = torch.tensor(list(tokens), dtype=torch.long)
    parts = [drafter.confidence(hidden[s:s + chunk], y[s:s + chunk])[0].float()
             for s in range(0, len(tokens), chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, drafter.num_heads)
