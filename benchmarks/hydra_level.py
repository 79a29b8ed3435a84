"""What one level of the shipped Hydra heads costs, by torch's operators and by the plugin's one-call kernel, weights
cold as after the target's forward.

    python benchmarks/hydra_level.py                            # 1, 2 and 4 paths, bfloat16
    python benchmarks/hydra_level.py --rows 1,2,3,4 --dtype float32 --out runs/hydra-level.json

A level is head ``k``'s block on ``[h ; e(path)]`` and the draft lm_head (8,192 rows for the shipped heads), then
each path's top-k tokens and, for the confidence pass, the top-1 probability. Timed as the drafter runs it
(``HydraDrafter._level``: the path's embedding lookup included) on the shipped heads' weights in ``--dtype``, the
target's embedding and lm_head random of its shape (the time does not depend on the values); a buffer of
``--flush-mb`` is written before each timed call, as the target's forward streams its weights between two levels.
Path counts and both paths are timed in random order, ``--repeats`` passes each; the median is reported.
"""
from __future__ import annotations

import argparse
import json
import sys

from gemm_rows import checked_rows, median_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default=None, help="Hydra heads folder (default: the shipped ones)")
    ap.add_argument("--rows", default="1,2,4", help="path counts, e.g. 1-4 (the kernel takes at most 4)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--flush-mb", type=int, default=300, help="buffer written before each call (the target's size)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    rows = checked_rows(ap, args)

    import torch

    from vllm_entmtp import hydra_kernel
    from vllm_entmtp.heads.hydra import load_hydra_heads
    from vllm_entmtp.models import default_heads
    from vllm_entmtp.proposer import HydraDrafter, _fused_blocks

    if rows[-1] > hydra_kernel.MAX_ROWS:
        ap.error(f"--rows: the kernel takes at most {hydra_kernel.MAX_ROWS} paths")
    dtype = getattr(torch, args.dtype)
    if not hydra_kernel.load(dtype):
        sys.exit(f"the plugin's kernel is not available here: {hydra_kernel.why_not()}")
    heads = load_hydra_heads(args.heads or default_heads()["hydra"], dtype=dtype)
    cfg = heads.config
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype) * 0.05  # tied embedding and lm_head
    drafter = HydraDrafter(heads, lambda ids: table[ids], table, measure_kernels=True)
    startup = drafter.describe_kernels()  # the start-up choice, before the runs below switch paths
    kernel_weights = [(w, b) for w, b, _ in _fused_blocks(heads)]
    flush = torch.zeros(args.flush_mb * 1024 * 1024 // 4)
    runs = {(n, path, probs) for n in rows for path in ("torch", "kernel") for probs in (False, True)}
    hidden = {n: torch.randn(n, cfg.hidden_size, dtype=dtype) for n in rows}
    ids = {n: torch.randint(0, cfg.vocab_size, (n, 1)) for n in rows}

    def run(key) -> None:
        n, path, probs = key
        drafter.level_weights = kernel_weights if path == "kernel" else None
        drafter._level(0, hidden[n], ids[n], 8, probs)

    with torch.inference_mode():
        ms = median_ms(run, sorted(runs), args.repeats, before=lambda: flush.add_(1.0))
    print(f"Hydra heads level 0 ({cfg.truncated_vocab_size or cfg.vocab_size}-token draft vocabulary, {args.dtype}, "
          f"{torch.get_num_threads()} threads); median ms over {args.repeats} calls, weights cold; start-up timing "
          f"(warm, one path): {startup}\n")
    print("| paths | top-1 prob. | torch's operators | the plugin's kernel | kernel / torch |")
    print("|---:|---|---:|---:|---:|")
    for n in rows:
        for probs in (False, True):
            t, k = ms[(n, "torch", probs)], ms[(n, "kernel", probs)]
            print(f"| {n} | {'yes' if probs else 'no'} | {t:.3f} | {k:.3f} | {k / t:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "threads": torch.get_num_threads(),
                       "median_ms": [{"paths": n, "probs": p, "path": path, "ms": round(v, 4)}
                                     for (n, path, p), v in sorted(ms.items())]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
