"""TreeScheduler: threshold ladder, hysteresis, warm-up, node budget, confidence direction (no vLLM)."""
import json
from pathlib import Path

import pytest

from vllm_entmtp.config import EntMTPConfig
from vllm_entmtp.entropy import EntropyTracker, Signals
from vllm_entmtp.load_rules import DEFAULT_MAX_VERIFY_TOKENS, node_budget
from vllm_entmtp.scheduler import SchedulerError, TreeScheduler, fallback_thresholds
from vllm_entmtp.trees import Schedule, Tree, TreeSet, load_tree_set

# big (8 nodes) > mid (4) > small (2) > one (1)
TREES = {"one": Tree.chain(1), "small": Tree.chain(2), "mid": Tree([[0], [1], [0, 0], [0, 0, 0]]),
         "big": Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])}


def _set(schedule=None, order=("small", "big", "one", "mid")):
    return TreeSet(name="t", source=Path("t.json"), heads_kind="medusa", num_heads=4, description="",
                   trees=[(i, TREES[i]) for i in order], metadata={}, schedule=schedule)


ENT = Schedule(signal="entropy", thresholds=(0.5, 1.0, 2.0), tree_ids=("big", "mid", "small", "one"))
CONF = Schedule(signal="confidence", thresholds=(0.6, 0.3), tree_ids=("big", "small", "one"))


def ent(x, updates=10):
    return Signals(entropy_ema=x, entropy_last=x, updates=updates)


def conf(x, updates=10):
    return Signals(confidence=x, confidence_last=x, updates=updates)


def ids(choice):
    return [i for i, _ in choice]


# -- threshold mapping --------------------------------------------------------------------------------------------


def test_entropy_thresholds_map_low_entropy_to_big_trees():
    s = TreeScheduler(_set(ENT), "entropy", hysteresis=0.0, warmup_steps=0)
    assert s.ladder_source == "schedule" and s.ladder_ids == ["big", "mid", "small", "one"]
    values = [0.0, 0.49, 0.5, 0.99, 1.5, 2.0, 7.0]  # a value on a threshold goes to the conservative side
    out = s.choose([f"r{i}" for i in range(len(values))], [ent(v) for v in values])
    assert ids(out) == ["big", "big", "mid", "mid", "small", "one", "one"]
    assert out[0][1] is TREES["big"] and [s.bin_of(v) for v in values] == [0, 0, 1, 1, 2, 3, 3]


def test_confidence_policy_direction():
    s = TreeScheduler(_set(CONF), "confidence", hysteresis=0.0, warmup_steps=0)
    out = s.choose(["a", "b", "c", "d", "e"], [conf(0.9), conf(0.6), conf(0.45), conf(0.3), conf(0.01)])
    assert ids(out) == ["big", "small", "small", "one", "one"]  # high confidence -> big tree
    # the confidence policy reads Signals.confidence, not the entropy
    assert ids(s.choose(["f"], [Signals(entropy_ema=0.0, confidence=0.1, updates=9)])) == ["one"]


def test_fallback_ladder_by_size_with_even_thresholds():
    s = TreeScheduler(_set(), "entropy", warmup_steps=0, entropy_range=(0.0, 2.0))
    assert s.ladder_source == "fallback" and s.ladder_ids == ["big", "mid", "small", "one"]
    assert s.thresholds == pytest.approx([0.5, 1.0, 1.5])
    c = TreeScheduler(_set(), "confidence", warmup_steps=0)
    assert c.thresholds == pytest.approx([0.75, 0.5, 0.25])
    assert fallback_thresholds(1) == [] and fallback_thresholds(3) == pytest.approx([0.4, 0.8])
    shipped = TreeScheduler(load_tree_set("ladder"), "entropy")
    assert shipped.ladder_ids == ["mc24", "mc12", "mc6", "chain2", "chain1"] and shipped.default_tree_id == "mc24"


def test_equal_sizes_keep_file_order_in_the_fallback_ladder():
    ts = TreeSet(name="t", source=Path("t.json"), heads_kind="medusa", num_heads=4, description="",
                 trees=[("x", Tree([[0], [1]])), ("y", Tree.chain(2)), ("z", Tree.chain(3))])
    assert TreeScheduler(ts, "entropy").ladder_ids == ["z", "x", "y"]


# -- hysteresis ---------------------------------------------------------------------------------------------------


def test_hysteresis_holds_small_oscillations_and_follows_big_changes():
    s = TreeScheduler(_set(ENT), "entropy", hysteresis=0.1, warmup_steps=0)
    assert ids(s.choose(["r"], [ent(0.4)])) == ["big"]
    for v in (0.55, 0.45, 0.58, 0.42, 0.59):  # around the 0.5 threshold, less than 0.1 past it
        assert ids(s.choose(["r"], [ent(v)])) == ["big"], v
    assert s.stats.held_by_hysteresis == 3  # 0.55, 0.58, 0.59: the plain mapping says "mid"
    assert ids(s.choose(["r"], [ent(0.61)])) == ["mid"]  # crossed by more than the margin
    for v in (0.45, 0.41, 0.55):
        assert ids(s.choose(["r"], [ent(v)])) == ["mid"], v
    assert ids(s.choose(["r"], [ent(0.39)])) == ["big"]
    assert ids(s.choose(["r"], [ent(5.0)])) == ["one"]  # a big change jumps several bins at once
    assert s.stats.switches == 3 and s.current_bin("r") == 3


def test_hysteresis_is_per_request_and_free_resets_it():
    s = TreeScheduler(_set(ENT), "entropy", hysteresis=0.1, warmup_steps=0)
    s.choose(["a", "b"], [ent(0.3), ent(0.7)])
    assert ids(s.choose(["a", "b"], [ent(0.55), ent(0.55)])) == ["big", "mid"]  # same signal, own history
    s.free("a")
    assert s.current_bin("a") is None and ids(s.choose(["a"], [ent(0.55)])) == ["mid"]
    assert s.free_missing(["a"]) == 1 and len(s) == 1
    s.free("nope")


def test_schedule_hysteresis_is_used_unless_given():
    sched = Schedule(signal="entropy", thresholds=(0.5,), tree_ids=("big", "one"), hysteresis=0.3)
    assert TreeScheduler(_set(sched), "entropy").hysteresis == 0.3
    assert TreeScheduler(_set(sched), "entropy", hysteresis=0.0).hysteresis == 0.0
    assert TreeScheduler(_set(), "entropy").hysteresis == 0.05
    ts = _set(sched)
    assert TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set="x"), ts).hysteresis == 0.3
    assert TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set="x", hysteresis=0.05),
                                     ts).hysteresis == 0.05


# -- warm-up ------------------------------------------------------------------------------------------------------


def test_warmup_uses_the_default_tree():
    s = TreeScheduler(_set(ENT), "entropy", hysteresis=0.0, warmup_steps=2, default_tree_id="mid")
    tr = EntropyTracker(entropy_window=1)
    seen = []
    for _ in range(4):
        tr.update("r", 3.0)  # high entropy: "one" once trusted
        seen += ids(s.choose(["r"], [tr.signals("r")]))
    assert seen == ["mid", "one", "one", "one"]  # updates 1 < 2: warm-up; 2 updates: scheduled
    assert ids(s.choose(["new"], [tr.signals("new")])) == ["mid"]  # never updated
    assert ids(s.choose(["x"], [Signals(confidence=0.9, updates=5)])) == ["mid"]  # no entropy yet
    assert s.stats.warmup == 3


def test_default_tree_defaults_to_the_most_aggressive_and_must_be_in_the_ladder():
    assert TreeScheduler(_set(CONF), "confidence").default_tree_id == "big"
    with pytest.raises(SchedulerError, match=r"default tree 'mid' \(tree_id\) is not in the ladder.*'big', "
                                             r"'small', 'one'"):
        TreeScheduler(_set(CONF), "confidence", default_tree_id="mid")


# -- load budget --------------------------------------------------------------------------------------------------


def test_node_budget_rule():
    assert DEFAULT_MAX_VERIFY_TOKENS == 32
    assert node_budget(4) == 28 and node_budget(16) == 16 and node_budget(32) == 0 and node_budget(100) == 0
    assert node_budget(0) == 32
    assert node_budget(4, 16) == 12
    assert TreeScheduler(_set(), "entropy", max_verify_tokens_per_step=32).node_budget(8) == 24
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError):
            node_budget(1, bad)
    with pytest.raises(ValueError):
        node_budget(-1)


def test_budget_steps_down_largest_first_down_to_none():
    s = TreeScheduler(_set(ENT), "entropy", hysteresis=0.0, warmup_steps=0)
    rids, sig = ["a", "b", "c"], [ent(0.1), ent(0.7), ent(1.5)]  # big (8), mid (4), small (2) = 14 nodes
    assert ids(s.choose(rids, sig, budget_nodes=14)) == ["big", "mid", "small"]
    assert ids(s.choose(rids, sig, budget_nodes=10)) == ["mid", "mid", "small"]  # 8 -> 4
    assert ids(s.choose(rids, sig, budget_nodes=7)) == ["small", "small", "small"]  # 4 -> 2 twice (later first)
    assert ids(s.choose(rids, sig, budget_nodes=3)) == ["one", "one", "one"]
    assert ids(s.choose(rids, sig, budget_nodes=2)) == ["one", "one", None]
    assert s.choose(rids, sig, budget_nodes=0) == [(None, None)] * 3
    # the budget never changes the bin a request's signal holds
    assert [s.current_bin(r) for r in rids] == [0, 1, 2]
    assert s.stats.no_draft == 4
    with pytest.raises(ValueError, match="budget_nodes"):
        s.choose(rids, sig, budget_nodes=-1)


def test_requests_skipped_for_their_lookup_draft_take_no_share_of_the_budget():
    """A request whose prompt-lookup draft wins anyway gets no tree, and the budget goes to the others: before,
    its tree counted against the cap and was then thrown away, stepping the others down for nothing."""
    s = TreeScheduler(_set(ENT), "entropy", hysteresis=0.0, warmup_steps=0)
    rids, sig = ["a", "b", "c"], [ent(0.1), ent(0.7), ent(1.5)]  # big (8), mid (4), small (2)
    assert ids(s.choose(rids, sig, budget_nodes=10)) == ["mid", "mid", "small"]
    assert ids(s.choose(rids, sig, budget_nodes=10, skip={0})) == [None, "mid", "small"]
    assert ids(s.choose(rids, sig, budget_nodes=4, skip={1})) == ["small", None, "small"]
    assert [s.current_bin(r) for r in rids] == [0, 1, 2]  # skipping moves no bin


