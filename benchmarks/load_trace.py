"""The measured load rule's decisions, engine step by engine step, in a served or in-process entmtp engine.

A step hook (``$VLLM_ENTMTP_STEP_HOOK=load_trace``, this folder on ``PYTHONPATH``;
:func:`vllm_entmtp.stats.load_step_hook`) writes one JSON line per engine step to
``$VLLM_ENTMTP_LOAD_TRACE-<pid>.jsonl`` (the variable is a path prefix; default ``load-trace``), and
``python benchmarks/load_trace.py FILE...`` summarises such files by level and batch size::

    VLLM_ENTMTP_STEP_HOOK=load_trace VLLM_ENTMTP_LOAD_TRACE=/tmp/trace PYTHONPATH=benchmarks \\
        python benchmarks/compare.py --methods plain-bfloat16,entmtp ...
    python benchmarks/load_trace.py /tmp/trace-*.jsonl

A line holds the step's start (``t``, ``time.perf_counter`` seconds), its requests (``reqs``), scheduled tokens
(``tokens``), requests new to the engine (``new``) and draft tokens verified (``spec``); and, from the drafter's
call that ended the step before (it proposed the drafts this step verifies), its batch size (``n``), whether the
batch drained (``draining``, :class:`~vllm_entmtp.step_costs.Refills`), the load rule's answers in that call, in
call order (``probe``: ``StepCosts.needs_probe``, ``reference``: ``needs_reference``, ``loses``: ``drafting_loses``
(the heads'; prompt lookup's own verdict, ``drafting_loses(source="lookup")``, as ``lookup_loses``),
``explore``: ``needs_exploration``, ``pays``: ``TreeScheduler.drafting_pays``), the requests that drafted and their
draft tokens (``drafted``, ``draft_tokens``) and those from prompt lookup (``lookup_tokens``), whether the heads
ran, the requests (ids) the schedule's choice ran for and those that drafted from the heads (``heads_rows``,
``heads_drafted``: a request whose lookup chain won after the heads ran is in the first, not the second), whether
the drafts explored and whether they were weighed by ``StepCosts.token_value`` (``valued``), the realised
comparison's tokens per second with and without drafts at that batch size after the call, per draft source
(``rates``: ``{"heads": [with, without] or null, "lookup": ...}``, ``StepCosts.step_rates``); and the draft tokens
the step before accepted, its bonus tokens not counted (``accepted``, from the drafter's ``draft_step``). The report
gives, per batch size, the mean draft tokens, lookup draft tokens and accepted draft tokens of the decode steps that
verified drafts. Made to find where a level's time went (session 40: the drain of a level,
``benchmarks/results/drain-epyc-2026-12-06/``); it adds a few hundred bytes of writing per step, up to about 3 KB at
32 running with the request ids.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
from collections import defaultdict

TRACE_ENV = "VLLM_ENTMTP_LOAD_TRACE"
#: Steps further apart than this (seconds) start a new level: a benchmark's levels are separated by its client's
#: set-up and warm-up requests.
GAP_S = 2.0
#: StepCosts / TreeScheduler methods whose answers are recorded, and the names they are recorded under.
COSTS_CALLS = {"needs_probe": "probe", "needs_reference": "reference", "drafting_loses": "loses",
               "needs_exploration": "explore"}
SCHEDULER_CALLS = {"drafting_pays": "pays"}


class LoadTrace:
    """The step hook: wraps the drafter's decisions once (on its first step), writes a line per step."""

    def __init__(self, path: str | None = None):
        prefix = path or os.environ.get(TRACE_ENV) or "load-trace"
        self.path = f"{prefix}-{os.getpid()}.jsonl"
        self._out = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the worker's life
        self._drafter = None
        self._call: dict = {}  # what the drafter's last call decided, written with the next step

    def _wrap(self, obj, method: str, name: str) -> None:
        orig = getattr(obj, method)
        call = self._call

        def wrapped(*args, **kwargs):
            out = orig(*args, **kwargs)
            # drafting_loses(n, source="lookup"): prompt lookup's own verdict, recorded apart ("lookup_loses")
            source = kwargs.get("source", "heads")
            call.setdefault(name if source == "heads" else f"{source}_{name}", []).append(bool(out))
            return out

        setattr(obj, method, wrapped)

    def attach(self, drafter) -> None:
        """Wrap ``drafter``'s load-rule calls and its ``_propose_scheduled`` (instance attributes: nothing else
        changes)."""
        self._drafter = drafter
        if getattr(drafter, "step_costs", None) is not None:
            for method, name in COSTS_CALLS.items():
                self._wrap(drafter.step_costs, method, name)
        if getattr(drafter, "scheduler", None) is not None:
            for method, name in SCHEDULER_CALLS.items():
                self._wrap(drafter.scheduler, method, name)
        from vllm_entmtp.drafter import LOOKUP_ID  # here: the report reads JSON lines only, without vLLM
        from vllm_entmtp.step_costs import DRAFT_SOURCES

        orig, call = drafter._propose_scheduled, self._call

        def propose(hidden, bonus, req_ids, budgets, active):
            chosen, drafts = orig(hidden, bonus, req_ids, budgets, active)
            refills = getattr(drafter, "refills", None)
            call.update(n=len(req_ids), draining=bool(refills is not None and refills.draining),
                        drafted=sum(1 for d in drafts if d), draft_tokens=sum(len(d) for d in drafts),
                        lookup_tokens=sum(len(d) for (t, _), d in zip(chosen, drafts) if t == LOOKUP_ID),
                        heads_ran=bool(drafter.heads_ran), explored=bool(drafter._heads_exploring),
                        # per request (by id): the schedule's choice ran for it; it drafted from the heads
                        heads_rows=[req_ids[i] for i in getattr(drafter, "heads_rows", ())],
                        heads_drafted=[r for r, (t, _), d in zip(req_ids, chosen, drafts) if d and t != LOOKUP_ID],
                        valued=bool(getattr(drafter, "_valued", False)))
            costs = getattr(drafter, "step_costs", None)
            if costs is not None:  # the realised comparison as the rule read it after this call, per draft source
                call["rates"] = {s: None if (r := costs.step_rates(len(req_ids), s)) is None
                                 else [round(x, 1) for x in r] for s in DRAFT_SOURCES}
            return chosen, drafts

        drafter._propose_scheduled = propose
        orig_step = drafter.draft_step

        def draft_step(scheduler_output, sampled_token_ids, *args, **kwargs):
            # the draft tokens the step now ending accepted (its bonus tokens not counted)
            call["accepted"] = sum(max(len(t) - 1, 0) for t in sampled_token_ids)
            return orig_step(scheduler_output, sampled_token_ids, *args, **kwargs)

        drafter.draft_step = draft_step

    def __call__(self, runner, scheduler_output, t0: float) -> None:
        if runner.drafter is not self._drafter:
            self.attach(runner.drafter)
        scheduled = scheduler_output.num_scheduled_tokens
        line = dict(self._call, t=t0, reqs=len(scheduled), tokens=sum(scheduled.values()),
                    new=len(scheduler_output.scheduled_new_reqs),
                    spec=sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values()))
        self._call.clear()
        self._out.write(json.dumps(line) + "\n")


