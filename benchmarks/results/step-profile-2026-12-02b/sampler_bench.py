"""The rejection sampler on all-greedy batches of 16 requests (49,152-token vocabulary, one thread): vLLM 0.32's forward
against entmtp's fast path (vllm_entmtp/patches/sampler.py). Run: .venv/bin/python benchmarks/results/step-profile-2026-12-02b/sampler_bench.py"""
import time, torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm_entmtp.patches import apply_all
apply_all()
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm_entmtp.patches.sampler import GREEDY_FAST_PATH_ATTR
from test_patches_sampler import _greedy_batch, _sampling_metadata
torch.set_num_threads(1)
sm = _sampling_metadata()
for nd in ([1]*16, [2]*16 , [5]*16):
    meta, logits, _ = _greedy_batch(nd, vocab=49152)
    res = {}
    for name, fast in (("vllm", False), ("fast", True)):
        rs = RejectionSampler(Sampler()); setattr(rs, GREEDY_FAST_PATH_ATTR, fast)
        for _ in range(5): rs(meta, None, logits, sm)
        ts = []
        for _ in range(40):
            t = time.perf_counter(); rs(meta, None, logits, sm); ts.append(time.perf_counter() - t)
        ts.sort(); res[name] = ts[len(ts)//2] * 1e3
    print(f"16 requests x {nd[0]} draft tokens ({logits.shape[0]} rows): vLLM {res['vllm']:.2f} ms, fast path {res['fast']:.2f} ms")
