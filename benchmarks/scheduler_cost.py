"""Cost of EntMTP's per-step bookkeeping: the entropy tracker update and the scheduler's tree choice, per step,
for a batch of requests (pure Python; no engine).

    python benchmarks/scheduler_cost.py [--batch-sizes 1,4,16,64] [--step-ms 90]

Per batch size: microseconds per step for ``EntropyTracker.update`` of every request, ``signals_batch`` and
``TreeScheduler.choose`` with the node budget (the default tree set, policy entropy), median of many steps with
random signals; and that time as a share of a decode step of ``--step-ms`` milliseconds (measure yours: a plain
decode step of SmolLM2-135M in vLLM on this 2-core CPU is about 90 ms at batch size 1, float32). The entropy
itself (one ``entropy_nats`` over the rows the verification already computed) is timed too, on float32 logits of
the target's vocabulary.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--step-ms", type=float, default=90.0, help="decode step time to compare with (ms)")
    ap.add_argument("--tree-set", default="default")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args(argv)

    from vllm_entmtp.config import EntMTPConfig
    from vllm_entmtp.entropy import EntropyTracker, entropy_nats
    from vllm_entmtp.scheduler import TreeScheduler
    from vllm_entmtp.trees import load_tree_set

    ts = load_tree_set(args.tree_set)
    policy = ts.schedule.signal if ts.schedule is not None else "entropy"
    opts = EntMTPConfig(policy=policy, tree_set=args.tree_set)
    rng = random.Random(0)
    print(f"tree set {ts.name}, policy {policy}; step of {args.step_ms} ms for the share")
    print(f"{'batch':>5} {'tracker+choice us':>18} {'share':>7} {'entropy_nats us':>16} {'share':>7}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        tracker, sched = EntropyTracker.from_config(opts), TreeScheduler.from_config(opts, ts)
        ids = [f"r{i}" for i in range(b)]
        logits = torch.randn(b, args.vocab)
        t_book, t_ent = [], []
        for _ in range(args.steps):
            ent, top1 = [rng.uniform(0, 3) for _ in ids], [[rng.random() for _ in range(ts.num_heads)] for _ in ids]
            acc = [rng.randint(0, 2) for _ in ids]
            t0 = time.perf_counter()
            entropy_nats(logits).tolist()
            t1 = time.perf_counter()
            for i, r in enumerate(ids):
                tracker.update(r, ent[i], top1[i], acc[i])
            sched.choose(ids, tracker.signals_batch(ids), sched.node_budget(b))
            t2 = time.perf_counter()
            t_ent.append(t1 - t0)
            t_book.append(t2 - t1)
        book, en = statistics.median(t_book) * 1e6, statistics.median(t_ent) * 1e6
        print(f"{b:>5} {book:>18.1f} {book / (args.step_ms * 1e3):>7.2%} {en:>16.1f} {en / (args.step_ms * 1e3):>7.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
