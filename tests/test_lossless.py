"""Losslessness: greedy entmtp output equals plain decoding token for token (float32).

In float32 a forward that verifies several tokens gives the same argmax as one-token decode steps (in bf16,
near-ties flip; see docs/architecture.md), so equality here is exact. 30 prompts from three prompt sets;
plain decoding one request at a time is the reference. Two entmtp engines, one per kind of shipped heads:
the Medusa heads draft chains (8 concurrent requests), and the default heads (Hydra when shipped) draft trees
chosen per request and step by the confidence scheduler from the `default` tree set's trees (three branching
trees, and its longest chain cut by a ``chain_stop``; batch sizes 1, 4 and 16). In
the concurrent phases a third of the requests draft nothing and a third at most 1 token (the per-request cap),
so requests with different trees and with none share every step. A fifth engine serves the defaults in bfloat16
(`make serve`'s dtype on CPUs with AVX-512 BF16): it must serve, draft and verify, not equal plain decoding. Each
engine runs in a process of its own, five of them in two lanes on cores of their own where there are two
(:func:`_in_lanes`), then the prefix engine alone.

The tree engine also runs with prefix caching, chunked prefill and a KV cache small enough to force preemption
(``TREE_ENGINE``), samples (temperature 0.8, top-p, top-k, per-request seeds) twice with the same seeds, and has
a third of a batch aborted mid-generation. It serves a matrix of sampling options in one batch (``MATRIX``)
beside requests drafting trees and chains (the prefix engine serves it twice, for seeded repeats), and then a batch in which drafting and the tree walk fail for a third
of the requests each (faults injected in the worker, ``harness.install_faults``).
"""
import functools
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_entmtp.datasets import load_prompts
from vllm_entmtp.request_options import REQUEST_DRAFT_TOKENS_KEY, REQUEST_TREE_KEY

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


def _matrix(n: int) -> list[dict]:
    """``n`` requests' sampling options: every (temperature, top_k, top_p) of the grid, each with one option of
    ``extras`` in turn (``n`` = 24: every extra at least once, the grid cycled twice). Greedy requests with ``n``
    > 1 sample instead (vLLM refuses ``n`` > 1 when greedy)."""
    grid = list(itertools.product((0.0, 0.7), (-1, 1, 40), (1.0, 0.9)))  # temperature, top_k, top_p
    extras = [
        {}, {"min_p": 0.05}, {"n": 3}, {"logprobs": 2}, {"prompt_logprobs": 1},
        {"presence_penalty": 0.6, "frequency_penalty": 0.3}, {"repetition_penalty": 1.2},
        {"stop": ["\n\n", "."]}, {"stop_token_ids": [13, 28]}, {"min_tokens": 20}, {"max_tokens": 1},
        {"ignore_eos": True}, {"bad_words": [" the", " a"]}, {"logit_bias": {"13": -100.0, "28": 5.0}},
        {"structured_outputs": {"json": {"type": "object", "properties": {"answer": {"type": "integer"}},
                                         "required": ["answer"]}}},
        {"structured_outputs": {"regex": "[A-Z][a-z]+( [a-z]+)*\\."}},
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    ]
    out = []
    for j in range(n):
        t, k, p = grid[j % len(grid)]
        e = extras[j % len(extras)]
        out.append({"temperature": 0.7 if e.get("n", 1) > 1 else t, "top_k": k, "top_p": p, **e})
    return out


MATRIX_PROMPTS = list(range(24))
MATRIX = _matrix(len(MATRIX_PROMPTS))
FAULT_PROMPTS = list(range(0, 30, 2))
TREE_ENGINE = {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": MAX_BATCHED,
               "num_gpu_blocks_override": 24}


def _prompts():
    picked = []
    for name in ("humaneval", "gsm8k", "sharegpt"):
        ps = [p for p in load_prompts(name, limit=80) if len(p.messages[-1]["content"]) < 1500][:10]
        assert len(ps) == 10
        picked += ps
    return picked


