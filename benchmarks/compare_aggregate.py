"""From the runs of one ``benchmarks/compare.py`` run to one row per method, task and concurrency (statistics over
the repeats, ratios against the baselines taken within each repeat), and the project's targets read against
them."""
from __future__ import annotations

import math

import throughput as tp
from compare_methods import BASELINES, PLAIN_BEST, PLAIN_METHODS, STATIC_TREES


def stat(values: list[float]) -> dict | None:
    """``{"mean", "min", "max", "std", "n"}`` of the values that are not None; None when there are none."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    mean = sum(vals) / len(vals)
    return {"mean": mean, "min": min(vals), "max": max(vals),
            "std": math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)), "n": len(vals)}


def merge_tree_choice(tree_choices: list[dict]) -> dict:
    """The ``vllm:entmtp_tree_chosen`` counts of several levels' ``tree_choice``, summed per label set."""
    merged: dict[str, float] = {}
    for tc in tree_choices:
        for labels, n in (tc or {}).get(tp.CHOSEN_FAMILY, {}).items():
            merged[labels] = merged.get(labels, 0) + n
    return {tp.CHOSEN_FAMILY: merged}


def pooled_mal(levels: list[dict]) -> float | None:
    """1 + accepted / drafts over several levels' ``spec_decode`` counters (None without drafts)."""
    drafts = accepted = 0
    for lv in levels:
        sd = lv.get("spec_decode") or {}
        drafts += sd.get("num_drafts") or 0
        accepted += sd.get("num_accepted_tokens") or 0
    return 1 + accepted / drafts if drafts else None


def stalled_cells(runs: list[dict]) -> set[tuple[str, int, int]]:
    """``(task, concurrency, repeat)`` of the levels kept although the machine stood still during one method's
    run of them (``client_stall_s`` over ``throughput.STALL_LIMIT_S``)."""
    return {(run["task"], lv["concurrency"], run["repeat"]) for run in runs for lv in run["levels"]
            if tp.stalled(lv)}


def _levels_by_key(runs: list[dict]) -> dict[tuple, dict[int, dict]]:
    """``{(method, task, concurrency): {repeat: level}}``, without the :func:`stalled_cells`: a repeat of a level
    that one method ran while the machine stood still is left out for every method (its ratios would be off)."""
    stalled = stalled_cells(runs)
    out: dict[tuple, dict[int, dict]] = {}
    for run in runs:
        for lv in run["levels"]:
            if (run["task"], lv["concurrency"], run["repeat"]) not in stalled:
                out.setdefault((run["method"], run["task"], lv["concurrency"]), {})[run["repeat"]] = lv
    return out