def test_budget_ties_are_deterministic_later_requests_step_down_first():
    s = TreeScheduler(_set(ENT), "entropy", hysteresis=0.0, warmup_steps=0)
    rids = [f"r{i}" for i in range(4)]
    out = s.choose(rids, [ent(0.1)] * 4, budget_nodes=28)  # 4 x 8 = 32 > 28: one steps 8 -> 4
    assert ids(out) == ["big", "big", "big", "mid"]
    out2 = s.choose(rids, [ent(0.1)] * 4, budget_nodes=20)  # 32 -> 20: r3, r2, r1 step 8 -> 4
    assert ids(out2) == ["big", "mid", "mid", "mid"]
    assert ids(s.choose(rids, [ent(0.1)] * 4, budget_nodes=20)) == ids(out2)  # same input, same answer


def test_static_policy_gives_everyone_the_same_tree():
    s = TreeScheduler(_set(ENT), "static")
    assert s.default_tree_id == "big" and s.ladder_source == "fallback"
    out = s.choose(["a", "b"], [ent(0.0), ent(9.0)])
    assert ids(out) == ["big", "big"] and s.stats.warmup == 0
    assert ids(TreeScheduler(_set(), "static", default_tree_id="small").choose(["a"], [ent(9.0)])) == ["small"]
    assert ids(s.choose(["a", "b"], [ent(0.0)] * 2, budget_nodes=12)) == ["big", "mid"]


# -- construction errors ------------------------------------------------------------------------------------------


def test_policy_and_schedule_signal_must_agree():
    with pytest.raises(SchedulerError, match=r"policy='confidence', but tree set t.json's schedule has signal "
                                             r"'entropy'"):
        TreeScheduler(_set(ENT), "confidence")
    with pytest.raises(SchedulerError, match=r"method 'entmtp' \(policy, tree_set, tree_id\): policy='entropy'"):
        TreeScheduler.from_config(EntMTPConfig(policy="entropy", tree_set="x"), _set(CONF))
    with pytest.raises(SchedulerError, match="unknown policy 'greedy'"):
        TreeScheduler(_set(), "greedy")
    for kw in (dict(hysteresis=-0.1), dict(hysteresis=float("nan")), dict(warmup_steps=-1),
               dict(max_verify_tokens_per_step=0)):
        with pytest.raises(ValueError):
            TreeScheduler(_set(), "entropy", **kw)


def test_from_config_end_to_end_with_a_schedule_file(tmp_path):
    def entry(tid):
        t = TREES[tid]
        return {"id": tid, "paths": t.to_list(), "metadata": {"num_nodes": t.num_nodes, "depth": t.depth}}

    f = tmp_path / "s.json"
    f.write_text(json.dumps({"schema_version": 1, "name": "s", "heads": {"kind": "medusa", "num_heads": 4},
                             "trees": [entry("one"), entry("mid"), entry("big")],
                             "schedule": {"signal": "entropy", "thresholds": [0.3, 0.9],
                                          "tree_ids": ["big", "mid", "one"]}}))
    opts = EntMTPConfig(policy="entropy", tree_set=str(f), warmup_steps=1, max_verify_tokens_per_step=10)
    s = TreeScheduler.from_config(opts, load_tree_set(opts.tree_set, num_heads=4))
    tr = EntropyTracker.from_config(opts)
    tr.update_batch(["a", "b"], [0.1, 0.5])
    out = s.choose(["a", "b"], tr.signals_batch(["a", "b"]), s.node_budget(2))  # 8 nodes budget
    assert ids(out) == ["mid", "mid"] and s.warmup_steps == 1 and s.hysteresis == 0.05


def test_a_schedule_ending_in_none_drafts_nothing_there_and_none_is_reserved(tmp_path):
    from vllm_entmtp.errors import TreeSetError

    def write(tree_ids, names=("a", "b")):
        f = tmp_path / "s.json"
        f.write_text(json.dumps({
            "schema_version": 1, "name": "s", "heads": {"kind": "hydra", "num_heads": 4},
            "trees": [{"id": n, "paths": [[0]] if i == 0 else [[0], [1]],
                       "metadata": {"num_nodes": i + 1, "depth": 1}} for i, n in enumerate(names)],
            "schedule": {"signal": "entropy", "thresholds": [0.5 * (i + 1) for i in range(len(tree_ids) - 1)],
                         "tree_ids": tree_ids}}))
        return f

    s = TreeScheduler(load_tree_set(write(["b", "a", "none"])), "entropy", warmup_steps=0, hysteresis=0.0)
    sig = [Signals(entropy_ema=e, updates=3) for e in (0.1, 0.7, 2.0)]
    assert [t for t, _ in s.choose(["x", "y", "z"], sig)] == ["b", "a", None]
    assert s.choose(["x"], [sig[0]], budget_nodes=1) == [("a", Tree([[0]]))]  # steps down past b, 1 node left
    with pytest.raises(TreeSetError, match="'none' .* must be the last"):
        load_tree_set(write(["none", "a", "b"]))
    with pytest.raises(TreeSetError, match="a tree is named 'none'"):
        load_tree_set(write(["a", "none"], names=("a", "none")))


def test_calibration_mismatches_name_the_options_that_differ():
    from vllm_entmtp.config import EntMTPConfig
    from vllm_entmtp.scheduler import calibration_mismatches
    from vllm_entmtp.trees import load_tree_set

    ts = load_tree_set("default")  # built on the confidence signal: window 1, one head
    assert calibration_mismatches(ts, EntMTPConfig(policy="confidence", tree_set="default")) == []
    off = calibration_mismatches(ts, EntMTPConfig(policy="confidence", tree_set="default", confidence_heads=2,
                                                  confidence_window=4))
    assert off == ["confidence_window=4 (the set was calibrated with 1)",
                   "confidence_heads=2 (the set was calibrated with 1)"]
    assert calibration_mismatches(load_tree_set("ladder"), EntMTPConfig()) == []  # hand-made: no calibration


# -- cost model (load_policy "cost") ------------------------------------------------------------------------------

def _costed_set(decode_row_cost=None):
    """big (4 nodes) and small (1 node) with build-trees metadata: 4 calibration bins of the confidence, a ladder
    of 3 rungs (big, small, none) whose middle rung holds calibration bins 1 and 2."""
    cal = {"signal": "confidence", "edges": [0.6, 0.45, 0.3], "cost": {}}
    if decode_row_cost is not None:
        cal["cost"]["decode_row_cost"] = decode_row_cost
    meta = {"big": {"expected_accepted_per_bin": [1.5, 0.8, 0.3, 0.1], "cost": {"total": 1.4}, "calibration": cal},
            "small": {"expected_accepted_per_bin": [0.7, 0.45, 0.12, 0.05], "cost": {"total": 1.15}}}
    sched = Schedule(signal="confidence", thresholds=(0.6, 0.3), tree_ids=("big", "small", "none"))
    return TreeSet(name="c", source=Path("c.json"), heads_kind="hydra", num_heads=4, description="",
                   trees=[("big", TREES["mid"]), ("small", TREES["one"])], metadata=meta, schedule=sched)


def _cost_sched(**kw):
    kw.setdefault("load_policy", "cost")
    return TreeScheduler(_costed_set(kw.pop("set_d", None)), "confidence", hysteresis=0.0, warmup_steps=0, **kw)


def test_cost_model_at_one_request_drops_only_trees_expected_to_lose():
    s = _cost_sched()
    assert s.cost_model and s.cost_model_missing is None and s.decode_row_cost == 0.067
    assert ids(s.choose(["a"], [conf(0.9)])) == ["big"]     # 2.5 tokens in 1.4 steps
    assert ids(s.choose(["b"], [conf(0.5)])) == ["small"]   # calibration bin 1: 1.45 tokens in 1.15 steps
    assert ids(s.choose(["c"], [conf(0.35)])) == [None]     # bin 2: 1.12 tokens in 1.15 steps, below plain
    assert s.current_bin("c") == 1  # the signal's bin is kept; only this step drafts nothing
    assert s.stats.cost_stepdowns == 1 and s.stats.no_draft == 1


def test_cost_model_steps_the_ladder_down_as_the_batch_grows():
    # all confident: big pays at 1 and 2 requests, small at 4, nothing at 16 (the step's fixed cost is shared,
    # each request's drafting and rows are not)
    for batch, want in ((1, "big"), (2, "big"), (4, "small"), (16, None)):
        s = _cost_sched()
        rids = [f"r{i}" for i in range(batch)]
        assert ids(s.choose(rids, [conf(0.9)] * batch)) == [want] * batch, batch
    s = _cost_sched()
    assert s.step_cost([0, 0, 1, 2]) == pytest.approx(1 + 3 * 0.067 + 0.4 + 0.4 + 0.15)


def test_cost_model_steps_down_the_least_profitable_requests_first():
    s = _cost_sched()
    # two confident (big: 3.2 tokens per step saved), two unsure (small: 3.0): the unsure drop first, the later
    # request first on a tie; then both big ones step to small, where they stay
    out = s.choose(["a", "b", "c", "d"], [conf(0.9), conf(0.9), conf(0.5), conf(0.5)])
    assert ids(out) == ["small", "small", None, None]
    assert s.stats.cost_stepdowns == 4 and s.stats.no_draft == 2
    # a request still in warm-up (no signal) counts the mean over the calibration bins
    w = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=5, load_policy="cost")
    assert w.expected_accepted(0, None) == pytest.approx((1.5 + 0.8 + 0.3 + 0.1) / 4)
    assert ids(w.choose(["x"], [conf(0.9, updates=0)])) == ["big"]  # 1.675 tokens in 1.4 steps


def test_cost_model_past_a_ladder_without_none_then_the_node_cap():
    """A schedule without a "none" rung (the shipped sets): the cost model steps requests past its last tree to no
    drafting, and the node cap then applies to the others (it indexed past the ladder: IndexError, found under
    tensor parallelism, which runs the cost model)."""
    ts = _costed_set()
    ts = TreeSet(name=ts.name, source=ts.source, heads_kind=ts.heads_kind, num_heads=4, description="",
                 trees=ts.trees, metadata=ts.metadata,
                 schedule=Schedule(signal="confidence", thresholds=(0.6,), tree_ids=("big", "small")))
    s = TreeScheduler(ts, "confidence", hysteresis=0.0, warmup_steps=0, load_policy="cost")
    rids = [f"r{i}" for i in range(16)]
    assert ids(s.choose(rids, [conf(0.9)] * 16, budget_nodes=4)) == [None] * 16
    four = ["a", "b", "c", "d"]  # small pays for all four (test above); a cap of 2 nodes leaves two drafting
    assert ids(s.choose(four, [conf(0.9)] * 4, budget_nodes=2)) == ["small", "small", None, None]


