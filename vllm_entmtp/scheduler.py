"""Choosing each request's draft tree per step from a tree set (engine-independent; no vLLM import).

A :class:`TreeScheduler` holds a *ladder*: trees of a tree set ordered from the most aggressive (bin 0, drafted
when the entropy is low / the heads are confident) to the most conservative (bin ``K - 1``), and ``K - 1``
thresholds between neighbouring bins. Per step it maps each request's :class:`~vllm_entmtp.entropy.Signals`
to a bin, with hysteresis and a warm-up, then fits the batch into a node budget by stepping requests down the
ladder, past its end to no drafting. This is EntMTP's ``threshold_ladder`` (``TopologyBank`` +
``EagleTreeSelector`` in ``entmtp/model/runtime_scheduler.py``, github.com/xikronz/entmtp) with per-request
state and the hysteresis of its ``binary_tau`` mode; SGLang's adaptive speculative decoding does the same for
the whole batch (EMA, warm-up, hysteresis; ``docs/advanced_features/adaptive_speculative_decoding.md``).

Ladder and thresholds:

- The tree set's ``schedule`` (``docs/trees.md``) when it has one; its ``signal`` must be the policy's. Its
  last entry may be ``"none"``: requests in that bin draft nothing (where no tree is expected to pay).
- Otherwise the *fallback ladder*: every tree of the set, largest node count first (equal sizes keep file
  order), with thresholds evenly spaced: for ``K`` trees, ``lo + (hi - lo) * i / K`` for ``i = 1..K-1`` over
  the entropy range ``(lo, hi)`` (default ``(0.0, 1.2)`` nats: EntMTP's logged mean block-start entropies are
  0.34 to 0.83 nats, so both ends of that spread land in different bins), and ``1 - i / K`` for confidence
  (EntMTP's default ladder thresholds, equally spaced in (0, 1)). Guesses, not tuned for any heads.

Which side of a threshold: the *score* is the entropy EMA (``"entropy"``) or minus the path confidence
(``"confidence"``), and thresholds are taken in the same orientation (increasing). The bin of a score is the
number of thresholds ``<=`` it: a score exactly on a threshold goes to the more conservative bin.

Hysteresis ``h``: a request in bin ``b`` moves to a more conservative bin only when ``bin(score - h) > b`` and
to a more aggressive one only when ``bin(score + h) < b``, i.e. when its score is past the threshold by the
margin ``h`` (or more); it then moves to that bin (several bins at once on a big change). ``h = 0`` is the
plain mapping.
The bin a request holds is its signal's choice; the load budget never changes it.

Warm-up: while a request has fewer than ``warmup_steps`` signal updates, or its signal is still None, it
drafts the default tree (``default_tree_id``, else the ladder's bin 0); its first decision after warm-up is
the plain mapping (no hysteresis, as it holds no bin yet).

Load: the scheduler's choices are fitted to the batch by the load rules of :mod:`vllm_entmtp.load_rules`
(measured step costs by default, or a cost model, or a cap), and weighed against prompt-lookup drafts there.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm_entmtp.config import option_default
from vllm_entmtp.entropy import Signals
from vllm_entmtp.lifetimes import drop_missing
from vllm_entmtp.errors import EntMTPError
from vllm_entmtp.load_rules import DEFAULT_MAX_VERIFY_TOKENS, LoadRules, calibration_of, node_budget
from vllm_entmtp.step_costs import StepCosts
from vllm_entmtp.trees import NO_DRAFT_ID, Tree, TreeSet

POLICIES = ("static", "entropy", "confidence")
LOAD_POLICIES = ("measured", "cap", "cost")
# the options' defaults, written once in vllm_entmtp.config.EntMTPConfig
DEFAULT_HYSTERESIS = option_default("hysteresis")
DEFAULT_WARMUP_STEPS = option_default("warmup_steps")
DEFAULT_LOAD_POLICY = option_default("load_policy")
DEFAULT_ACCEPTANCE_WINDOW = option_default("acceptance_window")
DEFAULT_ENTROPY_RANGE = (0.0, 1.2)
"""Entropy range (nats) over which the fallback ladder spaces its thresholds."""


class SchedulerError(EntMTPError):
    """A scheduler that cannot be built from these options and this tree set (the message names both)."""


@dataclass
class SchedulerStats:
    """Counters of :meth:`TreeScheduler.choose` (plain ints; ``as_dict`` for reporting)."""

    decisions: int = 0          # request-steps decided
    warmup: int = 0             # of which in warm-up (or without a signal yet): default tree
    switches: int = 0           # a request's signal moved it to another bin
    held_by_hysteresis: int = 0  # the plain mapping said another bin, the margin kept the request where it was
    cost_stepdowns: int = 0     # single-bin steps down by the cost model (load_policy "cost" or "measured")
    cost_stepups: int = 0       # single-bin steps up to a larger tree measured faster ("measured")
    probes: int = 0             # steps without drafts to measure a plain step of that batch ("measured")
    not_paying: int = 0         # steps without drafts because no draft could pay at that batch ("measured")
    heads_skipped: int = 0      # request-steps whose heads did not run: none of its drafts could pay ("measured")
    budget_stepdowns: int = 0   # single-bin steps down to fit the node budget
    no_draft: int = 0           # request-steps left without a tree by the cost model or the budget

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class TreeScheduler(LoadRules):
    """Per-request tree choice from a tree set: thresholds on a signal, hysteresis, warm-up, node budget.

    Args:
        tree_set: the loaded :class:`~vllm_entmtp.trees.TreeSet`.
        policy: ``"entropy"`` (thresholds on ``Signals.entropy_ema``), ``"confidence"`` (on
            ``Signals.confidence``), or ``"static"`` (the default tree for everyone; only the budget applies).
        hysteresis: margin in the signal's unit; None: the schedule's ``hysteresis``, else
            :data:`DEFAULT_HYSTERESIS`.
        warmup_steps: a request's first updates that draft the default tree.
        default_tree_id: the warm-up tree (it must be in the ladder); None: bin 0 of the ladder, or for
            ``"static"`` the set's largest tree (the static policy's tree).
        max_verify_tokens_per_step: for :meth:`node_budget` (None: 32).
        entropy_range: the fallback ladder's entropy range in nats (unused with a schedule).
        load_policy: ``"measured"`` (step costs measured on the running engine, :meth:`choose` with ``costs``;
            no cap unless ``max_verify_tokens_per_step`` is given), ``"cap"`` (the cap only) or ``"cost"`` (the
            module's cost model, then the cap). ``"measured"`` and ``"cost"`` need a set whose ladder trees carry
            ``build-trees`` metadata for this policy's signal; otherwise only the cap applies and
            :attr:`cost_model_missing` says why.
        decode_row_cost: ``d`` of the cost model, in one-request plain steps per request; None: the tree set's
            calibration ``cost.decode_row_cost`` when it has one, else :data:`~vllm_entmtp.load_rules.DEFAULT_DECODE_ROW_COST`.

    Raises:
        SchedulerError: unknown policy or load policy, a schedule for the other signal, a default tree outside
            the ladder, a bad number.
    """

    def __init__(self, tree_set: TreeSet, policy: str = "entropy", *, hysteresis: float | None = None,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, default_tree_id: str | None = None,
                 max_verify_tokens_per_step: int | None = None,
                 entropy_range: tuple[float, float] = DEFAULT_ENTROPY_RANGE,
                 load_policy: str = DEFAULT_LOAD_POLICY, decode_row_cost: float | None = None,
                 acceptance_window: int = DEFAULT_ACCEPTANCE_WINDOW):
        if policy not in POLICIES:
            raise SchedulerError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
        if load_policy not in LOAD_POLICIES:
            raise SchedulerError(f"unknown load_policy {load_policy!r}; allowed: {', '.join(LOAD_POLICIES)}")
        if not (isinstance(acceptance_window, int) and acceptance_window >= 1):
            raise SchedulerError(f"acceptance_window must be an integer >= 1, got {acceptance_window!r}")
        self.tree_set = tree_set
        self.policy = policy
        self.acceptance_window = acceptance_window
        sched = tree_set.schedule
        if policy == "static":
            sched = None  # one tree for everyone; the size ladder is only for the budget
        elif sched is not None and sched.signal != policy:
            raise SchedulerError(
                f"policy={policy!r}, but tree set {tree_set.source}'s schedule has signal {sched.signal!r} "
                f"(its thresholds are in that signal's unit): use policy {sched.signal!r} or a tree set whose "
                f"schedule is for {policy!r}")
        if sched is not None:
            ids = list(sched.tree_ids)
            thresholds = list(sched.thresholds)
            self.ladder_source = "schedule"
        else:
            ids = [i for i, _ in sorted(tree_set.trees, key=lambda it: -it[1].num_nodes)]  # stable: file order
            thresholds = fallback_thresholds(len(ids), "confidence" if policy == "confidence" else "entropy",
                                             entropy_range)
            self.ladder_source = "fallback"
        self.ladder_ids: list[str] = ids
        # a schedule may end with "none": that bin drafts nothing
        self.ladder: list[Tree | None] = [None if i == NO_DRAFT_ID else tree_set.get(i) for i in ids]
        self.thresholds: list[float] = thresholds
        # scores and thresholds in increasing orientation (confidence is negated)
        self._sign = -1.0 if policy == "confidence" else 1.0
        self._edges = [self._sign * t for t in thresholds]
        self._nodes = [t.num_nodes if t is not None else 0 for t in self.ladder]

        if hysteresis is None:
            hysteresis = sched.hysteresis if sched is not None and sched.hysteresis is not None \
                else DEFAULT_HYSTERESIS
        if not (isinstance(hysteresis, (int, float)) and not isinstance(hysteresis, bool)
                and math.isfinite(hysteresis) and hysteresis >= 0):
            raise SchedulerError(f"hysteresis must be a finite number >= 0, got {hysteresis!r}")
        self.hysteresis = float(hysteresis)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise SchedulerError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        if max_verify_tokens_per_step is not None:
            node_budget(0, max_verify_tokens_per_step)  # validates
        self.max_verify_tokens_per_step = max_verify_tokens_per_step

        default_tree_id = tree_set.aliases.get(default_tree_id, default_tree_id)  # a tree given way to a chain
        if default_tree_id is None:
            default_tree_id = ids[0]  # static: the largest tree, as resolve_static_tree picks it
        if default_tree_id not in ids:
            where = "schedule.tree_ids" if sched is not None else "trees"
            raise SchedulerError(
                f"default tree {default_tree_id!r} (tree_id) is not in the ladder of tree set {tree_set.source} "
                f"({where}: {', '.join(map(repr, ids))})")
        self.default_tree_id = default_tree_id
        self._default_bin = ids.index(default_tree_id)

        self._bins: dict[str, int] = {}
        # "measured": per request, EMAs of its accepted and its expected accepted draft tokens, and the expected
        # accepted tokens of the draft chosen for it this step
        self._acc_obs: dict[str, list[float]] = {}
        self.expected: dict[str, float] = {}
        self.stats = SchedulerStats()
        self.load_policy = load_policy
        self.cost_model_missing: str | None = None
        self._cal_edges: list[float] = []
        self._acc: list[list[float]] = []    # per ladder bin: expected accepted draft tokens per calibration bin
        self._extra: list[float] = []        # per ladder bin: step cost above a plain step (plain steps)
        if load_policy in ("cost", "measured"):
            self.cost_model_missing = self._init_cost_model(need_costs=load_policy == "cost")
        if decode_row_cost is None:
            decode_row_cost = self._calibrated_decode_row_cost()
        if not (isinstance(decode_row_cost, (int, float)) and not isinstance(decode_row_cost, bool)
                and math.isfinite(decode_row_cost) and 0 <= decode_row_cost <= 1):
            raise SchedulerError(f"decode_row_cost must be a number in [0, 1], got {decode_row_cost!r}")
        self.decode_row_cost = float(decode_row_cost)

    @property
    def cost_model(self) -> bool:
        """Whether :meth:`choose` applies the cost model (load policy ``"cost"``, a non-static policy, and a set
        with the metadata it needs)."""
        return self.load_policy == "cost" and self.policy != "static" and self.cost_model_missing is None

    @property
    def measured(self) -> bool:
        """Whether :meth:`choose` fits the batch to measured step costs (load policy ``"measured"``, a non-static
        policy, and a set with expected accepted tokens per calibration bin)."""
        return self.load_policy == "measured" and self.policy != "static" and self.cost_model_missing is None

    @classmethod
    def from_config(cls, options: Any, tree_set: TreeSet) -> TreeScheduler:
        """From an :class:`~vllm_entmtp.config.EntMTPConfig` and its loaded ``tree_set``.

        ``hysteresis`` is the option when the user gave it, else the schedule's, else the option's default;
        ``tree_id`` is the warm-up tree.
        """
        given = getattr(options, "model_fields_set", set())
        try:
            return cls(tree_set, options.policy,
                       hysteresis=options.hysteresis if "hysteresis" in given else None,
                       warmup_steps=options.warmup_steps, default_tree_id=options.tree_id,
                       max_verify_tokens_per_step=options.max_verify_tokens_per_step,
                       load_policy=options.load_policy, decode_row_cost=options.decode_row_cost,
                       acceptance_window=options.acceptance_window)
        except SchedulerError as e:
            raise SchedulerError(f"method 'entmtp' (policy, tree_set, tree_id): {e}") from None

    # -- per step -------------------------------------------------------------------------------------------------

    def signal_value(self, signals: Signals) -> float | None:
        """The policy's signal: the entropy EMA, or the path confidence (None for ``"static"``)."""
        if self.policy == "entropy":
            return signals.entropy_ema
        if self.policy == "confidence":
            return signals.confidence
        return None

    def bin_of(self, value: float) -> int:
        """Plain mapping (no hysteresis) of a signal value to a ladder bin (0 = most aggressive)."""
        s = self._sign * value
        return sum(1 for e in self._edges if s >= e)

    def _decide(self, req_id: str, signals: Signals) -> int:
        st = self.stats
        st.decisions += 1
        value = self.signal_value(signals)
        if self.policy == "static" or value is None or signals.updates < self.warmup_steps \
                or not math.isfinite(value):
            if self.policy != "static":
                st.warmup += 1
            return self._default_bin
        cur = self._bins.get(req_id)
        s = self._sign * value
        if cur is None:
            new = sum(1 for e in self._edges if s >= e)
        else:
            h = self.hysteresis
            up = sum(1 for e in self._edges if s - h >= e)     # more conservative if > cur
            down = sum(1 for e in self._edges if s + h >= e)   # more aggressive if < cur
            new = up if up > cur else down if down < cur else cur
            if new != cur:
                st.switches += 1
            elif sum(1 for e in self._edges if s >= e) != cur:
                st.held_by_hysteresis += 1
        self._bins[req_id] = new
        return new

    def choose(self, req_ids: Sequence[str], signals: Sequence[Signals],
               budget_nodes: int | None = None, costs: StepCosts | None = None, skip: Collection[int] = (),
               sunk_seconds: float = 0.0, covered_levels: int = 0,
               token_value: float | None = None, idle: Collection[int] = ()) -> list[tuple[str | None, Tree | None]]:
        """Each request's ``(tree id, tree)`` for this step, or ``(None, None)``: no drafting.

        Args:
            req_ids: the batch's request ids.
            signals: one :class:`~vllm_entmtp.entropy.Signals` per request (``EntropyTracker.signals``).
            budget_nodes: the most draft nodes the batch may carry in all (e.g. :meth:`node_budget`); None:
                no limit. When the chosen trees exceed it, the request with the largest tree steps down one bin
                (ties: the later one in ``req_ids``), repeatedly, the last bin stepping to no drafting.
            costs: measured step costs (load policy ``"measured"``), or None.
            skip: indices of requests that draft nothing from the heads this step (their prompt-lookup draft
                wins in any case): their signals still move their bins, but they get no tree and take no part
                of ``budget_nodes`` (the caller leaves their lookup drafts' nodes out of it).
            sunk_seconds: this step's drafting time already spent before the choice (the heads' confidence
                pass): under measured costs only the rest of the drafting time is charged to the drafts, as the
                step pays the spent part whether it drafts or not.
            covered_levels: head levels that pass ran (its ``confidence_heads``; 0 without a pass): under
                measured costs each further level of the deepest chosen tree is charged to the drafts.
            idle: indices of requests that may draft nothing this step (a prefill chunk, no draft tokens allowed,
                or ahead while the batch drains): no tree, as ``skip``, but they take no lookup draft's rows either,
                so the step-up still applies.
            token_value: under measured costs, the seconds of step time an accepted draft token is worth while the
                batch drains (:meth:`~vllm_entmtp.step_costs.StepCosts.token_value`); None: the step's tokens
                per second.

        The cost model (:attr:`cost_model`; module docstring) applies first, for the batch ``req_ids``; under
        the ``"measured"`` load policy, :meth:`_fit_measured` on ``costs`` instead (where ``costs`` has not
        measured this batch size yet, the cap :data:`DEFAULT_MAX_VERIFY_TOKENS` applies in its place).

        Raises:
            ValueError: as many signals as request ids are needed; ``budget_nodes`` must be an int >= 0 or None.
        """
        if len(signals) != len(req_ids):
            raise ValueError(f"choose: {len(signals)} signals for {len(req_ids)} request ids")
        if budget_nodes is not None and (isinstance(budget_nodes, bool) or not isinstance(budget_nodes, int)
                                         or budget_nodes < 0):
            raise ValueError(f"budget_nodes must be an int >= 0 or None, got {budget_nodes!r}")
        bins = [self._decide(r, s) for r, s in zip(req_ids, signals)]
        for i in (*skip, *idle):
            bins[i] = len(self.ladder)  # past the ladder: no draft (the bin the signal holds is kept)
        if self.cost_model and bins:
            self._fit_cost(bins, [self.calibration_bin(self.signal_value(s)) for s in signals])
        if self.measured and bins:
            cal = [self.calibration_bin(self.signal_value(s)) for s in signals]
            fitted = costs is not None and self._fit_measured(
                bins, cal, costs, [self.acceptance_ratio(r) for r in req_ids], sunk_seconds, covered_levels,
                step_up=not skip, token_value=token_value)
            if not fitted and budget_nodes is None:
                budget_nodes = node_budget(len(bins), DEFAULT_MAX_VERIFY_TOKENS)
        if budget_nodes is not None:
            self._fit(bins, budget_nodes)
        k = len(self.ladder)
        if self.measured:
            self.expected = {r: self.expected_accepted(b, c) for r, b, c in zip(req_ids, bins, cal)
                             if b < k and self.ladder[b] is not None}
        return [(self.ladder_ids[b], self.ladder[b]) if b < k and self.ladder[b] is not None else (None, None)
                for b in bins]

    # -- lifetime -------------------------------------------------------------------------------------------------

    def current_bin(self, req_id: str) -> int | None:
        """The bin the request's signal holds (None: never decided past warm-up)."""
        return self._bins.get(req_id)

    def free(self, req_id: str) -> None:
        """Drop the request's bin and acceptance record (no error when it has none)."""
        self._bins.pop(req_id, None)
        self._acc_obs.pop(req_id, None)
        self.expected.pop(req_id, None)

    def free_missing(self, active_ids: Iterable[str]) -> int:
        """Drop the bins (and acceptance records) of requests not in ``active_ids``; return how many bins were
        dropped."""
        drop_missing(self._acc_obs, active_ids)
        drop_missing(self.expected, active_ids)
        return drop_missing(self._bins, active_ids)

    def tracked_ids(self) -> set[str]:
        """Ids of the requests the scheduler holds a bin or an acceptance record for."""
        return set(self._bins) | set(self._acc_obs)

    def __len__(self) -> int:
        return len(self._bins)

    def __repr__(self) -> str:
        return (f"TreeScheduler(policy={self.policy!r}, ladder={self.ladder_ids}, thresholds={self.thresholds}, "
                f"hysteresis={self.hysteresis}, warmup_steps={self.warmup_steps}, "
                f"default={self.default_tree_id!r}, source={self.ladder_source}, load_policy={self.load_policy!r}"
                f"{'' if self.cost_model else ' (cap only)'})")


def calibration_mismatches(tree_set: TreeSet, options: Any) -> list[str]:
    """Where the options the server runs with differ from those a ``build-trees`` set was calibrated for (its
    first tree's ``metadata.calibration``: ``signal_window``, ``confidence_heads``): the thresholds then apply to
    a signal of another shape. Empty for sets without that metadata, for another signal, or when they agree.
    """
    cal = calibration_of(tree_set)
    signal = cal.get("signal")
    if signal is None or tree_set.schedule is None or signal != tree_set.schedule.signal:
        return []
    runs = {"signal_window": getattr(options, f"{signal}_window", None)}
    if signal == "confidence":
        runs["confidence_heads"] = getattr(options, "confidence_heads", None)
    option = {"signal_window": f"{signal}_window", "confidence_heads": "confidence_heads"}
    return [f"{option[k]}={v} (the set was calibrated with {cal[k]})" for k, v in runs.items()
            if k in cal and v is not None and v != cal[k]]


def fallback_thresholds(num_trees: int, signal: str = "entropy",
                        entropy_range: tuple[float, float] = DEFAULT_ENTROPY_RANGE) -> list[float]:
    """``num_trees - 1`` evenly spaced thresholds: increasing over ``entropy_range`` (nats) for ``"entropy"``,
    decreasing in (0, 1) for ``"confidence"`` (``1 - i / K``)."""
    if isinstance(num_trees, bool) or not isinstance(num_trees, int) or num_trees < 1:
        raise ValueError(f"num_trees must be an int >= 1, got {num_trees!r}")
    k = num_trees
    if signal == "confidence":
        return [1.0 - i / k for i in range(1, k)]
    if signal != "entropy":
        raise ValueError(f"signal must be 'entropy' or 'confidence', got {signal!r}")
    lo, hi = entropy_range
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < hi):
        raise SchedulerError(f"entropy_range must be (lo, hi) with 0 <= lo < hi, got {entropy_range!r}")
    return [lo + (hi - lo) * i / k for i in range(1, k)]
