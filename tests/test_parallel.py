"""entmtp under tensor parallelism on this CPU: three ranks (the default model's 9 attention heads split 3 ways;
``VLLM_CPU_OMP_THREADS_BIND`` puts them on 2 cores), vLLM's multiprocessing executor. The target's embedding and
lm_head are split by vocabulary; the Hydra heads get whole copies (vllm_entmtp/tensor_parallel.py), every rank
drafts the same, trees verify on every rank, and greedy output equals plain decoding's at the same parallelism
token for token.

Data parallelism: ``vllm serve --data-parallel-size 2`` (two engines, one per core, and an API server per rank):
both engines draft, greedy answers equal the same server's answers without drafting, and the plugin's counters
reach ``/metrics`` (served in Prometheus' multiprocess mode there) summed over the ranks."""
import json
import os
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import load_benchmark

from test_lossless import _prompts, _run
from vllm_entmtp.metrics import PUBLISH_INTERVAL_S
from vllm_entmtp.request_options import REQUEST_TREE_KEY

pytestmark = pytest.mark.engine

TP = {"tensor_parallel_size": 3, "distributed_executor_backend": "mp", "enforce_eager": True}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0", "VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPTS = list(range(0, 30, 3))  # 10 prompts of code, math and chat


@pytest.fixture(scope="module")
def runs(tmp_path_factory, default_model):
    tmp = tmp_path_factory.mktemp("parallel")
    convs = [p.messages for p in _prompts()]
    # a third of the requests held to a branching tree of the default set (verified by the plugin's tree walk),
    # the others scheduled
    held = [{REQUEST_TREE_KEY: "b2n2"} if i % 3 == 0 else {} for i in range(len(PROMPTS))]
    phases = [{"name": "c4", "concurrency": 4, "prompts": PROMPTS, "extra_args": held}]
    plain = _run(tmp, "plain", default_model, None, phases, convs, engine_args=TP, env=ENV)
    ent = _run(tmp, "entmtp", default_model, {"method": "entmtp"}, phases, convs, engine_args=TP, env=ENV)
    return plain, ent


def test_tensor_parallel_greedy_output_equals_plain_decoding(runs):
    plain, ent = runs
    assert ent["c4"]["token_ids"] == plain["c4"]["token_ids"]
    assert sum(map(len, ent["c4"]["token_ids"])) > 5 * 32  # real generations


def test_tensor_parallel_drafts_and_verifies_trees(runs):
    _, ent = runs
    spec, stats = ent["c4"]["spec"], ent["c4"]["tree_stats"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"], spec
    assert stats["tree_steps"] > 0 and stats["per_tree"].get("b2n2", {}).get("accepted", 0) > 0, stats
    log = ent["log"]
    assert "tensor parallel size 3: load_policy 'measured'" in log, log[-3000:]
    assert "not measured under tensor parallelism" in log


# one engine on each of the first two cores this process may use
DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, sorted(os.sched_getaffinity(0))[:2])),
          "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binds two engines to two cores")
def test_data_parallel_serves_entmtp_with_its_metrics(tmp_path, default_model, monkeypatch):
    load_benchmark("compare")  # benchmarks/ on sys.path
    from compare_methods import SERVED_MODEL_NAME, Method
    from compare_server import Server, serve_command
    from test_serve import _free_port
    from throughput import parse_metrics

    port = _free_port()
    serve = serve_command("vllm", default_model, Method("entmtp", {"method": "entmtp"}), port, enforce_eager=True,
                          extra=["--dtype", "float32", "--max-model-len", "1024", "--data-parallel-size", "2"])
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", *serve[1:]]
    convs = [p.messages for p in _prompts()][:20:2]  # 10 prompts of code and math

    def chat(args):
        messages, cap = args
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=SERVED_MODEL_NAME, messages=messages, max_tokens=32, temperature=0,
                                           extra_body={"vllm_xargs": {"entmtp_num_draft_tokens": cap}})
        return r.choices[0].message.content

    for k, v in DP_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # vLLM makes a fresh one
    with Server(cmd, tmp_path / "server.log", port, 900, "entmtp-dp2") as server:
        with ThreadPoolExecutor(8) as pool:  # several at once: the front ends spread them over both engines
            drafted = list(pool.map(chat, [(m, 99) for m in convs]))
            undrafted = list(pool.map(chat, [(m, 0) for m in convs]))
        # the drafters publish their counters at most every PUBLISH_INTERVAL_S: scrape once that has passed
        time.sleep(PUBLISH_INTERVAL_S + 0.5)
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
            metrics = parse_metrics(resp.read().decode())
    assert drafted == undrafted
    assert sum(map(len, drafted)) > 10 * 32  # characters of 10 answers of up to 32 tokens: real generations
    per_engine = {dict(labels)["engine"]: v for labels, v in metrics["vllm:spec_decode_num_drafts_total"].items()}
    assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine  # both engines drafted
    # the plugin's counters, written by both engines' drafters as multiprocess metrics, summed at the scrape
    source = metrics.get("vllm:entmtp_source_drafts_total", {})
    assert sum(source.values()) == sum(per_engine.values()), json.dumps({"entmtp": str(source), "vllm": per_engine})
    assert sum(metrics["vllm:entmtp_tree_chosen_total"].values()) > 0
