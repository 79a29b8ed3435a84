"""`vllm serve` with entmtp, as a client meets it: bad requests get HTTP 400 naming what is wrong, and the server
serves the next good request; options vLLM refuses or crashed on under speculation are served; a minute of
``benchmarks/soak.py`` (64 streaming clients, mixed options, a third disconnecting, preemption) ends with no
error, greedy answers equal to the server's own no-drafting answers, and no per-request state left behind.

The bad requests here are the request rows of docs/bad-inputs.md (start-up errors are in tests/test_config.py
and tests/test_trees.py).
"""
import json
import socket
import sys

import openai
import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.engine

GOOD = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8, "temperature": 0}

# (what is wrong, the request's fields over GOOD, a phrase the error message must contain)
BAD_REQUESTS = [
    ("draft-token cap below 0", {"vllm_xargs": {"entmtp_num_draft_tokens": -1}},
     "entmtp_num_draft_tokens=-1: allowed: an integer >= 0"),
    ("draft-token cap not an integer", {"vllm_xargs": {"entmtp_num_draft_tokens": "two"}},
     "entmtp_num_draft_tokens='two': allowed: an integer >= 0"),
    ("tree id not in the served set", {"vllm_xargs": {"entmtp_tree_id": "b9n99"}},
     "entmtp_tree_id='b9n99' is not a tree of the served tree set; allowed: 'none' or one of b0n1"),
    ("unknown entmtp option", {"vllm_xargs": {"entmtp_tree": "b0n1"}},
     "unknown entmtp request option 'entmtp_tree'; allowed: entmtp_num_draft_tokens, entmtp_tree_id"),
    ("max_tokens below 1", {"max_tokens": -3}, "max_tokens"),
    ("temperature below 0", {"temperature": -1}, "temperature"),
    ("top_p above 1", {"temperature": 0.7, "top_p": 2}, "top_p"),
    ("top_k below -1", {"temperature": 0.7, "top_k": -5}, "top_k"),
    ("n with greedy sampling", {"n": 3}, "n must be 1 when using greedy sampling"),
    ("logit_bias outside the vocabulary", {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("min_p above 1", {"temperature": 0.7, "min_p": 2}, "min_p"),
    ("unknown model", {"model": "no-such-model"}, "does not exist"),
]


# float32 (greedy equality); a KV cache of 16 blocks of 128 tokens, too small for 16 running requests: the soak
# below forces preemption
SERVER_ARGS = ["--dtype", "float32", "--max-num-seqs", "16", "--max-model-len", "1024",
               "--num-gpu-blocks-override", "16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model):
    load_benchmark("compare")  # puts benchmarks/ on sys.path, where its server module is
    from compare_methods import Method
    from compare_server import Server, serve_command

    port = _free_port()
    serve = serve_command("vllm", default_model, Method("entmtp", {"method": "entmtp"}), port, enforce_eager=True,
                          extra=SERVER_ARGS)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", *serve[1:]]  # the `vllm` command of this Python
    with Server(cmd, tmp_path_factory.mktemp("serve") / "server.log", port, 600, "entmtp") as s:
        yield s


def _chat(server, **fields) -> str:
    """The answer's text; a refused request raises the client's error (``openai.BadRequestError``, ...)."""
    body = {"model": "SmolLM2-135M-Instruct", **GOOD, **fields}
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=body.pop("model"), messages=body.pop("messages"), extra_body=body)
    return r.choices[0].message.content


@pytest.mark.parametrize("what, fields, phrase", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_request_gets_400_naming_the_problem_and_the_server_serves_on(server, what, fields, phrase):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:  # 404: an unknown model, as vLLM has it
        _chat(server, **fields)
    assert phrase in str(e.value), what
    assert _chat(server)


def test_sampling_with_top_k_alone_is_served(server):
    """Any sampled request with top_k and no top_p killed the engine on its first step (HTTP 500, then every
    later request failed)."""
    for _ in range(2):
        assert _chat(server, temperature=0.7, top_k=40, max_tokens=16)
    assert _chat(server)


def test_min_p_and_logit_bias_are_served(server):
    """vLLM answers these with HTTP 400 under its own speculative methods; entmtp serves them (the request
    drafts nothing), and a logit bias of -100 keeps its token out of a greedy answer."""
    assert _chat(server, temperature=0.7, min_p=0.1, max_tokens=16)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.cmd[server.cmd.index("serve") + 1])
    text = _chat(server, max_tokens=16)
    banned = tok.encode(text, add_special_tokens=False)[0]
    biased = _chat(server, logit_bias={str(banned): -100}, max_tokens=16)
    assert banned not in tok.encode(biased, add_special_tokens=False) and biased != text, (text, biased)


def test_metrics_export_the_fallback_counters(server):
    """The family of contained faults is in /metrics (no fault here, so no stage has a sample yet)."""
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "# TYPE vllm:entmtp_fallbacks_total counter" in text, json.dumps(text[-2000:])


def _prefix_cache_hits(server, tp) -> float:
    """The server's prompt tokens found in its prefix cache so far (``vllm:prefix_cache_hits_total``, summed over
    engines), read with the load generator's parser (``tp``: ``benchmarks/throughput.py``)."""
    import urllib.request

    name = "vllm:prefix_cache_hits_total"
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        return sum(tp.parse_metrics(resp.read().decode(), (name,)).get(name, {}).values())


def test_the_benchmarks_prefix_cache_reset_makes_a_repeated_prompt_computed_again(server):
    """``benchmarks/compare.py`` sends every level the same prompts and empties each server's prefix cache before
    a level (``throughput.py --reset-prefix-cache``; its servers run with ``VLLM_SERVER_DEV_MODE=1``): a prompt
    sent again is found cached before the reset and not after it, and the entmtp server serves on."""
    import asyncio

    import aiohttp

    tp = load_benchmark("throughput")
    prompt = {"messages": [{"role": "user", "content": "Tell me about the old harbour of the city. " * 30}],
              "max_tokens": 4}  # about 300 prompt tokens: two full KV blocks of 128 to find cached

    async def reset():
        async with aiohttp.ClientSession() as session:
            await tp.reset_prefix_cache(session, server.base_url)

    asyncio.run(reset())
    first = _chat(server, **prompt)
    before = _prefix_cache_hits(server, tp)
    assert _chat(server, **prompt) == first
    cached = _prefix_cache_hits(server, tp)
    assert cached >= before + 128, (before, cached)
    asyncio.run(reset())
    assert _chat(server, **prompt) == first
    assert _prefix_cache_hits(server, tp) == cached


def test_a_minute_of_soak_with_disconnects_and_preemption(server, tmp_path):
    """CI's short version of benchmarks/soak.py (a full run's report is under benchmarks/results/soak-*)."""
    soak = load_benchmark("soak")
    out = tmp_path / "soak.json"
    rc = soak.main(["--base-url", server.base_url, "--server-pid", str(server.proc.pid), "--duration", "60",
                    "--warmup", "20", "--concurrency", "64", "--max-tokens", "48", "--prompts-per-task", "3",
                    "--reference", "no-draft", "--result-json", str(out)])
    r = json.loads(out.read_text())
    assert r["errors"] == 0, r["error_messages"]
    assert r["idle_after_load"], r  # every disconnected request was aborted
    assert r["completed"] >= 30 and r["disconnected"] >= 10, r
    assert r["greedy_checked"] >= 8 and r["greedy_mismatches"] == 0, r["mismatched"]
    assert r["requests_with_state_after"] <= 1  # the probe's own, at most
    assert r["preemptions"] > 0 and r["fallbacks"] == 0, r
    assert r["spec_decode"]["num_accepted_tokens"] > 0
    assert rc == 0