def _in_lanes(lanes: list[list[functools.partial]]) -> list[list[dict]]:
    """Run each lane's engines (:func:`_run` partials) one after another; on 2 cores (this project's machines) the
    two lanes side by side, each lane's engines bound to a core of its own (``_run``'s ``core``). vLLM binds an
    engine to one core there anyway (it keeps the other for the front end), so every engine computes on one thread
    as it would alone. With other core counts the lanes run one after another, bound as vLLM binds them, so that
    all engines keep one thread count."""
    from concurrent.futures import ThreadPoolExecutor

    cores = sorted(os.sched_getaffinity(0))  # the cores this process may use
    if len(lanes) != 2 or len(cores) != 2:
        return [[engine() for engine in lane] for lane in lanes]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda lane, core: [engine(core=core) for engine in lane], lane, core)
                   for lane, core in zip(lanes, cores)]
        return [f.result() for f in futures]


def _run(tmp_path, name, model, spec, phases, conversations, engine_args=None, env=None, core=None,
         dtype="float32"):
    job = {"model": model, "speculative_config": spec, "dtype": dtype, "max_model_len": 1024,
           "max_num_seqs": 16, "conversations": conversations, "max_tokens": MAX_TOKENS, "phases": phases,
           "engine_args": engine_args}
    job_file, out_file = tmp_path / f"{name}.job.json", tmp_path / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    bind = {} if core is None else {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
    p = subprocess.run([sys.executable, "-m", "vllm_entmtp.harness", str(job_file), str(out_file)],
                       capture_output=True, text=True, timeout=2400, env=os.environ | (env or {}) | bind)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out_file.read_text()) | {"log": p.stdout + p.stderr}  # vLLM logs to stdout by default


PREFIX_PROMPTS = list(range(0, 30, 3))  # 10 prompts, from each of the three sets
NUM_PROMPTS = 30  # _prompts(); the hybrid engine's copying prompts come after them


# Prompts whose answers copy their own text (prompt lookup's case): the default model writes these lines again
# and again. (Asked to repeat a HumanEval prompt's code, it writes the signature, then code of its own.)
COPY_LINES = ['print("hello world")', "x = x + 1", 'print("done")', "a = a + 1"]


def _copy_conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write the line '{line}' eight times."}] for line in COPY_LINES]


COPY_PROMPTS = list(range(NUM_PROMPTS, NUM_PROMPTS + len(COPY_LINES)))
NOVEL_PROMPTS = list(range(20, 30))  # ShareGPT chat
BF16_PROMPTS = [0, 10, 20, *COPY_PROMPTS[:1]]  # code, math, chat, and a copying answer


