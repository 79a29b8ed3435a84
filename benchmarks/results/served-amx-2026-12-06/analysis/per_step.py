"""Per step, from load traces (``benchmarks/load_trace.py``): each drafter call at 12 or more requests outside a drain
is D (the heads ran and drafted: draft tokens beyond the lookup drafts'), N (the heads ran and drafted nothing from
the heads; lookup drafts may have been taken) or S (the heads did not run); the share of each outcome after each.

    python per_step.py TRACE.jsonl ...
"""
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import load_trace as lt  # noqa: E402
for path in sys.argv[1:]:
    rows = lt.read(path)
    for li, lv in enumerate(lt.levels(rows)):
        calls = [r for r in lv if "n" in r and r["n"] >= 12 and not r.get("draining")]
        if len(calls) < 20: continue
        # per call outcome: R = heads ran & drafted from heads (drafted>lookup?), N = ran & nothing, S = skipped
        def o(r):
            if not r.get("heads_ran"): return "S"
            heads_toks = r.get("draft_tokens", 0) - r.get("lookup_tokens", 0)
            return "D" if heads_toks > 0 else "N"
        seq = [o(r) for r in calls]
        c = Counter(zip(seq, seq[1:]))
        def p(a):
            t = sum(v for (x, _), v in c.items() if x == a)
            return " ".join(f"{b}:{c[(a, b)]/t:.2f}" for b in "DNS") + f" (of {t})" if t else "-"
        print(f"{path.split('/')[-1]} L{li} {len(calls)} calls {Counter(seq)} | after N -> {p('N')} | after D -> {p('D')} | after S -> {p('S')}")
