"""Where an engine step's time goes: plain decoding against speculative methods, phase by phase, in one run.

    python benchmarks/step_profile.py --methods plain,entmtp --concurrency 1
    python benchmarks/step_profile.py --methods plain,entmtp --concurrency 16 --out runs/profile-c16.json
    python benchmarks/step_profile.py --methods plain,entmtp --repeats 3   # three processes a method, in turns

Each method runs in its own process: an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, compiled as
``vllm serve`` runs it unless ``--eager``), float32 unless ``--dtype``, greedy, ``--concurrency`` requests at a time over the prompt
set, after one warm-up batch. Wrappers around vLLM's engine step and the V1 model runner's methods time every
step; the report gives, per method, the median milliseconds of each phase over the steps where exactly
``--concurrency`` requests decode (no prompt tokens), and each phase's difference from the first method:

========== =====================================================================================================
step       the whole ``EngineCore.step``: scheduling, the forward, sampling, drafting, output processing
schedule   vLLM's scheduler
prepare    ``_prepare_inputs`` (with entmtp's tree rows)
forward    ``_model_forward``: the target over the step's rows (tree-attention fix included)
logits     the target's ``compute_logits`` (lm_head over the sampled rows; Llama-architecture targets only)
sample     ``_sample``: sampler, rejection sampler, tree walk, entmtp's entropy signal
propose    ``propose_draft_token_ids``: the drafter (heads, tracker, scheduler, counters)
bookkeep   ``_bookkeeping_sync``
========== =====================================================================================================

The forward's time differs from one engine process to the next (by up to ~1 ms at one request and ~8 ms at 32
on a 2-core CPU), more than most differences between methods: ``--repeats R`` runs each method in ``R`` processes,
the methods taking turns, and reports per method and phase the median over its processes of their medians (each
process's median step is listed under the table).

Phases nest (``forward``, ``logits`` and ``prepare`` are inside ``execute_model``; ``sample`` and ``propose``
inside ``sample_tokens``), so they do not add up to ``step``. ``rows`` is the mean of verified rows per step
(one per request plus its draft tokens). Tokens/s are printed for orientation; ``benchmarks/compare.py`` and
``benchmarks/ablation.py`` measure speed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PHASES = ("step", "schedule", "prepare", "forward", "logits", "sample", "propose", "bookkeep")
#: Inside ``sample`` and ``propose`` (entmtp only): the entropy signal, the heads (confidence and drafting), the
#: tracker and scheduler. (The counters for ``/metrics`` are written by a thread, off the step's path.)
SUB_PHASES = ("signals", "heads", "schedule_trees")
RUNNER_PHASES = {"_prepare_inputs": "prepare", "_model_forward": "forward", "_sample": "sample",
                 "propose_draft_token_ids": "propose", "_bookkeeping_sync": "bookkeep"}
METHODS = {
    "plain": None,
    "entmtp": {"method": "entmtp"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}


def summarize(records: list[dict], concurrency: int) -> dict:
    """Median ms per phase over the steps where ``concurrency`` requests decode and nothing else runs.

    Args:
        records: one dict per engine step: phase -> seconds, and ``reqs`` (requests scheduled), ``rows`` (tokens
            scheduled), ``spec`` (draft tokens scheduled).

    Returns ``decode_steps``, ``rows`` (their mean), ``median_ms`` (per phase), and the same by step kind
    (``by_kind``, :func:`step_kind`) and by rows verified (``by_rows``, keyed by the row count as a string): the
    target's forward does not grow evenly with its rows (vLLM's CPU GEMMs, ``benchmarks/gemm_rows.py``).

    Raises:
        ValueError: no such step.
    """
    dec = [r for r in records if r.get("reqs") == concurrency and r.get("rows") == concurrency + r.get("spec", 0)]
    if not dec:
        raise ValueError(f"no step decoded exactly {concurrency} requests ({len(records)} steps recorded)")
    def medians(steps: list[dict]) -> dict:
        return {p: round(1000 * statistics.median(r.get(p, 0.0) for r in steps), 3) for p in PHASES + SUB_PHASES}

    kinds: dict[str, list[dict]] = {}
    by_rows: dict[int, list[dict]] = {}
    for r in dec:
        kinds.setdefault(step_kind(r), []).append(r)
        by_rows.setdefault(r["rows"], []).append(r)
    return {"decode_steps": len(dec), "rows": round(statistics.mean(r["rows"] for r in dec), 3),
            "median_ms": medians(dec),
            "by_kind": {k: {"steps": len(v), "rows": round(statistics.mean(r["rows"] for r in v), 3),
                            "median_ms": medians(v)} for k, v in sorted(kinds.items())},
            "by_rows": {str(n): {"steps": len(v), "median_ms": medians(v)} for n, v in sorted(by_rows.items())}}


def step_kind(record: dict) -> str:
    """A decode step's kind: ``verified drafts`` or ``no draft tokens`` (draft tokens scheduled in the step or
    not), ``+ heads`` where the heads ran in it (for the next step's drafts), as in ``by_kind`` of
    :func:`summarize`: a step that verifies nothing may still pay for the heads."""
    return ("verified drafts" if record.get("spec") else "no draft tokens") + (" + heads" if record.get("heads")
                                                                              else "")


def time_split(records: list[dict], wall: float, concurrency: int) -> dict:
    """Where the run's wall time went: ``{kind: {"steps": n, "s": seconds}}`` for engine steps with prompt tokens
    (``prefill``), decode steps of ``concurrency`` requests with and without draft tokens, other decode steps
    (fewer requests), and ``outside`` (the wall time outside ``EngineCore.step``: the LLM's own input and
    output processing)."""
    out = {k: {"steps": 0, "s": 0.0} for k in ("prefill", "decode_drafting", "decode_no_draft", "decode_fewer")}
    for r in records:
        if r.get("rows", 0) != r.get("reqs", 0) + r.get("spec", 0):
            key = "prefill"
        elif r.get("reqs") != concurrency:
            key = "decode_fewer"
        else:
            key = "decode_drafting" if r.get("spec") else "decode_no_draft"
        out[key]["steps"] += 1
        out[key]["s"] += r.get("step", 0.0)
    out["outside"] = {"steps": 0, "s": wall - sum(v["s"] for v in out.values())}
    return {k: {"steps": v["steps"], "s": round(v["s"], 3)} for k, v in out.items()}


def split_methods(text: str) -> list[str]:
    """``--methods`` split at the commas outside JSON objects and strings: ``plain,x={"a": 1, "b": 2}`` gives
    ``["plain", 'x={"a": 1, "b": 2}']``."""
    parts, cur, depth, in_str, esc = [], [], 0, False, False
    for ch in text:
        if in_str:
            esc, in_str = (not esc and ch == "\\"), in_str and not (ch == '"' and not esc)
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [x.strip() for x in parts]


def combine(runs: list[dict]) -> dict:
    """One method's results from several processes: per phase (and per step kind) the median of the processes'
    medians; tokens/s and rows their means, steps their sums; ``process_step_ms``: each process's median step."""
    def med(dicts: list[dict]) -> dict:
        return {p: round(statistics.median(d[p] for d in dicts), 3) for p in dicts[0]}

    out = dict(runs[0])
    out.update(tokens_per_s=round(statistics.mean(r["tokens_per_s"] for r in runs), 3),
               rows=round(statistics.mean(r["rows"] for r in runs), 3),
               decode_steps=sum(r["decode_steps"] for r in runs), median_ms=med([r["median_ms"] for r in runs]),
               process_step_ms=[r["median_ms"]["step"] for r in runs])
    for key in ("steps", "output_tokens"):
        if all(key in r for r in runs):
            out[key] = sum(r[key] for r in runs)
    if all("time_split" in r for r in runs):
        out["time_split"] = {k: {"steps": sum(r["time_split"][k]["steps"] for r in runs),
                                 "s": round(sum(r["time_split"][k]["s"] for r in runs), 3)}
                             for k in runs[0]["time_split"]}
    kinds = sorted({k for r in runs for k in r.get("by_kind", {})})
    out["by_kind"] = {k: {"steps": sum(r["by_kind"][k]["steps"] for r in runs if k in r.get("by_kind", {})),
                          "rows": round(statistics.mean(r["by_kind"][k]["rows"] for r in runs
                                                        if k in r.get("by_kind", {})), 3),
                          "median_ms": med([r["by_kind"][k]["median_ms"] for r in runs if k in r.get("by_kind", {})])}
                      for k in kinds}
    counts = sorted({n for r in runs for n in r.get("by_rows", {})}, key=int)
    out["by_rows"] = {n: {"steps": sum(r["by_rows"][n]["steps"] for r in runs if n in r.get("by_rows", {})),
                          "median_ms": med([r["by_rows"][n]["median_ms"] for r in runs if n in r.get("by_rows", {})])}
                      for n in counts}
    return out


def format_table(results: list[dict]) -> str:
    """Markdown: one row per method, median ms per phase, and ``(+x)`` against the first method."""
    base = results[0]["median_ms"]
    phases = PHASES + tuple(p for p in SUB_PHASES if any(r["median_ms"].get(p, 0.0) for r in results))
    head = "| method | tokens/s | rows | " + " | ".join(phases) + " |"
    out = [head, "|" + "---|" * 2 + "---:|" * (len(phases) + 1)]
    for r in results:
        ms = r["median_ms"]
        cells = [f"{ms.get(p, 0.0):.2f}" + (f" ({ms.get(p, 0.0) - base.get(p, 0.0):+.2f})"
                                             if r is not results[0] else "") for p in phases]
        out.append(f"| {r['method']} | {r['tokens_per_s']:.2f} | {r['rows']:.2f} | " + " | ".join(cells) + " |")
    kinds = [(r["method"], k, v) for r in results for k, v in r.get("by_kind", {}).items()]
    if any(k != "no draft tokens" for _, k, _ in kinds):  # a speculative method: its steps by kind
        out += ["", "By step kind (median ms; `+ heads`: the heads ran in the step):", "",
                "| method | kind | steps | rows | " + " | ".join(phases) + " |",
                "|---|---|" + "---:|" * (len(phases) + 2)]
        out += [f"| {m} | {k} | {v['steps']} | {v['rows']:.2f} | "
                + " | ".join(f"{v['median_ms'].get(p, 0.0):.2f}" for p in phases) + " |" for m, k, v in kinds]
    by_rows = [(r["method"], n, v) for r in results if len(r.get("by_rows", {})) > 1
               for n, v in r["by_rows"].items()]
    if by_rows:  # steps of several row counts: what each costs
        cols = ("step", "forward", "logits", "sample", "propose")
        out += ["", "By rows verified (median ms):", "", "| method | rows | steps | " + " | ".join(cols) + " |",
                "|---|---:|---:|" + "---:|" * len(cols)]
        out += [f"| {m} | {n} | {v['steps']} | " + " | ".join(f"{v['median_ms'].get(p, 0.0):.2f}" for p in cols)
                + " |" for m, n, v in by_rows]
    if any(len(r.get("process_step_ms", [])) > 1 for r in results):
        out += ["", "Median step of each process (ms): " + "; ".join(
            f"{r['method']} " + ", ".join(f"{x:.2f}" for x in r["process_step_ms"]) for r in results)]
    return "\n".join(out) + "\n"


def _profile(method: str, spec: dict | None, args) -> dict:
    """Runs in the child process: the engine with timing wrappers; returns the method's summary."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_entmtp.patches import apply_all

    apply_all()  # the plugin's patches first: the wrappers go around them
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    records: list[dict] = []
    cur: dict = {}

    def timed(orig, key):
        def f(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                cur[key] = cur.get(key, 0.0) + time.perf_counter() - t
        return f

    for name, key in RUNNER_PHASES.items():
        setattr(gmr.GPUModelRunner, name, timed(getattr(gmr.GPUModelRunner, name), key))
    orig_step, orig_schedule = EngineCore.step, Scheduler.schedule

    def step(self):
        cur.clear()
        t = time.perf_counter()
        out = orig_step(self)
        cur["step"] = time.perf_counter() - t
        records.append(dict(cur))
        return out

    def schedule(self, *a, **k):
        t = time.perf_counter()
        so = orig_schedule(self, *a, **k)
        cur["schedule"] = cur.get("schedule", 0.0) + time.perf_counter() - t
        cur.update(reqs=len(so.num_scheduled_tokens), rows=so.total_num_scheduled_tokens,
                   spec=sum(len(v) for v in so.scheduled_spec_decode_tokens.values()))
        return so

    EngineCore.step, Scheduler.schedule = step, schedule
    import vllm_entmtp.step as entmtp_step
    from vllm_entmtp.entropy import EntropyTracker
    from vllm_entmtp.proposer import HydraDrafter, MTPDrafter
    from vllm_entmtp.scheduler import TreeScheduler

    entmtp_step._step_signals = timed(entmtp_step._step_signals, "signals")
    for cls in (HydraDrafter, MTPDrafter):
        for name in ("confidence", "propose"):
            setattr(cls, name, timed(getattr(cls, name), "heads"))
    TreeScheduler.choose = timed(TreeScheduler.choose, "schedule_trees")
    EntropyTracker.update = timed(EntropyTracker.update, "schedule_trees")
    from vllm.model_executor.models.llama import LlamaForCausalLM  # the default target's class

    LlamaForCausalLM.compute_logits = timed(LlamaForCausalLM.compute_logits, "logits")
    from vllm import LLM, SamplingParams

    from vllm_entmtp.datasets import load_prompts
    from vllm_entmtp.models import prepare_default_model

    llm = LLM(model=args.model or str(prepare_default_model()), dtype=args.dtype, max_model_len=2048,
              max_num_seqs=max(args.concurrency, 4), enforce_eager=args.eager, seed=0, speculative_config=spec,
              gpu_memory_utilization=0.3)
    convs = [p.messages for p in load_prompts(args.prompt_set, limit=args.num_prompts, max_chars=1500)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.chat(convs[:args.concurrency], sp, use_tqdm=False)  # warm-up
    records.clear()
    t0, n_out = time.perf_counter(), 0
    for i in range(0, len(convs), args.concurrency):
        outs = llm.chat(convs[i:i + args.concurrency], sp, use_tqdm=False)
        n_out += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    return {"method": method, "spec": spec, "concurrency": args.concurrency, "eager": args.eager,
            "tokens_per_s": round(n_out / wall, 3), "output_tokens": n_out, "steps": len(records),
            "time_split": time_split(records, wall, args.concurrency), **summarize(records, args.concurrency)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="plain,entmtp",
                    help=f"comma-separated, the first is the reference: {', '.join(METHODS)}, or NAME=JSON (a "
                         "--speculative-config)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (vllm serve compiles by default)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the target's dtype (measure both float32 and bfloat16: the faster differs by CPU)")
    ap.add_argument("--model", default=None, help="target model folder (default: the prepared default model)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="processes per method, the methods taking turns (medians over the processes)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.concurrency, args.num_prompts, args.max_tokens, args.repeats) < 1:
        ap.error("--concurrency, --num-prompts, --max-tokens and --repeats must be >= 1")
    methods = []
    for m in (x for x in split_methods(args.methods) if x):
        name, eq, js = m.partition("=")
        if eq:
            try:
                methods.append((name, json.loads(js)))
            except json.JSONDecodeError as e:
                ap.error(f"--methods {name}: not JSON ({e})")
        elif name in METHODS:
            methods.append((name, METHODS[name]))
        else:
            ap.error(f"unknown method {name!r}: use {', '.join(METHODS)} or NAME=JSON")
    names = [name for name, _ in methods]
    if len(set(names)) < len(names):
        ap.error(f"--methods: each method needs a name of its own ({', '.join(names)}); use NAME=JSON")
    if args.child is not None:
        name, spec = methods[0]
        print("STEP_PROFILE " + json.dumps(_profile(name, spec, args)), flush=True)
        return 0
    runs: dict[str, list[dict]] = {name: [] for name, _ in methods}
    for name, spec in [m for _ in range(args.repeats) for m in methods]:
        cmd = [sys.executable, __file__, "--child", "1", "--methods",
               name if spec is None or METHODS.get(name) == spec else f"{name}={json.dumps(spec)}",
               "--concurrency", str(args.concurrency), "--prompt-set", args.prompt_set,
               "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
        cmd += ["--eager"] * args.eager + (["--model", args.model] if args.model else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("STEP_PROFILE ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"{name}: the engine failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        res = json.loads(line.split(" ", 1)[1])
        runs[name].append(res)
        split = ", ".join(f"{k} {v['s']:.2f} s" + (f" ({v['steps']} steps)" if k != "outside" else "")
                          for k, v in res["time_split"].items())
        print(f"{name}: {res['tokens_per_s']:.2f} tokens/s, {res['decode_steps']} decode steps; {split}", flush=True)
    results = [combine(r) if len(r) > 1 else r[0] for r in runs.values()]
    text = (f"{args.prompt_set}, {args.num_prompts} prompts x {args.max_tokens} tokens, concurrency "
            f"{args.concurrency}, {'eager' if args.eager else 'compiled'}, {args.dtype}; median ms per decode step"
            + (f" (median of {args.repeats} processes' medians)" if args.repeats > 1 else "") + "\n\n"
            + format_table(results))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "child"}, "results": results,
                       "processes": runs, "report": text}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
