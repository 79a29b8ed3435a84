"""The tree mask a GPU attention backend would take (``vllm_entmtp/tree_mask.py``), checked and timed on a GPU.

    python benchmarks/gpu_tree_mask.py --device cuda --out DIR [--iters 50]
    python benchmarks/gpu_tree_mask.py --device cpu --out DIR --tiny     # a quick CPU smoke run (eager flex)

Needs torch (and pydantic, for the tree sets), not vLLM: vLLM's GPU attention backends are not patched by this
project, so this checks only the mask such a backend would take, in the two forms ``tree_mask.py`` builds.

1. Correctness, in float32 and bfloat16, on a packed (varlen) batch like ``tests/test_tree_mask.py``'s: decode
   rows, a chain, a prompt chunk and draft trees (``Tree([[0],[1],[0,0],[0,1],[1,0],[0,0,0]])``, ``[[0],[1]]``,
   trees of the shipped ``default`` set and Medusa's 63-node tree), random q/k/v with GQA (9 query heads over 3
   KV heads, head size 64, SmolLM2-135M's shape). Two kernels: (a) SDPA per request with its rows of
   ``tree_attention_bias``; (b) ``flex_attention`` (``torch.compile``d on CUDA, eager on CPU) over the packed
   batch with ``create_block_mask(tree_mask_mod(...))`` and ``enable_gqa=True``. Both against an independent
   float64 reference per request (on the same device, from the bf16-rounded inputs in the bfloat16 case): causal
   over the context, and among the step's rows ``Tree.ancestor_mask()`` (row 0 the root, rows 1..n the nodes) or
   causal for requests without a tree. Every row must be within the dtype's tolerance.
2. Timing on a serving-like batch (64 requests with the default set's largest tree, 32 plain decode rows,
   contexts 512-2048, bfloat16): compiled flex_attention with the block mask over the packed batch, against SDPA
   over the dense additive bias in ONE padded call (requests padded to the longest query rows and keys, K/V heads
   expanded before timing), with CUDA events (median of ``--iters`` after warm-ups); and the time to BUILD each
   mask per step (``tree_mask_mod`` + ``create_block_mask``; ``tree_attention_bias`` + the padded layout), wall
   clock, since that is on every step's path.

Writes ``results.json`` and ``README-fragment.md`` to ``--out``; exits 1 when a correctness check fails. Where
pydantic is missing (a bare CUDA image), install wheels of pydantic, pydantic-core, annotated-types,
typing-inspection and typing-extensions at the versions of the project's venv into a folder on ``PYTHONPATH``,
with the repository root after it. A correctness failure still runs the timing, so one run reports both.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_entmtp.tree_mask import tree_attention_bias, tree_mask_mod
from vllm_entmtp.trees import Tree, load_tree_set

H, HKV, D = 9, 3, 64  # SmolLM2-135M
REP = H // HKV
SCALE = D ** -0.5
TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # bf16 keeps 8 mantissa bits: ~4e-3 relative per rounding of O(1) values
TREE = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def _largest(tree_set) -> tuple[str, Tree]:
    """The set's tree with the most nodes (then the deepest; then the first in file order)."""
    return max(tree_set.trees, key=lambda it: (it[1].num_nodes, it[1].depth))


def _check_batch(tiny: bool):
    """(context, rows, tree or None, label) per request: test_tree_mask.py's BATCH plus real trees."""
    default = load_tree_set("default")
    batch = [(9, 1, None, "decode"), (31, TREE.num_nodes + 1, TREE, "tree TREE"), (5, 4, None, "chain of 3"),
             (3, 5, None, "prompt chunk"), (70, 3, Tree([[0], [1]]), "tree [[0],[1]]")]
    picks = ["b0n12", "b3n12"] if tiny else ["b0n12", "b3n12", "b2n8"]
    ctxs = [200, 517, 129]
    for ctx, tid in zip(ctxs, picks):
        t = default.get(tid)
        batch.append((ctx, t.num_nodes + 1, t, f"default/{tid}"))
    if not tiny:
        mc = load_tree_set("medusa63").trees[0][1]
        batch += [(300, mc.num_nodes + 1, mc, "medusa63"), (1000, 1, None, "decode")]
    return batch


