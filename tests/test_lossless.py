"""Losslessness: greedy entmtp output equals plain decoding token for token (float32).

In float32 a forward that verifies several tokens gives the same argmax as one-token decode steps (in bf16,
near-ties flip; see docs/architecture.md), so equality here is exact. 30 prompts from three prompt sets;
plain decoding one request at a time is the reference. Two entmtp engines, one per kind of shipped heads:
the Medusa heads draft chains (8 concurrent requests), and the default heads (Hydra when shipped) draft trees
chosen per request and step by the confidence scheduler from the `default` tree set's trees (three branching
trees, and its longest chain cut by a ``chain_stop``; batch sizes 1, 4 and 16). In
the concurrent phases a third of the requests draft nothing and a third at most 1 token (the per-request cap),
so requests with different trees and with none share every step. Each engine runs in its own process.

The tree engine also runs with prefix caching, chunked prefill and a KV cache small enough to force preemption
(``TREE_ENGINE``), samples (temperature 0.8, top-p, top-k, per-request seeds) twice with the same seeds, and has
a third of a batch aborted mid-generation.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_entmtp.datasets import load_prompts
from vllm_entmtp.patches.runner import REQUEST_DRAFT_TOKENS_KEY, REQUEST_TREE_KEY

pytestmark = pytest.mark.engine

MAX_TOKENS = 48
STOP = ["\n\n"]  # a stop string that shows up inside most outputs
CHAIN_STOP = 0.2  # the schedule's chain cut below this path confidence (the calibrated sets' value)
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "prompts": list(range(10))}  # request i has seed i
ABORT = {"name": "abort", "concurrency": 16, "abort_every": 3, "abort_after_steps": 3, "prompts": list(range(15))}
# The tree engine runs the way a loaded server does: prefix caching, prefill chunks of at most 256 tokens mixed
# with decode steps (prompts run up to ~400 tokens), and a KV cache of 24 blocks of 128 tokens, too small for 16
# requests at once, so vLLM preempts requests (and recomputes them later).
MAX_BATCHED = 256
TREE_ENGINE = {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": MAX_BATCHED,
               "num_gpu_blocks_override": 24}


def _prompts():
    picked = []
    for name in ("humaneval", "gsm8k", "sharegpt"):
        ps = [p for p in load_prompts(name, limit=80) if len(p.messages[-1]["content"]) < 1500][:10]
        assert len(ps) == 10
        picked += ps
    return picked


def _run(tmp_path, name, model, spec, phases, conversations, engine_args=None):
    job = {"model": model, "speculative_config": spec, "dtype": "float32", "max_model_len": 1024,
           "max_num_seqs": 16, "conversations": conversations, "max_tokens": MAX_TOKENS, "phases": phases,
           "engine_args": engine_args}
    job_file, out_file = tmp_path / f"{name}.job.json", tmp_path / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    p = subprocess.run([sys.executable, "-m", "vllm_entmtp.harness", str(job_file), str(out_file)],
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out_file.read_text()) | {"log": p.stdout + p.stderr}  # vLLM logs to stdout by default


PREFIX_PROMPTS = list(range(0, 30, 3))  # 10 prompts, from each of the three sets


def _prefix_heads(hydra_dir: str, model_dir: str, out) -> str:
    """Hydra++ prefix-mlp heads for the default model: the shipped Hydra heads' weights and a prefix layer
    shaped like the target's layers, with small random residual branches (so that it changes what the heads
    read). Trained prefix heads are not shipped; these test the serving path, not draft quality."""
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig, load_hydra_heads
    from vllm_entmtp.heads.prefix import PrefixLayerConfig
    from vllm_entmtp.training.train import init_heads_from

    base = load_hydra_heads(hydra_dir)
    target = json.loads((Path(model_dir) / "config.json").read_text())
    heads = HydraHeads(HydraHeadsConfig(**(base.config.model_dump() | {
        "hydra_head_arch": "prefix-mlp", "prefix_layer": PrefixLayerConfig.from_target_config(target).model_dump()})))
    init_heads_from(heads, base)  # what train-heads --init-heads does
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in heads.prefix_embeding_layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.002)
    heads.save(out)
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, default_model, default_heads, shipped_heads):
    tmp = tmp_path_factory.mktemp("lossless")
    prompts = _prompts()
    convs = [p.messages for p in prompts]
    caps = [{REQUEST_DRAFT_TOKENS_KEY: [0, 1, 99][i % 3]} for i in range(len(convs))]
    # c4: a third draft nothing, a third are held to one tree of the set that the schedule never picks
    # (per-request override), a third follow the schedule
    from vllm_entmtp.trees import load_tree_set

    # the shipped default set's trees under a schedule of branching trees (the calibrated schedule may pick only
    # chains, which vLLM verifies itself): the tree engine must verify several trees, and switch between them
    shipped = load_tree_set("default")
    raw = json.loads(shipped.source.read_text())
    branching = [next(t for t in shipped.ids if shipped.get(t).num_nodes == n > shipped.get(t).depth)
                 for n in (6, 4, 2)]  # the first branching tree of 6, 4 and 2 nodes
    # and the set's longest chain, cut by a chain_stop where the heads' path confidence drops
    cut_chain = max((t for t in shipped.ids if shipped.get(t).num_nodes == shipped.get(t).depth >= 3),
                    key=lambda t: shipped.get(t).num_nodes)
    raw["schedule"] = {"signal": "confidence", "thresholds": [0.8, 0.6, 0.3], "chain_stop": CHAIN_STOP,
                       "tree_ids": [branching[0], cut_chain, *branching[1:]]}
    (tmp / "trees.json").write_text(json.dumps(raw))
    tree_set = str(tmp / "trees.json")
    ts = load_tree_set(tree_set)
    forced = max((t for t in ts.ids if t not in ts.schedule.tree_ids), key=lambda t: ts.get(t).num_nodes)
    mixed = [[{REQUEST_DRAFT_TOKENS_KEY: 0}, {REQUEST_TREE_KEY: forced}, {}][i % 3] for i in range(len(convs))]
    plain = _run(tmp, "plain", default_model, None,
                 [{"name": "bs1", "concurrency": 1}, {"name": "stop", "concurrency": 16, "stop": STOP}, ABORT], convs)
    chain = _run(tmp, "chain", default_model, {"method": "entmtp", "model": shipped_heads["medusa"],
                                               "num_speculative_tokens": 4},
                 [{"name": "c8", "concurrency": 8, "extra_args": caps}], convs)
    policy = ts.schedule.signal
    # max_verify_tokens_per_step 64: the default cap (32) would step most of these trees down at 16 requests
    # (they do not pay there on this CPU); this engine is here to verify the trees of a batch
    tree = _run(tmp, "tree", default_model, {"method": "entmtp", "tree_set": tree_set, "policy": policy,
                                             "max_verify_tokens_per_step": 64},
                [{"name": "bs1", "concurrency": 1}, {"name": "c4", "concurrency": 4, "extra_args": mixed},
                 {"name": "c16", "concurrency": 16, "extra_args": caps},
                 {"name": "stop", "concurrency": 16, "stop": STOP},
                 {"name": "sampled_a", "concurrency": 16, **SAMPLED}, {"name": "sampled_b", "concurrency": 16, **SAMPLED},
                 ABORT, {"name": "again_a", "concurrency": 1, "prompts": [0]},
                 {"name": "again_b", "concurrency": 1, "prompts": [0]}], convs, engine_args=TREE_ENGINE)
    tree["forced"], tree["chain"] = forced, (cut_chain, ts.get(cut_chain).num_nodes)
    prefix = _run(tmp, "prefix", default_model,
                  {"method": "entmtp", "model": _prefix_heads(shipped_heads["hydra"], default_model, tmp / "prefix"),
                   "tree_set": tree_set, "policy": policy},
                  [{"name": "c4", "concurrency": 4, "prompts": PREFIX_PROMPTS}], convs,
                  engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": MAX_BATCHED})
    return prompts, plain, {"chain": chain, "tree": tree, "prefix": prefix}


CASES = [("chain", "c8"), ("tree", "bs1"), ("tree", "c4"), ("tree", "c16")]


@pytest.mark.parametrize("method, phase", CASES)
def test_greedy_output_equals_plain_decoding(runs, method, phase):
    prompts, plain, spec = runs
    got, ref = spec[method][phase], plain["bs1"]
    diffs = [p.id for p, a, b in zip(prompts, ref["token_ids"], got["token_ids"]) if a != b]
    assert diffs == [], f"{len(diffs)} of {len(prompts)} outputs differ from plain decoding: {diffs}"
    assert got["finish_reasons"] == ref["finish_reasons"]
    assert sum(map(len, got["token_ids"])) > 20 * MAX_TOKENS  # real generations, not empty ones


@pytest.mark.parametrize("method, phase", CASES)
def test_draft_tokens_are_accepted(runs, method, phase):
    spec = runs[2][method][phase]["spec"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"], spec


def test_per_request_cap_limits_draft_tokens(runs):
    """With a third of the requests capped at 0 and a third at 1, fewer draft tokens go out per drafting step."""
    spec = runs[2]["tree"]
    per_step = {ph: spec[ph]["spec"]["num_draft_tokens"] / spec[ph]["spec"]["num_drafts"] for ph in ("bs1", "c16")}
    assert per_step["c16"] < per_step["bs1"], per_step


def test_trees_are_verified_through_non_first_branches(runs):
    """Tree verification really ran: accepted paths left the top-1 chain and their K/V was moved."""
    stats = runs[2]["tree"]["c16"]["tree_stats"]  # cumulative over the tree engine's phases
    assert stats["tree_steps"] > 0 and stats["non_first_branch_paths"] > 0 and stats["kv_slots_moved"] > 0
    assert len(stats["per_tree"]) > 1  # several trees (and capped prefixes of them) in the same batches
    assert stats["scheduler"]["switches"] > 0  # the scheduler moved requests between trees
    assert stats["tracked_requests"] <= 16  # per-request state is freed with the requests
    assert runs[2]["chain"]["c8"]["tree_stats"]["tree_steps"] == 0  # chains go through vLLM's own sampler


def test_scheduled_chains_are_cut_by_the_chain_stop(runs):
    """In the one-request phase (no budget cuts) the schedule's chain was drafted whole and cut short by the
    schedule's chain_stop ("id@n"), and the outputs stayed exact (test above, c4 and c16 mixing cut chains,
    which vLLM verifies, with trees, which the plugin does)."""
    chain, nodes = runs[2]["tree"]["chain"]
    chosen = runs[2]["tree"]["bs1"]["tree_stats"]["chosen"]
    cut = {t: n for t, n in chosen.items() if t.split("@")[0] == chain and t != chain}
    assert cut and chosen.get(chain, 0) > 0, chosen
    assert all(1 <= int(t.split("@")[1]) < nodes for t in cut), cut


def test_a_request_can_be_held_to_one_tree(runs):
    """Requests of the c4 phase asking for a tree of the set that its schedule never picks (extra_args) drafted
    it (as itself, or cut to the node budget), and their output stayed exact (test above)."""
    tree = runs[2]["tree"]
    forced = tree["forced"]
    chosen = tree["c4"]["tree_stats"]["chosen"]
    assert not any(t.split("@")[0] == forced for t in tree["bs1"]["tree_stats"]["chosen"])
    assert sum(n for t, n in chosen.items() if t.split("@")[0] == forced) >= 10, (forced, chosen)


def test_start_up_lines_reach_vllms_log(runs):
    """The drafter's start-up lines go through vLLM's configured "vllm" logger (format and level), as in the log
    of `vllm serve`; a logger outside it would drop INFO lines."""
    log = runs[2]["tree"]["log"]
    assert re.search(r"INFO .*entmtp: \d+ \w+Heads MTP heads from .*; drafting trees scheduled by policy", log), \
        log[-4000:]
    assert re.search(r"INFO .*entmtp: load: max_verify_tokens_per_step only", log), log[-4000:]


def test_per_tree_counters_reach_prometheus(runs):
    """The drafter's counters (engine-core process) are exported through the front end's Prometheus registry."""
    phase = runs[2]["tree"]["c16"]
    stats, metrics = phase["tree_stats"], phase["entmtp_metrics"]
    for tree, v in stats["per_tree"].items():
        assert metrics[f"tree_verified{{{tree}}}"] == v["steps"]
        assert metrics[f"tree_nodes_verified{{{tree}}}"] == v["nodes"]
        assert metrics[f"tree_tokens_accepted{{{tree}}}"] == v["accepted"]
    assert {k: v for k, v in metrics.items() if k.startswith("tree_chosen{")} == \
        {f"tree_chosen{{{t}}}": n for t, n in stats["chosen"].items()}
    assert metrics["kv_slots_moved"] == stats["kv_slots_moved"] > 0


def test_stop_string_inside_an_accepted_path_ends_the_output_there(runs):
    prompts, plain, spec = runs
    ref, got = plain["stop"], spec["tree"]["stop"]
    assert got["texts"] == ref["texts"] and got["token_ids"] == ref["token_ids"]
    assert got["finish_reasons"] == ref["finish_reasons"]
    assert ref["finish_reasons"].count("stop") >= 10  # the stop string did cut most outputs
    assert all(not t.endswith("\n\n") and "\n\n" not in t for t in got["texts"])


def test_engine_ran_with_chunked_prefill_and_preemption(runs):
    """The tree engine's outputs above are exact while vLLM split long prompts into chunks next to decode steps
    and preempted requests for lack of KV blocks (and recomputed them)."""
    prompts, plain, spec = runs
    tree = spec["tree"]
    assert tree["stop"]["engine"]["num_preemptions"] > 0, tree["stop"]["engine"]  # cumulative, greedy phases
    assert max(tree["bs1"]["prompt_tokens"]) > MAX_BATCHED  # such a prompt cannot be prefilled in one step


def test_a_prompt_served_from_the_prefix_cache_gives_the_same_output(runs):
    """The same prompt twice in a row: the second time its first KV block comes from the prefix cache, and the
    output is still plain decoding's."""
    prompts, plain, spec = runs
    a, b = spec["tree"]["again_a"], spec["tree"]["again_b"]
    assert b["engine"]["prefix_cache_hits"] - a["engine"]["prefix_cache_hits"] >= 128  # a whole block
    assert a["token_ids"][0] == b["token_ids"][0] == plain["bs1"]["token_ids"][0]


