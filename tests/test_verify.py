"""Acceptance: greedy tree walk, tree rejection sampling (deterministic cases) and vLLM's sampling parameters.
The distribution-level check of rejection sampling is in test_rejection_sampling.py."""
import pytest
import torch

from vllm_entmtp.trees import Tree
from vllm_entmtp.verify import apply_sampling_params, greedy_accept, tree_rejection_sample

# node:      1    2    3       4       5       6
# path:     [0]  [1]  [0,0]   [0,1]   [1,0]   [0,0,0]
TREE = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
PARENTS = TREE.parents  # [0, 0, 1, 1, 2, 3]
DRAFTS = [10, 20, 11, 12, 21, 13]


def test_tree_layout_used_below():
    assert PARENTS == [0, 0, 1, 1, 2, 3]


def test_greedy_walks_through_a_non_first_branch():
    # root wants 20 (node 2, the second sibling), node 2 wants 21 (node 5), node 5 is a leaf.
    argmax = [20, 0, 21, 0, 0, 99, 0]
    assert greedy_accept(DRAFTS, PARENTS, argmax) == [2, 5]
    assert argmax[5] == 99  # bonus token: the target's argmax after the last accepted node


def test_greedy_takes_the_second_child_at_depth_two():
    argmax = [10, 12, 0, 0, 7, 0, 0]  # node 1 wants 12: node 4 (its second child)
    assert greedy_accept(DRAFTS, PARENTS, argmax) == [1, 4]


def test_greedy_stops_at_the_first_mismatch():
    argmax = [10, 11, 0, 5, 0, 0, 0]  # node 3 wants 5 but its child (node 6) carries 13
    assert greedy_accept(DRAFTS, PARENTS, argmax) == [1, 3]
    assert greedy_accept(DRAFTS, PARENTS, [7, 11, 0, 13, 0, 0, 0]) == []  # root mismatch: nothing accepted


def test_greedy_accepts_the_whole_deepest_path():
    argmax = [10, 11, 0, 13, 0, 0, 42]
    acc = greedy_accept(DRAFTS, PARENTS, argmax)
    assert acc == [1, 3, 6] and argmax[acc[-1]] == 42


def test_greedy_with_duplicate_siblings_takes_the_first():
    drafts = [10, 10, 11, 12, 21, 13]  # nodes 1 and 2 both carry 10
    assert greedy_accept(drafts, PARENTS, [10, 12, 0, 0, 0, 0, 0]) == [1, 4]
    # the duplicate's subtree is never entered: node 1 wants 21, which only node 2's child (node 5) carries
    assert greedy_accept(drafts, PARENTS, [10, 21, 21, 0, 0, 0, 0]) == [1]


def test_greedy_rejects_bad_input():
    with pytest.raises(ValueError, match="entries"):
        greedy_accept(DRAFTS, PARENTS, [0] * 6)
    with pytest.raises(ValueError, match="parent"):
        greedy_accept([1, 2], [0, 2], [0, 0, 0])
    with pytest.raises(ValueError, match="parents"):
        greedy_accept([1, 2], [0], [0, 0, 0])


def _onehot_rows(argmax, vocab=128):
    probs = torch.zeros(len(argmax), vocab)
    probs[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    return probs


def test_rejection_sampling_with_one_hot_targets_is_greedy():
    g = torch.Generator().manual_seed(0)
    rng = torch.Generator().manual_seed(1)
    trees = [TREE, Tree.chain(4), Tree([[0], [1], [2], [0, 0], [2, 0], [2, 1], [0, 0, 0], [2, 1, 0]])]
    for _ in range(200):
        tree = trees[int(torch.randint(3, (), generator=rng))]
        drafts = torch.randint(4, (tree.num_nodes,), generator=rng).tolist()  # duplicates are common
        argmax = torch.randint(4, (tree.num_nodes + 1,), generator=rng).tolist()
        acc, nxt = tree_rejection_sample(drafts, tree.parents, _onehot_rows(argmax), g)
        assert acc == greedy_accept(drafts, tree.parents, argmax)
        assert nxt == argmax[acc[-1] if acc else 0]


def test_rejection_sampling_never_accepts_or_emits_a_zero_probability_token():
    g = torch.Generator().manual_seed(0)
    probs = torch.full((7, 6), 0.25)
    probs[:, 0] = 0.0  # token 0 impossible everywhere
    probs[:, 5] = 0.0
    probs[0] = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])  # root: 1 or 2 only
    drafts = [0, 0, 1, 2, 3, 4]
    for _ in range(200):
        acc, nxt = tree_rejection_sample(drafts, PARENTS, probs, g)
        assert acc == []  # nodes 1 and 2 carry token 0
        assert nxt in (1, 2)


