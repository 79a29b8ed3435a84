"""The entmtp method inside vLLM's config: plugin registration, good and bad options, heads that don't fit."""
import importlib.metadata
import subprocess
import sys

import pytest

from conftest import make_heads


@pytest.fixture(scope="module")
def spec_cls():
    import vllm.plugins
    from vllm.config import SpeculativeConfig

    vllm.plugins.load_general_plugins()
    return SpeculativeConfig


def _make(spec_cls, target_model_config, **kw):
    from vllm.config import ParallelConfig

    return spec_cls(target_model_config=target_model_config, target_parallel_config=ParallelConfig(), **kw)


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "entmtp" and ep.value == "vllm_entmtp.plugin:register" for ep in eps)


def test_register_is_idempotent(spec_cls):
    from vllm_entmtp.plugin import register

    post_init = spec_cls.__post_init__
    register()
    register()
    assert spec_cls.__post_init__ is post_init and spec_cls._entmtp_patched


def test_defaults_use_registered_heads(spec_cls, target_model_config, default_heads):
    sc = _make(spec_cls, target_model_config, method="entmtp")
    from vllm_entmtp.heads.formats import read_any_heads_config

    assert sc.entmtp_heads == default_heads and sc.model == default_heads
    # no fixed draft asked for: EntMTP's entropy scheduling over the default tree set; a step carries at most
    # the largest tree of its schedule
    from vllm_entmtp.trees import load_tree_set

    ts = load_tree_set("default", num_heads=read_any_heads_config(default_heads).num_heads)
    assert sc.entmtp.policy == ts.schedule.signal and sc.entmtp.tree_set == "default"
    scheduled = max(ts.get(t).num_nodes for t in ts.schedule.tree_ids if t != "none")
    # prompt lookup (draft_sources "hybrid", the default) drafts chains of up to lookup_tokens (4)
    assert sc.entmtp.draft_sources == "hybrid"
    assert sc.num_speculative_tokens == max(scheduled, sc.entmtp.lookup_tokens)
    heads_only = _make(spec_cls, target_model_config, method="entmtp", draft_sources="heads")
    assert heads_only.num_speculative_tokens == scheduled
    assert _make(spec_cls, target_model_config, method="entmtp", lookup_tokens=7).num_speculative_tokens == 7
    # room for larger trees of the set (a request's entmtp_tree_id), but not past them or below the schedule
    in_set = max(t.num_nodes for _, t in ts.trees)
    roomy = _make(spec_cls, target_model_config, method="entmtp", policy=ts.schedule.signal, tree_set="default",
                  num_speculative_tokens=in_set)
    assert roomy.num_speculative_tokens == in_set and roomy.entmtp.policy == ts.schedule.signal
    with pytest.raises(ValueError, match=r"confidence_heads=9, but the heads .* allowed: 1\.\."):
        _make(spec_cls, target_model_config, method="entmtp", confidence_heads=9)
    for bad in (in_set + 1, scheduled - 1):
        if bad >= 1:
            with pytest.raises(ValueError, match=f"num_speculative_tokens={bad}, but the scheduled trees"):
                _make(spec_cls, target_model_config, method="entmtp", policy=ts.schedule.signal,
                      tree_set="default", num_speculative_tokens=bad)
    assert sc.entmtp.draft_confidence_threshold == 0.0
    chains = _make(spec_cls, target_model_config, method="entmtp", num_speculative_tokens=2)
    assert chains.entmtp.policy == "static" and chains.num_speculative_tokens == 2  # a fixed draft: chains
    assert sc.method == "medusa"  # entmtp runs on vLLM's medusa plumbing (vllm_entmtp/patches/config.py)


def test_explicit_options(spec_cls, target_model_config, tmp_path):
    make_heads(tmp_path, num_heads=3)
    sc = _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path), num_speculative_tokens=2,
               draft_confidence_threshold=0.25)
    assert sc.num_speculative_tokens == 2 and sc.entmtp.draft_confidence_threshold == 0.25
    assert sc.entmtp_heads == str(tmp_path)


