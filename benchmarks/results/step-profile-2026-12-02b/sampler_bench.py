"""vLLM 0.32's ``RejectionSampler.forward`` against entmtp's all-greedy fast path (vllm_entmtp/patches/sampler.py)
on all-greedy batches of 16 requests, 49,152-token vocabulary, one thread; median of 40 calls.

Run from the repository root: ``.venv/bin/python benchmarks/results/step-profile-2026-12-02b/sampler_bench.py``
(it builds its batches with the helpers of ``tests/test_patches_sampler.py``).
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from test_patches_sampler import _greedy_batch, _samplers, _sampling_metadata  # noqa: E402
from verify_cost import _time  # noqa: E402


def median_ms(fn, repeats: int = 40) -> float:
    for _ in range(4):  # warm-up (one more in _time)
        fn()
    return _time(fn, repeats) * 1e3


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
