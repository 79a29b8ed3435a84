"""The attention of the requests that verify draft tokens, on vLLM's CPU paged KV cache (``verify_attention``).

vLLM's CPU kernel (``cpu_attention_with_kv_cache``) takes a request's second query row at a large part of its
first's cost. The kernel here (``kernels/verify_attention.cpp``) reads each request's K/V blocks once for all its
query rows and all query heads of a KV head, on both of vLLM's x86 layouts:

- ``vec`` (x86 without AMX, and float32 everywhere; AVX-512F, or AVX2 with FMA where the CPU has no AVX-512F
  (``kernels/simd.h``), accumulators in registers). On the project's 2-core EPYC with AVX-512 (bfloat16, 30 layers, 16
  requests, one thread as the served worker runs; ``benchmarks/attention_rows.py --kernels vllm,entmtp``, two runs)
  vLLM's took 17.3-17.8 ms for one row each and 24.0-24.2 ms for two at 300 tokens of context, 51.1-52.5 and 78.9-80.9
  ms at 1,000; this kernel 13.2-13.4 and 17.3-17.5 ms, 39.7-39.8 and 51.8 ms. Served, a draft token cost 11-13 % less
  per step (``benchmarks/results/verify-kernel-epyc-2026-12-05/``). On a 2-core AMD EPYC with AVX2 only (float32, 32
  requests, 2 threads; 2026-12-07) vLLM's took 37.5 / 59.9 / 74.9 / 78.6 ms for 1-4 rows a request at 300 tokens of
  context and 119.1 / 237.3 / 291.1 / 307.9 at 1,000; this kernel (AVX2) 25.9 / 32.7 / 42.4 / 46.6 and 88.5 / 113.7 /
  142.7 / 157.1 (``benchmarks/results/avx2-kernels-epyc-2026-12-07/``).
- ``amx`` (bfloat16 on CPUs with AMX; AMX tiles, as vLLM's kernel: up to 16 query vectors a tile, so extra rows
  cost little). On a 2-core Xeon with AMX (32 requests, one thread) vLLM's took 22.0 / 42.1 / 43.2 / 44.8 ms for
  1-4 rows a request at 300 tokens of context and 67.1 / 148.7 / 153.2 / 158.5 at 1,000; this kernel 22.5 / 24.8 /
  26.1 / 28.1 and 63.3 / 69.4 / 74.6 / 78.2 (``benchmarks/results/amx-kernel-2026-12-06/``).

In a step where some requests verify draft tokens (``verifying``: vLLM scheduled draft tokens for them) with 2 to
:data:`MAX_ROWS` query rows, those and the requests of one row take it; the rest (prompt chunks of more than one
token, requests of more rows) run vLLM's kernel as a batch of their own, and a step that verifies no draft token
runs vLLM's kernel alone, as plain decoding does. The one-row requests join because two kernels in one step cost
more than one: on the 2-core Xeon with AMX (bfloat16, 30 layers, one thread; ``benchmarks/attention_split.py``,
2026-12-06) 32 requests at 600 tokens of context, 5 of them verifying one draft token, took 49.9 ms split between
the kernels and 43.8 ms with every request on this one, where vLLM's kernel took 44.2 ms for a row each (16
requests at 200 tokens: 8.7, 7.6 and 9.1 ms). In bfloat16 a request that does not draft may so round differently
from plain decoding in a step where others draft.
Where the kernel does not apply (neither AVX-512F nor AVX2 with FMA, no C++ compiler or ninja, a KV layout other
than these two, sliding windows, ALiBi, soft-capping, sinks, an fp8 KV cache, head sizes other than 64 and 128, a
non-causal step) vLLM's kernel runs everything. Its output differs from vLLM's kernel by rounding (the sums run in
another order: on random float32 batches within 2.4e-7 of outputs of order 1, bfloat16 ones on ``amx`` within 2e-3
of outputs up to 3; the start-up check and the tests allow 1e-4 in float32, 3e-2 in bfloat16).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_entmtp import cpp_build

#: Requests with at most this many query rows take the kernel (a chain of 15 draft tokens and its root).
MAX_ROWS = 16
#: vLLM's CPU KV layouts (its ISA names) the kernel reads: ``vec`` (float32 or bfloat16) and ``amx``
#: (bfloat16 on CPUs with AMX, computed with AMX tiles).
LAYOUTS = ("vec", "amx")
#: Block sizes the kernel takes must be multiples of these.
BLOCK_MULTIPLE = {"vec": 16, "amx": 32}
SOURCE = "verify_attention.cpp"
NAME = "entmtp_verify_attention"


def kernel(isa: str = "vec"):
    """The loaded kernel for KV layout ``isa`` (``multirow_attention``, ``multirow_attention_amx``), or None."""
    if KERNEL.module is None:
        return None
    return KERNEL.module.multirow_attention_amx if isa == "amx" else KERNEL.module.multirow_attention


def use(impls, on: bool) -> None:
    """Whether these attention layers (one engine's ``TreeCPUAttentionImpl`` objects) take the kernel
    (:func:`serves`): set by the engine's drafter from its option ``verify_attention``, after :func:`load`."""
    for impl in impls:
        impl.entmtp_verify = bool(on) and KERNEL.module is not None


def why_not() -> str:
    """Why :func:`kernel` is None (empty when it is loaded)."""
    return KERNEL.reason


def load(dtype: torch.dtype) -> bool:
    """Build (the first time: about 30 s with g++; then from torch's extension folder) and check the kernel against
    vLLM's on a small batch in ``dtype`` (once per dtype); True when it is ready. A failure leaves vLLM's kernel for
    every step and says why (:func:`why_not`)."""
    return KERNEL.load(dtype)


def layout(dtype: torch.dtype) -> str:
    """vLLM's CPU KV layout for ``dtype`` on this machine (its ISA name: ``vec``, ``amx``, ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, 128, 64, "auto")


def _unavailable(dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 and bfloat16 only)"
    if cpp_build.isa() is None:
        return cpp_build.NO_ISA
    here = layout(dtype)
    if here not in LAYOUTS:
        return f"vLLM's CPU attention uses the KV layout '{here}' here (the kernel reads {', '.join(LAYOUTS)})"
    if here == "amx" and not (torch.cpu._is_amx_tile_supported() and torch.cpu._is_avx512_bf16_supported()):
        return "this CPU has no AMX tiles or no AVX512-BF16 (the kernel's 'amx' layout path uses both)"
    if here == "amx" and not torch.cpu._init_amx():
        return "Linux did not grant this process the AMX tile state"
    return cpp_build.toolchain_missing()


def layer_limits(impl, layout: str, block_size: int) -> str | None:
    """Why a layer's attention cannot take the kernel whatever the step (None: it can), from what is fixed at
    start-up: the KV layout vLLM chose (``layout``, its ISA name), block size, head size, and the layer's options."""
    if layout not in LAYOUTS:
        return f"vLLM's KV layout here is '{layout}', not one of {', '.join(LAYOUTS)}"
    if block_size % BLOCK_MULTIPLE[layout]:
        return f"KV block size {block_size} (a multiple of {BLOCK_MULTIPLE[layout]} only on '{layout}')"
    if impl.head_size not in (64, 128):
        return f"head size {impl.head_size} (64 and 128 only)"
    if impl.kv_cache_dtype != "auto":
        return f"KV cache dtype {impl.kv_cache_dtype}"
    for name, off in (("ALiBi", impl.alibi_slopes is None), ("a sliding window", impl.sliding_window == -1),
                      ("logit soft-capping", not impl.logits_soft_cap), ("attention sinks", impl.sinks is None)):
        if not off:
            return f"{name} in layer attention"
    return None


def vllm_metadata(num_heads: int, num_kv_heads: int, head_dim: int, seq_lens, qsl, dtype: torch.dtype, isa: str,
                  kv_split: bool = False, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """vLLM's scheduler metadata for a causal batch of ``len(seq_lens)`` requests
    (``cpu_attn_get_scheduler_metadata``), built once per step and read by :func:`vllm_kernel` in every layer."""
    import vllm._custom_ops as ops
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=kv_split,
        dynamic_causal=None, kv_cache_dtype=kv_cache_dtype)


def vllm_kernel(query, kv_cache, qsl, seq_lens, block_table, scale: float, metadata: torch.Tensor, out: torch.Tensor,
                k_scale: float = 1.0, v_scale: float = 1.0, kv_cache_dtype: str = "auto") -> None:
    """vLLM's kernel (``cpu_attention_with_kv_cache``) on ``query [T, H, D]`` over ``kv_cache [num_blocks, Hkv,
    block_size, 2 * D]``, causal, into ``out``; ``metadata``: :func:`vllm_metadata` of the same batch."""
    import vllm._custom_ops as ops
    nb, hkv, bs, _ = kv_cache.shape
    kc, vc = kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=seq_lens, scale=scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
        scheduler_metadata=metadata, s_aux=None, dynamic_causal=None, k_scale=k_scale, v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype)


