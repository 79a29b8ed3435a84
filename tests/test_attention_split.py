"""benchmarks/attention_split.py: a step's layout, and its three ways of splitting the kernels compute the same
attention (the timing itself is a benchmark's)."""
import pytest
import torch
from conftest import load_benchmark

from vllm_entmtp import verify_attention as va

sp = load_benchmark("attention_split")


def test_the_first_requests_verify_and_the_rest_decode():
    assert sp.step_rows(4, 1) == [2, 1, 1, 1]
    assert sp.step_rows(3, 0) == [1, 1, 1] and sp.step_rows(2, 2) == [2, 2]
    with pytest.raises(ValueError, match="verifying <= requests"):
        sp.step_rows(2, 3)


def test_the_three_ways_compute_the_same_attention():
    if not va.load(torch.float32):
        pytest.skip(f"the verification kernel does not serve this machine: {va.why_not()}")
    step = sp.make_step(torch, va, "vec", torch.float32, heads=9, kv_heads=3, head_dim=64, layers=2,
                        requests=5, verifying=2, context=150)
    assert set(step["ways"]) == {"vllm", "split", "entmtp"}
    for run in step["ways"].values():
        run()
    out = step["out"]
    assert (out["split"] - out["vllm"]).abs().max().item() <= 1e-4
    assert (out["entmtp"] - out["vllm"]).abs().max().item() <= 1e-4
    assert not torch.equal(out["entmtp"], out["split"])  # the one-row requests ran another kernel
    only_vllm = sp.make_step(torch, va, "vec", torch.float32, heads=9, kv_heads=3, head_dim=64, layers=1,
                             requests=3, verifying=0, context=40)
    assert set(only_vllm["ways"]) == {"vllm"}  # a step without drafts runs vLLM's kernel alone
