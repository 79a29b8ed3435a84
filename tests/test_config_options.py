"""EntMTPConfig's scheduler options, validated with pydantic only (no vLLM import)."""
import json
import re

import pytest

from vllm_entmtp.config import EntMTPConfig, EntMTPConfigError, entmtp_keys, parse_entmtp_options

VLLM_KEYS = ["method", "model", "num_speculative_tokens"]


def parse(**options):
    return parse_entmtp_options(options, VLLM_KEYS)


def test_defaults_keep_todays_behaviour():
    c = parse()
    assert (c.policy, c.entropy_window, c.acceptance_window, c.hysteresis, c.warmup_steps,
            c.max_verify_tokens_per_step) == ("auto", 16, 8, 0.05, 2, None)
    assert c.tree_set is None and c.draft_confidence_threshold == 0.0
    for k in ("policy", "entropy_window", "acceptance_window", "hysteresis", "warmup_steps",
              "max_verify_tokens_per_step"):
        assert k in entmtp_keys() and EntMTPConfig.model_fields[k].description, k


def test_scheduler_options_are_accepted():
    c = parse(policy="entropy", tree_set="default", entropy_window=4, acceptance_window=1, hysteresis=0,
              warmup_steps=0, max_verify_tokens_per_step=128)
    assert (c.policy, c.entropy_window, c.acceptance_window, c.hysteresis, c.warmup_steps,
            c.max_verify_tokens_per_step) == ("entropy", 4, 1, 0.0, 0, 128)
    assert parse(policy="confidence", tree_set="x.json", tree_id="mc6").tree_id == "mc6"
    assert parse(policy="static", tree=[[0]]).policy == "static"  # static needs no tree_set
    assert "hysteresis" not in parse(policy="entropy", tree_set="d").model_fields_set  # "not given" is visible


@pytest.mark.parametrize("policy", ["entropy", "confidence"])
def test_non_static_policy_needs_tree_set(policy):
    with pytest.raises(EntMTPConfigError, match=re.escape(f"policy={policy!r} chooses among the trees of a tree set: "
                                                          f"give 'tree_set' too")):
        parse(policy=policy)
    with pytest.raises(EntMTPConfigError, match="'tree_set'"):
        parse(policy=policy, tree=[[0], [1]])


@pytest.mark.parametrize("options,message", [
    (dict(policy="greedy"), r"policy='greedy': Input should be 'auto', 'static', 'entropy' or 'confidence'; allowed: "
                            r"policy \('auto' \| 'static' \| 'entropy' \| 'confidence'; default 'auto'\)"),
    (dict(entropy_window=0), r"entropy_window=0: Input should be greater than or equal to 1; allowed: entropy_window "
                             r"\(int, >= 1; default 16\)"),
    (dict(entropy_window=True), r"entropy_window=True: Input should be a valid integer"),
    (dict(acceptance_window=2.5), r"acceptance_window=2.5: Input should be a valid integer"),
    (dict(hysteresis=-0.1), r"hysteresis=-0.1: Input should be greater than or equal to 0"),
    (dict(hysteresis=float("inf")), r"hysteresis=inf: Input should be a finite number"),
    (dict(warmup_steps=-1), r"warmup_steps=-1: Input should be greater than or equal to 0"),
    (dict(max_verify_tokens_per_step=0), r"max_verify_tokens_per_step=0: Input should be greater than or equal to "
                                         r"1; allowed: max_verify_tokens_per_step \(int \| None, >= 1; default None\)"),
])
def test_bad_values_are_named_with_the_allowed_range(options, message):
    with pytest.raises(EntMTPConfigError, match=r"invalid --speculative-config for method 'entmtp': " + message):
        parse(**options)


def test_unknown_key_suggests_the_closest_and_lists_the_keys_briefly():
    with pytest.raises(EntMTPConfigError, match=r"unknown key\(s\) \['polcy'\].* Did you mean policy \('auto' \| "
                                                r"'static' \| 'entropy' \| 'confidence'; default 'auto'\)\?.*"
                                                r"max_verify_tokens_per_step.*"
                                                r"vLLM's own keys \(\d+: method, model, num_speculative_tokens"):
        parse(polcy="entropy")
    with pytest.raises(EntMTPConfigError) as e:
        parse(zzz=1)
    assert "Did you mean" not in str(e.value) and len(str(e.value)) < 700  # it printed kilobytes


def test_several_errors_are_reported_together():
    with pytest.raises(EntMTPConfigError) as e:
        parse(entropy_window=0, warmup_steps=-1)
    assert "entropy_window=0" in str(e.value) and "warmup_steps=-1" in str(e.value)


def test_auto_policy_schedules_unless_a_fixed_draft_is_asked_for(tmp_path):
    from vllm_entmtp.config import resolve_policy

    from vllm_entmtp.errors import TreeSetError
    from vllm_entmtp.trees import load_tree_set

    auto = resolve_policy(parse(), num_speculative_tokens_given=False, num_heads=4)
    assert (auto.policy, auto.tree_set) == (load_tree_set("default").schedule.signal, "default")
    assert resolve_policy(parse(tree_set="medusa63"), False, 4).policy == "entropy"  # no schedule: entropy
    conf = tmp_path / "conf.json"  # a set calibrated on the confidence signal is scheduled on it
    conf.write_text(json.dumps({"schema_version": 1, "name": "c", "heads": {"kind": "hydra", "num_heads": 4},
                                "trees": [{"id": "a", "paths": [[0]], "metadata": {"num_nodes": 1, "depth": 1}}],
                                "schedule": {"signal": "confidence", "thresholds": [0.3], "tree_ids": ["a", "none"]}}))
    assert resolve_policy(parse(tree_set=str(conf)), False, 4).policy == "confidence"
    with pytest.raises(TreeSetError, match="absent"):  # the user's set must load: its error, not chains
        resolve_policy(parse(tree_set=str(tmp_path / "absent.json")), False, 4)
    for opts, n_given in ((dict(tree=[[0], [1]]), False), (dict(tree_set="default", tree_id="chain2"), False),
                          ({}, True), (dict(draft_confidence_threshold=0.2), False)):
        assert resolve_policy(parse(**opts), n_given, 4).policy == "static", opts
    assert resolve_policy(parse(), False, num_heads=1).policy == "static"  # the default set is deeper: chains
    assert resolve_policy(parse(policy="confidence", tree_set="default"), True, 4).policy == "confidence"
