"""benchmarks/throughput.py: statistics, /metrics deltas, arguments, and the client against a real aiohttp server."""
from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


tp = load_benchmark("throughput")

LABELS = ["model_name", "engine"]  # vllm/v1/metrics/loggers.py


class SpecCounters:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py), names and labels as the server has them,
    plus an entmtp counter family, in a registry of their own."""

    def __init__(self, num_spec_tokens: int = 3, engines=("0",)):
        self.registry = CollectorRegistry()
        self.engines = engines
        reg = self.registry
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", LABELS, registry=reg)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", LABELS,
                                    registry=reg)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", LABELS,
                                registry=reg)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                               LABELS + ["position"], registry=reg)
        self.tree = Counter("vllm_entmtp_tree_choice", "Steps per chosen tree.", LABELS + ["tree"], registry=reg)
        # a family that is neither spec-decode nor entmtp: must be ignored
        Counter("vllm:prompt_tokens", "Prompt tokens.", LABELS, registry=reg).labels("m", "0").inc(5)
        for e in engines:  # vLLM creates every series at start-up, at 0
            for c in (self.drafts, self.draft_tokens, self.accepted):
                c.labels("m", e)
            for pos in range(num_spec_tokens):
                self.per_pos.labels("m", e, str(pos))

    def step(self, engine="0", drafts=0, draft_tokens=0, accepted_per_pos=(), tree=None):
        self.drafts.labels("m", engine).inc(drafts)
        self.draft_tokens.labels("m", engine).inc(draft_tokens)
        self.accepted.labels("m", engine).inc(sum(accepted_per_pos))
        for pos, n in enumerate(accepted_per_pos):
            self.per_pos.labels("m", engine, str(pos)).inc(n)
        if tree is not None:
            self.tree.labels("m", engine, tree).inc(drafts)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


# ------------------------------------------------------------------------------------------ statistics
def _rec(ttft, latency, tokens, itl=(), prompt=10):
    return tp.RequestRecord(success=True, ttft=ttft, latency=latency, output_tokens=tokens, prompt_tokens=prompt,
                            itl=list(itl))


def test_summarize_known_values():
    records = [
        _rec(0.1, 1.1, 11, itl=[0.1] * 10),  # tpot 0.1
        _rec(0.2, 2.2, 21, itl=[0.05, 0.15]),  # tpot 0.1
        _rec(0.3, 0.7, 5, itl=[0.2, 0.2]),  # tpot 0.1
        _rec(0.4, 0.4, 1),  # one token: no tpot, no itl
        tp.RequestRecord(error="HTTP 500: boom"),
        tp.RequestRecord(error="HTTP 500: boom"),
        tp.RequestRecord(error="stream error: bad"),
    ]
    s = tp.summarize(records, duration_s=2.0)
    assert s["completed"] == 4 and s["failed"] == 3
    assert s["errors"] == ["HTTP 500: boom", "stream error: bad"]  # distinct, in order
    assert s["total_output_tokens"] == 38 and s["total_input_tokens"] == 40
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(19.0)
    assert s["total_token_throughput"] == pytest.approx(39.0)
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p99_ttft_ms"] == pytest.approx(300 + 0.97 * 100)  # rank 0.99 * (4 - 1) = 2.97, interpolated
    assert s["mean_tpot_ms"] == pytest.approx(100.0) and s["p99_tpot_ms"] == pytest.approx(100.0)
    itls = [0.1] * 10 + [0.05, 0.15, 0.2, 0.2]
    assert s["mean_itl_ms"] == pytest.approx(1000 * sum(itls) / len(itls))
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["p99_itl_ms"] == pytest.approx(200.0)
    assert s["median_e2el_ms"] == pytest.approx(900.0)  # latencies 0.4, 0.7, 1.1, 2.2


def test_tpot_definition():
    assert _rec(0.5, 2.5, 5).tpot == pytest.approx(0.5)  # (2.5 - 0.5) / 4
    assert _rec(0.5, 0.5, 1).tpot is None


def test_summarize_without_completions_has_no_figures():
    s = tp.summarize([tp.RequestRecord(error="x")], duration_s=1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["errors"] == ["x"]
    assert s["median_ttft_ms"] is None and s["p99_itl_ms"] is None and s["output_throughput"] == 0


def test_poisson_arrivals_are_seeded_and_increasing():
    a = tp.poisson_arrival_offsets(50, 4.0, seed=1)
    assert a == tp.poisson_arrival_offsets(50, 4.0, seed=1) != tp.poisson_arrival_offsets(50, 4.0, seed=2)
    assert a[0] == 0 and all(x < y for x, y in zip(a, a[1:]))
    assert tp.poisson_arrival_offsets(5, float("inf"), seed=0) == [0.0] * 5


# ------------------------------------------------------------------------------------------ /metrics
def test_spec_decode_delta_from_real_registry():
    c = SpecCounters(num_spec_tokens=3, engines=("0", "1"))
    c.step("0", drafts=7, draft_tokens=21, accepted_per_pos=(5, 3, 1), tree="old")  # before the level
    before = tp.parse_metrics(c.text())
    c.step("0", drafts=10, draft_tokens=30, accepted_per_pos=(8, 4, 2), tree="chain")
    c.step("1", drafts=10, draft_tokens=30, accepted_per_pos=(6, 2, 0), tree="wide")
    after = tp.parse_metrics(c.text())
    assert not any(name.startswith("vllm:prompt") for name in after)

    d = tp.spec_decode_delta(before, after)
    assert d["num_drafts"] == 20 and d["num_draft_tokens"] == 60 and d["num_accepted_tokens"] == 22
    assert d["num_accepted_tokens_per_position"] == [14, 6, 2]
    assert d["acceptance_rate_per_position"] == pytest.approx([0.7, 0.3, 0.1])
    assert d["draft_acceptance_rate"] == pytest.approx(22 / 60)
    assert d["mean_acceptance_length_incl_bonus"] == pytest.approx(1 + 22 / 20)

    tree = tp.tree_choice_delta(before, after)
    assert tree == {"vllm_entmtp_tree_choice_total": {'{tree="chain"}': 10, '{tree="old"}': 0,
                                                      '{tree="wide"}': 10}}


def test_spec_decode_delta_without_drafts_and_without_spec_decode():
    c = SpecCounters()
    snap = tp.parse_metrics(c.text())
    d = tp.spec_decode_delta(snap, snap)
    assert d["num_drafts"] == 0 and d["mean_acceptance_length_incl_bonus"] is None
    assert d["num_accepted_tokens_per_position"] == [0, 0, 0]
    plain = tp.parse_metrics('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1\n')
    assert plain == {} and tp.spec_decode_delta(plain, plain) is None and tp.tree_choice_delta(plain, plain) == {}


def test_metrics_settle_only_for_servers_with_drafters():
    """A speculative server's counters are read once its drafters have published the level's last steps (entmtp
    writes them at most every PUBLISH_INTERVAL_S); a plain server's, or none, at once."""
    from vllm_entmtp.metrics import PUBLISH_INTERVAL_S

    spec = tp.parse_metrics(SpecCounters().text())
    tree = {"vllm:entmtp_tree_chosen_total": {(("tree", "b0n1"),): 3.0}}
    assert tp.settle_s(spec) == tp.settle_s(tree) == PUBLISH_INTERVAL_S + 0.5
    assert tp.settle_s({}) == tp.settle_s(None) == 0.0