def _prefix_heads(hydra_dir: str, model_dir: str, out) -> str:
    """Hydra++ prefix-mlp heads for the default model: the shipped Hydra heads' weights and a prefix layer
    shaped like the target's layers, with small random residual branches (so that it changes what the heads
    read). Trained prefix heads are not shipped; these test the serving path, not draft quality."""
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig, load_hydra_heads
    from vllm_entmtp.heads.prefix import PrefixLayerConfig
    from vllm_entmtp.training.adapters import init_heads_from

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
    hybrid_convs = convs + _copy_conversations()
    plain_phases = [{"name": "bs1", "concurrency": 1},
                    {"name": "stop", "concurrency": 16, "stop": STOP, "prompts": list(range(NUM_PROMPTS))}, ABORT,
                    {"name": "matrix", "concurrency": 16, "requests": MATRIX, "prompts": MATRIX_PROMPTS}]
    plain = functools.partial(_run, tmp, "plain", default_model, None, plain_phases, hybrid_convs)
    chain = functools.partial(_run, tmp, "chain", default_model,
                              {"method": "entmtp", "model": shipped_heads["medusa"], "num_speculative_tokens": 4},
                              [{"name": "c8", "concurrency": 8, "extra_args": caps}], convs)
    policy = ts.schedule.signal
    # load_policy "cap" with 64 rows: the measured load rule (the default) and the default cap (32) would step
    # most of these trees down at 16 requests (they do not pay there on this CPU); this engine is here to verify
    # the trees of a batch
    tree_phases = [{"name": "bs1", "concurrency": 1}, {"name": "c4", "concurrency": 4, "extra_args": mixed},
                   {"name": "c16", "concurrency": 16, "extra_args": caps},
                   {"name": "stop", "concurrency": 16, "stop": STOP},
                   {"name": "sampled_a", "concurrency": 16, **SAMPLED},
                   {"name": "sampled_b", "concurrency": 16, **SAMPLED},
                   ABORT, {"name": "matrix", "concurrency": 16, "requests": MATRIX, "prompts": MATRIX_PROMPTS},
                   {"name": "faults", "concurrency": 16, "prompts": FAULT_PROMPTS, "faults": ["draft", "verify"]},
                   {"name": "again_a", "concurrency": 1, "prompts": [0]},
                   {"name": "again_b", "concurrency": 1, "prompts": [0]},
                   {"name": "again_c", "concurrency": 1, "prompts": [0], "reset_prefix_cache": True}]
    tree = functools.partial(_run, tmp, "tree", default_model,
                             {"method": "entmtp", "tree_set": tree_set, "policy": policy, "load_policy": "cap",
                              "max_verify_tokens_per_step": 64, "draft_sources": "heads"},
                             tree_phases, convs, engine_args=TREE_ENGINE)
    prefix_phases = [{"name": "c4", "concurrency": 4, "prompts": PREFIX_PROMPTS},
                     {"name": "matrix_a", "concurrency": 16, "requests": MATRIX, "prompts": MATRIX_PROMPTS},
                     {"name": "matrix_b", "concurrency": 16, "requests": MATRIX, "prompts": MATRIX_PROMPTS}]
    # no prefix cache, and the engine in this process (vLLM's in-process client adds every request before the
    # first step; a separate engine-core process may start stepping while requests still arrive, so batches
    # depended on timing): the matrix's second run gets the same batches as its first
    prefix_engine = functools.partial(
        _run, tmp, "prefix", default_model,
        {"method": "entmtp", "model": _prefix_heads(shipped_heads["hydra"], default_model, tmp / "prefix"),
         "tree_set": tree_set, "policy": policy, "load_policy": "cap", "draft_sources": "heads"},
        prefix_phases, convs,
        engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": MAX_BATCHED,
                     "enable_prefix_caching": False},
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    # prompt lookup and the heads in one schedule (draft_sources "hybrid", the default), the default tree set;
    # the cap, so that drafting does not depend on measured costs. Drafted as where vLLM has no tree attention
    # (any GPU): the schedule chooses among the set's chains, which the calibrated default set schedules anyway
    # in c16 a quarter of the requests hold themselves to the default set's branching tree b2n2 ([[0], [1]]),
    # which, without tree attention, drafts its top-1 chain: the set's b0n1
    held = [{REQUEST_TREE_KEY: "b2n2"} if i % 4 == 0 else {} for i in range(len(hybrid_convs))]
    hybrid_phases = [{"name": "copy", "concurrency": 1, "prompts": COPY_PROMPTS},
                     {"name": "novel", "concurrency": 1, "prompts": NOVEL_PROMPTS},
                     {"name": "c16", "concurrency": 16, "extra_args": held},
                     {"name": "sampled", "concurrency": 16, **SAMPLED}]
    hybrid = functools.partial(_run, tmp, "hybrid", default_model, {"method": "entmtp", "load_policy": "cap"},
                               hybrid_phases, hybrid_convs, env={"VLLM_ENTMTP_TREE_ATTENTION": "0"})
    # the defaults in bfloat16, the dtype `make serve` serves on CPUs with AVX-512 BF16 (not compared with plain
    # decoding: in bfloat16 a verification forward's near-ties flip; docs/architecture.md)
    # (the cap, so that drafting does not depend on step costs, which in bfloat16 on CPUs without native bfloat16
    # GEMMs may say no draft pays)
    bf16 = functools.partial(_run, tmp, "bfloat16", default_model, {"method": "entmtp", "load_policy": "cap"},
                             [{"name": "c4", "concurrency": 4, "prompts": BF16_PROMPTS},
                              {"name": "sampled", "concurrency": 4, **SAMPLED, "prompts": BF16_PROMPTS},
                              {"name": "trees", "concurrency": 4, "prompts": BF16_PROMPTS,
                               "extra_args": [{REQUEST_TREE_KEY: "b2n4"}] * len(BF16_PROMPTS)}],
                             hybrid_convs, dtype="bfloat16")
    # two lanes on this project's 2 cores (engine minutes on a 2-core Xeon, 2026-12-02, side by side: plain 8,
    # hybrid 4.5; chain 2, tree 14), then the prefix engine alone: it runs inside its front-end process, whose
    # other threads (structured-output grammars) then have the other core (bound beside the tree engine it took
    # 3x as long)
    (plain, hybrid, bf16), (chain, tree) = _in_lanes([[plain, hybrid, bf16], [chain, tree]])
    prefix = prefix_engine()
    tree["forced"], tree["chain"] = forced, (cut_chain, ts.get(cut_chain).num_nodes)
    return prompts, plain, {"chain": chain, "tree": tree, "prefix": prefix, "hybrid": hybrid, "bfloat16": bf16}


