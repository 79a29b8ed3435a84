"""Trees (canonical order, derived data, validation), tree-set files (loading, errors naming the entry,
shipped sets) and building per-request drafts from the heads' top-k tokens."""
import json
import re

import pytest
import torch

from vllm_entmtp.errors import TreeSetError
from vllm_entmtp.tree_proposal import build_tree_drafts, needed_heads, needed_topk
from vllm_entmtp.trees import (TREES_ENV, Schedule, Tree, available_tree_sets, load_tree_set, parse_inline_tree,
                               shipped_trees_dir)

# Medusa's mc_sim_7b_63, FasterDecoding/Medusa medusa/model/medusa_choices.py, in its own (greedy-search) order.
MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
                [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
                [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
                [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
                [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1],
                [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]


# -- Tree -------------------------------------------------------------------------------------------------------


def test_canonical_order_is_breadth_first_then_lexicographic():
    t = Tree([[0, 1], [1, 0], [1], [0, 0, 0], [0], [0, 0], [2]])
    assert t.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert Tree(reversed(t.to_list())) == t and hash(Tree(t.paths)) == hash(t)
    assert t.num_nodes == len(t) == 7 and t.depth == 3


def test_parents_depths_ranks():
    t = Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert t.parents == [0, 0, 0, 1, 1, 2, 4]
    assert t.depths == [1, 1, 1, 2, 2, 2, 3]
    assert t.ranks == [0, 1, 2, 0, 1, 0, 0]
    assert t.max_rank_per_depth == [2, 1, 0]
    assert t.children == [[1, 2, 3], [4, 5], [6], [], [7], [], [], []]


def test_ancestor_mask_small_tree():
    t = Tree([[0], [1], [0, 0]])  # nodes 1:[0] 2:[1] 3:[0,0]
    m = t.ancestor_mask()
    assert m.dtype == torch.bool and m.shape == (4, 4)
    assert m.int().tolist() == [[1, 0, 0, 0],
                                [1, 1, 0, 0],
                                [1, 0, 1, 0],
                                [1, 1, 0, 1]]
    m[0, 1] = True  # a copy: the tree is not changed
    assert not t.ancestor_mask()[0, 1]


def test_ancestor_mask_is_the_prefix_relation_on_paths():
    t = Tree(MC_SIM_7B_63)
    m = t.ancestor_mask()
    paths = [()] + list(t.paths)
    for i, pi in enumerate(paths):
        for j, pj in enumerate(paths):
            assert bool(m[i, j]) == (pi[:len(pj)] == pj), (pi, pj)


def test_every_prefix_is_a_tree_with_the_same_structure():
    t = Tree(MC_SIM_7B_63)
    mask = t.ancestor_mask()
    for n in range(1, t.num_nodes + 1):
        p = t.prefix(n)
        assert p.paths == t.paths[:n]
        assert p.parents == t.parents[:n] and p.depths == t.depths[:n]
        assert torch.equal(p.ancestor_mask(), mask[:n + 1, :n + 1])
    assert t.prefix(t.num_nodes) is t
    for bad in (0, 64, -1):
        with pytest.raises(ValueError, match="prefix"):
            t.prefix(bad)


def test_chain():
    assert Tree.chain(3).paths == ((0,), (0, 0), (0, 0, 0))
    assert Tree.chain(4).parents == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        Tree.chain(0)


def test_missing_left_sibling_is_allowed():
    t = Tree([[2], [0], [0, 3]])
    assert t.paths == ((0,), (2,), (0, 3)) and t.max_rank_per_depth == [2, 3]


@pytest.mark.parametrize("paths,message", [
    ([], r"empty tree"),
    ([[0], []], r"paths\[1\] is an empty path"),
    ([[0], [0, -1]], r"path \[0, -1\] has negative rank -1"),
    ([[0], [1], [0]], r"duplicate node: path \[0\]"),
    ([[0], [0, 1, 0]], r"path \[0, 1, 0\] has no parent: path \[0, 1\] is missing"),
    ([[1], [0, 1]], r"path \[0, 1\] has no parent: path \[0\] is missing"),
    ([[0], [0, "1"]], r"path \[0, '1'\] has rank '1', not an int"),
    ([[0], [True]], r"rank True, not an int"),
    ([[0], 3], r"paths\[1\] = 3 is not a list"),
    ("[[0]]", r"a tree is a list of paths"),
])
def test_tree_validation_names_the_offending_path(paths, message):
    with pytest.raises(TreeSetError, match=message):
        Tree(paths)


def test_depth_is_checked_against_the_heads():
    Tree(MC_SIM_7B_63, max_depth=4)
    with pytest.raises(TreeSetError, match=r"path \[0, 0, 0, 0\] has depth 4, deeper than the 3 heads"):
        Tree(MC_SIM_7B_63, max_depth=3)


def test_inline_tree():
    assert parse_inline_tree([[0], [0, 0]], 2) == Tree.chain(2)
    assert parse_inline_tree([[0], [0, 0], [0, 0, 0]], None).depth == 3
    with pytest.raises(TreeSetError, match=r"^inline tree: path \[0, 0, 0\] has depth 3, deeper than the 2 heads"):
        parse_inline_tree([[0], [0, 0], [0, 0, 0]], 2)
    with pytest.raises(TreeSetError, match=r"^inline tree: path \[1, 0\] has no parent"):
        parse_inline_tree([[0], [1, 0]], 4)


# -- tree-set files ---------------------------------------------------------------------------------------------


def _entry(tid, paths, **md):
    t = Tree(paths)
    return {"id": tid, "paths": paths, "metadata": {"num_nodes": t.num_nodes, "depth": t.depth, **md}}


def _set(trees, num_heads=4, **extra):
    return {"schema_version": 1, "name": "t", "heads": {"kind": "medusa", "num_heads": num_heads},
            "trees": trees, **extra}


def _write(tmp_path, obj, name="t.json"):
    f = tmp_path / name
    f.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=1))
    return f


def test_load_a_valid_file(tmp_path):
    f = _write(tmp_path, _set([_entry("a", [[0]]), _entry("b", [[0, 0], [0]], accept_len=1.7)],
                              description="x"))
    ts = load_tree_set(f, num_heads=2)
    assert ts.name == "t" and ts.heads_kind == "medusa" and ts.num_heads == 4 and ts.source == f
    assert ts.ids == ["a", "b"] and ts.get("b") == Tree.chain(2) and [t for _, t in ts.trees][0] == Tree.chain(1)
    assert ts.metadata["b"] == {"num_nodes": 2, "depth": 2, "accept_len": 1.7}
    with pytest.raises(TreeSetError, match=r"no tree 'c'; it has 'a', 'b'"):
        ts.get("c")
    assert load_tree_set(str(f)).ids == ["a", "b"]  # a string with a separator is a path too


def test_malformed_json_names_file_line_and_column(tmp_path):
    f = _write(tmp_path, '{\n  "schema_version": 1,\n  "name": "t",,\n}')
    with pytest.raises(TreeSetError, match=re.escape(f"tree set {f}: malformed JSON at line 3, column 15")):
        load_tree_set(f)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(extra=1), r"extra: Extra inputs are not permitted"),
    (lambda d: d.update(schema_version=2), r"schema_version: Input should be 1"),
    (lambda d: d["heads"].update(kind="eagle"), r"heads.kind: Input should be 'medusa' or 'hydra'"),
    (lambda d: d.update(trees=[]), r"trees: List should have at least 1 item"),
    (lambda d: d["trees"][1].update(colour="red"), r"tree 'b' \(trees\[1\]\) colour: Extra inputs"),
    (lambda d: d["trees"][1]["paths"].__setitem__(1, [0, "x"]),
     r"tree 'b' \(trees\[1\]\) paths\[1\]\[1\] \(path \[0, \"x\"\]\): Input should be a valid integer"),
    (lambda d: d["trees"][1]["paths"].__setitem__(1, [0, 1.5]), r"paths\[1\]\[1\] \(path \[0, 1.5\]\)"),
    (lambda d: d["trees"][1]["metadata"].pop("depth"), r"tree 'b' \(trees\[1\]\) metadata.depth: Field required"),
])
def test_schema_errors_name_file_and_entry(tmp_path, mutate, message):
    d = _set([_entry("a", [[0]]), _entry("b", [[0], [0, 0]])])
    mutate(d)
    f = _write(tmp_path, d)
    with pytest.raises(TreeSetError, match=re.escape(f"tree set {f}: ") + ".*" + message):
        load_tree_set(f)


