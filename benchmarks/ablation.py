"""Ablation of the EntMTP scheduler in ONE engine, on the same prompts: no drafting, each tree of the set used
statically, and the scheduled policy.

    python benchmarks/ablation.py --tree-set humaneval --prompt-set humaneval --num-prompts 10 --max-tokens 96
    python benchmarks/ablation.py --tree-set gsm8k --prompt-set gsm8k --repeats 2 --out runs/ablation-gsm8k.json

One vLLM engine runs ``{"method": "entmtp", "tree_set": SET, "policy": SIGNAL}`` (the signal of the set's schedule:
``entropy`` or ``confidence``); the variants differ only in each request's ``extra_args``:
``entmtp_num_draft_tokens: 0`` (no drafting), ``entmtp_tree_id: ID`` (that tree every step, the schedule ignored)
or nothing (the schedule). The static trees are the schedule's and the ``--extra-trees`` best others of the set by
its own calibration (``--all-trees``: every tree of the set). Every variant is a phase that sends the same prompts
one request at a time (``--concurrency N``: N requests in flight, so the load cap ``max_verify_tokens_per_step``
and batched verification come into play); with ``--repeats`` the phases are rotated each round (interleaved), and
tokens/s are summed over the rounds. ``--interleave prompt`` (the default at one request at a time) goes further:
a phase is one prompt under one variant, and every prompt runs under all the variants back to back (their order
rotated by round and prompt), so a few seconds of the machine's drift fall on every variant alike instead of on
one variant's whole phase. The engine's prefix cache is emptied before every phase, so that each computes its
prompts (until 2026-12-07 it was kept, and the variants after a prompt's first phase found it cached). Same
engine, same process, same prompts: the ratios are fair ones. ``--skip-prompts N``
measures on prompts after the first N, which ``build-trees --num-prompts N`` calibrated the set on.

Per variant: output tokens/s and its ratio to no drafting and to the best static tree, mean acceptance length
(bonus token included; vLLM's counters), and for the schedule the share of steps each tree was chosen. Per tree:
the Pearson correlation between the request's entropy EMA when the tree was drafted (nats), and its path
confidence when tracked (the ``confidence`` policy), and the number of its draft tokens accepted (bonus
excluded), pooled over the phases.

Step cost per tree size and kind (``step_cost_by_nodes`` in the result, keys ``"N"`` for chains and ``"Nt"`` for
trees that need the tree-attention fix; ``vllm-entmtp build-trees --step-costs`` reads it): the median time of a
one-request decode step that verifies N draft nodes, over the median of one that verifies none (``step_ms``: the
engine times its steps, ``benchmarks/step_timer.py``). Medians of hundreds of steps shrug off the load spikes
that move a tokens/s ratio by 5-10 % on a shared machine. (The tokens/s estimate, ``MAL x (tokens/s without
drafting) / (tokens/s with the tree)``, is ``step_cost_by_nodes_from_rates``.) "No drafting" here still runs the
speculative pipeline with empty drafts; plain decoding without it is ``benchmarks/compare.py``'s baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

NO_DRAFT = "no-drafting"
SCHEDULED = "scheduled"


def variants(tree_ids: list[str]) -> list[tuple[str, dict | None]]:
    """``(name, extra_args per request)`` of every variant: no drafting, each tree, the schedule."""
    return ([(NO_DRAFT, {"entmtp_num_draft_tokens": 0})] + [(f"tree:{t}", {"entmtp_tree_id": t}) for t in tree_ids]
            + [(SCHEDULED, None)])


def best_unscheduled(tree_set, n: int) -> list[str]:
    """The ``n`` trees of a ``build-trees`` set outside its schedule with the highest expected speed-up over all
    positions by the set's own calibration (``metadata.expected_tokens_per_step_per_bin`` over
    ``metadata.cost.total``; the bins hold equal shares of the calibration's positions, being its quantiles),
    best first; trees without that metadata are skipped. The static variants an ablation adds so that "beats
    every static tree of its set" is measured against the set's best trees, not only the schedule's."""
    scheduled = set(tree_set.schedule.tree_ids) if tree_set.schedule is not None else set()
    ranked = []
    for t in tree_set.ids:
        m = tree_set.metadata.get(t, {})
        tokens, cost = m.get("expected_tokens_per_step_per_bin"), (m.get("cost") or {}).get("total")
        if t not in scheduled and tokens and cost:
            ranked.append((sum(tokens) / (len(tokens) * cost), t))
    return [t for _, t in sorted(ranked, key=lambda x: -x[0])[:n]]