CASES = [("chain", "c8"), ("tree", "bs1"), ("tree", "c4"), ("tree", "c16"), ("hybrid", "c16")]


@pytest.mark.parametrize("method, phase", CASES)
def test_greedy_output_equals_plain_decoding(runs, method, phase):
    prompts, plain, spec = runs
    got, ref = spec[method][phase], plain["bs1"]
    n = len(got["token_ids"])  # the hybrid engine's copying prompts come after the 30 of the others
    diffs = [i for i, (a, b) in enumerate(zip(ref["token_ids"][:n], got["token_ids"])) if a != b]
    assert diffs == [], f"{len(diffs)} of {n} outputs differ from plain decoding: {diffs}"
    assert got["finish_reasons"] == ref["finish_reasons"][:n] and n >= len(prompts)
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


def test_draft_rows_attend_through_the_plugins_kernel_where_it_serves(runs):
    """Where the verification kernel serves (AVX-512F or AVX2, vLLM's 'vec' KV layout, a C++ compiler), the engines
    whose output the tests above compare with plain decoding ran it for their draft rows (verify_attention 'auto');
    elsewhere they ran vLLM's kernel and say why."""
    from vllm_entmtp import verify_attention

    log = runs[2]["tree"]["log"]
    if verify_attention._unavailable(torch.float32) is None:
        assert re.search(r"INFO .*entmtp: requests verifying draft tokens attend through the plugin's kernel", log), \
            log[-4000:]
    else:
        assert re.search(r"INFO .*entmtp: verification attention by vLLM's kernel only: ", log), log[-4000:]


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
    # after the cache is emptied (the benchmarks' phases, harness "reset_prefix_cache") the prompt is computed again
    c = spec["tree"]["again_c"]
    assert c["engine"]["prefix_cache_hits"] == b["engine"]["prefix_cache_hits"]
    assert c["token_ids"][0] == plain["bs1"]["token_ids"][0]


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
    # its engine core runs in the test's process: the draft tokens came with each step's output, and the engine
    # core never called the workers for them (vllm_entmtp/patches/engine_core.py)
    assert spec["prefix"]["matrix_b"]["draft_token_calls"] == 0


def _deterministic(opts: dict) -> bool:
    return opts["temperature"] == 0.0 or opts["top_k"] == 1


