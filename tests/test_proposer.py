"""MTPDrafter: per-request chains from the heads' top-1 tokens, cut by budget and confidence."""
import pytest
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


def test_chain_stop_keeps_the_first_node_and_is_per_request():
    from vllm_entmtp.trees import Tree

    drafter, heads, w = _drafter()  # no global threshold
    x = torch.randn(8, 8)
    top_p, top_ids = torch.softmax(heads.logits(x, w), -1).max(-1)  # [heads, B]
    path = torch.cumprod(top_p, 0)
    two = path[1].sort().values
    stop = float(two[3] + two[4]) / 2  # some chains keep two nodes or more, some fewer (between two values)
    trees = [Tree.chain(3)] * 7 + [Tree([[0], [1]])]
    out = drafter.propose(x, trees, chain_stop=[stop] * 6 + [None, stop])
    for b in range(6):
        n = 1  # the first node always
        while n < 3 and path[n, b] >= stop:
            n += 1
        assert out[b] == top_ids[:n, b].tolist()
    assert any(len(o) == 1 for o in out[:6]) and any(len(o) > 1 for o in out[:6])
    assert out[6] == top_ids[:, 6].tolist()  # None: the drafter's own threshold (0: no cut)
    assert len(out[7]) == 2  # a branching tree is never cut
    # with a global threshold too: chain_stop entries override it for their requests, None entries keep it
    high, _, _ = _drafter(threshold=0.999)
    cut = high.propose(x[:2], [Tree.chain(3)] * 2, chain_stop=[stop, None])
    assert cut[0] == out[0] and cut[1] == []
    with pytest.raises(ValueError, match="chain_stop has 1 entries for 2 requests"):
        high.propose(x[:2], [Tree.chain(3)] * 2, chain_stop=[0.5])
    with pytest.raises(ValueError, match=r"chain_stop entries must be in \[0, 1\), got 1.5"):
        high.propose(x[:1], [Tree.chain(3)], chain_stop=[1.5])


def test_tree_nodes_carry_the_heads_topk_by_depth_and_rank():
    from vllm_entmtp.trees import Tree

    drafter, heads, w = _drafter(num_heads=3, vocab=12)
    x = torch.randn(2, 8)
    topk = heads.logits(x, w).topk(3, dim=-1).indices  # [heads, B, 3]
    tree = Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    out = drafter.propose(x, [tree, None])
    assert out[1] == []
    assert out[0] == [int(topk[len(p) - 1, 0, p[-1]]) for p in tree.paths]


# ---------------------------------------------------------------------------------------------- Hydra
def _hydra(num_heads=3, hidden=8, vocab=12, draft_vocab=None, threshold=0.0, seed=0):
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig
    from vllm_entmtp.proposer import HydraDrafter

    torch.manual_seed(seed)
    heads = HydraHeads(HydraHeadsConfig(hidden_size=hidden, vocab_size=vocab, hydra_num_heads=num_heads,
                                        truncated_vocab_size=draft_vocab))
    for name, p in heads.named_parameters():
        torch.nn.init.normal_(p, std=0.5)
    if draft_vocab is not None:
        heads.token_map.copy_(torch.randperm(vocab)[:draft_vocab].sort().values)
    w, e = torch.randn(vocab, hidden), torch.randn(vocab, hidden)
    return HydraDrafter(heads, lambda ids: e[ids], w, confidence_threshold=threshold), heads, w, e


def _hydra_topk(heads, w, e, h, path_ids, k):
    """Head len(path_ids)-1 on one path, computed directly: its top-k target token ids and top-1 probability."""
    d = len(path_ids) - 1
    x = torch.cat([h] + [e[t] for t in path_ids])[None].detach()
    logits = heads.hydra_mlp[d](x) @ heads.draft_lm_weight(w).t()
    return heads.to_token_ids(logits.topk(k).indices[0]).tolist(), float(torch.softmax(logits, -1).max())


def test_hydra_tree_children_depend_on_their_parents_token():
    from vllm_entmtp.trees import Tree

    for draft_vocab in (None, 7):
        drafter, heads, w, e = _hydra(draft_vocab=draft_vocab)
        tree = Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]])
        x, bonus = torch.randn(2, 8), torch.tensor([3, 5])
        out = drafter.propose(x, [tree, None], bonus)
        assert out[1] == []
        toks = out[0]
        for j, path in enumerate(tree.paths, start=1):  # brute force: the node's parent path through the heads
            parent_tokens = [toks[tree.paths.index(path[:i])] for i in range(1, len(path))]
            expected, _ = _hydra_topk(heads, w, e, x[0], [3] + parent_tokens, path[-1] + 1)
            assert toks[j - 1] == expected[path[-1]], path
        if draft_vocab is not None:
            assert set(toks) <= set(heads.token_map.tolist())