# ------------------------------------------------------------------------------------------ arguments, prompts
def test_parse_load_levels():
    assert tp.parse_concurrency("1,4, 16,64") == [1, 4, 16, 64]
    assert tp.parse_request_rates("0.5,2,inf") == [0.5, 2.0, float("inf")]
    for bad in ("", "1,,4", "0", "-1", "1.5", "a"):
        with pytest.raises(tp.BenchmarkError, match="--concurrency"):
            tp.parse_concurrency(bad)
    for bad in ("0", "-1", "x", "nan", "1,"):
        with pytest.raises(tp.BenchmarkError, match="--request-rate"):
            tp.parse_request_rates(bad)


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,x"], "--concurrency takes whole numbers"),
    (["--request-rate", "0"], "--request-rate takes numbers > 0"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--max-seconds", "0"], "--max-seconds must be > 0"),
    (["--base-url", "localhost:8000"], "--base-url must start with http://"),
    (["--dataset", "no-such-set"], "neither a prompt set"),
])
def test_bad_usage_is_one_line(argv, message, capsys):
    assert tp.main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_unreachable_server_is_one_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert tp.main(["--base-url", f"http://127.0.0.1:{port}", "--dataset", str(prompts), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the server") and err.count("\n") == 1


def test_prompts_from_jsonl_and_prompt_set(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"messages": [{"role": "user", "content": "two"}]}\n{"prompt": "three"}\n')
    assert tp.load_benchmark_prompts(str(path), 2) == [[{"role": "user", "content": "one"}],
                                                       [{"role": "user", "content": "two"}]]
    gsm = tp.load_benchmark_prompts("gsm8k", 3)
    assert len(gsm) == 3 and gsm[0][0]["role"] == "user" and "grade school math" in gsm[0][0]["content"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(tp.BenchmarkError, match="no prompts"):
        tp.load_benchmark_prompts(str(empty), 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(tp.BenchmarkError, match=r"bad.jsonl:1: expected an object with a \"prompt\""):
        tp.load_benchmark_prompts(str(bad), 5)


def test_prompts_from_hugging_face_rows():
    rows = [{"question": "q1", "answer": "a"}, {"question": "q2", "answer": "b"}]
    assert tp.hf_rows_to_prompts(rows, None, "hf:x") == [[{"role": "user", "content": "q1"}],
                                                         [{"role": "user", "content": "q2"}]]
    share = [{"id": "1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                           {"from": "human", "value": "more"}]}]
    assert tp.hf_rows_to_prompts(share, None, "hf:x") == [[{"role": "user", "content": "hi"}]]  # first turn
    chat = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}]
    assert tp.hf_rows_to_prompts(chat, "messages", "hf:x") == [chat[0]["messages"]]
    with pytest.raises(tp.BenchmarkError, match=r"hf:x: row 0 has no column prompt / question.*columns: id, "
                                                r"label\); pick one with --hf-column"):
        tp.hf_rows_to_prompts([{"id": 1, "label": 2}], None, "hf:x")
    with pytest.raises(tp.BenchmarkError, match="row 0, column 'label': expected a string or a list of chat"):
        tp.hf_rows_to_prompts([{"id": 1, "label": 2}], "label", "hf:x")


def test_hugging_face_dataset_that_cannot_load_is_one_line(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(tp.BenchmarkError, match=r"hf:org/name: Hugging Face datasets need the `datasets` package"):
        tp.load_benchmark_prompts("hf:org/name", 4)

    def offline(name, split, streaming):
        assert (name, split, streaming) == ("org/name", "test", True)
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(tp.BenchmarkError, match=r"^--dataset hf:org/name:test: cannot load it \(ConnectionError: "
                                                r"Couldn't reach 'org/name' on the Hub \(LocalEntryNotFoundError\)\)$"):
        tp.load_benchmark_prompts("hf:org/name:test", 4)
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda n, split, streaming: rows))
    assert tp.load_benchmark_prompts("hf:org/name", 3) == [[{"role": "user", "content": f"p{i}"}] for i in range(3)]


def test_sse_parser_splits_events_across_chunks():
    p = tp.SSEParser()
    assert p.feed(b'data: {"a": 1}\r\n\r\ndata: {"b"') == ['{"a": 1}']
    assert p.feed(b': 2}\n\n: ping\n\ndata: [DONE]') == ['{"b": 2}']
    assert p.flush() == ["[DONE]"]


# ------------------------------------------------------------------------------------------ end to end
class FakeServer:
    """An OpenAI-compatible streaming server: each request streams ``TOKENS_PER_REQUEST`` tokens in chunks of
    two (so chunk count != token count), then a usage chunk; each request adds a known spec-decode step."""

    CHUNKS = 3
    TOKENS_PER_REQUEST = 2 * CHUNKS
    DRAFTS, DRAFT_TOKENS, ACCEPTED_PER_POS = 2, 6, (2, 1, 0)  # per request: MAL 1 + 3/2 = 2.5

    def __init__(self):
        self.counters = SpecCounters()
        self.in_flight = self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.events: list[str] = []  # "request" per generation request, "reset" per prefix-cache reset
        self.reset_answers: list[bool] = []  # what POST /reset_prefix_cache answers, in turn (then success)
        app = web.Application()
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def reset_prefix_cache(self, request):  # vLLM's development endpoint
        self.events.append("reset")
        return web.json_response({"success": self.reset_answers.pop(0) if self.reset_answers else True})

    async def metrics(self, request):
        return web.Response(text=self.counters.text(), content_type="text/plain")

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.events.append("request")
        self.auth.append(request.headers.get("Authorization"))
        if body.get("model") != "fake-model":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        chat = request.path.endswith("/chat/completions")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            if chat:
                await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None})
            for i in range(self.CHUNKS):
                await asyncio.sleep(0.002)
                choice = {"index": 0, "finish_reason": "length" if i == self.CHUNKS - 1 else None}
                choice.update({"delta": {"content": "ab"}} if chat else {"text": "ab"})
                await send({"choices": [choice], "usage": None})
            self.counters.step(drafts=self.DRAFTS, draft_tokens=self.DRAFT_TOKENS,
                               accepted_per_pos=self.ACCEPTED_PER_POS, tree="chain" if chat else "wide")
            await send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": self.TOKENS_PER_REQUEST,
                                                 "total_tokens": 7 + self.TOKENS_PER_REQUEST}})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def test_reset_prefix_cache_empties_the_cache_before_every_level(server, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(2)))
    argv = ["--base-url", server.url, "--dataset", str(prompts), "--concurrency", "1,2", "--num-requests", "2",
            "--max-tokens", "6", "--no-progress"]
    assert tp.main(argv) == 0 and "reset" not in server.events  # off by default
    server.events.clear()
    server.reset_answers = [False, False]  # blocks still held: asked again until it empties
    monkeypatch.setattr(tp, "reset_prefix_cache", functools.partial(tp.reset_prefix_cache, wait_s=0.01))
    assert tp.main(argv + ["--reset-prefix-cache"]) == 0
    # the warm-up request, then before each level a reset (three tries for the first), then its two requests
    assert server.events == ["request", "reset", "reset", "reset", "request", "request", "reset", "request", "request"]

    server.reset_answers = [False] * 40
    assert tp.main(argv + ["--reset-prefix-cache"]) == 2
    assert "kept its prefix cache (blocks still held) after 30 tries" in capsys.readouterr().err