def test_sampling_with_seeds_is_reproducible_with_drafts_accepted(runs):
    """Temperature 0.8 with top-p and top-k: the tree rejection sampler draws from each request's seeded
    generator, so the same seeds give the same text; the samples differ from greedy decoding, and draft tokens
    are accepted. (That the sampled distribution is the target's is tests/test_rejection_sampling.py.)"""
    prompts, plain, spec = runs
    tree = spec["tree"]
    a, b = tree["sampled_a"], tree["sampled_b"]
    assert a["token_ids"] == b["token_ids"]
    assert sum(x != y for x, y in zip(a["token_ids"], plain["bs1"]["token_ids"])) >= len(a["token_ids"]) // 2
    assert all(len(t) > 0 for t in a["token_ids"])
    for ph in (a, b):
        assert ph["spec"]["num_drafts"] > 0 and ph["spec"]["num_accepted_tokens"] > 0, ph["spec"]


def test_aborted_requests_leave_the_others_exact_and_free_their_state(runs):
    """A third of a batch is aborted after three engine steps (as clients that go away): the others finish
    exactly as in plain decoding (which had the same aborts), and the drafter keeps no state of any of them."""
    prompts, plain, spec = runs
    ref, got = plain["abort"], spec["tree"]["abort"]
    n = len(ABORT["prompts"])
    aborted = [i for i in range(n) if i % ABORT["abort_every"] == 0]
    assert [i for i, f in enumerate(got["finish_reasons"]) if f == "abort"] == aborted
    assert all(len(got["token_ids"][i]) < MAX_TOKENS for i in aborted)
    kept = [i for i in range(n) if i not in aborted]
    diffs = [prompts[ABORT["prompts"][i]].id for i in kept if got["token_ids"][i] != ref["token_ids"][i]]
    assert diffs == [], f"{len(diffs)} of {len(kept)} outputs differ from plain decoding: {diffs}"
    assert [got["finish_reasons"][i] for i in kept] == [ref["finish_reasons"][i] for i in kept]
    # after one more request, the drafter holds state for that one at most
    assert spec["tree"]["again_a"]["tree_stats"]["requests_with_state"] <= 1


def test_hydra_prefix_mlp_heads_are_lossless(runs):
    """Hydra++ heads with a prefix layer (its K/V cache per request in the drafter, fed with prompt chunks and
    accepted paths): output equal to plain decoding, draft tokens accepted, no state left behind."""
    prompts, plain, spec = runs
    got = spec["prefix"]["c4"]
    ref = [plain["bs1"]["token_ids"][i] for i in PREFIX_PROMPTS]
    diffs = [prompts[i].id for i, a, b in zip(PREFIX_PROMPTS, ref, got["token_ids"]) if a != b]
    assert diffs == [], f"{len(diffs)} of {len(ref)} outputs differ from plain decoding: {diffs}"
    assert got["spec"]["num_accepted_tokens"] > 0, got["spec"]
    assert got["tree_stats"]["requests_with_state"] <= 4
