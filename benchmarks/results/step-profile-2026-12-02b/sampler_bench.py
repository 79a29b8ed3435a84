"""vLLM 0.32's ``RejectionSampler.forward`` against entmtp's all-greedy fast path (vllm_entmtp/patches/sampler.py)
on all-greedy batches of 16 requests, 49,152-token vocabulary, one thread; median of 40 calls.

Run from the repository root: ``.venv/bin/python benchmarks/results/step-profile-2026-12-02b/sampler_bench.py``
(it builds its batches with the helpers of ``tests/test_patches_sampler.py``).
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_patches_sampler import _greedy_batch, _samplers, _sampling_metadata  # noqa: E402


def median_ms(fn, repeats: int = 40) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    vllms, fast = _samplers()
    sm = _sampling_metadata()
    for n in (1, 2, 5):
        meta, logits = _greedy_batch([n] * 16, vocab=49152)
        ms = {name: median_ms(lambda s=s: s(meta, None, logits, sm)) for name, s in (("vllm", vllms), ("fast", fast))}
        print(f"16 requests x {n} draft tokens ({logits.shape[0]} rows): vLLM {ms['vllm']:.2f} ms, "
              f"fast path {ms['fast']:.2f} ms")


if __name__ == "__main__":
    main()
