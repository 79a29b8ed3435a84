"""Tree-set JSON files: finding them, their schema, and loading them into a validated :class:`TreeSet`
(pydantic only; the trees themselves are :class:`~vllm_entmtp.trees.tree.Tree`).

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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, field_validator

from vllm_entmtp.errors import TreeSetError
from vllm_entmtp.trees.tree import Tree

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
        aliases: ids that :meth:`get` resolves to another tree of the set (:func:`chains_only`'s replaced trees).
    """

    name: str
    source: Path
    heads_kind: str
    num_heads: int
    description: str
    trees: list[tuple[str, Tree]]
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)
    schedule: Schedule | None = None
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def ids(self) -> list[str]:
        return [i for i, _ in self.trees]

    def get(self, tree_id: str) -> Tree:
        """The tree with this id (or the one it is an alias of); ``TreeSetError`` listing the ids when absent."""
        tree_id = self.aliases.get(tree_id, tree_id)
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


def chains_only(tree_set: TreeSet) -> TreeSet:
    """The set as a runner without tree attention drafts it, where causal attention verifies chains only.

    Every tree that branches gives way to its top-1 chain (:meth:`Tree.top1_chain`), under the id of the set's own
    chain of that shape when it has one (whose metadata, such as build-trees' expectations, then applies), else
    ``chain<n>`` (no metadata); a branching tree without a top-1 path drafts nothing (``none``). The replaced ids
    stay valid through :attr:`TreeSet.aliases` (a request holding itself to a tree gets its chain). The schedule
    follows: each bin drafts its tree's chain, and neighbouring bins that end on one chain are merged. A set of
    chains only is returned as it is.
    """
    if all(t.is_chain for _, t in tree_set.trees):
        return tree_set
    trees = [(i, t) for i, t in tree_set.trees if t.is_chain]
    taken = set(tree_set.ids) | {NO_DRAFT_ID}
    aliases: dict[str, str] = {}
    for i, t in tree_set.trees:
        if t.is_chain:
            continue
        chain = t.top1_chain()
        if chain is None:
            aliases[i] = NO_DRAFT_ID
            continue
        same = next((j for j, c in trees if c == chain), None)
        if same is None:
            same = f"chain{chain.num_nodes}"
            while same in taken:
                same += "'"
            taken.add(same)
            trees.append((same, chain))
        aliases[i] = same
    if not trees:
        raise TreeSetError(f"tree set {tree_set.source}: none of its trees has a top-1 path (node [0]), so where "
                           f"only chains are verified (no tree attention) it drafts nothing")
    schedule = tree_set.schedule
    if schedule is not None:
        ids, thresholds = [], []
        for k, i in enumerate(schedule.tree_ids):
            i = aliases.get(i, i)
            if ids and ids[-1] == i:
                continue  # the same chain as the bin before: one bin
            if ids:
                thresholds.append(schedule.thresholds[k - 1])
            ids.append(i)
        schedule = Schedule(schedule.signal, tuple(thresholds), tuple(ids), schedule.hysteresis, schedule.chain_stop)
    metadata = {i: tree_set.metadata[i] for i, _ in trees if i in tree_set.metadata}
    first = tree_set.metadata.get(tree_set.ids[0], {})
    if "calibration" in first and trees[0][0] != tree_set.ids[0]:  # the set's calibration rides on its first tree
        metadata[trees[0][0]] = {**metadata.get(trees[0][0], {}), "calibration": first["calibration"]}
    return TreeSet(tree_set.name, tree_set.source, tree_set.heads_kind, tree_set.num_heads, tree_set.description,
                   trees, metadata, schedule, aliases)
