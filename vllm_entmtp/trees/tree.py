"""Draft trees of MTP-head proposals: the :class:`Tree` and the tree math the verification needs (torch only).

A tree is plain data: a list of *paths*, each a list of top-k ranks, one rank per head (Medusa's
``medusa_choices``, ``medusa/model/medusa_choices.py`` in FasterDecoding/Medusa; Cai et al. 2024, arXiv
2401.10774, section 2.1.2). Path ``[r0, r1]`` is the rank-``r1`` token of head 1 placed under the rank-``r0``
token of head 0; its parent is path ``[r0]``; the parent of every depth-1 path is the root, i.e. the request's
last accepted token (whose next token the target itself predicts).

Canonical node order is breadth-first: paths sorted by ``(len(path), path)``, exactly as Medusa's
``generate_medusa_buffers`` sorts them (``medusa/model/utils.py``). A parent is shorter than its children, so
it always comes first, and any prefix of the node list is a tree again (``Tree.prefix``). Nodes are numbered
1..num_nodes in this order; number 0 is the root. Everything the verification needs (parent indices, depths
as position offsets, the ancestor attention mask) is derived here from the paths.

Tree sets (the JSON files that hold named trees and a schedule) are :mod:`vllm_entmtp.trees.tree_sets`.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

import torch

from vllm_entmtp.errors import TreeSetError


def _fmt(path: Sequence[Any]) -> str:
    return "[" + ", ".join(repr(r) if isinstance(r, str) else str(r) for r in path) + "]"


class Tree:
    """An immutable draft tree in canonical (breadth-first) order.

    Args:
        paths: the nodes as paths of top-k ranks (any order; ints >= 0). ``[[0], [1], [0, 0]]`` is the top-1
            and top-2 tokens of head 0 and, under the top-1 one, the top-1 token of head 1.
        max_depth: when given, the number of heads: a path longer than this raises.

    Raises:
        TreeSetError: empty tree, a path that is not a non-empty sequence of ints, a negative rank, a
            duplicate path, a path whose parent path is missing (``[0, 1]`` without ``[0]``), or a path
            deeper than ``max_depth``. The message names the offending path. A missing *left sibling*
            (``[2]`` without ``[1]``) is allowed.

    Node ``j`` (1-based, canonical order) is ``paths[j - 1]``; node 0 is the root.
    """

    def __init__(self, paths: Iterable[Sequence[int]], max_depth: int | None = None):
        self._paths: tuple[tuple[int, ...], ...] = _validate_paths(paths)
        if max_depth is not None:
            self.check_depth(max_depth)

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """The nodes' paths in canonical order: sorted by ``(len, lexicographic)``."""
        return self._paths

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def chain(cls, n: int) -> Tree:
        """The chain of ``n >= 1`` top-1 tokens: ``[[0], [0, 0], ..., [0] * n]``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a chain needs n >= 1 nodes, got {n!r}")
        return cls([[0] * d for d in range(1, n + 1)])

    def prefix(self, n: int) -> Tree:
        """The first ``n`` nodes (1 <= n <= num_nodes) in canonical order; a tree, as parents come first."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.num_nodes:
            raise ValueError(f"prefix of a {self.num_nodes}-node tree needs 1 <= n <= {self.num_nodes}, got {n!r}")
        if n == self.num_nodes:
            return self
        cache = self.__dict__.setdefault("_prefixes", {})  # the same Tree object each time: its masks are kept
        if n not in cache:
            cache[n] = Tree(self.paths[:n])
        return cache[n]

    def check_depth(self, num_heads: int) -> None:
        """Raise ``TreeSetError`` naming the first path deeper than ``num_heads`` (one rank per head)."""
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        for p in self.paths:
            if len(p) > num_heads:
                raise TreeSetError(f"path {_fmt(p)} has depth {len(p)}, deeper than the {num_heads} heads "
                                   f"(a path has one rank per head; max depth {num_heads})")

    # -- derived data ---------------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Number of draft nodes (the root not counted)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        """Length of the longest path (= heads needed)."""
        return len(self.paths[-1])

    @property
    def is_chain(self) -> bool:
        """Each node is the only child of the one before (``num_nodes == depth``): causal attention verifies it."""
        return self.num_nodes == self.depth

    def top1_chain(self) -> Tree | None:
        """What a runner without tree attention drafts in this tree's place: the tree itself if it is a chain, else
        its top-1 path (``[0], [0, 0], ...`` as deep as the tree holds it) as a chain; None for a branching tree
        without node ``[0]``."""
        if self.is_chain:
            return self
        n = sum(1 for p in self.paths if not any(p))
        return Tree.chain(n) if n else None

    @cached_property
    def fix_rows(self) -> list[int]:
        """The node rows (1-based) whose causal view is not their ancestors-or-self (:func:`fix_rows_for`); empty
        for a chain. Do not change the list."""
        return fix_rows_for(self._derived[0])

    @cached_property
    def _derived(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        index = {p: i + 1 for i, p in enumerate(self._paths)}
        parents = tuple(index[p[:-1]] if len(p) > 1 else 0 for p in self._paths)
        depths = tuple(len(p) for p in self._paths)
        ranks = tuple(p[-1] for p in self._paths)
        max_rank = [0] * depths[-1]
        for d, r in zip(depths, ranks):
            max_rank[d - 1] = max(max_rank[d - 1], r)
        return parents, depths, ranks, tuple(max_rank)

    # The list-valued properties return fresh lists: callers may keep or change them.

    @property
    def parents(self) -> list[int]:
        """``num_nodes`` ints: ``parents[j - 1]`` is the index (0 = root) of node ``j``'s parent; always < j."""
        return list(self._derived[0])

    @property
    def depths(self) -> list[int]:
        """``num_nodes`` ints: the depth of each node, 1-based (root = 0); also its position offset."""
        return list(self._derived[1])

    @property
    def ranks(self) -> list[int]:
        """``num_nodes`` ints: each node's top-k rank in its head (the last entry of its path)."""
        return list(self._derived[2])

    @property
    def max_rank_per_depth(self) -> list[int]:
        """``depth`` ints: entry ``d`` is the largest rank used at depth ``d + 1`` (head ``d``)."""
        return list(self._derived[3])

    @property
    def children(self) -> list[list[int]]:
        """``num_nodes + 1`` lists: the children of node ``i`` (0 = root), in node order."""
        return children_lists(self._derived[0])

    @cached_property
    def _mask(self) -> torch.Tensor:
        n = self.num_nodes
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[0, 0] = True
        for j, parent in enumerate(self._derived[0], start=1):
            mask[j] = mask[parent]
            mask[j, j] = True
        return mask

    def ancestor_mask(self) -> torch.Tensor:
        """Tree attention mask, ``torch.bool [num_nodes + 1, num_nodes + 1]`` (row/column 0 = root).

        ``mask[i, j]`` is True iff ``j == i`` or node ``j`` is an ancestor of node ``i``; every row has
        column 0 set. Medusa's ``medusa_attn_mask`` restricted to the tree (``medusa/model/utils.py``).
        A fresh tensor on the CPU each call.
        """
        return self._mask.clone()

    def to_list(self) -> list[list[int]]:
        """The paths as JSON-ready lists, canonical order."""
        return [list(p) for p in self.paths]

    # -- dunder ---------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_nodes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        body = ", ".join(_fmt(p) for p in self.paths[:8]) + (", ..." if self.num_nodes > 8 else "")
        return f"Tree(num_nodes={self.num_nodes}, depth={self.depth}, paths=[{body}])"


def fix_rows_for(parents: Sequence[int]) -> list[int]:
    """Rows (1-based nodes) whose causal view (context + rows 0..i) is not exactly context + ancestors-or-self:
    every node from the first that is not the previous node's child on."""
    out, chain = [], True
    for j, p in enumerate(parents, start=1):
        chain = chain and p == j - 1
        if not chain:
            out.append(j)
    return out


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """Children per node from a parent list (``parents[j - 1]`` = parent of node j): ``len(parents) + 1`` lists."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents, start=1):
        out[p].append(j)
    return out


def _validate_paths(paths: Iterable[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Iterable):
        raise TreeSetError(f"a tree is a list of paths (lists of top-k ranks), got {type(paths).__name__}")
    out: list[tuple[int, ...]] = []
    for i, p in enumerate(paths):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TreeSetError(f"paths[{i}] = {p!r} is not a list of top-k ranks")
        if len(p) == 0:
            raise TreeSetError(f"paths[{i}] is an empty path (the root is implicit; a node needs >= 1 rank)")
        ranks = []
        for r in p:
            try:
                if isinstance(r, bool):
                    raise TypeError
                r = operator.index(r)  # int, numpy and torch integers; not bool, float or str
            except TypeError:
                raise TreeSetError(f"path {_fmt(p)} has rank {r!r}, not an int") from None
            if r < 0:
                raise TreeSetError(f"path {_fmt(p)} has negative rank {r} (ranks are 0-based top-k indices)")
            ranks.append(r)
        out.append(tuple(ranks))
    if not out:
        raise TreeSetError("empty tree (no paths; a tree needs at least one node, e.g. [[0]])")
    seen: set[tuple[int, ...]] = set()
    for p in out:
        if p in seen:
            raise TreeSetError(f"duplicate node: path {_fmt(p)} appears more than once")
        seen.add(p)
    for p in sorted(out, key=lambda q: (len(q), q)):
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeSetError(f"path {_fmt(p)} has no parent: path {_fmt(p[:-1])} is missing")
    return tuple(sorted(out, key=lambda q: (len(q), q)))


def parse_inline_tree(paths: Sequence[Sequence[int]], num_heads: int | None) -> Tree:
    """A tree given inline (e.g. in a config), checked against ``num_heads`` heads (None: no depth check).

    Raises:
        TreeSetError: as ``Tree``; the message starts with ``inline tree:``.
    """
    try:
        return Tree(paths, max_depth=num_heads)
    except TreeSetError as e:
        raise TreeSetError(f"inline tree: {e}") from None

