"""Draft trees of MTP-head proposals and the tree-set JSON files that hold them (torch and pydantic only).

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

A *tree set* is a JSON file with several named trees for one kind of heads (format: ``docs/trees.md``), and
optionally a ``schedule``: a ladder of its trees with thresholds on an entropy or confidence signal, read by
``vllm_entmtp.scheduler.TreeScheduler``.
``load_tree_set("default")`` reads ``<repo>/trees/default.json``; folders listed in the environment variable
``VLLM_ENTMTP_TREES`` (``os.pathsep``-separated) are searched first. Every error is a ``TreeSetError`` that
names the file (or "inline tree"), the tree id and the offending path.
"""
from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, field_validator

from vllm_entmtp.errors import TreeSetError

TREES_ENV = "VLLM_ENTMTP_TREES"
"""Environment variable: extra folders (``os.pathsep``-separated) searched for ``<name>.json`` before the
repository's ``trees/`` folder."""

SCHEMA_VERSION = 1


def shipped_trees_dir() -> Path:
    """The repository's top-level ``trees/`` folder, installed as the data package ``vllm_entmtp._trees``
    (``pyproject.toml`` maps it), so that editable and regular installs both find it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm_entmtp._trees")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    import vllm_entmtp

    return Path(vllm_entmtp.__file__).resolve().parent.parent / "trees"


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


# -- tree-set files ---------------------------------------------------------------------------------------------


class _Heads(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["medusa", "hydra"]
    num_heads: StrictInt = Field(ge=1)


class _Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")  # free-form statistics beside the two checked fields

    num_nodes: StrictInt
    depth: StrictInt


class _TreeEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    paths: list[list[StrictInt]]
    metadata: _Metadata


class _Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    signal: Literal["entropy", "confidence"]
    thresholds: list[StrictFloat]
    tree_ids: list[str] = Field(min_length=1)
    hysteresis: StrictFloat | None = Field(default=None, ge=0.0)
    chain_stop: StrictFloat | None = Field(default=None, gt=0.0, lt=1.0)

    @field_validator("thresholds")
    @classmethod
    def _finite(cls, v: list[float]) -> list[float]:
        for i, x in enumerate(v):
            if not math.isfinite(x):
                raise ValueError(f"thresholds[{i}] = {x} is not a finite number")
        return v

    @field_validator("hysteresis")
    @classmethod
    def _finite_h(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"hysteresis = {v} is not a finite number")
        return v


class TreeSetFile(BaseModel):
    """Schema of a tree-set JSON file (version 1); unknown keys are refused except inside ``metadata``."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1]
    name: str = Field(min_length=1)
    heads: _Heads
    description: str = ""
    trees: list[_TreeEntry] = Field(min_length=1)
    schedule: _Schedule | None = None


@dataclass(frozen=True)
class Schedule:
    """A tree set's optional ``schedule``: a ladder of its trees and the thresholds between them.

    Attributes:
        signal: ``"entropy"`` (thresholds in nats on the target's entropy EMA, strictly increasing) or
            ``"confidence"`` (thresholds on the heads' path confidence in [0, 1], strictly decreasing).
        thresholds: ``len(tree_ids) - 1`` numbers; bin ``i`` (tree ``tree_ids[i]``) holds the signals between
            ``thresholds[i - 1]`` and ``thresholds[i]`` (``vllm_entmtp.scheduler`` says which side of a
            threshold is which).
        tree_ids: ids of trees of the set, from the most aggressive (lowest entropy / highest confidence) to
            the most conservative; no id twice.
        hysteresis: margin in the signal's unit, or None (the scheduler's own default).
        chain_stop: a number in (0, 1), or None: a scheduled *chain* is cut before its first node after the
            first whose path confidence (the product of the heads' top-1 probabilities along the chain, up to and
            including that node's head) is below it, so each request drafts, per step, the chain depth its heads
            are confident of (EAGLE-2's confidence-ranked drafting, Li et al. 2024, arXiv 2406.16858, section 4,
            reduced to a chain). The first node is always drafted: whether to draft at all is the ladder's choice.
    """

    signal: str
    thresholds: tuple[float, ...]
    tree_ids: tuple[str, ...]
    hysteresis: float | None = None
    chain_stop: float | None = None


@dataclass(frozen=True)
class TreeSet:
    """A loaded, validated tree set.

    Attributes:
        name: the file's ``name``.
        source: the file it was read from.
        heads_kind: ``"medusa"`` or ``"hydra"``.
        num_heads: the heads the file was written for (every tree's depth is <= this).
        description: free text.
        trees: ``(id, Tree)`` pairs in file order.
        metadata: per tree id, the file's ``metadata`` object (``num_nodes``, ``depth`` and free-form stats).
        schedule: the file's validated ``schedule``, or None when it has none.
    """

    name: str
    source: Path
    heads_kind: str
    num_heads: int
    description: str
    trees: list[tuple[str, Tree]]
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)
    schedule: Schedule | None = None

    @property
    def ids(self) -> list[str]:
        return [i for i, _ in self.trees]

    def get(self, tree_id: str) -> Tree:
        """The tree with this id; ``TreeSetError`` listing the ids when absent."""
        for i, t in self.trees:
            if i == tree_id:
                return t
        raise TreeSetError(f"tree set {self.source}: no tree {tree_id!r}; it has {', '.join(map(repr, self.ids))}")

    def __len__(self) -> int:
        return len(self.trees)


