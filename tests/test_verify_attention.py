"""vllm_entmtp/verify_attention.py: the kernel for requests that verify draft tokens, against vLLM's CPU kernel."""
from __future__ import annotations

import types

import pytest
import torch

from vllm_entmtp import cpp_build
from vllm_entmtp import verify_attention as va

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel():
    if not va.load(torch.float32):
        pytest.skip(f"the verification kernel does not serve this machine: {va.why_not()}")
    return va.kernel()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_equals_vllms_within_rounding(kernel, dtype):
    # contexts on and around block edges (128), row counts from 1 to MAX_ROWS, blocks out of order
    contexts = [0, 1, 15, 127, 128, 129, 255, 300, 1000]
    rows = [2, 3, 1, 16, 4, 2, 8, 5, 7]
    batch = va.random_batch(dtype, contexts, rows, seed=1)
    ours, vllms = va.multirow(*batch, 0.1).float(), va.reference(*batch, 0.1).float()
    assert ours.shape == vllms.shape
    assert (ours - vllms).abs().max().item() <= va.TOLERANCE[dtype]
    # and not by accident: another scale gives other outputs
    assert (va.multirow(*batch, 0.3).float() - vllms).abs().max().item() > 10 * va.TOLERANCE[dtype]


def test_each_row_sees_its_own_prefix_only(kernel):
    # one request of 4 rows: row i must equal a request of i + 1 rows over the same cache (causal), to rounding
    query, cache, qsl, seq, table = va.random_batch(torch.float32, [200], [4], seed=2)
    full = va.multirow(query, cache, qsl, seq, table, 0.125)
    for i in range(4):
        part = va.multirow(query[:i + 1].contiguous(), cache, torch.tensor([0, i + 1], dtype=torch.int32),
                           torch.tensor([200 + i + 1], dtype=torch.int32), table, 0.125)
        assert (part[i] - full[i]).abs().max().item() <= 1e-6
    assert (full[0] - full[3]).abs().max().item() > 1e-3


def test_head_dim_128_and_other_head_counts(kernel):
    batch = va.random_batch(torch.float32, [50, 400], [3, 2], heads=8, kv_heads=2, head_dim=128, seed=3)
    assert (va.multirow(*batch, 0.09) - va.reference(*batch, 0.09)).abs().max().item() <= 1e-4


def _metadata(qsl, seq_lens, table, causal=True):
    return types.SimpleNamespace(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
                                 causal=causal, dynamic_causal=None, num_actual_tokens=qsl[-1])


def test_a_step_is_split_by_rows_and_mixed_steps_compute_both_parts(kernel):
    dtype = torch.float32
    contexts, rows = [300, 40, 129, 600, 64], [1, 3, 1, 17, 2]  # 17 rows: a prompt chunk, vLLM's kernel
    query, cache, qsl, seq, table = va.random_batch(dtype, contexts, rows, seed=4)
    impl = types.SimpleNamespace(num_heads=9, num_kv_heads=3, head_size=64, kv_cache_dtype="auto", scale=0.125)
    md = _metadata(qsl.tolist(), seq.tolist(), table)
    split = va.plan(md, impl, "vec", dtype)
    q = qsl.tolist()
    assert split.reqs_m.tolist() == [0, 1, 2, 4]  # the requests of one row join those verifying drafts
    assert split.rows_v.tolist() == list(range(q[3], q[4])) and split.qsl_v.tolist() == [0, 17]
    assert split.seq_v.tolist() == [617] and torch.equal(split.table_v, table[[3]])
    layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, isa="vec")
    out = torch.full_like(query, float("nan"))
    va.forward(impl, layer, query, cache, split, out, int(qsl[-1]))
    whole = va.reference(query, cache, qsl, seq, table, 0.125)
    assert not out.isnan().any()
    assert (out - whole).abs().max().item() <= 1e-4
    # the long chunk is vLLM's kernel's own result on its rows
    assert torch.equal(out[split.rows_v], va.reference(query[split.rows_v].contiguous(), cache, split.qsl_v,
                                                       split.seq_v, split.table_v, 0.125))


def test_only_requests_that_verify_draft_tokens_take_the_kernel(kernel):
    # a prompt chunk of 3 tokens has as many rows as a request verifying 2 draft tokens: only the step's own record
    # of which requests verify draft tokens tells them apart
    impl = types.SimpleNamespace(num_heads=9, num_kv_heads=3, head_size=64, kv_cache_dtype="auto")
    table = torch.zeros(3, 4, dtype=torch.int32)
    md = _metadata([0, 3, 4, 7], [3, 20, 30], table)  # a new prompt of 3 tokens, one decode, one verifying 2
    split = va.plan(md, impl, "vec", torch.float32, verifying={2})
    # the one decoding joins the one verifying; the 3-token prompt stays on vLLM's
    assert split.reqs_m.tolist() == [1, 2]
    assert split.rows_v.tolist() == [0, 1, 2] and split.qsl_v.tolist() == [0, 3]
    assert va.plan(md, impl, "vec", torch.float32, verifying=set()) is None  # nobody verifies: vLLM's alone
    assert va.plan(md, impl, "vec", torch.float32).reqs_m.tolist() == [0, 1, 2]  # by rows alone
    md = _metadata([0, 1, 2, 3], [10, 20, 30], table)
    assert va.plan(md, impl, "vec", torch.float32, verifying={1}) is None  # a verifying request of one row: none