def test_reset_prefix_cache_without_the_endpoint_names_the_setting(tmp_path):
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def check():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                await tp.reset_prefix_cache(session, url)
        finally:
            await runner.cleanup()

    with pytest.raises(tp.BenchmarkError, match=r"/reset_prefix_cache: not found; .*VLLM_SERVER_DEV_MODE=1"):
        asyncio.run(check())


def test_end_to_end_concurrency_sweep(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "res" / "result.json"
    rc = tp.main(["--base-url", server.url + "/v1", "--dataset", str(prompts), "--concurrency", "1,3",
                  "--num-requests", "7", "--max-tokens", "6", "--seed", "3", "--result-json", str(out),
                  "--api-key", "sekret", "--no-progress"])
    stdout = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "fake-model" and result["config"]["concurrency"] == [1, 3]
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["platform"]
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    assert server.max_in_flight <= 3

    body = server.bodies[-1]  # what the client sent
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["seed"] == 3 and body["max_completion_tokens"] == 6
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].startswith("prompt ")
    assert len(server.bodies) == 1 + 7 + 7  # the warm-up request, then 7 per level
    assert set(server.auth) == {"Bearer sekret"} and "sekret" not in out.read_text()

    for level in result["levels"]:
        assert level["completed"] == 7 and level["failed"] == 0 and level["errors"] == []
        assert level["total_output_tokens"] == 7 * FakeServer.TOKENS_PER_REQUEST  # from usage, not chunks
        assert level["total_input_tokens"] == 7 * 7
        assert level["output_throughput"] == pytest.approx(42 / level["duration"])
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert level[f"median_{name}_ms"] > 0 and level[f"p99_{name}_ms"] >= level[f"median_{name}_ms"]
        spec = level["spec_decode"]  # only this level's requests (the warm-up's step is before)
        assert spec["num_drafts"] == 7 * FakeServer.DRAFTS and spec["num_draft_tokens"] == 7 * FakeServer.DRAFT_TOKENS
        assert spec["num_accepted_tokens_per_position"] == [14, 7, 0]
        assert spec["mean_acceptance_length_incl_bonus"] == pytest.approx(2.5)
        assert level["tree_choice"] == {"vllm_entmtp_tree_choice_total": {'{tree="chain"}': 14}}
        assert 0 <= level["client_stall_s"] < tp.STALL_LIMIT_S
    assert "conc 1" in stdout and "conc 3" in stdout and "2.50" in stdout and "stood still" not in stdout
    paused = result["levels"][1] | {"client_stall_s": 27.4}
    assert ("warning at concurrency 3: this client stood still for 27.4 s (the machine paused?)"
            in tp.format_table([result["levels"][0], paused]))