def phase_order(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """``(round, name)`` of every phase: round ``r`` is ``names`` rotated by ``r`` (interleaving)."""
    return [(r, names[(i + r) % len(names)]) for r in range(repeats) for i in range(len(names))]


def prompt_phase_order(names: list[str], repeats: int, num_prompts: int) -> list[tuple[int, int, str]]:
    """``(round, prompt, name)`` of every phase when each phase is one prompt under one variant: in round ``r``
    prompt ``p`` runs under every variant back to back, ``names`` rotated by ``r + p``, so each variant goes
    first as often as the others and a slow stretch of the machine hits all of them within seconds."""
    return [(r, p, names[(i + r + p) % len(names)])
            for r in range(repeats) for p in range(num_prompts) for i in range(len(names))]


def select_prompts(prompt_set: str, num: int, *, skip: int = 0, max_chars: int | None = None) -> list:
    """The first ``num`` prompts of ``prompt_set`` shorter than ``max_chars`` characters, leaving out the set's
    first ``skip`` prompts (unfiltered: the ones ``vllm-entmtp build-trees --num-prompts skip`` calibrates on).
    Returns ``vllm_entmtp.datasets.Prompt`` objects; raises ``ValueError`` for an unknown set."""
    from vllm_entmtp.datasets import load_prompts

    seen = {p.id for p in load_prompts(prompt_set, limit=skip)} if skip else set()
    return [p for p in load_prompts(prompt_set, max_chars=max_chars) if p.id not in seen][:num]


def outputs_differing(outputs: dict[tuple[int, int], dict[str, list[int]]]) -> dict[str, int]:
    """Per variant, how many of its (round, prompt) greedy outputs differ token for token from no drafting's on
    the same prompt in the same round (float32 greedy decoding is lossless: all should be 0)."""
    out: dict[str, int] = {}
    for runs in outputs.values():
        ref = runs.get(NO_DRAFT)
        for name, ids in runs.items():
            if name != NO_DRAFT:
                out[name] = out.get(name, 0) + (ref is not None and ids != ref)
    return out


def outputs_text(differing: dict[str, int]) -> str:
    """One sentence on :func:`outputs_differing`'s counts."""
    differ = {n: k for n, k in differing.items() if k}
    return ("Greedy outputs: identical to no drafting's for every variant, round and prompt." if not differ else
            "Greedy outputs that differ from no drafting's (rounds x prompts): "
            + ", ".join(f"{n} {k}" for n, k in differ.items()) + ".")


def phase_name(r: int, p: int | None, name: str) -> str:
    """The harness's name of a phase: ``round:variant``, or ``round:prompt:variant`` for a one-prompt phase."""
    return f"{r}:{name}" if p is None else f"{r}:{p}:{name}"


def _diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def summarize(phases: list[dict], names: list[str]) -> dict:
    """Per variant: tokens, seconds, tokens/s, mean acceptance length (bonus incl.), choice shares; ratios."""
    out: dict[str, dict] = {n: {"output_tokens": 0, "seconds": 0.0, "num_drafts": 0, "num_accepted_tokens": 0,
                                "chosen": {}} for n in names}
    for ph in phases:
        o = out[ph["variant"]]
        o["output_tokens"] += ph["output_tokens"]
        o["seconds"] += ph["seconds"]
        o["num_drafts"] += ph["num_drafts"]
        o["num_accepted_tokens"] += ph["num_accepted_tokens"]
        for t, n in ph["chosen"].items():
            o["chosen"][t] = o["chosen"].get(t, 0) + n
    for o in out.values():
        o["tokens_per_s"] = o["output_tokens"] / o["seconds"] if o["seconds"] else None
        o["mean_acceptance_length_incl_bonus"] = (1 + o["num_accepted_tokens"] / o["num_drafts"]
                                                  if o["num_drafts"] else 1.0)
        total = sum(o["chosen"].values())
        o["choice_shares"] = {t: n / total for t, n in sorted(o["chosen"].items())} if total else {}
    base = out[NO_DRAFT]["tokens_per_s"] if NO_DRAFT in out else None
    statics = [n for n in names if n.startswith("tree:") and out[n]["tokens_per_s"]]
    best = max(statics, key=lambda n: out[n]["tokens_per_s"]) if statics else None
    for o in out.values():
        o["vs_no_drafting"] = o["tokens_per_s"] / base if base and o["tokens_per_s"] else None
        o["vs_best_static"] = (o["tokens_per_s"] / out[best]["tokens_per_s"]
                               if best and o["tokens_per_s"] else None)
    return {"variants": out, "best_static": best}


def step_cost_from_rates(summary: dict, key_of: dict[str, str]) -> dict[str, float]:
    """``{key: step cost relative to no drafting}`` of the static trees (``key_of``: tree id -> its
    ``vllm_entmtp.stats.step_key``); trees of the same key averaged, sorted by nodes."""
    base = summary["variants"].get(NO_DRAFT, {}).get("tokens_per_s")
    per: dict[int, list[float]] = {}
    for name, o in summary["variants"].items():
        if name.startswith("tree:") and base and o["tokens_per_s"]:
            cost = o["mean_acceptance_length_incl_bonus"] * base / o["tokens_per_s"]
            per.setdefault(key_of[name[len("tree:"):]], []).append(cost)
    from vllm_entmtp.stats import parse_step_key

    return {k: round(sum(v) / len(v), 4) for k, v in sorted(per.items(), key=lambda kv: parse_step_key(kv[0]))}


def tree_step_keys(tree_set, tree_ids) -> dict[str, str]:
    """``{tree id: vllm_entmtp.stats.step_key}`` (draft nodes, and whether it needs the tree-attention fix)."""
    from vllm_entmtp.stats import tree_step_key

    return {t: tree_step_key(tree_set.get(t)) for t in tree_ids}


def chosen_step_key(chosen: str, keys: dict[str, str]) -> str:
    """The step key of a ``chosen`` entry: a tree id, or ``id@n`` for the first ``n`` nodes of a chain (cut by
    the load cap or by ``schedule.chain_stop``), whose key is ``"n"``; ``""`` when unknown (a cut tree)."""
    base, _, n = chosen.partition("@")
    key = keys.get(base, "")
    if not n:
        return key
    return n if key.isdigit() else ""


def step_time_speedups(result: dict) -> dict[str, float]:
    """Per variant, its speed-up over no drafting estimated from the engine's median step times instead of the
    wall clock: ``output tokens / sum over its steps of the step cost of the tree drafted`` (``chosen`` counts
    the request-steps per tree, ``step_cost_by_nodes`` their median cost, a step that drafts nothing costs 1).
    Medians of hundreds of steps pooled over the rounds do not move with the machine's drift, which moved the
    same variant's tokens/s by up to 25 % between rounds of one run here; tokens/s ratios move with it.
    Empty when the result has no step costs, ran several requests at a time, or its tree set cannot be read;
    variants that drafted a tree without a measured cost are left out."""
    costs = result.get("step_cost_by_nodes") or {}
    keys = result.get("step_keys")
    if not costs or result.get("concurrency", 1) > 1:  # the engine times one-request steps only, and with
        return {}  # several requests in flight the chosen counts are request-steps, not steps
    if keys is None:  # results written before step_keys: the keys from the tree set (its path as recorded)
        from vllm_entmtp.errors import TreeSetError
        from vllm_entmtp.trees import load_tree_set

        try:
            ts = load_tree_set(result["tree_set"])
        except TreeSetError:
            return {}
        keys = tree_step_keys(ts, ts.ids)
    out = {}
    for name, o in result["variants"].items():
        units = 0.0
        for tree, n in o["chosen"].items():
            cost = 1.0 if tree == "none" else costs.get(chosen_step_key(tree, keys))
            if cost is None:
                break
            units += n * cost
        else:
            if units:
                out[name] = o["output_tokens"] / units
    return out


def format_table(summary: dict) -> str:
    rows = [f"{'variant':<22} {'tok/s':>7} {'vs none':>8} {'vs best':>8} {'MAL':>6}  choice shares",
            "-" * 90]
    for name, o in summary["variants"].items():
        shares = ", ".join(f"{t} {p:.0%}" for t, p in o["choice_shares"].items()) if name == SCHEDULED else ""
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        rows.append(f"{name:<22} {fmt(o['tokens_per_s'], '7.2f')} {fmt(o['vs_no_drafting'], '8.3f')} "
                    f"{fmt(o['vs_best_static'], '8.3f')} {o['mean_acceptance_length_incl_bonus']:>6.3f}  {shares}")
    rows.append(f"best static tree: {summary['best_static']}; MAL: mean acceptance length incl. the bonus token")
    return "\n".join(rows)


def per_round(result: dict, name: str) -> list[float]:
    """Tokens/s of variant ``name`` in each round of a result (the spread shows the run's noise); a round's
    phases (one per prompt with ``--interleave prompt``) pooled."""
    tokens: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for ph in result["phases"]:
        if ph["variant"] == name:
            tokens[ph["round"]] = tokens.get(ph["round"], 0) + ph["output_tokens"]
            seconds[ph["round"]] = seconds.get(ph["round"], 0.0) + ph["seconds"]
    return [tokens[r] / seconds[r] for r in sorted(tokens) if seconds[r]]


def load_text(result: dict) -> str:
    """How the result's phases loaded the engine: one request at a time, or N in flight (and the load cap)."""
    n = result.get("concurrency", 1)  # results written before --concurrency ran one at a time
    if n == 1:
        return "one request at a time"
    cap = result.get("max_verify_tokens_per_step")
    load = result.get("load_policy")
    return (f"{n} requests in flight" + (f", load_policy {load}" if load else "")
            + (f", max_verify_tokens_per_step {cap}" if cap else ""))


def markdown_report(results: list[dict], max_loss: float = 0.02) -> str:
    """A markdown report of several ablation results (one per task): a table per task, then the verdict on the
    scheduler's bar (beats every static tree of its set on at least two tasks; never more than ``max_loss``
    below the best one)."""
    out, beats, worst = [], [], []
    for r in results:
        v, best = r["variants"], r["best_static"]
        out += [f"### {r['prompt_set']} (tree set `{Path(r['tree_set']).stem}`)", "",
                f"{r['num_prompts']} prompts"
                f"{' (after the first ' + str(r['skip_prompts']) + ')' if r.get('skip_prompts') else ''} x "
                f"{r['max_tokens']} tokens, {r['repeats']} rounds"
                f"{' (every prompt under all variants back to back)' if r.get('interleave') == 'prompt' else ''}, "
                f"{r['dtype']}, one "
                f"{'compiled' if r.get('compiled') else 'eager'} engine, {load_text(r)}.", "",
                "| variant | tokens/s | per round | vs no drafting | vs best static | step-time estimate: vs no "
                "drafting / vs best static | MAL (bonus incl.) | choice shares |",
                "|---|---:|---|---:|---:|---:|---:|---|"]
        est = step_time_speedups(r)
        best_est = max((x for n, x in est.items() if n.startswith("tree:")), default=None)
        for name, o in v.items():
            shares = ", ".join(f"{t} {p:.0%}" for t, p in o["choice_shares"].items()) if name == SCHEDULED else ""
            rounds = " / ".join(f"{x:.2f}" for x in per_round(r, name))
            e = (f"{est[name]:.3f} / {est[name] / best_est:.3f}" if name in est and best_est else "-")
            out.append(f"| {name} | {o['tokens_per_s']:.2f} | {rounds} | {o['vs_no_drafting']:.3f} | "
                       f"{o['vs_best_static']:.3f} | {e} | {o['mean_acceptance_length_incl_bonus']:.3f} | {shares} |")
        for key, what in (("entropy_acceptance", "entropy EMA (nats)"), ("confidence_acceptance", "path confidence")):
            corr = r.get(key, {})
            if corr:
                out += ["", f"Pearson r, {what} when a tree was drafted vs its accepted draft tokens: " + ", ".join(
                    f"{t} {c['r']:+.2f} (n={c['n']})" for t, c in corr.items() if c.get("r") is not None)]
        if r.get("outputs_differing") is not None:
            out += ["", outputs_text(r["outputs_differing"])]
        if r.get("step_cost_by_nodes"):
            out += ["", "Step cost by draft nodes (median engine step period, no drafting = 1; \"Nt\": a tree that "
                    "needs the attention fix): "
                    + ", ".join(f"{n}: {c:.3f}" for n, c in r["step_cost_by_nodes"].items())]
        out.append("")
        if SCHEDULED not in v:  # a step-cost run (--no-schedule): no verdict
            continue
        statics = [n for n in v if n.startswith("tree:")]
        speeds = {n: o["tokens_per_s"] for n, o in v.items()}
        for kind, sp in (("wall", speeds), ("steps", est)):
            if SCHEDULED not in sp or any(n not in sp for n in statics):
                continue
            if all(sp[SCHEDULED] > sp[n] for n in statics):
                beats.append((kind, r["prompt_set"]))
            worst.append((kind, r["prompt_set"], sp[SCHEDULED] / max(sp[n] for n in statics)))
    out += ["### Verdict", ""]
    for kind, what in (("wall", "tokens/s (wall clock)"), ("steps", "step-time estimate (median step costs)")):
        b = [t for k, t in beats if k == kind]
        w = [(t, x) for k, t, x in worst if k == kind]
        if not w:
            continue
        ok_beats, ok_loss = len(b) >= 2, all(x >= 1 - max_loss for _, x in w)
        out += [f"- {what}: beats every static tree of its set on {len(b)} task(s) ({', '.join(b) or 'none'}); "
                f"needed: 2 -> {'met' if ok_beats else 'not met'}",
                f"- {what}: scheduled / best static tree: " + ", ".join(f"{t} {x:.3f}" for t, x in w)
                + f"; needed: never below {1 - max_loss:.2f} -> {'met' if ok_loss else 'not met'}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", nargs="+", metavar="RESULT_JSON",
                    help="do not run: print a markdown report of these results (--out: write it there)")
    ap.add_argument("--tree-set", help="a tree set with a schedule (name in trees/ or path); required to run")
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--skip-prompts", type=int, default=0, metavar="N",
                    help="leave out the first N prompts of the set (as `vllm-entmtp build-trees --num-prompts N` "
                         "reads them: the set's first N, unfiltered), so that a tree set calibrated on them is "
                         "measured on prompts it has not seen (default %(default)s)")
    ap.add_argument("--max-prompt-chars", type=int, default=1500,
                    help="skip prompts whose text is this long or longer (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds, phases rotated each round (default 1)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight per phase (default 1: one at a time)")
    ap.add_argument("--interleave", choices=("prompt", "round"), default=None,
                    help="prompt: a phase per prompt and variant, every prompt under all variants back to back "
                         "(the default at concurrency 1); round: a phase per variant and round, all prompts "
                         "(the default, and the only choice, with several requests in flight)")
    ap.add_argument("--max-verify-tokens-per-step", type=int, default=None,
                    help="the engine's load cap (the option of the same name; default: the option's default)")
    ap.add_argument("--load-policy", choices=("cost", "cap"), default=None,
                    help="the engine's load_policy (the option of the same name; default: the option's default)")
    ap.add_argument("--all-trees", action="store_true",
                    help="every tree of the set statically, not only the schedule's")
    ap.add_argument("--extra-trees", type=int, default=1, metavar="N",
                    help="also run statically the N trees outside the schedule that the set's calibration expects "
                         "to be fastest (default %(default)s; 0: the schedule's trees only)")
    ap.add_argument("--policy", choices=("entropy", "confidence"), default=None,
                    help="the engine's policy (default: the signal of the set's schedule; entropy without one). "
                         "It decides what every step computes: confidence costs a head evaluation per step")
    ap.add_argument("--no-schedule", action="store_true",
                    help="leave out the scheduled variant (e.g. measuring step costs with --all-trees)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compiled", action="store_true",
                    help="run the engine with torch.compile, as `vllm serve` does (default: eager, which starts "
                         "faster but makes the target's forward, and so every step, longer)")
    ap.add_argument("--model", default=None, help="target model folder (default: the prepared default model)")
    ap.add_argument("--heads", default=None, help="heads folder (default: the registered ones)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.report:
        try:
            text = markdown_report([json.loads(Path(f).read_text()) for f in args.report])
        except (OSError, json.JSONDecodeError, KeyError) as e:
            ap.error(f"--report: {e}")
        if args.out:
            Path(args.out).write_text(text)
        print(text, end="")
        return 0
    if args.tree_set is None:
        ap.error("--tree-set is required (or --report FILES)")
    if min(args.repeats, args.num_prompts, args.max_tokens, args.concurrency) < 1:
        ap.error("--repeats, --num-prompts, --max-tokens and --concurrency must be >= 1")
    if args.skip_prompts < 0:
        ap.error("--skip-prompts must be >= 0")
    if args.extra_trees < 0:
        ap.error("--extra-trees must be >= 0")
    interleave = args.interleave or ("prompt" if args.concurrency == 1 else "round")
    if interleave == "prompt" and args.concurrency > 1:
        ap.error("--interleave prompt needs --concurrency 1 (a phase of one prompt has one request in flight)")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_entmtp.harness import run_job
    from vllm_entmtp.models import prepare_default_model
    from step_timer import step_costs_from_times
    from vllm_entmtp.config import option_default
    from vllm_entmtp.stats import STEP_HOOK_ENV
    from vllm_entmtp.trees import NO_DRAFT_ID, load_tree_set

    ts = load_tree_set(args.tree_set)
    if ts.schedule is None and not args.all_trees:
        ap.error(f"tree set {ts.source} has no schedule: give --all-trees, or a set built by vllm-entmtp build-trees")
    tree_ids = ts.ids if args.all_trees else ([t for t in ts.schedule.tree_ids if t != NO_DRAFT_ID]
                                              + best_unscheduled(ts, args.extra_trees))
    vs = dict(variants(tree_ids))
    if args.no_schedule:
        vs.pop(SCHEDULED)
    prompts = select_prompts(args.prompt_set, args.num_prompts, skip=args.skip_prompts,
                             max_chars=args.max_prompt_chars)
    if not prompts:
        ap.error(f"no prompts of {args.prompt_set} left after --skip-prompts {args.skip_prompts}")
    # (round, prompt index or None for all prompts, variant) of every phase
    order = (prompt_phase_order(list(vs), args.repeats, len(prompts))
             if interleave == "prompt" else [(r, None, n) for r, n in phase_order(list(vs), args.repeats)])
    convs = [p.messages for p in prompts]
    policy = args.policy or (ts.schedule.signal if ts.schedule is not None else "entropy")
    spec = {"method": "entmtp", "tree_set": str(ts.source), "policy": policy}
    need = max(ts.get(t).num_nodes for t in tree_ids)
    if ts.schedule is None or need > max(ts.get(t).num_nodes for t in ts.schedule.tree_ids if t != NO_DRAFT_ID):
        # room for every tree measured (the default: the schedule's largest tree, or a lookup chain if longer)
        spec["num_speculative_tokens"] = max(need, option_default("lookup_tokens"))
    # the engine times its steps by draft nodes (benchmarks/step_timer.py, imported by the engine's workers)
    os.environ[STEP_HOOK_ENV] = "step_timer"
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    if args.heads:
        spec["model"] = args.heads
    if args.max_verify_tokens_per_step is not None:
        spec["max_verify_tokens_per_step"] = args.max_verify_tokens_per_step
    if args.load_policy is not None:
        spec["load_policy"] = args.load_policy
    job = {"model": args.model or str(prepare_default_model()), "speculative_config": spec, "dtype": args.dtype,
           "max_model_len": 2048, "max_num_seqs": max(4, args.concurrency), "conversations": convs,
           "max_tokens": args.max_tokens, "engine_args": {"enforce_eager": not args.compiled},
           # every phase computes its prompts: kept, the prefix cache served the later variants' prompts
           "phases": [{"name": phase_name(r, p, n), "concurrency": args.concurrency, "reset_prefix_cache": True,
                       "prompts": None if p is None else [p],
                       "extra_args": ([vs[n]] * (len(convs) if p is None else 1)) if vs[n] is not None else None}
                      for r, p, n in order]}
    try:
        raw = run_job(job)
    except RuntimeError as e:
        sys.exit(str(e))
    phases, before, outputs = [], {}, {}
    for (r, p, n) in order:
        res = raw[phase_name(r, p, n)]
        chosen = res["tree_stats"].get("chosen", {})
        for i, ids in enumerate(res["token_ids"]):
            outputs.setdefault((r, i if p is None else p), {})[n] = ids
        phases.append({"round": r, **({} if p is None else {"prompt": p}), "variant": n,
                       "output_tokens": sum(map(len, res["token_ids"])),
                       "seconds": res["seconds"], "num_drafts": res["spec"]["num_drafts"],
                       "num_accepted_tokens": res["spec"]["num_accepted_tokens"], "chosen": _diff(chosen, before)})
        before = chosen
    final_stats = raw[phase_name(*order[-1])]["tree_stats"]
    summary = summarize(phases, list(vs))
    summary["outputs_differing"] = outputs_differing(outputs)
    summary["entropy_acceptance"] = final_stats.get("entropy_acceptance", {})
    summary["confidence_acceptance"] = final_stats.get("confidence_acceptance", {})
    summary["step_ms"] = final_stats.get("step_ms", {})
    # the engine times one-request steps only: with several requests in flight, only the phases' tails
    summary["step_cost_by_nodes"] = step_costs_from_times(summary["step_ms"]) if args.concurrency == 1 else {}
    summary["step_keys"] = tree_step_keys(ts, tree_ids)
    summary["step_cost_by_nodes_from_rates"] = step_cost_from_rates(summary, summary["step_keys"])
    summary["policy"] = policy
    source = Path(ts.source).resolve()
    shown = source.relative_to(Path.cwd()) if source.is_relative_to(Path.cwd()) else source  # no machine paths
    result = {"tree_set": str(shown), "prompt_set": args.prompt_set, "num_prompts": len(prompts),
              "skip_prompts": args.skip_prompts, "prompt_ids": [p.id for p in prompts],
              "max_tokens": args.max_tokens, "repeats": args.repeats, "interleave": interleave, "dtype": args.dtype,
              "concurrency": args.concurrency, "max_verify_tokens_per_step": args.max_verify_tokens_per_step,
              "load_policy": args.load_policy, "compiled": args.compiled, "phases": phases,
              **summary}
    print(f"{args.prompt_set}: {len(prompts)} prompts x {args.max_tokens} tokens, tree set {ts.name}, "
          f"{args.repeats} round(s) interleaved by {interleave}, {args.dtype}, "
          f"one {'compiled' if args.compiled else 'eager'} engine, "
          f"concurrency {args.concurrency}")
    print(format_table(summary))
    print(outputs_text(summary["outputs_differing"]))
    for key, what in (("entropy_acceptance", "entropy EMA (nats)"), ("confidence_acceptance", "path confidence")):
        corr = summary[key]
        if corr:
            print(f"{what} vs accepted draft tokens, Pearson r per tree: " + ", ".join(
                f"{t} {v['r']:+.2f} (n={v['n']})" for t, v in corr.items() if v.get("r") is not None))
    print("step cost by draft nodes (no drafting = 1), median step times: " + ", ".join(
        f"{n}: {c:.3f}" for n, c in summary["step_cost_by_nodes"].items()))
    print("  from tokens/s and MAL: " + ", ".join(
        f"{n}: {c:.3f}" for n, c in summary["step_cost_by_nodes_from_rates"].items()))
    est = step_time_speedups(result)
    if est:
        print("speed-up over no drafting from the median step times: " + ", ".join(
            f"{n} {x:.3f}" for n, x in est.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