@pytest.mark.parametrize("trees,message", [
    ([_entry("a", [[0]]), {"id": "b", "paths": [[0], [0, 2, 0]], "metadata": {"num_nodes": 2, "depth": 3}}],
     r"tree 'b': path \[0, 2, 0\] has no parent: path \[0, 2\] is missing"),
    ([{"id": "dup", "paths": [[0], [1], [1]], "metadata": {"num_nodes": 3, "depth": 1}}],
     r"tree 'dup': duplicate node: path \[1\] appears more than once"),
    ([{"id": "e", "paths": [], "metadata": {"num_nodes": 0, "depth": 0}}], r"tree 'e': empty tree"),
    ([{"id": "neg", "paths": [[0], [-2]], "metadata": {"num_nodes": 2, "depth": 1}}],
     r"tree 'neg': path \[-2\] has negative rank -2"),
    ([_entry("a", [[0]]), _entry("a", [[1]])], r"tree 'a': duplicate tree id"),
    ([_entry("deep", [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]])],
     r"tree 'deep': path \[0, 0, 0, 0, 0\] has depth 5, deeper than the 4 heads.*heads.num_heads=4"),
    ([{"id": "m", "paths": [[0], [0, 0]], "metadata": {"num_nodes": 3, "depth": 2}}],
     r"tree 'm': metadata says num_nodes=3, depth=2 but the paths give num_nodes=2, depth=2"),
])
def test_tree_errors_name_file_tree_and_path(tmp_path, trees, message):
    f = _write(tmp_path, _set(trees))
    with pytest.raises(TreeSetError, match=re.escape(f"tree set {f}: ") + message):
        load_tree_set(f)