def with_plain_best(by_key: dict[tuple, dict[int, dict]]) -> dict[tuple, dict[int, dict]]:
    """``by_key`` plus the pseudo-method ``plain-best``: per task, concurrency and repeat, the level of the plain
    method (any dtype) with the highest output tokens/s, its ``plain_method`` naming which."""
    out = dict(by_key)
    best: dict[tuple, dict[int, dict]] = {}
    for (method, task, conc), reps in by_key.items():
        if method not in PLAIN_METHODS:
            continue
        cell = best.setdefault((PLAIN_BEST, task, conc), {})
        for r, lv in reps.items():
            if lv.get("output_throughput") is None:
                continue
            if r not in cell or lv["output_throughput"] > cell[r]["output_throughput"]:
                cell[r] = lv | {"plain_method": method}
    out.update({k: v for k, v in best.items() if v})
    return out


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (method, task, concurrency), all from ``runs`` (one compare run): statistics over the repeats
    of output tokens/s, median TPOT/TTFT and MAL (incl. bonus); ratios of output tokens/s vs ``plain-best``
    (:func:`with_plain_best`; its own rows name the plain method that was fastest), each plain method and each
    baseline that ran, taken per repeat (same repeat, so measured side by side) and then averaged; tree-choice
    shares of the counts pooled over the repeats."""
    by_key = with_plain_best(_levels_by_key(runs))
    rows = []
    for (method, task, conc), reps in by_key.items():
        def metric(name, reps=reps):
            return stat([lv.get(name) for lv in reps.values()])

        ratios = {}
        for base in (PLAIN_BEST, *PLAIN_METHODS, *BASELINES, *STATIC_METHODS):
            base_reps = by_key.get((base, task, conc), {})
            ratios[base] = stat([lv["output_throughput"] / base_reps[r]["output_throughput"]
                                 for r, lv in reps.items()
                                 if r in base_reps and lv.get("output_throughput") is not None
                                 and base_reps[r].get("output_throughput")])
        rows.append({
            "method": method, "task": task, "concurrency": conc, "repeats": sorted(reps),
            "completed": sum(lv.get("completed", 0) for lv in reps.values()),
            "failed": sum(lv.get("failed", 0) for lv in reps.values()),
            "output_throughput": metric("output_throughput"), "median_tpot_ms": metric("median_tpot_ms"),
            "median_ttft_ms": metric("median_ttft_ms"),
            "mal": stat([(lv.get("spec_decode") or {}).get("mean_acceptance_length_incl_bonus")
                         for lv in reps.values()]),
            "ratios": {k: v for k, v in ratios.items() if v is not None},
            "plain_methods": sorted({lv["plain_method"] for lv in reps.values() if "plain_method" in lv}),
            "tree_choice_shares": tp.tree_choice_shares(merge_tree_choice([lv.get("tree_choice")
                                                                           for lv in reps.values()])),
        })
    return rows


#: The project's targets for ``{"method": "entmtp"}`` (the method ``entmtp``), read against a run as it came out
#: (never tuned for): output tokens/s over plain decoding at concurrency 1, per task.
SPEEDUP_TARGETS = {"humaneval": 1.6, "gsm8k": 1.6, "sharegpt": 1.3, "creative": 1.3}
VS_BASELINE_TARGETS = {"ngram": 1.6, "vllm-medusa": 1.36}  # on at least one task, concurrency 1
VS_HYDRA_TARGET = 1.15  # over hydra-tree, mean of the four tasks' ratios, concurrency 1
LOAD_CONCURRENCY = 16  # never below plain decoding at this concurrency and every higher one that ran
NEVER_BELOW = ("ngram", "entmtp-heads")  # on every task, at every concurrency that ran
STATIC_METHODS = tuple(f"static-{t}" for t in STATIC_TREES)
VS_STATIC_TARGET = 1.05  # the per-request schedule over the best static tree, mixed task, every concurrency > 1
MEMORY_TARGET = 1.10  # peak server memory over plain's


def peak_memory(runs: list[dict]) -> dict[str, float]:
    """Per method, the largest ``server_peak_rss_mib`` over its runs (MiB); methods without a reading left out."""
    out: dict[str, float] = {}
    for run in runs:
        v = run.get("server_peak_rss_mib")
        if v is not None:
            out[run["method"]] = max(out.get(run["method"], 0.0), float(v))
    return out


def targets(doc: dict, method: str = "entmtp") -> list[dict]:
    """The project's targets read against this run: one ``{"target", "needed", "measured", "met"}`` per target,
    ``met`` None where the run lacks what the target needs (a method, task or concurrency level it did not run)."""
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}

    def ratio(task, conc, base):
        r = rows.get((method, task, conc))
        st = r and r["ratios"].get(base)
        return st["mean"] if st else None

    def verdict(ok, have):
        return bool(ok) if have else None

    out = []
    for task, need in SPEEDUP_TARGETS.items():
        v = ratio(task, 1, PLAIN_BEST)
        out.append({"target": f"{method} / {PLAIN_BEST}, {task}, concurrency 1", "needed": f">= {need:.2f}x",
                    "measured": "-" if v is None else f"{v:.2f}x", "met": verdict(v is not None and v >= need,
                                                                                   v is not None)})
    for base, need in VS_BASELINE_TARGETS.items():
        got = {t: ratio(t, 1, base) for t in SPEEDUP_TARGETS}
        got = {t: v for t, v in got.items() if v is not None}
        best = max(got.items(), key=lambda kv: kv[1]) if got else None
        out.append({"target": f"{method} / {base}, best task, concurrency 1", "needed": f">= {need:.2f}x on one task",
                    "measured": "-" if best is None else f"{best[1]:.2f}x ({best[0]}); "
                    + ", ".join(f"{t} {v:.2f}x" for t, v in got.items()),
                    "met": verdict(best is not None and best[1] >= need, best is not None)})
    got = [ratio(t, 1, "hydra-tree") for t in SPEEDUP_TARGETS]
    have = all(v is not None for v in got)
    mean = sum(got) / len(got) if have else None
    out.append({"target": f"{method} / hydra-tree, mean of the four tasks, concurrency 1",
                "needed": f">= {VS_HYDRA_TARGET:.2f}x", "measured": "-" if mean is None else f"{mean:.2f}x",
                "met": verdict(have and mean >= VS_HYDRA_TARGET, have)})
    levels = sorted({c for (_, _, c) in rows if c >= LOAD_CONCURRENCY}) or [LOAD_CONCURRENCY]
    for conc in levels:
        got = {t: ratio(t, conc, PLAIN_BEST) for t in SPEEDUP_TARGETS}
        have = all(v is not None for v in got.values())
        out.append({"target": f"{method} / {PLAIN_BEST}, every task, concurrency {conc}", "needed": ">= 1.00x",
                    "measured": "-" if not have else ", ".join(f"{t} {v:.2f}x" for t, v in got.items()),
                    "met": verdict(have and min(got.values()) >= 1.0, have)})
    concs = sorted({c for (m, _, c) in rows if m == method})
    for base in NEVER_BELOW:
        got = {(t, c): ratio(t, c, base) for t in SPEEDUP_TARGETS for c in concs}
        got = {k: v for k, v in got.items() if v is not None}
        out.append({"target": f"{method} / {base}, every task and concurrency", "needed": ">= 1.00x",
                    "measured": "-" if not got else ", ".join(f"{t} c{c} {v:.2f}x" for (t, c), v in got.items()),
                    "met": verdict(got and min(got.values()) >= 1.0, bool(got))})
    for who in (method, "entmtp-heads"):
        for conc in sorted({c for (m, t, c) in rows if m == who and t == "mixed" and c > 1}):
            r = rows[(who, "mixed", conc)]
            got = {b: r["ratios"][b]["mean"] for b in STATIC_METHODS if b in r["ratios"]}
            worst = min(got.items(), key=lambda kv: kv[1]) if got else None
            out.append({"target": f"{who} / the best static tree, mixed, concurrency {conc}",
                        "needed": f">= {VS_STATIC_TARGET:.2f}x", "measured": "-" if not got else
                        f"{worst[1]:.2f}x ({worst[0]}); " + ", ".join(f"{b} {v:.2f}x" for b, v in got.items()),
                        "met": verdict(got and worst[1] >= VS_STATIC_TARGET, bool(got))})
    mem = peak_memory(doc["runs"])
    plain = min((mem[m] for m in PLAIN_METHODS if m in mem), default=None)
    have = method in mem and plain is not None
    out.append({"target": f"{method} peak server memory / plain's", "needed": f"<= {MEMORY_TARGET:.2f}x",
                "measured": "-" if not have else f"{mem[method] / plain:.3f}x ({mem[method]:.0f} / "
                f"{plain:.0f} MiB)", "met": verdict(have and mem[method] <= MEMORY_TARGET * plain, have)})
    return out
