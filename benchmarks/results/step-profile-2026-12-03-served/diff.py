"""Compare py-spy raw profiles (collapsed stacks): inclusive samples per function, per step."""
import re, sys, collections
def load(path):
    incl = collections.Counter(); total = 0
    for line in open(path):
        line = line.rstrip()
        if not line: continue
        stack, _, n = line.rpartition(' ')
        n = int(n); total += n
        seen = set()
        for fr in stack.split(';'):
            key = re.sub(r':\d+\)', ')', fr)  # the frame without its line number
            if key not in seen:
                seen.add(key); incl[key] += n
    return incl, total
a, b = sys.argv[1], sys.argv[2]   # name prefixes, e.g. /tmp/prof/plain /tmp/prof/entmtp
for part in ('ec', 'wk'):
    ia, ta = load(f'{a}.{part}.txt'); ib, tb = load(f'{b}.{part}.txt')
    print(f'== {part}: samples {ta} vs {tb}')
    keys = set(ia) | set(ib)
    rows = sorted(keys, key=lambda k: -(ib[k] - ia[k]))
    for k in rows[:40]:
        print(f'{ia[k]:7d} {ib[k]:7d} {ib[k]-ia[k]:+7d}  {k[:160]}')