def test_path_deeper_than_the_loaded_heads(tmp_path):
    f = _write(tmp_path, _set([_entry("ok", [[0]]), _entry("d3", [[0], [0, 0], [0, 0, 0]])]))
    load_tree_set(f, num_heads=3)
    with pytest.raises(TreeSetError, match=re.escape(f"tree set {f}: tree 'd3': path [0, 0, 0] has depth 3, "
                                                     "deeper than the 2 heads") + r".*num_heads=2"):
        load_tree_set(f, num_heads=2)


def test_unknown_name_lists_the_available_ones():
    with pytest.raises(TreeSetError, match=r"unknown tree set 'nope'.*available: .*chain4, .*default, .*ladder, medusa63, .*small"):
        load_tree_set("nope")


def test_missing_file(tmp_path):
    with pytest.raises(TreeSetError, match="does not exist"):
        load_tree_set(tmp_path / "absent.json")


def test_env_folders_are_searched_first(tmp_path, monkeypatch):
    _write(tmp_path, _set([_entry("mine", [[0], [1]])]), name="default.json")
    _write(tmp_path, _set([_entry("x", [[0]])]), name="extra.json")
    monkeypatch.setenv(TREES_ENV, str(tmp_path))
    assert load_tree_set("default").ids == ["mine"]
    assert load_tree_set("extra").ids == ["x"]
    assert {"extra", "default", "medusa63"} <= set(available_tree_sets())


# -- the optional schedule ---------------------------------------------------------------------------------------


def _scheduled(**schedule):
    sched = {"signal": "entropy", "thresholds": [0.3, 0.9], "tree_ids": ["c", "b", "a"], **schedule}
    return _set([_entry("a", [[0]]), _entry("b", [[0], [0, 0]]), _entry("c", [[0], [1], [0, 0]])], schedule=sched)