def test_cost_model_options_and_when_it_does_not_apply():
    assert _cost_sched(set_d=0.2).decode_row_cost == 0.2  # the calibration's value
    assert _cost_sched(set_d=0.2, decode_row_cost=0.0).decode_row_cost == 0.0  # the option's
    free = _cost_sched(decode_row_cost=1.0)  # each request costs a whole step: the big trees pay again at 16
    assert ids(free.choose([f"r{i}" for i in range(16)], [conf(0.9)] * 16)) == ["big"] * 16
    cap = _cost_sched(load_policy="cap")
    assert not cap.cost_model and ids(cap.choose([f"r{i}" for i in range(16)], [conf(0.9)] * 16)) == ["big"] * 16
    assert cap.stats.cost_stepdowns == 0
    assert not TreeScheduler(_costed_set(), "confidence").cost_model  # "cap" is the default
    static = TreeScheduler(_costed_set(), "static", load_policy="cost")
    assert not static.cost_model and "static" in static.cost_model_missing
    plain = TreeScheduler(_set(CONF), "confidence", load_policy="cost")  # no build-trees metadata: the cap only
    assert not plain.cost_model and "no build-trees calibration" in plain.cost_model_missing
    meta = _costed_set().metadata
    del meta["small"]["cost"]
    broken = TreeSet(name="c", source=Path("c.json"), heads_kind="hydra", num_heads=4, description="",
                     trees=[("big", TREES["mid"]), ("small", TREES["one"])], metadata=meta,
                     schedule=_costed_set().schedule)
    assert "tree 'small'" in TreeScheduler(broken, "confidence", load_policy="cost").cost_model_missing
    with pytest.raises(SchedulerError, match="unknown load_policy 'fair'"):
        _cost_sched(load_policy="fair")
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(SchedulerError, match="decode_row_cost must be a number in"):
            _cost_sched(decode_row_cost=bad)
    assert EntMTPConfig().load_policy == "measured"
    opts = EntMTPConfig(policy="confidence", tree_set="x", load_policy="cost", decode_row_cost=0.1)
    s = TreeScheduler.from_config(opts, _costed_set())
    assert s.load_policy == "cost" and s.cost_model and s.decode_row_cost == 0.1
    for bad in (dict(load_policy="none"), dict(decode_row_cost=2.0)):
        with pytest.raises(ValueError):
            EntMTPConfig(**bad)


# -- measured step costs (load_policy "measured", the default) ---------------------------------------------------

def _costs(step_s: dict[int, float], draft_s: float = 0.0):
    from vllm_entmtp.step_costs import StepCosts

    c = StepCosts()
    for rows, t in step_s.items():
        for _ in range(3):
            c.record_rows(rows, t)
    if draft_s:
        c.record_draft(1, draft_s)
    return c


def test_measured_costs_keep_trees_where_rows_are_cheap_and_drop_them_where_they_are_not():
    """One request, rows almost free (a draft row costs 5 % of a step): every confident or unsure request drafts
    its tree. Sixteen requests, a draft row costing 90 % of a plain token's share of the step: only what pays
    stays, and with nothing expected to pay the heads are skipped (drafting_pays)."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    assert s.measured and s.node_budget(16) is None  # no cap: the costs decide
    cheap = _costs({1: 0.020, 5: 0.024}, draft_s=0.002)
    assert ids(s.choose(["a"], [conf(0.9)], None, cheap)) == ["big"]
    assert ids(s.choose(["b"], [conf(0.5)], None, cheap)) == ["small"]
    assert ids(s.choose(["c"], [conf(0.1)], None, cheap)) == [None]  # bin 3: 0.05 tokens do not pay 1 ms
    assert s.drafting_pays(1, cheap)
    # 16 rows take 48 ms (3 ms a token); each more row 1.5 ms, drafting 1 ms
    dear = _costs({16: 0.048, 32: 0.048 + 16 * 0.0015}, draft_s=0.001)
    rids = [f"r{i}" for i in range(16)]
    out = ids(s.choose(rids, [conf(0.9)] * 8 + [conf(0.35)] * 8, None, dear))
    # confident: small (0.7 tokens for 1.5 ms) beats the step's 1 per 3 ms, big's 3 more rows (0.8 tokens for
    # 4.5 ms) do not; unsure: 0.12 tokens for 1.5 ms do not
    assert out == ["small"] * 8 + [None] * 8
    assert s.drafting_pays(16, dear)
    # the drafting's 1 ms is the heads' pass whoever it serves: one request left to the heads (the rest take their
    # lookup drafts) cannot carry it (16.7 tokens in 50.5 ms against 16 in 48), sixteen can
    assert not s.drafting_pays(16, dear, drafting=1) and s.drafting_pays(16, dear, drafting=16)
    dearer = _costs({16: 0.048, 32: 0.048 + 16 * 0.006}, draft_s=0.004)  # a row dearer than a token
    assert ids(s.choose(rids, [conf(0.9)] * 16, None, dearer)) == [None] * 16
    assert not s.drafting_pays(16, dearer) and s.stats.not_paying == 2


def test_measured_costs_charge_only_the_drafting_not_yet_spent():
    """The heads' confidence pass runs before the choice, and the step pays it whether it drafts or not: with
    1.5 ms of the 2 ms drafting spent, an unsure request's one node (0.12 tokens for 1 ms of rows and 0.5 ms of
    drafting) pays, where charged the whole 2 ms it does not; a hopeless one (0.05 tokens) still does not."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    cheap = _costs({1: 0.020, 5: 0.024}, draft_s=0.002)
    assert ids(s.choose(["a"], [conf(0.35)], None, cheap)) == [None]  # 1.12 / 23 ms < 1 / 20 ms
    assert ids(s.choose(["a"], [conf(0.35)], None, cheap, sunk_seconds=0.0015)) == ["small"]  # 1.12/23 > 1/21.5
    assert ids(s.choose(["b"], [conf(0.1)], None, cheap, sunk_seconds=0.0015)) == [None]  # 1.05 / 23 ms
    assert ids(s.choose(["c"], [conf(0.35)], None, cheap, sunk_seconds=0.01)) == ["small"]  # more than measured


def _point_costs(step_s: dict[int, float], n: int = 10, draft_s: float = 0.0):
    """StepCosts with ``n`` observations of each row count (the first one dropped: ``n - 1`` kept)."""
    from vllm_entmtp.step_costs import StepCosts

    c = StepCosts()
    for rows, t in step_s.items():
        for _ in range(n):
            c.record_rows(rows, t)
    if draft_s:
        c.record_draft(1, draft_s)
    return c


def test_measured_costs_step_up_to_a_larger_tree_where_its_step_is_measured_faster():
    """vLLM's CPU GEMMs can read the weights faster for three to six rows than for two (the 2-core EPYC: a step
    of 2 rows 20.0 ms, of 3 rows 18.2 ms at one request): an unsure request's chain of one (2 rows) moves up to
    big (5 rows) where 5 rows are measured 3 % or more below 2 rows, both on their own observations; not where
    the saving is within that margin, not where either row count has too few observations, not where the head
    levels the larger tree adds eat the saving, and never for a request that drafts nothing."""
    from vllm_entmtp.step_costs import POINT_MIN_OBS, STEP_UP_MARGIN

    assert STEP_UP_MARGIN == 0.03
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    regime = {1: 0.020, 2: 0.022, 5: 0.019}
    assert ids(s.choose(["a"], [conf(0.5)], None, _point_costs(regime))) == ["big"]
    assert s.stats.cost_stepups == 1 and s.expected["a"] == pytest.approx(0.8)  # big's, calibration bin 1
    close = {1: 0.020, 2: 0.022, 5: 0.022 * (1 - STEP_UP_MARGIN) + 1e-4}
    assert ids(s.choose(["b"], [conf(0.5)], None, _point_costs(close))) == ["small"]
    few = _point_costs({1: 0.020, 2: 0.022})
    for _ in range(POINT_MIN_OBS - 1):
        few.record_rows(5, 0.019)
    assert few.measured_time(5) is None and few.measured_time(2) == pytest.approx(0.022)
    assert ids(s.choose(["c"], [conf(0.5)], None, few)) == ["small"]
    levels = _point_costs(regime)
    for _ in range(3):
        levels.record_levels(1, 0, 0.0002)
        levels.record_levels(1, 2, 0.0002 + 2 * 0.002)  # big needs two levels beyond the pass: 4 ms more
    assert ids(s.choose(["d"], [conf(0.5)], None, levels, covered_levels=1)) == ["small"]
    assert s.stats.cost_stepups == 1
    # two requests: the one that drafts nothing stays so; of two chains of one (4 rows) one moves up to big (7
    # rows, measured faster), the other not (10 rows, dearer than 7); with 2 ms a head level, big's two more levels
    # cost more than 7 rows save
    pair = _point_costs({2: 0.020, 3: 0.022, 6: 0.019}, draft_s=0.002)
    assert ids(s.choose(["e", "f"], [conf(0.5), conf(0.1)], None, pair)) == ["big", None]
    both = {2: 0.020, 4: 0.022, 7: 0.019, 10: 0.025}
    assert ids(s.choose(["g", "h"], [conf(0.5), conf(0.5)], None, _point_costs(both))) == ["big", "small"]
    deep = _point_costs(both)
    for _ in range(3):
        deep.record_levels(2, 0, 0.0002)
        deep.record_levels(2, 2, 0.0002 + 2 * 0.002)
    assert ids(s.choose(["i", "j"], [conf(0.5), conf(0.5)], None, deep, covered_levels=1)) == ["small", "small"]
    # where a request takes its prompt-lookup draft (skip), its rows are not in the counts: no step-up
    lookup = _point_costs({2: 0.020, 3: 0.022, 6: 0.019})  # without the skip, k would move up (3 -> 6 rows)
    assert ids(s.choose(["k", "l"], [conf(0.5), conf(0.5)], None, lookup, skip=[1])) == ["small", None]
    assert s.stats.cost_stepups == 3


