"""Where a served level's engine time went, from vLLM's per-iteration log lines (``--enable-logging-iteration-details``;
parsed by ``benchmarks/iteration_times.py``; the lines of each server log are kept in ``iterations/``, gzipped): per
log, the iterations from the level's first step with prompt tokens before its first batch of ``--requests`` (the
warm-up requests before it left out) to the log's end (a server that served two tasks' levels counts both), summed
by kind: steps with prompt tokens, decode steps, and the decode steps of at least ``--requests - 4`` requests with
their generation tokens (scheduled: one a request plus its draft tokens). An iteration's time is the workers' (the
engine core waits for them), not the engine core's own scheduling.

    PYTHONPATH=benchmarks python level_split.py iterations/served-c32-96-requests-*.txt.gz --requests 32
"""
import argparse
import gzip
from pathlib import Path

from iteration_times import parse_iterations

ap = argparse.ArgumentParser()
ap.add_argument("logs", nargs="+")
ap.add_argument("--requests", type=int, default=32)
a = ap.parse_args()
print("| log | steps | engine s | prompt steps | prompt s | decode steps | decode s | decode ms/step | "
      f"decode steps of >= {a.requests - 4} requests | their ms/step | their generation tokens/step |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for log in a.logs:
    text = gzip.open(log, "rt").read() if log.endswith(".gz") else Path(log).read_text()
    its = parse_iterations(text.splitlines())
    start = next(i for i, it in enumerate(its) if it["gen_requests"] + it["ctx_requests"] >= a.requests)
    while start > 0 and its[start - 1]["ctx_tokens"] > 0:
        start -= 1
    lv = its[start:]
    pr = [it for it in lv if it["ctx_tokens"] > 0]
    de = [it for it in lv if it["ctx_tokens"] == 0]
    full = [it for it in de if it["gen_requests"] >= a.requests - 4]

    def s(xs):
        return sum(x["ms"] for x in xs)

    print(f"| {Path(log).name.split('.')[0]} | {len(lv)} | {s(lv) / 1e3:.2f} | {len(pr)} | {s(pr) / 1e3:.2f} | "
          f"{len(de)} | {s(de) / 1e3:.2f} | {s(de) / max(len(de), 1):.1f} | {len(full)} | "
          f"{s(full) / max(len(full), 1):.1f} | {sum(x['gen_tokens'] for x in full) / max(len(full), 1):.1f} |")
