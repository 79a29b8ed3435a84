"""What a ``benchmarks/compare.py`` run writes: ``results.json``, ``report.md`` (tables per task and concurrency),
``headline.md`` (the figures the README quotes) and the plots, all from the results document."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import throughput as tp
from compare_aggregate import aggregate, merge_tree_choice, peak_memory, pooled_mal, stat, targets
from compare_methods import BASELINES, PLAIN_BEST, SERVED_MODEL_NAME, is_entmtp
from compare_server import portable


def fmt_stat(st: dict | None, spec: str, suffix: str = "") -> str:
    """``mean`` alone for one value, else ``mean [min-max]``; ``-`` for None."""
    if st is None:
        return "-"
    text = format(st["mean"], spec) + suffix
    if st["n"] > 1:
        text += f" [{format(st['min'], spec)}–{format(st['max'], spec)}]"
    return text


def fmt_shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{t} {100 * v:.0f}%" for t, v in sorted(shares.items(), key=lambda kv: -kv[1])) or "-"


def _ordered(names, order: list[str]) -> list[str]:
    known = [n for n in order if n in names]
    return known + sorted(n for n in names if n not in known)


def requests_per_level(s: dict) -> str:
    """The requests a level sent, in words: ``num_requests``, or ``waves`` times the requests in flight where more
    (``waves`` 1 in results written before it existed), with the count at each level."""
    waves = s.get("waves", 1)
    times = "as many as" if waves == 1 else f"{waves} times as many as"
    counts = ", ".join(f"{tp.level_requests(s['num_requests'], waves, c)} at c{c}" for c in s["concurrency"])
    return f"{s['num_requests']} requests per level, or {times} in flight where more ({counts})"


def runtime_lines(runs: list[dict]) -> list[str]:
    """Report lines: the OpenMP binding and ``LD_PRELOAD`` the servers ran with (one line when all agree)."""
    seen: dict[str, list[str]] = {}
    for run in runs:
        rt = run.get("server_runtime")
        if rt is None:
            continue
        env = rt.get("env", {})
        key = (f"LD_PRELOAD={', '.join(env.get('LD_PRELOAD', [])) or '(unset)'}; OpenMP binding: "
               + ("; ".join(rt.get("omp_binding", [])) or "(not logged)"))
        seen.setdefault(key, [])
        if run["method"] not in seen[key]:
            seen[key].append(run["method"])
    if len(seen) == 1:
        return [f"- servers: {next(iter(seen))}"]
    return [f"- servers {', '.join(m)}: {k}" for k, m in seen.items()]


def render_report(doc: dict) -> str:
    """``report.md`` of a results document (``results.json``'s content)."""
    s, m = doc["settings"], doc["machine"]
    methods = list(s["methods"])
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}
    ran = {r["method"] for r in doc["aggregate"]}
    baselines = [b for b in (PLAIN_BEST, *BASELINES) if b in ran]
    multi = s["repeats"] > 1
    out = ["# Speculative decoding: side-by-side comparison", "",
           f"- command: `{doc['command']}`",
           f"- machine: {m.get('cpu_model')}, {m.get('cpu_count')} CPUs ({m.get('usable_cpus')} usable), "
           f"{m.get('platform')}",
           f"- date: {doc['date']} (run {doc['run_id']})",
           *runtime_lines(doc["runs"]),
           f"- target model: {SERVED_MODEL_NAME}; tasks: {', '.join(s['tasks'])}; concurrency: "
           f"{', '.join(map(str, s['concurrency']))}; {requests_per_level(s)}, each of at most "
           f"{s['max_tokens']} tokens, greedy (temperature 0){', ignore_eos' if s['ignore_eos'] else ''}; "
           f"repeats: {s['repeats']}", ""]
    if doc.get("incomplete"):
        out += [f"**Incomplete run:** {doc['incomplete']}", ""]
    out += ["Speed is a ratio measured within one run on one machine: every method was served in turn by this "
            "run, on the same machine, with the same prompts and settings. Compare the methods with each other "
            "(the `vs` columns); never compare these numbers with those of another run or machine."]
    if s.get("paired"):
        started = ("started anew every repeat (`--fresh-servers`)" if s.get("fresh_servers")
                   else "started once")
        out += ["", f"Methods ran paired (`--paired`): every method's server was {started} and they took turns, "
                "level by level, their order rotated from one level to the next; a server waited idle while another "
                "was measured."]
    if multi:
        order = ("" if s.get("paired") else "Methods ran interleaved: their order was rotated every repeat. ")
        out += ["", f"{order}Each figure is the mean over the {s['repeats']} repeats, [min–max] after it; a ratio "
                f"is taken within each repeat, then averaged."]
    resets = {bool((r.get("config") or {}).get("reset_prefix_cache")) for r in doc["runs"]}
    if resets == {True}:
        out += ["", "Every server's prefix cache was emptied before every level: each level computed its prompts."]
    elif resets:
        out += ["", "**Prefix cache kept between levels** (a run before `--reset-prefix-cache`): every level and "
                "repeat sends the same prompts, so a level could find prompts that an earlier level or repeat of "
                "the same server had sent already cached (only their last block computed)."]
    if s.get("enforce_eager"):
        out += ["", "The servers ran with `--enforce-eager` (no torch.compile): faster start-up, but every "
                "method's speed differs from a compiled server's."]
    out += ["", "## Methods", "", "| method | --speculative-config | what | server start-up (s) | peak memory (MiB) |",
            "|---|---|---|---|---:|"]
    mem = peak_memory(doc["runs"])
    startup: dict[str, list] = {}
    for run in doc["runs"]:
        startup.setdefault(run["method"], {})[run["repeat"]] = run.get("server_startup_s")
    for name, info in s["methods"].items():
        spec = json.dumps(info["speculative_config"]) if info["speculative_config"] else "(none)"
        up = stat(list(startup.get(name, {}).values()))
        peak = f"{mem[name]:.0f}" if name in mem else "-"
        out.append(f"| {name} | `{spec}` | {info['note']} | {fmt_stat(up, '.0f')} | {peak} |")
    if s["skipped"]:
        out += ["", "Not run:"] + [f"- {k}: {v}" for k, v in s["skipped"].items()]
    out += ["", "Peak memory: the sum of the server processes' peak resident sets (`VmHWM`: API server, engine "
            "core, workers), read after each task; the KV cache is the same size for every method "
            "(`VLLM_CPU_KVCACHE_SPACE`)."]
    goals = doc.get("targets") or []
    if goals:
        out += ["", "## Targets", "", "The project's targets for `{\"method\": \"entmtp\"}` (the method `entmtp`), "
                "read against this run; `-`: the run lacks a method, task or level the target needs.", "",
                "| target | needed | measured | met |", "|---|---|---|---|"]
        out += [f"| {g['target']} | {g['needed']} | {g['measured']} | "
                f"{'-' if g['met'] is None else ('yes' if g['met'] else 'no')} |" for g in goals]
    out += ["", "Columns: output tokens/s over the level; `vs X`: that divided by method X's (same task, "
            f"concurrency and repeat); `{PLAIN_BEST}`: the fastest plain method of each repeat (which one, in "
            "brackets); MAL: mean acceptance length including the bonus token (1 + accepted / "
            "drafts; 1.00 = no draft token accepted); TPOT: median time per output token after the first."]
    for task in s["tasks"]:
        out += ["", f"## {task}"]
        for conc in s["concurrency"]:
            present = [n for n in _ordered({k[0] for k in rows if k[1:] == (task, conc)}, methods)]
            if not present:
                continue
            out += ["", f"### {task}, concurrency {conc}", "",
                    "| method | out tok/s | " + " | ".join(f"vs {b}" for b in baselines)
                    + " | MAL | TPOT ms | failed |",
                    "|---|" + "---:|" * (len(baselines) + 4)]
            for name in present:
                r = rows[(name, task, conc)]
                cells = [fmt_stat(r["output_throughput"], ".1f")]
                cells += [fmt_stat(r["ratios"].get(b), ".2f", "x") for b in baselines]
                cells += [fmt_stat(r["mal"], ".2f"), fmt_stat(r["median_tpot_ms"], ".1f"), str(r["failed"])]
                label = name if name != PLAIN_BEST else f"{name} ({', '.join(r.get('plain_methods', []))})"
                out.append(f"| {label} | " + " | ".join(cells) + " |")
            shares = [(n, rows[(n, task, conc)]["tree_choice_shares"]) for n in present
                      if is_entmtp(s["methods"].get(n, {}).get("speculative_config"))]
            if shares:
                out += ["", "Tree choice (share of drafting request-steps per tree; none = no draft):", "",
                        "| method | tree-choice shares |", "|---|---|"]
                out += [f"| {n} | {fmt_shares(sh)} |" for n, sh in shares]
    plots = doc.get("plots") or []
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    errors = [(r["method"], r["task"], lv["concurrency"], e) for r in doc["runs"] for lv in r["levels"]
              for e in lv.get("errors", [])]
    if errors:
        out += ["", "## Errors", ""] + [f"- {mt} / {t} / concurrency {c}: {e}" for mt, t, c, e in errors]
    stalls = stall_lines(doc["runs"])
    if stalls:
        out += ["", "## The machine stood still", "", "Levels during which the load generator itself stood still "
                f"for over {tp.STALL_LIMIT_S:g} s (the whole machine paused, not only the server): measured again "
                "(`--paired`), or kept and left out of the figures.", ""] + stalls
    return "\n".join(out) + "\n"