def test_step_up_reads_the_row_count_it_leaves_from_its_last_observations_after_they_age_out():
    """Once the step-up keeps requests off 2 rows, their observations age out; the step-up goes on reading the
    last 8 of them (``kept``, topped up by fresh ones first) for KEPT_MAX_AGE engine steps instead of pausing until
    2 rows are verified again, and stops after that. Only a count the step-up left is kept, and the count it moves
    to must be measured now."""
    from vllm_entmtp.step_costs import KEPT_MAX_AGE, POINT_MIN_OBS, ROWS_MAX_AGE

    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    c = _point_costs({1: 0.020, 5: 0.019})
    for ms in range(20, 30):  # 2 rows: 20..29 ms, the first dropped
        c.record_rows(2, ms / 1000)

    def step(costs):  # an engine step: the schedule, then 1 and 5 rows verified
        costs.tick()
        choice = ids(s.choose(["a"], [conf(0.5)], None, costs))
        costs.record_rows(1, 0.020)
        costs.record_rows(5, 0.019)
        return choice

    assert step(c) == ["big"]  # 2 rows measured now (24.5 ms median) against 5 rows (19 ms)
    for _ in range(ROWS_MAX_AGE):
        assert step(c) == ["big"]
    assert c.measured_time(2) is None  # aged out
    assert c.measured_time(2, kept=True) == pytest.approx(0.0255)  # its last 8: 22..29 ms
    assert c.measured_time(3, kept=True) is None  # never measured
    for _ in range(3):  # fresh observations come first: 40, 40, 40 and the last 5 kept, 25..29 ms
        c.record_rows(2, 0.040)
    assert c.measured_time(2, kept=True) == pytest.approx(0.0285)
    for _ in range(KEPT_MAX_AGE + 1):
        c.tick()
        c.record_rows(1, 0.020)
        c.record_rows(5, 0.019)
    assert c.measured_time(2, kept=True) is None  # kept no longer; the 3 fresh ones aged out too
    stepups = s.stats.cost_stepups
    assert step(c) == ["small"] and s.stats.cost_stepups == stepups
    for _ in range(POINT_MIN_OBS + 1):  # measured again (the first dropped)
        c.record_rows(2, 0.022)
    assert step(c) == ["big"] and s.stats.cost_stepups == stepups + 1
    # a count that aged out without the step-up leaving it is not kept
    idle = _point_costs({1: 0.020, 2: 0.022, 5: 0.019})
    for _ in range(ROWS_MAX_AGE + 1):
        idle.tick()
        idle.record_rows(1, 0.020)
        idle.record_rows(2, 0.022)
    assert idle.measured_time(5) is None and idle.measured_time(5, kept=True) is None
    # the larger row count is never read from kept observations: 5 rows kept (left), 2 rows measured now
    stale = _point_costs({1: 0.020, 2: 0.022, 5: 0.019})
    for _ in range(ROWS_MAX_AGE + 1):
        stale.tick()
        stale.left_rows(5)
        stale.record_rows(1, 0.020)
        stale.record_rows(2, 0.022)
    assert stale.measured_time(5) is None and stale.measured_time(5, kept=True) == pytest.approx(0.019)
    assert ids(s.choose(["d"], [conf(0.5)], None, stale)) == ["small"]


def test_a_head_level_is_measured_apart_from_the_drafts_that_need_none():
    from vllm_entmtp.step_costs import StepCosts

    c = StepCosts()
    for _ in range(3):
        c.record_levels(16, 0, 0.0002)
    assert c.level_time(16) == (0.0002, 0.0)  # no draft that needed a level yet
    for secs in (0.009, 0.0032, 0.0026, 0.0058):  # the first is dropped (one-time costs)
        c.record_levels(16, 1 if secs < 0.004 else 2, secs)
    rest, per = c.level_time(16)
    assert rest == pytest.approx(0.0002) and per == pytest.approx(0.0028)  # median of 3.0, 2.4, 2.8 ms
    for _ in range(40):  # many drafts that run no level do not crowd the level's price out
        c.record_levels(16, 0, 0.0002)
    assert c.level_time(16) == pytest.approx((rest, per))
    c.record_levels(4, 0, 0.0001)
    c.record_levels(4, 0, 0.0001)
    # each part at the nearest batch size that has it: batch size 4's own rest, 16's level
    assert c.level_time(4) == pytest.approx((0.0001, 0.00285)) and c.level_time(14) == pytest.approx((rest, per))
    assert StepCosts().level_time(16) is None
    assert c.summary()["level_ms"] == {4: [0.1, 2.85], 16: [0.2, 2.8]}


def test_measured_costs_price_the_head_levels_of_the_deepest_tree():
    """Sixteen requests, 3 ms a plain token, 0.5 ms a draft row; the confidence pass ran one head. big (4 nodes,
    depth 3) needs two more head levels, small (a chain of 1) none. A level costing 3 ms whoever reaches it: one
    confident request's big tree (0.8 tokens more than small for 1.5 ms of rows and 6 ms of levels) steps down;
    eight confident requests' big trees step down together (6.4 tokens for 12 ms of rows and 6 ms of levels,
    where each alone would keep its tree: 0.8 tokens for 1.5 ms). Before a level is measured, rows alone
    decide; at 0.5 ms a level the eight keep their trees."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    rids = [f"r{i}" for i in range(16)]
    one, eight = [conf(0.9)] + [conf(0.5)] * 15, [conf(0.9)] * 8 + [conf(0.5)] * 8

    def costs(per_level):
        c = _costs({16: 0.048, 32: 0.056, 64: 0.072})
        if per_level is not None:
            for _ in range(3):
                c.record_levels(16, 0, 0.0002)
                c.record_levels(16, 2, 0.0002 + 2 * per_level)
        return c

    assert ids(s.choose(rids, one, None, costs(None), covered_levels=1)) == ["big"] + ["small"] * 15
    assert ids(s.choose(rids, one, None, costs(0.003), covered_levels=1)) == ["small"] * 16
    assert ids(s.choose(rids, eight, None, costs(None), covered_levels=1)) == ["big"] * 8 + ["small"] * 8
    assert ids(s.choose(rids, eight, None, costs(0.003), covered_levels=1)) == ["small"] * 16
    assert ids(s.choose(rids, eight, None, costs(0.0005), covered_levels=1)) == ["big"] * 8 + ["small"] * 8


def test_the_heads_run_only_for_requests_whose_own_acceptance_could_pay():
    """Sixteen requests, 3 ms a plain token, 1.5 ms a draft row and 1 ms of drafting for the batch: a request
    accepting what the calibration expects may pay (the small tree: 0.7 tokens for 1.56 ms), one accepting a
    fifth of it cannot (0.14 tokens) and does not run the heads; a request with no record yet, or costs not
    measured, always may."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    dear = _costs({16: 0.048, 32: 0.048 + 16 * 0.0015}, draft_s=0.001)
    dear.record_draft(16, 0.001)
    for _ in range(2):
        s.observe_acceptance("good", 0.7, 1)
        s.observe_acceptance("bad", 0.7, 0)
    assert s.acceptance_ratio("good") > 1.0 and s.acceptance_ratio("bad") == 0.2
    floor = s.paying_ratio(16, dear)  # once per step: small pays from 0.744 (0.7 r for 1.5625 ms at 1/3 ms)
    assert floor == pytest.approx(16 / 0.048 * 0.0015625 / 0.7)
    assert s.request_may_pay("good", floor) and not s.request_may_pay("bad", floor)
    assert s.request_may_pay("new", floor)  # no record yet
    # one row count: a draft row has no price yet
    assert s.request_may_pay("bad", s.paying_ratio(16, _costs({16: 0.048})))
    # the same record at one request, where a draft row costs a twentieth of a step, still pays
    cheap = _costs({1: 0.020, 5: 0.021}, draft_s=0.0005)
    assert s.request_may_pay("bad", s.paying_ratio(1, cheap))
    cap = TreeScheduler(_costed_set(), "confidence", load_policy="cap")
    for _ in range(2):
        cap.observe_acceptance("bad", 0.7, 0)
    assert cap.request_may_pay("bad", cap.paying_ratio(16, dear))  # the measured load policy's rule only


def test_measured_costs_fall_back_to_the_cap_until_measured():
    """Before two row counts are measured the rule cannot price a draft: the cap of 32 verified rows applies."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    rids = [f"r{i}" for i in range(16)]
    out = s.choose(rids, [conf(0.9)] * 16, None, _costs({16: 0.05}))
    assert sum(t.num_nodes for _, t in out if t is not None) <= 32 - 16
    assert s.drafting_pays(16, _costs({16: 0.05}))  # unknown: do not skip the heads
    given = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0, max_verify_tokens_per_step=20)
    assert given.node_budget(16) == 4  # a cap the user gives applies after the measured rule


def test_step_costs_interpolate_extrapolate_and_probe():
    from vllm_entmtp.step_costs import PROBE_EVERY, StepCosts

    c = StepCosts()
    assert c.rows_time(4) is None and c.draft_time(4) == 0.0
    assert c.needs_probe(4)  # nothing measured
    c.record_rows(4, 0.010)
    assert c.rows_time(4) == 0.010 and c.rows_time(8) is None  # one point: nothing to interpolate from
    for t in (0.030, 0.020, 0.020):
        c.record_rows(8, t)
    assert c.rows_time(8) == pytest.approx(0.020)  # the median
    assert c.rows_time(6) == pytest.approx(0.015)  # between 4 and 8
    # beyond 8: the last segment's slope (2.5 ms a row) or the mean (2.5 ms a row), whichever is steeper
    assert c.rows_time(12) == pytest.approx(0.030)
    assert c.rows_time(2) == pytest.approx(0.005)
    assert not c.needs_probe(6)  # between measured row counts: no probe
    assert c.needs_probe(16)  # beyond them: probe
    assert not any(c.needs_probe(8) for _ in range(PROBE_EVERY - 1))
    assert c.needs_probe(8)  # a measured batch size is measured again now and then
    c.record_draft(2, 0.002)
    assert c.draft_time(1) == c.draft_time(8) == 0.002  # the nearest measured batch size
    assert c.summary()["rows_ms"] == {4: 10.0, 8: 20.0} and c.summary()["probes"] == 3


def test_a_draft_row_costs_the_local_slope_not_the_step_between_two_noisy_medians():
    """With three or more measured row counts near the batch, the curve is their least-squares line (weighted by
    observations, never falling): one noisy median can neither make draft rows free nor dear. With fewer, the
    medians point by point."""
    from vllm_entmtp.step_costs import StepCosts

    c = StepCosts()
    true = {r: 0.010 + 0.001 * r for r in range(28, 41)}  # 1 ms a row
    noise = {32: -0.004, 33: +0.006, 36: -0.003}  # a low median at 32, a high one at 33, a low one at 36
    for r, t in true.items():
        for _ in range(3):
            c.record_rows(r, t + noise.get(r, 0.0))
    pointwise = c._pointwise(32, 4)
    assert pointwise[1] - pointwise[0] == pytest.approx(0.011)  # one row from the medians: 11 ms
    assert pointwise[4] - pointwise[0] == pytest.approx(0.005)  # four rows: 1.25 ms each
    curve = c.curve(32, 4)
    slope = [b - a for a, b in zip(curve, curve[1:])]
    assert slope == pytest.approx([slope[0]] * 4) and 0.0008 < slope[0] < 0.0012  # about the true 1 ms a row
    assert c.curve(32, 0) == [pytest.approx(0.038)]  # no draft rows: the median itself
    sparse = StepCosts()
    for r, t in ((16, 0.030), (32, 0.050)):
        sparse.record_rows(r, t)
    assert sparse.curve(16, 2) == pytest.approx([0.030, 0.03125, 0.0325])  # two row counts: interpolated
    flat = StepCosts()
    for r, t in ((8, 0.030), (9, 0.029), (10, 0.028)):  # falling medians: the line does not fall
        flat.record_rows(r, t)
    assert flat.curve(8, 2) == pytest.approx([0.029] * 3)


def test_drafting_rests_where_steps_with_drafts_emit_fewer_tokens_per_second_than_steps_without():
    """The guard under every load rule: the realised tokens per second of decode steps that verified drafts against
    those that verified none, at the nearest batch size within a quarter of it; no verdict until both are
    measured (8 and 4 steps); a batch size without one of its own takes a loss of the largest smaller one."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, StepCosts

    c = StepCosts()
    for _ in range(COMPARE_MIN_PLAIN + 1):  # the first observation of a key is dropped when the second comes
        c.record_step(16, 16, 0.030, drafted=False)  # 533 tokens/s
    assert c.step_rates(16) is None and not c.drafting_loses(16)  # drafting not measured yet
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(16, 18, 0.036, drafted=True)  # 500 tokens/s: two accepted draft tokens for 6 ms
    assert c.step_rates(16) == pytest.approx((500.0, 533.33), rel=1e-3)
    assert c.drafting_loses(16) and c.drafting_loses(14) and c.drafting_loses(20)  # within 16 // 4
    assert not c.drafting_loses(11)  # too far (a quarter of 11): no verdict of its own, and none below it
    # 22 and 40 have no verdict of their own either: the largest smaller batch size's loss stands (bigger batches
    # make draft rows dearer), until their own steps say otherwise
    assert c.drafting_loses(22) and c.drafting_loses(40)
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(40, 48, 0.060, drafted=True)  # 800 tokens/s with drafts at 40 requests
    for _ in range(COMPARE_MIN_PLAIN + 1):
        c.record_step(40, 40, 0.057, drafted=False)  # 702 tokens/s without
    assert not c.drafting_loses(40) and c.drafting_loses(22)  # 40's own verdict; 22 still inherits 16's
    assert not c.drafting_loses(60)  # the largest smaller batch size with a verdict decides: 40 won
    for _ in range(16):
        c.record_step(16, 20, 0.034, drafted=True)  # 588 tokens/s: the window moves on
    assert not c.drafting_loses(16) and not c.drafting_loses(22)  # 16 wins now; 22 inherits nothing
    assert c.summary()["step_rates"] == {16: [pytest.approx(588.2, abs=0.1), pytest.approx(533.3, abs=0.1)],
                                         40: [pytest.approx(800.0, abs=0.1), pytest.approx(701.8, abs=0.1)]}


