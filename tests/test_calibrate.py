"""``vllm-entmtp build-trees`` (vllm_entmtp/calibrate/): acceptance formula, greedy trees, Pareto choice, bins,
the tree-set file it writes, and one end-to-end run on a tiny random model."""
from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_heads

from vllm_entmtp.calibrate.acceptance import expected_accepted, greedy_tree, node_probability
from vllm_entmtp.calibrate.bins import BinStats, bin_statistics, edge_scores, quantile_edges
from vllm_entmtp.calibrate.chain_stop import CHAIN_STOP_GRID, cut_depths, fit_chain_stop, schedule_speedup_on_outcomes
from vllm_entmtp.calibrate.costs import interpolate_cost, monotone_times, read_step_costs, step_cost_of
from vllm_entmtp.calibrate.records import display_path
from vllm_entmtp.calibrate.report import summary_table
from vllm_entmtp.calibrate.search import (Candidate, best_ratio, candidates_for_bin, choose, expected_overall,
                                          pareto_frontier)
from vllm_entmtp.calibrate.signals import chain_outcomes, signal_correlations, signal_series
from vllm_entmtp.calibrate.target import true_token_ranks
from vllm_entmtp.calibrate.tree_set import build_tree_set
from vllm_entmtp.cli import main as cli_main
from vllm_entmtp.config import EntMTPConfig
from vllm_entmtp.scheduler import TreeScheduler
from vllm_entmtp.trees import Tree, load_tree_set

P3 = [[0.5, 0.25], [0.4, 0.1], [0.5, 0.0]]  # 3 heads, top-2


def _walk_expectation(paths, P):
    """E[accepted nodes] by enumerating every outcome (the right rank per depth, or a miss) with its
    probability and walking the tree from the root: the definition the formula must agree with."""
    nodes = {tuple(p) for p in paths}
    width = len(P[0])
    total = 0.0
    for outcome in itertools.product(range(width + 1), repeat=len(P)):  # rank == width: miss
        prob = math.prod(P[d][r] if r < width else 1 - sum(P[d]) for d, r in enumerate(outcome))
        n = 0
        while n < len(P) and outcome[:n + 1] in nodes:
            n += 1
        total += prob * n
    return total


def test_expected_acceptance_on_a_hand_made_table():
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    # 0.5 + 0.25 + 0.5*0.4 + 0.5*0.1 + 0.25*0.4 + 0.5*0.4*0.5
    assert expected_accepted(tree, P3) == pytest.approx(1.2, abs=1e-12)
    assert expected_accepted([[0], [0, 0], [0, 0, 0]], P3) == pytest.approx(0.8, abs=1e-12)
    assert node_probability((0, 1), P3) == pytest.approx(0.05, abs=1e-12)
    assert node_probability((2,), P3) == 0.0  # rank past the table: a miss
    assert node_probability((0, 0, 0, 0), P3) == 0.0  # deeper than the heads
    assert expected_accepted([[0, 1, 0], [0], [0, 1]], P3) == pytest.approx(0.575, abs=1e-12)  # any order
    for paths in (tree, [[0]], [[1], [0], [1, 1], [1, 0, 0], [1, 0]]):
        assert expected_accepted(paths, P3) == pytest.approx(_walk_expectation(paths, P3), abs=1e-12)


def test_greedy_tree_known_result_and_properties():
    P = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.0]]
    got = greedy_tree(P, 8)
    assert [p for p, _ in got] == [(0,), (0, 0), (1,), (0, 1), (2,), (1, 0), (2, 0), (1, 1)]
    assert [v for _, v in got] == pytest.approx([0.6, 0.3, 0.2, 0.12, 0.1, 0.1, 0.05, 0.04])
    # (2,) and (1, 0) tie at 0.1: the shorter path first; zero-probability nodes last, in canonical order,
    # until the 3 + 3 * 3 nodes of the [depth][rank] grid are used up
    assert [p for p, _ in greedy_tree(P, 20)][8:] == [(2, 1), (0, 2), (1, 2), (2, 2)]
    # the left-sibling rule: rank 1 is worth more than rank 0, but only enters after it
    assert [p for p, _ in greedy_tree([[0.1, 0.5], [0.9, 0.0]], 3)] == [(0,), (1,), (1, 0)]
    # depth limit and the end of the [depth][rank] grid
    assert all(len(p) == 1 for p, _ in greedy_tree(P, 3, max_depth=1))
    assert len(greedy_tree([[0.5]], 5)) == 1
    assert len(greedy_tree([[0.5], [0.5]], 5)) == 2
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        table = torch.rand(4, 5, generator=g)
        table = (table / table.sum(1, keepdim=True) * 0.9).tolist()
        full = greedy_tree(table, 30, max_depth=3)
        for n in range(1, 31):
            prefix = [p for p, _ in full[:n]]
            assert [p for p, _ in greedy_tree(table, n, max_depth=3)] == prefix  # nested
            Tree(prefix, max_depth=3)  # a valid tree: parents present
            assert all(p[:-1] + (p[-1] - 1,) in prefix for p in prefix if p[-1] > 0)  # left siblings present
        for p, v in full:
            assert v == pytest.approx(node_probability(p, table))
    with pytest.raises(ValueError, match="max_nodes"):
        greedy_tree(P, 0)
    with pytest.raises(ValueError, match="equally long"):
        greedy_tree([[0.5, 0.1], [0.5]], 2)