def test_stall_watch_sees_the_process_stopped():
    """A paused virtual machine stops every process on it, the load generator too: a process stopped (SIGSTOP)
    for 1.5 s sees that gap in its StallWatch."""
    code = ("import sys, time\nsys.path.insert(0, %r)\nimport throughput as tp\n"
            "with tp.StallWatch() as w:\n    print('ready', flush=True)\n    time.sleep(3.0)\n"
            "print(w.max_gap_s, flush=True)\n") % str(ROOT / "benchmarks")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(p.pid, signal.SIGCONT)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0 and float(out) >= 1.2


def test_fill_levels_sends_a_full_batch_at_every_level(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "result.json"
    assert tp.main(["--base-url", server.url, "--dataset", str(prompts), "--concurrency", "1,5", "--num-requests",
                    "2", "--fill-levels", "--max-tokens", "4", "--warmup-requests", "0", "--result-json", str(out),
                    "--no-progress"]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert [lv["completed"] for lv in levels] == [2, 5]  # 2 at one in flight, 5 (not 2) at five in flight
    assert len(server.bodies) == 7
    cfg = tp.make_config(tp.build_parser().parse_args(["--num-requests", "3", "--fill-levels"]))
    assert (cfg.requests_at(1, 10), cfg.requests_at(16, 10), cfg.requests_at(None, 10)) == (3, 16, 3)
    cfg = tp.make_config(tp.build_parser().parse_args(["--num-requests", "3"]))
    assert cfg.requests_at(16, 10) == 3
    cfg = tp.make_config(tp.build_parser().parse_args(["--num-requests", "3", "--fill-levels", "2"]))
    assert (cfg.requests_at(1, 10), cfg.requests_at(16, 10)) == (3, 32)  # the batch runs full twice over
    with pytest.raises(tp.BenchmarkError, match="--fill-levels must be >= 0, got -1"):
        tp.make_config(tp.build_parser().parse_args(["--fill-levels", "-1"]))


def test_end_to_end_completions_at_a_request_rate(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "raw text"}\n')
    out = tmp_path / "result.json"
    assert tp.main(["--base-url", server.url, "--dataset", str(prompts), "--endpoint", "completions",
                    "--request-rate", "inf", "--num-requests", "4", "--warmup-requests", "0",
                    "--result-json", str(out), "--no-progress"]) == 0
    [level] = json.loads(out.read_text())["levels"]
    assert level["request_rate"] == "inf" and level["concurrency"] is None
    assert level["completed"] == 4 and level["total_output_tokens"] == 4 * FakeServer.TOKENS_PER_REQUEST
    assert level["spec_decode"]["mean_acceptance_length_incl_bonus"] == pytest.approx(2.5)
    assert server.bodies[0]["prompt"] == "raw text" and "messages" not in server.bodies[0]


def test_wrong_model_fails_at_warm_up(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    assert tp.main(["--base-url", server.url, "--model", "other", "--dataset", str(prompts), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: warm-up request") and "HTTP 404" in err and err.count("\n") == 1


def test_draft_sources_from_entmtps_source_counters():
    """Per draft source (prompt lookup, heads): drafts, tokens, share and MAL from vllm:entmtp_source_* deltas."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reg = CollectorRegistry()
    fams = {k: Counter(f"vllm:entmtp_source_{k}", k, ["source"], registry=reg)
            for k in ("drafts", "draft_tokens", "accepted_tokens")}
    before = tp.parse_metrics(generate_latest(reg).decode())
    for src, (n, toks, acc) in {"heads": (30, 60, 15), "lookup": (10, 40, 25)}.items():
        for k, v in zip(("drafts", "draft_tokens", "accepted_tokens"), (n, toks, acc)):
            fams[k].labels(source=src).inc(v)
    after = tp.parse_metrics(generate_latest(reg).decode())
    got = tp.draft_sources(tp.tree_choice_delta(before, after))
    assert got["heads"] == {"drafts": 30, "draft_tokens": 60, "accepted_tokens": 15, "share": 0.75,
                            "mean_acceptance_length_incl_bonus": 1.5}
    assert got["lookup"]["share"] == 0.25 and got["lookup"]["mean_acceptance_length_incl_bonus"] == 3.5
    assert tp.draft_sources({}) == {}
