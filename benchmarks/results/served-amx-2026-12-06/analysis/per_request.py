"""Per request, from load traces (``benchmarks/load_trace.py``, with ``heads_rows`` / ``heads_drafted``): after a step
whose schedule's choice ran for a request and that did not draft from the heads for it (no draft, or its lookup chain),
how often its next step's choice drafted from the heads; likewise after one that did. Consecutive drafter calls only.

    python per_request.py TRACE.jsonl ...
"""
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import load_trace as lt  # noqa: E402
for path in sys.argv[1:]:
    rows = lt.read(path)
    for li, lv in enumerate(lt.levels(rows)):
        calls = [r for r in lv if "n" in r]
        if len(calls) < 20: continue
        hist = defaultdict(list)  # rid -> list of (call index, ran, drafted)
        for ci, r in enumerate(calls):
            hr = set(r.get("heads_rows", [])); hd = set(r.get("heads_drafted", []))
            for rid in hr:
                hist[rid].append((ci, rid in hd))
        pairs = defaultdict(int)
        for rid, h in hist.items():
            for (c0, d0), (c1, d1) in zip(h, h[1:]):
                if c1 == c0 + 1:
                    pairs[(d0, d1)] += 1
        ran = sum(1 for r in calls if r.get("heads_ran"))
        ran_none = sum(1 for r in calls if r.get("heads_ran") and not r.get("heads_drafted"))
        nrows = sum(len(r.get("heads_rows", [])) for r in calls)
        ndr = sum(len(r.get("heads_drafted", [])) for r in calls)
        n = [r["n"] for r in calls]
        def p(a, b):
            t = pairs[(a, True)] + pairs[(a, False)]
            return f"{pairs[(a, b)] / t:.2f} of {t}" if t else "-"
        print(f"{path.split('/')[-1]} level {li}: calls {len(calls)} (n median {sorted(n)[len(n)//2]}), heads ran {ran}, "
              f"ran+nothing {ran_none}, rows {nrows}, heads-drafted rows {ndr}; "
              f"P(draft|prev none) {p(False, True)}, P(draft|prev draft) {p(True, True)}")