def test_rejection_sampling_duplicate_sibling_after_a_rejection_is_rejected():
    g = torch.Generator().manual_seed(0)
    probs = torch.full((7, 4), 0.25)
    probs[0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    drafts = [1, 1, 2, 2, 3, 3]  # nodes 1 and 2 both carry 1
    seen_second = 0
    for _ in range(400):
        acc, nxt = tree_rejection_sample(drafts, PARENTS, probs, g)
        assert 2 not in acc  # the duplicate is never accepted...
        if not acc:
            assert nxt == 0  # ...and once 1 is rejected, the residual is all on token 0
        seen_second += bool(acc)
    assert 120 < seen_second < 280  # node 1 accepted about half the time


def test_rejection_sampling_certain_token_is_always_accepted_and_bonus_drawn_at_the_leaf():
    g = torch.Generator().manual_seed(0)
    probs = _onehot_rows([10, 11, 0, 13, 0, 0, 0], vocab=64).float()
    probs[6] = 0.0
    probs[6, 40:44] = 0.25  # after the deepest node: uniform over 40..43
    drafts = [10, 20, 11, 12, 21, 13]
    bonus = set()
    for _ in range(100):
        acc, nxt = tree_rejection_sample(drafts, PARENTS, probs, g)
        assert acc == [1, 3, 6]
        bonus.add(nxt)
    assert bonus == {40, 41, 42, 43}


def test_rejection_sampling_is_reproducible_with_a_seeded_generator():
    probs = torch.softmax(torch.randn(7, 16, generator=torch.Generator().manual_seed(3)), dim=-1)
    drafts = [1, 2, 3, 4, 5, 6]
    a = [tree_rejection_sample(drafts, PARENTS, probs, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [tree_rejection_sample(drafts, PARENTS, probs, torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == b


def test_rejection_sampling_rejects_bad_input():
    probs = torch.full((7, 16), 1 / 16)
    with pytest.raises(ValueError, match="num_nodes"):
        tree_rejection_sample(DRAFTS[:5] + [1], PARENTS, probs[:6])
    with pytest.raises(ValueError, match="vocabulary"):
        tree_rejection_sample([1, 2, 3, 4, 5, 16], PARENTS, probs)
    bad = probs.clone()
    bad[0] = 0.0
    with pytest.raises(ValueError, match="row 0"):
        tree_rejection_sample([1, 2, 3, 4, 5, 6], PARENTS, bad)


def test_rejection_sampling_with_an_empty_tree_samples_the_root_row():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert tree_rejection_sample([], [], probs, g) == ([], 2)


# -- apply_sampling_params --------------------------------------------------------------------------------------


def test_greedy_temperature_gives_one_hot_at_the_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    assert apply_sampling_params(logits, 0.0, 2, 0.5).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(apply_sampling_params(logits, 1.0, None, None), torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    t = apply_sampling_params(logits, 0.5, None, None)  # p^2 renormalised
    assert torch.allclose(t, torch.tensor([[16.0, 9.0, 4.0, 1.0]]) / 30)
    k = apply_sampling_params(logits, 1.0, 2, None)
    assert torch.allclose(k, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    # top-p 0.6: ascending cumsum 0.1, 0.3, 0.6, 1.0; drop where <= 0.4 -> tokens 3 and 2 go
    p = apply_sampling_params(logits, 1.0, None, 0.6)
    assert torch.allclose(p, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    # a tiny top-p still keeps the most likely token
    assert apply_sampling_params(logits, 1.0, None, 1e-6).tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_off_values_and_ties():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    base = apply_sampling_params(logits, 1.0, None, None)
    for k, p in [(0, None), (-1, 1.0), (4, None), (10, 1.0)]:
        assert torch.equal(apply_sampling_params(logits, 1.0, k, p), base)
    two = apply_sampling_params(logits, 1.0, 2, None)  # the tie at the 2nd place is kept, as in vLLM
    assert (two > 0).tolist() == [[True, True, True, False]]


def test_small_positive_temperature_is_raised_like_vllm():
    logits = torch.tensor([[0.0, 0.001]])
    assert torch.equal(apply_sampling_params(logits, 1e-4, None, None),
                       apply_sampling_params(logits, 1e-2, None, None))


def test_bad_sampling_params_raise():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="temperature"):
        apply_sampling_params(x, -0.5, None, None)
    with pytest.raises(ValueError, match="top_p"):
        apply_sampling_params(x, 1.0, None, 0.0)


def test_inverse_cdf_draw_skips_zero_mass_tokens_and_reports_an_empty_residual():
    from vllm_entmtp.verify import _draw

    row = torch.tensor([0.0, 0.2, 0.0, 0.8, 0.0])
    assert _draw(row, [], 0.0) == 1 and _draw(row, [], 0.1999) == 1 and _draw(row, [], 0.2001) == 3
    assert _draw(row, [], 1.0 - 2.0 ** -53) == 3  # never the trailing zero-mass token
    assert _draw(row, [1], 0.0) == 3
    assert _draw(row, [1, 3], 0.5) is None