def reference(query, kv_cache, qsl, seq_lens, block_table, scale: float, isa: str = "vec") -> torch.Tensor:
    """vLLM's kernel on the same rows (``kv_cache [num_blocks, Hkv, block_size, 2 * D]`` in layout ``isa``),
    causal."""
    if isa == "amx":  # the process asks Linux for the AMX tile state first (vLLM's worker does), else SIGILL
        torch.cpu._init_amx()
    out = torch.empty_like(query)
    md = vllm_metadata(query.shape[1], kv_cache.shape[1], query.shape[2], seq_lens, qsl, query.dtype, isa)
    vllm_kernel(query, kv_cache, qsl, seq_lens, block_table, scale, md, out)
    return out


def multirow(query, kv_cache, qsl, seq_lens, block_table, scale: float, reqs: torch.Tensor | None = None,
             out: torch.Tensor | None = None, isa: str = "vec") -> torch.Tensor:
    """The kernel on ``query [T, H, D]`` over ``kv_cache [num_blocks, Hkv, block_size, 2 * D]`` in layout ``isa``
    (one of :data:`LAYOUTS`): the rows of the requests ``reqs`` (int32 indices; None: all) into ``out`` (None: a
    new tensor; other rows left as they are)."""
    nb, hkv = kv_cache.shape[:2]
    out = torch.empty_like(query) if out is None else out
    if reqs is None:
        reqs = torch.arange(len(seq_lens), dtype=torch.int32)
    kernel(isa)(query, kv_cache.view(nb, hkv, -1), qsl, seq_lens, block_table, reqs, float(scale), out)
    return out