def test_pareto_frontier_and_best_ratio():
    pts = [(1.0, 1.0), (1.2, 1.5), (1.1, 1.0), (1.5, 1.4), (2.0, 2.0), (2.0, 2.0), (1.2, 1.3), (3.0, 2.0)]
    assert pareto_frontier(pts) == [0, 1, 4]  # (1.1, 1.0), (1.5, 1.4), (1.2, 1.3), (3, 2) dominated
    assert best_ratio(pts) == 1  # 1.5 / 1.2 = 1.25
    assert best_ratio([(1.0, 1.0), (1.3, 1.2)]) == 0  # nothing beats not drafting
    assert best_ratio([(2.0, 2.5), (1.0, 1.25)]) == 1  # equal ratio: the cheaper
    with pytest.raises(ValueError, match="cost"):
        best_ratio([(0.0, 1.0)])


def test_bins_and_rank_tables():
    ent = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    ranks = torch.tensor([[0, 0], [1, 9], [0, -1], [0, 1], [3, 0], [2, -1]], dtype=torch.int16)
    assert quantile_edges(ent, 2) == [0.35]
    assert quantile_edges(torch.zeros(10), 3) == []  # edges <= 0 dropped
    assert quantile_edges(ent, 1) == []
    bins = bin_statistics(ent, ranks, [0.3], max_rank=2)  # 0.3 lies on the edge: upper bin
    assert [b.positions for b in bins] == [2, 4]
    assert bins[0].P == [[0.5, 0.5], [0.5, 0.0]]  # head 1: ranks 0 and 9 (a miss)
    assert bins[1].P == [[0.5, 0.0], [0.5, 0.5]]  # head 0: 0, 0, 3, 2; head 1: 0 and 1 (two unlabelled)
    assert bins[1].labels_per_depth == [4, 2]
    assert bins[0].mean_signal == pytest.approx(0.15) and bins[1].hi == math.inf
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    assert true_token_ranks(logits, torch.tensor([3, -1]), cap=8).tolist() == [1, 8]
    assert true_token_ranks(logits, torch.tensor([0, 2]), cap=1).tolist() == [1, 1]


def test_confidence_bins_go_from_most_to_least_confident():
    conf = torch.tensor([0.9, 0.8, 0.5, 0.4, 0.2, 0.1])
    ranks = torch.zeros(6, 1, dtype=torch.int16)
    ranks[3:] = 5  # the less confident half misses
    edges = quantile_edges(-conf, 2, lower=-1.0)
    assert edges == [-0.45]
    bins = bin_statistics(-conf, ranks, edges, max_rank=2, signal="confidence")
    assert [b.positions for b in bins] == [3, 3] and bins[0].P == [[1.0, 0.0]] and bins[1].P == [[0.0, 0.0]]
    assert bins[0].signal_range() == (0.45, 1.0) and bins[1].signal_range() == (None, 0.45)
    assert bins[0].mean_signal == pytest.approx(2.2 / 3) and bins[0].to_json()["confidence_range"] == [0.45, 1.0]
    assert edge_scores([0.6, 0.2], "confidence") == [-0.6, -0.2]
    for bad, sig in (([0.2, 0.6], "confidence"), ([1.0], "confidence"), ([0.6, 0.2], "entropy")):
        with pytest.raises(ValueError, match="--edges"):
            edge_scores(bad, sig)