def test_schedule_is_optional_and_loaded(tmp_path):
    assert load_tree_set(_write(tmp_path, _set([_entry("a", [[0]])]))).schedule is None
    ts = load_tree_set(_write(tmp_path, _scheduled(hysteresis=0.1)))
    assert ts.schedule == Schedule(signal="entropy", thresholds=(0.3, 0.9), tree_ids=("c", "b", "a"), hysteresis=0.1)
    ts = load_tree_set(_write(tmp_path, _scheduled(signal="confidence", thresholds=[0.7, 0.2])))
    assert ts.schedule.signal == "confidence" and ts.schedule.hysteresis is None
    ts = load_tree_set(_write(tmp_path, _scheduled(thresholds=[1], tree_ids=["a", "c"])))  # JSON int is a number
    assert ts.schedule.thresholds == (1.0,) and ts.ids == ["a", "b", "c"]  # trees keep file order
    for name in ["chain4", "ladder", "medusa63", "small"]:
        assert load_tree_set(name).schedule is None
    ts = load_tree_set(_write(tmp_path, _scheduled(signal="confidence", thresholds=[0.7, 0.2], chain_stop=0.25)))
    assert ts.schedule.chain_stop == 0.25 and _scheduled()["schedule"].get("chain_stop") is None


@pytest.mark.parametrize("schedule,message", [
    (dict(thresholds=[0.3]), r"schedule: 3 tree_ids need 2 thresholds \(one between each pair of neighbouring "
                             r"trees\), got 1"),
    (dict(thresholds=[0.9, 0.3]), r"schedule.thresholds\[1\] = 0.3 is not greater than thresholds\[0\] = 0.9 "
                                  r"\(entropy thresholds must be strictly increasing"),
    (dict(thresholds=[0.3, 0.3]), r"schedule.thresholds\[1\] = 0.3 is not greater than"),
    (dict(thresholds=[-0.1, 0.3]), r"schedule.thresholds\[0\] = -0.1: an entropy threshold \(nats\) must be >= 0"),
    (dict(signal="confidence"), r"schedule.thresholds\[1\] = 0.9 is not less than thresholds\[0\] = 0.3 "
                                r"\(confidence thresholds must be strictly decreasing"),
    (dict(signal="confidence", thresholds=[1.5, 0.3]), r"schedule.thresholds\[0\] = 1.5: a confidence threshold "
                                                       r"must be in \[0, 1\]"),
    (dict(tree_ids=["c", "x", "a"]), r"schedule.tree_ids\[1\] 'x' is not a tree of this set; it has 'a', 'b', 'c'"),
    (dict(tree_ids=["c", "b", "c"]), r"schedule.tree_ids\[2\] 'c' is already tree_ids\[0\]"),
    (dict(signal="loss"), r"schedule.signal: Input should be 'entropy' or 'confidence' \(got 'loss'\)"),
    (dict(thresholds=[0.3, "0.9"]), r"schedule.thresholds\[1\]: Input should be a valid number"),
    (dict(thresholds=[0.3, float("nan")]), r"schedule.thresholds: Value error, thresholds\[1\] = nan is not a "
                                           r"finite number"),
    (dict(hysteresis=-1.0), r"schedule.hysteresis: Input should be greater than or equal to 0"),
    (dict(tree_ids=[]), r"schedule.tree_ids: List should have at least 1 item"),
    (dict(chain_stop=1.0), r"schedule.chain_stop: Input should be less than 1"),
    (dict(chain_stop="0.5"), r"schedule.chain_stop: Input should be a valid number"),
    (dict(chain_stop=0.0), r"schedule.chain_stop: Input should be greater than 0"),
    (dict(colour="red"), r"schedule.colour: Extra inputs are not permitted"),
])
def test_schedule_errors_name_file_and_entry(tmp_path, schedule, message):
    f = _write(tmp_path, _scheduled(**schedule))
    with pytest.raises(TreeSetError, match=re.escape(f"tree set {f}: ") + message):
        load_tree_set(f)


