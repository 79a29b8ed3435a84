"""The one-call Hydra level kernel (vllm_entmtp/hydra_kernel.py, kernels/hydra_level.cpp) and the kernels' build
helper (vllm_entmtp/cpp_build.py)."""
import os
import time

import pytest
import torch

from vllm_entmtp import cpp_build, hydra_kernel
from vllm_entmtp.trees import Tree


@pytest.fixture(scope="module")
def kernel():
    if cpp_build.toolchain_missing() is not None:
        pytest.skip(f"the kernel cannot be built here: {cpp_build.toolchain_missing()}")
    assert hydra_kernel.load(torch.float32), hydra_kernel.why_not()
    assert hydra_kernel.load(torch.bfloat16), hydra_kernel.why_not()
    return hydra_kernel


@pytest.mark.parametrize("dtype,hidden_size", [(torch.float32, 80), (torch.bfloat16, 80), (torch.bfloat16, 64)])
def test_a_level_gives_the_reference_topk_and_top1_probability(kernel, dtype, hidden_size):
    # in bfloat16 a product over a multiple of 32 features takes 32 a step (AVX512-BF16, where the CPU has it), others
    # 16 a step: hidden 80, the lm_head 16 a step and the block 32; hidden 64, both 32 a step. 301 draft-vocabulary
    # rows: groups of 4 rows and a tail of 1
    for n in range(1, kernel.MAX_ROWS + 1):
        for depth in (1, 3):
            for mapped in (True, False):
                hidden, emb, wb, bb, wl, ids = kernel.random_level(dtype, n, depth, hidden=hidden_size, vocab=500,
                                                                    draft_vocab=301, seed=10 * n + depth)
                ids = ids if mapped else None
                toks, p1 = kernel.level(hidden, emb, wb, bb, wl, ids, 5, True)
                ref_toks, ref_p1 = kernel.reference(hidden, emb, wb, bb, wl, ids, 5)
                assert toks == ref_toks, (n, depth, mapped)
                assert p1 == pytest.approx(ref_p1, rel=1e-4, abs=1e-6)
                assert all(0 <= t < 500 for row in toks for t in row)
                top1, none = kernel.level(hidden, emb, wb, bb, wl, ids, 1, False)
                assert top1 == [t[:1] for t in ref_toks] and none is None


def test_bad_arguments_are_refused_by_name(kernel):
    args = kernel.random_level(torch.float32, 2, 1, hidden=32, vocab=50, draft_vocab=40)
    hidden, emb, wb, bb, wl, ids = args
    with pytest.raises(RuntimeError, match="N in 1..4"):
        kernel.level(torch.zeros(5, 32), torch.zeros(5, 1, 32), wb, bb, wl, ids, 2, True)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.level(hidden.bfloat16(), emb.bfloat16(), wb, bb, wl, ids, 2, True)
    with pytest.raises(RuntimeError, match="w_block"):
        kernel.level(hidden, torch.zeros(2, 2, 32), wb, bb, wl, ids, 2, True)
    with pytest.raises(RuntimeError, match="topk"):
        kernel.level(hidden, emb, wb, bb, wl, ids, 41, True)
    with pytest.raises(RuntimeError, match="token_ids"):
        kernel.level(hidden, emb, wb, bb, wl, ids[:5], 2, True)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.level(torch.zeros(1, 24), torch.zeros(1, 1, 24), torch.zeros(48, 48), torch.zeros(48),
                     torch.zeros(10, 24), None, 2, True)


def test_the_server_drafter_takes_the_kernel_for_few_paths_and_drafts_what_torchs_path_drafts(kernel):
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig
    from vllm_entmtp.proposer import HydraDrafter, _fused_blocks

    torch.manual_seed(0)
    heads = HydraHeads(HydraHeadsConfig(hidden_size=64, vocab_size=200, hydra_num_heads=3, truncated_vocab_size=150))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    heads.token_map.copy_(torch.randperm(200)[:150].sort().values)
    w, e = torch.randn(200, 64), torch.randn(200, 64)
    fast = HydraDrafter(heads, lambda ids: e[ids], w, measure_kernels=True)
    assert set(fast.level_timings) == {"kernel", "torch"}  # it took the faster; here it is made to take the kernel
    fast.level_weights = [(wb, bb) for wb, bb, _ in _fused_blocks(heads)]
    for lin in [b for b, _ in fast.blocks] + fast.lm:  # levels of more paths: float32 products, as the heads'
        lin.small = lin.large = "torch"
    assert "the plugin's kernel" in fast.describe_kernels()
    plain = HydraDrafter(heads, lambda ids: e[ids], w)  # the heads' own modules
    calls = []
    real = hydra_kernel.level
    x, bonus = torch.randn(6, 64), torch.randint(0, 200, (6,))
    tree = Tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    try:
        hydra_kernel.level = lambda *a: calls.append(a[0].shape[0]) or real(*a)
        for rows in (x[:1], x[:4], x):  # 1 and 4 paths a level: the kernel; 6: torch's path
            n = rows.shape[0]
            calls.clear()
            assert fast.propose(rows, [tree] * n, bonus[:n]) == plain.propose(rows, [tree] * n, bonus[:n])
            probs, _ = fast.confidence(rows, bonus[:n])
            torch.testing.assert_close(probs, plain.confidence(rows, bonus[:n])[0], rtol=1e-4, atol=1e-6)
            assert (calls != []) == (n <= hydra_kernel.MAX_ROWS)
    finally:
        hydra_kernel.level = real