def test_every_request_of_the_sampling_matrix_completes(runs):
    """All options of the matrix in one batch, beside requests drafting trees and chains: each request returns
    its ``n`` completions, ending on a stop or the length limit. Any sampled request with top_k and no top_p
    used to kill the engine here (vllm_entmtp/patches/sampler.py)."""
    got = runs[2]["tree"]["matrix"]
    for opts, outs in zip(MATRIX, got["outputs"]):
        assert len(outs) == opts.get("n", 1), opts
        for c in outs:
            assert c["finish_reason"] in ("stop", "length"), (opts, c)
            assert 1 <= len(c["token_ids"]) <= opts.get("max_tokens", MAX_TOKENS), (opts, c)
            assert opts.get("min_tokens", 0) <= len(c["token_ids"]) or c["finish_reason"] == "stop", (opts, c)
    assert got["spec"]["num_drafts"] > 0 and got["spec"]["num_accepted_tokens"] > 0  # the batch kept drafting
    assert got["tree_stats"]["tree_steps"] > runs[2]["tree"]["abort"]["tree_stats"]["tree_steps"]  # trees too


def test_deterministic_requests_of_the_matrix_equal_plain_decoding(runs):
    """Greedy requests, and sampled ones with top_k 1, give plain decoding's tokens, text, finish reason,
    token count and logprobs, with each option (penalties, stops inside accepted paths, structured output,
    min_p and logit_bias served without drafting, ...)."""
    prompts, plain, spec = runs
    ref, got = plain["matrix"], spec["tree"]["matrix"]
    checked = 0
    for i, opts in enumerate(MATRIX):
        if not _deterministic(opts):
            continue
        for r, g in zip(ref["outputs"][i], got["outputs"][i]):
            assert (g["token_ids"], g["text"], g["finish_reason"]) == (r["token_ids"], r["text"], r["finish_reason"]), \
                (i, opts)
            if r["logprobs"] is not None:
                assert g["logprobs"] == pytest.approx(r["logprobs"], abs=1e-3), (i, opts)
            checked += 1
        assert got["prompt_logprobs"][i] == ref["prompt_logprobs"][i], (i, opts)
    assert checked >= 14


def test_seeded_requests_of_the_matrix_repeat(runs):
    """The matrix twice in an engine whose batches run the same way both times (the prefix engine: no prefix
    cache, a KV cache that holds the batch): seeded requests give the same samples. (In the tree engine a second
    run's batches differ, its tiny KV cache evicting and preempting otherwise, and so do its load cap's trees and
    with them the random draws of tree rejection sampling: seeded samples repeat where the batches do,
    docs/options.md.) The prefix engine also has tree requests beside chains and no-draft ones."""
    a, b = runs[2]["prefix"]["matrix_a"], runs[2]["prefix"]["matrix_b"]
    assert a["spec"]["num_accepted_tokens"] > 0 and a["tree_stats"]["tree_steps"] > 0
    assert a["outputs"] == b["outputs"]
    sampled = [i for i, o in enumerate(MATRIX) if not _deterministic(o)]
    assert len(sampled) >= 6
    n3 = [a["outputs"][i] for i in sampled if MATRIX[i].get("n", 1) == 3]
    assert n3 and all(len({str(c["token_ids"]) for c in outs}) > 1 for outs in n3)  # n samples, not one


def test_min_p_and_logit_bias_are_served_as_without_speculation(runs):
    """vLLM refuses min_p and logit_bias under speculative decoding; entmtp serves them, drafting nothing for
    those requests: greedy or seeded, their answer is a plain engine's."""
    plain, got = runs[1]["matrix"], runs[2]["tree"]["matrix"]
    idx = [i for i, o in enumerate(MATRIX) if "min_p" in o or "logit_bias" in o]
    assert len(idx) >= 3 and any(not _deterministic(MATRIX[i]) for i in idx)
    for i in idx:
        assert got["outputs"][i] == plain["outputs"][i], (i, MATRIX[i])


