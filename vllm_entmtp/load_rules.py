"""The load rules of :class:`~vllm_entmtp.scheduler.TreeScheduler`: how the trees its signals chose are fitted to
the batch, and how prompt-lookup drafts are weighed against them (engine-independent; no vLLM import).

Load (the bin a request's signal holds is never changed by any of these):

0. **Measured costs** (``load_policy="measured"``, the default, for sets built by ``vllm-entmtp build-trees``):
   :meth:`TreeScheduler.choose` with ``costs`` (:class:`~vllm_entmtp.step_costs.StepCosts`, measured on the
   running engine: a decode step's row-bound time by the rows it verifies, drafting time by batch size, each head
   level the drafts run after the choice; :meth:`LoadRules._fit_measured`) steps
   requests down the ladder, the one giving up the fewest expected accepted tokens per second of step time saved
   first, while that gives up fewer than the step's tokens per second; then, if a step without drafts is faster
   per token, nobody drafts; else requests move up the ladder where the step with the larger tree is measured
   faster (:meth:`LoadRules._step_up`: a step's time need not grow with its rows).
   :meth:`TreeScheduler.drafting_pays` tells the drafter before it runs the heads
   whether any draft could pay at this batch size. Until the costs for a batch size are measured, the cap
   (rule 2, with its default of 32) applies instead; a cap the user gives applies after this rule.

The two older rules, applied in this order:

1. **Cost model** (``load_policy="cost"``, opt-in, for sets built by ``vllm-entmtp build-trees``; not for
   ``"static"``): keep the trees that raise the step's expected tokens per unit of time. Every tree of such a set
   records its expected accepted draft tokens per calibration bin (``metadata.expected_accepted_per_bin``; the
   request's bin comes from its signal and the calibration's ``edges``; a request without a signal yet counts the
   mean over the bins, which hold equal shares of the calibration positions) and its measured cost at one request
   (``metadata.cost.total``, in plain decoding steps, drafting included). The step of ``B`` requests is modelled
   as ``1 + d * (B - 1)`` plain one-request steps (``d``: ``decode_row_cost``, what one more request's decode row
   adds) plus ``cost.total - 1`` per drafting request, and yields ``B + sum(accepted)`` tokens. While stepping a
   request one rung down the ladder (to ``"none"`` past the last) gives up fewer tokens per unit of time saved
   (``dA / dT``) than the step's current ratio ``tokens / time``, the request with the smallest ``dA / dT`` steps
   down; ties go to the later request. At one request this drops a tree only where its expected speed-up is below
   1; as ``B`` grows the ratio rises and only trees whose accepted tokens pay for their own cost stay. Source: the
   break-even argument of Sequoia (Chen et al. 2024, section 4: the tree size that maximises tokens per second
   depends on the hardware's cost of verifying more tokens) applied per request.
   Not the default: it charges every request its one-request cost, and on this CPU most of that cost is per step,
   not per request (``benchmarks/results/step-profile-2026-11-30b/``: one draft token costs 14 ms at one request
   and 12.5 ms for sixteen together, where it still gains 17 %), so with one-request calibrations it drops
   drafting where drafting pays. It needs step costs measured per batch size.
2. **Cap** (always): :func:`node_budget` gives the draft nodes a step may verify: ``max_verify_tokens_per_step``
   (default :data:`DEFAULT_MAX_VERIFY_TOKENS` = 32) minus one root row per request. :meth:`TreeScheduler.choose`
   then, while the chosen trees' nodes exceed the budget, steps the request with the largest tree one bin down (a
   tie goes to the request later in the batch), the last bin stepping down to no drafting (``None``). On this CPU
   a step's time is nearly flat up to about 32 verified rows and steep beyond (``step-profile-2026-11-30b``: at
   16 requests, 32 rows +8 %, 48 rows +53 %, 80 rows of branching trees +300 %), which is what a cap expresses.

Prompt lookup (``draft_sources`` ``"hybrid"``; :mod:`vllm_entmtp.lookup`): :meth:`LoadRules.fit_lookup` gives a
request its lookup chain instead of the heads' draft where the lookup expects at least as many accepted tokens
(its own record of lookup drafts against the calibration's expectation for the heads' choice, scaled by the
request's acceptance record), within the cap of verified rows (rule 2) where one applies, and under measured
costs only where that raises the step's tokens per second (while the batch drains: where the accepted tokens'
worth exceeds the time their rows add), the chain cut to the prefix that raises it most.
:meth:`LoadRules.best_expected` lets the drafter skip the heads for requests whose lookup draft no heads' draft
could beat.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence

from vllm_entmtp.step_costs import STEP_UP_MARGIN, StepCosts, drafts_behind
from vllm_entmtp.trees import Tree, TreeSet

DEFAULT_DECODE_ROW_COST = 0.067
"""What one more request's decode row adds to a step, in one-request plain steps, when the tree set does not say:
the slope of plain decoding's time per output token over 1, 4 and 16 requests in flight in the compiled servers of
``benchmarks/results/compare-2026-11-30/`` (HumanEval: 76.0, 94.6 and 155.6 ms; 5.1 ms per request / 76 ms)."""
DEFAULT_MAX_VERIFY_TOKENS = 32
"""Default cap on the tokens verified per step (draft nodes + one root per request), see :func:`node_budget`."""
ACCEPTANCE_MIN_STEPS = 2
ACCEPTANCE_RATIO_RANGE = (0.2, 3.0)


def node_budget(batch_size: int, max_verify_tokens_per_step: int | None = None) -> int:
    """Draft nodes a step may carry in all: ``max(0, max_verify_tokens_per_step - batch_size)``.

    Every request verifies its root row anyway (the plain decode token), so of ``max_verify_tokens_per_step``
    verified rows (None: :data:`DEFAULT_MAX_VERIFY_TOKENS`) ``batch_size`` are taken and the rest can be
    draft nodes. With 32: 28 nodes for 4 requests, 16 for 16 requests (one each), none from 32 requests on.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
    cap = DEFAULT_MAX_VERIFY_TOKENS if max_verify_tokens_per_step is None else max_verify_tokens_per_step
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"max_verify_tokens_per_step must be an int >= 1 or None, got {cap!r}")
    return max(0, cap - batch_size)



