"""The ablation benchmark's bookkeeping, and the entropy/acceptance correlation the drafter records."""
import math

import pytest

from conftest import load_benchmark
from vllm_entmtp.stats import TreeStats, pearson

ab = load_benchmark("ablation")


def test_variants_and_interleaved_order():
    vs = ab.variants(["a", "b"])
    assert vs == [("no-drafting", {"entmtp_num_draft_tokens": 0}), ("tree:a", {"entmtp_tree_id": "a"}),
                  ("tree:b", {"entmtp_tree_id": "b"}), ("scheduled", None)]
    names = [n for n, _ in vs]
    order = ab.phase_order(names, 2)
    assert [n for r, n in order if r == 0] == names
    assert [n for r, n in order if r == 1] == names[1:] + names[:1]


def test_prompt_interleaving_runs_every_prompt_under_all_variants_back_to_back():
    names = ["no-drafting", "tree:a", "scheduled"]
    order = ab.prompt_phase_order(names, 2, 4)
    assert len(order) == 2 * 4 * 3
    for r in range(2):
        for p in range(4):
            block = order[(r * 4 + p) * 3:(r * 4 + p + 1) * 3]
            assert {(rr, pp) for rr, pp, _ in block} == {(r, p)}  # one prompt, all variants, consecutive
            assert [n for _, _, n in block] == names[(r + p) % 3:] + names[:(r + p) % 3]
    firsts = [n for i, (_, _, n) in enumerate(order) if i % 3 == 0]
    assert sorted(firsts.count(n) for n in names) == [2, 3, 3]  # 8 blocks: each variant leads 2 or 3 of them
    assert ab.phase_name(1, 3, "tree:a") == "1:3:tree:a" and ab.phase_name(1, None, "tree:a") == "1:tree:a"


def test_outputs_differing_counts_runs_unlike_no_drafting():
    outputs = {(0, 0): {"no-drafting": [1, 2, 3], "tree:a": [1, 2, 3], "scheduled": [1, 2, 4]},
               (0, 1): {"no-drafting": [5], "tree:a": [5], "scheduled": [5]},
               (1, 0): {"no-drafting": [1, 2, 3], "tree:a": [1, 2], "scheduled": [1, 2, 4]}}
    assert ab.outputs_differing(outputs) == {"tree:a": 1, "scheduled": 2}
    assert ab.outputs_text(ab.outputs_differing(outputs)).endswith("tree:a 1, scheduled 2.")
    assert ab.outputs_text({"tree:a": 0}).startswith("Greedy outputs: identical")


def test_chosen_step_keys_of_cut_chains():
    keys = {"c4": "4", "t4": "4t"}
    assert ab.chosen_step_key("c4", keys) == "4" and ab.chosen_step_key("c4@2", keys) == "2"
    assert ab.chosen_step_key("t4", keys) == "4t" and ab.chosen_step_key("t4@2", keys) == ""  # a cut tree: unknown
    assert ab.chosen_step_key("x", keys) == "" and ab.chosen_step_key("x@1", keys) == ""


def test_per_round_pools_the_prompt_phases_of_a_round():
    phases = [{"round": 0, "prompt": 0, "variant": "x", "output_tokens": 10, "seconds": 1.0},
              {"round": 0, "prompt": 1, "variant": "x", "output_tokens": 30, "seconds": 1.0},
              {"round": 0, "prompt": 0, "variant": "y", "output_tokens": 5, "seconds": 1.0},
              {"round": 1, "prompt": 0, "variant": "x", "output_tokens": 12, "seconds": 2.0}]
    assert ab.per_round({"phases": phases}, "x") == [20.0, 6.0]
    assert ab.per_round({"phases": phases}, "y") == [5.0]