def test_the_kernel_can_be_turned_off_and_a_dtype_it_does_not_take_is_named(monkeypatch):
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig
    from vllm_entmtp.proposer import make_drafter

    heads = HydraHeads(HydraHeadsConfig(hidden_size=32, vocab_size=40, hydra_num_heads=2))
    w = torch.randn(40, 32)
    off = make_drafter(heads, embed=lambda ids: w[ids], lm_head_weight=w, compute_logits=None, level_kernel=False)
    assert off.level_weights is None and off.level_timings == {}
    assert off.describe_kernels().endswith("levels by torch's operators (option heads_kernel 'torch')")
    monkeypatch.setattr(hydra_kernel.KERNEL, "reason", hydra_kernel.KERNEL.reason)  # restored after
    assert not hydra_kernel.load(torch.float16)
    assert hydra_kernel.why_not() == "dtype torch.float16 (float32 and bfloat16 only)"


def test_a_build_lock_left_by_a_killed_start_is_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    cpp_build.clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running right now
    old = time.time() - cpp_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpp_build.clear_stale_lock(tmp_path)
    assert not lock.exists()
    cpp_build.clear_stale_lock(tmp_path / "missing")  # nothing to do, no error


def test_the_level_benchmark_times_both_paths_on_the_shipped_heads(kernel, tmp_path):
    import importlib.util
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))  # it imports gemm_rows' helpers
    try:
        spec = importlib.util.spec_from_file_location("hydra_level", bench / "hydra_level.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out = tmp_path / "level.json"
        assert mod.main(["--rows", "1,3", "--repeats", "1", "--flush-mb", "1", "--dtype", "float32",
                         "--out", str(out)]) == 0
    finally:
        sys.path.remove(str(bench))
    rows = json.loads(out.read_text())["median_ms"]
    assert {(r["paths"], r["probs"], r["path"]) for r in rows} == {
        (n, p, path) for n in (1, 3) for p in (False, True) for path in ("kernel", "torch")}
    assert all(r["ms"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        mod.main(["--rows", "5"])  # more paths than the kernel takes


def test_a_dtype_that_fails_its_check_leaves_the_module_another_dtype_passed_with(monkeypatch):
    built = []
    monkeypatch.setattr(cpp_build, "build", lambda name, source: built.append(name) or object())
    k = cpp_build.BuiltKernel("k", "k.cpp", lambda dtype: None,
                              lambda dtype: None if dtype == torch.float32 else "sums differ", "torch's operators")
    assert not k.load(torch.bfloat16) and k.module is None and k.reason == "sums differ"  # nothing passed yet
    assert k.load(torch.float32) and k.module is not None and k.reason == ""
    module = k.module
    assert not k.load(torch.bfloat16) and k.module is module and k.reason == "sums differ"
    assert k.load(torch.float32) and built == ["k", "k"]  # built again after the first failure only


def test_the_start_up_log_says_why_heads_do_not_take_the_kernel():
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig
    from vllm_entmtp.proposer import HydraDrafter

    heads = HydraHeads(HydraHeadsConfig(hidden_size=8, vocab_size=12, hydra_num_heads=2))
    w = torch.randn(12, 8)
    drafter = HydraDrafter(heads, lambda ids: w[ids], w, measure_kernels=True)
    assert drafter.level_weights is None
    assert drafter.describe_kernels().endswith("levels by torch's operators (hidden size 8 (a multiple of 16 only))")


def test_the_kernels_isa_follows_the_cpu(monkeypatch):
    # AVX-512F first; AVX2 with FMA without it; neither: no kernel, and the reason names both
    flags = {"avx512": True, "avx2": True, "fma": True}
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: flags["avx512"])
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: flags["avx2"])
    monkeypatch.setattr(cpp_build, "_has_fma", lambda: flags["fma"])
    assert cpp_build.isa() == "avx512"
    flags["avx512"] = False
    assert cpp_build.isa() == "avx2"
    flags["fma"] = False
    assert cpp_build.isa() is None
    assert cpp_build.toolchain_missing() == "this CPU has neither AVX-512F nor AVX2 with FMA"
    with pytest.raises(RuntimeError, match="neither AVX-512F nor AVX2"):
        cpp_build.build(hydra_kernel.NAME, hydra_kernel.SOURCE)
    assert set(cpp_build.ISA_FLAGS) == {"avx512", "avx2"}


@pytest.mark.skipif(cpp_build.isa() != "avx512" or cpp_build.toolchain_missing() is not None,
                    reason="the AVX2 build is the kernel of this machine (the tests above check it), or none builds")
def test_the_avx2_build_gives_the_reference_level_on_an_avx512_cpu():
    # CPUs with AVX-512 run AVX2 code too: the build AVX2-only CPUs take is checked here as well
    mod = cpp_build.build(hydra_kernel.NAME, hydra_kernel.SOURCE, "avx2")
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 4):
            hidden, emb, wb, bb, wl, ids = hydra_kernel.random_level(dtype, n, 2, hidden=80, vocab=500,
                                                                     draft_vocab=301, seed=n)
            toks, p1 = mod.hydra_level(hidden, emb, wb, bb, wl, ids, 5, True)
            ref_toks, ref_p1 = hydra_kernel.reference(hidden, emb, wb, bb, wl, ids, 5)
            assert toks == ref_toks
            assert p1 == pytest.approx(ref_p1, rel=1e-4, abs=1e-6)
