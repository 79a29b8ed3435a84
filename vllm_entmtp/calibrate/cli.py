"""Build a tree set for the scheduler (bins on the entropy signal, the default, or on confidence) from measured
statistics: ``vllm-entmtp build-trees``.

The command line: its options, and one run from the prompts to a tree-set file the runtime has loaded back
(statistics, bins and greedy trees, cost, the tree set, the check); the method is described in
:mod:`vllm_entmtp.calibrate`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from vllm_entmtp.calibrate.bins import bin_statistics, edge_scores, quantile_edges
from vllm_entmtp.calibrate.chain_stop import fit_chain_stop_schedule
from vllm_entmtp.calibrate.costs import (measure_draft_times, measure_verify_times, monotone_times,
                                         read_step_costs, step_cost_of)
from vllm_entmtp.calibrate.lookup import lookup_statistics
from vllm_entmtp.calibrate.records import (STATS_VERSION, collect_statistics, dir_fingerprint, display_path,
                                           file_digest, log, render_prompt, stats_cache_path)
from vllm_entmtp.calibrate.report import plot_frontiers, summary_table
from vllm_entmtp.calibrate.search import candidates_for_bin, choose, expected_overall
from vllm_entmtp.calibrate.signals import SIGNAL_UNIT, SIGNALS, signal_correlations, signal_series
from vllm_entmtp.calibrate.target import RANK_STORE_CAP, TargetView, greedy_continuation, make_drafter
from vllm_entmtp.calibrate.tree_set import build_tree_set
from vllm_entmtp.fast_linear import use_vllm_cpu_gemm

DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24)


def _int_list(text: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"node budgets must be integers >= 1, got {text!r}")
    return vals


def _edge_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not math.isfinite(v) or v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"bin edges must be finite and > 0, got {text!r}")
    return vals


def _chain_stop_arg(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not 0.0 < x < 1.0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number in (0, 1), got {text!r}")
    return x


def _positive(kind: type, minimum: float = 1):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-set", help="prompt set of vllm_entmtp.datasets (humaneval, gsm8k, sharegpt, "
                                          "creative, mtbench)")
    src.add_argument("--jsonl", help="JSONL file of prompts: {\"prompt\": str} or {\"messages\": [...]} per line")
    p.add_argument("--num-prompts", type=_positive(int), default=20, help="first N prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive(int, 2), default=128,
                   help="greedy tokens generated per prompt (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=_positive(int), default=1024,
                   help="keep the last N prompt tokens (default: %(default)s)")
    p.add_argument("--model", help="target model folder (default: the prepared default model)")
    p.add_argument("--heads", help="MTP heads folder, Medusa or Hydra, any supported layout (default: the heads "
                                   "registered for the model)")
    p.add_argument("--out", help="tree-set JSON to write (default: runs/calib/<prompt set or jsonl stem>.json)")
    p.add_argument("--plot", help="PNG of the frontiers (default: next to --out, same stem)")
    p.add_argument("--name", help="the tree set's name (default: <prompts>-<heads kind>)")
    p.add_argument("--signal", choices=SIGNALS, default="entropy",
                   help="what the bins (and the schedule's thresholds) are on: the tracker's entropy EMA, or its "
                        "path confidence; the policy that reads the set must be the same (default: %(default)s)")
    p.add_argument("--signal-window", type=_positive(int), default=None,
                   help="EMA window of the signal, as the runtime tracker keeps it: the entropy_window option "
                        "for entropy, confidence_window for confidence (default: those options' defaults, 16 and 1)")
    p.add_argument("--confidence-heads", type=_positive(int), default=None,
                   help="leading heads whose top-1 probabilities make the path confidence (the confidence_heads "
                        "option; default: its default, 1)")
    p.add_argument("--bins", "--entropy-bins", dest="bins", type=_positive(int), default=3,
                   help="signal bins, edges at the quantiles of the data (default: %(default)s)")
    p.add_argument("--edges", "--entropy-edges", dest="edges", type=_edge_list, default=None,
                   help="explicit bin edges in the signal's unit, comma-separated, most aggressive bin first: "
                        "increasing nats for entropy, decreasing probabilities for confidence (overrides --bins)")
    p.add_argument("--node-budgets", type=_int_list, default=list(DEFAULT_BUDGETS),
                   help="tree sizes tried per bin (default: %s)" % ",".join(map(str, DEFAULT_BUDGETS)))
    p.add_argument("--max-rank", type=_positive(int), default=8,
                   help="top-k ranks per head considered; rank >= this is a miss (default: %(default)s, at most "
                        f"{RANK_STORE_CAP})")
    p.add_argument("--hysteresis", type=_positive(float, 0.0), default=None,
                   help="hysteresis (the signal's unit) written into the schedule (default: none, the scheduler's "
                        "own)")
    p.add_argument("--step-costs", default=None, nargs="+", metavar="JSON",
                   help="step costs measured inside vLLM (\"step_cost_by_nodes\" of benchmarks/ablation.py "
                        "results), used instead of timing a transformers forward and the drafter here; with "
                        "several files (runs), each cost is the median over the files that measured it")
    p.add_argument("--chain-stop", type=_chain_stop_arg, default=None, metavar="auto|TAU",
                   help="also try the schedule 'every request drafts the heads' top-1 chain, cut where its path "
                        "confidence falls below TAU' (schedule.chain_stop; the first node always drafted): auto "
                        "fits the chain depth and TAU on the calibration's positions and writes that schedule "
                        "when it beats the bins' ladder there; a number in (0, 1) writes it with that TAU. Needs "
                        "--step-costs (default: not tried)")
    p.add_argument("--decode-row-cost", type=float, default=None,
                   help="what one more request's decode row adds to a step, in one-request plain steps, measured "
                        "on this hardware (e.g. the slope of plain decoding's step time over batch sizes, "
                        "benchmarks/step_profile.py); recorded as calibration.cost.decode_row_cost for the "
                        "scheduler's load cost model (default: not recorded; the scheduler's default applies)")
    p.add_argument("--cost-context", type=_positive(int), default=256,
                   help="KV-cache tokens before the timed verification forwards (default: %(default)s)")
    p.add_argument("--cost-repeats", type=_positive(int), default=7,
                   help="timed runs per size; the median is used (default: %(default)s)")
    p.add_argument("--gemm", choices=("vllm", "torch"), default="vllm",
                   help="linear layers of the timed verification forward: vllm = vLLM's CPU GEMM (oneDNN), as "
                        "served (default; falls back to torch when unavailable); torch = transformers' own")
    p.add_argument("--threads", type=_positive(int), default=None,
                   help="torch threads for everything, timings included (default: torch's, e.g. OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random cost context (default: %(default)s)")


def _load_prompts(args) -> tuple[list[dict], dict]:
    from vllm_entmtp.datasets import PromptFileError, load_prompts, read_jsonl_prompts

    if args.jsonl:
        path = Path(args.jsonl).expanduser()
        try:
            prompts = read_jsonl_prompts(path)
        except PromptFileError as e:
            raise ValueError(f"--jsonl {e}") from None
        if not prompts:
            raise ValueError(f"--jsonl {path}: no prompts")
        key = {"jsonl": str(path.resolve()), "sha256": file_digest(path)}
    else:
        prompts = load_prompts(args.prompt_set, limit=args.num_prompts)
        key = {"prompt_set": args.prompt_set}
    return [{"id": p.id, "messages": p.messages} for p in prompts[:args.num_prompts]], key


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as e:  # bad input: EntMTPError, TreeSetError, HeadsCheckpointError, unknown prompt set
        raise SystemExit(f"build-trees: error: {e}") from None


def _run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_entmtp.config import EntMTPConfig
    from vllm_entmtp.heads import load_mtp_heads
    from vllm_entmtp.heads.hydra import HydraHeads
    from vllm_entmtp.lookup import DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN
    from vllm_entmtp.models import find_registered_heads, prepare_default_model
    from vllm_entmtp.scheduler import TreeScheduler
    from vllm_entmtp.trees import Tree, load_tree_set

    if args.max_rank > RANK_STORE_CAP:
        raise ValueError(f"--max-rank {args.max_rank} exceeds {RANK_STORE_CAP}")
    if args.decode_row_cost is not None and not (0 <= args.decode_row_cost <= 1):
        raise ValueError(f"--decode-row-cost {args.decode_row_cost}: expected a number in [0, 1] (a fraction of a "
                         "one-request plain step)")
    if args.chain_stop is not None and not args.step_costs:
        raise ValueError("--chain-stop needs --step-costs (the costs of chains of every length, measured in vLLM)")
    given_edges = edge_scores(args.edges, args.signal) if args.edges else None  # bad edges fail before any work
    step_costs = read_step_costs(args.step_costs) if args.step_costs else None
    if args.threads:
        torch.set_num_threads(args.threads)
    label = args.prompt_set or Path(args.jsonl).stem
    out = Path(args.out or f"runs/calib/{label}.json")
    plot_path = Path(args.plot) if args.plot else out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)

    prompts, prompt_key = _load_prompts(args)
    if len(prompts) < args.num_prompts:
        log(f"only {len(prompts)} prompt(s) available (asked for {args.num_prompts})")

    model_dir = Path(args.model).expanduser() if args.model else prepare_default_model()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: not a model folder (no config.json)")
    log(f"target {model_dir} (transformers, float32, {torch.get_num_threads()} thread(s))")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().requires_grad_(False)
    heads_dir = Path(args.heads).expanduser() if args.heads else find_registered_heads(str(model_dir), model.config)
    if heads_dir is None:
        raise ValueError(f"no MTP heads are registered for {model_dir}; pass --heads DIR")
    heads = load_mtp_heads(heads_dir, hidden_size=model.config.hidden_size,
                           vocab_size=model.get_output_embeddings().weight.shape[0]).eval().requires_grad_(False)
    kind = "hydra" if isinstance(heads, HydraHeads) else "medusa"
    num_heads = heads.num_heads
    log(f"heads {heads_dir} ({kind}, {num_heads} heads)")
    view = TargetView.of(model, tokenizer)

    # 1. per-position statistics (cached)
    key = {"version": STATS_VERSION, "model": dir_fingerprint(model_dir), "heads": dir_fingerprint(heads_dir),
           "prompts": prompt_key, "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    cache_path = stats_cache_path(out, key)
    records = collect_statistics(view, heads, tokenizer, prompts, args.max_tokens, args.max_prompt_tokens,
                                 cache_path, key)
    ranks = torch.cat([r["ranks"] for r in records])
    if ranks.numel() == 0:
        raise ValueError("no generated positions (every continuation was empty)")
    signal = args.signal
    defaults = EntMTPConfig()
    window = args.signal_window or (defaults.entropy_window if signal == "entropy" else defaults.confidence_window)
    conf_heads = min(args.confidence_heads or defaults.confidence_heads, num_heads)
    score = signal_series(records, signal, window, conf_heads)
    lower = 0.0 if signal == "entropy" else -1.0

    # 2. bins and greedy trees
    edges = given_edges if given_edges is not None else quantile_edges(score, args.bins, lower)
    bins = [b for b in bin_statistics(score, ranks, edges, args.max_rank, signal) if b.positions > 0]
    for i, b in enumerate(bins):  # empty bins dropped: renumber, ranges follow the kept bins
        b.index = i
        b.hi = bins[i + 1].lo if i + 1 < len(bins) else math.inf
    if bins:
        bins[0].lo = lower
    budgets = list(args.node_budgets)
    cands = {b.index: candidates_for_bin(b, budgets, num_heads) for b in bins}

    # 3. cost: verification by node count, drafting by tree (or both, measured in vLLM, by node count)
    chains = [tuple((0,) * k for k in range(1, n + 1)) for n in range(1, num_heads + 1)]  # chain keys
    sizes = sorted({0} | {c.num_nodes for cs in cands.values() for c in cs}
                   | (set(range(1, num_heads + 1)) if args.chain_stop is not None else set()))
    if step_costs:
        files = ", ".join(args.step_costs)
        log(f"step costs measured in vLLM ({files}; median per key over the files): " + "; ".join(
            f"{kind} " + ", ".join(f"{n}: {c:.3f}" for n, c in t.items()) for kind, t in step_costs.items() if t))
    log(f"timing verification of {', '.join(map(str, sizes))} draft nodes over a {args.cost_context}-token "
         f"context ({args.cost_repeats} runs each, {torch.get_num_threads()} thread(s))")
    gemm = "vllm" if args.gemm == "vllm" and use_vllm_cpu_gemm(model) else "torch"
    if args.gemm == "vllm" and gemm != "vllm":
        log("vLLM's CPU GEMM (oneDNN) is not available here: timing with torch's")
    verify_s = monotone_times(measure_verify_times(model, sizes, args.cost_context, args.cost_repeats,
                                                   seed=args.seed))
    distinct = {c.key: Tree(c.key) for cs in cands.values() for c in cs}
    if args.chain_stop is not None:
        distinct.update({k: Tree(k) for k in chains if k not in distinct})
    distinct = list(distinct.items())
    first = records[0]
    hid = greedy_continuation(view, render_prompt(tokenizer, prompts[0]["messages"], args.max_prompt_tokens), 1)[1]
    draft_s = measure_draft_times(make_drafter(heads, view), [t for _, t in distinct], hid,
                                  first["tokens"][0], args.cost_repeats)
    base = verify_s[0]
    draft_of = {k: s for (k, _), s in zip(distinct, draft_s)}
    for cs in cands.values():
        for c in cs:
            if args.step_costs:  # drafting is inside the engine's step time
                c.verify_cost, c.draft_cost = step_cost_of(step_costs, c.key), 0.0
            else:
                c.verify_cost = verify_s[c.num_nodes] / base
                c.draft_cost = draft_of[c.key] / base
    choices = [choose(b, cands[b.index]) for b in bins]
    chain_stop = chain_info = None
    if args.chain_stop is not None:
        chain_stop, chain_info = fit_chain_stop_schedule(args.chain_stop, records, score, bins, choices, chains,
                                                          step_costs)

    # 4. the tree set
    calibration = {
        "command": "vllm-entmtp build-trees " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["build-trees"]
        else "vllm-entmtp build-trees",
        "model": display_path(model_dir), "heads": display_path(heads_dir), "heads_kind": kind,
        "prompts": args.prompt_set or str(args.jsonl), "num_prompts": len(records),
        "max_tokens": args.max_tokens, "positions": int(score.numel()), "max_rank": args.max_rank,
        "signal": signal, "signal_window": window,
        **({"confidence_heads": conf_heads} if signal == "confidence" else {}),
        "edges": [-e for e in edges] if signal == "confidence" else list(edges), "node_budgets": budgets,
        "bins": [b.to_json() for b in bins],
        "cost": {"threads": torch.get_num_threads(), "context_tokens": args.cost_context,
                 "repeats": args.cost_repeats, "gemm": gemm, "plain_decode_ms": round(base * 1e3, 3),
                 "verify_ms": {str(n): round(s * 1e3, 3) for n, s in verify_s.items()},
                 "measured_with": "transformers float32 forward with KV cache (causal mask over the N+1 new "
                                  "tokens, logits for each) and the runtime drafter; not vLLM"},
        "assumptions": "heads independent across depths (P(node) = prod_i P[i][r_i]); the signal is the "
                       "tracker's EMA updated once per generated token (the engine updates once per step)",
    }
    if args.decode_row_cost is not None:
        calibration["cost"]["decode_row_cost"] = args.decode_row_cost
    if args.step_costs:
        calibration["cost"]["step_costs"] = {"files": [display_path(f) for f in args.step_costs],
                                             "combined": "median per key over the files that measured it",
                                             "step_cost_by_nodes": {
                                                 (f"{n}t" if kind == "tree" else str(n)): c
                                                 for kind, t in step_costs.items() for n, c in t.items()},
                                             "used": "instead of verify + draft above"}
    calibration["expected_overall"] = overall = expected_overall(choices)
    if chain_info is not None:
        calibration["chain_stop"] = chain_info
    calibration["signal_correlations"] = corr = signal_correlations(records, defaults.entropy_window)
    calibration["lookup"] = lookup = lookup_statistics(
        [(render_prompt(tokenizer, p["messages"], args.max_prompt_tokens), r["tokens"])
         for p, r in zip(prompts, records)], DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX, defaults.lookup_tokens)
    name = args.name or f"{label}-{kind}"
    times_ms = {"verify": {n: s * 1e3 for n, s in verify_s.items()},
                "draft": {k: s * 1e3 for k, s in draft_of.items()}}
    ts_json, bin_ids = build_tree_set(choices, name=name, heads_kind=kind, num_heads=num_heads, times_ms=times_ms,
                             calibration=calibration, hysteresis=args.hysteresis, chain_stop=chain_stop)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(ts_json, indent=1) + "\n")
    os.replace(tmp, out)

    # 5. check that the runtime accepts it
    ts = load_tree_set(str(out.resolve()), num_heads=num_heads)
    sched = TreeScheduler.from_config(EntMTPConfig(policy=signal, tree_set=str(out.resolve())), ts)

    plot_frontiers(choices, plot_path, f"{name}: {len(records)} prompts, {int(score.numel())} positions, "
                                       f"{kind} heads, {signal} (window {window})")
    print(f"tree set {out} ({len(ts)} trees; schedule {sched.ladder_ids}, thresholds "
          f"{[round(x, 4) for x in sched.thresholds]} ({SIGNAL_UNIT[signal]}); policy {signal!r} reads it)")
    print(f"plot {plot_path}; statistics cache {cache_path}")
    print(f"cost: plain decode step {base * 1e3:.1f} ms ({torch.get_num_threads()} thread(s), transformers "
          f"float32, {args.cost_context}-token context); verifying N nodes: "
          + ", ".join(f"{n}: {verify_s[n] / base:.2f}" for n in sizes if n))
    if chain_stop is not None:
        print("the bins' ladder (not scheduled: the chain stop below replaces it):")
    print(summary_table(choices, bin_ids))
    if "best_static" in overall:
        bs = overall["best_static"]
        print(f"expected over all positions: schedule x{overall['schedule']:.3f}; best single tree "
              f"({bs['num_nodes']} nodes {bs['paths']}) x{bs['speedup']:.3f}")
    if chain_info is not None:
        best = chain_info["best"]
        print(f"chain stop, position by position on the calibration: bins' ladder x{chain_info['ladder']:.3f}; "
              "chains " + ", ".join(f"{n}: x{x:.3f}" for n, x in chain_info["chains"].items())
              + f"; best cut chain: {best['depth']} nodes, chain_stop {best['chain_stop']} x{best['speedup']:.3f}; "
              + (f"scheduled: chain{chain_info['chosen']['depth']} cut at {chain_info['chosen']['chain_stop']}"
                 if chain_info["chosen"] else "not scheduled (the ladder is expected to be faster)"))
    if lookup["drafts"]:
        print(f"prompt lookup ({lookup['prompt_lookup_min']}-{lookup['prompt_lookup_max']} tokens, drafts of up to "
              f"{lookup['max_tokens']}): drafts at {lookup['coverage']:.0%} of positions, "
              f"{lookup['mean_accepted']:.2f} accepted per draft, acceptance probability {lookup['acceptance_probability']:.3f} (the set's "
              f"lookup prior: {lookup['prior']})")
    print("signals vs acceptance (Pearson r with head 0's hit / the chain's accepted length; head 0's hit rate "
          "in the top / bottom 30 % of the signal): " + "; ".join(
              f"{n} {v['r_first']:+.2f}/{v['r_chain']:+.2f} ({v['first_hit_top30']:.2f} vs "
              f"{v['first_hit_bottom30']:.2f})" for n, v in corr.items() if v["r_first"] is not None))
    return 0
