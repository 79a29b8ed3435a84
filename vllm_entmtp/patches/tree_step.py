"""Per-step record of which rows of the batch are draft trees (worker process; no vLLM import).

The runner patch fills it after vLLM has built the step's inputs; the attention override reads it in every
layer; the sampler patch reads it to walk the trees and then to move the accepted path's K/V. One object per
worker process, reset every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TreeRows:
    """One request's rows in this step's flattened batch: the root (last accepted token) and its tree nodes.

    ``q0`` is the root's row among the step's query tokens; rows ``q0 .. q0 + num_nodes`` belong to it.
    ``parents[j-1]`` is the parent row (0 = root) of node row ``j``; ``mask`` is the ancestor-or-self mask
    ``[num_nodes+1, num_nodes+1]`` (bool); ``fix_rows`` are the rows whose causal attention differs from the
    tree's (the others already attend exactly to their ancestors, e.g. a leading chain).
    """

    batch_index: int
    q0: int
    draft_tokens: list[int]
    parents: list[int]
    mask: torch.Tensor
    fix_rows: list[int]
    tree_id: str = ""
    ranks: list[int] = field(default_factory=list)  # top-k rank of each node (for statistics)

    @property
    def num_rows(self) -> int:
        return len(self.draft_tokens) + 1


@dataclass
class TreeStep:
    rows: dict[int, TreeRows] = field(default_factory=dict)  # batch index -> rows
    # layer name -> (layer, impl, kv_cache, key [n, Hkv, D], value [n, Hkv, D], slots [n]) of rows row_lo..row_hi
    kv: dict[str, tuple] = field(default_factory=dict)
    row_lo: int = 0
    row_hi: int = 0
    # batch index -> (seq_len, tree_rows_plan(...)): block ids, rows, mask, the same in every layer of the step
    plans: dict[int, tuple] = field(default_factory=dict)
    # batch indices whose bookkeeping failed: vLLM verifies their draft tokens as a chain, they keep one token
    fallback: set[int] = field(default_factory=set)

    def reset(self, rows: dict[int, TreeRows], fallback: set[int] | None = None) -> None:
        self.rows = rows
        self.fallback = fallback or set()
        self.kv = {}
        self.plans = {}
        if rows:
            self.row_lo = min(r.q0 for r in rows.values())
            self.row_hi = max(r.q0 + r.num_rows for r in rows.values())
        else:
            self.row_lo = self.row_hi = 0


def fix_rows_for(parents: list[int]) -> list[int]:
    """Rows whose causal view (context + rows 0..i) is not exactly context + ancestors-or-self."""
    out, chain = [], True
    for j, p in enumerate(parents, start=1):
        chain = chain and p == j - 1
        if not chain:
            out.append(j)
    return out


STEP = TreeStep()
