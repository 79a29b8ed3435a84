"""Losslessness: greedy entmtp output equals plain decoding token for token (float32).

In float32 a forward that verifies several tokens gives the same argmax as one-token decode steps (in bf16,
near-ties flip; see docs/architecture.md), so equality here is exact. 20 prompts from three prompt sets, at
batch size 1 and with 8 concurrent requests (some of which carry 0 or 1 draft tokens per step through the
per-request cap), against plain decoding at batch size 1. Each engine runs in its own process.
"""
import json
import subprocess
import sys

import pytest

from vllm_entmtp.datasets import load_prompts
from vllm_entmtp.patches.runner import REQUEST_DRAFT_TOKENS_KEY

pytestmark = pytest.mark.engine

MAX_TOKENS = 64


def _prompts():
    picked = []
    for name, n in (("humaneval", 7), ("gsm8k", 7), ("sharegpt", 6)):
        ps = [p for p in load_prompts(name, limit=60) if len(p.messages[-1]["content"]) < 1500][:n]
        assert len(ps) == n
        picked += ps
    return picked


def _run(tmp_path, name, model, spec, phases, conversations):
    job = {"model": model, "speculative_config": spec, "dtype": "float32", "max_model_len": 1024,
           "max_num_seqs": 8, "conversations": conversations, "max_tokens": MAX_TOKENS, "phases": phases}
    job_file, out_file = tmp_path / f"{name}.job.json", tmp_path / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    p = subprocess.run([sys.executable, "-m", "vllm_entmtp.harness", str(job_file), str(out_file)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out_file.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, default_model, default_heads):
    tmp = tmp_path_factory.mktemp("lossless")
    prompts = _prompts()
    convs = [p.messages for p in prompts]
    # Every third request may carry no draft tokens, every third+1 at most one: mixed budgets in one batch.
    caps = [{REQUEST_DRAFT_TOKENS_KEY: [0, 1, 99][i % 3]} for i in range(len(convs))]
    plain = _run(tmp, "plain", default_model, None, [{"name": "bs1", "concurrency": 1}], convs)
    spec = _run(tmp, "entmtp", default_model, {"method": "entmtp"},
                [{"name": "bs1", "concurrency": 1},
                 {"name": "c8", "concurrency": 8, "extra_args": caps}], convs)
    return prompts, plain["bs1"], spec


@pytest.mark.parametrize("phase", ["bs1", "c8"])
def test_greedy_output_equals_plain_decoding(runs, phase):
    prompts, plain, spec = runs
    got = spec[phase]
    diffs = [p.id for p, a, b in zip(prompts, plain["token_ids"], got["token_ids"]) if a != b]
    assert diffs == [], f"{len(diffs)} of {len(prompts)} outputs differ from plain decoding: {diffs}"
    assert got["finish_reasons"] == plain["finish_reasons"]
    assert sum(map(len, got["token_ids"])) > 15 * MAX_TOKENS  # real generations, not empty ones


@pytest.mark.parametrize("phase", ["bs1", "c8"])
def test_draft_tokens_are_accepted(runs, phase):
    spec = runs[2][phase]["spec"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0, spec
    assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


def test_per_request_cap_limits_draft_tokens(runs):
    """With a third of the requests capped at 0 and a third at 1, fewer draft tokens go out per step."""
    spec = runs[2]
    per_step = {ph: spec[ph]["spec"]["num_draft_tokens"] / spec[ph]["spec"]["num_drafts"] for ph in spec}
    assert per_step["c8"] < per_step["bs1"], per_step
