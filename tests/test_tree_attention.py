"""Tree attention and KV compaction on vLLM's CPU paged-cache layout, against a dense reference."""
import pytest
import torch

from vllm_entmtp.trees import fix_rows_for
from vllm_entmtp.trees import Tree

ops = pytest.importorskip("vllm._custom_ops")

HKV, REP, D, BS = 3, 3, 64, 32  # SmolLM2's attention shape: 9 query heads, 3 KV heads, head size 64


def _cache(num_blocks):
    return torch.zeros(num_blocks, HKV, BS, 2 * D)


def _write(kv_cache, key, value, slots):
    nb = kv_cache.shape[0]
    kc, vc = kv_cache.view(nb, HKV, BS * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.tensor(slots, dtype=torch.long), "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def _dense(q, k, v, allowed, scale):
    """q [T, H, D], k/v [L, Hkv, D], allowed [T, L] -> [T, H, D]."""
    kh, vh = k.repeat_interleave(REP, 1), v.repeat_interleave(REP, 1)
    s = torch.einsum("thd,lhd->htl", q, kh) * scale
    s = s.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(s, -1), vh)


@pytest.mark.parametrize("ctx", [5, 31, 70])
def test_tree_rows_match_dense_attention_with_ancestor_mask(ctx):
    from vllm_entmtp.patches.tree_attention import tree_rows_attention

    torch.manual_seed(ctx)
    tree = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    parents = tree.parents
    assert parents == [0, 0, 1, 1, 2, 3]  # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6}
    t = len(parents) + 1
    seq_len = ctx + t
    blocks = torch.tensor([4, 1, 6, 2])  # a scattered block table
    slots = [int(blocks[p // BS]) * BS + p % BS for p in range(seq_len)]
    k, v = torch.randn(seq_len, HKV, D), torch.randn(seq_len, HKV, D)
    cache = _cache(8)
    _write(cache, k, v, slots)
    q = torch.randn(t, HKV * REP, D)
    mask = tree.ancestor_mask()
    rows = list(range(t))
    got = tree_rows_attention(q, cache, blocks, seq_len, t, mask, rows, scale=0.125)
    allowed = torch.zeros(t, seq_len, dtype=torch.bool)
    allowed[:, :ctx] = True
    allowed[:, ctx:] = mask
    torch.testing.assert_close(got, _dense(q, k, v, allowed, 0.125), rtol=1e-5, atol=1e-5)
    # a causal mask gives something else for rows that see siblings: the fix is needed exactly there
    causal = torch.ones(t, seq_len, dtype=torch.bool).tril(ctx)
    differs = [i for i in rows if not torch.allclose(got[i], _dense(q, k, v, causal, 0.125)[i], atol=1e-5)]
    assert differs == fix_rows_for(parents) == [2, 3, 4, 5, 6]


def test_ancestor_mask_and_fix_rows():
    mask = Tree([[0], [1], [0, 0]]).ancestor_mask()
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [True, False, True, False], [True, True, False, True]]
    assert fix_rows_for([0, 1, 2]) == []  # a chain: causal is already right
    assert fix_rows_for([0, 1, 0, 3]) == [3, 4]


def test_compaction_moves_accepted_path_into_consecutive_slots():
    from vllm_entmtp import step
    from vllm_entmtp.step import STEP, TreeRows

    torch.manual_seed(0)
    tree = Tree([[0], [1], [1, 0], [1, 1]])
    parents = tree.parents
    assert parents == [0, 0, 2, 2]  # accepted path 2 -> 4 (non-first branches)
    t, q0 = len(parents) + 1, 3  # this request's rows start at row 3 of the batch
    cache = _cache(2)
    key, value = torch.randn(q0 + t, HKV, D), torch.randn(q0 + t, HKV, D)
    slots = torch.arange(10, 10 + q0 + t)
    _write(cache, key, value, slots.tolist())

    class Layer:
        isa, _k_scale_float, _v_scale_float = "vec", 1.0, 1.0

    class Impl:
        kv_cache_dtype = "auto"

    tr = TreeRows(0, q0, [11, 12, 13, 14], parents, tree.ancestor_mask(), fix_rows_for(parents))
    STEP.reset({0: tr})
    STEP.kv["l0"] = (Layer, Impl, cache, key[q0:].clone(), value[q0:].clone(), slots[q0:].clone())
    step._compact_kv([(tr, [2, 4])])
    STEP.reset({})
    # read back: K is stored transposed per block ([D, BS]), V plain ([BS, D])
    mem = cache.view(2, HKV, 2, BS * D)

    def read(slot):
        b, o = divmod(slot, BS)
        return mem[b, :, 0].view(HKV, D, BS)[:, :, o], mem[b, :, 1].view(HKV, BS, D)[:, o, :]

    for k, node in ((1, 2), (2, 4)):
        got_k, got_v = read(int(slots[q0 + k]))
        torch.testing.assert_close(got_k, key[q0 + node])
        torch.testing.assert_close(got_v, value[q0 + node])
    root_k, _ = read(int(slots[q0]))
    torch.testing.assert_close(root_k, key[q0])  # the root stays


def test_sampled_chains_pass_any_kv_layout_and_branching_trees_are_refused_where_the_fix_cannot_run(monkeypatch):
    """On a CPU with AMX, bfloat16 KV uses vLLM's 'amx' layout, which the tree fix cannot read. The drafter drafts
    chains only there, but sampled chains are verified by this project (rejection sampling), so their rows reach
    the attention override: it must leave them to vLLM's causal kernel, not stop the engine (2026-12-04, a
    Sapphire-Rapids-class Xeon: every sampled request that drafted killed the bfloat16 engine)."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_entmtp import step
    from vllm_entmtp.patches.tree_attention import TreeCPUAttentionImpl
    from vllm_entmtp.step import STEP, Draft, TreeRows

    calls = []
    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", lambda self, layer, q, *a, **k: calls.append(layer) or q)
    monkeypatch.setattr(CPUAttentionBackendImpl, "do_kv_cache_update", lambda *a: None)
    impl = object.__new__(TreeCPUAttentionImpl)
    layer = SimpleNamespace(isa="amx", layer_name="model.layers.0.self_attn.attn")
    query = torch.randn(6, 9 * D)
    chain, branching = Tree([[0], [0, 0], [0, 0, 0]]), Tree([[0], [1], [0, 0]])
    try:
        STEP.reset({0: TreeRows.of(0, 0, Draft.make("chain3", chain, [5, 6, 7], greedy=False)),
                    1: TreeRows.of(1, 4, Draft.make("b0n1", Tree([[0]]), [8], greedy=False))})
        assert not STEP.fixes
        impl.do_kv_cache_update(layer, query, query, None, torch.arange(6))
        assert STEP.kv == {}  # nothing stashed: a chain's accepted path sits in its own slots already
        assert impl.forward(layer, query, query, query, None, SimpleNamespace(), query) is query
        assert calls == [layer]
        STEP.reset({0: TreeRows.of(0, 0, Draft.make("b2n3", branching, [5, 6, 7], greedy=True))})
        assert STEP.fixes
        with pytest.raises(RuntimeError, match="'vec' KV layout only.*uses 'amx'"):
            impl.forward(layer, query, query, query, None, SimpleNamespace(), query)
    finally:
        STEP.reset({})

    # and the step refuses a branching tree before it touches the batch where the drafter found no tree attention
    runner = SimpleNamespace(positions=torch.arange(10))
    draft = Draft.make("b2n3", branching, [5, 6, 7], greedy=True)
    with pytest.raises(RuntimeError, match="tree attention is not available"):
        step._tree_rows(runner, 0, draft, [5, 6, 7], 2, tree_attention=False)
    assert runner.positions.tolist() == list(range(10))
    tr = step._tree_rows(runner, 0, draft, [5, 6, 7], 2, tree_attention=True)
    assert tr.fix_rows and runner.positions[3:6].tolist() == [3, 3, 4]  # root at position 2: depths 1, 1, 2
    sampled_chain = Draft.make("chain3", chain, [5, 6, 7], greedy=False)
    assert step._tree_rows(runner, 0, sampled_chain, [5, 6, 7], 2, tree_attention=False).fix_rows == []