def test_skip_prompts_leaves_out_the_calibration_prompts():
    from vllm_entmtp.datasets import load_prompts

    calib = {p.id for p in load_prompts("sharegpt", limit=16)}  # what build-trees --num-prompts 16 reads
    held_out = ab.select_prompts("sharegpt", 6, skip=16, max_chars=1500)
    assert len(held_out) == 6 and not calib & {p.id for p in held_out}
    assert all(len(p.messages[-1]["content"]) < 1500 for p in held_out)
    first = ab.select_prompts("sharegpt", 6, max_chars=1500)
    assert [p.id for p in first] == [p.id for p in load_prompts("sharegpt", limit=6, max_chars=1500)]
    assert calib & {p.id for p in first}


def test_summary_ratios_and_shares():
    ph = [{"variant": "no-drafting", "output_tokens": 100, "seconds": 10.0, "num_drafts": 0, "num_accepted_tokens": 0,
           "chosen": {"none": 90}},
          {"variant": "tree:a", "output_tokens": 100, "seconds": 8.0, "num_drafts": 80, "num_accepted_tokens": 20,
           "chosen": {"a": 80}},
          {"variant": "tree:b", "output_tokens": 100, "seconds": 9.0, "num_drafts": 70, "num_accepted_tokens": 30,
           "chosen": {"b": 70}},
          {"variant": "scheduled", "output_tokens": 60, "seconds": 4.0, "num_drafts": 40, "num_accepted_tokens": 20,
           "chosen": {"a": 30, "b": 10}},
          {"variant": "scheduled", "output_tokens": 40, "seconds": 3.0, "num_drafts": 30, "num_accepted_tokens": 10,
           "chosen": {"b": 10, "none": 10}}]
    s = ab.summarize(ph, ["no-drafting", "tree:a", "tree:b", "scheduled"])
    v = s["variants"]
    assert s["best_static"] == "tree:a"
    assert v["scheduled"]["tokens_per_s"] == pytest.approx(100 / 7)  # pooled over its phases
    assert v["scheduled"]["vs_best_static"] == pytest.approx((100 / 7) / (100 / 8))
    assert v["tree:b"]["vs_no_drafting"] == pytest.approx((100 / 9) / 10)
    assert v["scheduled"]["mean_acceptance_length_incl_bonus"] == pytest.approx(1 + 30 / 70)
    assert v["scheduled"]["choice_shares"] == {"a": 0.5, "b": 1 / 3, "none": 1 / 6}
    assert "scheduled" in ab.format_table(s)


def _result(task, tps):
    """An ablation result whose variants ran at ``tps`` tokens/s (two rounds of 50 tokens each)."""
    phases = [{"round": r, "variant": n, "output_tokens": 50, "seconds": 50 / t, "num_drafts": 10,
               "num_accepted_tokens": 5, "chosen": {}} for r in range(2) for n, t in tps.items()]
    return {"tree_set": f"trees/{task}.json", "prompt_set": task, "num_prompts": 8, "max_tokens": 64, "repeats": 2,
            "dtype": "float32", "phases": phases, **ab.summarize(phases, list(tps)), "entropy_acceptance": {}}


def test_markdown_report_verdict(tmp_path, capsys):
    good = [_result("humaneval", {"no-drafting": 8, "tree:a": 9, "scheduled": 9.5}),
            _result("gsm8k", {"no-drafting": 8, "tree:a": 9, "tree:b": 9.2, "scheduled": 9.3}),
            _result("sharegpt", {"no-drafting": 8, "tree:a": 9, "scheduled": 8.9})]
    text = ab.markdown_report(good)
    assert "| scheduled | 9.50 | 9.50 / 9.50 | 1.188 | 1.056 |" in text
    assert "on 2 task(s) (humaneval, gsm8k); needed: 2 -> met" in text
    assert "sharegpt 0.989; needed: never below 0.98 -> met" in text
    bad = good[:1] + [_result("creative", {"no-drafting": 8, "tree:a": 9, "scheduled": 8.7})]
    text = ab.markdown_report(bad)
    assert "on 1 task(s) (humaneval); needed: 2 -> not met" in text and "-> not met" in text.splitlines()[-1]
    import json

    files = []
    for r in good:
        files.append(tmp_path / f"{r['prompt_set']}.json")
        files[-1].write_text(json.dumps(r))
    assert ab.main(["--report", *map(str, files), "--out", str(tmp_path / "r.md")]) == 0
    assert (tmp_path / "r.md").read_text() == capsys.readouterr().out == ab.markdown_report(good)
    assert "one eager engine, one request at a time." in text
    loaded = dict(good[0], concurrency=16, max_verify_tokens_per_step=24, compiled=True)
    assert "one compiled engine, 16 requests in flight, max_verify_tokens_per_step 24." in ab.markdown_report([loaded])
    loaded["load_policy"] = "cap"
    assert "16 requests in flight, load_policy cap, max_verify_tokens_per_step 24." in ab.markdown_report([loaded])