def test_signal_series_is_what_the_runtime_tracker_holds():
    from vllm_entmtp.entropy import EntropyTracker

    recs = [{"entropy": torch.tensor([1.0, 0.0, 2.0]), "head_top1": torch.tensor([[0.5, 0.4], [0.9, 0.8],
                                                                               [0.1, 0.5]])},
            {"entropy": torch.tensor([0.3]), "head_top1": torch.tensor([[0.2, 0.2]])}]
    ent = signal_series(recs, "entropy", 2)
    b = 0.5  # window 2: beta = 1/2, bias-corrected; a new record starts a new EMA
    m = [(1 - b) * 1.0, b * (1 - b) * 1.0, b * b * (1 - b) * 1.0 + (1 - b) * 2.0]  # EMA before correction
    assert ent.tolist() == pytest.approx([m[0] / (1 - b), m[1] / (1 - b ** 2), m[2] / (1 - b ** 3), 0.3])
    tr = EntropyTracker(entropy_window=2)
    for e in (1.0, 0.0, 2.0):
        tr.update("r", e)
    assert ent[2].item() == pytest.approx(tr.signals("r").entropy_ema)
    conf = signal_series(recs, "confidence", 1)  # window 1: this position's path confidence, negated
    assert conf.tolist() == pytest.approx([-0.2, -0.72, -0.05, -0.04])
    first = signal_series(recs, "confidence", 1, confidence_heads=1)  # the first head's only
    assert first.tolist() == pytest.approx([-0.5, -0.9, -0.1, -0.2])
    with pytest.raises(ValueError, match="unknown signal"):
        signal_series(recs, "nope", 1)


def test_signal_correlations_find_the_predictive_signal():
    g = torch.Generator().manual_seed(0)
    n = 400
    conf = torch.rand(n, generator=g)
    hit = torch.rand(n, generator=g) < conf  # head 0 is right with probability = its confidence
    ranks = torch.where(hit, 0, 3).to(torch.int16)[:, None].repeat(1, 2)
    recs = [{"entropy": torch.rand(n, generator=g), "ranks": ranks,  # entropy: unrelated noise
             "head_top1": torch.stack([conf, torch.full((n,), 0.5)], 1)}]
    got = signal_correlations(recs, entropy_window=4)
    assert set(got) == {"entropy_ema", "entropy_last", "confidence_1_heads", "confidence_2_heads"}
    c1 = got["confidence_1_heads"]
    assert c1["r_first"] > 0.4 and c1["first_hit_top30"] > 0.75 > 0.25 > c1["first_hit_bottom30"]
    assert abs(got["entropy_last"]["r_first"]) < 0.15
    assert got["confidence_2_heads"]["r_first"] == pytest.approx(c1["r_first"], abs=1e-3)  # x 0.5: same r


def test_metadata_paths_do_not_name_this_machine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "heads").mkdir()
    assert display_path(tmp_path / "heads") == "heads"
    home = Path.home()
    assert display_path(home / ".cache" / "m") == str(Path("~") / ".cache" / "m")


def test_step_costs_file_and_interpolation(tmp_path):
    f = tmp_path / "cost.json"
    f.write_text(json.dumps({"step_cost_by_nodes": {"0": 1.0, "1": 1.2, "4": 1.5, "2": 1.1}}))
    both = read_step_costs(f)
    assert both == {"chain": {1: 1.2, 2: 1.1, 4: 1.5}, "tree": {}}
    costs = both["chain"]
    assert interpolate_cost(costs, 1) == pytest.approx(1.2)
    assert interpolate_cost(costs, 2) == pytest.approx(1.2)  # never cheaper than fewer nodes
    assert interpolate_cost(costs, 3) == pytest.approx(1.35)
    assert interpolate_cost(costs, 8) == pytest.approx(1.5 + 0.15 * 4)  # the last slope
    # no tree costs measured: trees cost what chains of their size do
    assert step_cost_of(both, [[0], [1]]) == pytest.approx(1.2)
    # chains and trees measured apart: a branching tree reads the tree table, a chain the chain table
    f.write_text(json.dumps({"step_cost_by_nodes": {"0": 1.0, "1": 1.1, "2": 1.2, "2t": 1.4, "4t": 1.8}}))
    both = read_step_costs(f)
    assert both == {"chain": {1: 1.1, 2: 1.2}, "tree": {2: 1.4, 4: 1.8}}
    assert step_cost_of(both, [[0], [0, 0]]) == pytest.approx(1.2)
    assert step_cost_of(both, [[0], [1]]) == pytest.approx(1.4)
    assert step_cost_of(both, [[0], [0, 0], [1]]) == pytest.approx(1.6)  # branches after its chain: a tree
    assert step_cost_of(both, [[0]]) == pytest.approx(1.1)
    for bad in ({"nodes": {}}, {"step_cost_by_nodes": {"1": "x"}}, {"step_cost_by_nodes": {"2": -1}},
                {"step_cost_by_nodes": {"2x": 1.2}}):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="--step-costs"):
            read_step_costs(f)