def test_drafting_rests_on_a_tie_of_the_realised_comparison():
    """The drafted steps must be COMPARE_MARGIN ahead of the steps without drafts: a tie rests (its costs show only
    over a level: requests finishing at different steps, their successors' prompts run one by one)."""
    from vllm_entmtp.step_costs import COMPARE_MARGIN, COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, StepCosts, drafts_behind

    assert drafts_behind((102.0, 100.0)) and not drafts_behind((100.0 * (1 + COMPARE_MARGIN) + 0.1, 100.0))
    c = StepCosts()
    for _ in range(COMPARE_MIN_PLAIN + 1):
        c.record_step(16, 16, 0.046, drafted=False)  # 348 tokens/s
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(16, 20, 0.056, drafted=True)  # 357 tokens/s: 2.6 % ahead
    assert c.step_rates(16)[0] > c.step_rates(16)[1] and c.drafting_loses(16)
    assert "16: 357/348 (rests)" in c.describe()
    for _ in range(16):
        c.record_step(16, 21, 0.056, drafted=True)  # 375 tokens/s: 7.8 % ahead
    assert not c.drafting_loses(16)


def test_the_option_compare_margin_sets_the_realised_comparisons_margin():
    """``compare_margin`` sets the margin of the step costs a drafter builds (``StepCosts.from_options``): 0.02
    drafts where the default's 5 % rests, 0.1 rests where it drafts; 0 drafts on a tie."""
    from vllm_entmtp.config import parse_entmtp_options
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, StepCosts, drafts_behind

    assert parse_entmtp_options({}, []).compare_margin == 0.05
    assert not drafts_behind((100.0, 100.0), 0.0) and drafts_behind((99.9, 100.0), 0.0)

    def costs(margin: float, drafted_tokens: int) -> StepCosts:
        c = StepCosts.from_options(parse_entmtp_options({"compare_margin": margin}, []))
        for _ in range(COMPARE_MIN_PLAIN + 1):
            c.record_step(16, 16, 0.046, drafted=False)  # 348 tokens/s
        for _ in range(COMPARE_MIN_DRAFTING + 1):
            c.record_step(16, drafted_tokens, 0.056, drafted=True)
        return c

    assert not costs(0.02, 20).drafting_loses(16) and costs(0.05, 20).drafting_loses(16)  # 2.6 % ahead
    assert costs(0.1, 21).drafting_loses(16) and not costs(0.05, 21).drafting_loses(16)  # 7.8 % ahead
    assert "16: 357/348;" in costs(0.02, 20).describe() and "16: 357/348 (rests)" in costs(0.05, 20).describe()


def test_the_realised_comparison_moves_steps_without_drafts_to_the_drafted_steps_batch_size():
    """Where the steps without drafts come from another batch size than the drafted ones (a draining batch), their
    tokens per second are moved to the drafted steps' batch size by the plain steps' tokens per second at both: a
    larger batch emits more tokens per second without any draft, which had read as a lead for drafting."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, StepCosts

    c = StepCosts()
    for _ in range(COMPARE_MIN_PLAIN + 1):
        c.record_step(12, 12, 0.040, drafted=False)  # 300 tokens/s at 12 requests
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(16, 17, 0.050, drafted=True)  # 340 tokens/s at 16: one draft token accepted a step
    assert c.step_rates(16) == pytest.approx((340.0, 300.0))  # no plain step known at 16: as measured
    assert not c.drafting_loses(16)
    for _ in range(3):
        c.record_rows(12, 0.040)
        c.record_rows(16, 0.048)  # a plain step at 16 requests: 333 tokens/s
    assert c.step_rates(16) == pytest.approx((340.0, 300.0 * (16 / 0.048) / (12 / 0.040)))
    assert c.drafting_loses(16)  # 340 against 333: short of the margin
    for _ in range(COMPARE_MIN_PLAIN + 1):
        c.record_step(16, 16, 0.046, drafted=False)  # steps without drafts at 16 itself: no move
    assert c.step_rates(16) == pytest.approx((340.0, 16 / 0.046))


def test_the_realised_comparison_judges_prompt_lookups_drafts_apart_from_the_heads():
    """Steps that verified prompt lookup's drafts alone and steps that verified some of the heads' are compared with
    the steps without drafts apart (``source``): served at 32 running on ShareGPT, the heads' one-token drafts lost
    at 30 requests while lookup's, mostly accepted, had won at 31, and one verdict for both had stopped both."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, StepCosts

    c = StepCosts()
    for _ in range(COMPARE_MIN_PLAIN + 1):  # (a key's first observation is dropped)
        c.record_step(30, 30, 0.100, drafted=False)  # 300 tokens/s
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(30, 42, 0.155, drafted=True)  # 271 tokens/s: the heads' drafts, 12 accepted
    assert c.drafting_loses(30) and c.drafting_loses(31, source="heads")
    assert c.step_rates(30, source="lookup") is None and not c.drafting_loses(30, source="lookup")
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(30, 55, 0.140, drafted=True, source="lookup")  # 393 tokens/s: lookup's drafts, 25 accepted
    assert c.step_rates(31, source="lookup") == pytest.approx((392.86, 300.0), rel=1e-3)
    assert not c.drafting_loses(30, source="lookup") and c.drafting_loses(30)  # each source by its own steps
    summary = c.summary()
    assert summary["step_rates"] == {30: [pytest.approx(271.0, abs=0.1), 300.0]}
    assert summary["lookup_step_rates"] == {30: [pytest.approx(392.9, abs=0.1), 300.0]}
    assert "30: 271/300 (rests), 30 (lookup alone): 393/300;" in c.describe()
    # lookup's drafted steps alone ask for steps without drafts to be compared with, as the heads' do
    fresh = StepCosts()
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        fresh.record_step(16, 24, 0.050, drafted=True, source="lookup")
    assert fresh.needs_reference(16)
    with pytest.raises(ValueError, match="source"):
        c.record_step(30, 30, 0.100, drafted=True, source="medusa")


def test_a_batch_drains_once_a_finished_request_is_not_replaced():
    """Refills: a finished request followed by an arrival within REFILL_WAIT steps is steady load; REFILL_WAIT steps
    without one, the batch drains until a request arrives; a batch that starts from empty (or has had no finish
    yet) does not count as draining."""
    from vllm_entmtp.step_costs import REFILL_WAIT, Refills

    r = Refills()
    r.step(arrived=16, finished=0, continuing=0)  # a burst arrives on an idle engine
    for _ in range(3 * REFILL_WAIT):
        r.step(arrived=0, finished=0, continuing=16)
    assert not r.draining  # nobody finished yet: steady load and a burst look alike
    r.step(arrived=0, finished=1, continuing=15)
    r.step(arrived=1, finished=0, continuing=15)  # the client's next request, a step later
    for _ in range(3 * REFILL_WAIT):
        r.step(arrived=0, finished=0, continuing=16)
    assert not r.draining  # refilled
    r.step(arrived=0, finished=1, continuing=15)
    for _ in range(REFILL_WAIT - 1):
        r.step(arrived=0, finished=0, continuing=15)
    assert not r.draining  # not yet: a replacement may still come
    r.step(arrived=0, finished=0, continuing=15)
    assert r.draining  # REFILL_WAIT steps after the finish with no arrival
    r.step(arrived=0, finished=1, continuing=14)
    assert r.draining  # a further finish changes nothing
    r.step(arrived=2, finished=0, continuing=14)
    assert not r.draining  # a request arrived: the batch is refilled
    r.step(arrived=0, finished=1, continuing=15)
    for _ in range(REFILL_WAIT):
        r.step(arrived=0, finished=0, continuing=15)
    assert r.draining
    r.step(arrived=4, finished=1, continuing=0)  # the batch ran empty; a new burst starts it anew
    for _ in range(2 * REFILL_WAIT):
        r.step(arrived=0, finished=0, continuing=4)
    assert not r.draining  # the finish announced with the new burst was the last batch's


