"""The tree mask a GPU attention backend would take (vllm_entmtp/tree_mask.py), against the CPU tree fix's output
(patches/tree_attention.py over vLLM's paged cache) on a mixed batch: decode, chain, prompt chunk and two trees."""
import pytest
import torch
import torch.nn.functional as F

from vllm_entmtp.tree_mask import tree_attention_bias, tree_mask_mod
from vllm_entmtp.trees import Tree

ops = pytest.importorskip("vllm._custom_ops")
from test_tree_attention import BS, D, HKV, REP, _cache, _dense, _write  # noqa: E402

SCALE = 0.125
TREE = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
# (context length, query rows, tree or None): a decode step, a tree, a 3-token chain, a prompt chunk, a small tree
BATCH = [(9, 1, None), (31, TREE.num_nodes + 1, TREE), (5, 4, None), (3, 5, None), (70, 3, Tree([[0], [1]]))]


def _batch():
    torch.manual_seed(0)
    reqs = []
    for ctx, t, tree in BATCH:
        seq_len = ctx + t
        reqs.append({"ctx": ctx, "t": t, "tree": tree, "k": torch.randn(seq_len, HKV, D),
                     "v": torch.randn(seq_len, HKV, D), "q": torch.randn(t, HKV * REP, D)})
    qsl = torch.tensor([0] + [r["t"] for r in reqs]).cumsum(0)
    seq_lens = torch.tensor([r["ctx"] + r["t"] for r in reqs])
    trees = {b: r["tree"] for b, r in enumerate(reqs) if r["tree"] is not None}
    return reqs, qsl, seq_lens, trees


def _reference(r):
    """The CPU path: tree rows through the tree fix over a scattered paged cache; other requests causal."""
    from vllm_entmtp.patches.tree_attention import tree_rows_attention

    seq_len, t = r["ctx"] + r["t"], r["t"]
    if r["tree"] is None:
        causal = torch.ones(t, seq_len, dtype=torch.bool).tril(r["ctx"])
        return _dense(r["q"], r["k"], r["v"], causal, SCALE)
    nblk = (seq_len + BS - 1) // BS
    blocks = torch.randperm(nblk + 3)[:nblk]
    slots = [int(blocks[p // BS]) * BS + p % BS for p in range(seq_len)]
    cache = _cache(nblk + 3)
    _write(cache, r["k"], r["v"], slots)
    return tree_rows_attention(r["q"], cache, blocks, seq_len, t, r["tree"].ancestor_mask(), list(range(t)), SCALE)


def test_additive_bias_gives_the_cpu_tree_fix_output():
    reqs, qsl, seq_lens, trees = _batch()
    bias = tree_attention_bias(qsl, seq_lens, trees)
    assert bias.shape == (int(qsl[-1]), int(seq_lens.max()))
    for b, r in enumerate(reqs):
        rows = bias[int(qsl[b]):int(qsl[b + 1]), :int(seq_lens[b])]
        assert torch.isinf(bias[int(qsl[b]):int(qsl[b + 1]), int(seq_lens[b]):]).all()  # past its own keys
        q = r["q"].transpose(0, 1)  # [H, t, D]
        k, v = (x.repeat_interleave(REP, 1).transpose(0, 1) for x in (r["k"], r["v"]))
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=rows, scale=SCALE).transpose(0, 1)
        torch.testing.assert_close(got, _reference(r), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager: the reference kernel
def test_flex_attention_mask_mod_gives_the_cpu_tree_fix_output():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    reqs, qsl, seq_lens, trees = _batch()
    q = torch.cat([r["q"] for r in reqs]).transpose(0, 1)[None]  # [1, H, total_q, D]
    k, v = (torch.cat([r[x] for r in reqs]).transpose(0, 1)[None] for x in ("k", "v"))  # [1, Hkv, total_kv, D]
    mask = create_block_mask(tree_mask_mod(qsl, seq_lens, trees), 1, None, q.shape[2], k.shape[2], device="cpu")
    out = flex_attention(q, k, v, block_mask=mask, scale=SCALE, enable_gqa=True)[0].transpose(0, 1)
    for b, r in enumerate(reqs):
        torch.testing.assert_close(out[int(qsl[b]):int(qsl[b + 1])], _reference(r), rtol=1e-5, atol=1e-5)


def test_the_mask_differs_from_causal_exactly_on_rows_that_would_see_siblings():
    reqs, qsl, seq_lens, trees = _batch()
    tree_bias = tree_attention_bias(qsl, seq_lens, trees)
    causal = tree_attention_bias(qsl, seq_lens, {})
    differs = [i for i in range(int(qsl[-1])) if not torch.equal(tree_bias[i], causal[i])]
    # request 1's tree rows 2..6 (TREE.fix_rows) and request 4's row 2 (node [1] would see node [0])
    assert differs == [int(qsl[1]) + j for j in TREE.fix_rows] + [int(qsl[4]) + 2]
    with pytest.raises(ValueError, match="request 0: 1 query rows, but its tree has 3 rows"):
        tree_attention_bias(qsl, seq_lens, {0: Tree([[0], [1]])})
