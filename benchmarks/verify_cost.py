"""Cost of verifying an N-node draft tree against an N-token chain, per forward step, on vLLM's CPU attention.

    python benchmarks/verify_cost.py [--contexts 128,1024,4096] [--nodes 4,8,24,63] [--dtype bfloat16]

Chain and tree verification run the same N + 1 query tokens through every linear layer; they differ only in
attention: a chain is one causal call of vLLM's kernel, a tree additionally recomputes the rows that would see
siblings (``vllm_entmtp.patches.tree_attention.tree_rows_attention``: one gather of the request's K/V blocks,
two batched matmuls). This script times, per attention layer, at each context length: vLLM's kernel for 1 query
row (plain decode), for N + 1 causal rows (an N-token chain), and the tree fix for the tree's rows, and gives
the whole step's attention cost over SmolLM2-135M's 30 layers (9 query heads, 3 KV heads, head size 64). Trees
are prefixes of Medusa's mc_sim_7b_63 (``trees/medusa63.json``). Median of ``--repeats`` timings; one run,
same process, interleaved.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LAYERS, H, HKV, D, BS = 30, 9, 3, 64, 128


def _time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    from vllm_entmtp.patches.tree_attention import tree_rows_attention, tree_rows_plan
    from vllm_entmtp.verify_attention import vllm_kernel, vllm_metadata
    from vllm_entmtp.trees import fix_rows_for
    from vllm_entmtp.trees import load_tree_set

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--nodes", default="4,8,24,63")
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                    help="KV cache and query dtype (default %(default)s: what `make serve` uses on CPUs without "
                         "AVX-512 BF16)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker uses 1 here)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    big = load_tree_set("medusa63").trees[0][1]
    rows_out = []
    print(f"{'context':>8} {'N':>4} {'decode':>9} {'chain':>9} {'tree fix':>9} {'tree/chain':>10}   (ms per step, {LAYERS} layers)")
    for ctx in map(int, args.contexts.split(",")):
        for n in map(int, args.nodes.split(",")):
            tree = big.prefix(min(n, big.num_nodes))
            t = tree.num_nodes + 1
            seq = ctx + t
            nblk = (seq + BS - 1) // BS
            cache = torch.randn(nblk, HKV, BS, 2 * D).to(dtype)
            block_table = torch.arange(nblk, dtype=torch.int32).unsqueeze(0)
            q = torch.randn(t, H, D).to(dtype)
            out = torch.empty(t, H, D, dtype=dtype)

            def kernel(rows):
                qsl = torch.tensor([0, rows], dtype=torch.int32)
                sl = torch.tensor([ctx + rows], dtype=torch.int32)
                meta = vllm_metadata(H, HKV, D, sl, qsl, dtype, "vec")
                return lambda: vllm_kernel(q[:rows], cache, qsl, sl, block_table, D ** -0.5, meta, out[:rows])

            mask, fix = tree.ancestor_mask(), fix_rows_for(tree.parents)
            decode = _time(kernel(1), args.repeats) * LAYERS * 1e3
            chain = _time(kernel(t), args.repeats) * LAYERS * 1e3
            fixt = 0.0
            if fix:  # as in the engine: the plan once per step, the attention once per layer
                plan = tree_rows_plan(block_table[0], seq, t, mask, fix, BS)
                fixt = (_time(lambda: tree_rows_plan(block_table[0], seq, t, mask, fix, BS), args.repeats)
                        + _time(lambda: tree_rows_attention(q, cache, block_table[0], seq, t, mask, fix, D ** -0.5,
                                                            plan=plan), args.repeats) * LAYERS) * 1e3
            r = {"context": ctx, "nodes": tree.num_nodes, "decode_ms": decode, "chain_ms": chain,
                 "tree_fix_ms": fixt, "tree_over_chain": (chain + fixt) / chain}
            rows_out.append(r)
            print(f"{ctx:>8} {tree.num_nodes:>4} {decode:>9.2f} {chain:>9.2f} {fixt:>9.2f} {r['tree_over_chain']:>10.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "threads": args.threads, "rows": rows_out}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
