"""entmtp under tensor parallelism on this CPU: three ranks (the default model's 9 attention heads split 3 ways;
``VLLM_CPU_OMP_THREADS_BIND`` puts them on 2 cores), vLLM's multiprocessing executor. The target's embedding and
lm_head are split by vocabulary; the Hydra heads get whole copies (vllm_entmtp/tensor_parallel.py), every rank
drafts the same, trees verify on every rank, and greedy output equals plain decoding's at the same parallelism
token for token."""
import pytest

from test_lossless import _prompts, _run
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
