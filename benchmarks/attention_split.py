"""What a step's attention costs when some of its requests verify draft tokens, by how the step splits the kernels.

    python benchmarks/attention_split.py                      # 16 and 32 requests, 0-10 verifying, 200 and 600 tokens
    python benchmarks/attention_split.py --requests 32 --verifying 0,5 --contexts 600,1500 --out runs/split.json

A step of ``N`` requests after ``C`` tokens of context each, ``K`` of them verifying one draft token (two query
rows), the others decoding (one row), through every attention layer of the target (one KV cache per layer, random
values, as ``attention_rows.py``), timed three ways:

``vllm``
    vLLM's kernel for every request (``cpu_attention_with_kv_cache``, what vLLM's CPU backend runs).
``split``
    the plugin's kernel (:mod:`vllm_entmtp.verify_attention`) for the ``K`` requests, vLLM's for the others as a
    batch of their own: what the attention override ran before commit 5b8ef55.
``entmtp``
    the override's own plan and forward (:func:`~vllm_entmtp.verify_attention.plan`,
    :func:`~vllm_entmtp.verify_attention.forward`): since 5b8ef55 the requests of one row join those verifying drafts
    on the plugin's kernel, one kernel a step.

With ``K = 0`` the override leaves the step to vLLM's kernel (a step without drafts runs as plain decoding), so
only ``vllm`` is timed. Run with the engine's thread count (``vllm serve`` on a 2-core CPU ran its worker on one
thread). vLLM's kernel is called without splitting a request's context among threads (``enable_kv_split=False``,
as ``attention_rows.py``; the engine follows ``VLLM_CPU_ATTN_SPLIT_KV``, which matters with more than one thread).
Medians over ``--repeats`` passes, the ways in random order.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_rows import attention_shape, parse_counts, vllm_version  # noqa: E402
from gemm_rows import median_ms  # noqa: E402

WAYS = ("vllm", "split", "entmtp")


def step_rows(requests: int, verifying: int) -> list[int]:
    """Query rows per request: ``verifying`` requests of two rows (the first ones), the rest of one."""
    if requests < 1 or not 0 <= verifying <= requests:
        raise ValueError(f"need 0 <= verifying <= requests and requests >= 1, got {verifying} of {requests}")
    return [2] * verifying + [1] * (requests - verifying)


def make_step(torch, va, isa: str, dtype, heads: int, kv_heads: int, head_dim: int, layers: int,
              requests: int, verifying: int, context: int, block_size: int = 128) -> dict:
    """The three ways of one step's attention as callables (``vllm``, ``split``, ``entmtp``; the last two only
    with ``verifying > 0``), each writing its output into ``out`` (returned with them)."""
    rows = step_rows(requests, verifying)
    batches = [va.random_batch(dtype, [context] * requests, rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                               block_size=block_size, seed=layer, isa=isa) for layer in range(layers)]
    query, _, qsl, seq, table = batches[0]
    caches = [b[1] for b in batches]
    scale = head_dim ** -0.5
    out = {w: torch.empty_like(query) for w in WAYS}

    def run_vllm():
        md = va.vllm_metadata(heads, kv_heads, head_dim, seq, qsl, dtype, isa)
        for kv in caches:
            va.vllm_kernel(query, kv, qsl, seq, table, scale, md, out["vllm"])

    ways = {"vllm": run_vllm}
    if verifying:
        multi = torch.arange(verifying, dtype=torch.int32)
        rest = list(range(verifying, requests))
        rows_v = torch.arange(2 * verifying, 2 * verifying + len(rest))
        qsl_v = torch.arange(len(rest) + 1, dtype=torch.int32)
        seq_v, table_v = seq[verifying:].contiguous(), table[verifying:].contiguous()

        def run_split():  # the override before 5b8ef55: vLLM's kernel for the one-row requests, then the plugin's
            md = va.vllm_metadata(heads, kv_heads, head_dim, seq_v, qsl_v, dtype, isa) if rest else None
            for kv in caches:
                if rest:
                    ov = torch.empty(len(rest), heads, head_dim, dtype=dtype)
                    va.vllm_kernel(query.index_select(0, rows_v), kv, qsl_v, seq_v, table_v, scale, md, ov)
                    out["split"].index_copy_(0, rows_v, ov)
                va.multirow(query, kv, qsl, seq, table, scale, reqs=multi, out=out["split"], isa=isa)

        impl = types.SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=head_dim,
                                     kv_cache_dtype="auto", scale=scale)
        layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, isa=isa)
        attn = types.SimpleNamespace(causal=True, dynamic_causal=None, query_start_loc=qsl, seq_lens=seq,
                                     block_table=table)

        def run_entmtp():
            split = va.plan(attn, impl, isa, dtype, verifying=set(range(verifying)))
            for kv in caches:
                va.forward(impl, layer, query, kv, split, out["entmtp"], int(qsl[-1]))

        ways.update(split=run_split, entmtp=run_entmtp)
    return {"ways": ways, "out": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target model folder (default: the prepared default model)")
    ap.add_argument("--requests", default="16,32", help="requests per step, e.g. 16,32")
    ap.add_argument("--verifying", default="0,1,5,10", help="requests of the step verifying one draft token")
    ap.add_argument("--contexts", default="200,600", help="tokens of context per request, e.g. 200,600")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        requests, contexts = parse_counts(args.requests, "requests"), parse_counts(args.contexts, "contexts")
        verifying = sorted({int(x) for x in args.verifying.split(",") if x.strip()})
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if any(k < 0 for k in verifying):
        ap.error("--verifying: counts must be >= 0")

    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_entmtp import verify_attention as va
    from vllm_entmtp.models import prepare_default_model

    folder = Path(args.model) if args.model else prepare_default_model()
    heads, kv_heads, head_dim, layers = attention_shape(json.loads((folder / "config.json").read_text()))
    dtype = getattr(torch, args.dtype)
    isa = _get_attn_isa(dtype, 128, head_dim, "auto")
    if isa == "amx":  # the process asks Linux for the AMX tile state first (vLLM's worker does), else SIGILL
        torch.cpu._init_amx()
    if isa not in va.LAYOUTS or not va.load(dtype):
        print(f"error: the verification kernel does not serve here ('{isa}' layout): {va.why_not()}",
              file=sys.stderr)
        return 2
    results = []
    for n in requests:
        for ctx in contexts:
            for k in (k for k in verifying if k <= n):
                step = make_step(torch, va, isa, dtype, heads, kv_heads, head_dim, layers, n, k, ctx)
                names = list(step["ways"])
                ms = median_ms(lambda w: step["ways"][w](), names, args.repeats)
                for w in names:
                    results.append({"requests": n, "context": ctx, "verifying": k, "way": w, "ms": round(ms[w], 3)})
    print(f"{folder.name}: {layers} layers, {heads} query heads, {kv_heads} KV heads of {head_dim}, {args.dtype}, "
          f"'{isa}' KV layout, {torch.get_num_threads()} threads; median ms of a step's attention (all layers) over "
          f"{args.repeats} passes\n")
    print("| requests | context | verifying | vLLM's kernel for all | split (before 5b8ef55) | entmtp (one kernel) |\n"
          "|---:|---:|---:|---:|---:|---:|")
    by = {(x["requests"], x["context"], x["verifying"], x["way"]): x["ms"] for x in results}
    for n, ctx, k in dict.fromkeys((x["requests"], x["context"], x["verifying"]) for x in results):
        cells = [by.get((n, ctx, k, w)) for w in WAYS]
        print(f"| {n} | {ctx} | {k} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "model": folder.name,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm_version(),
                       "isa": isa, "threads": torch.get_num_threads(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
