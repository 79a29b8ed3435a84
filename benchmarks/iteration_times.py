"""Engine step times from the logs of servers run with vLLM's per-iteration details.

    python benchmarks/compare.py --paired --fresh-servers --methods plain-bfloat16,entmtp --tasks gsm8k \\
        --concurrency 32 --num-requests 32 --max-tokens 128 --ignore-eos --repeats 3 \\
        --serve-args "--dtype bfloat16 --enable-logging-iteration-details" --out runs/spread
    python benchmarks/iteration_times.py runs/spread/servers/*.log --requests 32

With ``--enable-logging-iteration-details`` vLLM's API server logs one line per engine step: its context
(prompt) requests and tokens, its generation requests and tokens (one per request, plus its draft tokens) and the
step's elapsed time (the workers' forward and sampling, drafting included, as the engine core waits for them;
not the engine core's own scheduling). A tokens-per-second ratio between two servers mixes the methods with
whatever else differs between them; these times compare like steps: for each log, the steps in which exactly
``--requests`` requests decoded and no prompt tokens ran, those without draft tokens (a speculative server that
drafted nothing: its fixed cost over plain decoding) apart from those with. Both servers must have logged alike
(the log line costs the API server, not the step).

Output: a Markdown table (one row per log; ``--json`` for the numbers).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from pathlib import Path

#: vLLM 0.32's line (``vllm/v1/metrics/loggers.py``, ``LoggingStatLogger._log_iteration_details``).
LINE = re.compile(r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
                  r"(\d+) generation tokens, iteration elapsed time: ([\d.]+) ms(?! \(dummy\))")
FIELDS = ("index", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens")
#: Steps with at least this many prompt tokens are read for the prompt's cost (:func:`summarize`): ``vllm serve``'s
#: default step budget on CPU is 2,048 tokens, so a burst of prompts (or a long prompt) runs in steps of about that
#: many. Served on the AMX Xeon (2026-12-06, bfloat16, GSM8K at 32 running,
#: ``benchmarks/results/one-kernel-amx-2026-12-06/served-traced/``), entmtp's step of 22 prompts (2,045 and 2,047
#: tokens) took 1,042 and 1,022 ms where plain decoding's took 624 and 585; in four such levels the next day it
#: took 1.02-1.19x plain's: the slowness comes and goes (``benchmarks/results/c32-recheck-amx-2026-12-07/``).
LARGE_PREFILL = 1024


def parse_iterations(lines) -> list[dict]:
    """The per-iteration lines of a server log (dummy iterations left out), in order: ``index``, ``ctx_requests``,
    ``ctx_tokens``, ``gen_requests``, ``gen_tokens`` (ints) and ``ms``."""
    out = []
    for line in lines:
        m = LINE.search(line)
        if m:
            out.append({**dict(zip(FIELDS, map(int, m.groups()[:5]))), "ms": float(m.group(6))})
    return out


def _stats(ms: list[float]) -> dict:
    if not ms:
        return {"steps": 0, "median_ms": None, "mean_ms": None}
    return {"steps": len(ms), "median_ms": round(statistics.median(ms), 3), "mean_ms": round(statistics.mean(ms), 3)}


def summarize(iterations: list[dict], requests: int) -> dict:
    """Steps that decoded exactly ``requests`` requests with no prompt tokens: ``no_draft`` (one token each) and
    ``drafted`` (draft tokens verified too; with their mean ``rows``), and the drafted ones by the step's number
    of draft tokens (``by_draft_tokens``); and the steps with prompt tokens (``prefill``: how many, their total
    ms, their prompt tokens, how many have :data:`LARGE_PREFILL` prompt tokens or more (``large_steps``) and their
    ms per 1,000 prompt tokens (``large_ms_per_1k``): the prompt decides their time more than the decoding rows
    riding along)."""
    decode = [it for it in iterations if it["ctx_tokens"] == 0 and it["gen_requests"] == requests]
    plain = [it["ms"] for it in decode if it["gen_tokens"] == requests]
    drafted = [it for it in decode if it["gen_tokens"] > requests]
    prefill = [it for it in iterations if it["ctx_tokens"] > 0]
    large = [it for it in prefill if it["ctx_tokens"] >= LARGE_PREFILL]
    by_k: dict[int, list[float]] = {}
    for it in drafted:
        by_k.setdefault(it["gen_tokens"] - requests, []).append(it["ms"])
    return {"iterations": len(iterations), "no_draft": _stats(plain),
            "drafted": _stats([it["ms"] for it in drafted])
            | {"rows": round(statistics.mean(it["gen_tokens"] for it in drafted), 2) if drafted else None},
            "by_draft_tokens": {k: _stats(by_k[k]) for k in sorted(by_k)},
            "prefill": {"steps": len(prefill), "total_ms": round(sum(it["ms"] for it in prefill), 1),
                        "ctx_tokens": sum(it["ctx_tokens"] for it in prefill), "large_steps": len(large),
                        "large_ms_per_1k": round(1000 * sum(it["ms"] for it in large)
                                                 / sum(it["ctx_tokens"] for it in large), 1) if large else None}}


def format_table(results: dict[str, dict], requests: int) -> str:
    def cell(x):
        return "-" if x is None else f"{x:.2f}"

    rows = [f"| log | steps | no draft: steps | median ms | mean ms | drafted: steps | median ms | rows | "
            f"prefill steps | prefill ms | ms per 1k prompt tokens |", "|---" + "|---:" * 10 + "|"]
    for name, r in results.items():
        nd, dr, pf = r["no_draft"], r["drafted"], r["prefill"]
        rows.append(f"| {name} | {r['iterations']} | {nd['steps']} | {cell(nd['median_ms'])} | {cell(nd['mean_ms'])} "
                    f"| {dr['steps']} | {cell(dr['median_ms'])} | {cell(dr['rows'])} | {pf['steps']} | "
                    f"{pf['total_ms']:.0f} | {'-' if pf['large_ms_per_1k'] is None else pf['large_ms_per_1k']} |")
    return f"Steps of {requests} decoding requests (no prompt tokens), by vLLM's iteration times\n\n" + "\n".join(rows)


def format_by_draft_tokens(results: dict[str, dict], requests: int, baseline: str | None = None) -> str:
    """Per log, the drafted steps by their number of draft tokens: median ms and its ratio to the median step
    without draft tokens of ``baseline`` (a log's name: a plain server's, so the ratio is a step verifying k
    draft tokens in plain steps) or, without one, of the same log."""
    against = f"{baseline}'s no-draft median" if baseline else "no-draft median"
    rows = [f"| log | draft tokens | steps | median ms | / {against} |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        base = results[baseline or name]["no_draft"]["median_ms"]
        for k, st in r["by_draft_tokens"].items():
            ratio = f"{st['median_ms'] / base:.3f}" if base else "-"
            rows.append(f"| {name} | {k} | {st['steps']} | {st['median_ms']:.2f} | {ratio} |")
    return (f"Drafted steps of {requests} decoding requests by their draft tokens\n\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="server logs (vllm serve ... --enable-logging-iteration-details)")
    ap.add_argument("--requests", type=int, default=1, help="decoding requests per step to compare (default 1)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    ap.add_argument("--by-draft-tokens", action="store_true",
                    help="also a table of the drafted steps by their number of draft tokens")
    ap.add_argument("--baseline", metavar="LOG",
                    help="with --by-draft-tokens: the log (one of LOGS, a plain server's) whose no-draft median "
                         "the drafted steps are divided by (default: each log's own)")
    args = ap.parse_args(argv)
    if args.requests < 1:
        print(f"error: --requests must be >= 1, got {args.requests}", file=sys.stderr)
        return 2
    results = {}
    for log in args.logs:
        try:
            raw = Path(log).read_bytes()
            if log.endswith(".gz"):  # results folders keep server logs compressed
                raw = gzip.decompress(raw)
            its = parse_iterations(raw.decode(errors="replace").splitlines())
        except OSError as e:
            print(f"error: {log}: {e}", file=sys.stderr)
            return 2
        if not its:
            print(f"error: {log} has no iteration lines: was the server run with "
                  f"--enable-logging-iteration-details?", file=sys.stderr)
            return 2
        results[Path(log).name] = summarize(its, args.requests)
    baseline = Path(args.baseline).name if args.baseline else None
    if baseline is not None and baseline not in results:
        print(f"error: --baseline {args.baseline} is not one of the logs", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_table(results, args.requests))
        if args.by_draft_tokens:
            print("\n" + format_by_draft_tokens(results, args.requests, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
