"""Run from the repository root with the venv's python: does the level kernel slow the target-like work that follows it? fake target after two levels, kernel vs torch."""
import random, statistics, time, torch
from vllm_entmtp.heads.hydra import load_hydra_heads
from vllm_entmtp.models import default_heads
from vllm_entmtp.proposer import HydraDrafter, _fused_blocks
from vllm_entmtp.fast_linear import onednn_kernel
dt = torch.bfloat16
heads = load_hydra_heads(default_heads()["hydra"], dtype=dt)
H, V = 576, 49152
table = torch.randn(V, H, dtype=dt) * 0.05
d = HydraDrafter(heads, lambda ids: table[ids], table, measure_kernels=True)
kw = [(w, b) for w, b, _ in _fused_blocks(heads)]
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
layers = [onednn_kernel(torch.randn(n, k, dtype=dt) * 0.02, None) for _ in range(30) for k, n in shapes]
lm = onednn_kernel(table, None)
xs = {k: torch.randn(2, k, dtype=dt) for k, _ in shapes}
def fake_target():
    for i, f in enumerate(layers):
        f(xs[shapes[i % 4][0]])
    lm(xs[576]).argmax(-1).tolist()
hidden = torch.randn(1, H, dtype=dt)
res = {"kernel": [], "torch": []}
lv = {"kernel": [], "torch": []}
with torch.inference_mode():
    for _ in range(3): fake_target()
    for it in range(300):
        for path in random.sample(["kernel", "torch"], 2):
            d.level_weights = kw if path == "kernel" else None
            t0 = time.perf_counter()
            toks, _ = d._level(0, hidden, torch.tensor([[5]]), 1, False)
            d._level(1, hidden, torch.tensor([[5, toks[0][0]]]), 1, False)
            t1 = time.perf_counter()
            fake_target()
            t2 = time.perf_counter()
            lv[path].append(t1 - t0); res[path].append(t2 - t1)
for p in res:
    print(p, "two levels %.3f ms" % (1e3 * statistics.median(lv[p])), "target after %.3f ms" % (1e3 * statistics.median(res[p])))