def random_batch(dtype: torch.dtype, contexts: list[int], rows: list[int], heads: int = 9, kv_heads: int = 3,
                 head_dim: int = 64, block_size: int = 128, seed: int = 0, isa: str = "vec"):
    """A paged cache in layout ``isa`` written by vLLM's ``cpu_attn_reshape_and_cache`` and query rows for
    ``len(contexts)`` requests of ``rows[i]`` rows after ``contexts[i]`` tokens: ``(query, kv_cache, qsl, seq_lens,
    block_table)``."""
    import vllm._custom_ops as ops
    g = torch.Generator().manual_seed(seed)
    seqs = [c + r for c, r in zip(contexts, rows)]
    per = max(-(-s // block_size) for s in seqs)
    n = len(seqs)
    cache = torch.zeros(n * per, kv_heads, block_size, 2 * head_dim, dtype=dtype)
    table = torch.arange(n * per, dtype=torch.int32).view(n, per).flip(1).contiguous()  # blocks out of order
    k = torch.randn(sum(seqs), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(sum(seqs), kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.cat([table[b, torch.arange(s) // block_size].long() * block_size + torch.arange(s) % block_size
                       for b, s in enumerate(seqs)])
    kc, vc = cache.view(n * per, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    qsl = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).to(dtype)
    return query, cache, qsl, torch.tensor(seqs, dtype=torch.int32), table


#: Largest difference from vLLM's kernel the start-up check accepts (outputs of order 1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def self_check(dtype: torch.dtype) -> str | None:
    """The kernel against vLLM's on a small random batch (several contexts and row counts) in each layout an engine
    of ``dtype`` may use here (``vec``, and ``amx`` where vLLM picks it for its default block size: an engine with
    a block size that is no multiple of 32 runs ``vec`` there); None when they agree within :data:`TOLERANCE`,
    else why not."""
    for isa in dict.fromkeys(("vec", layout(dtype))):
        batch = random_batch(dtype, [5, 300, 129, 1000, 127], [2, 1, 3, 4, 8], isa=isa)
        scale = 0.125
        ours, vllms = multirow(*batch, scale, isa=isa).float(), reference(*batch, scale, isa=isa).float()
        diff = (ours - vllms).abs().max().item()
        if not diff <= TOLERANCE[dtype]:
            return f"its start-up check differed from vLLM's kernel by {diff:.3g} ({dtype}, '{isa}' layout)"
    return None


@dataclass
class Split:
    """One step's requests by kernel (the same for every layer of the step): the kernel's requests (those
    verifying draft tokens with 2 to :data:`MAX_ROWS` rows and those of one row; ``reqs_m``, read and written in
    place in the step's batch: ``qsl``, ``seq_lens``, ``table``) and vLLM's (the rest, None where there are none)
    as a batch of their own: its query rows, ``qsl``, ``seq_lens``, block table and vLLM's scheduler metadata."""
    reqs_m: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    table: torch.Tensor
    rows_v: torch.Tensor | None = None
    qsl_v: torch.Tensor | None = None
    seq_v: torch.Tensor | None = None
    table_v: torch.Tensor | None = None
    md_v: object | None = None


def plan(attn_metadata, impl, isa: str, dtype: torch.dtype, verifying=None) -> Split | None:
    """The step's :class:`Split`, or None where every request runs vLLM's kernel (no request verifying draft
    tokens with 2 to :data:`MAX_ROWS` rows, or a step the kernel does not serve). ``verifying``: the batch indices
    of the requests that verify draft tokens this step (the attention override passes the step's); None: every
    request of 2 to :data:`MAX_ROWS` rows. Where some request takes the kernel, so do the requests of one row
    (module docstring)."""
    if attn_metadata.causal is not True or attn_metadata.dynamic_causal is not None:
        return None
    if verifying is not None and not verifying:
        return None
    qsl_t = attn_metadata.query_start_loc
    qsl = qsl_t.tolist()
    n = len(qsl) - 1
    multi = [b for b in range(n) if 2 <= qsl[b + 1] - qsl[b] <= MAX_ROWS and (verifying is None or b in verifying)]
    if not multi:
        return None
    verify = set(multi)
    multi = [b for b in range(n) if b in verify or qsl[b + 1] - qsl[b] == 1]
    i32 = torch.int32
    seq_lens, table = attn_metadata.seq_lens, attn_metadata.block_table
    split = Split(torch.tensor(multi, dtype=i32), qsl_t.to(i32).contiguous(), seq_lens.to(i32).contiguous(),
                  table.to(i32).contiguous())
    chosen = set(multi)
    rest = [b for b in range(n) if b not in chosen]
    if not rest:
        return split
    import vllm.envs as envs
    counts = [qsl[b + 1] - qsl[b] for b in rest]
    split.rows_v = torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b in rest])
    split.qsl_v = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=i32)
    sel = torch.tensor(rest)
    split.seq_v, split.table_v = split.seq_lens[sel].contiguous(), split.table[sel].contiguous()
    split.md_v = vllm_metadata(impl.num_heads, impl.num_kv_heads, impl.head_size, split.seq_v, split.qsl_v, dtype,
                               isa, kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=impl.kv_cache_dtype)
    return split


def serves(impl, layer, kv_cache: torch.Tensor) -> bool:
    """Whether this layer's attention can take the kernel at all (same every step)."""
    isa = getattr(layer, "isa", None)
    return (getattr(impl, "entmtp_verify", False) and KERNEL.module is not None
            and isa in LAYOUTS and impl.alibi_slopes is None
            and impl.sliding_window == -1 and not impl.logits_soft_cap and impl.sinks is None
            and impl.kv_cache_dtype == "auto" and kv_cache.is_contiguous()
            and impl.head_size in (64, 128) and kv_cache.shape[2] % BLOCK_MULTIPLE[isa] == 0
            and (isa != "amx" or kv_cache.dtype == torch.bfloat16))


def forward(impl, layer, query: torch.Tensor, kv_cache: torch.Tensor, split: Split, output: torch.Tensor,
            num_tokens: int) -> None:
    """One layer's attention of the step by :class:`Split`: vLLM's kernel for its batch, this kernel for the
    requests verifying draft tokens and those of one row; into ``output[:num_tokens]``."""
    h, d = impl.num_heads, impl.head_size
    q = query[:num_tokens].view(num_tokens, h, d)
    out = output[:num_tokens].view(num_tokens, h, d)
    if split.rows_v is not None:
        qv = q.index_select(0, split.rows_v)
        ov = torch.empty_like(qv)
        vllm_kernel(qv, kv_cache, split.qsl_v, split.seq_v, split.table_v, impl.scale, split.md_v, ov,
                    k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype)
        out.index_copy_(0, split.rows_v, ov)
    multirow(q, kv_cache, split.qsl, split.seq_lens, split.table, impl.scale, reqs=split.reqs_m, out=out,
             isa=layer.isa)


KERNEL = cpp_build.BuiltKernel(NAME, SOURCE, _unavailable, self_check, "verification attention by vLLM's kernel")