def make_hook() -> LoadTrace:
    """The hook the plugin builds once per worker (:func:`vllm_entmtp.stats.load_step_hook`)."""
    return LoadTrace()


def read(path: str) -> list[dict]:
    """A trace's lines; ``.gz`` files (as results folders keep them) are read compressed."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def levels(rows: list[dict], gap: float = GAP_S) -> list[list[dict]]:
    """The steps in runs with less than ``gap`` seconds between one step's start and the next."""
    out: list[list[dict]] = []
    for r in rows:
        if not out or r["t"] - out[-1][-1]["t"] > gap:
            out.append([])
        out[-1].append(r)
    return out


def summarize(level: list[dict]) -> dict:
    """One level: its seconds (first step's start to last's), and per batch size of the steps (``by_batch``) and
    for the steps the batch drained in (``draining``: by the drafter's call before the step, which proposed the
    drafts the step verifies): steps, seconds, steps with prompt tokens, decode steps that verified drafts and
    their seconds, decode steps that verified none and their seconds, and the load rule's True answers of the
    drafter's call at the end of each step. A step's seconds run to the next step's start (the last step of a
    level has none and is left out). A warm-up request less than :data:`GAP_S` before a level counts in it."""
    def blank():
        return defaultdict(float)

    by_batch: dict[int, dict] = defaultdict(blank)
    drain = blank()
    for a, b in zip(level, level[1:]):
        dt = b["t"] - a["t"]
        for c in (by_batch[a["reqs"]], *((drain,) if a.get("draining") else ())):
            c["steps"] += 1
            c["seconds"] += dt
            if a["new"]:
                c["prefill_steps"] += 1
                continue
            kind = "drafted" if a["spec"] else "plain"
            c[f"{kind}_steps"] += 1
            c[f"{kind}_seconds"] += dt
            if a["spec"]:  # the draft tokens this step verified, those of prompt lookup, and those it accepted
                c["draft_tokens"] += a["spec"]
                c["lookup_tokens"] += a.get("lookup_tokens", 0)
                c["accepted"] += b.get("accepted", 0)
            for name in (*COSTS_CALLS.values(), "lookup_loses", *SCHEDULER_CALLS.values()):
                c[name] += sum(b.get(name, ()))
    return {"steps": len(level), "seconds": level[-1]["t"] - level[0]["t"],
            "by_batch": {n: dict(c) for n, c in sorted(by_batch.items(), reverse=True)}, "draining": dict(drain)}