def test_step_costs_of_several_runs_are_medians_per_key(tmp_path):
    runs = [{"0": 1.0, "1": 1.15, "2": 1.28, "4t": 1.6}, {"1": 1.03, "2": 1.19}, {"1": 0.99, "2": 1.07},
            {"1": 1.10, "2": 1.23, "4t": 1.5}]
    files = []
    for i, r in enumerate(runs):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps({"step_cost_by_nodes": r}))
    both = read_step_costs(files)
    assert both["chain"] == {1: pytest.approx((1.03 + 1.10) / 2), 2: pytest.approx((1.19 + 1.23) / 2)}
    assert both["tree"] == {4: pytest.approx(1.55)}  # only the runs that measured it
    assert read_step_costs([files[0]]) == read_step_costs(files[0]) == {"chain": {1: 1.15, 2: 1.28},
                                                                            "tree": {4: 1.6}}
    files[2].write_text(json.dumps({"step_cost_by_nodes": {"1": 0}}))
    with pytest.raises(ValueError, match=f"--step-costs {files[2]}"):  # the bad file is named
        read_step_costs(files)
    with pytest.raises(ValueError, match="no file"):
        read_step_costs([])


def _choice(index, lo, hi, P, costs):
    stats = BinStats(index, lo, hi, 10, (lo + min(hi, 3.0)) / 2, [10] * len(P), P)
    cands = candidates_for_bin(stats, [1, 2, 4], len(P))
    for c in cands:
        c.verify_cost, c.draft_cost = costs[c.num_nodes], 0.05
    return choose(stats, cands)


def test_expected_overall_weighs_bins_by_positions():
    costs = {1: 1.2, 2: 1.4, 4: 1.8}
    hot = _choice(0, 0.0, 1.0, [[0.9, 0.05], [0.8, 0.1]], costs)
    cold = _choice(1, 1.0, math.inf, [[0.05, 0.05], [0.05, 0.0]], costs)
    assert hot.chosen is not None and cold.chosen is None  # the cold bin drafts nothing
    got = expected_overall([hot, cold])
    t_hot = hot.chosen.tokens_per_step
    # 10 positions in each bin (see _choice): the schedule drafts in the hot bin only
    assert got["schedule"] == pytest.approx(round((t_hot + 1.0) / (hot.chosen.cost + 1.0), 4))
    every = []
    for c in hot.candidates:
        t = [1 + expected_accepted(c.key, b.stats.P) for b in (hot, cold)]
        every.append((t[0] + t[1]) / (2 * c.cost))
    assert got["best_static"]["speedup"] == pytest.approx(round(max(every), 4))
    assert got["schedule"] > got["best_static"]["speedup"]  # choosing per bin pays here