def test_while_the_batch_drains_only_the_requests_with_the_most_tokens_left_may_draft():
    """last_to_finish: within slack of the request with the most tokens left (its max_tokens less its output), or
    within LAST_SHARE of its tokens left, whichever is more (most requests end on an end-of-sequence token before
    their max_tokens: nearly as many tokens left is as likely last); a request whose tokens left are unknown may
    draft; with none known, all may."""
    from vllm_entmtp.step_costs import LAST_SHARE, last_to_finish

    assert LAST_SHARE == 0.5
    assert last_to_finish([60, 57, 56, 40, 29, 3], slack=4) == [True, True, True, True, False, False]
    assert last_to_finish([10, 5, 4, 3], slack=6) == [True, True, True, False]  # slack is more than half of 10
    assert last_to_finish([60, None, 10], slack=4) == [True, True, False]
    assert last_to_finish([None, None], slack=4) == [True, True]
    assert last_to_finish([5, 5, 5], slack=0) == [True, True, True]  # tied: each is among the last
    assert last_to_finish([], slack=4) == []


def test_while_the_batch_drains_a_token_of_the_last_request_is_worth_a_step_of_the_batch_left_at_the_end():
    """StepCosts.token_value: with some requests ahead, an accepted draft token of the requests with the most tokens
    left brings the batch's end a step sooner, a step of about as many rows as they are, shared by them; where
    that is not COMPARE_MARGIN more than a plain token of the batch running, None (the batch's tokens per second
    judge). Weighed by that worth, a lone last request's drafts pay at
    16 requests where by the batch's tokens per second they do not (and the requests that may not draft are idle:
    they share no drafting cost)."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    # 1 row 20 ms, 16 rows 48 ms (3 ms a token), 1.5 ms a further row; drafting 1 ms
    c = _costs({1: 0.020, 16: 0.048, 32: 0.048 + 16 * 0.0015}, draft_s=0.001)
    assert c.token_value(16, 1) == pytest.approx(0.020)  # the last request alone: a step of one row
    assert c.token_value(16, 4) == pytest.approx((0.020 + 0.028 * 3 / 15) / 4)  # 4 rows of 25.6 ms, shared
    # 15 of 16 behind: 3.08 ms a token against 3.0, not COMPARE_MARGIN more; every token counts about alike
    assert c.rows_time(15) / 15 > 0.048 / 16 and c.token_value(16, 15) is None
    assert _costs({8: 0.016, 16: 0.048}).token_value(16, 4) is None  # extrapolated below 8 rows, 0 ms at 4
    assert c.token_value(16, 16) is None and c.token_value(16, 0) is None  # nobody ahead: tokens per second
    assert c.token_value(16, 1) is not None and _costs({16: 0.048}).token_value(16, 1) is None  # curve unknown
    rids = [f"r{i}" for i in range(16)]
    confident = [conf(0.9)] * 16
    value = c.token_value(16, 1)
    # by tokens per second: one request's drafts cannot carry the heads' 1 ms (16.7 tokens in 50.5 ms vs 16 in 48)
    assert not s.drafting_pays(16, c, drafting=1)
    assert ids(s.choose(rids, confident, None, c, idle=range(1, 16))) == [None] * 16
    # every request drafting shares the drafting: small pays for each (0.7 tokens for 1.5 ms of rows)
    assert ids(s.choose(rids, confident, None, c)) == ["small"] * 16
    # worth a 20-ms step each, the last request's drafts pay, and big's 3 more rows (0.8 tokens for 4.5 ms) too
    assert s.drafting_pays(16, c, drafting=1, token_value=value)
    assert ids(s.choose(rids, confident, None, c, token_value=value, idle=range(1, 16))) == ["big"] + [None] * 15
    # the least acceptance record at which a request's heads could pay: lower at the drain's worth, higher where
    # the one request left to the heads carries the whole drafting time (1 ms, not a sixteenth of it)
    assert s.paying_ratio(16, c, value) < s.paying_ratio(16, c)
    assert s.paying_ratio(16, c, value) < s.paying_ratio(16, c, value, drafting=1)
    # an unsure last request: 0.12 tokens (small, bin 2) are worth 2.4 ms against 1.5 ms of rows and 1 ms drafting
    assert ids(s.choose(rids, [conf(0.35)] + confident[1:], None, c, token_value=value, idle=range(1, 16))) == [
        None] * 16


def test_a_first_observation_is_dropped_when_a_second_arrives():
    """A key's first observation carries one-time costs (kernels built for a new shape): alone it stands, the second
    replaces it, later ones join the window."""
    from vllm_entmtp.step_costs import StepCosts

    c = StepCosts()
    c.record_draft(1, 0.237)
    assert c.draft_time(1) == 0.237  # alone, it stands
    c.record_draft(1, 0.002)
    assert c.draft_time(1) == 0.002  # the first is gone
    c.record_draft(1, 0.004)
    assert c.draft_time(1) == pytest.approx(0.003)  # the median of the later two
    c.record_rows(3, 0.040)
    c.record_rows(3, 0.026)
    c.record_rows(3, 0.027)
    assert c.rows_time(3) == pytest.approx(0.0265)


def test_drafting_is_measured_again_where_it_does_not_pay():
    """One slow first draft (237 ms against 2 ms after, seen on a served engine) said no draft pays at one request;
    the heads then never ran, so the estimate could never change. Every PROBE_EVERY steps that do not pay the
    drafter drafts anyway (needs_exploration); the second measurement replaces the first, and drafting pays."""
    from vllm_entmtp.step_costs import PROBE_EVERY, StepCosts

    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    c = StepCosts()
    for rows, t in ((1, 0.025), (5, 0.027)):
        for _ in range(3):
            c.record_rows(rows, t)
    c.record_draft(1, 0.237)
    assert not s.drafting_pays(1, c)
    explored = [c.needs_exploration(1) for _ in range(2 * PROBE_EVERY)]
    assert explored.count(True) == 2 and explored.index(True) == PROBE_EVERY - 1
    assert not c.needs_exploration(4) and c.summary()["explorations"] == 2  # counted per batch size
    c.record_draft(1, 0.002)  # what the exploring step measured
    assert s.drafting_pays(1, c)


def test_drafting_is_explored_sooner_where_no_step_of_more_rows_is_measured():
    """A batch size larger than any drafted step so far: its draft rows are extrapolated at a plain token's cost
    each, so no draft pays there until a drafted step of more rows is measured. The drafter explores every
    EXPLORE_UNMEASURED_EVERY steps until then, and every PROBE_EVERY steps after."""
    from vllm_entmtp.step_costs import EXPLORE_UNMEASURED_EVERY, PROBE_EVERY, StepCosts

    assert EXPLORE_UNMEASURED_EVERY < PROBE_EVERY
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    c = StepCosts()
    for rows, t in ((1, 0.012), (3, 0.014), (16, 0.020)):  # a warm-up at one request, a probe at sixteen
        for _ in range(3):
            c.record_rows(rows, t)
    c.record_draft(16, 0.0015)
    assert not s.drafting_pays(16, c)  # 17+ rows: 20 ms / 16 rows = 1.25 ms a draft row, a plain token's cost
    explored = [c.needs_exploration(16) for _ in range(EXPLORE_UNMEASURED_EVERY)]
    assert explored == [False] * (EXPLORE_UNMEASURED_EVERY - 1) + [True]
    for _ in range(3):
        c.record_rows(24, 0.022)  # what the exploring step measured: 8 draft rows for 2 ms
    assert s.drafting_pays(16, c)
    explored = [c.needs_exploration(16) for _ in range(PROBE_EVERY)]
    assert explored.index(True) == PROBE_EVERY - 1  # measured above: the usual period
    assert [c.needs_exploration(1) for _ in range(PROBE_EVERY)].index(True) == PROBE_EVERY - 1


def _plain_steps_of_30_ms_at_16():
    """A scheduler with measured costs: plain steps of 25 ms at one request and 30 ms at 16 (533 tokens/s), draft
    rows cheap up to 32 rows, drafting 2 ms at 16 requests."""
    from vllm_entmtp.step_costs import StepCosts

    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    c = StepCosts()
    for rows, t in ((1, 0.025), (5, 0.0255), (16, 0.030), (32, 0.0305), (80, 0.060)):
        for _ in range(3):
            c.record_rows(rows, t)
    c.record_draft(16, 0.002)
    return s, c


def test_the_heads_stop_where_their_realised_yield_is_below_plain_decodings():
    """At 16 requests the calibration's best acceptance says drafting can pay, but the steps that ran the heads got
    1 accepted token for 5 ms they added (200 tokens/s) against the plain step's 16 in 30 ms (533 tokens/s): no
    draft pays there once 8 such steps are measured, and at one request (1.5 tokens for 2.5 ms) it does."""
    from vllm_entmtp.step_costs import YIELD_MIN_STEPS

    s, c = _plain_steps_of_30_ms_at_16()
    c.record_draft(1, 0.002)
    assert s.drafting_pays(16, c) and c.heads_yield(16) is None
    c.record_heads_yield(16, 0, 0.300)  # a first step's one-time costs: dropped when the second comes
    for _ in range(YIELD_MIN_STEPS - 1):
        c.record_heads_yield(16, 1, 0.005)
        assert s.drafting_pays(16, c)  # not yet judged
    c.record_heads_yield(16, 1, 0.005)
    assert c.heads_yield(16) == pytest.approx(200.0) and not s.drafting_pays(16, c)
    assert c.summary()["heads_yield"] == {16: 200.0}
    for _ in range(YIELD_MIN_STEPS):
        c.record_heads_yield(1, 1.5, 0.0025)
    assert s.drafting_pays(1, c)
    # a batch size near 16 reads 16's yield (continuous batching moves it by a few requests), a far one does not
    assert c.heads_yield(14) == c.heads_yield(18) == pytest.approx(200.0)
    assert c.heads_yield(3) == c.heads_yield(1) and c.heads_yield(8) is None and c.heads_yield(40) is None
    for _ in range(16):  # the heads fare better at 16 in later steps: drafting pays again
        c.record_heads_yield(16, 4, 0.005)
    assert s.drafting_pays(16, c)


def test_the_realised_comparison_overrules_the_heads_yield_and_exploring_steps_do_not_enter_it():
    """The heads' yield prices their rows by the step-cost curve; the realised comparison measures what drafted and
    plain steps emitted. Where the latter has drafted steps ahead at this batch size, a low yield does not stop the
    heads; where it has them behind, drafting rests (drafting_loses) whatever the yield. An exploring step's yield
    (a tree for every request, to measure costs) is not the rule's own drafting and is not kept."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, YIELD_MIN_STEPS

    s, c = _plain_steps_of_30_ms_at_16()
    for _ in range(YIELD_MIN_STEPS + 1):
        c.record_heads_yield(16, 1, 0.005)  # 200 tokens/s against the plain step's 533
    assert c.heads_yield(16) == pytest.approx(200.0) and not s.drafting_pays(16, c)
    for _ in range(YIELD_MIN_STEPS + 1):  # exploring steps that fared better do not lift it, nor worse sink it
        c.record_heads_yield(16, 8, 0.005, exploring=True)
        c.record_heads_yield(18, 0, 0.005, exploring=True)
    assert c.heads_yield(16) == pytest.approx(200.0) and c.summary()["heads_yield"] == {16: 200.0}
    for _ in range(COMPARE_MIN_PLAIN + 1):
        c.record_step(16, 16, 0.030, drafted=False)  # 533 tokens/s
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(15, 21, 0.034, drafted=True)  # 618 tokens/s at 15 requests (within a quarter of 16)
    assert not c.drafting_loses(16) and s.drafting_pays(16, c)
    for _ in range(16):
        c.record_step(16, 17, 0.036, drafted=True)  # 472 tokens/s: the drafted steps fall behind
    assert c.drafting_loses(16) and not s.drafting_pays(16, c)