def test_make_llm_is_eager_unless_told(monkeypatch):
    """`--compiled` reaches vLLM: the harness's engine is eager by default and compiled with enforce_eager=False."""
    import vllm

    from vllm_entmtp.harness import make_llm

    seen = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: seen.append(kw))
    make_llm("m", None)
    make_llm("m", None, enforce_eager=False)
    assert [kw["enforce_eager"] for kw in seen] == [True, False]


def test_entropy_acceptance_correlation():
    s = TreeStats()
    for x, y in [(0.1, 3), (0.5, 2), (1.0, 1), (2.0, 0)]:
        s.record_signal("t", x, y)
    s.record_signal("u", 1.0, 1)
    d = s.as_dict()["entropy_acceptance"]
    assert d["t"]["n"] == 4 and d["t"]["r"] < -0.9  # more entropy, fewer accepted tokens
    assert d["u"]["r"] is None and d["all"]["n"] == 5  # one pair: undefined
    xs, ys = [0.1, 0.5, 1.0, 2.0], [3, 2, 1, 0]
    mx, my = sum(xs) / 4, sum(ys) / 4
    r = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / math.sqrt(
        sum((a - mx) ** 2 for a in xs) * sum((b - my) ** 2 for b in ys))
    assert d["t"]["r"] == pytest.approx(r)
    assert pearson(0, 0, 0, 0, 0, 0)["r"] is None
    assert s.as_dict()["confidence_acceptance"] == {}  # not tracked
    s.record_signal("t", None, 2, confidence=0.9)
    s.record_signal("t", None, 0, confidence=0.1)
    c = s.as_dict()["confidence_acceptance"]
    assert c["t"]["n"] == 2 and c["t"]["r"] == pytest.approx(1.0) and c["t"]["mean_signal"] == pytest.approx(0.5)
    assert s.as_dict()["entropy_acceptance"]["t"]["n"] == 4  # None entropies are not averaged in


def test_step_cost_by_nodes():
    summary = ab.summarize(
        [{"variant": v, "output_tokens": t, "seconds": 10.0, "num_drafts": d, "num_accepted_tokens": a, "chosen": {}}
         for v, t, d, a in [("no-drafting", 100, 0, 0), ("tree:a", 120, 80, 40), ("tree:b", 100, 50, 50),
                            ("tree:c", 90, 60, 30)]], ["no-drafting", "tree:a", "tree:b", "tree:c", "scheduled"])
    # a: MAL 1.5 at 12 tok/s vs 10: cost 1.25; b: MAL 2 at 10: 2.0; c: MAL 1.5 at 9: 1.6667
    assert ab.step_cost_from_rates(summary, {"a": "1", "b": "4t", "c": "4t"}) == {"1": 1.25,
                                                                                "4t": round((2 + 15 / 9) / 2, 4)}
    assert ab.step_cost_from_rates(summary, {"a": "1", "b": "4", "c": "4t"}) == {"1": 1.25, "4": 2.0,
                                                                               "4t": round(15 / 9, 4)}