def test_tree_set_file_loads_and_schedules(tmp_path):
    costs = {1: 1.05, 2: 1.1, 4: 1.12}
    good, bad = [[0.9, 0.05], [0.8, 0.1]], [[0.05, 0.01], [0.0, 0.0]]
    choices = [_choice(0, 0.0, 0.2, good, costs), _choice(1, 0.2, 0.9, good, costs),
               _choice(2, 0.9, math.inf, bad, costs)]
    assert choices[0].chosen.num_nodes == 4 and choices[2].chosen is None
    keys = {c.key for b in choices for c in b.candidates}
    times = {"verify": {n: 10.0 * x for n, x in costs.items()}, "draft": {k: 0.5 for k in keys}}
    obj, bin_ids = build_tree_set(choices, name="t", heads_kind="medusa", num_heads=2, times_ms=times,
                                    calibration={"prompts": "hand", "positions": 30}, hysteresis=0.1)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(obj))
    ts = load_tree_set(str(path), num_heads=2)
    # bins 0 and 1 chose the same tree: merged, one threshold left; in bin 2 no tree beats plain decoding, so it
    # drafts nothing (the schedule's reserved last entry "none"); its best tree (< 1), the 1-node one, is kept
    # in the set under bin 0's id
    assert choices[2].scheduled.num_nodes == 1 and choices[2].scheduled.speedup < 1
    assert ts.schedule.tree_ids == ("b0n4", "none") and ts.schedule.thresholds == (0.9,)
    assert bin_ids == ["b0n4", "b0n4", "none"] and ts.schedule.hysteresis == 0.1
    assert ts.get("b0n1") == Tree([[0]]) and ts.get("b0n4") == Tree([[0], [1], [0, 0], [0, 1]])
    md = ts.metadata["b0n4"]
    assert md["expected_tokens_per_step_per_bin"][0] == pytest.approx(1 + 0.9 + 0.05 + 0.72 + 0.09, abs=1e-4)
    assert md["cost"]["total"] == pytest.approx(1.17) and md["chosen_in_bins"] == [0, 1]
    assert "calibration" in ts.metadata[ts.ids[0]] and "none (no tree is expected to beat" in ts.description
    sched = TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set=str(path)), ts)
    assert sched.ladder_ids == ["b0n4", "none"] and sched.bin_of(0.5) == 0 and sched.bin_of(1.0) == 1
    from vllm_entmtp.entropy import Signals
    sig = [Signals(entropy_ema=e, entropy_last=e, updates=5) for e in (0.5, 1.0)]
    assert sched.choose(["a", "b"], sig) == [("b0n4", ts.get("b0n4")), (None, None)]
    table = summary_table(choices, bin_ids)
    assert "no tree beats plain decoding (best: 1 nodes" in table and "bonus" in table


def _records(ranks, top1):
    return [{"ranks": torch.tensor(ranks, dtype=torch.int16), "head_top1": torch.tensor(top1)}]


def test_chain_outcomes_and_cut_depths():
    ranks = [[0, 0, 1], [0, 2, 0], [3, 0, 0], [0, 0, 0], [0, -1, -1]]  # the last has no true token for heads 1, 2
    top1 = [[0.9, 0.8, 0.5], [0.6, 0.9, 0.9], [0.3, 0.9, 0.9], [0.95, 0.9, 0.9], [0.9, 0.9, 0.9]]
    lead, conf, rk = chain_outcomes(_records(ranks, top1))
    assert lead.tolist() == [2, 1, 0, 3] and rk.shape == (4, 3)
    assert conf[0].tolist() == pytest.approx([0.9, 0.72, 0.36])
    # the first node always; then while the path confidence up to the node's head is >= tau
    assert cut_depths(conf, 3, 0.5).tolist() == [2, 2, 1, 3]
    assert cut_depths(conf, 2, 0.5).tolist() == [2, 2, 1, 2]
    assert cut_depths(conf, 3, 0.99).tolist() == [1, 1, 1, 1]


def test_fit_chain_stop_against_fixed_chains():
    # two kinds of positions: confident ones where the chain is right (heads say 0.95) and doubtful ones where
    # only head 0 is (heads say 0.3 after it); a cut chain drafts 3 on the first and 1 on the second
    ranks = [[0, 0, 0]] * 5 + [[0, 1, 1]] * 5
    top1 = [[0.95, 0.95, 0.95]] * 5 + [[0.9, 0.3, 0.3]] * 5
    lead, conf, _ = chain_outcomes(_records(ranks, top1))
    cost = [1.0, 1.1, 1.3, 1.5]
    fit = fit_chain_stop(lead, conf, cost)
    assert fit["chains"][1] == pytest.approx(20 / 11, abs=1e-4)  # 2 tokens per step everywhere, cost 1.1
    assert fit["chains"][3] == pytest.approx((5 * 4 + 5 * 2) / 15, abs=1e-4)
    best = fit["best"]
    assert best["depth"] == 3 and best["speedup"] == pytest.approx((5 * 4 + 5 * 2) / (5 * 1.5 + 5 * 1.1), abs=1e-4)
    assert 0.9 * 0.3 < best["chain_stop"] <= 0.95 ** 3  # between the doubtful and the confident paths
    assert best["speedup"] > max(fit["chains"].values())