def test_steps_the_kernel_leaves_to_vllm(kernel):
    impl = types.SimpleNamespace(num_heads=9, num_kv_heads=3, head_size=64, kv_cache_dtype="auto")
    table = torch.zeros(3, 4, dtype=torch.int32)
    assert va.plan(_metadata([0, 1, 2, 3], [10, 20, 30], table), impl, "vec", torch.float32) is None  # one row each
    assert va.plan(_metadata([0, 1, 40, 41], [10, 60, 30], table), impl, "vec", torch.float32) is None  # a prompt
    assert va.plan(_metadata([0, 2, 3, 4], [10, 20, 30], table, causal=False), impl, "vec", torch.float32) is None
    split = va.plan(_metadata([0, 2, 5], [10, 20], table[:2]), impl, "vec", torch.float32)
    assert split.rows_v is None and split.reqs_m.tolist() == [0, 1]  # everyone verifies drafts


def test_a_layer_the_kernel_cannot_serve(kernel):
    impl = types.SimpleNamespace(alibi_slopes=None, sliding_window=-1, logits_soft_cap=0, sinks=None,
                                 kv_cache_dtype="auto", head_size=64)
    layer = types.SimpleNamespace(isa="vec")
    cache = torch.zeros(2, 3, 128, 128)
    assert not va.serves(impl, layer, cache)  # no engine turned it on for this layer
    va.use([impl], True)
    assert va.serves(impl, layer, cache)
    other = types.SimpleNamespace(**vars(impl))
    va.use([other], False)  # another engine's layers, verify_attention 'vllm': this one's stay on
    assert va.serves(impl, layer, cache) and not va.serves(other, layer, cache)
    assert not va.serves(impl, types.SimpleNamespace(isa="neon"), cache)  # a layout the kernel does not read
    assert not va.serves(impl, types.SimpleNamespace(isa="amx"), cache)  # 'amx' holds bfloat16 only
    assert va.serves(impl, types.SimpleNamespace(isa="amx"), cache.to(torch.bfloat16))
    assert not va.serves(impl, types.SimpleNamespace(isa="amx"), torch.zeros(2, 3, 48, 128, dtype=torch.bfloat16))
    for key, value in (("sliding_window", 256), ("logits_soft_cap", 30.0), ("kv_cache_dtype", "fp8"),
                       ("head_size", 80)):
        assert not va.serves(types.SimpleNamespace(**{**vars(impl), key: value}), layer, cache), key
    assert not va.serves(impl, layer, cache.transpose(0, 1))  # not contiguous


def test_what_fixes_a_layer_to_vllms_kernel_is_named_at_start_up():
    impl = types.SimpleNamespace(alibi_slopes=None, sliding_window=-1, logits_soft_cap=0, sinks=None,
                                 kv_cache_dtype="auto", head_size=64)
    assert va.layer_limits(impl, "vec", 128) is None
    assert va.layer_limits(impl, "amx", 128) is None
    assert "'neon', not one of vec, amx" in va.layer_limits(impl, "neon", 128)
    assert "block size 40" in va.layer_limits(impl, "vec", 40)
    assert va.layer_limits(impl, "vec", 48) is None and "multiple of 32 only on 'amx'" in va.layer_limits(impl, "amx", 48)
    for key, value, words in (("head_size", 96, "head size 96"), ("kv_cache_dtype", "fp8_e4m3", "fp8_e4m3"),
                              ("sliding_window", 512, "sliding window"), ("logits_soft_cap", 30.0, "soft-capping"),
                              ("alibi_slopes", torch.ones(9), "ALiBi"), ("sinks", torch.ones(9), "sinks")):
        assert words in va.layer_limits(types.SimpleNamespace(**{**vars(impl), key: value}), "vec", 128), key


def test_rows_are_read_and_written_in_place_with_strides(kernel):
    # the layer's query is a view into a wider tensor (q of a fused qkv projection): rows strided, not copied
    query, cache, qsl, seq, table = va.random_batch(torch.float32, [30, 200, 90], [2, 1, 3], seed=5)
    wide = torch.randn(query.shape[0], 15, 64)
    wide[:, :9] = query
    view = wide[:, :9]
    assert not view.is_contiguous()
    out = torch.full((query.shape[0], 9, 64), 7.0)
    va.multirow(view, cache, qsl, seq, table, 0.125, reqs=torch.tensor([0, 2], dtype=torch.int32), out=out)
    whole = va.reference(query, cache, qsl, seq, table, 0.125)
    assert (out[0:2] - whole[0:2]).abs().max().item() <= 1e-5 and (out[3:6] - whole[3:6]).abs().max() <= 1e-5
    assert torch.equal(out[2], torch.full((9, 64), 7.0))  # request 1 was not asked for