def test_hydra_confidence_state_is_reused_and_gives_the_same_drafts():
    from vllm_entmtp.trees import Tree

    drafter, heads, w, e = _hydra()
    x, bonus = torch.randn(3, 8), torch.tensor([1, 2, 3])
    trees = [Tree([[0], [1], [0, 0], [0, 0, 0]]), Tree.chain(3), None]
    probs, state = drafter.confidence(x, bonus)
    assert probs.shape == (3, 3) and probs.dtype == torch.float32
    # top-1 probabilities along each request's greedy chain
    for b in range(3):
        path = [int(bonus[b])]
        for k in range(3):
            toks, p = _hydra_topk(heads, w, e, x[b], path, 1)
            assert abs(float(probs[b, k]) - p) < 1e-5
            path.append(toks[0])
    assert drafter.propose(x, trees, bonus, state) == drafter.propose(x, trees, bonus)
    # the first head only (confidence_heads=1): one head evaluated, the same probabilities, a reusable state
    first, state1 = drafter.confidence(x, bonus, num_heads=1)
    assert first.shape == (3, 1) and torch.equal(first[:, 0], probs[:, 0])
    assert len(state1) == 3 and drafter.propose(x, trees, bonus, state1) == drafter.propose(x, trees, bonus)


def test_hydra_propose_counts_the_head_levels_it_ran():
    """What the load rule prices (StepCosts.record_levels): levels whose paths the confidence pass did not
    evaluate. After a one-head pass a chain of 1 runs none and a chain of 3 two; a tree branching at depth 1 runs
    its second level once for all its paths; without a pass every depth runs; a chain the chain stop cuts runs
    the levels up to the one that cut it."""
    from vllm_entmtp.trees import Tree

    drafter, heads, w, e = _hydra(seed=3)
    x, bonus = torch.randn(4, 8), torch.arange(4)
    _, state = drafter.confidence(x, bonus, num_heads=1)
    for trees, want in (([Tree.chain(1)] * 4, 0), ([Tree.chain(1), Tree.chain(3), None, None], 2),
                        ([Tree([[0], [1], [0, 0], [1, 0]])] + [Tree.chain(1)] * 3, 1)):
        drafter.propose(x, trees, bonus, dict(state))
        assert drafter.levels_run == want, trees
    drafter.propose(x, [Tree.chain(2)] * 4, bonus)
    assert drafter.levels_run == 2
    out = drafter.propose(x, [Tree.chain(3)] * 4, bonus, dict(state), chain_stop=[0.999999] * 4)
    # every chain stops after its first node: the second level ran (its probabilities decided the stop), the third
    # did not
    assert [len(o) for o in out] == [1] * 4 and drafter.levels_run == 1


def test_hydra_confidence_threshold_cuts_chains():
    drafter, heads, w, e = _hydra(seed=3)
    x, bonus = torch.randn(8, 8), torch.arange(8)
    probs, _ = drafter.confidence(x, bonus)
    full = drafter.propose_chains(x, bonus, [3] * 8)
    two = torch.cumprod(probs, 1)[:, 1].sort().values
    threshold = float(two[3] + two[4]) / 2  # some chains keep 2+ tokens, some fewer
    drafter.confidence_threshold = threshold
    out = drafter.propose_chains(x, bonus, [3] * 8)
    for b in range(8):
        n = 0
        while n < 3 and float(torch.prod(probs[b, :n + 1])) >= threshold:
            n += 1
        assert out[b] == full[b][:n]
    assert any(len(o) < 2 for o in out) and any(len(o) >= 2 for o in out)


