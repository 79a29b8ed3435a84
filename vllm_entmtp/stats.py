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
    # the same for the path confidence at the choice (product of the heads' top-1 probabilities), when tracked
    confidence_pairs: dict = field(default_factory=dict)
    # stage (step.FAULT_STAGES) -> requests that went on without speculation for a step after a fault
    fallbacks: dict = field(default_factory=dict)
    # draft source ("heads", "lookup") -> [verified drafts, draft tokens, accepted draft tokens (bonus excluded)]
    # of scheduled requests (every verifier: trees, chains, vLLM's own)
    by_source: dict = field(default_factory=dict)
    # the sources that drafted in one step ("heads", "heads+lookup", "lookup") -> steps
    step_sources: dict = field(default_factory=dict)
    # drafting steps in which the requests' drafts were not all of one length (per-request choice in one batch)
    mixed_length_steps: int = 0

    def record_fallback(self, stage: str, requests: int = 1) -> None:
        """A contained fault of the plugin's work in ``stage``, touching ``requests`` requests of a step."""
        self.fallbacks[stage] = self.fallbacks.get(stage, 0) + requests

    def record_choice(self, tree_id: str | None) -> None:
        """One request-step's proposal (chains and "none" included), for the share of steps per tree."""
        key = tree_id or "none"
        self.chosen[key] = self.chosen.get(key, 0) + 1

    def record_source(self, source: str, drafted: int, accepted: int) -> None:
        """One verified draft of ``drafted`` tokens from ``source``, ``accepted`` of them (bonus excluded)."""
        v = self.by_source.setdefault(source, [0, 0, 0])
        v[0] += 1
        v[1] += drafted
        v[2] += accepted

    def record_step_sources(self, sources: set[str]) -> None:
        """One drafting step and the draft sources its requests drafted from."""
        if sources:
            key = "+".join(sorted(sources))
            self.step_sources[key] = self.step_sources.get(key, 0) + 1

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

    def record_signal(self, tree_id: str, entropy: float | None, accepted: int,
                      confidence: float | None = None) -> None:
        """One drafting step of a request: its entropy EMA (nats) and path confidence when its tree was chosen
        (either None: not tracked), and how many of the draft tokens were accepted (bonus excluded)."""
        for pairs, x in ((self.signal_pairs, entropy), (self.confidence_pairs, confidence)):
            if x is not None:
                _add_pair(pairs.setdefault(tree_id, [0, 0.0, 0.0, 0.0, 0.0, 0.0]), float(x), float(accepted))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["per_tree"] = {k: {"steps": v[0], "nodes": v[1], "accepted": v[2]} for k, v in self.per_tree.items()}
        d["by_source"] = {k: {"drafts": v[0], "drafted": v[1], "accepted": v[2]} for k, v in self.by_source.items()}
        for key, pairs in (("entropy_acceptance", self.signal_pairs), ("confidence_acceptance",
                                                                       self.confidence_pairs)):
            pooled = [sum(col) for col in zip(*pairs.values())] if pairs else None
            d[key] = {**{k: pearson(*v) for k, v in pairs.items()}, **({"all": pearson(*pooled)} if pooled else {})}
        return d


def _add_pair(v: list, x: float, y: float) -> None:
    """Add ``(x, y)`` to running sums ``[n, sum x, sum y, sum xy, sum xx, sum yy]``."""
    v[0] += 1
    v[1] += x
    v[2] += y
    v[3] += x * y
    v[4] += x * x
    v[5] += y * y


def pearson(n: float, sx: float, sy: float, sxy: float, sxx: float, syy: float) -> dict:
    """``{"n", "mean_signal", "mean_accepted", "r"}`` from running sums; ``r`` is None when undefined."""
    out = {"n": int(n), "mean_signal": sx / n if n else None, "mean_accepted": sy / n if n else None, "r": None}
    if n >= 2:
        cov = sxy - sx * sy / n
        vx, vy = sxx - sx * sx / n, syy - sy * sy / n
        if vx > 0 and vy > 0:
            out["r"] = cov / (vx * vy) ** 0.5
    return out


STEP_HOOK_ENV = "VLLM_ENTMTP_STEP_HOOK"
"""A module the engine's workers import for a step hook (benchmarks; ``benchmarks/step_timer.py``): its
``make_hook()`` returns a callable run at the start of every step as ``hook(runner, scheduler_output, t0)``, whose
``stats()`` (if any) is merged into :func:`worker_stats`. Unset: no hook, nothing done per step."""


def load_step_hook():
    """The step hook of ``$VLLM_ENTMTP_STEP_HOOK`` (``None`` when unset).

    Raises:
        RuntimeError: the module does not import or has no ``make_hook``, naming the variable.
    """
    import importlib
    import os

    name = os.environ.get(STEP_HOOK_ENV, "").strip()
    if not name:
        return None
    try:
        make = importlib.import_module(name).make_hook
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"${STEP_HOOK_ENV}={name!r}: no importable module with a make_hook() there ({e}); "
                           f"put its folder on PYTHONPATH or unset the variable") from e
    return make()


def step_key(nodes: int, tree: bool) -> str:
    """Step-cost key of a step (``benchmarks/step_timer.py``, ``build-trees --step-costs``): ``"N"`` for N draft
    nodes that attend causally (a chain, or nothing), and ``"Nt"`` for a tree that needs the tree-attention fix (its
    rows recomputed with the ancestor mask in every layer, ``patches/tree_attention.py``), which costs more than a
    chain of the same size on a CPU."""
    return f"{nodes}t" if tree else str(nodes)


def needs_attention_fix(tree) -> bool:
    """Whether a draft tree's rows need the tree-attention fix: it branches before its end
    (:func:`~vllm_entmtp.trees.fix_rows_for`); a chain does not."""
    return bool(tree.fix_rows)


def tree_step_key(tree) -> str:
    """:func:`step_key` of a draft tree (:class:`~vllm_entmtp.trees.Tree`): its node count, and
    :func:`needs_attention_fix`."""
    return step_key(tree.num_nodes, needs_attention_fix(tree))


def parse_step_key(key: str) -> tuple[int, bool]:
    """``(nodes, tree)`` of a :func:`step_key` (``ValueError`` for anything else)."""
    tree = key.endswith("t")
    nodes = int(key[:-1] if tree else key)
    if nodes < 0:
        raise ValueError(f"negative node count in step key {key!r}")
    return nodes, tree


def worker_stats(worker) -> dict:
    """For ``LLM.collective_rpc``: the entmtp drafter's :class:`TreeStats` of this worker, as a dict. Publishes
    them for ``/metrics`` too (:class:`~vllm_entmtp.metrics.Publisher`), so that metrics read after this call
    are current."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    publisher = getattr(drafter, "publisher", None)
    if publisher is not None:
        for _ in range(100):  # a snapshot fails only while the engine changes the counters under it
            if publisher.flush():
                break
    stats = getattr(drafter, "tree_stats", None)
    out = stats.as_dict() if stats is not None else {}
    hook_stats = getattr(getattr(drafter, "step_hook", None), "stats", None)
    if hook_stats is not None:  # a benchmark's step hook ($VLLM_ENTMTP_STEP_HOOK)
        out |= hook_stats()
    scheduler = getattr(drafter, "scheduler", None)
    if scheduler is not None:
        out["scheduler"] = scheduler.stats.as_dict()
        out["tracked_requests"] = len(drafter.tracker)
    if hasattr(drafter, "held_request_ids"):  # requests with any per-request state in the drafter
        out["requests_with_state"] = len(drafter.held_request_ids())
    return out