def _make(batch, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for ctx, t, tree, label in batch:
        s = ctx + t
        reqs.append({"ctx": ctx, "t": t, "tree": tree, "label": label,
                     "q": torch.randn(t, H, D, generator=g).to(device),
                     "k": torch.randn(s, HKV, D, generator=g).to(device),
                     "v": torch.randn(s, HKV, D, generator=g).to(device)})
    qsl = torch.tensor([0] + [r["t"] for r in reqs]).cumsum(0).to(device)
    seq_lens = torch.tensor([r["ctx"] + r["t"] for r in reqs]).to(device)
    trees = {b: r["tree"] for b, r in enumerate(reqs) if r["tree"] is not None}
    return reqs, qsl, seq_lens, trees


def _allowed(r, tree_override=False) -> torch.Tensor:
    """[t, ctx + t] bool, built independently of tree_mask.py: context all, then ancestors-or-self / causal."""
    ctx, t = r["ctx"], r["t"]
    m = torch.zeros(t, ctx + t, dtype=torch.bool)
    m[:, :ctx] = True
    if r["tree"] is not None and not tree_override:
        m[:, ctx:] = r["tree"].ancestor_mask()
    else:
        m[:, ctx:] = torch.ones(t, t, dtype=torch.bool).tril()
    return m


def _reference(q, k, v, allowed) -> torch.Tensor:
    """float64 attention of one request: q [t, H, D], k/v [S, HKV, D], allowed [t, S] -> [t, H, D]."""
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(REP, 1) for x in (k, v))  # query head h reads KV head h // REP
    s = torch.einsum("thd,shd->hts", q, k) * SCALE
    s = s.masked_fill(~allowed.to(q.device), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def _flex(device, compile_: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compile_ else flex_attention


def check(device, dtype_name, flex, tiny) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    dtype = getattr(torch, dtype_name)
    batch = _check_batch(tiny)
    reqs, qsl, seq_lens, trees = _make(batch, device)
    for r in reqs:  # round the inputs to the dtype first; the reference reads the same rounded values
        for x in ("q", "k", "v"):
            r[x] = r[x].to(dtype)
    bias = tree_attention_bias(qsl, seq_lens, trees, dtype=dtype)
    q = torch.cat([r["q"] for r in reqs]).transpose(0, 1)[None]  # [1, H, total_q, D]
    k, v = (torch.cat([r[x] for r in reqs]).transpose(0, 1)[None] for x in ("k", "v"))  # [1, HKV, total_kv, D]
    block_mask = create_block_mask(tree_mask_mod(qsl, seq_lens, trees), 1, None, q.shape[2], k.shape[2],
                                   device=device)
    flex_out = flex(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True)[0].transpose(0, 1)
    rows = []
    worst = {"sdpa": 0.0, "flex": 0.0}
    for b, r in enumerate(reqs):
        lo, hi, s = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        ref = _reference(r["q"], r["k"], r["v"], _allowed(r))
        sd = F.scaled_dot_product_attention(r["q"].transpose(0, 1)[None], r["k"].transpose(0, 1)[None],
                                            r["v"].transpose(0, 1)[None], attn_mask=bias[lo:hi, :s],
                                            scale=SCALE, enable_gqa=True)[0].transpose(0, 1)
        e_sdpa = (sd.double() - ref).abs().amax(dim=(1, 2))  # per row
        e_flex = (flex_out[lo:hi].double() - ref).abs().amax(dim=(1, 2))
        # how far the plain causal answer is from the tree answer on this request's rows: the size of an error
        # that a wrong (causal) mask would make, to show the tolerance can see one
        # and, on the rows where the two differ (Tree.fix_rows), each kernel's output must be nearer the tree
        # reference than the causal one, so a causal mask fails the check even where its error is under the tolerance
        causal_gap, wrong_sdpa, wrong_flex = None, 0, 0
        if r["tree"] is not None and r["tree"].fix_rows:
            causal = _reference(r["q"], r["k"], r["v"], _allowed(r, tree_override=True))
            fix = r["tree"].fix_rows
            gap = (causal - ref).abs().amax(dim=(1, 2))
            causal_gap = float(gap[fix].min())
            for out, err in ((sd, e_sdpa), (flex_out[lo:hi], e_flex)):
                e_causal = (out.double() - causal).abs().amax(dim=(1, 2))
                n_wrong = int((e_causal[fix] <= err[fix]).sum())
                if out is sd:
                    wrong_sdpa = n_wrong
                else:
                    wrong_flex = n_wrong
        worst["sdpa"] = max(worst["sdpa"], float(e_sdpa.max()))
        worst["flex"] = max(worst["flex"], float(e_flex.max()))
        rows.append({"request": b, "label": r["label"], "context": r["ctx"], "rows": r["t"],
                     "max_abs_err_sdpa": float(e_sdpa.max()), "max_abs_err_flex": float(e_flex.max()),
                     "rows_over_tol_sdpa": int((e_sdpa > TOL[dtype_name]).sum()),
                     "rows_over_tol_flex": int((e_flex > TOL[dtype_name]).sum()),
                     "min_causal_gap_on_fix_rows": causal_gap, "fix_rows_nearer_causal_sdpa": wrong_sdpa,
                     "fix_rows_nearer_causal_flex": wrong_flex})
    ok = all(x["rows_over_tol_sdpa"] == 0 and x["rows_over_tol_flex"] == 0 and x["fix_rows_nearer_causal_sdpa"] == 0
             and x["fix_rows_nearer_causal_flex"] == 0 for x in rows)
    return {"dtype": dtype_name, "tolerance": TOL[dtype_name], "total_q": int(qsl[-1]),
            "total_kv": int(seq_lens.sum()), "requests": len(reqs), "max_abs_err_sdpa": worst["sdpa"],
            "max_abs_err_flex": worst["flex"], "ok": ok, "per_request": rows}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _event_time(fn, device, warmup, iters) -> dict:
    """Kernel time in ms: CUDA events around each call (after ``warmup`` calls); perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "n": iters}


def _wall_time(fn, device, warmup, iters) -> dict:
    """Wall-clock ms of a call that is mostly host work (mask building), synchronised on both ends."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "n": iters}


def _padded_bias(bias, qsl, seq_lens, max_q, dtype):
    """[B, 1, max_q, max_kv] from tree_attention_bias's packed rows; padding query rows see every key (0 bias:
    no fully masked row, no NaN) and are dropped afterwards."""
    B = len(seq_lens)
    out = torch.zeros(B, max_q, bias.shape[1], dtype=dtype, device=bias.device)
    req = torch.repeat_interleave(torch.arange(B, device=bias.device), qsl[1:] - qsl[:-1])
    j = torch.arange(int(qsl[-1]), device=bias.device) - qsl[:-1][req]
    out[req, j] = bias.to(dtype)
    return out[:, None]


def serving(device, flex, tree_id, tree, n_tree, n_decode, ctx_lo, ctx_hi, warmup, iters, seed=1) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    ctxs = torch.randint(ctx_lo, ctx_hi + 1, (n_tree + n_decode,), generator=g)
    batch = [(int(ctxs[i]), tree.num_nodes + 1, tree, tree_id) for i in range(n_tree)]
    batch += [(int(ctxs[n_tree + i]), 1, None, "decode") for i in range(n_decode)]
    reqs, qsl, seq_lens, trees = _make(batch, device, seed=seed)
    total_q, total_kv = int(qsl[-1]), int(seq_lens.sum())
    B, max_q, max_kv = len(reqs), max(r["t"] for r in reqs), int(seq_lens.max())
    out = {"tree_id": tree_id, "tree_nodes": tree.num_nodes, "tree_depth": tree.depth, "tree_requests": n_tree,
           "decode_requests": n_decode, "context_range": [ctx_lo, ctx_hi], "total_q": total_q,
           "total_kv": total_kv, "dtype": "bfloat16", "heads": [H, HKV, D]}
    # packed layout (flex)
    q = torch.cat([r["q"] for r in reqs]).transpose(0, 1)[None].to(dtype).contiguous()
    k, v = (torch.cat([r[x] for r in reqs]).transpose(0, 1)[None].to(dtype).contiguous() for x in ("k", "v"))
    # padded layout (SDPA): [B, H, max_q, D], K/V expanded to H heads (outside the timing)
    qp = torch.zeros(B, H, max_q, D, dtype=dtype, device=device)
    kp = torch.zeros(B, H, max_kv, D, dtype=dtype, device=device)
    vp = torch.zeros_like(kp)
    for b, r in enumerate(reqs):
        s = r["ctx"] + r["t"]
        qp[b, :, :r["t"]] = r["q"].transpose(0, 1).to(dtype)
        kp[b, :, :s] = r["k"].repeat_interleave(REP, 1).transpose(0, 1).to(dtype)
        vp[b, :, :s] = r["v"].repeat_interleave(REP, 1).transpose(0, 1).to(dtype)

    # -- building the masks (every step) --
    def build_block_mask(compile_=False):
        return create_block_mask(tree_mask_mod(qsl, seq_lens, trees), 1, None, total_q, total_kv, device=device,
                                 _compile=compile_)

    def build_bias():
        return _padded_bias(tree_attention_bias(qsl, seq_lens, trees, dtype=dtype), qsl, seq_lens, max_q, dtype)

    out["build_tree_mask_mod_ms"] = _wall_time(lambda: tree_mask_mod(qsl, seq_lens, trees), device, 1, 10)
    out["build_block_mask_ms"] = _wall_time(build_block_mask, device, 1, 10)
    out["build_tree_attention_bias_ms"] = _wall_time(
        lambda: tree_attention_bias(qsl, seq_lens, trees, dtype=dtype), device, 1, 10)
    out["build_bias_padded_ms"] = _wall_time(build_bias, device, 1, 10)
    if device == "cuda":
        try:
            t0 = time.perf_counter()
            build_block_mask(True)
            _sync(device)
            out["build_block_mask_compiled_first_call_s"] = time.perf_counter() - t0
            out["build_block_mask_compiled_ms"] = _wall_time(lambda: build_block_mask(True), device, 2, 10)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out["build_block_mask_compiled_error"] = f"{type(e).__name__}: {e}"[:500]
    block_mask = build_block_mask()
    bq, bk = block_mask.BLOCK_SIZE
    visited_partial = int(block_mask.kv_num_blocks.sum())
    visited_full = int(block_mask.full_kv_num_blocks.sum()) if block_mask.full_kv_num_blocks is not None else 0
    grid = -(-total_q // bq) * -(-total_kv // bk)
    out["block_mask"] = {"block_size": [bq, bk], "grid_blocks": grid, "partial_blocks": visited_partial,
                         "full_blocks": visited_full,
                         "visited_percent": 100.0 * (visited_partial + visited_full) / grid}
    bias_p = build_bias()

    # -- the attention calls --
    t0 = time.perf_counter()
    flex_out = flex(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True)
    _sync(device)
    out["flex_first_call_s"] = time.perf_counter() - t0
    out["flex_ms"] = _event_time(lambda: flex(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True),
                                 device, warmup, iters)
    causal_mask = create_block_mask(tree_mask_mod(qsl, seq_lens, {}), 1, None, total_q, total_kv, device=device)
    try:
        flex(q, k, v, block_mask=causal_mask, scale=SCALE, enable_gqa=True)
        out["flex_causal_same_layout_ms"] = _event_time(
            lambda: flex(q, k, v, block_mask=causal_mask, scale=SCALE, enable_gqa=True), device, warmup, iters)
    except Exception as e:  # noqa: BLE001
        out["flex_causal_same_layout_error"] = f"{type(e).__name__}: {e}"[:500]

    sdpa = lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=bias_p, scale=SCALE)  # noqa: E731
    sdpa_out = sdpa()
    out["sdpa_padded_ms"] = _event_time(sdpa, device, warmup, iters)
    backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if device == "cuda":
        backends["cudnn"] = SDPBackend.CUDNN_ATTENTION
    for name, be in backends.items():
        try:
            with sdpa_kernel([be]):
                sdpa()
                out[f"sdpa_padded_{name}_ms"] = _event_time(sdpa, device, warmup, iters)
        except Exception as e:  # noqa: BLE001
            out[f"sdpa_padded_{name}_error"] = f"{type(e).__name__}: {e}"[:300]

    # -- do the two timed paths agree, and with a float64 reference on a few requests? --
    fo = flex_out[0].transpose(0, 1)  # [total_q, H, D]
    diff, ref_err = 0.0, 0.0
    for b, r in enumerate(reqs):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        so = sdpa_out[b, :, :r["t"]].transpose(0, 1)
        diff = max(diff, float((fo[lo:hi].float() - so.float()).abs().max()))
        if b in (0, 1, n_tree, B - 1):
            ref = _reference(r["q"].to(dtype), r["k"].to(dtype), r["v"].to(dtype), _allowed(r))
            ref_err = max(ref_err, float((fo[lo:hi].double() - ref).abs().max()),
                          float((so.double() - ref).abs().max()))
    out["flex_vs_sdpa_max_abs_diff"] = diff
    out["max_abs_err_vs_float64_on_4_requests"] = ref_err
    # useful work: 4 * D flops per (head, allowed query-key pair)
    allowed = int(sum(_allowed(r).sum() for r in reqs))
    out["allowed_pairs"] = allowed
    out["useful_gflop"] = 4 * D * H * allowed / 1e9
    out["padded_pairs"] = B * max_q * max_kv
    out["flex_visited_pairs"] = (visited_partial + visited_full) * bq * bk
    return out


def env_info(device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32  # False: float32 is checked as float32
        info["cuda"] = torch.version.cuda
        try:
            import triton

            info["triton"] = triton.__version__
        except Exception:  # noqa: BLE001
            pass
        try:
            info["nvidia_smi_L"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                                  timeout=30).stdout.strip()
        except Exception as e:  # noqa: BLE001
            info["nvidia_smi_L"] = f"unavailable: {e}"
    return info


def _fmt_ms(d):
    return f"{d['median_ms']:.3f}" if isinstance(d, dict) else "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json and README-fragment.md")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a small serving batch and few iterations (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="skip the optional medusa63 timing once this many seconds have passed")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    compile_ = device == "cuda"
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per dtype and shape; stay under the limit
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    flex = _flex(device, compile_)
    res = {"env": env_info(device), "flex_attention": "torch.compile(dynamic=False)" if compile_ else "eager"}
    print(json.dumps(res["env"], indent=1), flush=True)

    def save():
        res["elapsed_s"] = time.perf_counter() - start
        (out_dir / "results.json").write_text(json.dumps(res, indent=1) + "\n")

    # 1. correctness
    res["correctness"] = []
    for dt in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        c = check(device, dt, flex, args.tiny)
        c["seconds"] = time.perf_counter() - t0
        res["correctness"].append(c)
        print(f"[check {dt}] requests={c['requests']} total_q={c['total_q']} total_kv={c['total_kv']} "
              f"max|err| sdpa={c['max_abs_err_sdpa']:.3e} flex={c['max_abs_err_flex']:.3e} "
              f"tol={c['tolerance']:.0e} -> {'OK' if c['ok'] else 'FAIL'} ({c['seconds']:.1f}s)", flush=True)
        for row in c["per_request"]:
            gap = row["min_causal_gap_on_fix_rows"]
            print(f"    {row['label']:>16} ctx={row['context']:>5} rows={row['rows']:>3} "
                  f"sdpa={row['max_abs_err_sdpa']:.2e} flex={row['max_abs_err_flex']:.2e}"
                  + (f"  (causal would be off by >= {gap:.2e} on its fix rows; fix rows nearer causal: "
                     f"sdpa {row['fix_rows_nearer_causal_sdpa']}, flex {row['fix_rows_nearer_causal_flex']})"
                     if gap is not None else ""))
        save()
    ok = all(c["ok"] for c in res["correctness"])

    # 2. timing
    default = load_tree_set("default")
    tid, tree = _largest(default)
    if args.tiny:
        cfgs = [(tid, tree, 4, 2, 32, 96)]
        iters, warmup = min(args.iters, 3), 1
    else:
        mc_id, mc = load_tree_set("medusa63").trees[0]
        cfgs = [(tid, tree, 64, 32, 512, 2048), (f"medusa63/{mc_id}", mc, 64, 32, 512, 2048)]
        iters, warmup = args.iters, args.warmup
    res["timing"] = []
    for i, (name, t, nt, nd, lo, hi) in enumerate(cfgs):
        if i > 0 and time.perf_counter() - start > args.budget_s:
            print(f"[time] skipping {name}: past --budget-s", flush=True)
            res["timing"].append({"tree_id": name, "skipped": "past --budget-s"})
            continue
        try:
            s = serving(device, flex, name, t, nt, nd, lo, hi, warmup, iters)
        except Exception as e:  # noqa: BLE001 - keep what was measured
            import traceback

            traceback.print_exc()
            s = {"tree_id": name, "error": f"{type(e).__name__}: {e}"[:1000]}
        res["timing"].append(s)
        save()
        if "error" in s:
            continue
        print(f"[time] tree {name} ({t.num_nodes} nodes) x{nt} + {nd} decode, ctx {lo}-{hi}: total_q={s['total_q']} "
              f"total_kv={s['total_kv']} useful={s['useful_gflop']:.2f} GFLOP", flush=True)
        print(f"    {'what':<52}{'median ms':>10}", flush=True)
        for key, label in [("flex_ms", f"flex_attention ({res['flex_attention'][:13]}), packed, tree mask"),
                           ("flex_causal_same_layout_ms", "flex_attention, packed, causal-only block mask"),
                           ("sdpa_padded_ms", "SDPA, one padded call, dense bias (default backend)"),
                           ("sdpa_padded_efficient_ms", "  same, EFFICIENT_ATTENTION forced"),
                           ("sdpa_padded_cudnn_ms", "  same, CUDNN_ATTENTION forced"),
                           ("sdpa_padded_math_ms", "  same, MATH forced"),
                           ("build_tree_mask_mod_ms", "build: tree_mask_mod"),
                           ("build_block_mask_ms", "build: tree_mask_mod + create_block_mask"),
                           ("build_block_mask_compiled_ms", "build: same, create_block_mask(_compile=True)"),
                           ("build_tree_attention_bias_ms", "build: tree_attention_bias"),
                           ("build_bias_padded_ms", "build: tree_attention_bias + padded [B,1,q,kv]")]:
            if key in s:
                print(f"    {label:<52}{_fmt_ms(s[key]):>10}", flush=True)
            elif key.replace("_ms", "_error") in s:
                print(f"    {label:<52}{'error':>10}  {s[key.replace('_ms', '_error')][:120]}", flush=True)
        bm = s["block_mask"]
        print(f"    block mask {bm['block_size']}: {bm['partial_blocks']} partial + {bm['full_blocks']} full of "
              f"{bm['grid_blocks']} blocks ({bm['visited_percent']:.1f}% visited); useful pairs {s['allowed_pairs']} = "
              f"{100 * s['allowed_pairs'] / s['flex_visited_pairs']:.1f}% of flex's visited, "
              f"{100 * s['allowed_pairs'] / s['padded_pairs']:.1f}% of SDPA's padded", flush=True)
        print(f"    "
              f"flex first call {s['flex_first_call_s']:.1f}s; flex vs SDPA max|diff| {s['flex_vs_sdpa_max_abs_diff']:.2e}; "
              f"vs float64 (4 requests) {s['max_abs_err_vs_float64_on_4_requests']:.2e}", flush=True)

    res["ok"] = ok
    save()
    (out_dir / "README-fragment.md").write_text(_fragment(res))
    print(f"{'ALL CHECKS PASSED' if ok else 'CHECK FAILED'} ({time.perf_counter() - start:.0f}s)", flush=True)
    return 0 if ok else 1


def _fragment(res) -> str:
    env = res["env"]
    lines = [f"GPU tree-mask check on {env.get('gpu', env['device'])} (torch {env['torch']}, flex_attention "
             f"{res['flex_attention']}).", "", "| dtype | max abs err SDPA+bias | max abs err flex+block mask | tol | ok |",
             "| --- | --- | --- | --- | --- |"]
    for c in res["correctness"]:
        lines.append(f"| {c['dtype']} | {c['max_abs_err_sdpa']:.2e} | {c['max_abs_err_flex']:.2e} | "
                     f"{c['tolerance']:.0e} | {c['ok']} |")
    for s in res.get("timing", []):
        if "flex_ms" not in s:
            continue
        lines += ["", f"Serving-like batch, bfloat16: {s['tree_requests']} requests with tree {s['tree_id']} "
                  f"({s['tree_nodes']} nodes) + {s['decode_requests']} decode rows, contexts "
                  f"{s['context_range'][0]}-{s['context_range'][1]} (total_q {s['total_q']}, total_kv {s['total_kv']}); "
                  "median ms:", "", "| what | ms |", "| --- | --- |"]
        for key, label in [("flex_ms", "flex_attention, packed, tree block mask"),
                           ("flex_causal_same_layout_ms", "flex_attention, packed, causal block mask"),
                           ("sdpa_padded_ms", "SDPA, one padded call, dense additive bias"),
                           ("build_block_mask_ms", "build tree_mask_mod + create_block_mask"),
                           ("build_block_mask_compiled_ms", "build, create_block_mask compiled"),
                           ("build_bias_padded_ms", "build tree_attention_bias + padding")]:
            if key in s:
                lines.append(f"| {label} | {_fmt_ms(s[key])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