def calibration_of(tree_set: TreeSet) -> dict:
    """The ``build-trees`` calibration record of a tree set (its first tree's ``metadata.calibration``; ``{}`` for
    sets without one)."""
    return tree_set.metadata.get(tree_set.ids[0], {}).get("calibration", {}) if tree_set.ids else {}



class LoadRules:
    """The load rules as methods of :class:`~vllm_entmtp.scheduler.TreeScheduler` (which sets what they read:
    ``policy``, ``tree_set``, ``ladder``, ``ladder_ids``, ``_nodes``, ``_sign``, ``stats``, ``expected``,
    ``_acc_obs``, ``acceptance_window``, ``load_policy``, ``max_verify_tokens_per_step``, ``decode_row_cost``)."""

    def _calibrated_decode_row_cost(self) -> float:
        d = calibration_of(self.tree_set).get("cost", {}).get("decode_row_cost")
        return DEFAULT_DECODE_ROW_COST if d is None else d

    def _init_cost_model(self, need_costs: bool = True) -> str | None:
        """Fill the cost model's tables from the tree set's metadata; return why it cannot apply (None: it can).
        ``need_costs``: the one-request costs (``metadata.cost.total``) are required (load policy ``"cost"``)."""
        if self.policy == "static":
            return "the static policy drafts one tree for everyone"
        cal = calibration_of(self.tree_set)
        if cal.get("signal") != self.policy or not isinstance(cal.get("edges"), list):
            return (f"tree set {self.tree_set.source} has no build-trees calibration for the {self.policy!r} "
                    f"signal (metadata.calibration.signal and edges)")
        edges = sorted(self._sign * float(e) for e in cal["edges"])
        nbins = len(edges) + 1
        acc, extra = [], []
        for tid, tree in zip(self.ladder_ids, self.ladder):
            if tree is None:
                acc.append([0.0] * nbins)
                extra.append(0.0)
                continue
            meta = self.tree_set.metadata.get(tid, {})
            per_bin = meta.get("expected_accepted_per_bin")
            total = meta.get("cost", {}).get("total") if isinstance(meta.get("cost"), dict) else None
            if not isinstance(per_bin, list) or len(per_bin) != nbins \
                    or (need_costs and not isinstance(total, (int, float))):
                return (f"tree {tid!r} of tree set {self.tree_set.source} lacks metadata.expected_accepted_per_bin "
                        f"({nbins} bins)" + (" or metadata.cost.total" if need_costs else ""))
            acc.append([float(a) for a in per_bin])
            extra.append(max(0.0, float(total) - 1.0) if isinstance(total, (int, float)) else 0.0)
        self._cal_edges, self._acc, self._extra = edges, acc, extra
        return None

    def calibration_bin(self, value: float | None) -> int | None:
        """The calibration bin of a signal value (None: no signal yet), for the cost model's expectations."""
        if value is None or not math.isfinite(value):
            return None
        s = self._sign * value
        return sum(1 for e in self._cal_edges if s >= e)

    def node_budget(self, batch_size: int) -> int | None:
        """:func:`node_budget` with this scheduler's ``max_verify_tokens_per_step``; None (no cap) under the
        ``"measured"`` load policy unless ``max_verify_tokens_per_step`` was given."""
        if self.measured and self.max_verify_tokens_per_step is None:
            return None
        return node_budget(batch_size, self.max_verify_tokens_per_step)

    def exploring_budget(self, batch_size: int, explored: int = 1) -> int:
        """Draft nodes a step that drafts to measure drafting again may carry (:meth:`StepCosts.needs_exploration
        <vllm_entmtp.step_costs.StepCosts.needs_exploration>`): the default cap's, and at least the ladder's
        smallest tree for every request, so that the step measures rows up to about twice the batch (from 32
        requests on the cap leaves none; one tree of one node measured a step of 33 rows, beyond which the rows'
        curve prices a draft row at a plain token's mean, so no draft could pay at 32 requests); every second
        exploring step of a batch size (``explored``: its count, this one included) half of that (where it is
        more than the cap's room: from about 22 requests on), so that the drafted steps' line
        (:meth:`StepCosts.curve <vllm_entmtp.step_costs.StepCosts.curve>`) has two draft-row counts apart where
        the schedule drafts nothing else."""
        smallest = min((n for n in self._nodes if n > 0), default=0)
        every = smallest * batch_size // (2 if explored % 2 == 0 else 1)
        return max(node_budget(batch_size, DEFAULT_MAX_VERIFY_TOKENS), every, smallest)

    # -- measured step costs (load policy "measured") ---------------------------------------------------------

    def _curve(self, costs: StepCosts, batch_size: int, max_nodes: int) -> list[float] | None:
        """Row-bound step time with ``n = 0 .. max_nodes`` draft nodes over ``batch_size`` roots (seconds)."""
        return costs.curve(batch_size, max_nodes)

    def drafting_pays(self, batch_size: int, costs: StepCosts, drafting: int | None = None,
                      token_value: float | None = None) -> bool:
        """Whether any draft can raise this batch's tokens per second at the best acceptance the calibration
        knows: ``k`` requests (any ``k`` up to ``drafting``, the requests that may draft from the heads this step;
        None: all of them) drafting one tree of the ladder each at its best calibration bin's
        expected accepted tokens, against a step without drafts, the drafting up to the choice included (the
        levels after it are left to the choice, :meth:`_fit_measured`: this test is the optimistic one); and,
        once measured,
        the heads' realised yield at this batch size (accepted draft tokens per second they added to the step,
        :meth:`StepCosts.heads_yield <vllm_entmtp.step_costs.StepCosts.heads_yield>`) must beat the plain step's
        tokens per second, unless the realised comparison at this batch size
        (:meth:`StepCosts.step_rates <vllm_entmtp.step_costs.StepCosts.step_rates>`) has the steps that verified
        drafts ahead of those that verified none by its margin (the option ``compare_margin``): it measures
        what the yield estimates (the yield prices the heads' rows by the step-cost curve, and charges a drafting
        step's fixed cost to the heads alone). Served,
        creative writing at 32 running (2026-12-05, AMX Xeon), the yield read 504 tokens/s against the plain
        step's 511 and stopped the heads while the steps that had verified drafts emitted 575 tokens/s against 481
        for the steps without. False: skip the heads for this step. True when the costs are not measured enough
        to say.

        ``token_value``: the seconds of step time an accepted draft token is worth (:meth:`StepCosts.token_value
        <vllm_entmtp.step_costs.StepCosts.token_value>`, while the batch drains); None: the plain step's time
        per token at this batch size. With it, a draft pays where its accepted tokens' worth is more than the
        time it adds, the heads' yield is held against ``1 / token_value`` and the realised comparison (tokens
        per second of the whole batch) has no say."""
        if not self.measured or batch_size < 1:
            return True
        k_max = max((n for n in self._nodes), default=0)
        curve = self._curve(costs, batch_size, batch_size * k_max)
        if curve is None:
            return True
        d = costs.draft_time(batch_size)
        plain = batch_size / curve[0] if token_value is None else 1.0 / token_value
        realised = costs.heads_yield(batch_size)
        # the heads, as they have fared at this batch size, unless the steps that verified drafts here emitted
        # compare_margin more tokens per second than those that verified none (every cost measured, where the
        # yield prices the rows)
        if realised is not None and realised <= plain:
            rates = None if token_value is not None else costs.step_rates(batch_size)
            if rates is None or drafts_behind(rates, costs.margin):
                self.stats.not_paying += 1
                return False
        # the drafting time is the heads' pass, whatever the requests it serves (the lm_head's weights are read
        # once): a few requests left to the heads (the rest take their lookup draft) may not carry it
        most = batch_size if drafting is None else min(drafting, batch_size)
        for b, n in enumerate(self._nodes):
            if n == 0:
                continue
            a = max(self._acc[b])
            for k in range(1, most + 1):
                if (batch_size + k * a) / (curve[k * n] + d) > plain if token_value is None else (
                        k * a * token_value > curve[k * n] + d - curve[0]):
                    return True
        self.stats.not_paying += 1
        return False

    def paying_ratio(self, batch_size: int, costs: StepCosts, token_value: float | None = None,
                     drafting: int | None = None) -> float | None:
        """The least acceptance record (:meth:`acceptance_ratio`) at which a request's heads could pay at
        ``batch_size`` requests: some tree of the ladder, at its best calibration bin's expected accepted tokens
        scaled by the record, raises the step's tokens per second for its rows (alone, or as the last rows of a
        step in which every request drafts: a drafting step's fixed cost is shared, :meth:`StepCosts.curve
        <vllm_entmtp.step_costs.StepCosts.curve>`) and its share of the drafting time (the batch size's
        measured drafting time over its requests). Computed once per step for the batch
        (:meth:`request_may_pay` compares each request's record with it). The best bin is taken as a request's
        confidence is not known before the heads run, so no request is dropped that the choice after them
        (:meth:`_fit_measured`) would keep for the same record. None where the costs are not measured enough to
        say, or under another load policy. ``token_value``: as for :meth:`drafting_pays`; ``drafting``: the
        requests that may draft from the heads this step (None: all of them), who share the drafting time and whose
        trees are the last rows of the step.

        At 16 running the heads' pass over the batch cost 1.9 ms of an 18-ms step (2026-12-03, in-process,
        bfloat16, GSM8K), about five draft rows' worth; run for requests whose drafts are mostly rejected (chat,
        where the heads are weakest), it bought nothing: they were dropped by the choice after it."""
        if not self.measured or batch_size < 1:
            return None
        k_max = max(self._nodes, default=0)
        curve = self._curve(costs, batch_size, batch_size * k_max)
        if curve is None:
            return None
        most = batch_size if drafting is None else max(min(drafting, batch_size), 1)
        share = costs.draft_time(batch_size) / most
        plain = batch_size / curve[0] if token_value is None else 1.0 / token_value
        need = math.inf
        for b, n in enumerate(self._nodes):
            best = max(self._acc[b]) if n else 0.0
            if n == 0 or best <= 0:
                continue
            # its rows alone, or the last of every request's same tree (a drafting step's fixed cost is shared)
            every = most * n
            extra = min(curve[n] - curve[0], curve[every] - curve[every - n]) + share
            need = min(need, 0.0 if extra <= 0 else plain * extra / best)
        return need

    def request_may_pay(self, req_id: str, paying_ratio: float | None) -> bool:
        """Whether the heads should run for ``req_id`` this step: its acceptance record is above
        ``paying_ratio`` (:meth:`paying_ratio` of the step's batch size); True without a record of
        :data:`ACCEPTANCE_MIN_STEPS` verified drafts, or where ``paying_ratio`` is None."""
        if paying_ratio is None:
            return True
        st = self._acc_obs.get(req_id)
        if st is None or st[2] < ACCEPTANCE_MIN_STEPS:
            return True
        return self.acceptance_ratio(req_id) > paying_ratio

    def acceptance_ratio(self, req_id: str) -> float:
        """What a request accepted over what the calibration expected of its drafts (EMAs over about
        ``acceptance_window`` drafting steps (the option, as the tracker's), clipped to :data:`ACCEPTANCE_RATIO_RANGE`); 1 before
        :data:`ACCEPTANCE_MIN_STEPS` of its drafts were verified. The measured rule scales the calibration's
        expectations by it: text the heads predict worse than the calibration prompts drafts less."""
        st = self._acc_obs.get(req_id)
        if st is None or st[2] < ACCEPTANCE_MIN_STEPS or st[1] <= 0:
            return 1.0
        lo, hi = ACCEPTANCE_RATIO_RANGE
        return min(max(st[0] / st[1], lo), hi)

    def observe_acceptance(self, req_id: str, expected: float, accepted: int) -> None:
        """A verified draft of ``req_id``: ``expected`` accepted draft tokens (:attr:`expected` when it was
        chosen), ``accepted`` of them accepted (bonus excluded)."""
        st = self._acc_obs.setdefault(req_id, [0.0, 0.0, 0])
        b = 1.0 - 1.0 / self.acceptance_window
        st[0] = b * st[0] + (1.0 - b) * float(accepted)
        st[1] = b * st[1] + (1.0 - b) * float(expected)
        st[2] += 1

    def _beyond(self, ladder_bin: int, covered_levels: int) -> int:
        """Head levels the tree of ``ladder_bin`` needs beyond the ``covered_levels`` the confidence pass ran
        (0 for no draft)."""
        tree = self.ladder[ladder_bin] if ladder_bin < len(self.ladder) else None
        return max(tree.depth - covered_levels, 0) if tree is not None and tree.num_nodes else 0

    def _fit_measured(self, bins: list[int], cal_bins: list[int | None], costs: StepCosts,
                      scale: list[float] | None = None, sunk: float = 0.0, covered_levels: int = 0,
                      step_up: bool = True, token_value: float | None = None) -> bool:
        """Step bins down in place while a step down gives up fewer expected tokens per second saved than the
        step's tokens per second, on measured step costs (:class:`~vllm_entmtp.step_costs.StepCosts`); then, if
        a step without drafts is faster per token still, no request drafts. False (nothing changed) when the
        costs are not measured enough for this batch size.

        ``sunk``: seconds of this step's drafting already spent (the heads' confidence pass, run before the
        choice): a step costs them whether it drafts or not, so only the rest of the drafting time (the batch
        size's measured drafting time less ``sunk``, at least 0) is charged to drafting.

        The drafts after the choice are priced by depth where the heads' further levels are measured
        (:meth:`StepCosts.level_time <vllm_entmtp.step_costs.StepCosts.level_time>`): a fixed part, and one
        level's time for each depth of the deepest chosen tree beyond ``covered_levels`` (the heads the
        confidence pass ran). A Hydra head runs once per depth for all the requests that reach it, so one
        request's second draft token can cost the whole step a level; besides each request's step down, the
        rule weighs stepping every request at the deepest depth down together (each to its first rung that is
        shallower), which saves that level.

        ``token_value``: the seconds of step time an accepted draft token is worth (:meth:`drafting_pays`); with
        it, a request steps down while what it gives up is worth less than the time saved, and nobody drafts
        where the drafts' accepted tokens are worth less than the time they add."""
        k, b_size = len(self.ladder), len(bins)
        nodes = [self._nodes[b] if b < k else 0 for b in bins]
        curve = self._curve(costs, b_size, sum(nodes))
        if curve is None:
            return False
        sunk = max(float(sunk), 0.0)
        fixed, per = max(costs.draft_time(b_size) - sunk, 0.0), 0.0
        levels = costs.level_time(b_size)
        if levels is not None:
            fixed, per = fixed + levels[0], levels[1]
        scale = scale or [1.0] * b_size
        acc = [self.expected_accepted(b, c) * f for b, c, f in zip(bins, cal_bins, scale)]
        beyond = [self._beyond(b, covered_levels) for b in range(k)] + [0]  # per rung; past the ladder: none
        dep = [beyond[b] for b in bins]
        depths = Counter(d for d in dep if d > 0)  # requests per depth beyond the pass
        total = sum(nodes)

        def time_of(n: int, depth: int) -> float:
            return curve[n] + sunk + (fixed + per * depth if n > 0 else 0.0)

        def rung(i: int, nb: int) -> tuple[int, float, int]:  # nodes, expected tokens, depth of request i at nb
            if nb >= k:
                return 0, 0.0, 0
            n = self._nodes[nb]
            return n, self.expected_accepted(nb, cal_bins[i]) * scale[i], beyond[nb]

        tokens = b_size + sum(acc)
        while total > 0:
            deep = max(depths, default=0)
            below = max((d for d in depths if d < deep), default=0)  # the deepest once the deepest are gone
            now = time_of(total, deep)
            best = None
            for i, b in enumerate(bins):
                if b >= k or nodes[i] == 0:
                    continue
                n_new, a_new, d_new = rung(i, b + 1)
                rest = below if dep[i] == deep and depths[deep] == 1 else deep
                d_t = now - time_of(total - nodes[i] + n_new, max(rest, d_new))
                if d_t <= 0:
                    continue
                ratio = (acc[i] - a_new) / d_t
                if best is None or ratio < best[0] or (ratio == best[0] and i > best[1][0][0]):
                    best = (ratio, [(i, b + 1, n_new, a_new, d_new)])
            if per > 0 and deep > 0 and depths[deep] > 1:  # the deepest requests together, to a shallower rung
                moves, n_after, a_gone, d_after = [], total, 0.0, below
                for i in (i for i in range(b_size) if dep[i] == deep):
                    nb = bins[i] + 1
                    while nb < k and beyond[nb] >= deep:
                        nb += 1
                    n_new, a_new, d_new = rung(i, nb)
                    moves.append((i, nb, n_new, a_new, d_new))
                    n_after += n_new - nodes[i]
                    a_gone += acc[i] - a_new
                    d_after = max(d_after, d_new)
                d_t = now - time_of(n_after, d_after)
                if d_t > 0 and (best is None or a_gone / d_t < best[0]):
                    best = (a_gone / d_t, moves)
            if best is None or best[0] >= (tokens / now if token_value is None else 1.0 / token_value):
                break
            for i, nb, n_new, a_new, d_new in best[1]:
                total += n_new - nodes[i]
                tokens += a_new - acc[i]
                if dep[i]:
                    depths[dep[i]] -= 1
                    if not depths[dep[i]]:
                        del depths[dep[i]]
                if d_new:
                    depths[d_new] += 1
                bins[i], nodes[i], acc[i], dep[i] = nb, n_new, a_new, d_new
                self.stats.cost_stepdowns += 1
                if nb >= k or self.ladder[nb] is None:
                    self.stats.no_draft += 1
        drafted = time_of(total, max(depths, default=0))
        if total > 0 and (b_size / time_of(0, 0) >= tokens / drafted if token_value is None
                          else (tokens - b_size) * token_value <= drafted - time_of(0, 0)):
            for i, b in enumerate(bins):
                if b < k and nodes[i] > 0:
                    bins[i] = k
                    self.stats.no_draft += 1
        elif total > 0 and step_up:
            self._step_up(bins, nodes, acc, dep, costs, per, rung)
        return True

    def _step_up(self, bins: list[int], nodes: list[int], acc: list[float], dep: list[int], costs: StepCosts,
                 per: float, rung) -> None:
        """Move drafting requests up the ladder in place where the step with the larger tree is measured faster.

        The rows' curve never falls (:meth:`StepCosts.curve <vllm_entmtp.step_costs.StepCosts.curve>`), but a
        step's time can: vLLM's CPU GEMMs took longer for one or two rows than for three to six on the 2-core
        EPYC (2026-12-05, bfloat16, ``benchmarks/gemm_rows.py``: the target's linear layers took
        9.8 ms at 1 row, 10.6 ms at 2, 8.5-8.9 ms at 3 to 6), and in-process at one request (``step_profile.py``, mixed
        prompts) a step that verified 2 rows (a chain of one draft token) took 20.0 ms, one of 3 rows 18.2 ms;
        the shipped schedule drafted a chain of one in 104 of 262 steps. Where a request's next rung up (more
        nodes, no fewer expected accepted tokens) gives a row count whose own measured time
        (:meth:`StepCosts.measured_time <vllm_entmtp.step_costs.StepCosts.measured_time>`), plus the head levels
        it adds, is :data:`~vllm_entmtp.step_costs.STEP_UP_MARGIN` below the current row count's, the request
        moves up, the largest saving first, until no move saves. Both row counts must be measured on their own:
        nothing is interpolated, so only what this machine did decides. Not in a step where some requests take
        prompt-lookup drafts instead (:meth:`~vllm_entmtp.scheduler.TreeScheduler.choose`'s ``skip``): their rows
        are not counted here, so the row counts compared would not be the step's. The rows table mixes batch
        sizes (3 rows: one request with two draft tokens, or three without). Once the step-up has replaced a row
        count, its observations age out (:data:`~vllm_entmtp.step_costs.ROWS_MAX_AGE`): a count the step-up left
        (:meth:`~vllm_entmtp.step_costs.StepCosts.left_rows`) is then read from its last observations (``kept``)
        for :data:`~vllm_entmtp.step_costs.KEPT_MAX_AGE` more steps, after which the step-up stops until it is
        measured again; the count it moves to must be measured now. ``rung(i, b)``: request ``i``'s nodes,
        expected accepted tokens and head levels beyond the confidence pass at ladder bin ``b``
        (:meth:`_fit_measured`'s)."""
        k, b_size = len(self.ladder), len(bins)
        total = sum(nodes)
        for _ in range(b_size * k):
            now_rows = costs.measured_time(b_size + total, kept=True)
            if now_rows is None:
                return
            ranked = sorted(dep, reverse=True)
            deep, second = ranked[0], (ranked[1] if len(ranked) > 1 else 0)
            now = now_rows + per * deep
            best = None
            for i, b in enumerate(bins):
                if not 0 < b < k or nodes[i] == 0 or self.ladder[b - 1] is None:
                    continue
                n_new, a_new, d_new = rung(i, b - 1)
                if n_new <= nodes[i] or a_new < acc[i]:
                    continue
                t = costs.measured_time(b_size + total - nodes[i] + n_new)
                if t is None:
                    continue
                rest = second if dep[i] == deep else deep
                new = t + per * max(rest, d_new)
                if new <= now * (1.0 - STEP_UP_MARGIN) and (best is None or new < best[0]):
                    best = (new, i, n_new, a_new, d_new)
            if best is None:
                return
            _, i, n_new, a_new, d_new = best
            costs.left_rows(b_size + total)  # its observations may now age out: kept for measured_time(kept=True)
            total += n_new - nodes[i]
            bins[i] -= 1
            nodes[i], acc[i], dep[i] = n_new, a_new, d_new
            self.stats.cost_stepups += 1

    # -- prompt lookup as a second draft source (vllm_entmtp.lookup) ----------------------------------------------

    def best_expected(self, req_id: str) -> float:
        """The most accepted draft tokens the heads can expect for ``req_id`` this step: the best tree of the
        ladder at the best calibration bin, scaled by the request's :meth:`acceptance_ratio`; infinite for a set
        without build-trees statistics (nothing to compare a lookup draft with before the heads run)."""
        best = max((max(a) for a, t in zip(self._acc, self.ladder) if t is not None and a), default=None)
        return math.inf if best is None else best * self.acceptance_ratio(req_id)

    def chosen_expected(self, req_id: str, tree: Tree | None) -> float:
        """Expected accepted draft tokens of the heads' draft chosen for ``req_id`` this step (``tree``; None: no
        draft), scaled by its :meth:`acceptance_ratio`; without build-trees statistics, one token per head of
        the tree's depth times the fallback's guess of one half."""
        if tree is None:
            return 0.0
        e = self.expected.get(req_id)
        if e is None:
            return 0.5 * max(tree.depths, default=0)
        return e * self.acceptance_ratio(req_id)

    def fit_lookup(self, batch_size: int, nodes: list[int], acc: list[float], cands: dict[int, Sequence[float]],
                   costs: StepCosts | None, budget: int | None = None,
                   token_value: float | None = None) -> dict[int, int]:
        """Which requests draft their prompt-lookup chain instead of the heads' draft, and how much of it.

        Args:
            batch_size: the step's requests.
            nodes, acc: per request, the draft nodes and expected accepted tokens of the heads' choice (0, 0: none).
            cands: request index -> expected accepted tokens of its lookup chain's first 1, 2, ... tokens (the
                last: the whole chain; :meth:`PromptLookup.expected <vllm_entmtp.lookup.PromptLookup.expected>`).
            costs: measured step costs (load policy ``"measured"``), or None.
            budget: the draft nodes the step may carry in all (:meth:`node_budget`: the cap of verified rows
                less one root per request); None: no cap.
            token_value: the seconds of step time an accepted draft token is worth (:meth:`drafting_pays`); None:
                the step's tokens per second decides.

        Returns: request index -> the tokens of its chain it drafts, for the requests that switch.

        A lookup draft replaces the heads' where it expects at least as many accepted tokens; requests switch in
        order of expected tokens gained per row added, while the step's draft nodes stay within ``budget`` and,
        under measured costs, where the switch raises the step's expected tokens per second
        (:class:`~vllm_entmtp.step_costs.StepCosts`). Under measured costs a chain is cut to the prefix
        that raises the step's tokens per second most (with ``token_value``: whose accepted tokens' worth exceeds
        the time its rows add by most), given the switches before it, and cut again once all are made (they raise
        the step's rate, so a further token must bring more): a chain's later tokens are accepted only after all
        before them, so each is less likely accepted than the one before and can cost more rows than it returns.
        Served on the 2-core EPYC (2026-12-06, bfloat16, GSM8K at 16 running,
        ``benchmarks/results/lookup-length-epyc-2026-12-06/``), lookup drafts were whole chains of 4 tokens of
        which 1.9 were accepted, where a draft row cost about 0.55 of a plain token's time. Without measured
        costs every chain is drafted whole.
        """
        better = [i for i, e in cands.items() if e and e[-1] > 0 and e[-1] >= acc[i]]
        curve = None
        if costs is not None and self.measured and better:
            extra = sum(len(cands[i]) for i in better)
            curve = self._curve(costs, batch_size, sum(nodes) + extra)
        if curve is None and budget is None:
            return {i: len(cands[i]) for i in sorted(better)}
        total, tokens = sum(nodes), batch_size + sum(acc)

        def score(t: float, n: int) -> float:  # a step of t expected tokens over n draft nodes: the higher, the better
            return t / curve[n] if token_value is None else t * token_value - curve[n]

        better.sort(key=lambda i: -(cands[i][-1] - acc[i]) / max(len(cands[i]) - nodes[i], 0.5))
        out = {}
        for i in better:
            # the prefixes that fit and expect no fewer tokens than the heads' draft (without costs: the whole chain)
            lengths = [m for m in range(1, len(cands[i]) + 1) if cands[i][m - 1] >= acc[i]] if curve is not None \
                else [len(cands[i])]
            lengths = [m for m in lengths if budget is None or total - nodes[i] + m <= max(budget, total)]
            if not lengths:
                continue  # past the cap (a switch that adds no node always fits)
            switched = [(tokens - acc[i] + cands[i][m - 1], total - nodes[i] + m, m) for m in lengths]
            t_new, n_new, m = switched[-1] if curve is None else max(switched, key=lambda s: score(s[0], s[1]))
            if curve is None or score(t_new, n_new) > score(tokens, total):
                out[i] = m
                tokens, total = t_new, n_new
        # each chain was cut at the rate of the step as it stood then; the later switches raised it, so an earlier
        # chain's last tokens may no longer pay: cut them again until none does
        cut = curve is not None
        while cut:
            cut = False
            for i, m in out.items():
                shorter = [(tokens - cands[i][m - 1] + cands[i][k - 1], total - m + k, k) for k in range(1, m)
                           if cands[i][k - 1] >= acc[i]]
                shorter = [s for s in shorter if score(s[0], s[1]) > score(tokens, total)]
                if shorter:
                    tokens, total, out[i] = max(shorter, key=lambda s: score(s[0], s[1]))
                    cut = True
        return dict(sorted(out.items()))

    def expected_accepted(self, ladder_bin: int, cal_bin: int | None) -> float:
        """The cost model's expected accepted draft tokens of ladder bin ``ladder_bin`` (``K``: no drafting) for a
        request in calibration bin ``cal_bin`` (None: the mean over the bins)."""
        if ladder_bin >= len(self.ladder):
            return 0.0
        per_bin = self._acc[ladder_bin]
        return sum(per_bin) / len(per_bin) if cal_bin is None else per_bin[cal_bin]

    def step_cost(self, bins: Sequence[int]) -> float:
        """The cost model's time of a step whose requests draft the trees of ladder bins ``bins``, in plain
        one-request steps: ``1 + d * (B - 1)`` plus each drafting tree's measured extra cost."""
        k = len(self.ladder)
        return 1.0 + self.decode_row_cost * (len(bins) - 1) + sum(self._extra[b] for b in bins if b < k)

    def _fit_cost(self, bins: list[int], cal_bins: list[int | None]) -> None:
        """Step bins down in place while a step down gives up fewer expected tokens per unit of time saved than
        the step's tokens per unit of time (bin ``K`` = no drafting)."""
        k = len(self.ladder)
        tokens = len(bins) + sum(self.expected_accepted(b, c) for b, c in zip(bins, cal_bins))
        time = self.step_cost(bins)

        def move(i: int):  # (dA / dT, -i, dA, dT) of request i's next step down, or None
            b = bins[i]
            if b >= k:
                return None
            d_t = self._extra[b] - (self._extra[b + 1] if b + 1 < k else 0.0)
            if d_t <= 0:
                return None
            d_a = self.expected_accepted(b, cal_bins[i]) - self.expected_accepted(b + 1, cal_bins[i])
            return (d_a / d_t, -i, d_a, d_t)

        heap = [m for m in (move(i) for i in range(len(bins))) if m is not None]
        heapq.heapify(heap)
        while heap and heap[0][0] < tokens / time:
            _, neg_i, d_a, d_t = heapq.heappop(heap)
            i = -neg_i
            bins[i] += 1
            tokens, time = tokens - d_a, time - d_t
            self.stats.cost_stepdowns += 1
            if bins[i] >= k or self.ladder[bins[i]] is None:
                self.stats.no_draft += 1
            m = move(i)
            if m is not None:
                heapq.heappush(heap, m)

    def _fit(self, bins: list[int], budget: int) -> None:
        """Step bins down in place until the nodes fit ``budget`` (bin ``K`` = no drafting, 0 nodes)."""
        k = len(self.ladder)
        nodes = self._nodes + [0]  # bin k (past the ladder, where the cost model may have put a request): none
        total = sum(nodes[b] for b in bins)
        if total <= budget:
            return
        # max-heap on (nodes, index): the largest tree first, the later request on a tie; no-draft bins stay
        heap = [(-nodes[b], -i) for i, b in enumerate(bins) if b < k]
        heapq.heapify(heap)
        while total > budget and heap:
            neg_n, neg_i = heapq.heappop(heap)
            i = -neg_i
            b = bins[i] + 1
            bins[i] = b
            self.stats.budget_stepdowns += 1
            if b < k:
                total += nodes[b] + neg_n
                heapq.heappush(heap, (-nodes[b], neg_i))
            else:
                total += neg_n
                self.stats.no_draft += 1