def test_a_kernel_that_disagrees_with_vllms_is_not_used(kernel, monkeypatch):
    monkeypatch.setattr(va, "TOLERANCE", {torch.float32: -1.0, torch.bfloat16: -1.0})
    assert "differed from vLLM's kernel" in va.self_check(torch.float32)


@pytest.fixture(scope="module")
def amx_kernel():
    if va.layout(torch.bfloat16) != "amx":
        pytest.skip("vLLM's CPU attention does not use the 'amx' layout on this machine (no AMX)")
    if not va.load(torch.bfloat16):
        pytest.skip(f"the verification kernel does not serve this machine: {va.why_not()}")
    return va.kernel("amx")


def test_the_amx_layout_kernel_equals_vllms_within_rounding(amx_kernel):
    # contexts on and around block edges (128) and the layout's groups of 16 and 32 tokens, odd token counts, and
    # requests of more than 16 query vectors (6 rows x 3 query heads: two tile passes)
    contexts = [0, 1, 15, 31, 33, 127, 128, 129, 255, 300, 1000]
    rows = [2, 3, 1, 16, 4, 2, 8, 5, 7, 6, 2]
    batch = va.random_batch(torch.bfloat16, contexts, rows, seed=11, isa="amx")
    ours, vllms = va.multirow(*batch, 0.1, isa="amx").float(), va.reference(*batch, 0.1, isa="amx").float()
    assert not ours.isnan().any()
    assert (ours - vllms).abs().max().item() <= va.TOLERANCE[torch.bfloat16]
    assert (va.multirow(*batch, 0.3, isa="amx").float() - vllms).abs().max().item() > 10 * va.TOLERANCE[torch.bfloat16]
    wide = va.random_batch(torch.bfloat16, [50, 400], [3, 2], heads=8, kv_heads=2, head_dim=128, seed=12, isa="amx")
    diff = va.multirow(*wide, 0.09, isa="amx").float() - va.reference(*wide, 0.09, isa="amx").float()
    assert diff.abs().max().item() <= va.TOLERANCE[torch.bfloat16]


def test_the_amx_layout_kernel_sees_each_rows_own_prefix_only(amx_kernel):
    query, cache, qsl, seq, table = va.random_batch(torch.bfloat16, [200], [6], seed=13, isa="amx")
    full = va.multirow(query, cache, qsl, seq, table, 0.125, isa="amx")
    for i in range(6):
        part = va.multirow(query[:i + 1].contiguous(), cache, torch.tensor([0, i + 1], dtype=torch.int32),
                           torch.tensor([200 + i + 1], dtype=torch.int32), table, 0.125, isa="amx")
        assert torch.equal(part[i], full[i])  # the same sums in the same order: the same bits
    assert (full[0].float() - full[5].float()).abs().max().item() > 1e-2


def test_the_amx_layout_kernel_refuses_what_the_layout_cannot_hold(amx_kernel):
    query, cache, qsl, seq, table = va.random_batch(torch.bfloat16, [40], [2], seed=14, isa="amx")
    with pytest.raises(RuntimeError, match="bfloat16"):
        va.multirow(query.float(), cache.float(), qsl, seq, table, 0.125, isa="amx")
    odd = torch.zeros(cache.shape[0], cache.shape[1], 48, cache.shape[3], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        va.multirow(query, odd, qsl, seq, table, 0.125, isa="amx")


@pytest.mark.skipif(cpp_build.isa() != "avx512" or cpp_build.toolchain_missing() is not None,
                    reason="the AVX2 build is the kernel of this machine (the tests above check it), or none builds")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_avx2_build_equals_vllms_kernel_on_an_avx512_cpu(dtype):
    # CPUs with AVX-512 run AVX2 code too: the build AVX2-only CPUs take is checked here on the 'vec' layout
    mod = cpp_build.build(va.NAME, va.SOURCE, "avx2")
    assert not hasattr(mod, "multirow_attention_amx")  # AMX tiles need AVX-512: that path is the AVX-512 build's
    for head_dim, heads, kv_heads in ((64, 9, 3), (128, 8, 2)):
        query, cache, qsl, seq, table = va.random_batch(dtype, [0, 15, 129, 300, 1000], [2, 1, 16, 5, 3],
                                                        heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=7)
        out = torch.empty_like(query)
        reqs = torch.arange(len(seq), dtype=torch.int32)
        mod.multirow_attention(query, cache.view(*cache.shape[:2], -1), qsl, seq, table, reqs, 0.1, out)
        vllms = va.reference(query, cache, qsl, seq, table, 0.1).float()
        assert (out.float() - vllms).abs().max().item() <= va.TOLERANCE[dtype]
