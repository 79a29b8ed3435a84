"""Counters of tree verification, per worker process (plain Python; no vLLM import).

Read them offline with ``LLM.collective_rpc(vllm_entmtp.stats.worker_stats)``; ``benchmarks/acceptance.py``
and the tests do. Acceptance lengths here exclude the bonus token.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TreeStats:
    tree_steps: int = 0            # request-steps verified as a tree (chains are counted by vLLM's own metrics)
    nodes_verified: int = 0        # draft nodes in those trees
    tokens_accepted: int = 0       # accepted draft tokens (bonus excluded)
    non_first_branch_paths: int = 0  # accepted paths that leave the top-1 chain somewhere
    kv_slots_moved: int = 0        # accepted nodes whose K/V was moved to a consecutive slot
    per_tree: dict = field(default_factory=dict)  # tree id -> [steps, nodes, accepted]
    chosen: dict = field(default_factory=dict)  # tree id ("none": no drafting) -> request-steps it was chosen
    # tree id -> [n, sum x, sum y, sum xy, sum xx, sum yy] of (entropy EMA at the choice, nats; accepted draft
    # tokens of that draft, bonus excluded): the correlation of the tracked entropy with the next acceptance
    signal_pairs: dict = field(default_factory=dict)

    def record_choice(self, tree_id: str | None) -> None:
        """One request-step's proposal (chains and "none" included), for the share of steps per tree."""
        key = tree_id or "none"
        self.chosen[key] = self.chosen.get(key, 0) + 1

    def record(self, tree_id: str, num_nodes: int, path: list[int], ranks: list[int]) -> None:
        """One verified tree: ``path`` = accepted node indices (1-based), ``ranks[j-1]`` = node j's rank."""
        self.tree_steps += 1
        self.nodes_verified += num_nodes
        self.tokens_accepted += len(path)
        if any(ranks[j - 1] != 0 for j in path):
            self.non_first_branch_paths += 1
        self.kv_slots_moved += sum(1 for k, node in enumerate(path, start=1) if node != k)
        entry = self.per_tree.setdefault(tree_id, [0, 0, 0])
        entry[0] += 1
        entry[1] += num_nodes
        entry[2] += len(path)

    def record_signal(self, tree_id: str, entropy: float, accepted: int) -> None:
        """One drafting step of a request: its entropy EMA (nats) when its tree was chosen, and how many of the
        draft tokens were accepted (bonus excluded)."""
        v = self.signal_pairs.setdefault(tree_id, [0, 0.0, 0.0, 0.0, 0.0, 0.0])
        x, y = float(entropy), float(accepted)
        v[0] += 1
        v[1] += x
        v[2] += y
        v[3] += x * y
        v[4] += x * x
        v[5] += y * y

    def as_dict(self) -> dict:
        d = asdict(self)
        d["per_tree"] = {k: {"steps": v[0], "nodes": v[1], "accepted": v[2]} for k, v in self.per_tree.items()}
        pooled = [sum(col) for col in zip(*self.signal_pairs.values())] if self.signal_pairs else None
        d["entropy_acceptance"] = {
            **{k: pearson(*v) for k, v in self.signal_pairs.items()},
            **({"all": pearson(*pooled)} if pooled else {})}
        return d


def pearson(n: float, sx: float, sy: float, sxy: float, sxx: float, syy: float) -> dict:
    """``{"n", "mean_entropy", "mean_accepted", "r"}`` from running sums; ``r`` is None when undefined."""
    out = {"n": int(n), "mean_entropy": sx / n if n else None, "mean_accepted": sy / n if n else None, "r": None}
    if n >= 2:
        cov = sxy - sx * sy / n
        vx, vy = sxx - sx * sx / n, syy - sy * sy / n
        if vx > 0 and vy > 0:
            out["r"] = cov / (vx * vy) ** 0.5
    return out


def worker_stats(worker) -> dict:
    """For ``LLM.collective_rpc``: the entmtp drafter's :class:`TreeStats` of this worker, as a dict."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    stats = getattr(drafter, "tree_stats", None)
    out = stats.as_dict() if stats is not None else {}
    scheduler = getattr(drafter, "scheduler", None)
    if scheduler is not None:
        out["scheduler"] = scheduler.stats.as_dict()
        # requests with any per-request state in the drafter (tracker, scheduler, pending trees)
        held = set(drafter.pending) | set(getattr(drafter, "_drafted_at", {})) | scheduler.tracked_ids()
        if getattr(drafter, "prefix_cache", None) is not None:
            held |= drafter.prefix_cache.tracked_ids()
        out["tracked_requests"] = len(drafter.tracker)
        out["requests_with_state"] = len(held | drafter.tracker.tracked_ids())
    return out
