"""The attention mask of a batch of per-request draft trees, in the forms a GPU attention kernel takes (torch only).

vLLM 0.32 has no tree attention (removed upstream, vllm-project/vllm#42121). On CPU the plugin recomputes the tree
rows after vLLM's causal kernel (``patches/tree_attention.py``); a GPU backend would mask inside its kernel
instead. This module builds that mask for vLLM's packed (varlen) batch layout, where request ``b`` has
``q_len[b] = query_start_loc[b + 1] - query_start_loc[b]`` query rows this step and ``seq_lens[b]`` keys
(its context and those rows), so its row ``j`` sits at position ``seq_lens[b] - q_len[b] + j``:

- :func:`tree_attention_bias`: an additive bias ``[total_q, max(seq_lens)]`` (0 where a row may attend, -inf
  elsewhere), row ``i`` over its own request's key positions: what SDPA's ``attn_mask`` takes per request, or a
  Triton kernel reads beside its block table;
- :func:`tree_mask_mod`: a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over the packed query rows and packed
  keys (the requests' keys one after the other), for ``create_block_mask``.

A request in ``trees`` has one row for its root and one per draft node (``Tree.num_nodes + 1`` rows, canonical
order, as ``step.py`` lays them out): those rows see the whole context and, among the step's rows, their
ancestors and themselves (``Tree.ancestor_mask``). Every other request (a decode step, a chain, a prompt chunk)
is causal. ``tests/test_tree_mask.py`` checks both forms against the CPU tree fix's output.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from vllm_entmtp.trees import Tree


def _rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, trees: Mapping[int, Tree]):
    """Per packed query row: its request, its position, and its allowed tree rows (``[total_q, max_rows]``,
    all True for causal requests); per request: its context length."""
    qsl = query_start_loc.to("cpu", torch.long)
    sl = seq_lens.to("cpu", torch.long)
    q_len = qsl[1:] - qsl[:-1]
    ctx = sl - q_len
    if (ctx < 0).any():
        raise ValueError("seq_lens must count each request's query rows (seq_lens >= q_len)")
    req = torch.repeat_interleave(torch.arange(len(q_len)), q_len)
    j = torch.arange(int(qsl[-1])) - qsl[req]
    pos = ctx[req] + j
    max_rows = max([int(q_len.max()) if len(q_len) else 1] + [t.num_nodes + 1 for t in trees.values()])
    anc = torch.ones(int(qsl[-1]), max_rows, dtype=torch.bool)
    for b, tree in trees.items():
        n = tree.num_nodes + 1
        if int(q_len[b]) != n:
            raise ValueError(f"request {b}: {int(q_len[b])} query rows, but its tree has {n} rows (root + nodes)")
        anc[int(qsl[b]):int(qsl[b]) + n, :n] = tree.ancestor_mask()
    return req, pos, anc, ctx, sl


def tree_attention_bias(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, trees: Mapping[int, Tree],
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[total_q, max(seq_lens)]`` additive mask: row ``i`` (of request ``b``) over key positions ``0 ..
    seq_lens[b] - 1`` of its request; 0 where it may attend, -inf elsewhere (beyond ``seq_lens[b]`` too).

    Args:
        query_start_loc: ``[B + 1]`` cumulative query rows (vLLM's ``query_start_loc``).
        seq_lens: ``[B]`` keys per request, this step's rows included (vLLM's ``seq_lens``).
        trees: batch index -> the request's draft tree; requests not in it are causal.
    """
    req, pos, anc, ctx, sl = _rows(query_start_loc, seq_lens, trees)
    k = torch.arange(int(sl.max()) if len(sl) else 0)
    rel = k[None, :] - ctx[req][:, None]
    tree_ok = anc.gather(1, rel.clamp(0, anc.shape[1] - 1))
    allowed = (k[None, :] <= pos[:, None]) & ((rel < 0) | tree_ok)
    bias = torch.zeros(allowed.shape, dtype=dtype)
    return bias.masked_fill_(~allowed, float("-inf")).to(query_start_loc.device)


def tree_mask_mod(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, trees: Mapping[int, Tree]
                  ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A FlexAttention ``mask_mod`` for the packed batch: query index ``q_idx`` over ``sum(q_len)`` rows, key
    index ``kv_idx`` over ``sum(seq_lens)`` keys (request ``b``'s keys at ``sum(seq_lens[:b]) ..``). A row
    attends to its own request's keys, causally, and among a tree request's rows to its ancestors and itself.
    Use with ``create_block_mask(mask_mod, 1, None, total_q, total_kv)``."""
    req, pos, anc, ctx, sl = _rows(query_start_loc, seq_lens, trees)
    dev = query_start_loc.device
    kv_req = torch.repeat_interleave(torch.arange(len(sl)), sl)
    kv_pos = torch.arange(int(sl.sum())) - torch.cat([torch.zeros(1, dtype=torch.long), sl.cumsum(0)[:-1]])[kv_req]
    req, pos, anc, ctx, kv_req, kv_pos = (t.to(dev) for t in (req, pos, anc, ctx, kv_req, kv_pos))
    last = anc.shape[1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        r = req[q_idx]
        p = kv_pos[kv_idx]
        rel = p - ctx[r]
        tree_ok = anc[q_idx, rel.clamp(0, last)]
        return (kv_req[kv_idx] == r) & (p <= pos[q_idx]) & ((rel < 0) | tree_ok)

    return mask_mod