def by_drafter(level: list[dict], batch_size: int) -> dict[tuple[bool, str], tuple[int, float]]:
    """The decode steps of ``batch_size`` requests (no prompt tokens) of a level, by whether they verified draft
    tokens and by what the drafter did at their end (in the step's own time): ``"heads, drafted"``, ``"heads,
    nothing drafted"`` (their confidence pass and the schedule's choice ran, and no draft came of them), ``"no
    heads"`` (lookup drafts, or none): ``(verified drafts?, that) -> (steps, median ms)``. Made to price the heads'
    pass where it drafts nothing (session 41, ``benchmarks/results/lookup-length-epyc-2026-12-06/``)."""
    groups: dict[tuple[bool, str], list[float]] = defaultdict(list)
    for a, b in zip(level, level[1:]):
        if a["new"] or a["reqs"] != batch_size or "n" not in b:
            continue
        did = ("heads, drafted" if b.get("drafted") else "heads, nothing drafted") if b.get("heads_ran") \
            else "no heads"
        groups[(bool(a["spec"]), did)].append(1e3 * (b["t"] - a["t"]))
    return {k: (len(v), statistics.median(v)) for k, v in sorted(groups.items())}


def _row(label, c: dict) -> str:
    def ms(kind: str) -> float:  # mean milliseconds of a step of that kind
        steps = c.get(f"{kind}_steps", 0)
        return 1e3 * c.get(f"{kind}_seconds", 0) / steps if steps else 0.0

    def per_drafted(key: str) -> float:
        steps = c.get("drafted_steps", 0)
        return c.get(key, 0) / steps if steps else 0.0

    cells = [label, f"{c.get('steps', 0):.0f}", f"{c.get('seconds', 0):.2f}", f"{c.get('prefill_steps', 0):.0f}",
             f"{c.get('drafted_steps', 0):.0f}", f"{ms('drafted'):.1f}",
             *(f"{per_drafted(k):.1f}" for k in ("draft_tokens", "lookup_tokens", "accepted")),
             f"{c.get('plain_steps', 0):.0f}",
             f"{ms('plain'):.1f}",
             *(f"{c.get(k, 0):.0f}" for k in ("loses", "lookup_loses", "pays", "probe", "explore"))]
    return "| " + " | ".join(str(x) for x in cells) + " |"


def report(paths: list[str], min_steps: int = 20, drafter_at: int | None = None, gap: float = GAP_S) -> str:
    """Markdown: per file and level (steps less than ``gap`` seconds apart, :func:`levels`) of at least
    ``min_steps`` steps, a row per batch size and one for the drain;
    with ``drafter_at``, also that batch size's decode steps by what the drafter did at their end
    (:func:`by_drafter`)."""
    head = ("| requests | steps | s | prompt steps | drafted | ms | draft tokens | of lookup | accepted | plain | ms | "
            "loses | lookup loses | pays | probes | explores |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            "---:|---:|---:|---:|---:|")
    out = []
    for path in paths:
        for i, level in enumerate(lv for lv in levels(read(path), gap) if len(lv) >= min_steps):
            s = summarize(level)
            out += [f"### {os.path.basename(path)}, level {i}: {s['steps']} steps, {s['seconds']:.1f} s", "", head]
            out += [_row(n, c) for n, c in s["by_batch"].items()]
            if s["draining"]:
                out.append(_row("draining", s["draining"]))
            out.append("")
            groups = by_drafter(level, drafter_at) if drafter_at is not None else {}
            if groups:
                out += [f"Steps of {drafter_at} requests by what the drafter did at their end:", "",
                        "| verified drafts | drafter | steps | median ms |", "|---|---|---:|---:|"]
                out += [f"| {'yes' if v else 'no'} | {did} | {n} | {ms:.1f} |" for (v, did), (n, ms) in groups.items()]
                out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="trace files written by the hook")
    ap.add_argument("--min-steps", type=int, default=20, help="leave out levels of fewer steps (warm-ups)")
    ap.add_argument("--drafter-at", type=int, default=None, metavar="N",
                    help="also split the decode steps of N requests by what the drafter did at their end")
    ap.add_argument("--gap", type=float, default=GAP_S, metavar="SECONDS",
                    help=f"steps further apart start a new level (default {GAP_S}; under steady load a step with "
                         f"a burst of prompts can take longer: pass more, below the pause between levels)")
    args = ap.parse_args(argv)
    print(report(args.paths, args.min_steps, args.drafter_at, args.gap))


if __name__ == "__main__":
    main()
