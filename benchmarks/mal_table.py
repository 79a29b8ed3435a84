"""Mean acceptance length of several speculative configs on several prompt sets, one engine per config, one
phase per prompt set, all in one script run (one request at a time, greedy).

    python benchmarks/mal_table.py --prompt-sets humaneval,gsm8k,sharegpt --num-prompts 6 --max-tokens 48 \\
        --config 'medusa-chain={"method":"entmtp","model":"vllm_entmtp/assets/heads/SmolLM2-135M-Instruct/medusa","num_speculative_tokens":4}' \\
        --config 'hydra-chain={"method":"entmtp","model":"vllm_entmtp/assets/heads/SmolLM2-135M-Instruct/hydra","num_speculative_tokens":4}'

Mean acceptance length includes the bonus token (``1 + accepted / drafting steps``, vLLM's counters). Tokens/s
are printed too, but engines run one after another, so compare them with care (``benchmarks/ablation.py``
compares trees inside one engine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-sets", default="humaneval,gsm8k,sharegpt")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-prompt-chars", type=int, default=1500,
                    help="skip prompts whose text is this long or longer (default %(default)s)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--config", action="append", required=True, metavar="NAME=JSON",
                    help="a speculative config, repeatable")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_entmtp.datasets import load_prompts
    from vllm_entmtp.harness import run_job
    from vllm_entmtp.models import prepare_default_model

    sets = [s for s in args.prompt_sets.split(",") if s]
    convs, phases = [], []
    for name in sets:
        ps = load_prompts(name, limit=args.num_prompts, max_chars=args.max_prompt_chars)
        phases.append({"name": name, "concurrency": 1, "prompts": list(range(len(convs), len(convs) + len(ps)))})
        convs += [p.messages for p in ps]
    configs = []
    for c in args.config:
        name, _, js = c.partition("=")
        try:
            configs.append((name, json.loads(js)))
        except json.JSONDecodeError as e:
            ap.error(f"--config {name}: not JSON ({e})")
    results = {}
    for name, spec in configs:
        job = {"model": str(prepare_default_model()), "speculative_config": spec, "dtype": args.dtype,
               "max_model_len": 2048, "max_num_seqs": 4, "conversations": convs, "max_tokens": args.max_tokens,
               "phases": phases}
        try:
            raw = run_job(job)
        except RuntimeError as e:
            sys.exit(f"{name}: {e}")
        results[name] = {}
        for s in sets:
            r = raw[s]
            sp = r["spec"]
            toks = sum(map(len, r["token_ids"]))
            results[name][s] = {"mal_incl_bonus": 1 + sp["num_accepted_tokens"] / max(sp["num_drafts"], 1),
                                "num_drafts": sp["num_drafts"], "accepted_per_position": sp["accepted_per_position"],
                                "tokens_per_s": toks / r["seconds"], "output_tokens": toks}
    print(f"mean acceptance length (bonus incl.), {args.num_prompts} prompts x {args.max_tokens} tokens, "
          f"{args.dtype}, one request at a time")
    print(f"{'config':<20}" + "".join(f"{s:>14}" for s in sets))
    for name, per in results.items():
        print(f"{name:<20}" + "".join(f"{per[s]['mal_incl_bonus']:>14.3f}" for s in sets))
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