def stall_lines(runs: list[dict]) -> list[str]:
    """One line per level of ``runs`` whose figures a pause of the machine touched: measured again after one
    (``stalled_runs_s``), or kept with one (``client_stall_s`` over ``throughput.STALL_LIMIT_S``)."""
    out = []
    for r in runs:
        for lv in r["levels"]:
            where = f"- {r['method']} / {r['task']} / concurrency {lv['concurrency']} / repeat {r['repeat'] + 1}"
            redone = lv.get("stalled_runs_s") or []
            if redone:
                out.append(f"{where}: measured again after stalls of {', '.join(f'{x:.1f}' for x in redone)} s")
            if tp.stalled(lv):
                out.append(f"{where}: kept with a stall of {lv['client_stall_s']:.1f} s: this repeat of the level "
                           f"is left out of every method's figures")
    return out


def render_headline(doc: dict, method: str = "entmtp") -> str:
    """``headline.md``: ``method``'s speed ratios per task (against plain decoding at each concurrency level, and
    against each baseline at the lowest level), its mean acceptance length, then the targets table; every number
    from ``doc`` (``results.json``), as the README quotes it."""
    s = doc["settings"]
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}
    ran = {r["method"] for r in doc["aggregate"]}
    bases = [b for b in BASELINES if b in ran]
    low = min(s["concurrency"])
    cols = [f"vs {PLAIN_BEST}, c{c}" for c in s["concurrency"]] + [f"vs {b}, c{low}" for b in bases]
    out = [f"`{method}` (`{json.dumps((s['methods'].get(method) or {}).get('speculative_config'))}`), output "
           f"tokens/s as a ratio, measured in one run ({doc['date'][:10]}, {doc['machine'].get('cpu_model')}, "
           f"{doc['machine'].get('usable_cpus')} CPUs; {requests_per_level(s)}, "
           f"each of at most {s['max_tokens']} tokens, greedy); MAL: mean acceptance length at c{low}, bonus token "
           "included.", "",
           "| task | " + " | ".join(cols) + f" | MAL, c{low} |", "|---|" + "---:|" * (len(cols) + 1)]
    for task in s["tasks"]:
        cells = []
        for c in s["concurrency"]:
            r = rows.get((method, task, c))
            cells.append(fmt_stat(r and r["ratios"].get(PLAIN_BEST), ".2f", "x"))
        r = rows.get((method, task, low))
        cells += [fmt_stat(r and r["ratios"].get(b), ".2f", "x") for b in bases]
        cells.append(fmt_stat(r and r["mal"], ".2f"))
        out.append(f"| {task} | " + " | ".join(cells) + " |")
    goals = doc.get("targets") or []
    if goals:
        out += ["", "| target | needed | measured | met |", "|---|---|---|---|"]
        out += [f"| {g['target']} | {g['needed']} | {g['measured']} | "
                f"{'-' if g['met'] is None else ('yes' if g['met'] else 'no')} |" for g in goals]
    return "\n".join(out) + "\n"


