"""Choosing a bin's tree: the greedy tree at each node budget (:class:`Candidate`, with its cost and expected
tokens per step), their Pareto frontier and the best expected speed-up against not drafting
(:class:`BinChoice`), and the expected speed-up over all positions.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_entmtp.calibrate.acceptance import Path_, expected_accepted, greedy_tree
from vllm_entmtp.calibrate.bins import BinStats


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated ``(cost, value)`` points, by increasing cost.

    A point is dominated when another has cost <= and value >= with at least one strict; of exact duplicates
    the first is kept. Used with cost = relative step time and value = expected tokens per step.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    out, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            out.append(i)
            best = points[i][1]
    return out


def best_ratio(points: Sequence[tuple[float, float]]) -> int:
    """Index of the point with the largest ``value / cost`` (expected speed-up over plain decoding); ties go to
    the cheaper point, then the earlier one. Costs must be > 0."""
    if not points:
        raise ValueError("best_ratio needs at least one point")
    for i, (c, _) in enumerate(points):
        if not c > 0:
            raise ValueError(f"point {i} has cost {c!r}; costs must be > 0")
    return min(range(len(points)), key=lambda i: (-points[i][1] / points[i][0], points[i][0], i))


@dataclass
class Candidate:
    """One bin's greedy tree at one node budget, with its measured cost and expected value.

    ``cost`` and its parts are relative to a plain decode step (one token verified, no drafting) = 1.0;
    ``tokens_per_step`` includes the bonus token; ``speedup = tokens_per_step / cost``.
    """

    bin: int
    budget: int  # the node budget asked for (num_nodes is smaller when the [depth][rank] grid ran out)
    paths: tuple[Path_, ...]  # adding order
    accepted: float
    verify_cost: float = math.nan
    draft_cost: float = math.nan

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def key(self) -> tuple[Path_, ...]:
        return tuple(sorted(self.paths, key=lambda p: (len(p), p)))

    @property
    def tokens_per_step(self) -> float:
        return 1.0 + self.accepted

    @property
    def cost(self) -> float:
        return self.verify_cost + self.draft_cost

    @property
    def speedup(self) -> float:
        return self.tokens_per_step / self.cost


@dataclass
class BinChoice:
    """The candidates of a bin, its Pareto frontier, the chosen tree (None: no drafting is best) and the best
    tree even when it is below 1 (``scheduled``; reported, and kept in the set for static use). The schedule
    gives a bin whose ``chosen`` is None the reserved entry "none" (no drafting)."""

    stats: BinStats
    candidates: list[Candidate]
    frontier: list[Candidate]
    chosen: Candidate | None
    scheduled: Candidate = field(init=False)

    def __post_init__(self):
        self.scheduled = self.chosen if self.chosen is not None else self.candidates[
            best_ratio([(c.cost, c.tokens_per_step) for c in self.candidates])]


def candidates_for_bin(stats: BinStats, budgets: Sequence[int], num_heads: int) -> list[Candidate]:
    """The greedy tree of ``stats.P`` at every budget (nested trees; a budget past the ``[depth][rank]`` grid
    gets the whole grid; a tree equal to a smaller budget's is left out)."""
    order = greedy_tree(stats.P, max(budgets), max_depth=num_heads)
    out: list[Candidate] = []
    for n in budgets:
        paths = tuple(p for p, _ in order[:n])
        if out and len(paths) == out[-1].num_nodes:
            continue
        out.append(Candidate(stats.index, n, paths, expected_accepted(paths, stats.P)))
    return out


def choose(stats: BinStats, cands: list[Candidate]) -> BinChoice:
    """Pareto frontier and best expected speed-up among ``cands`` and "no drafting" (cost 1, 1 token/step)."""
    points = [(1.0, 1.0)] + [(c.cost, c.tokens_per_step) for c in cands]
    front = [cands[i - 1] for i in pareto_frontier(points) if i > 0]
    best = best_ratio(points)
    return BinChoice(stats, cands, front, cands[best - 1] if best > 0 else None)


def expected_overall(choices: list[BinChoice]) -> dict:
    """Expected speed-up over plain decoding, over all positions (bins weighted by their positions, one step per
    position as an approximation): of the schedule (each bin drafting its chosen tree, or nothing) and of
    every candidate tree drafted in every bin; ``sum_b w_b T_b / sum_b w_b C_b`` with ``T`` the expected
    tokens per step (bonus included) and ``C`` the cost.

    Returns:
        ``{"schedule": x, "best_static": {"paths": [[rank, ...], ...], "num_nodes": n, "speedup": x}}``.
    """
    w = [b.stats.positions for b in choices]

    def overall(per_bin: list[tuple[float, float]]) -> float:
        return sum(wi * t for wi, (t, _) in zip(w, per_bin)) / sum(wi * c for wi, (_, c) in zip(w, per_bin))

    sched = overall([(b.chosen.tokens_per_step, b.chosen.cost) if b.chosen is not None else (1.0, 1.0)
                     for b in choices])
    best = None
    for c in {c.key: c for b in choices for c in b.candidates}.values():
        x = overall([(1.0 + expected_accepted(c.key, b.stats.P), c.cost) for b in choices])
        if best is None or x > best[1]:
            best = (c, x)
    out = {"schedule": round(sched, 4)}
    if best is not None:
        out["best_static"] = {"paths": [list(p) for p in best[0].key], "num_nodes": best[0].num_nodes,
                              "speedup": round(best[1], 4)}
    return out