def test_unknown_key_is_named_with_allowed_keys(spec_cls, target_model_config):
    with pytest.raises(ValueError) as e:
        _make(spec_cls, target_model_config, method="entmtp", tree_sett="x")
    msg = str(e.value)
    assert "unknown key(s) ['tree_sett']" in msg and "draft_confidence_threshold" in msg
    assert "num_speculative_tokens" in msg


@pytest.mark.parametrize("value", [1.5, -0.1, "high"])
def test_bad_value_is_named_with_allowed_range(spec_cls, target_model_config, value):
    with pytest.raises(ValueError) as e:
        _make(spec_cls, target_model_config, method="entmtp", draft_confidence_threshold=value)
    assert "draft_confidence_threshold=" in str(e.value) and ">= 0.0, < 1.0" in str(e.value)


def test_more_draft_tokens_than_heads_is_refused(spec_cls, target_model_config, tmp_path):
    make_heads(tmp_path, num_heads=2)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 but the heads .* have 2 heads.*1\.\.2"):
        _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path), num_speculative_tokens=3)


def test_heads_that_do_not_fit_the_target_are_refused(spec_cls, target_model_config, tmp_path):
    make_heads(tmp_path, hidden_size=64, vocab_size=49152)
    with pytest.raises(ValueError, match=r"heads hidden_size=64, target hidden_size=576"):
        _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path))


def test_missing_heads_folder_is_refused(spec_cls, target_model_config, tmp_path):
    with pytest.raises(ValueError, match=r"is not a local folder and could not be downloaded"):
        _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path / "nope"))


def test_vllm_speculative_keys_are_the_users_and_none_of_entmtps(spec_cls):
    from vllm_entmtp.config import EntMTPConfig
    from vllm_entmtp.patches.config import vllm_speculative_keys

    keys = vllm_speculative_keys()
    assert keys == sorted(keys)
    assert {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"} <= set(keys)
    # set by vLLM itself, so not listed to users as allowed keys
    assert not {"target_model_config", "target_parallel_config", "draft_model_config"} & set(keys)
    # entmtp's options are the keys vLLM does not define; one of both would be read twice
    assert not set(EntMTPConfig.model_fields) & set(keys)


def test_other_methods_still_refuse_unknown_keys(spec_cls, target_model_config):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['draft_confidence_threshold'\].*'ngram'"):
        _make(spec_cls, target_model_config, method="ngram", num_speculative_tokens=2,
              draft_confidence_threshold=0.5)
    sc = _make(spec_cls, target_model_config, method="ngram", num_speculative_tokens=2)
    assert sc.method == "ngram" and not hasattr(sc, "entmtp")


def test_unsupported_vllm_version_is_refused():
    from vllm_entmtp.patches import check_vllm_version

    assert check_vllm_version("0.32.0+cpu") == "0.32.0"
    with pytest.raises(RuntimeError, match=r"supports vLLM 0.32.0 only; the installed vLLM is 0.33.1"):
        check_vllm_version("0.33.1")


@pytest.mark.engine
def test_vllm_serve_fails_at_startup_on_a_bad_option(default_model):
    """The real command line: a bad key stops `vllm serve` before any engine starts, naming the key."""
    vllm_cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", default_model, "--port", "0",
                "--speculative-config", '{"method": "entmtp", "tree_sett": "gsm8k"}']
    p = subprocess.run(vllm_cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "unknown key(s) ['tree_sett']" in p.stderr + p.stdout


def test_tree_options_size_the_step(spec_cls, target_model_config, tmp_path):
    make_heads(tmp_path, num_heads=4)
    sc = _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path), tree_set="ladder",
               tree_id="mc6")
    assert sc.num_speculative_tokens == 6 and len(sc.entmtp_tree) == 6 and sc.entmtp_tree_id == "mc6"
    sc = _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path), tree_set="ladder",
               policy="entropy")
    assert sc.num_speculative_tokens == 24 and sc.entmtp_tree is None  # the ladder's largest tree
    assert sc.entmtp_tree_set_path.endswith("ladder.json")
    sc = _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path), tree=[[0], [1], [0, 0]])
    assert sc.num_speculative_tokens == 3 and sc.entmtp_tree == [[0], [1], [0, 0]]