def make_plots(doc: dict, out_dir: Path) -> list[str]:
    """``throughput.png`` (output tokens/s vs concurrency per task), ``mal.png`` (MAL per task and method) and
    ``tree_choice.png`` (stacked tree-choice shares of the entmtp methods); returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["settings"]
    methods = list(s["methods"])
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}
    tasks = s["tasks"]
    written = []

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for name in methods:
            pts = [(c, rows[(name, task, c)]["output_throughput"]) for c in s["concurrency"]
                   if (name, task, c) in rows and rows[(name, task, c)]["output_throughput"]]
            if pts:
                ax.errorbar([c for c, _ in pts], [st["mean"] for _, st in pts],
                            yerr=[[st["mean"] - st["min"] for _, st in pts], [st["max"] - st["mean"] for _, st in pts]],
                            marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["concurrency"], [str(c) for c in s["concurrency"]])
        ax.set_title(task)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("output tokens/s (this run only)")
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)
    written.append("throughput.png")

    pooled: dict[tuple, list] = {}
    for run in doc["runs"]:
        pooled.setdefault((run["method"], run["task"]), []).extend(run["levels"])
    mal = {k: pooled_mal(v) for k, v in pooled.items()}
    spec_methods = [n for n in methods if any(mal.get((n, t)) for t in tasks)]
    if spec_methods:
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(tasks) * len(spec_methods) / 2), 4))
        width = 0.8 / len(spec_methods)
        for i, name in enumerate(spec_methods):
            ax.bar([t + i * width for t in range(len(tasks))], [mal.get((name, t)) or 0 for t in tasks], width,
                   label=name)
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("MAL (incl. bonus token)")
        ax.set_title("mean acceptance length, all concurrency levels pooled", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "mal.png", dpi=110)
        plt.close(fig)
        written.append("mal.png")

    bars = []
    for name in methods:
        if not is_entmtp(s["methods"][name]["speculative_config"]):
            continue
        for task in tasks:
            tcs = [lv.get("tree_choice") for run in doc["runs"] if (run["method"], run["task"]) == (name, task)
                   for lv in run["levels"]]
            shares = tp.tree_choice_shares(merge_tree_choice(tcs))
            if shares:
                bars.append((f"{name}\n{task}", shares))
    if bars:
        trees = sorted({t for _, sh in bars for t in sh})
        fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(bars)), 4))
        bottom = [0.0] * len(bars)
        for tree in trees:
            vals = [sh.get(tree, 0.0) for _, sh in bars]
            ax.bar(range(len(bars)), vals, bottom=bottom, label=tree)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
        ax.set_ylabel("share of drafting request-steps")
        ax.set_title("tree choice, all concurrency levels pooled")
        ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
        fig.tight_layout()
        fig.savefig(out_dir / "tree_choice.png", dpi=110)
        plt.close(fig)
        written.append("tree_choice.png")
    return written


def write_outputs(doc: dict, out_dir: Path) -> None:
    doc["aggregate"] = aggregate(doc["runs"])
    doc["targets"] = targets(doc)
    try:
        doc["plots"] = make_plots(doc, out_dir) if doc["runs"] else []
    except Exception as e:  # a plot must not cost the numbers
        doc["plots"] = []
        print(f"[compare] plots failed: {type(e).__name__}: {e}", file=sys.stderr)
    (out_dir / "results.json").write_text(portable(json.dumps(doc, indent=2)) + "\n")
    (out_dir / "report.md").write_text(portable(render_report(doc)))
    (out_dir / "headline.md").write_text(portable(render_headline(doc)))