def test_hydra_chain_stop_keeps_the_first_node_and_reuses_the_confidence_state():
    from vllm_entmtp.trees import Tree

    drafter, heads, w, e = _hydra(seed=3)
    x, bonus = torch.randn(8, 8), torch.arange(8)
    probs, state = drafter.confidence(x, bonus)
    full = drafter.propose_chains(x, bonus, [3] * 8)
    path = torch.cumprod(probs, 1)
    two = path[:, 1].sort().values
    stop = float(two[3] + two[4]) / 2
    out = drafter.propose(x, [Tree.chain(3)] * 8, bonus, state, chain_stop=[stop] * 8)
    for b in range(8):
        n = 1
        while n < 3 and float(path[b, n]) >= stop:
            n += 1
        assert out[b] == full[b][:n]
    assert any(len(o) == 1 for o in out) and any(len(o) > 1 for o in out)
    assert drafter.propose(x, [Tree.chain(3)] * 8, bonus, chain_stop=[stop] * 8) == out  # no state: the same


def test_hydra_measured_kernels_compute_what_the_heads_compute():
    """The server's drafter (measure_kernels: each head block's two maps fused into one linear, each linear by
    the kernel measured fastest here) gives the heads' own modules' logits, to float16 rounding at worst, at one
    row and at many; every candidate kernel computes x @ W.T + b."""
    from vllm_entmtp.fast_linear import LARGE_ROWS, FastLinear
    from vllm_entmtp.proposer import HydraDrafter

    drafter, heads, w, e = _hydra(draft_vocab=7)
    fast = HydraDrafter(heads, lambda ids: e[ids], w, measure_kernels=True)
    assert drafter.blocks is None and len(fast.blocks) == heads.num_heads
    x = torch.randn(LARGE_ROWS + 2, 8)
    ids = torch.randint(0, 11, (LARGE_ROWS + 2, 3))
    for k in range(heads.num_heads):
        for n in (1, LARGE_ROWS + 2):
            ref = heads.logits(k, heads.hidden_states(k, x[:n], e[ids[:n]]), heads.draft_lm_weight(w))
            got = fast._logits(k, fast._hidden_states(k, x[:n], e[ids[:n]]))
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    lin = FastLinear(w, torch.randn(w.shape[0]))
    for name, kernel in lin.kernels.items():
        torch.testing.assert_close(kernel(x), x @ w.t() + lin.kernels["torch"](torch.zeros(1, 8)), atol=2e-2,
                                   rtol=2e-2, msg=name)
    assert {lin.small, lin.large} <= set(lin.kernels) and set(lin.timings) == {1, LARGE_ROWS}
    forced = FastLinear(w, kernel="torch")
    assert (forced.small, forced.large, forced.timings) == ("torch", "torch", {})
    with pytest.raises(ValueError, match="not available"):
        FastLinear(w, kernel="tpu")


def test_hydra_needs_the_bonus_token():
    import pytest

    from vllm_entmtp.trees import Tree

    drafter, *_ = _hydra()
    with pytest.raises(ValueError, match="bonus"):
        drafter.propose(torch.randn(1, 8), [Tree.chain(2)])
    with pytest.raises(ValueError, match="depth 4"):
        drafter.propose(torch.randn(1, 8), [Tree.chain(4)], torch.tensor([0]))


def test_hydra_confidence_over_some_rows_matches_the_whole_batch_and_keys_the_state_by_batch_row():
    """The drafter runs the confidence pass over the requests that may draft only (not prompt chunks, nor those
    whose lookup draft wins): their probabilities and state are the whole batch's, keyed by batch index."""
    from vllm_entmtp.trees import Tree

    drafter, *_ = _hydra()
    x, bonus = torch.randn(4, 8), torch.tensor([1, 2, 3, 4])
    whole, whole_state = drafter.confidence(x, bonus, num_heads=2)
    some, state = drafter.confidence(x, bonus, num_heads=2, rows=[3, 1])
    assert some.shape == (2, 2)
    assert torch.allclose(some[0], whole[3]) and torch.allclose(some[1], whole[1])
    assert {i for i, _ in state} == {1, 3}
    assert state.keys() == {key for key in whole_state if key[0] in (1, 3)}
    for key, (toks, p) in state.items():  # the same tokens; probabilities up to the batch's rounding
        assert toks == whole_state[key][0] and p == pytest.approx(whole_state[key][1], abs=1e-5)
    trees = [None, Tree([[0], [1], [0, 0]]), None, Tree.chain(3)]
    assert drafter.propose(x, trees, bonus, state) == drafter.propose(x, trees, bonus)
    none, empty = drafter.confidence(x, bonus, num_heads=2, rows=[])
    assert none.shape == (0, 2) and empty == {}