def test_bad_tree_file_is_refused_at_startup_with_the_entry_named(spec_cls, target_model_config, tmp_path):
    make_heads(tmp_path / "heads", num_heads=4)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "name": "bad", "heads": {"kind": "medusa", "num_heads": 4}, '
                   '"trees": [{"id": "t", "paths": [[0], [1, 0]], "metadata": {"num_nodes": 2, "depth": 2}}]}')
    with pytest.raises(ValueError, match=r"bad.json.*\[1, 0\]"):
        _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path / "heads"), tree_set=str(bad))


def test_tree_deeper_than_the_heads_is_refused(spec_cls, target_model_config, tmp_path):
    make_heads(tmp_path, num_heads=2)
    with pytest.raises(ValueError, match=r"depth 3, deeper than the 2 heads"):
        _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path), tree=[[0], [0, 0], [0, 0, 0]])


def test_scheduled_policy_needs_a_tree_set(spec_cls, target_model_config, tmp_path):
    make_heads(tmp_path, num_heads=4)
    with pytest.raises(ValueError, match=r"policy.*tree_set"):
        _make(spec_cls, target_model_config, method="entmtp", model=str(tmp_path), policy="entropy")


def test_vllm_own_medusa_method_is_left_alone(spec_cls, target_model_config, shipped_heads):
    """With the plugin installed, vLLM's built-in medusa (a baseline) configures as without it."""
    sc = _make(spec_cls, target_model_config, method="medusa", model=shipped_heads["medusa"],
               num_speculative_tokens=2)
    assert sc.method == "medusa" and sc.num_speculative_tokens == 2
    assert getattr(sc, "entmtp", None) is None  # so the runner patch keeps vLLM's MedusaProposer


def test_prompt_lookup_bounds_are_vllms_keys(spec_cls, target_model_config):
    """entmtp's prompt lookup reads vLLM's prompt_lookup_min/_max (its defaults 2 and 4 when neither is given;
    vLLM's medusa set-up zeroes them, so they are kept before it) and refuses min > max at start-up."""
    assert _make(spec_cls, target_model_config, method="entmtp").entmtp_lookup == (2, 4)
    assert _make(spec_cls, target_model_config, method="entmtp", prompt_lookup_min=3,
                 prompt_lookup_max=6).entmtp_lookup == (3, 6)
    assert _make(spec_cls, target_model_config, method="entmtp", prompt_lookup_min=5).entmtp_lookup == (5, 5)
    with pytest.raises(ValueError, match="prompt_lookup_min=5 must be <= prompt_lookup_max=3"):
        _make(spec_cls, target_model_config, method="entmtp", prompt_lookup_min=5, prompt_lookup_max=3)


def test_start_up_explains_vllms_medusa_wording(spec_cls, target_model_config):
    """vLLM logs entmtp's set-up in its inner method's words ('MedusaModel', medusa-based speculative decoding);
    the plugin says so once, in vLLM's log."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.entmtp")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    spec_cls._entmtp_explained = False
    try:
        _make(spec_cls, target_model_config, method="entmtp")
        _make(spec_cls, target_model_config, method="entmtp")
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    lines = [r.getMessage() for r in records if "runs inside vLLM" in r.getMessage()]
    assert len(lines) == 1 and "'medusa' method" in lines[0] and "MedusaModel" in lines[0], lines


def test_pipeline_parallelism_is_refused_at_start_up(spec_cls, target_model_config):
    from vllm.config import ParallelConfig

    # the drafter, its tree rows and the tree attention would live on the last stage only
    with pytest.raises(ValueError, match=r"does not support pipeline parallelism \(pipeline_parallel_size=2\)"):
        spec_cls(target_model_config=target_model_config,
                 target_parallel_config=ParallelConfig(pipeline_parallel_size=2), method="entmtp")
    assert _make(spec_cls, target_model_config, method="entmtp").entmtp is not None  # one stage: served