def tree_search_dirs() -> list[Path]:
    """Folders searched for ``<name>.json``, in order: ``$VLLM_ENTMTP_TREES`` entries, then ``<repo>/trees``."""
    extra = [Path(p).expanduser() for p in os.environ.get(TREES_ENV, "").split(os.pathsep) if p.strip()]
    return [*extra, shipped_trees_dir()]


def available_tree_sets() -> dict[str, Path]:
    """Name -> file of every tree set found in ``tree_search_dirs()`` (earlier folders win)."""
    found: dict[str, Path] = {}
    for d in tree_search_dirs():
        if d.is_dir():
            for f in sorted(d.glob("*.json")):
                found.setdefault(f.stem, f)
    return found


def _is_bare_name(s: str) -> bool:
    return bool(s) and "/" not in s and os.sep not in s and not s.endswith(".json")


def _resolve(name_or_path: str | os.PathLike[str]) -> Path:
    if isinstance(name_or_path, str) and _is_bare_name(name_or_path):
        for d in tree_search_dirs():
            f = d / f"{name_or_path}.json"
            if f.is_file():
                return f
        names = sorted(available_tree_sets())
        raise TreeSetError(
            f"unknown tree set {name_or_path!r}: no {name_or_path}.json in "
            f"{', '.join(str(d) for d in tree_search_dirs())}; available: {', '.join(names) or '(none)'} "
            f"(or give a path to a .json file; extra folders via ${TREES_ENV})")
    f = Path(name_or_path).expanduser()
    if not f.is_file():
        raise TreeSetError(f"tree set file {f} does not exist (a bare name such as 'default' is looked up in "
                           f"{', '.join(str(d) for d in tree_search_dirs())})")
    return f


def _where(raw: Any, loc: tuple[Any, ...]) -> str:
    """Human name of a pydantic error location, with the tree id and the path's value when known."""
    if len(loc) >= 2 and loc[0] == "trees" and isinstance(loc[1], int):
        i = loc[1]
        entry = raw.get("trees")[i] if isinstance(raw, dict) and isinstance(raw.get("trees"), list) else None
        tid = entry.get("id") if isinstance(entry, dict) else None
        s = f"tree {tid!r} (trees[{i}])" if isinstance(tid, str) else f"trees[{i}]"
        rest = loc[2:]
        if rest:
            s += " " + ".".join(str(x) if not isinstance(x, int) else f"[{x}]" for x in rest).replace(".[", "[")
        if len(rest) >= 2 and rest[0] == "paths" and isinstance(rest[1], int) and isinstance(entry, dict):
            paths = entry.get("paths")
            if isinstance(paths, list) and rest[1] < len(paths):
                s += f" (path {json.dumps(paths[rest[1]])})"
        return s
    return ".".join(str(x) if not isinstance(x, int) else f"[{x}]" for x in loc).replace(".[", "[") or "(top level)"


#: In a schedule's ``tree_ids``, the last entry may be this reserved id: "draft nothing" in that bin.
NO_DRAFT_ID = "none"