def test_ladder_evaluated_on_outcomes():
    costs = {1: 1.1, 2: 1.2, 4: 1.5}
    hot = _choice(0, 0.0, 1.0, [[0.9, 0.05], [0.8, 0.1]], costs)
    cold = _choice(1, 1.0, math.inf, [[0.05, 0.05], [0.05, 0.0]], costs)
    ranks = torch.tensor([[0, 0], [0, 1], [1, 0], [0, 0]])
    score = torch.tensor([0.5, 0.5, 0.5, 2.0, 0.1])  # the last position has no full label
    full = torch.tensor([True, True, True, True, False])
    tree = set(hot.chosen.key)
    acc = []
    for r in ranks.tolist()[:3]:
        d = 0
        while d < 2 and tuple(r[:d + 1]) in tree:
            d += 1
        acc.append(d)
    expected = (3 + sum(acc) + 1) / (3 * hot.chosen.cost + 1)  # the cold bin drafts nothing
    assert cold.chosen is None
    assert schedule_speedup_on_outcomes([hot, cold], score, full, ranks) == pytest.approx(expected, abs=1e-4)


def test_tree_set_with_a_chain_stop_schedules_one_cut_chain(tmp_path):
    costs = {1: 1.05, 2: 1.1, 4: 1.12}
    choices = [_choice(0, 0.0, 0.5, [[0.9, 0.05], [0.8, 0.1]], costs), _choice(1, 0.5, math.inf,
                                                                              [[0.5, 0.1], [0.3, 0.1]], costs)]
    chains = [Candidate(bin=0, budget=n, paths=tuple((0,) * k for k in range(1, n + 1)), accepted=0.5 * n,
                          verify_cost=1.0 + 0.05 * n, draft_cost=0.0) for n in (2, 1)]
    keys = {c.key for b in choices for c in b.candidates} | {c.key for c in chains}
    times = {"verify": {n: 10.0 * x for n, x in costs.items()}, "draft": {k: 0.5 for k in keys}}
    obj, bin_ids = build_tree_set(choices, name="t", heads_kind="hydra", num_heads=2, times_ms=times,
                                    calibration={"prompts": "hand", "positions": 20}, chain_stop=(0.35, chains))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(obj))
    ts = load_tree_set(str(path), num_heads=2)
    tid = ts.schedule.tree_ids[0]
    assert ts.get(tid) == Tree.chain(2)
    # bin_ids: the bins' ladder it replaced (for the printed summary), each bin's own scheduled tree
    assert [ts.get(i) for i in bin_ids] == [Tree([list(p) for p in b.scheduled.key]) for b in choices]
    # an entropy set: the cut chain for everyone
    assert ts.schedule.tree_ids == (tid,) and ts.schedule.thresholds == () and ts.schedule.chain_stop == 0.35
    assert "cut where the heads' path confidence falls below 0.35" in ts.description
    assert "the bins' ladder it replaced: bin 0" in ts.description
    assert TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set=str(path)), ts).ladder_ids == [tid]
    # a confidence set: the 1-node chain below tau (the same drafts; a step down under load before none)
    for b in choices:
        b.stats.signal = "confidence"
    obj, _ = build_tree_set(choices, name="t", heads_kind="hydra", num_heads=2, times_ms=times,
                              calibration={"prompts": "hand", "positions": 20}, chain_stop=(0.35, chains))
    path.write_text(json.dumps(obj))
    ts = load_tree_set(str(path), num_heads=2)
    one = ts.schedule.tree_ids[1]
    assert ts.schedule.tree_ids == (tid, one) and ts.get(one) == Tree.chain(1)
    assert ts.schedule.thresholds == (0.35,) and ts.schedule.hysteresis == 0.0 and ts.schedule.chain_stop == 0.35
    sched = TreeScheduler.from_config(EntMTPConfig(policy="confidence", tree_set=str(path)), ts)
    assert sched.ladder_ids == [tid, one] and sched.hysteresis == 0.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama (hidden 32) with the SmolLM2 tokenizer and chat template. Its embeddings are
    scaled up so that its greedy continuation is confident (it repeats a token, which near-identity heads then
    predict: the statistics have hits, the trees more than one node)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_entmtp.models import default_model_dir

    src = default_model_dir()
    if not (src / "tokenizer.json").is_file():
        pytest.skip("the default model is not prepared (run `vllm-entmtp prepare`)")
    out = tmp_path_factory.mktemp("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True, max_position_embeddings=256))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(30.0)
    model.save_pretrained(out)
    return out, vocab


def _hydra_heads(path, vocab):
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig

    torch.manual_seed(2)
    heads = HydraHeads(HydraHeadsConfig(hidden_size=32, vocab_size=vocab, hydra_num_heads=3,
                                        truncated_vocab_size=4000))
    for name, p in heads.named_parameters():
        if "linear" in name:
            torch.nn.init.normal_(p, std=0.05)
    heads.token_map.copy_(torch.arange(4000).flip(0))  # draft column j is token 3999 - j
    heads.save(path)


def _build(tmp_path, model, heads, *extra):
    out = tmp_path / "calib" / "set.json"
    argv = ["build-trees", "--model", str(model), "--heads", str(heads), "--out", str(out), "--num-prompts", "3",
            "--max-tokens", "8", "--cost-context", "16", "--cost-repeats", "1", "--node-budgets", "1,2,4,6",
            "--entropy-bins", "2", *extra]
    return cli_main(argv), out


def test_build_trees_end_to_end(tiny_model, tmp_path, capsys):
    model, vocab = tiny_model
    make_heads(tmp_path / "medusa", hidden_size=32, vocab_size=vocab, num_heads=3)
    rc, out = _build(tmp_path, model, tmp_path / "medusa", "--prompt-set", "humaneval")
    assert rc == 0
    ts = load_tree_set(str(out), num_heads=3)
    assert ts.heads_kind == "medusa" and ts.schedule.signal == "entropy"
    TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set=str(out)), ts)
    cal = ts.metadata[ts.ids[0]]["calibration"]
    assert cal["num_prompts"] == 3 and cal["positions"] > 0 and len(cal["bins"][0]["P"]) == 3
    assert set(cal["cost"]["verify_ms"]) >= {"0", "1"}
    lookup = cal["lookup"]  # the prompt lookup scored at every generated position of the same prompts
    assert lookup["positions"] == cal["positions"] and 0 <= lookup["drafts"] <= lookup["positions"]
    assert (lookup["prompt_lookup_min"], lookup["prompt_lookup_max"], lookup["max_tokens"]) == (2, 4, 4)
    assert out.with_suffix(".png").stat().st_size > 0
    caches = list(out.parent.glob("set.stats-*.pt"))
    assert len(caches) == 1
    printed = capsys.readouterr()
    assert "speed-up" in printed.out and "bonus" in printed.out
    # a rerun with other budgets and bins reads the statistics from the cache
    rc, _ = _build(tmp_path, model, tmp_path / "medusa", "--prompt-set", "humaneval", "--node-budgets", "1,3",
                   "--entropy-edges", "0.5", "--max-rank", "4")
    assert rc == 0 and "3 prompt(s) done" in capsys.readouterr().err
    assert load_tree_set(str(out)).metadata[load_tree_set(str(out)).ids[0]]["calibration"]["max_rank"] == 4

    # Hydra heads with a truncated draft vocabulary, prompts from a JSONL file
    _hydra_heads(tmp_path / "hydra", vocab)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "def add(a, b):"}\n\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    rc, out = _build(tmp_path, model, tmp_path / "hydra", "--jsonl", str(jsonl), "--name", "hy")
    assert rc == 0
    ts = load_tree_set(str(out), num_heads=3)
    assert ts.heads_kind == "hydra" and ts.name == "hy"
    assert ts.metadata[ts.ids[0]]["calibration"]["num_prompts"] == 2
    TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set=str(out)), ts)

    # the confidence signal, with step costs measured in vLLM: from the cache, no new statistics
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"step_cost_by_nodes": {"1": 1.01, "2": 1.02, "3": 1.03, "24": 1.24}}))
    rc, out = _build(tmp_path, model, tmp_path / "hydra", "--jsonl", str(jsonl), "--name", "hy", "--signal",
                     "confidence", "--bins", "2", "--step-costs", str(costs), "--decode-row-cost", "0.1")
    assert rc == 0 and "2 prompt(s) done" in capsys.readouterr().err
    ts = load_tree_set(str(out), num_heads=3)
    cal = ts.metadata[ts.ids[0]]["calibration"]
    assert ts.schedule.signal == "confidence" and cal["signal"] == "confidence" and cal["signal_window"] == 1
    assert cal["confidence_heads"] == 1
    assert {"entropy_ema", "confidence_1_heads"} <= set(cal["signal_correlations"])
    assert cal["expected_overall"]["schedule"] > 0
    assert all(0 <= x <= 1 for x in ts.schedule.thresholds)
    assert list(ts.schedule.thresholds) == sorted(ts.schedule.thresholds, reverse=True)
    assert "confidence_range" in cal["bins"][0]
    for tid in ts.ids:  # every tree costs what the measured table says for its size
        md = ts.metadata[tid]
        assert md["cost"]["total"] == pytest.approx(1 + 0.01 * md["num_nodes"], abs=1e-4)
    sched = TreeScheduler.from_config(EntMTPConfig(policy="confidence", tree_set=str(out)), ts)
    assert cal["cost"]["decode_row_cost"] == 0.1  # the load cost model reads it, and every tree's statistics
    assert not sched.cost_model and sched.decode_row_cost == 0.1  # "cap" is the default load policy
    assert TreeScheduler.from_config(EntMTPConfig(policy="confidence", tree_set=str(out), load_policy="cost"),
                                     ts).cost_model
    with pytest.raises(Exception, match="signal 'confidence'"):
        TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set=str(out)), ts)
    assert sched.policy == "confidence"

    # --chain-stop: a chain cut by the heads' path confidence, fitted on the same positions (from the cache)
    rc, out = _build(tmp_path, model, tmp_path / "hydra", "--jsonl", str(jsonl), "--name", "hy", "--signal",
                     "confidence", "--bins", "2", "--step-costs", str(costs), "--chain-stop", "0.4")
    assert rc == 0 and "chain stop, position by position" in capsys.readouterr().out
    ts = load_tree_set(str(out), num_heads=3)
    info = ts.metadata[ts.ids[0]]["calibration"]["chain_stop"]
    assert info["asked"] == 0.4 and info["chosen"]["chain_stop"] == 0.4 and ts.schedule.chain_stop == 0.4
    assert ts.get(ts.schedule.tree_ids[0]) == Tree.chain(info["chosen"]["depth"])
    assert set(info["chains"]) == {"1", "2", "3"} or set(info["chains"]) == {1, 2, 3}
    TreeScheduler.from_config(EntMTPConfig(policy="confidence", tree_set=str(out)), ts)
    rc, out = _build(tmp_path, model, tmp_path / "hydra", "--jsonl", str(jsonl), "--name", "hy", "--signal",
                     "confidence", "--bins", "2", "--step-costs", str(costs), "--chain-stop", "auto")
    assert rc == 0
    info = load_tree_set(str(out), num_heads=3).metadata[ts.ids[0]]["calibration"]["chain_stop"]
    assert info["asked"] == "auto" and len(info["cut"]["2"]) == len(CHAIN_STOP_GRID)
    assert (info["chosen"] is not None) == (info["best"]["speedup"] > info["ladder"])