def test_schedule_without_tree_ids_key_is_refused(tmp_path):
    d = _scheduled()
    del d["schedule"]["tree_ids"]
    f = _write(tmp_path, d)
    with pytest.raises(TreeSetError, match=r"schedule.tree_ids: Field required"):
        load_tree_set(f)


# -- shipped tree sets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chain4", "small", "medusa63", "ladder", "default", "humaneval", "gsm8k",
                                  "sharegpt", "creative"])
def test_shipped_sets_load_against_four_heads(name):
    assert (shipped_trees_dir() / f"{name}.json").is_file()
    ts = load_tree_set(name, num_heads=4)
    assert ts.heads_kind in ("medusa", "hydra") and ts.num_heads == 4 and len(ts) >= 1
    for _, t in ts.trees:
        assert t.depth <= 4


def test_every_file_in_trees_folder_validates():
    files = sorted(shipped_trees_dir().glob("*.json"))
    assert files
    for f in files:
        load_tree_set(f, num_heads=4)


def test_shipped_contents():
    assert load_tree_set("chain4").trees == [("chain4", Tree.chain(4))]
    mc = load_tree_set("medusa63").get("mc_sim_7b_63")
    assert mc == Tree(MC_SIM_7B_63) and mc.num_nodes == 63 and mc.depth == 4
    raw = json.loads((shipped_trees_dir() / "medusa63.json").read_text())
    assert raw["trees"][0]["paths"] == MC_SIM_7B_63  # stored in Medusa's own order
    ladder = load_tree_set("ladder")
    assert [t.num_nodes for _, t in ladder.trees] == [1, 2, 6, 12, 24]
    assert ladder.get("chain1") == Tree.chain(1) and ladder.get("chain2") == Tree.chain(2)
    for _, t in ladder.trees:
        assert t == Tree(MC_SIM_7B_63[:t.num_nodes])  # the first n nodes of Medusa's greedy order
    for name in ("default", "humaneval", "gsm8k", "sharegpt", "creative"):  # calibrated: build-trees
        ts = load_tree_set(name, num_heads=4)
        assert ts.heads_kind == "hydra" and ts.schedule is not None and ts.schedule.signal == "confidence", name
        cal = ts.metadata[ts.ids[0]]["calibration"]
        assert cal["signal"] == "confidence" and cal["confidence_heads"] == 1 and cal["signal_window"] == 1, name
        assert "step_costs" in cal["cost"] and (shipped_trees_dir() / "plots" / f"{name}.png").is_file()
    for tid, t in load_tree_set("small").trees:
        assert 6 <= t.num_nodes <= 10 and t.depth <= 4, tid


# -- drafts from top-k ------------------------------------------------------------------------------------------


def test_build_tree_drafts_uses_depth_and_rank_only():
    heads, b, k = 3, 3, 4
    topk = (torch.arange(heads).view(heads, 1, 1) * 100 + torch.arange(b).view(1, b, 1) * 10
            + torch.arange(k).view(1, 1, k))  # token = 100*head + 10*request + rank
    t1 = Tree([[0], [1], [0, 0], [1, 0], [0, 3], [0, 0, 2]])
    out = build_tree_drafts(topk, [t1, None, Tree.chain(2)])
    assert out == [[0, 1, 100, 103, 100, 202], [], [20, 120]]
    assert needed_topk([t1, None]) == 4 and needed_heads([t1, None]) == 3
    assert needed_topk([None]) == 0 and build_tree_drafts(topk[:, :1], [None]) == [[]]


def test_build_tree_drafts_checks_heads_and_topk():
    topk = torch.zeros(2, 1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="depth 3 but topk_ids has only 2 heads"):
        build_tree_drafts(topk, [Tree.chain(3)])
    with pytest.raises(ValueError, match="rank 3 but topk_ids has only top-3"):
        build_tree_drafts(topk, [Tree([[3]])])
    with pytest.raises(ValueError, match="B=1 requests but 2 trees"):
        build_tree_drafts(topk, [None, None])
    with pytest.raises(ValueError, match="integer tensor"):
        build_tree_drafts(topk.float(), [None])


