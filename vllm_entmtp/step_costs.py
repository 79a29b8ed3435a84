"""Step costs measured on the running engine, for the load rule (engine-independent; no vLLM import).

What a draft token costs depends on the machine and the batch: on a 2-core Xeon with AVX-512 BF16 (2026-12-01,
``benchmarks/step_profile.py``, bfloat16) the target's forward over 1 row took 18.8 ms and over 2.6 rows 20.2 ms,
so at one request a draft row cost 0.9 ms, a twentieth of a step; over 16 rows it took 43 ms and over 32 rows
86 ms, so at 16 requests a draft row cost 2.7 ms, most of a plain token's 3.3 ms. A fixed cap on the rows per
step cannot be right on both machines and both loads; measured costs can.

:class:`StepCosts` keeps, per number of rows ``R`` a decode step verified, the recent times of the step's part
that grows with its rows (the forward, the logits, sampling and verification; the last :data:`WINDOW` of the last
:data:`ROWS_MAX_AGE` engine steps, as they depend on the contexts running), and per batch size the recent times
of drafting. :meth:`StepCosts.rows_time` interpolates between measured row counts (piecewise linear; beyond the
largest, the steeper of the last segment's slope and the mean slope). The scheduler
(:meth:`~vllm_entmtp.scheduler.TreeScheduler.choose` with ``costs``) keeps a request's draft only while its
expected accepted tokens per second of extra step time beat the step's own tokens per second. The drafts after
the schedule's choice are priced by depth (:meth:`StepCosts.level_time`): a Hydra head runs once per depth for
every request that reaches it, so the deepest tree of the batch sets what they cost.

Where a batch size's plain step is neither measured (a step without draft tokens at that many rows) nor
between two measured row counts, the drafter makes a *probe*: one step of that batch without drafts
(:meth:`StepCosts.needs_probe`); a measured batch size is probed again every :data:`PROBE_EVERY` of its steps, so
that the costs follow the contexts as they grow. Rows beyond the largest measured count are extrapolated (no
less steeply than the mean time per row), not probed: where that is pessimistic the rule drafts less than it
could, never more, until an exploring step (below) measures a step of more rows.

Two guards keep one bad observation from stopping the drafts for good (seen 2026-12-02 on a served bfloat16
engine: the heads' first call took 237 ms, against about 2 ms after, and since the rule then found that no draft
pays, the heads never ran again, so the estimate never changed and the server drafted from prompt lookup only):

* the first observation of a row count or a batch size is dropped when the second arrives (it carries one-time
  costs: kernels built for a new shape, memory first touched); alone, it stands;
* where drafting does not pay, every :data:`PROBE_EVERY` such steps of a batch size (every
  :data:`EXPLORE_UNMEASURED_EVERY` while no step of more rows than the batch is measured: the extrapolation above
  prices each draft row there at no less than a plain token, so no draft could pay; or while the drafted steps'
  line of :meth:`StepCosts.curve` is not measured there, in steps where drafts pay) the drafter drafts anyway
  (:meth:`StepCosts.needs_exploration`, under the default cap of verified rows, or with room for the ladder's
  smallest tree for every request where that is more: a step of about twice the batch's rows), so that the
  drafting time and the draft rows' costs are measured again.

The heads' realised yield: the rule above judges a batch size by the calibration's best acceptance, so it may
run the heads every step where the schedule then drafts little from them (2026-12-02, in-process, 32 requests,
bfloat16: the heads ran every step for 2.1 ms of a 48-ms step while the schedule drafted 4.4 tokens a step
from them over the 32 requests).
:meth:`StepCosts.record_heads_yield` keeps, per batch size, what each step in which the heads ran got from them
(their accepted draft tokens, known one step later) against what they added to it (the heads' part of the
drafter's time: their confidence, the schedule and their drafts, not prompt lookup and the tracker, which run
in every step; and their rows); where that yield (:meth:`StepCosts.heads_yield`) is below the plain step's
tokens per second, drafting does not pay at that batch size
(:meth:`~vllm_entmtp.load_rules.LoadRules.drafting_pays`), unless the realised comparison below has the steps
with drafts ahead there (the yield prices the heads' rows by the step-time line and charges them a drafting
step's whole fixed part). The heads then run only in the exploring steps above, whose yields are not kept (they
draft for every request, not as the rule would), until the low yield has aged out: the yield is judged over the
heads' steps among the last :data:`YIELD_MAX_AGE` engine steps, so that a stretch of text which the heads
predicted badly does not keep them off for good (then :data:`YIELD_MIN_STEPS` steps of the heads judge the yield
again). The realised comparison below judges the heads by the steps that verified their drafts, not by those of
prompt lookup's drafts alone (:data:`DRAFT_SOURCES`).

The realised comparison, over all of the above: the rules price draft rows and drafting from the rows' curve
and the calibration, which miss costs that depend on the workload (each draft row attends to its request's whole
context, so on long chat prompts it costs far more than on short code prompts) and overrate acceptance where the
text is not like the calibration's. :meth:`StepCosts.record_step` keeps, per batch size, what each decode step
emitted (one token per request plus its accepted draft tokens) and took (from its inputs to the end of its
drafting), apart for steps that verified draft tokens some of which came from the heads, steps that verified
prompt lookup's drafts alone, and steps that verified none (not the steps in which a request held itself to a
tree; a step whose drafting ran the heads counts as theirs whatever it verified, as their time is in it, so that
the steps without drafts are what resting costs), among the last :data:`STEP_RATE_MAX_AGE` engine steps (a
drafted step also leaves once as many requests as its batch size have finished since: :meth:`StepCosts.tick`;
steps without drafts at another batch size than the drafted ones are moved to it by the plain steps' tokens per
second, :meth:`StepCosts.step_rates`); where the steps with the heads' drafts have not emitted the option
``compare_margin`` (default :data:`COMPARE_MARGIN`) more tokens per second than those without
(:meth:`StepCosts.drafting_loses`; a tie costs what single steps do not show), the heads do not run at that batch
size and explore as above (2026-12-02,
served, ShareGPT, 16 running, bfloat16: entmtp ran 0.78-0.92x plain decoding while drafting in a quarter of the
request-steps); prompt lookup still drafts there unless the steps with its drafts alone lose the same comparison
(``source="lookup"``), as its drafts cost no head and on chat are accepted far more often under load
(:data:`DRAFT_SOURCES`). Both sides of
the comparison must come from the text now running: where drafted steps near a batch size are recent enough to
compare but steps without drafts are not, the drafter drafts nothing in the next steps of that batch size until
they are (:meth:`StepCosts.needs_reference`; otherwise drafting goes on unjudged wherever the steps have drafted
since their last plain step). A batch size with no comparison of its own takes the loss of the largest smaller
batch size that has one (per source): drafting only gets dearer as the batch grows, so it is not tried afresh
there (it is still explored).

While the batch drains (requests finish and none arrive: the end of a burst, or a benchmark's level of as many
requests as run at once; :class:`Refills`), a batch's time is the steps of its last request to finish plus a row
for every token and draft row: an accepted draft token of a request that finishes before the last saves one row
of a later step, less than the draft rows cost, and only the requests with the most tokens left bring the end
sooner. There only those requests may draft (:func:`last_to_finish`), and where they are clearly behind the rest
an accepted draft token of theirs is worth a step of the batch that will be left at the end, shared by the
requests in it (:meth:`StepCosts.token_value`), more than a plain token of the batch now running: the rules weigh
their drafts by that worth, and the realised comparison (tokens per second of the whole batch) neither judges
those steps nor takes them in.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque

#: Observations kept per row count (and per batch size for drafting); the median of these is used.
WINDOW = 16
#: A row count's observations are dropped once they are this many engine steps old (:meth:`StepCosts.tick`, any
#: batch size): a step of 32 rows costs what the contexts now running make it cost. Kept without age, the plain
#: steps at 32 requests of a served ShareGPT level (long prompts, 83 ms) priced the draft rows of a GSM8K level
#: at 32 requests two levels later (short prompts: 49-56 ms a plain step, about 1.7 ms a draft row) at about
#: 0.3 ms a row (read from vLLM's iteration times, not from the drafter), and GSM8K's steps at 32 requests
#: verified 55-92 rows where in-process, measured afresh, they verified 36-46 (2026-12-04,
#: ``benchmarks/results/served-check-2026-12-04c/``). Where a batch size's row count ages out, it is probed again
#: (:meth:`StepCosts.needs_probe`); with 64 steps between probes and between the exploring steps of a resting
#: batch size (:data:`PROBE_EVERY`), 256 keeps a few of each.
ROWS_MAX_AGE = 256
#: A batch size's no-draft time is measured again after this many of its steps.
PROBE_EVERY = 64
#: Where no step of more rows than a batch size is measured, it explores drafting every this many steps in which
#: no draft pays (:meth:`StepCosts.needs_exploration`). Served on the 2-core EPYC (2026-12-03, bfloat16, GSM8K, a
#: fresh server, 64 requests a level; ``benchmarks/results/load-learning-2026-12-03/``): at one exploring step in
#: 64, the first level at 16 running drafted in 2-3 % of its request-steps (three servers); at one in 8, in 16 and
#: 56 % (two servers).
EXPLORE_UNMEASURED_EVERY = 8
#: Measured row counts it takes to fit a line to the step time near a batch (:meth:`StepCosts.curve`).
FIT_MIN_POINTS = 3
#: Two draft-row counts of drafted steps this far apart are enough for the drafted steps' line
#: (:meth:`StepCosts.curve`): an exploring step (a tree for every request) and the rule's own steps of a few draft
#: rows.
DRAFTED_FIT_SPAN = 8
#: Decode steps that verified draft tokens, and steps that verified none, that it takes to compare the two at a
#: batch size (:meth:`StepCosts.drafting_loses`).
COMPARE_MIN_DRAFTING = 8
COMPARE_MIN_PLAIN = 4
#: The steps that verified draft tokens must emit this share more tokens per second than those that verified none for
#: drafting to go on (:func:`drafts_behind`; the default of the option ``compare_margin``). A tie costs what the tokens
#: per second of single steps do not show: requests that accept different numbers of draft tokens finish at different
#: steps, so a level's last steps run fewer requests, and their successors arrive one or two at a time, each prompt in a
#: step of its own, where plain decoding's equal-length requests finish together and their successors' prompts run in
#: one step. Served on the 2-core EPYC (2026-12-05, bfloat16, GSM8K, 32 requests at 16 running): the steps with drafts
#: tied the steps without (359 against 365 tokens/s), the decode steps took 11.5 s against plain decoding's 11.6 s, and
#: the steps with prompt tokens 4.9 s against 4.1 s (13 steps against 4): the level ran 0.96x.
COMPARE_MARGIN = 0.05
#: Where the drafts a decode step verified came from, for the realised comparison (:meth:`StepCosts.record_step`):
#: ``"heads"``, some from the heads; ``"lookup"``, all from prompt lookup. The two are compared with the steps
#: without drafts apart. Served at 32 running on ShareGPT (2026-12-06, AMX Xeon, bfloat16, answers of up to 256
#: tokens; ``benchmarks/results/served-amx-2026-12-06/``, trace ``t42b-6107``), the steps at 30 requests that
#: verified the heads' drafts alone (28 draft tokens a step, 12 accepted) emitted 273 tokens/s against 297 for
#: steps without drafts, and that verdict, read by the batch sizes around it, stopped every draft from 29 to 26
#: requests, prompt lookup's too, whose drafts had made the steps at 31 requests (25 of their 31 draft tokens from
#: lookup, 24 accepted) emit 396 tokens/s against 307 without.
DRAFT_SOURCES = ("heads", "lookup")
#: The realised comparison's kinds of decode steps: by the source of their drafts, and ``"none"`` (no drafts).
STEP_KINDS = (*DRAFT_SOURCES, "none")
#: Steps in which the heads ran that it takes to judge a batch size's yield (of those of the last
#: :data:`YIELD_MAX_AGE` steps).
YIELD_MIN_STEPS = 8
#: The heads' yield is judged over their steps among the last this many engine steps in which the drafter ran
#: (:meth:`StepCosts.tick`), of any batch size. Where a low yield stopped the heads, it stands until fewer than
#: :data:`YIELD_MIN_STEPS` of its observations are that recent (up to that many steps; exploring steps' yields are
#: not kept); then the calibration decides again and fresh observations judge anew. Before (the last 16 steps in
#: which the heads ran, with no age), two things went wrong at one request, in-process, bfloat16 (2026-12-03): on
#: ShareGPT the first requests' yield (45-49 accepted tokens per second added, under plain decoding's 75-92) kept
#: the heads off five requests in all but 3 exploring steps, and on creative writing a stretch of 16 steps in which
#: the confidence pass drafted nothing read a yield of 0 and stopped the heads, while in both the steps that
#: verified drafts emitted 105-249 tokens per second against 75-95 for steps that verified none.
YIELD_MAX_AGE = 64
#: The realised comparison (:meth:`StepCosts.drafting_loses`) reads the decode steps among the last this many
#: engine steps in which the drafter ran (:meth:`StepCosts.tick`), of any batch size: a verdict that drafting loses
#: lapses once fewer than :data:`COMPARE_MIN_DRAFTING` of its drafted steps are that recent, and the drafts of the
#: text now running judge anew (where the load rule says a draft could pay at all). Before (the last 16 drafted
#: steps, with no age), in-process at one request on ShareGPT (2026-12-04, bfloat16, 8 prompts of 128 tokens one
#: after another), a stretch in which one request's drafts were mostly rejected made the drafter rest in 99 and 129
#: of 603 and 684 steps (two runs), through the next requests, while over each run its steps with drafts emitted
#: 191-239 tokens per second against 85-91 for steps without: while it rests only exploring steps (1 in
#: :data:`PROBE_EVERY`) draft, too few to move a window of 16. Aged, the same run rested in none
#: (``benchmarks/results/lookup-and-rest-2026-12-04/``). Aged by steps of their own batch size instead (c03610b),
#: a served level of 32 GSM8K requests compared its drafted steps with the steps without drafts at 32 of the
#: ShareGPT level before it (long prompts: 83 ms a step against GSM8K's 49-56 ms), found that drafting paid, and
#: drafted in 49 of its 50 steps at 32 requests (98.6 ms each), 7 % slower than plain decoding
#: (``benchmarks/results/served-check-2026-12-04b/``). Aged by steps of any batch size, the comparison at 32 had no
#: step without drafts left there (none of them comes while drafting pays) and formed no verdict
#: (``benchmarks/results/served-check-2026-12-04/``): hence :meth:`StepCosts.needs_reference`.
STEP_RATE_MAX_AGE = 128

#: Observations of a row count that :meth:`StepCosts.measured_time` needs to read it on its own.
POINT_MIN_OBS = 8
#: After the observations of a row count that the step-up left (:meth:`StepCosts.left_rows`, within
#: :data:`ROWS_MAX_AGE` steps) have aged below :data:`POINT_MIN_OBS`, :meth:`StepCosts.measured_time` with
#: ``kept=True`` still reads the last of them for this many more engine steps. The step-up
#: (:meth:`~vllm_entmtp.load_rules.LoadRules._step_up`) keeps a row count from being verified, so its observations
#: age out (:data:`ROWS_MAX_AGE`), and the step-up then paused until that count was measured again: in-process at
#: one request on the 2-core EPYC (2026-12-05, ``benchmarks/results/small-rows-epyc-2026-12-05/``) 17-47 steps of
#: about 550 still verified 2 rows (a chain of one draft token, the dearest step there). Four times the rows' own
#: age is a choice, not a measurement: long enough that the pause comes rarely, short enough to follow a machine
#: whose costs drift.
KEPT_MAX_AGE = 4 * ROWS_MAX_AGE
#: A request moves up to a larger tree only where the step with it is measured at least this share faster
#: (:meth:`~vllm_entmtp.load_rules.LoadRules._step_up`): two row counts' medians of a few steps each differ by a
#: few per cent with no cause.
STEP_UP_MARGIN = 0.03

#: Engine steps after a request finished within which a new request must arrive for the batch to count as refilled
#: (:class:`Refills`). Served on the 2-core EPYC (2026-12-05, HumanEval and GSM8K at 16 running, the benchmark's
#: client sending its next request as one ends), the next request's prompt ran 0 or 1 steps after the batch shrank.
REFILL_WAIT = 3
#: While the batch drains, a request counts among the last to finish where it has at most this share of the most
#: tokens left fewer than the request with the most (:func:`last_to_finish`).
LAST_SHARE = 0.5


class Refills:
    """Whether the requests that finish are replaced by new ones (a server under steady load) or the batch drains
    (the last requests of a burst, or of a benchmark's level): the batch drains from the engine step
    :data:`REFILL_WAIT` steps after a request finished with no request arriving since, until one arrives.
    Before any request has finished since the batch last started from empty, it does not count as draining.

    It changes what an accepted draft token is worth (module docstring; :func:`last_to_finish`): under steady load
    it frees its request's place for the next request a step sooner, a plain step's time per request; while the
    batch drains it shortens the batch's time only if its request is among the last to finish, and otherwise saves
    one row of a later step. Served on the 2-core EPYC (2026-12-05, bfloat16, HumanEval, 32 requests at 32
    running), as the batch drained from 25 to 18 requests the drafter drafted 13-24 rows a step for ten steps
    (99-111 ms each, against about 62 ms for a plain step of 25 rows), the decode steps of the level taking 8.5 s
    against plain decoding's 8.1 s."""

    def __init__(self) -> None:
        self._finished: int | None = None  # clock of the first finish not yet followed by an arrival
        self._clock = 0
        self.draining = False

    def step(self, arrived: int, finished: int, continuing: int) -> None:
        """An engine step: ``arrived`` requests were scheduled for the first time, ``finished`` were announced
        finished, ``continuing`` were scheduled again (0: the batch starts anew)."""
        self._clock += 1
        if continuing == 0:  # the finishes announced with a batch that starts anew are the last batch's
            self._finished, self.draining = None, False
            return
        if finished and self._finished is None:
            self._finished = self._clock
        if arrived:
            self._finished, self.draining = None, False
        elif self._finished is not None and self._clock - self._finished >= REFILL_WAIT:
            self.draining = True


def last_to_finish(tokens_left: list[int | None], slack: int) -> list[bool]:
    """Which requests of a draining batch may draft: those with at most ``slack`` fewer tokens left (their
    ``max_tokens`` less their output so far) than the request with the most, or at most :data:`LAST_SHARE` of
    its tokens left fewer, whichever is more; a request whose tokens left are not known (None) may. A request
    further ahead finishes before the last one whatever it accepts, so its accepted draft tokens save rows of
    later steps and not steps (module docstring).

    Tokens left only bound a request's length: most stop at an end-of-sequence token first, so requests with
    nearly as many tokens left are as likely to finish last. Within ``slack`` alone (2026-12-06, served, bfloat16,
    GSM8K, 32 requests at 32 running), the requests of one wave (their prompts run over a few steps, their drafts
    accepted unevenly) were a few tokens apart, and from one step to the next 1 to 30 of 30-31 requests counted as
    the last; valued as such (:meth:`StepCosts.token_value`) they drafted in every step of the drain and the level
    ran 0.94x plain decoding in one repeat (1.02x in the other), where without that worth it had run 0.96-0.98x."""
    known = [t for t in tokens_left if t is not None]
    if not known:
        return [True] * len(tokens_left)
    most = max(known)
    floor = most - max(slack, LAST_SHARE * most)
    return [t is None or t >= floor for t in tokens_left]


def drafts_behind(rates: tuple[float, float], margin: float = COMPARE_MARGIN) -> bool:
    """Whether ``(tokens/s of the steps that verified draft tokens, tokens/s of those that verified none)`` has the
    drafted steps short of ``margin`` (a share; the option ``compare_margin``, default :data:`COMPARE_MARGIN`)
    ahead."""
    return rates[0] < rates[1] * (1.0 + margin)


def _rate(obs) -> float:
    """Tokens per second over ``(tokens, seconds, ...)`` observations."""
    return sum(o[0] for o in obs) / sum(o[1] for o in obs)


def _line(pts: list[tuple[int, float, int]]) -> tuple[float, float]:
    """``(intercept, slope >= 0)`` of the least-squares line through ``(rows, seconds, weight)`` points (at least
    two row counts)."""
    w = sum(n for _, _, n in pts)
    mr = sum(r * n for r, _, n in pts) / w
    mt = sum(t * n for _, t, n in pts) / w
    var = sum(n * (r - mr) ** 2 for r, _, n in pts)
    slope = max(sum(n * (r - mr) * (t - mt) for r, t, n in pts) / var, 0.0)
    return mt - slope * mr, slope


def _nearest(table: dict[int, deque], batch_size: int, need: int) -> int | None:
    """The batch size of ``table`` nearest ``batch_size`` (no further than ``max(2, batch_size // 4)``: under
    continuous batching the batch size moves by a few requests from step to step; ties: the larger) with ``need``
    observations; None without."""
    near = [b for b, obs in table.items() if len(obs) >= need and abs(b - batch_size) <= max(2, batch_size // 4)]
    return min(near, key=lambda b: (abs(b - batch_size), -b)) if near else None


def _closest(table: dict[int, deque], batch_size: int) -> deque | None:
    """The observations of ``table``'s batch size nearest ``batch_size``, at any distance (ties: the larger);
    None for an empty table."""
    return table[min(table, key=lambda b: (abs(b - batch_size), -b))] if table else None


class StepCosts:
    """Recent step times by rows verified and drafting times by batch size (seconds)."""

    def __init__(self, window: int = WINDOW, probe_every: int = PROBE_EVERY, margin: float = COMPARE_MARGIN):
        self.window = window
        self.probe_every = probe_every
        self.margin = margin  # the realised comparison's (drafting_loses; the option compare_margin)
        self._rows: dict[int, deque] = {}  # row count -> (seconds, clock) observations
        self._plain_rows: dict[int, deque] = {}  # row count -> (seconds, clock) of the steps without draft rows
        # draft rows -> (seconds over the plain step of its batch size then, clock, batch size) of drafted steps
        self._drafted_rows: dict[int, deque] = {}
        self._drafted_pts: dict[int, list] = {}  # batch size -> _drafted_points, until the drafted steps change
        self._rows_order: deque = deque()  # (clock, row count) of every row observation, oldest first (aging)
        self._draft: dict[int, deque] = {}
        self._levels: dict[int, deque] = {}  # per batch size: (head levels run beyond the confidence pass, seconds)
        self._flat: dict[int, deque] = {}  # per batch size: seconds of drafts that ran no head level
        self._since_probe: dict[int, int] = {}
        self._since_draft: dict[int, int] = {}  # steps of a batch size in which no draft paid, since it explored
        self._explored: dict[int, int] = {}  # exploring steps per batch size
        self._yield: dict[int, deque] = {}  # per batch size: (accepted heads tokens, extra seconds) a heads step
        # the decode steps by the drafts they verified (:data:`STEP_KINDS`) -> B -> (tokens, s, clock, finished)
        self._steps: dict[str, dict[int, deque]] = {k: {} for k in STEP_KINDS}
        self._seen: dict[tuple[str, int], int] = {}  # observations so far per (kind, key)
        self._clock = 0  # engine steps in which the drafter ran (tick): the yield and the decode steps age by it
        self._finished = 0  # requests finished so far (tick): the drafted decode steps also age by it
        self._med: dict[int, float] | None = None  # medians by row count, cached until the next observation
        # row count -> (seconds of its last POINT_MIN_OBS observations, clock) as they aged below that many, for the
        # counts the step-up left (row count -> clock it last did: left_rows)
        self._kept: dict[int, tuple[list[float], int]] = {}
        self._left: dict[int, int] = {}
        self.probes = 0
        self.references = 0  # steps without drafts for the realised comparison (needs_reference)
        self.explorations = 0

    @classmethod
    def from_options(cls, options) -> StepCosts:
        """The step costs of a drafter with these entmtp options (:class:`~vllm_entmtp.config.EntMTPConfig`): the
        realised comparison's margin is ``compare_margin``."""
        return cls(margin=options.compare_margin)

    # -- observations ---------------------------------------------------------------------------------------------

    def record_rows(self, rows: int, seconds: float, batch_size: int | None = None) -> None:
        """A decode step (no prompt tokens) that verified ``rows`` rows (one root per request plus its draft
        tokens) took ``seconds`` in its row-bound part. ``batch_size``: its requests (None, or ``rows``: no draft
        rows); where some of its rows were draft tokens (fewer requests than ``rows``), the step is also kept
        apart by its draft rows, as its time over the plain step of its batch size as now measured
        (:meth:`plain_time`; not kept where that is not measured), for the drafted steps' line of :meth:`curve`;
        a step without draft rows is kept apart as a plain one."""
        if rows >= 1 and seconds > 0:
            self._add(self._rows, "rows", rows, (seconds, self._clock))
            self._rows_order.append((self._clock, rows))
            self._med = None
            if batch_size is None or batch_size >= rows:
                self._add(self._plain_rows, "plain-rows", rows, (seconds, self._clock))
            elif batch_size >= 1:
                plain = self.plain_time(batch_size)
                if plain is not None:
                    self._add(self._drafted_rows, "drafted-rows", rows - batch_size,
                              (seconds / plain, self._clock, batch_size))
                    self._drafted_pts = {}

    def record_draft(self, batch_size: int, seconds: float) -> None:
        """Drafting from the heads for ``batch_size`` requests up to the schedule's choice (their confidence pass
        and the choice; not prompt lookup and the tracker, which run in every step; the drafts after the choice
        are recorded by :meth:`record_levels`, as their cost depends on the depth drafted) took ``seconds``."""
        if batch_size >= 1 and seconds > 0:
            self._add(self._draft, "draft", batch_size, seconds)

    def record_levels(self, batch_size: int, levels: int, seconds: float) -> None:
        """The heads' drafts after their confidence pass, for ``batch_size`` requests, took ``seconds``; they ran
        ``levels`` head levels (a Hydra head runs once per depth, over the paths that need it and the pass did not
        evaluate: with the default one-head pass, a chain of 2 runs one level, a chain of 1 none). Drafts that
        ran no level and drafts that ran some are kept apart, so that neither crowds the other out."""
        if batch_size >= 1 and levels > 0 and seconds > 0:
            self._add(self._levels, "levels", batch_size, (int(levels), seconds))
        elif batch_size >= 1 and levels == 0 and seconds > 0:
            self._add(self._flat, "flat", batch_size, seconds)

    def record_heads_yield(self, batch_size: int, accepted: int, seconds: float, exploring: bool = False) -> None:
        """A step of ``batch_size`` requests in which the heads ran: ``accepted`` of their draft tokens were accepted
        (bonus tokens excluded; 0 where the schedule then drafted nothing from them), at ``seconds`` of step time
        the heads added (drafting, and the rows of their draft tokens). ``exploring``: the step's drafts were not
        the rule's choice by the batch's tokens per second (it explored, :meth:`needs_exploration`, or weighed its
        drafts by :meth:`token_value` while the batch drained): their yield is not kept. An exploring step's drafts,
        a tree for every request under the exploring budget, measure costs (served, creative writing at 32 running:
        kept, the exploring steps of a batch size at which the heads' yield had stopped them pulled it from 504 to
        226 tokens/s while the steps that had verified drafts emitted 575 tokens/s against 481 without)."""
        if batch_size >= 1 and seconds > 0 and not exploring:
            self._add(self._yield, "yield", batch_size, (float(accepted), seconds, self._clock), YIELD_MAX_AGE + 1)

    def record_step(self, batch_size: int, tokens: int, seconds: float, drafted: bool,
                    source: str = "heads") -> None:
        """A decode step of ``batch_size`` requests emitted ``tokens`` (one per request plus the accepted draft
        tokens) in ``seconds`` (from its inputs to the end of its drafting); ``drafted``: it verified draft
        tokens, ``source`` (:data:`DRAFT_SOURCES`) where they came from: ``"lookup"`` where all of them came from
        prompt lookup, ``"heads"`` where some came from the heads. The drafter records a step whose drafting ran
        the heads as ``drafted`` from ``"heads"`` whatever it verified (their confidence pass may choose no draft):
        the steps without drafts stand for resting, where no head runs."""
        if source not in DRAFT_SOURCES:
            raise ValueError(f"source must be one of {DRAFT_SOURCES}, got {source!r}")
        if batch_size >= 1 and seconds > 0:
            kind = source if drafted else "none"
            self._add(self._steps[kind], f"step-{kind}", batch_size,
                      (float(tokens), seconds, self._clock, self._finished))

    def tick(self, finished: int = 0) -> None:
        """An engine step in which the drafter ran (any batch size, prompt chunks or not), ``finished``: the
        requests that left the runner since the last call (finished or aborted; the drafter counts them, as vLLM
        announces a finish in the next step, which skips the runner where nothing else runs). The steps that
        verified draft tokens at a batch size are dropped from the realised comparison once as many requests as that
        batch size have finished since (:meth:`record_step`): what they emitted was the text of requests no longer
        running. In-process at one request (2026-12-05, bfloat16, 16 mixed prompts of 64 tokens one after another,
        each 30-64 steps), a loss read on drafted steps that then stopped changing (most drafts rejected, several
        steps slowed to 26-29 ms against 18-19 ms) kept the drafter resting for 46 and 61 steps of about 550 (two
        traced runs, the trace not kept), and runs had 62 and 134 steps without drafts where others had 20-26
        (``benchmarks/results/small-rows-epyc-2026-12-05/``); the steps without drafts, whose rate depends on the
        batch and its contexts rather than on the text, age by steps only. The heads' yield observations and the
        realised comparison's decode steps age by these engine steps; those older than
        :data:`YIELD_MAX_AGE` and :data:`STEP_RATE_MAX_AGE` of them are dropped (each batch size's are kept in the
        order they came, so the oldest are on the left), and so do the row counts' observations
        (:data:`ROWS_MAX_AGE`; a row count with none left is not measured)."""
        self._clock += 1
        for r in [r for r, clock in self._left.items() if self._clock - clock > ROWS_MAX_AGE]:
            del self._left[r]
        order = self._rows_order
        while order and self._clock - order[0][0] > ROWS_MAX_AGE:
            clock, r = order.popleft()
            obs = self._rows.get(r)
            if obs is None:
                continue
            while obs and obs[0][1] <= clock:  # the window or a first observation's drop may have taken it already
                if len(obs) == POINT_MIN_OBS and r in self._left:  # left within ROWS_MAX_AGE (pruned above)
                    self._kept[r] = ([o[0] for o in obs], self._clock)  # for measured_time(kept=True)
                obs.popleft()
                self._med = None
            if not obs:
                del self._rows[r]
                self._med = None
        for r in [r for r, (_, clock) in self._kept.items() if self._clock - clock > KEPT_MAX_AGE]:
            del self._kept[r]
        for table in (self._plain_rows, self._drafted_rows):
            aged = False
            for r in [r for r, obs in table.items() if not obs or self._clock - obs[-1][1] > ROWS_MAX_AGE]:
                del table[r]
                aged = True
            for obs in table.values():
                while self._clock - obs[0][1] > ROWS_MAX_AGE:
                    obs.popleft()
                    aged = True
            if aged and table is self._drafted_rows:  # the cached points read the drafted steps only
                self._drafted_pts = {}
        for table, age in ((self._yield, YIELD_MAX_AGE),
                           *((self._steps[k], STEP_RATE_MAX_AGE) for k in STEP_KINDS)):
            for obs in table.values():
                while obs and self._clock - obs[0][2] > age:
                    obs.popleft()
        self._finished += max(int(finished), 0)
        if finished:
            for source in DRAFT_SOURCES:
                for b, obs in self._steps[source].items():
                    while obs and self._finished - obs[0][3] >= b:
                        obs.popleft()

    def needs_reference(self, batch_size: int) -> bool:
        """Whether the next step of ``batch_size`` requests should draft nothing, so that the realised comparison
        (:meth:`step_rates`) has steps without drafts from the text now running: True where a batch size near it
        has :data:`COMPARE_MIN_DRAFTING` recent drafted steps (of either source) and none has
        :data:`COMPARE_MIN_PLAIN` recent steps without. Where drafting pays by the rows' curve every step drafts,
        so no such step would come, and the drafts would go on unjudged (module docstring). Counts the step when
        True."""
        if (any(_nearest(self._steps[s], batch_size, COMPARE_MIN_DRAFTING) is not None for s in DRAFT_SOURCES)
                and _nearest(self._steps["none"], batch_size, COMPARE_MIN_PLAIN) is None):
            self.references += 1
            return True
        return False

    def step_rates(self, batch_size: int, source: str = "heads") -> tuple[float, float] | None:
        """Tokens per second of the recent decode steps that verified draft tokens of ``source``
        (:meth:`record_step`) and of those that verified none, at the nearest batch sizes (no further than
        ``max(2, batch_size // 4)``) with :data:`COMPARE_MIN_DRAFTING` and :data:`COMPARE_MIN_PLAIN` of them;
        None without.

        Where the two come from different batch sizes, the rate without drafts is moved to the drafted steps' batch
        size by the plain steps' tokens per second at both (``b / plain_time(b)``, :meth:`plain_time`; as measured
        where either is not known): a larger batch emits more tokens per second without any draft, so drafted
        steps at a larger batch size than the steps without read as ahead before any draft token is accepted
        (a draining batch's steps come at many batch sizes). Served plain decoding on the AVX2 EPYC (2026-12-07,
        creative writing and mixed prompts, one engine core, median steps;
        ``benchmarks/results/realised-comparison-epyc-2026-12-07/``) emitted 14-15 tokens/s at one request,
        84-88 at 15, 98-101 at 16 and 110-122 at 32."""
        found = []
        for kind, need in ((source, COMPARE_MIN_DRAFTING), ("none", COMPARE_MIN_PLAIN)):
            b = _nearest(self._steps[kind], batch_size, need)
            if b is None:
                return None
            found.append((b, _rate(self._steps[kind][b])))
        (b_drafted, drafted), (b_none, none) = found
        if b_none != b_drafted:
            t_drafted, t_none = self.plain_time(b_drafted), self.plain_time(b_none)
            if t_drafted is not None and t_none is not None:
                none *= (b_drafted / t_drafted) / (b_none / t_none)
        return drafted, none

    def drafting_loses(self, batch_size: int, source: str = "heads") -> bool:
        """Whether, at ``batch_size`` requests, the decode steps that verified draft tokens of ``source``
        (:data:`DRAFT_SOURCES`: ``"heads"``, steps some of whose drafts came from the heads; ``"lookup"``, steps
        whose drafts all came from prompt lookup) have not emitted :attr:`margin` (``compare_margin``) more tokens
        per second than those that verified none (:meth:`step_rates`, :func:`drafts_behind`): what drafting
        actually returned against what it actually cost, every cost included (the rows' attention over long
        contexts, the heads, lookup and sampling).

        Where that is not measured near ``batch_size``, the verdict of the largest smaller batch size that has
        one (:data:`COMPARE_MIN_DRAFTING` and :data:`COMPARE_MIN_PLAIN` steps of its own) stands if it lost: as
        the batch grows a draft row costs more (the step becomes compute-bound) and a plain token less, so where
        drafting lost at 16 requests it is not tried afresh at 32 (each new batch size would otherwise pay
        :data:`COMPARE_MIN_DRAFTING` drafted steps before it can rest; not measured on its own); the
        exploring steps (:meth:`needs_exploration`) still measure drafting at ``batch_size``, and its own verdict
        replaces the inherited one once it has the steps. False with neither."""
        rates = self.step_rates(batch_size, source)
        if rates is not None:
            return drafts_behind(rates, self.margin)
        for b in sorted((b for b in self._steps[source] if b < batch_size), reverse=True):
            rates = self._own_rates(b, source)
            if rates is not None:
                return drafts_behind(rates, self.margin)
        return False

    def _own_rates(self, batch_size: int, source: str = "heads") -> tuple[float, float] | None:
        """:meth:`step_rates` from the steps of exactly ``batch_size`` requests; None without enough of them."""
        out = []
        for kind, need in ((source, COMPARE_MIN_DRAFTING), ("none", COMPARE_MIN_PLAIN)):
            obs = self._steps[kind].get(batch_size)
            if obs is None or len(obs) < need:
                return None
            out.append(_rate(obs))
        return out[0], out[1]

    def heads_yield(self, batch_size: int) -> float | None:
        """Accepted heads' draft tokens per second of step time the heads added, at ``batch_size`` requests: their
        sum over the steps in which the heads ran among the last :data:`YIELD_MAX_AGE` steps (:meth:`tick`) over
        those steps' added seconds, at the
        nearest batch size with :data:`YIELD_MIN_STEPS` of them no further than ``max(2, batch_size // 4)`` (under
        continuous batching the batch size moves by a few requests from step to step); None without."""
        b = _nearest(self._yield, batch_size, YIELD_MIN_STEPS)
        return None if b is None else self._own_yield(b)

    def _own_yield(self, batch_size: int) -> float:
        obs = self._yield[batch_size]  # those of the last YIELD_MAX_AGE steps (tick drops the older)
        return sum(o[0] for o in obs) / sum(o[1] for o in obs)

    def _add(self, table: dict[int, deque], kind: str, key: int, seconds, keep: int | None = None) -> None:
        """Append an observation (the last ``keep``, default :attr:`window`, are kept); the key's first one is
        dropped when its second arrives (module docstring)."""
        seen = self._seen.get((kind, key), 0)
        self._seen[(kind, key)] = seen + 1
        obs = table.setdefault(key, deque(maxlen=keep or self.window))
        if seen == 1:
            obs.clear()
        obs.append(seconds)

    # -- probes ---------------------------------------------------------------------------------------------------

    def needs_probe(self, batch_size: int) -> bool:
        """Whether the next step of ``batch_size`` requests should draft nothing, to measure a plain step of that
        many rows: none measured and none on both sides to interpolate from, or :attr:`probe_every` steps of
        that batch size since its last measurement. Counts the step."""
        if batch_size in self._rows:
            n = self._since_probe.get(batch_size, 0) + 1
            if n < self.probe_every:
                self._since_probe[batch_size] = n
                return False
        elif any(r < batch_size for r in self._rows) and any(r > batch_size for r in self._rows):
            return False
        self._since_probe[batch_size] = 0
        self.probes += 1
        return True

    def needs_exploration(self, batch_size: int, unmeasured_line: bool = False) -> bool:
        """Called on a step of ``batch_size`` requests in which no draft pays, or (``unmeasured_line``) in which
        drafts pay by the line through plain and drafted steps together while the drafted steps' own line is not
        measured there (:meth:`drafted_line_known`): whether to draft anyway, to measure drafting again (every
        :attr:`probe_every` such steps of that batch size; every :data:`EXPLORE_UNMEASURED_EVERY` while no step of
        more rows than ``batch_size`` is measured, as there the rows' curve prices a draft row at no less than a
        plain token, so that no draft can pay until a step of more rows has been measured, and with
        ``unmeasured_line``). The same holds where drafting rests on a
        loss inherited from a smaller batch size (:meth:`drafting_loses`): there too the first exploring step comes
        sooner, and once it has measured a step of more rows the usual period applies. Counts the step."""
        n = self._since_draft.get(batch_size, 0) + 1
        soon = not any(r > batch_size for r in self._rows) or unmeasured_line
        every = min(EXPLORE_UNMEASURED_EVERY, self.probe_every) if soon else self.probe_every
        if n < every:
            self._since_draft[batch_size] = n
            return False
        self._since_draft[batch_size] = 0
        self.explorations += 1
        self._explored[batch_size] = self._explored.get(batch_size, 0) + 1
        return True

    def explored(self, batch_size: int) -> int:
        """Exploring steps so far at ``batch_size`` requests (:meth:`needs_exploration`)."""
        return self._explored.get(batch_size, 0)

    def drafted_line_known(self, batch_size: int) -> bool:
        """Whether the drafted steps' line of :meth:`curve` is measured for ``batch_size`` requests (up to three
        times their rows). Until it is, a drafted step is priced by the line through plain and drafted steps
        together, which spreads a drafting step's fixed cost over its draft rows: the drafter then explores as
        often as where no step of more rows is measured (:meth:`needs_exploration` with ``unmeasured_line``, in
        steps where a draft pays by that line, as drafting for a few requests is where it misleads most)."""
        return self._drafted_fit(batch_size, 1.0) is not None

    # -- reads ----------------------------------------------------------------------------------------------------

    def known_rows(self) -> list[int]:
        return sorted(self._rows)

    def _medians(self) -> dict[int, float]:
        if self._med is None:
            self._med = {r: statistics.median(o[0] for o in v) for r, v in sorted(self._rows.items())}
        return self._med

    def rows_time(self, rows: int) -> float | None:
        """The row-bound time of a decode step of ``rows`` rows (seconds): the median of its observations, else
        interpolated between the nearest measured row counts; None with fewer than two measured row counts (one,
        if ``rows`` is it)."""
        curve = self.curve(rows, 0)
        return None if curve is None else curve[0]

    def curve(self, rows: int, extra: int) -> list[float] | None:
        """The row-bound time of a decode step of ``rows, rows + 1, ..., rows + extra`` rows (seconds); None where
        one is unknown.

        With ``extra`` > 0 and at least :data:`FIT_MIN_POINTS` measured row counts within ``max(2, rows // 4)``
        of ``rows .. rows + extra``, the curve is the least-squares line through their medians (weighted by their
        observations), never falling, and beyond the largest measured row count no lower than the
        extrapolation below: a draft row then costs the local slope. Interpolating between single medians
        instead let noise decide (2026-12-02, in-process, 32 requests, bfloat16: medians of 49.7, 68.9 and
        49.5 ms at 36, 37 and 38 rows, so a 37th row cost 19 ms and a 38th saved as much, where a line
        through the same run's medians from 24 to 43 rows rises 1.1 ms a row). Otherwise
        :meth:`rows_time` point by point: the median, else interpolated between the nearest measured row
        counts, beyond the largest extrapolated no less steeply than the mean time per row.

        Where the plain step of ``rows`` rows is measured (:meth:`plain_time`: steps without draft rows) and
        :data:`FIT_MIN_POINTS` draft-row counts of drafted steps of batch sizes near ``rows`` (or two,
        :data:`DRAFTED_FIT_SPAN` or more apart; up to three times ``rows`` draft rows, whatever ``extra``), the
        curve is that plain step and, with any draft row, the line through those drafted steps' medians by their
        draft rows (:meth:`_drafted_fit`: each as its time over the plain step of its batch size when it ran,
        scaled by the plain step now), never under the plain step: a step that drafts pays a cost that a line
        through plain and drafted steps together spreads over the draft rows. Served at 32
        running on a 2-core Xeon with AMX (2026-12-04, bfloat16, GSM8K, one engine core): a plain step of 32
        rows took 69-70 ms, a step that verified 4 draft rows 88 ms, one that verified 32 (a chain of 1 for every
        request) 94 ms; the line through the first two priced each draft row at 4.7 ms, and the rule drafted for
        a few requests, found those steps slower per token, and rested (0.99x plain decoding), where a chain of 1
        for every request ran 1.12x (``benchmarks/results/served-c32-rows-amx-2026-12-04/``). Taken in seconds
        and from any batch size, the same server's drafted steps of GSM8K at 32 running (64 rows in 100 ms)
        priced ShareGPT's next (long contexts: a plain step of 32 rows took 106 ms) as free, and every request
        drafted (143 ms a step) until the realised comparison stopped the drafts; and 40 rows of 16 requests
        are not 40 rows of 32 requests (24 draft rows against 8)."""
        pointwise = self._pointwise(rows, extra)
        if pointwise is None or extra == 0:
            return pointwise
        margin = max(2, rows // 4)
        largest = max(self._rows)
        plain = self.plain_time(rows)
        drafted = self._drafted_fit(rows, plain) if plain is not None else None
        if drafted is not None:  # a step that drafts: the drafted steps' line, never under the plain step
            a, slope = drafted
            out = [plain]
            for d, p in enumerate(pointwise[1:], start=1):
                t = max(a + slope * d, plain)  # d draft rows
                out.append(max(t, p) if rows + d > largest else t)
            return out
        fit = self._local_fit(rows - margin, rows + extra + margin)
        if fit is None:
            return pointwise
        a, slope = fit
        return [max(a + slope * r, p) if r > largest else a + slope * r
                for r, p in zip(range(rows, rows + extra + 1), pointwise)]

    def _local_fit(self, lo: int, hi: int) -> tuple[float, float] | None:
        """``(intercept, slope >= 0)`` of the weighted least-squares line through the medians of the measured row
        counts in ``[lo, hi]``; None with fewer than :data:`FIT_MIN_POINTS` of them."""
        med = self._medians()
        pts = [(r, t, len(self._rows[r])) for r, t in med.items() if lo <= r <= hi]
        return _line(pts) if len(pts) >= FIT_MIN_POINTS else None

    def plain_time(self, batch_size: int) -> float | None:
        """The plain step of ``batch_size`` rows (no draft rows): the median of the steps without draft rows of that
        many rows, else interpolated between the nearest measured row counts no further than
        ``max(2, batch_size // 4)`` on both sides; None without (seconds)."""
        obs = self._plain_rows.get(batch_size)
        if obs:
            return statistics.median(o[0] for o in obs)
        reach = max(2, batch_size // 4)
        lo = max((r for r in self._plain_rows if batch_size - reach <= r < batch_size), default=None)
        hi = min((r for r in self._plain_rows if batch_size < r <= batch_size + reach), default=None)
        if lo is None or hi is None:
            return None
        t_lo = statistics.median(o[0] for o in self._plain_rows[lo])
        t_hi = statistics.median(o[0] for o in self._plain_rows[hi])
        return t_lo + (t_hi - t_lo) * (batch_size - lo) / (hi - lo)

    def _drafted_points(self, batch_size: int) -> list[tuple[int, float, int]]:
        """``(draft rows, median time over the plain step, observations)`` of the drafted steps of batch sizes no
        further than ``max(2, batch_size // 4)``, up to three times ``batch_size`` draft rows (cached until the
        drafted steps change)."""
        pts = self._drafted_pts.get(batch_size)
        if pts is None:
            reach = max(2, batch_size // 4)
            pts = []
            for d, obs in self._drafted_rows.items():
                if d <= 3 * batch_size + reach:
                    near = [o[0] for o in obs if abs(o[2] - batch_size) <= reach]
                    if near:
                        pts.append((d, statistics.median(near), len(near)))
            self._drafted_pts[batch_size] = pts
        return pts

    def _drafted_fit(self, batch_size: int, plain: float) -> tuple[float, float] | None:
        """``(intercept, slope)`` in seconds of a step of ``batch_size`` requests by its draft rows: the line of
        :func:`_line` through :meth:`_drafted_points`, each taken as its time over the plain step of its batch
        size when it was measured, times ``plain`` (the plain step of ``batch_size`` rows now: the costs of both
        grow with the contexts running); None with fewer than :data:`FIT_MIN_POINTS` draft row counts (or two
        :data:`DRAFTED_FIT_SPAN` apart)."""
        pts = self._drafted_points(batch_size)
        if len(pts) < FIT_MIN_POINTS and not (
                len(pts) >= 2 and max(p[0] for p in pts) - min(p[0] for p in pts) >= DRAFTED_FIT_SPAN):
            return None
        a, slope = _line(pts)
        return a * plain, slope * plain

    def _pointwise(self, rows: int, extra: int) -> list[float] | None:
        med = self._medians()
        known = list(med)
        out = []
        for r in range(rows, rows + extra + 1):
            if r in med:
                out.append(med[r])
                continue
            if len(known) < 2:
                return None
            i = bisect.bisect_left(known, r)
            if 0 < i < len(known):  # between two measured row counts
                lo, hi = known[i - 1], known[i]
                out.append(med[lo] + (med[hi] - med[lo]) * (r - lo) / (hi - lo))
            elif i == len(known):  # beyond the largest: extrapolate, no less steeply than on average
                a, b = known[-2], known[-1]
                slope = max((med[b] - med[a]) / (b - a), med[b] / b, 0.0)
                out.append(med[b] + slope * (r - b))
            else:  # below the smallest
                a, b = known[0], known[1]
                slope = max((med[b] - med[a]) / (b - a), 0.0)
                out.append(max(med[a] - slope * (a - r), 0.0))
        return out

    def measured_time(self, rows: int, kept: bool = False) -> float | None:
        """The row-bound time of a decode step of ``rows`` rows as measured, nothing interpolated: the median of
        its own observations where it has :data:`POINT_MIN_OBS` of them; with ``kept``, for a count the step-up
        left, else the median of its last :data:`POINT_MIN_OBS` observations, those still held first and then those
        that aged out (for :data:`KEPT_MAX_AGE` engine steps after they did); None otherwise (seconds)."""
        obs = self._rows.get(rows)
        if obs is not None and len(obs) >= POINT_MIN_OBS:
            return self._medians()[rows]
        old = self._kept.get(rows) if kept else None
        if old is None:
            return None
        fresh = [o[0] for o in obs] if obs else []
        return statistics.median(fresh + old[0][len(fresh) - POINT_MIN_OBS:])

    def left_rows(self, rows: int) -> None:
        """The step-up moved a request off a step of ``rows`` rows (:meth:`measured_time`'s ``kept``)."""
        self._left[rows] = self._clock

    def draft_time(self, batch_size: int) -> float:
        """Drafting time for ``batch_size`` requests (seconds; :meth:`record_draft`): the median at the nearest
        measured batch size (it grows slowly with the batch: drafts included, 2.2 ms for one request and 3.3 ms
        for sixteen on the machine above); 0 before any measurement."""
        if not self._draft:
            return 0.0
        return statistics.median(_closest(self._draft, batch_size))

    def level_time(self, batch_size: int) -> tuple[float, float] | None:
        """``(rest, per_level)`` seconds of the heads' drafts after their confidence pass near ``batch_size``
        (:meth:`record_levels`): ``rest``, what a draft costs that needs no further level (the median of those,
        0 where none is measured), and ``per_level``, what each further level adds (the median over drafts that
        needed some of ``(seconds - rest) / levels``; 0 until one is measured, so that a deeper tree gets drafted
        and measured), each at the batch size nearest ``batch_size`` that has them. None before any draft is
        measured.

        On a 2-core Xeon with AMX (2026-12-04, bfloat16, ``step_profile.py``, in-process) a level of the shipped
        Hydra heads took 1.5-1.6 ms of a 30-ms step at one request and 2.2-3.2 ms of a 60-86 ms step over sixteen;
        alone, the head's block and 8,192-row draft lm_head took 0.53 ms for one row and 0.59 ms for sixteen
        (their weights are read from memory however few rows they multiply)."""
        flat, deep = _closest(self._flat, batch_size), _closest(self._levels, batch_size)
        if flat is None and deep is None:
            return None
        rest = statistics.median(flat) if flat else 0.0
        per = statistics.median(max(s - rest, 0.0) / lv for lv, s in deep) if deep else 0.0
        return rest, per

    def compared(self) -> bool:
        """Whether some batch size has a realised comparison of its own (what :meth:`describe` lists)."""
        return any(self._own_rates(b, s) is not None for s in DRAFT_SOURCES for b in self._steps[s])

    def token_value(self, batch_size: int, last: int) -> float | None:
        """While a batch of ``batch_size`` requests drains, the seconds of step time one accepted draft token of its
        ``last`` requests with the most tokens left (:func:`last_to_finish`) is worth: each such token brings the
        batch's end a step sooner for its request, a step of about ``last`` rows (the others will have finished),
        whose time those requests share (:meth:`rows_time`). Served on the 2-core EPYC (2026-12-06, bfloat16,
        GSM8K, 32 requests at 16 running), the steps in which a level's batch drained took 10 of its 30 seconds,
        and 55 of those 170 steps drafted (at 10 requests 2 of 31, the rule finding that no draft paid): a token
        of the request that finishes last is worth a step of one request, about 27 ms there, not a plain token of
        ten (5.4 ms). None where that is not :data:`COMPARE_MARGIN` (fixed: the option ``compare_margin`` is the
        realised comparison's) more than a plain token of the batch now running (``rows_time(batch_size) /
        batch_size``; so also where nobody is ahead): there every request's token counts about alike, and the rules
        judge by the batch's tokens per second, the realised comparison included; None where the rows' curve is not
        measured."""
        if not 1 <= last < batch_size:
            return None
        t_last, t_all = self.rows_time(last), self.rows_time(batch_size)
        if t_last is None or t_all is None or t_last / last <= (1.0 + COMPARE_MARGIN) * t_all / batch_size:
            return None
        return t_last / last

    def describe(self) -> str:
        """One line for the server's log: per batch size with a realised comparison, the tokens per second of its
        recent steps with and without draft tokens and whether the drafter rests there (the heads'; then those of
        prompt lookup's drafts alone, marked ``(lookup alone)``); then the steps made to
        measure (probes, references) and to explore. What a user reads to see why entmtp drafts little under load."""
        parts = []
        for source in DRAFT_SOURCES:
            for b in sorted(self._steps[source]):
                rates = self._own_rates(b, source)
                if rates is not None:
                    label = f"{b}" if source == "heads" else f"{b} ({source} alone)"
                    rests = " (rests)" if drafts_behind(rates, self.margin) else ""
                    parts.append(f"{label}: {rates[0]:.0f}/{rates[1]:.0f}{rests}")
        compared = ", ".join(parts) if parts else "none yet"
        return (f"tokens/s of recent steps with/without draft tokens by batch size: {compared}; steps without drafts "
                f"to measure: probes {self.probes}, references {self.references}; exploring steps {self.explorations}")

    def summary(self) -> dict:
        """For logs and tests: ``{"rows_ms": {R: median ms}, "draft_ms": {B: median ms}, "level_ms": {B: [rest,
        per level] ms}, "heads_yield": {B: accepted heads' tokens per second added}, "step_rates": {B: [tokens/s
        of steps with the heads' drafts, of steps without]}, "lookup_step_rates": {the same for steps with prompt
        lookup's drafts alone}, "probes": n, "references": n, "explorations": n}``."""
        return {"rows_ms": {r: round(1e3 * t, 3) for r, t in self._medians().items()},
                "draft_ms": {b: round(1e3 * statistics.median(v), 3) for b, v in sorted(self._draft.items())},
                "level_ms": {b: [round(1e3 * x, 3) for x in lt] for b in sorted({*self._levels, *self._flat})
                             if (lt := self.level_time(b)) is not None},
                "heads_yield": {b: round(self._own_yield(b), 1) for b in sorted(self._yield)
                                if len(self._yield[b]) >= YIELD_MIN_STEPS},
                **{key: {b: [round(r, 1) for r in rates] for b in sorted(self._steps[source])
                         if (rates := self.step_rates(b, source)) is not None}
                   for key, source in (("step_rates", "heads"), ("lookup_step_rates", "lookup"))},
                "probes": self.probes, "references": self.references, "explorations": self.explorations}