def test_build_trees_bad_inputs(tiny_model, tmp_path):
    model, vocab = tiny_model
    make_heads(tmp_path / "wide", hidden_size=64, vocab_size=vocab, num_heads=2)
    with pytest.raises(SystemExit, match="hidden_size"):
        _build(tmp_path, model, tmp_path / "wide", "--prompt-set", "humaneval")
    with pytest.raises(SystemExit, match="unknown prompt set 'nope'"):
        _build(tmp_path, model, tmp_path / "wide", "--prompt-set", "nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(SystemExit, match="line 1"):
        _build(tmp_path, model, tmp_path / "wide", "--jsonl", str(bad))
    for opt in (["--node-budgets", "0,2"], ["--max-tokens", "1"], ["--signal", "nope"], ["--chain-stop", "1.5"],
                ["--chain-stop", "often"]):
        with pytest.raises(SystemExit):
            _build(tmp_path, model, tmp_path / "wide", "--prompt-set", "humaneval", *opt)
    make_heads(tmp_path / "ok", hidden_size=32, vocab_size=vocab, num_heads=2)
    for opt, msg in ((["--edges", "0.5,0.2"], "strictly increasing"),
                     (["--signal", "confidence", "--edges", "0.2,0.5"], "strictly decreasing"),
                     (["--step-costs", str(tmp_path / "absent.json")], "--step-costs"),
                     (["--decode-row-cost", "2"], "--decode-row-cost 2.0: expected a number in"),
                     (["--chain-stop", "auto"], "--chain-stop needs --step-costs")):
        with pytest.raises(SystemExit, match=msg):  # before any statistics are computed
            _build(tmp_path, model, tmp_path / "ok", "--prompt-set", "humaneval", *opt)


def test_verification_times_are_made_monotone():
    assert monotone_times({0: 1.0, 1: 1.2, 2: 1.1, 4: 1.5, 3: 1.4}) == {0: 1.0, 1: 1.2, 2: 1.2, 3: 1.4, 4: 1.5}
