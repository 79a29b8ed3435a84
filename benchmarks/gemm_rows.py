"""What the target's linear layers cost by the rows a step verifies, by vLLM's CPU GEMM, weights cold.

    python benchmarks/gemm_rows.py                      # 1..48 rows, the default model's shapes, bfloat16
    python benchmarks/gemm_rows.py --rows 1-8,16,32 --dtype float32 --out runs/gemm-rows.json

A decode step's forward multiplies every verified row by every weight of the target: at a few rows it is bound by
reading the weights from memory, at many by arithmetic. Where it changes, and how, depends on the CPU and on the
kernel oneDNN picks for the row count: on the 2-core AMD EPYC with AVX-512 BF16 (2026-12-05, bfloat16, SmolLM2-135M's
shapes, ``benchmarks/results/small-rows-epyc-2026-12-05/gemm-rows.json``) 1 row took 9.8 ms, 2 rows 10.6 ms,
3 to 6 rows 8.5-8.9 ms, then about 0.5 ms a row from 8 rows on. The load rule reads
such steps from the engine's own measurements (``vllm_entmtp/step_costs.py``, ``LoadRules._step_up``); this
script shows the kernel's part alone, so that a step profile's ``by rows`` table can be read against it.

Each layer's weight is its own tensor of the target's shape with random values (the time does not depend on them),
multiplied by vLLM's ``onednn_mm`` as vLLM's CPU backend runs unquantised linear layers (merged QKV and gate/up
projections); a buffer of ``--flush-mb`` is written before each timed pass so that the weights come from memory as
after a step's other work. Row counts are timed in random order, ``--repeats`` passes each; the median is reported.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def parse_rows(text: str) -> list[int]:
    """``"1-4,8,16"`` -> ``[1, 2, 3, 4, 8, 16]`` (sorted, no repeats)."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--rows: {part!r} is not a number or a range like 1-8") from None
        if a < 1 or b < a:
            raise ValueError(f"--rows: {part!r} must be >= 1 and ascending")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("--rows: no row count given")
    return sorted(out)


def checked_rows(ap, args) -> list[int]:
    """``args.rows`` parsed, and ``args.repeats`` checked; a bad value ends the script with the parser's error."""
    try:
        rows = parse_rows(args.rows)
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return rows


def median_ms(run, counts: list[int], repeats: int, before=None) -> dict[int, float]:
    """Median milliseconds of ``run(count)`` per count: each count run once first (kernels built for its shapes),
    then ``repeats`` passes over the counts in a random order each, ``before()`` (if given) ahead of each timed
    call, outside the timing."""
    for c in counts:
        run(c)
    times: dict[int, list[float]] = {c: [] for c in counts}
    order = list(counts)
    for _ in range(repeats):
        random.shuffle(order)
        for c in order:
            if before is not None:
                before()
            t = time.perf_counter()
            run(c)
            times[c].append(time.perf_counter() - t)
    return {c: 1000 * statistics.median(v) for c, v in times.items()}


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """``(in_features, out_features)`` of one decoder layer's linear layers as vLLM builds a Llama-architecture
    model (QKV merged, gate and up merged), from a transformers ``config.json``."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    return [(h, (heads + 2 * kv) * head_dim), (heads * head_dim, h), (h, 2 * inter), (inter, h)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target model folder (default: the prepared default model)")
    ap.add_argument("--rows", default="1-48", help="row counts, e.g. 1-8,16,32")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--flush-mb", type=int, default=64, help="buffer written before each pass (more than the L3)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    rows = checked_rows(ap, args)

    import torch
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        sys.exit("this vLLM build has no oneDNN GEMM (vLLM's CPU build runs its linear layers with it)")
    from pathlib import Path

    from vllm_entmtp.models import prepare_default_model

    folder = Path(args.model) if args.model else prepare_default_model()
    config = json.loads((folder / "config.json").read_text())
    dtype = getattr(torch, args.dtype)
    shapes = linear_shapes(config)
    layers = []
    for _ in range(config["num_hidden_layers"]):
        for k, n in shapes:
            w = torch.randn(n, k, dtype=dtype) * 0.02
            layers.append((k, ops.create_onednn_mm(w.t(), 32), w))
    flush = torch.zeros(args.flush_mb * 1024 * 1024 // 4)
    inputs = {m: {k: torch.randn(m, k, dtype=dtype) for k, _ in shapes} for m in rows}

    def run(m: int) -> None:
        for k, handle, _ in layers:
            ops.onednn_mm(handle, inputs[m][k], None)

    ms = {m: round(v, 3) for m, v in median_ms(run, rows, args.repeats, before=lambda: flush.add_(1.0)).items()}
    weights_mb = sum(w.numel() * w.element_size() for _, _, w in layers) / 1e6
    print(f"{folder.name}: {len(layers)} linear layers, {weights_mb:.0f} MB of {args.dtype} weights, "
          f"{torch.get_num_threads()} threads; median ms over {args.repeats} passes, weights cold\n")
    print("| rows | ms | ms per row |\n|---:|---:|---:|")
    for m in rows:
        print(f"| {m} | {ms[m]:.2f} | {ms[m] / m:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "model": folder.name, "weights_mb": round(weights_mb, 1),
                       "threads": torch.get_num_threads(), "median_ms": {str(m): v for m, v in ms.items()}}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