def _check_schedule(f: Path, spec: _Schedule, ids: list[str]) -> Schedule:
    """Cross-field rules of ``schedule`` (the schema checked the types): sizes, order, known and unique ids."""
    where = f"tree set {f}: schedule"
    th, tids = spec.thresholds, spec.tree_ids
    if len(tids) != len(th) + 1:
        raise TreeSetError(f"{where}: {len(tids)} tree_ids need {len(tids) - 1} thresholds (one between each pair "
                           f"of neighbouring trees), got {len(th)}")
    seen: dict[str, int] = {}
    if NO_DRAFT_ID in ids:
        raise TreeSetError(f"tree set {f}: a tree is named {NO_DRAFT_ID!r}, which a schedule reserves for "
                           "'no drafting'; rename it")
    for i, tid in enumerate(tids):
        if tid == NO_DRAFT_ID:
            if i != len(tids) - 1:
                raise TreeSetError(f"{where}.tree_ids[{i}] {NO_DRAFT_ID!r} (no drafting) must be the last, most "
                                   f"conservative entry of the ladder")
            seen[tid] = i
            continue
        if tid not in ids:
            raise TreeSetError(f"{where}.tree_ids[{i}] {tid!r} is not a tree of this set; it has "
                               f"{', '.join(map(repr, ids))}")
        if tid in seen:
            raise TreeSetError(f"{where}.tree_ids[{i}] {tid!r} is already tree_ids[{seen[tid]}] (each tree "
                               f"appears at most once in the ladder)")
        seen[tid] = i
    if spec.signal == "entropy":
        for i, x in enumerate(th):
            if x < 0:
                raise TreeSetError(f"{where}.thresholds[{i}] = {x}: an entropy threshold (nats) must be >= 0")
        for i in range(1, len(th)):
            if not th[i] > th[i - 1]:
                raise TreeSetError(f"{where}.thresholds[{i}] = {th[i]} is not greater than thresholds[{i - 1}] = "
                                   f"{th[i - 1]} (entropy thresholds must be strictly increasing: tree_ids go "
                                   f"from the most aggressive, low entropy, to the most conservative)")
    else:
        for i, x in enumerate(th):
            if not 0.0 <= x <= 1.0:
                raise TreeSetError(f"{where}.thresholds[{i}] = {x}: a confidence threshold must be in [0, 1]")
        for i in range(1, len(th)):
            if not th[i] < th[i - 1]:
                raise TreeSetError(f"{where}.thresholds[{i}] = {th[i]} is not less than thresholds[{i - 1}] = "
                                   f"{th[i - 1]} (confidence thresholds must be strictly decreasing: tree_ids go "
                                   f"from the most aggressive, high confidence, to the most conservative)")
    return Schedule(signal=spec.signal, thresholds=tuple(th), tree_ids=tuple(tids), hysteresis=spec.hysteresis,
                    chain_stop=spec.chain_stop)


def load_tree_set(name_or_path: str | os.PathLike[str], num_heads: int | None = None) -> TreeSet:
    """Read and validate a tree-set JSON file.

    Args:
        name_or_path: a bare name (``"default"``: ``<name>.json`` in ``tree_search_dirs()``) or a file path
            (anything containing a path separator or ending in ``.json``, or a ``Path``).
        num_heads: the heads actually loaded; when given, every path must be at most this deep.

    Returns:
        The ``TreeSet``, trees in file order, each in canonical node order.

    Raises:
        TreeSetError: unknown name (lists the available ones), missing or unreadable file, malformed JSON
            (line and column), schema violations (extra keys, wrong types; located by tree id and path),
            duplicate tree ids, an invalid tree (empty, empty path, negative rank, duplicate node, missing
            parent), a path deeper than the file's ``heads.num_heads`` or than ``num_heads``, or metadata
            ``num_nodes``/``depth`` that disagree with the paths, or a ``schedule`` whose sizes, threshold order
            or tree ids are wrong. Each message starts with the file.
    """
    f = _resolve(name_or_path)
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TreeSetError(f"tree set {f}: cannot read: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise TreeSetError(f"tree set {f}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    try:
        spec = TreeSetFile.model_validate(raw)
    except ValidationError as e:
        msgs = [f"{_where(raw, tuple(err['loc']))}: {err['msg']}"
                + (f" (got {err['input']!r})" if err["type"] not in ("missing",) and not isinstance(
                    err.get("input"), (dict, list)) else "")
                for err in e.errors()]
        raise TreeSetError(f"tree set {f}: " + "; ".join(msgs)) from None

    trees: list[tuple[str, Tree]] = []
    metadata: dict[str, dict[str, Any]] = {}
    for entry in spec.trees:
        where = f"tree set {f}: tree {entry.id!r}"
        if entry.id in metadata:
            raise TreeSetError(f"{where}: duplicate tree id (ids must be unique in a file)")
        try:
            tree = Tree(entry.paths)
        except TreeSetError as e:
            raise TreeSetError(f"{where}: {e}") from None
        try:
            tree.check_depth(spec.heads.num_heads)
        except TreeSetError as e:
            raise TreeSetError(f"{where}: {e}; the file declares heads.num_heads={spec.heads.num_heads}") from None
        if num_heads is not None:
            try:
                tree.check_depth(num_heads)
            except TreeSetError as e:
                raise TreeSetError(f"{where}: {e}; the loaded heads have num_heads={num_heads}") from None
        md = entry.metadata
        if md.num_nodes != tree.num_nodes or md.depth != tree.depth:
            raise TreeSetError(f"{where}: metadata says num_nodes={md.num_nodes}, depth={md.depth} but the paths "
                               f"give num_nodes={tree.num_nodes}, depth={tree.depth}")
        trees.append((entry.id, tree))
        metadata[entry.id] = md.model_dump()
    schedule = _check_schedule(f, spec.schedule, [i for i, _ in trees]) if spec.schedule is not None else None
    return TreeSet(name=spec.name, source=f, heads_kind=spec.heads.kind, num_heads=spec.heads.num_heads,
                   description=spec.description, trees=trees, metadata=metadata, schedule=schedule)
