import re, sys, statistics, collections
pat = re.compile(r'Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms')
for path in sys.argv[1:]:
    g = collections.defaultdict(list)
    for line in open(path):
        m = pat.search(line)
        if not m: continue
        _, cr, ct, gr, gt, ms = m.groups()
        if int(cr): continue
        gr, gt = int(gr), int(gt)
        g[(gr, 'nodraft' if gt == gr else 'draft')].append(float(ms))
    print(path)
    for k in sorted(g):
        v = g[k]
        if len(v) >= 5:
            print(f'  B={k[0]:3d} {k[1]:8s} n={len(v):5d} median={statistics.median(v):7.2f} mean={statistics.mean(v):7.2f}')