def test_the_realised_comparison_overrules_a_low_yield_by_the_options_margin():
    """The load rule reads the realised comparison's margin from the step costs (``compare_margin``): drafted steps
    3 % ahead of the steps without drafts keep the heads running against a low yield at a margin of 2 %, not at the
    default 5 %."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, YIELD_MIN_STEPS

    for margin, pays in ((0.02, True), (0.05, False)):
        s, c = _plain_steps_of_30_ms_at_16()
        c.margin = margin
        for _ in range(YIELD_MIN_STEPS + 1):
            c.record_heads_yield(16, 1, 0.005)  # 200 tokens/s against the plain step's 533
        for _ in range(COMPARE_MIN_PLAIN + 1):
            c.record_step(16, 16, 0.030, drafted=False)  # 533 tokens/s
        for _ in range(COMPARE_MIN_DRAFTING + 1):
            c.record_step(16, 22, 0.040, drafted=True)  # 550 tokens/s: 3.1 % ahead
        assert s.drafting_pays(16, c) is pays and c.drafting_loses(16) is not pays, margin


def test_a_low_heads_yield_ages_out_and_the_heads_are_judged_again():
    """A yield measured low stops the heads at that batch size only while YIELD_MIN_STEPS of its observations are
    among the last YIELD_MAX_AGE drafter steps (tick): then the calibration decides again (the heads run), and
    fresh observations judge anew; observations of different ages expire one by one."""
    from vllm_entmtp.step_costs import YIELD_MAX_AGE, YIELD_MIN_STEPS, StepCosts

    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    c = StepCosts()
    for rows, t in ((1, 0.025), (5, 0.0255), (16, 0.030)):
        for _ in range(3):
            c.record_rows(rows, t)
    c.record_draft(1, 0.002)
    for _ in range(YIELD_MIN_STEPS + 1):  # 0.1 accepted token for 5 ms added: 20 tokens/s, under plain's 40
        c.record_heads_yield(1, 0.1, 0.005)
    assert c.heads_yield(1) == pytest.approx(20.0) and not s.drafting_pays(1, c)
    for _ in range(YIELD_MAX_AGE):  # resting steps: no new yield
        c.tick()
    assert not s.drafting_pays(1, c)  # the youngest observation is YIELD_MAX_AGE steps old: it still counts
    c.tick()
    assert c.heads_yield(1) is None and s.drafting_pays(1, c) and c.summary()["heads_yield"] == {}
    for _ in range(YIELD_MIN_STEPS):  # fresh observations, a request the heads predict well: judged again
        c.record_heads_yield(1, 1.5, 0.0025)
    assert c.heads_yield(1) == pytest.approx(600.0) and s.drafting_pays(1, c)
    for _ in range(16):  # a stretch where the confidence pass drafts nothing (0 accepted for 1 ms each), 16 steps
        c.tick()
        c.record_heads_yield(1, 0, 0.001)
        c.record_step(1, 1, 0.025, drafted=False)  # recording a step does not age the yield: only tick() does
    # judged over the heads' steps of the last YIELD_MAX_AGE steps, not the stretch alone: 12 tokens in 36 ms
    assert c.heads_yield(1) == pytest.approx(12 / 0.036) and s.drafting_pays(1, c)
    for _ in range(YIELD_MAX_AGE - 15):  # the 8 good ones are YIELD_MAX_AGE + 1 steps old: only the stretch is left
        c.tick()
    assert c.heads_yield(1) == 0.0 and not s.drafting_pays(1, c)
    for _ in range(16 - YIELD_MIN_STEPS + 1):  # the stretch ages out one by one: fewer than 8 left, not judged
        c.tick()
    assert c.heads_yield(1) is None and s.drafting_pays(1, c)


def test_a_verdict_that_drafting_loses_lapses_as_its_steps_age():
    """The realised comparison reads the decode steps of the last STEP_RATE_MAX_AGE drafter steps (tick), of any
    batch size: a stretch whose drafts were rejected makes the drafter rest only until fewer than
    COMPARE_MIN_DRAFTING of its drafted steps are that recent (resting steps add undrafted ones only); then no
    verdict stands (drafting is tried) and fresh steps judge anew."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, STEP_RATE_MAX_AGE, StepCosts

    c = StepCosts()
    for _ in range(COMPARE_MIN_DRAFTING + 1):  # drafts all rejected: 1 token in 13 ms (77 tokens/s); the first
        c.tick()                               # observation of a kind is dropped when the second comes
        c.record_step(1, 1, 0.013, drafted=True)
    assert c._clock == COMPARE_MIN_DRAFTING + 1  # the oldest drafted step kept came at tick 2
    for _ in range(STEP_RATE_MAX_AGE + 2 - c._clock):  # resting: plain steps, 1 token in 11 ms (91 tokens/s)
        c.tick()
        c.record_step(1, 1, 0.011, drafted=False)
    assert c.drafting_loses(1)  # the oldest drafted step is STEP_RATE_MAX_AGE steps old: it still counts
    c.tick()
    assert c.step_rates(1) is None and not c.drafting_loses(1)  # 7 recent drafted steps: no verdict
    for _ in range(COMPARE_MIN_DRAFTING):  # the text now running: 2 tokens in 13 ms (154 tokens/s)
        c.tick()
        c.record_step(1, 2, 0.013, drafted=True)
    assert c.step_rates(1) == pytest.approx((2 / 0.013, 1 / 0.011)) and not c.drafting_loses(1)


def test_a_verdict_that_drafting_loses_lapses_once_the_requests_it_judged_have_finished():
    """The drafted steps of a batch size leave the realised comparison once as many requests as that batch size
    have finished since each was recorded: at one request, a loss read on one request's drafts does not keep the
    next request from drafting; at 4 requests it stands until 4 have finished. The steps without drafts age by
    steps only."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, StepCosts

    c = StepCosts()
    for b in (1, 4):
        for _ in range(COMPARE_MIN_DRAFTING + 1):  # drafts rejected: 1 token a request in 13 ms
            c.tick()
            c.record_step(b, b, 0.013, drafted=True)
        for _ in range(COMPARE_MIN_PLAIN + 1):  # steps without drafts: 1 token a request in 11 ms
            c.tick()
            c.record_step(b, b, 0.011, drafted=False)
    assert c.drafting_loses(1) and c.drafting_loses(4)
    c.tick(finished=1)  # the request of the batch of one finished (or one of the four)
    assert c.step_rates(1) is None and not c.drafting_loses(1)
    assert c.drafting_loses(4) and c.step_rates(4)[1] == pytest.approx(4 / 0.011)
    c.tick(finished=2)
    assert c.drafting_loses(4)
    c.tick(finished=1)  # four finished since the drafted steps at 4: the plain ones are kept
    assert c.step_rates(4) is None and not c.drafting_loses(4)
    assert len(c._steps["none"][4]) == COMPARE_MIN_PLAIN
    for _ in range(COMPARE_MIN_DRAFTING):  # the text now running at 4: drafted steps after those finishes stay
        c.tick()
        c.record_step(4, 8, 0.013, drafted=True)
    c.tick(finished=3)
    assert c.step_rates(4) == pytest.approx((8 / 0.013, 4 / 0.011)) and not c.drafting_loses(4)
    c.tick(finished=1)
    assert c.step_rates(4) is None


def test_steps_without_drafts_are_asked_for_where_drafted_ones_have_no_recent_reference():
    """needs_reference: where a batch size (or one within a quarter of it) has COMPARE_MIN_DRAFTING recent drafted
    steps and none has COMPARE_MIN_PLAIN recent steps without drafts, the next steps draft nothing, until the
    comparison can judge. The served case (2026-12-04): plain steps at 32 requests on long chat prompts (80 ms),
    then other traffic, then short math prompts at 32 whose drafted steps emit 54 tokens in 98 ms (551 tokens/s)
    against their own plain step's 32 in 52 ms (615 tokens/s): compared with the chat steps (400 tokens/s) drafting
    would have won; aged out, they leave no verdict, so references are taken and drafting is found to lose."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, STEP_RATE_MAX_AGE, StepCosts

    c = StepCosts()
    assert not c.needs_reference(32)  # nothing drafted: nothing to compare
    for _ in range(COMPARE_MIN_PLAIN + 1):  # chat prompts at 32 requests, no drafts
        c.tick()
        c.record_step(32, 32, 0.080, drafted=False)
    for _ in range(STEP_RATE_MAX_AGE):  # other traffic (one request at a time)
        c.tick()
    for i in range(COMPARE_MIN_DRAFTING + 1):  # math prompts at 32, drafted: no reference asked for until 8 count
        assert not c.needs_reference(32)
        c.tick()
        c.record_step(32, 54, 0.098, drafted=True)
    assert c.step_rates(32) is None and not c.drafting_loses(32)  # the chat steps aged out: no verdict
    assert c.needs_reference(32) and c.needs_reference(30) and c.needs_reference(40)  # within a quarter of 32
    assert not c.needs_reference(23) and not c.needs_reference(43) and c.references == 3
    for _ in range(COMPARE_MIN_PLAIN + 1):  # the references: the math prompts' own plain steps
        c.tick()
        c.record_step(32, 32, 0.052, drafted=False)
    assert not c.needs_reference(32) and c.references == 3
    assert c.step_rates(32) == pytest.approx((54 / 0.098, 32 / 0.052)) and c.drafting_loses(32)
    assert c.summary()["references"] == 3