def test_step_timer_medians_and_costs():
    from vllm_entmtp.stats import parse_step_key, step_key

    st = load_benchmark("step_timer")
    StepTimer, step_costs_from_times = st.StepTimer, st.step_costs_from_times
    t = StepTimer(cap=4)
    for x in (0.10, 0.11, 0.50, 0.09):  # one spike: the median ignores it
        t.record("0", x)
    for x in (0.12, 0.13, 0.14, 0.9, 0.13, 0.13):  # past the cap the oldest are overwritten (0.12, 0.13 go)
        t.record("2", x)
    sm = t.summary()
    assert sm["0"]["n"] == 4 and sm["0"]["median_ms"] == pytest.approx(105.0)
    assert sm["2"]["n"] == 4 and sorted(t._times["2"]) == [0.13, 0.13, 0.14, 0.9]
    assert sm["2"]["median_ms"] == pytest.approx(135.0)
    assert step_costs_from_times(sm) == {"2": round(135 / 105, 4)}
    assert step_costs_from_times({"2": sm["2"]}) == {}  # no 0-node steps: no reference
    t.record(step_key(2, True), 0.2)  # a tree of 2 nodes that needs the attention fix: its own key
    assert list(t.summary()) == ["0", "2", "2t"] and t.summary()["2t"]["median_ms"] == pytest.approx(200.0)
    assert parse_step_key("12t") == (12, True) and parse_step_key("3") == (3, False)
    with pytest.raises(ValueError):
        parse_step_key("x")


def test_tree_step_key_marks_trees_that_branch_before_their_end():
    from vllm_entmtp.stats import tree_step_key
    from vllm_entmtp.trees import Tree

    assert tree_step_key(Tree.chain(3)) == "3"
    assert tree_step_key(Tree([[0], [0, 0], [1]])) == "3t"  # branches after its chain: rows need the fix
    assert tree_step_key(Tree([[0], [1]])) == "2t"
    assert tree_step_key(Tree([[0]])) == "1"


def test_step_time_speedups_and_their_verdict():
    """The estimate from median step costs: output tokens over the cost of the steps each variant took."""
    good = _result("humaneval", {"no-drafting": 8, "tree:a": 9, "scheduled": 8.9})  # the wall clock: behind
    for ph in good["phases"]:
        ph["chosen"] = {"no-drafting": {"none": 50}, "tree:a": {"a": 40}, "scheduled": {"a": 20, "b": 10, "none": 5}}[
            ph["variant"]]
    good.update(ab.summarize(good["phases"], list(good["variants"])))
    good["step_cost_by_nodes"] = {"1": 1.1, "2t": 1.3}
    good["step_keys"] = {"a": "1", "b": "2t"}
    est = ab.step_time_speedups(good)
    assert est["no-drafting"] == pytest.approx(1.0)
    assert est["tree:a"] == pytest.approx(100 / (80 * 1.1))
    assert est["scheduled"] == pytest.approx(100 / (40 * 1.1 + 20 * 1.3 + 10 * 1.0))
    text = ab.markdown_report([good])
    assert f"| {est['scheduled']:.3f} / {est['scheduled'] / est['tree:a']:.3f} |" in text
    assert "- tokens/s (wall clock): scheduled / best static tree: humaneval 0.989" in text
    assert f"- step-time estimate (median step costs): scheduled / best static tree: humaneval " \
           f"{est['scheduled'] / est['tree:a']:.3f}" in text
    assert ab.step_time_speedups(dict(good, concurrency=4)) == {}  # steps of a batch are not timed
    good["step_keys"] = {"a": "1"}  # a tree without a measured cost: no estimate for what drafted it
    assert set(ab.step_time_speedups(good)) == {"no-drafting", "tree:a"}
    good["step_cost_by_nodes"] = {}
    assert ab.step_time_speedups(good) == {}