def test_top1_chain_is_what_a_runner_without_tree_attention_drafts():
    assert Tree.chain(3).top1_chain() == Tree.chain(3)
    assert Tree([[1], [1, 0]]).top1_chain() == Tree([[1], [1, 0]])  # a chain of other ranks: causal is right
    assert Tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]]).top1_chain() == Tree.chain(3)
    assert Tree([[0], [1], [1, 0]]).top1_chain() == Tree.chain(1)
    assert Tree([[1], [2]]).top1_chain() is None  # no top-1 path: nothing to draft


def test_chains_only_keeps_the_schedule_on_the_sets_chains(tmp_path):
    from vllm_entmtp.scheduler import TreeScheduler
    from vllm_entmtp.trees import NO_DRAFT_ID, chains_only

    trees = [_entry("c1", [[0]], calibration={"edges": [0.5]}), _entry("c2", [[0], [0, 0]], note="c2's"),
             _entry("t3", [[0], [1], [0, 0]]), _entry("t4", [[0], [0, 0], [0, 1], [0, 0, 0]]),
             _entry("t5", [[0], [1], [2], [1, 0]]), _entry("w", [[1], [2]])]
    sched = {"signal": "confidence", "thresholds": [0.8, 0.6, 0.4, 0.2], "tree_ids": ["t4", "t3", "c2", "t5", "w"]}
    ts = load_tree_set(_write(tmp_path, _set(trees, schedule=sched)))
    ch = chains_only(ts)
    # t3's top-1 chain is c2 (its metadata goes with it); t4's is a 3-chain the set lacks; w has no top-1 path
    assert ch.aliases == {"t3": "c2", "t4": "chain3", "t5": "c1", "w": NO_DRAFT_ID}
    assert ch.ids == ["c1", "c2", "chain3"] and all(t.is_chain for _, t in ch.trees)
    assert ch.get("t4") == Tree.chain(3) and ch.get("t3") == Tree.chain(2)  # held requests get the chain
    assert ch.metadata["c2"]["note"] == "c2's" and "chain3" not in ch.metadata
    assert ch.metadata["c1"]["calibration"] == {"edges": [0.5]}
    # bins on one chain merge: t3 and c2 are both c2 now, so the 0.6 edge between them goes
    assert ch.schedule.tree_ids == ("chain3", "c2", "c1", NO_DRAFT_ID)
    assert ch.schedule.thresholds == (0.8, 0.4, 0.2) and ch.schedule.signal == "confidence"
    s = TreeScheduler(ch, "confidence", default_tree_id="t3")
    assert s.default_tree_id == "c2" and [t.num_nodes if t else 0 for t in s.ladder] == [3, 2, 1, 0]
    only = load_tree_set(_write(tmp_path, _set(trees[:2]), name="chains.json"))
    assert chains_only(only) is only  # nothing to replace
    # the first tree carries the set's calibration: it moves to the first chain when that tree branches
    first = load_tree_set(_write(tmp_path, _set([_entry("t", [[0], [1]], calibration={"edges": [0.1]}),
                                                 _entry("c", [[0]])]), name="first.json"))
    assert chains_only(first).metadata["c"]["calibration"] == {"edges": [0.1]}
    # a new chain's id never takes another tree's: "chain2" here is a branching tree of the file
    clash = chains_only(load_tree_set(_write(tmp_path, _set([_entry("t", [[0], [1], [0, 0]]),
                                                             _entry("chain2", [[0], [1]])]), name="clash.json")))
    assert clash.aliases == {"t": "chain2'", "chain2": "chain1"}
    assert clash.get("t") == Tree.chain(2) and clash.get("chain2") == Tree.chain(1)
    with pytest.raises(TreeSetError, match="none of its trees has a top-1 path"):
        chains_only(load_tree_set(_write(tmp_path, _set([_entry("w", [[1], [2]])]), name="w.json")))