def test_an_exploring_step_drafts_from_32_requests_on_too():
    """The drafter explores with the schedule under the default cap (no costs); from 32 requests on the cap leaves
    no draft node, so the exploring budget keeps room for the ladder's smallest tree for every request: a step of
    about twice the batch's rows is drafted, and measured."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    smallest = min(t.num_nodes for t in s.ladder if t is not None)
    for n, room in ((1, 31), (16, 16), (32, 32 * smallest), (40, 40 * smallest)):
        assert s.exploring_budget(n) == room
        rids = [f"x{n}-{i}" for i in range(n)]
        out = s.choose(rids, [conf(0.9)] * n, s.exploring_budget(n), None)
        drafted = [t for _, t in out if t is not None]
        assert drafted and sum(t.num_nodes for t in drafted) <= room, (n, out)
        if n >= 32:  # every request confident: the room is filled, a tree for each
            assert sum(t.num_nodes for t in drafted) == room and len(drafted) == n, (n, out)
    assert s.choose([f"y{i}" for i in range(32)], [conf(0.9)] * 32, 0, None) == [(None, None)] * 32  # the cap alone
    assert s.exploring_budget(32, explored=2) == 16 * smallest and s.exploring_budget(32, explored=3) == 32 * smallest


def test_a_drafting_steps_fixed_cost_is_priced_apart_from_its_draft_rows():
    """Served at 32 running on a Xeon with AMX, a step that drafted cost a fixed part more than a plain one and
    little more per draft row: 32 rows 69 ms, 36 rows 88 ms, 64 rows (a chain of 1 each) 94 ms. The drafted steps'
    own line prices the draft rows: 32 requests that each expect 0.45 accepted tokens from one draft token all
    draft, and one confident request among 31 that expect nothing does not pay the fixed part alone. One line
    through the plain and the drafted steps (the same times, not marked as drafted) read the plain step as 78 ms
    and 4 draft rows as 2 ms more."""
    from vllm_entmtp.step_costs import StepCosts

    times = {32: 0.069, 36: 0.088, 48: 0.091, 64: 0.094}
    split, mixed = StepCosts(), StepCosts()
    for _ in range(3):
        for rows, t in times.items():
            split.record_rows(rows, t, 32 if rows > 32 else None)
            mixed.record_rows(rows, t)
        split.record_rows(40, 0.074)  # a plain step of 40 requests: not a drafted step of 32
    curve = split.curve(32, 32)
    assert curve[0] == pytest.approx(0.069)
    assert curve[4] == pytest.approx(0.088, abs=1e-3) and curve[32] == pytest.approx(0.094, abs=1e-3)
    assert split.curve(32, 4) == pytest.approx(curve[:5])  # the same prices whatever the reach asked
    assert mixed.curve(32, 32)[0] > 0.075  # the line through both kinds of step
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    rids = [f"r{i}" for i in range(32)]
    assert ids(s.choose(rids, [conf(0.5)] * 32, None, split)) == ["small"] * 32  # 46.4 tokens in 94 ms
    lone = [conf(0.9)] + [conf(0.1)] * 31  # big (4 nodes, 1.5 tokens expected) for the first, nothing for the rest
    assert ids(s.choose(rids, lone, None, split)) == [None] * 32  # 33.5 tokens in 88 ms against 32 in 69
    # a request's heads may pay as one of many drafting requests, where alone they would need 12x the calibration's
    # acceptance (paying_ratio: the heads run for requests whose record is above it)
    assert s.paying_ratio(32, split) < 0.5


def test_drafted_steps_are_priced_against_the_plain_step_of_their_own_batch_size_as_measured_then():
    """Drafted steps are kept as their time over the plain step of their batch size when they ran, from batch
    sizes near the one priced: when longer contexts make the plain step dearer (served, ShareGPT after GSM8K at 32
    running: 106 ms against 69), the drafted steps measured on the short ones grow with it, where in seconds they
    had made every draft look free; and 16 requests with 24 draft rows say nothing of 32 requests with 8."""
    from vllm_entmtp.step_costs import StepCosts

    c = StepCosts()
    for _ in range(3):
        c.record_rows(32, 0.069)
        for rows, t in ((36, 0.088), (48, 0.091), (64, 0.094)):
            c.record_rows(rows, t, 32)
    for _ in range(16):  # longer contexts: the plain step's window now reads 106 ms
        c.record_rows(32, 0.106)
    curve = c.curve(32, 32)
    assert curve[0] == pytest.approx(0.106)
    assert curve[32] == pytest.approx(0.094 * 0.106 / 0.069, rel=0.01)  # not 0.094: below the plain step
    other = StepCosts()
    for _ in range(3):
        other.record_rows(16, 0.050)
        other.record_rows(32, 0.069)
        for rows, t in ((36, 0.060), (40, 0.061), (48, 0.062)):  # 16 requests with 20-32 draft rows
            other.record_rows(rows, t, 16)
    assert not other.drafted_line_known(32) and other.drafted_line_known(16)  # no drafted step of a batch near 32
    # the plain step a drafted step is taken over is a step without draft rows: 32 rows of 16 requests and their
    # 16 draft rows are not a plain step of 32 rows, so a drafted step of 32 requests is not kept against them
    lone = StepCosts()
    for _ in range(3):
        lone.record_rows(16, 0.050)
        lone.record_rows(32, 0.060, 16)
        lone.record_rows(64, 0.094, 32)
    assert lone.plain_time(16) == pytest.approx(0.050) and lone.plain_time(32) is None
    assert lone._drafted_points(32) == []


def test_drafting_is_explored_soon_while_the_drafted_steps_line_is_not_measured():
    """Where drafts pay only by the line through plain and drafted steps together (no drafted steps' line of its
    own at the batch size), the drafter explores every EXPLORE_UNMEASURED_EVERY steps, and the usual period applies
    once two drafted row counts 8 apart are measured there."""
    from vllm_entmtp.step_costs import EXPLORE_UNMEASURED_EVERY, PROBE_EVERY, StepCosts

    c = StepCosts()
    for _ in range(2):
        c.record_rows(32, 0.069)
        c.record_rows(36, 0.088, 32)  # the schedule's few drafts: one drafted row count
    assert not c.drafted_line_known(32)
    explored = [c.needs_exploration(32, unmeasured_line=True) for _ in range(EXPLORE_UNMEASURED_EVERY)]
    assert explored == [False] * (EXPLORE_UNMEASURED_EVERY - 1) + [True] and c.explored(32) == 1
    for _ in range(2):
        c.record_rows(64, 0.094, 32)  # what the exploring step measured
    assert c.drafted_line_known(32) and not c.drafted_line_known(16)
    assert [c.needs_exploration(32) for _ in range(PROBE_EVERY)].index(True) == PROBE_EVERY - 1
    # where no draft pays (resting), the usual period holds with or without the drafted steps' line
    assert [c.needs_exploration(24) for _ in range(PROBE_EVERY)].index(True) == PROBE_EVERY - 1


def test_measured_rule_learns_how_each_requests_drafts_fare():
    """Two equally confident requests; one has accepted a fifth of what the calibration expected of its drafts:
    at a load where a draft pays only at the calibrated acceptance, that one stops drafting and the other keeps
    its tree. The record goes with the request."""
    s = TreeScheduler(_costed_set(), "confidence", hysteresis=0.0, warmup_steps=0)
    costs = _costs({16: 0.048, 32: 0.048 + 16 * 0.0015}, draft_s=0.001)  # as in the test above: small pays
    rids = [f"r{i}" for i in range(16)]
    assert s.acceptance_ratio("r0") == 1.0
    s.observe_acceptance("r0", 0.7, 0)
    assert s.acceptance_ratio("r0") == 1.0  # one verified draft is not enough to judge
    for _ in range(6):
        s.observe_acceptance("r0", 0.7, 0)
        s.observe_acceptance("r1", 0.7, 1)
    assert s.acceptance_ratio("r0") == 0.2  # clipped below
    assert s.acceptance_ratio("r1") == pytest.approx(1 / 0.7)
    out = ids(s.choose(rids, [conf(0.9)] * 16, None, costs))
    assert out[0] is None and out[1] == "small" and out[2:] == ["small"] * 14
    assert s.expected["r1"] == pytest.approx(0.7) and "r0" not in s.expected
    assert "r0" in s.tracked_ids()
    s.free_missing(rids[1:])
    assert "r0" not in s.tracked_ids() and s.acceptance_ratio("r0") == 1.0


def test_row_times_age_out_and_the_batch_size_is_probed_again():
    """A row count's times are dropped ROWS_MAX_AGE engine steps (tick) after they were measured: steps of 32 rows on
    long chat contexts (80 ms) do not price the rows of short math contexts later; the batch size is then probed
    again (a step without drafts), and the fresh times decide."""
    from vllm_entmtp.step_costs import ROWS_MAX_AGE, StepCosts

    c = StepCosts()
    for rows, t in ((32, 0.080), (32, 0.080), (32, 0.080), (64, 0.096), (64, 0.096)):  # chat: 0.5 ms a draft row
        c.record_rows(rows, t)
        c.tick()
    assert c.rows_time(48) == pytest.approx(0.088) and not c.needs_probe(32)
    for _ in range(ROWS_MAX_AGE - 3):  # the last 32-row time came at step 2, the 64-row ones at 3 and 4
        c.tick()
    assert c.known_rows() == [32, 64]  # the youngest 32-row time is ROWS_MAX_AGE steps old: it still counts
    c.tick()
    assert c.known_rows() == [64]
    c.record_rows(64, 0.100)  # a fresh 64-row time; the older two age out in the next two steps
    for _ in range(3):
        c.tick()
    assert c.known_rows() == [64] and c.summary()["rows_ms"] == {64: 100.0}
    assert c.needs_probe(32)  # no time for 32 rows and none below to interpolate from: probe
    c.record_rows(32, 0.050)  # math: 1.56 ms a draft row
    c.record_rows(32, 0.050)
    assert c.rows_time(48) == pytest.approx(0.075)


def test_the_log_line_names_where_drafting_rests():
    """StepCosts.describe: the realised comparison per batch size (tokens/s with / without draft tokens), which
    batch sizes rest, and the steps made to measure and to explore."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, COMPARE_MIN_PLAIN, StepCosts

    c = StepCosts()
    assert c.describe().startswith("tokens/s of recent steps with/without draft tokens by batch size: none yet;")
    assert not c.compared()
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        c.record_step(1, 2, 0.010, drafted=True)  # 200 tokens/s
        c.record_step(32, 48, 0.100, drafted=True)  # 480 tokens/s
    for _ in range(COMPARE_MIN_PLAIN + 1):
        c.record_step(1, 1, 0.010, drafted=False)  # 100 tokens/s
        c.record_step(32, 32, 0.050, drafted=False)  # 640 tokens/s
    assert c.needs_probe(4) and c.compared()
    assert c.describe() == ("tokens/s of recent steps with/without draft tokens by batch size: 1: 200/100, "
                            "32: 480/640 (rests); steps without drafts to measure: probes 1, references 0; "
                            "exploring steps 0")