def test_faults_in_drafting_and_the_tree_walk_leave_the_engine_and_the_output_exact(runs):
    """Drafting fails for a third of the requests and the tree walk for another third (injected): those go on
    without speculation for the step, counted in /metrics; the others keep drafting trees; every output is
    plain decoding's; the engine serves the next phases (again_a, again_b) exactly."""
    prompts, plain, spec = runs
    got = spec["tree"]["faults"]
    ref = [plain["bs1"]["token_ids"][i] for i in FAULT_PROMPTS]
    diffs = [prompts[i].id for i, a, b in zip(FAULT_PROMPTS, ref, got["token_ids"]) if a != b]
    assert diffs == [], f"{len(diffs)} of {len(ref)} outputs differ from plain decoding: {diffs}"
    before = spec["tree"]["matrix"]["entmtp_metrics"]
    for stage in ("draft", "verify"):
        assert got["entmtp_metrics"].get(f"fallbacks{{{stage}}}", 0) > before.get(f"fallbacks{{{stage}}}", 0), stage
    assert got["spec"]["num_accepted_tokens"] > 0
    assert got["tree_stats"]["tree_steps"] > spec["tree"]["matrix"]["tree_stats"]["tree_steps"]  # trees walked


def _by_source(phase: dict, before: dict | None = None) -> dict[str, dict[str, int]]:
    """A phase's verified drafts by source (the counters are cumulative over an engine's phases)."""
    now = phase["tree_stats"]["by_source"]
    then = before["tree_stats"]["by_source"] if before is not None else {}
    return {src: {k: v - then.get(src, {}).get(k, 0) for k, v in c.items()} for src, c in now.items()}


def test_hybrid_drafts_are_exact_one_at_a_time(runs):
    """Hybrid drafts (prompt lookup and the heads) give plain decoding's output on the copying and the chat
    prompts, one request at a time; 16 at a time is in test_greedy_output_equals_plain_decoding."""
    prompts, plain, spec = runs
    hybrid = spec["hybrid"]
    for phase, idx in (("copy", COPY_PROMPTS), ("novel", NOVEL_PROMPTS)):
        ref = [plain["bs1"]["token_ids"][i] for i in idx]
        assert hybrid[phase]["token_ids"] == ref, phase
    assert sum(map(len, hybrid["copy"]["token_ids"])) >= 3 * MAX_TOKENS


def test_copying_prompts_draft_from_lookup_and_chat_from_the_heads(runs):
    """A prompt whose answer copies its own text drafts (mostly) from prompt lookup, with long accepted runs; a
    novel chat answer drafts mostly from the heads."""
    hybrid = runs[2]["hybrid"]
    copy, novel = _by_source(hybrid["copy"]), _by_source(hybrid["novel"], hybrid["copy"])
    look = copy.get("lookup", {"drafts": 0, "accepted": 0})
    assert look["drafts"] > copy.get("heads", {}).get("drafts", 0), copy
    assert look["accepted"] / look["drafts"] >= 2.0, copy  # mean accepted draft tokens per lookup draft
    assert novel.get("heads", {}).get("drafts", 0) > novel.get("lookup", {}).get("drafts", 0), novel


def test_both_sources_draft_in_the_same_steps(runs):
    """16 requests of code, math and chat at once: the source is chosen per request, so steps carry lookup and
    heads drafts together; every source's draft tokens are accepted; the counters reach Prometheus."""
    phase = runs[2]["hybrid"]["c16"]
    c16 = _by_source(phase, runs[2]["hybrid"]["novel"])
    steps = phase["tree_stats"]["step_sources"]
    assert steps.get("heads+lookup", 0) > 0, steps
    assert all(c16[s]["accepted"] > 0 for s in ("heads", "lookup")), c16
    metrics = phase["entmtp_metrics"]
    for src, v in phase["tree_stats"]["by_source"].items():
        assert metrics[f"source_drafts{{{src}}}"] == v["drafts"]
        assert metrics[f"source_accepted_tokens{{{src}}}"] == v["accepted"]