def test_extra_static_trees_are_the_sets_best_outside_its_schedule(tmp_path):
    """--extra-trees ranks the trees outside the schedule by the calibration's expected tokens per step over
    cost, averaged over the bins; trees without that metadata are never picked."""
    import json

    from vllm_entmtp.trees import load_tree_set

    def tree(i, paths, tokens, cost):
        meta = {"num_nodes": len(paths), "depth": max(map(len, paths))}
        if tokens:
            meta |= {"expected_tokens_per_step_per_bin": tokens, "cost": {"total": cost}}
        return {"id": i, "paths": paths, "metadata": meta}

    raw = {"schema_version": 1, "name": "t", "heads": {"kind": "hydra", "num_heads": 4}, "trees": [
        tree("c1", [[0]], [1.8, 1.2], 1.0),                           # in the schedule
        tree("c2", [[0], [0, 0]], [2.2, 1.2], 1.1),                   # in the schedule
        tree("c3", [[0], [0, 0], [0, 0, 0]], [2.4, 1.2], 1.25),       # 1.44
        tree("b2", [[0], [1]], [2.0, 1.4], 1.5),                      # 1.13
        tree("c4", [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], [2.5, 1.2], 1.2),  # 1.54: the best outside
        tree("bare", [[0], [1], [2]], None, None)],
        "schedule": {"signal": "confidence", "thresholds": [0.5], "tree_ids": ["c2", "c1"]}}
    (tmp_path / "t.json").write_text(json.dumps(raw))
    ts = load_tree_set(tmp_path / "t.json")
    assert ab.best_unscheduled(ts, 1) == ["c4"]
    assert ab.best_unscheduled(ts, 5) == ["c4", "c3", "b2"]
    assert ab.best_unscheduled(ts, 0) == []


def test_step_hook_loads_from_the_environment_and_times_one_request_decode_steps(monkeypatch, tmp_path):
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import vllm_entmtp.step as step
    from vllm_entmtp.stats import STEP_HOOK_ENV, load_step_hook
    from vllm_entmtp.trees import Tree

    monkeypatch.delenv(STEP_HOOK_ENV, raising=False)
    assert load_step_hook() is None  # unset: no hook
    monkeypatch.setenv(STEP_HOOK_ENV, "no_such_module_here")
    with pytest.raises(RuntimeError, match=STEP_HOOK_ENV):
        load_step_hook()
    (tmp_path / "hookless.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(STEP_HOOK_ENV, "hookless")
    with pytest.raises(RuntimeError, match="make_hook"):
        load_step_hook()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.setenv(STEP_HOOK_ENV, "step_timer")
    hook = load_step_hook()
    assert hook.stats() == {"step_ms": {}}

    def out(tokens, drafts):  # a scheduler output: request -> scheduled tokens, request -> draft tokens
        return SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                               scheduled_spec_decode_tokens=drafts)

    monkeypatch.setattr(step.STEP, "rows", {})
    hook(None, out({"a": 1}, {}), 10.0)       # a decode step of a, no drafts: timed from here
    hook(None, out({"a": 3}, {"a": [5, 6]}), 10.5)  # the next step of a: the first took 0.5 s; a 2-chain starts
    monkeypatch.setattr(step.STEP, "rows", {0: Tree([[0], [1]])})
    hook(None, out({"a": 3}, {"a": [5, 6]}), 10.8)  # 0.3 s for the chain; this one is a tree that needs the fix
    hook(None, out({"a": 1, "b": 7}, {}), 11.0)  # two requests (b's prompt): not a one-request step, not timed
    hook(None, out({"a": 1}, {}), 11.5)  # the tree step was cut by the two-request one: nothing recorded
    sm = hook.stats()["step_ms"]
    assert list(sm) == ["0", "2"] and sm["0"]["median_ms"] == pytest.approx(500.0)
    assert sm["2"]["median_ms"] == pytest.approx(300.0)
    del sys.modules["step_timer"]
