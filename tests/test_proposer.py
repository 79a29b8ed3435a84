"""MTPDrafter: per-request chains from the heads' top-1 tokens, cut by budget and confidence."""
import torch

from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig
from vllm_entmtp.proposer import MTPDrafter


def _drafter(threshold=0.0, num_heads=3, hidden=8, vocab=12, seed=0):
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    w = torch.randn(vocab, hidden)
    return MTPDrafter(heads, lambda x: x @ w.t(), confidence_threshold=threshold), heads, w


def test_chain_is_heads_top1_in_order_and_respects_budgets():
    drafter, heads, w = _drafter()
    x = torch.randn(4, 8)
    expected = heads.logits(x, w).argmax(-1).t().tolist()  # [B, heads]
    out = drafter.propose_chains(x, [3, 0, 1, 5])
    assert out == [expected[0], [], expected[2][:1], expected[3]]  # 5 > 3 heads: capped at 3


def test_all_zero_budgets_propose_nothing():
    drafter, _, _ = _drafter()
    assert drafter.propose_chains(torch.randn(2, 8), [0, 0]) == [[], []]


def test_confidence_threshold_cuts_chains_where_path_probability_drops():
    drafter, heads, w = _drafter(threshold=0.2)
    x = torch.randn(6, 8)
    probs = torch.softmax(heads.logits(x, w), -1)
    top_p, top_ids = probs.max(-1)  # [heads, B]
    path = torch.cumprod(top_p, 0)
    out = drafter.propose_chains(x, [3] * 6)
    for b in range(6):
        n = 0
        while n < 3 and path[n, b] >= 0.2:
            n += 1
        assert out[b] == top_ids[:n, b].tolist()
    assert any(len(o) < 3 for o in out)  # the threshold did cut something in this draw


def test_tree_nodes_carry_the_heads_topk_by_depth_and_rank():
    from vllm_entmtp.trees import Tree

    drafter, heads, w = _drafter(num_heads=3, vocab=12)
    x = torch.randn(2, 8)
    topk = heads.logits(x, w).topk(3, dim=-1).indices  # [heads, B, 3]
    tree = Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    out = drafter.propose(x, [tree, None])
    assert out[1] == []
    assert out[0] == [int(topk[len(p) - 1, 0, p[-1]]) for p in tree.paths]
