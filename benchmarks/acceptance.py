"""Mean acceptance length of entmtp on a prompt set, measured with vLLM's own spec-decode counters.

    python benchmarks/acceptance.py --prompt-set humaneval --num-prompts 40
    python benchmarks/acceptance.py --prompt-set gsm8k --compare-plain   # also plain decoding, same prompts

Mean acceptance length counts the bonus token (1.0 = nothing accepted; vLLM's convention):
``1 + accepted draft tokens / drafting steps``. Per-position acceptance rate ``i`` = accepted draft tokens at
chain position ``i`` / drafting steps. Each engine runs in its own process (``python -m vllm_entmtp.harness``).
With ``--compare-plain`` the plain run goes first, then entmtp, on the same prompts; tokens/s of both and
their ratio are reported (one run, same machine; ``benchmarks/throughput.py`` is the load test).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def run_engine(model: str, spec: dict | None, conversations: list, args) -> dict:
    from vllm_entmtp.harness import run_job

    job = {"model": model, "speculative_config": spec, "dtype": args.dtype, "max_model_len": args.max_model_len,
           "max_num_seqs": max(args.concurrency, 1), "conversations": conversations,
           "max_tokens": args.max_tokens, "phases": [{"name": "run", "concurrency": args.concurrency}]}
    try:
        return run_job(job, verbose=args.verbose)["run"]
    except RuntimeError as e:
        sys.exit(str(e))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-set", default="humaneval",
                    help="humaneval, gsm8k, sharegpt, mtbench or creative (default humaneval)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1, help="1 = one request at a time (default)")
    ap.add_argument("--dtype", default="bfloat16", help="target dtype (default bfloat16, as served)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--model", default=None, help="target model folder (default: the prepared default model)")
    ap.add_argument("--speculative-config", default='{"method": "entmtp"}',
                    help="JSON, as for vllm serve (default: {\"method\": \"entmtp\"})")
    ap.add_argument("--compare-plain", action="store_true", help="also run plain decoding; report tokens/s ratio")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--verbose", action="store_true", help="show the engines' logs")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_entmtp.datasets import load_prompts
    from vllm_entmtp.models import prepare_default_model

    model = args.model or str(prepare_default_model())
    prompts = load_prompts(args.prompt_set, limit=args.num_prompts)
    convs = [p.messages for p in prompts]
    spec_cfg = json.loads(args.speculative_config)
    results = {"prompt_set": args.prompt_set, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
               "concurrency": args.concurrency, "dtype": args.dtype, "speculative_config": spec_cfg}
    if args.compare_plain:
        plain = run_engine(model, None, convs, args)
        results["plain"] = {"output_tokens": sum(map(len, plain["token_ids"])), "seconds": plain["seconds"]}
    spec = run_engine(model, spec_cfg, convs, args)
    s = spec["spec"]
    drafts = max(s["num_drafts"], 1)
    results["entmtp"] = {
        "output_tokens": sum(map(len, spec["token_ids"])), "seconds": spec["seconds"],
        "num_drafts": s["num_drafts"], "num_draft_tokens": s["num_draft_tokens"],
        "num_accepted_tokens": s["num_accepted_tokens"],
        "mean_acceptance_length_incl_bonus": 1 + s["num_accepted_tokens"] / drafts,
        "draft_acceptance_rate": s["num_accepted_tokens"] / max(s["num_draft_tokens"], 1),
        "acceptance_rate_per_position": [a / drafts for a in s["accepted_per_position"]],
    }
    e = results["entmtp"]
    print(f"prompt set {args.prompt_set}: {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}, {args.dtype}")
    print(f"  mean acceptance length (bonus token included): {e['mean_acceptance_length_incl_bonus']:.3f}")
    print(f"  draft acceptance rate: {e['draft_acceptance_rate']:.3f}  "
          f"per position: {', '.join(f'{r:.3f}' for r in e['acceptance_rate_per_position'])}")
    tps = e["output_tokens"] / e["seconds"]
    print(f"  entmtp: {tps:.1f} output tokens/s")
    if args.compare_plain:
        p = results["plain"]
        ptps = p["output_tokens"] / p["seconds"]
        results["speedup_vs_plain"] = tps / ptps
        print(f"  plain:  {ptps:.1f} output tokens/s  -> entmtp/plain = {tps / ptps:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