def test_sampled_requests_draft_from_both_sources(runs):
    """Sampling (temperature 0.8, top-p, top-k, seeds) with hybrid drafts: every request completes, lookup
    drafts are verified by the rejection sampler (one-hot drafts: lossless, tests/test_rejection_sampling.py)
    and some of their tokens are accepted."""
    phase = runs[2]["hybrid"]["sampled"]
    got = _by_source(phase, runs[2]["hybrid"]["c16"])
    assert all(len(t) > 0 for t in phase["token_ids"])
    assert got.get("lookup", {}).get("accepted", 0) > 0, got


def test_without_tree_attention_the_schedule_chooses_chains_per_request(runs):
    """Where tree attention is missing (forced here: ``VLLM_ENTMTP_TREE_ATTENTION=0``, what any GPU gets), the
    schedule still chooses per request and step among the set's chains, with its signals and metrics: requests of
    one batch draft chains of different lengths (and their outputs are exact: the hybrid engine's cases above)."""
    hybrid = runs[2]["hybrid"]
    log = hybrid["log"]
    assert re.search(r"WARNING .*entmtp: no tree attention here .*off by \$VLLM_ENTMTP_TREE_ATTENTION.*the schedule "
                     r"chooses among the chains of tree set", log), log[-4000:]
    assert re.search(r"INFO .*entmtp: .*; drafting chains scheduled by policy 'confidence'", log), log[-4000:]
    stats = hybrid["c16"]["tree_stats"]  # cumulative over copy, novel and c16: greedy, so vLLM verified them all
    assert stats["tree_steps"] == 0  # with tree attention the requests held to b2n2 would walk trees
    assert not any(t.split("@")[0] == "b2n2" for t in stats["chosen"]), stats["chosen"]  # drafted as b0n1
    heads_chains = {t.split("@")[0] for t, n in stats["chosen"].items() if n and t not in ("none", "lookup")}
    assert {"b0n1", "b0n2"} <= heads_chains, stats["chosen"]  # both chains of the default schedule
    before = hybrid["novel"]["tree_stats"]["mixed_length_steps"]
    assert stats["mixed_length_steps"] - before > 0, stats  # in the 16-request batches, lengths differ per request
    assert hybrid["c16"]["entmtp_metrics"]["mixed_length_steps"] == stats["mixed_length_steps"]


def test_the_defaults_serve_in_bfloat16(runs):
    """`make serve` serves the model's bfloat16 where the CPU has AVX-512 BF16. vLLM's CPU argmax takes float32
    logits only: the greedy verification path once crashed the engine at start-up in bfloat16 (the tests ran
    float32 only). With the defaults but the cap load rule, greedy and seeded sampled requests complete, with
    draft tokens accepted and no fault contained; requests held to a branching tree have it verified (and accepted
    through it) where vLLM's CPU attention takes trees in bfloat16 (no AMX), and draft its top-1 chain elsewhere,
    as the start-up line says."""
    run = runs[2]["bfloat16"]
    for phase in ("c4", "sampled", "trees"):
        got = run[phase]
        assert len(got["token_ids"]) == len(BF16_PROMPTS) and all(len(t) > 0 for t in got["token_ids"]), phase
        assert set(got["finish_reasons"]) <= {"stop", "length"}, got["finish_reasons"]
    spec = run["c4"]["spec"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"], spec
    assert run["trees"]["tree_stats"]["fallbacks"] == {}  # cumulative over the phases
    after, before = run["trees"]["tree_stats"], run["sampled"]["tree_stats"]
    trees = after["tree_steps"] - before["tree_steps"]
    if "drafting trees scheduled" in run["log"]:
        assert trees > 0 and after["tokens_accepted"] > before["tokens_accepted"], after
    else:
        assert "drafting chains scheduled" in run["log"] and trees == 0
