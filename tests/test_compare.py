"""benchmarks/compare.py and its modules (compare_*.py): method table, interleaving, aggregation, report,
arguments and the server wrapper (no vLLM server is started)."""
from __future__ import annotations

import dataclasses
import json
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import load_benchmark

cp = load_benchmark("compare")  # the script: its options and main; it puts benchmarks/ on sys.path for its parts
import compare_aggregate as agg  # noqa: E402
import compare_methods as cm  # noqa: E402
import compare_report as rep  # noqa: E402
import compare_run as crun  # noqa: E402
import compare_server as srv  # noqa: E402
import compare_settings as cs  # noqa: E402
import throughput as tp  # noqa: E402

CHOSEN = tp.CHOSEN_FAMILY


# ------------------------------------------------------------------------------------------ method table
@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A fake checkout: ``make(heads=("medusa",), tree_sets=("humaneval",))`` ships those heads and tree sets
    (tmp folders that vllm_entmtp.models and vllm_entmtp.trees read), and returns shipped_method_table()."""
    import vllm_entmtp.models as models
    import vllm_entmtp.trees as trees

    def make(heads=("medusa",), tree_sets=()):
        assets = tmp_path / "assets"
        for kind in heads:
            d = assets / "heads" / models.DEFAULT_MODEL_NAME / kind
            d.mkdir(parents=True)
            (d / "config.json").write_text("{}")
        shipped = tmp_path / "trees"
        shipped.mkdir()
        for name in tree_sets:
            (shipped / f"{name}.json").write_text("{}")
        monkeypatch.setattr(models, "_ASSETS", assets)
        monkeypatch.setattr(trees.tree_sets, "shipped_trees_dir", lambda: shipped)
        monkeypatch.delenv(trees.TREES_ENV, raising=False)
        return cm.shipped_method_table()

    return make


def test_method_table_with_everything_shipped(checkout, tmp_path):
    available, skipped = checkout(heads=("medusa", "hydra"), tree_sets=("humaneval", "gsm8k", "default"))
    assert list(available) == ["plain", "plain-float32", "plain-bfloat16", "ngram", "vllm-medusa", "medusa-tree",
                               "hydra-tree", "entmtp", "entmtp-heads", "entmtp-no-draft", "entmtp-vllm-attention",
                               *(f"static-{t}" for t in cm.STATIC_TREES), "entmtp-humaneval", "entmtp-gsm8k"]
    assert available["static-b0n2"].spec == {"method": "entmtp", "policy": "static", "tree_set": "default",
                                             "tree_id": "b0n2"}
    assert available["static-b0n2"].only_task == "mixed"
    assert available["entmtp-heads"].spec == {"method": "entmtp", "draft_sources": "heads"}
    assert set(skipped) == {"entmtp-sharegpt", "entmtp-creative"}
    assert "trees/sharegpt.json" in skipped["entmtp-sharegpt"]
    medusa = str(tmp_path / "assets" / "heads" / "SmolLM2-135M-Instruct" / "medusa")
    hydra = medusa.replace("medusa", "hydra")
    assert available["plain"].spec is None and available["plain"].dtype is None  # the run's dtype
    assert available["plain-bfloat16"].spec is None and available["plain-bfloat16"].dtype == "bfloat16"
    assert available["ngram"].spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2}
    assert available["vllm-medusa"].spec == {"method": "medusa", "model": medusa, "num_speculative_tokens": 4}
    assert available["medusa-tree"].spec == {"method": "entmtp", "model": medusa, "tree_set": "ladder",
                                             "tree_id": "mc12"}
    assert available["hydra-tree"].spec == {"method": "entmtp", "model": hydra, "tree_set": "ladder",
                                            "tree_id": "mc12"}
    assert available["entmtp"].spec == {"method": "entmtp"}
    assert "hydra" in available["entmtp"].note  # the preferred kind when both are shipped
    assert available["entmtp-gsm8k"].spec == {"method": "entmtp", "tree_set": "gsm8k"}  # auto: the set's signal


def test_method_table_medusa_only(checkout):
    available, skipped = checkout(heads=("medusa",))
    assert "hydra-tree" not in available
    assert skipped["hydra-tree"] == "no Hydra heads are shipped for SmolLM2-135M-Instruct"
    assert "medusa" in available["entmtp"].note
    assert set(skipped) == {"hydra-tree", *(f"entmtp-{t}" for t in cm.TUNED_TASKS)}


def test_method_table_without_heads(checkout):
    available, skipped = checkout(heads=(), tree_sets=("creative",))
    assert list(available) == ["plain", "plain-float32", "plain-bfloat16", "ngram"]
    assert skipped["vllm-medusa"] == "no Medusa heads are shipped for SmolLM2-135M-Instruct"
    assert "no heads are shipped" in skipped["entmtp"]
    assert "no heads are shipped" in skipped["entmtp-creative"]


def test_select_methods(checkout):
    available, skipped = checkout(heads=("medusa",))
    assert [m.name for m in cm.select_methods(None, available, skipped)] == list(available)
    assert [m.name for m in cm.select_methods("entmtp, plain,entmtp", available, skipped)] == ["entmtp", "plain"]
    with pytest.raises(tp.BenchmarkError, match="unknown method 'eagle'; known: plain, plain-float32, plain-bfloat16, ngram"):
        cm.select_methods("plain,eagle", available, skipped)
    with pytest.raises(tp.BenchmarkError, match="method 'hydra-tree' is not available: no Hydra heads"):
        cm.select_methods("hydra-tree", available, skipped)
    with pytest.raises(tp.BenchmarkError, match="at least one"):
        cm.select_methods(" , ", available, skipped)


# ------------------------------------------------------------------------------------------ interleaving
def test_interleaved_order_rotates():
    methods = ["plain", "ngram", "entmtp"]
    orders = [cm.interleaved_order(methods, r) for r in range(4)]
    assert orders == [["plain", "ngram", "entmtp"], ["ngram", "entmtp", "plain"], ["entmtp", "plain", "ngram"],
                      ["plain", "ngram", "entmtp"]]
    for pos in range(3):  # over len(methods) repeats each method takes each position once
        assert sorted(o[pos] for o in orders[:3]) == sorted(methods)
    assert cm.interleaved_order([], 3) == []


# ------------------------------------------------------------------------------------------ paired runs
def test_paired_schedule_rotates_the_methods_level_by_level():
    plain, entmtp = cm.Method("plain", None), cm.Method("entmtp", ENTMTP)
    static = cm.Method("static-x", ENTMTP, only_task="mixed")
    order = crun.paired_schedule([plain, entmtp, static], ["humaneval", "mixed"], [1, 16], repeats=2)
    cells: dict = {}
    for repeat, task, c, pos, m in order:
        cells.setdefault((repeat, task, c), []).append((pos, m.name))
    assert list(cells) == [(r, t, c) for r in range(2) for t in ("humaneval", "mixed") for c in (1, 16)]
    for (repeat, task, c), turns in cells.items():  # each method once per level, in positions 0, 1, ...
        names = [n for _, n in turns]
        assert sorted(names) == (["entmtp", "plain"] if task == "humaneval" else ["entmtp", "plain", "static-x"])
        assert [p for p, _ in turns] == list(range(len(names)))
    # rotated from level to level and from repeat to repeat: at each level each method goes first once in 2 repeats
    firsts = [turns[0][1] for (r, t, c), turns in cells.items() if t == "humaneval"]
    assert firsts == ["plain", "entmtp", "entmtp", "plain"]
    for c in (1, 16):  # mixed: 3 methods, the first of each level differs between the repeats
        assert cells[0, "mixed", c][0][1] != cells[1, "mixed", c][0][1]
    assert crun.paired_schedule([], ["humaneval"], [1], 1) == []


class FakeServers:
    """Stands in for compare_server.Server in run_paired: records starts, stops and ports."""

    def __init__(self):
        self.started, self.stopped = [], []

    def __call__(self, cmd, log, port, timeout, name):
        fake = self

        class S:
            def __init__(self):
                self.log, self.port, self.startup_s, self.base_url = log, port, 1.5, f"http://h:{port}"

            def __enter__(self):
                fake.started.append((name, port))
                return self

            def __exit__(self, *exc):
                fake.stopped.append(name)

            def runtime(self):
                return {"env": {}, "omp_binding": []}

            def peak_rss_mib(self):
                return 100.0 + port

        return S()


def paired_settings(tmp_path, repeats=2):
    plain, entmtp = cm.Method("plain", None), cm.Method("entmtp", ENTMTP)
    return cs.Settings(methods=[plain, entmtp], skipped={}, tasks=["humaneval"], concurrency=[1, 4], num_requests=4,
                       max_tokens=8, repeats=repeats, ignore_eos=False, port=9000, out=tmp_path, quick=False,
                       enforce_eager=False, serve_args=[], startup_timeout=5.0, paired=True)


def test_run_paired_serves_every_method_once_and_takes_turns(tmp_path, monkeypatch):
    servers, calls = FakeServers(), []
    monkeypatch.setattr(crun, "Server", servers)
    monkeypatch.setattr(tp, "load_benchmark_prompts", lambda task, n: [[{"role": "user", "content": str(i)}]
                                                                      for i in range(n)])

    async def fake_run(cfg, prompts):
        port = int(cfg.base_url.rsplit(":", 1)[1])
        (c,) = [lv["concurrency"] for lv in cfg.levels]
        calls.append((port, c, cfg.warmup_requests))
        return {"config": {"port": port}, "date": "d", "levels": [level(c, float(port - 9000 + 1) * c)]}

    monkeypatch.setattr(tp, "run_benchmark", fake_run)
    runs: list = []
    crun.run_paired(paired_settings(tmp_path), "model", "vllm", runs)
    assert servers.started == [("plain", 9000), ("entmtp", 9001)]
    assert sorted(servers.stopped) == ["entmtp", "plain"]
    # turns: level by level, the order rotated each level; one warm-up request per server, on its first level
    assert calls == [(9000, 1, 1), (9001, 1, 1), (9001, 4, 0), (9000, 4, 0),
                     (9001, 1, 0), (9000, 1, 0), (9000, 4, 0), (9001, 4, 0)]
    assert [(r["repeat"], r["method"]) for r in runs] == [(0, "plain"), (0, "entmtp"), (1, "entmtp"), (1, "plain")]
    for r in runs:  # one record per method, task and repeat, its levels in order, as run_method writes them
        assert [lv["concurrency"] for lv in r["levels"]] == [1, 4]
        first = (r["method"] == "plain") == (r["repeat"] == 0)
        assert r["paired"] and r["positions"] == ({"1": 0, "4": 1} if first else {"1": 1, "4": 0})
        assert r["server_peak_rss_mib"] == (9100.0 if r["method"] == "plain" else 9101.0)
    saved = json.loads((tmp_path / "raw" / "r1-entmtp-humaneval.json").read_text())
    assert [lv["output_throughput"] for lv in saved["levels"]] == [2.0, 8.0]
    rows = {(r["method"], r["concurrency"]): r for r in agg.aggregate(runs)}
    assert rows["entmtp", 4]["ratios"]["plain"]["mean"] == pytest.approx(2.0)


def test_run_paired_with_fresh_servers_starts_them_anew_every_repeat(tmp_path, monkeypatch):
    servers, calls = FakeServers(), []
    monkeypatch.setattr(crun, "Server", servers)
    monkeypatch.setattr(tp, "load_benchmark_prompts", lambda task, k: [[{"role": "user", "content": "x"}]] * k)

    async def fake_run(cfg, prompts):
        (c,) = [lv["concurrency"] for lv in cfg.levels]
        calls.append((int(cfg.base_url.rsplit(":", 1)[1]), c, cfg.warmup_requests, len(servers.stopped)))
        return {"config": {}, "levels": [level(c, 10.0)]}

    monkeypatch.setattr(tp, "run_benchmark", fake_run)
    runs: list = []
    s = dataclasses.replace(paired_settings(tmp_path, repeats=2), fresh_servers=True)
    crun.run_paired(s, "model", "vllm", runs)
    assert servers.started == [("plain", 9000), ("entmtp", 9001)] * 2
    assert len(servers.stopped) == 4
    # repeat 0 runs before any server stopped, repeat 1 after both of repeat 0's; each fresh server warms up once
    assert calls == [(9000, 1, 1, 0), (9001, 1, 1, 0), (9001, 4, 0, 0), (9000, 4, 0, 0),
                     (9001, 1, 1, 2), (9000, 1, 1, 2), (9000, 4, 0, 2), (9001, 4, 0, 2)]
    assert {r["server_log"].rsplit("/", 1)[1] for r in runs} == {
        f"paired-r{r}-{m}.log" for r in (0, 1) for m in ("plain", "entmtp")}
    doc = hand_doc(hand_runs())
    doc["settings"].update(paired=True, fresh_servers=True)
    doc["aggregate"] = agg.aggregate(doc["runs"])
    assert "started anew every repeat (`--fresh-servers`)" in rep.render_report(doc)


def test_run_paired_interrupted_keeps_what_it_measured_and_stops_the_servers(tmp_path, monkeypatch):
    servers, n = FakeServers(), []
    monkeypatch.setattr(crun, "Server", servers)
    monkeypatch.setattr(tp, "load_benchmark_prompts", lambda task, k: [[{"role": "user", "content": "x"}]] * k)

    async def fake_run(cfg, prompts):
        n.append(1)
        if len(n) == 3:
            raise KeyboardInterrupt
        return {"config": {}, "levels": [level(cfg.levels[0]["concurrency"], 10.0)]}

    monkeypatch.setattr(tp, "run_benchmark", fake_run)
    runs: list = []
    with pytest.raises(KeyboardInterrupt):
        crun.run_paired(paired_settings(tmp_path), "model", "vllm", runs)
    assert sorted(servers.stopped) == ["entmtp", "plain"]
    assert [(r["method"], len(r["levels"])) for r in runs] == [("plain", 1), ("entmtp", 1)]


def test_run_paired_measures_a_level_again_when_the_machine_stood_still(tmp_path, monkeypatch):
    servers, calls = FakeServers(), []
    monkeypatch.setattr(crun, "Server", servers)
    monkeypatch.setattr(tp, "load_benchmark_prompts", lambda task, k: [[{"role": "user", "content": "x"}]] * k)
    # plain's first level stands still twice (27 s, then 3 s), entmtp's second level three times
    stalls = {(9000, 1): [27.0, 3.0, 0.02], (9001, 4): [5.0, 5.0, 5.0, 0.0]}

    async def fake_run(cfg, prompts):
        port = int(cfg.base_url.rsplit(":", 1)[1])
        (c,) = [lv["concurrency"] for lv in cfg.levels]
        calls.append((port, c))
        left = stalls.get((port, c)) or [0.01]
        return {"config": {}, "levels": [level(c, 10.0 * len(calls)) | {"client_stall_s": left.pop(0)}]}

    monkeypatch.setattr(tp, "run_benchmark", fake_run)
    runs: list = []
    crun.run_paired(paired_settings(tmp_path, repeats=1), "model", "vllm", runs)
    # plain c1 ran three times (two stalls), entmtp c4 three times (MAX_STALL_RETRIES = 2: the third is kept)
    assert calls == [(9000, 1)] * 3 + [(9001, 1), (9001, 4), (9001, 4), (9001, 4), (9000, 4)]
    levels = {(r["method"], lv["concurrency"]): lv for r in runs for lv in r["levels"]}
    assert levels["plain", 1]["stalled_runs_s"] == [27.0, 3.0]
    assert levels["plain", 1]["output_throughput"] == 30.0 and levels["plain", 1]["client_stall_s"] == 0.02
    assert levels["entmtp", 4]["stalled_runs_s"] == [5.0, 5.0] and levels["entmtp", 4]["client_stall_s"] == 5.0
    assert "stalled_runs_s" not in levels["entmtp", 1]
    lines = rep.stall_lines(runs)
    assert lines == ["- plain / humaneval / concurrency 1 / repeat 1: measured again after stalls of 27.0, 3.0 s",
                     "- entmtp / humaneval / concurrency 4 / repeat 1: measured again after stalls of 5.0, 5.0 s",
                     "- entmtp / humaneval / concurrency 4 / repeat 1: kept with a stall of 5.0 s: this repeat of "
                     "the level is left out of every method's figures"]
    doc = hand_doc(hand_runs())
    doc["runs"][0]["levels"][0]["stalled_runs_s"] = [27.0]
    doc["aggregate"] = agg.aggregate(doc["runs"])
    md = rep.render_report(doc)
    assert "## The machine stood still" in md and "measured again after stalls of 27.0 s" in md
    doc["runs"][0]["levels"][0].pop("stalled_runs_s")
    assert "stood still" not in rep.render_report(doc)
    # a level kept with a stall: that repeat of the level is left out for every method, the other repeat stays
    runs = hand_runs()
    runs[0]["levels"][0]["client_stall_s"] = 27.0  # plain, humaneval, c1, repeat 0
    assert agg.stalled_cells(runs) == {("humaneval", 1, 0)}
    rows = {(r["method"], r["concurrency"]): r for r in agg.aggregate(runs)}
    assert rows["entmtp", 1]["repeats"] == [1] and rows["plain", 1]["repeats"] == [1]
    assert rows["entmtp", 1]["ratios"]["plain"]["mean"] == pytest.approx(1.0)  # repeat 1's 20 / 20 only
    assert rows["entmtp", 4]["repeats"] == [0, 1]


def test_report_says_the_run_was_paired():
    doc = hand_doc(hand_runs())
    doc["settings"]["paired"] = True
    doc["aggregate"] = agg.aggregate(doc["runs"])
    md = rep.render_report(doc)
    assert "Methods ran paired (`--paired`)" in md and "order rotated from one level to the next" in md
    assert "rotated every repeat" not in md and "mean over the 2 repeats" in md


# ------------------------------------------------------------------------------------------ arguments
def settings(checkout_make, argv, **kw):
    available, skipped = checkout_make
    return cs.make_settings(cp.build_parser().parse_args(argv), available, skipped, **kw)


def test_quick_defaults_and_overrides(checkout):
    table = checkout(heads=("medusa",))
    s = settings(table, ["--quick"])
    assert [m.name for m in s.methods] == ["plain", "vllm-medusa", "entmtp"]
    assert (s.tasks, s.concurrency, s.num_requests, s.max_tokens) == (["humaneval", "sharegpt"], [1], 4, 64)
    assert not s.enforce_eager
    s = settings(table, ["--quick", "--methods", "plain,entmtp", "--tasks", "humaneval", "--num-requests", "2",
                         "--max-tokens", "32"])
    assert ([m.name for m in s.methods], s.tasks, s.num_requests, s.max_tokens) == (
        ["plain", "entmtp"], ["humaneval"], 2, 32)
    s = settings(table, ["--serve-args", "--dtype float32"])
    assert [m.name for m in s.methods] == ["plain", "plain-bfloat16", "ngram", "vllm-medusa", "medusa-tree",
                                           "entmtp", "entmtp-heads", "entmtp-no-draft", "entmtp-vllm-attention",
                                           *(f"static-{t}" for t in cm.STATIC_TREES)]
    # plain in the other dtype, once; the static trees on the mixed task only
    assert "same as plain" in s.skipped["plain-float32"]
    s = settings(table, [])
    assert (s.tasks, s.concurrency, s.repeats, s.port) == (list(cm.TASKS), [1, 4, 16], 1, 8123)
    assert not s.paired and settings(table, ["--paired"]).paired
    assert not s.fresh_servers and settings(table, ["--paired", "--fresh-servers"]).fresh_servers


def test_waves_keep_every_level_full_that_many_times_over(checkout):
    table = checkout()
    s = settings(table, ["--concurrency", "1,16", "--num-requests", "8"])
    assert s.waves == 1 and crun.prompts_needed(s) == 16  # one wave of 16 at 16 running
    cfg = crun.throughput_config(s, "http://x", "creative", warmup=0)
    assert (cfg.requests_at(1, 16), cfg.requests_at(16, 16)) == (8, 16)
    s = settings(table, ["--concurrency", "1,16", "--num-requests", "8", "--waves", "3"])
    assert crun.prompts_needed(s) == 48  # each request a different prompt
    cfg = crun.throughput_config(s, "http://x", "creative", warmup=0)
    assert (cfg.requests_at(1, 48), cfg.requests_at(16, 48)) == (8, 48)
    doc = hand_doc(hand_runs())
    doc["aggregate"] = agg.aggregate(doc["runs"])
    assert ("4 requests per level, or as many as in flight where more (4 at c1, 4 at c4), each of at most 64 tokens"
            in rep.render_report(doc))
    doc["settings"]["waves"] = 3
    md = rep.render_report(doc)
    assert "4 requests per level, or 3 times as many as in flight where more (4 at c1, 12 at c4)" in md


def test_added_methods_run_with_their_speculative_config(checkout):
    """``--add-method NAME=SPEC`` serves one more method (e.g. an entmtp option against the defaults), named in
    --methods like the built-in ones, or run with all of them."""
    table = checkout()
    spec = {"method": "entmtp", "compare_margin": 0.02}
    s = settings(table, ["--methods", "plain,m2,entmtp", "--add-method", f"m2={json.dumps(spec)}"])
    assert [(m.name, m.spec) for m in s.methods] == [("plain", None), ("m2", spec), ("entmtp", {"method": "entmtp"})]
    assert s.as_json()["methods"]["m2"]["speculative_config"] == spec
    s = settings(table, ["--add-method", 'ng2={"method": "ngram", "num_speculative_tokens": 2}'])
    assert s.methods[-1].name == "ng2" and "ng2" not in table[0]  # all methods, the added one last
    with pytest.raises(tp.BenchmarkError, match="unknown method 'm3'"):
        settings(table, ["--methods", "plain,m3", "--add-method", f"m2={json.dumps(spec)}"])
    s = settings(table, ["--quick", "--add-method", f"m2={json.dumps(spec)}"])  # the quick set and the added one
    assert [m.name for m in s.methods] == ["plain", "vllm-medusa", "entmtp", "m2"]


def test_per_task_tree_sets_run_their_own_task_only(checkout):
    table = checkout(heads=("hydra",), tree_sets=("humaneval", "gsm8k"))
    assert table[0]["entmtp-gsm8k"].only_task == "gsm8k" and table[0]["entmtp"].only_task is None
    s = settings(table, ["--tasks", "gsm8k,sharegpt"])
    assert [m.name for m in s.methods if not m.name.startswith("plain-")] == [
        "plain", "ngram", "hydra-tree", "entmtp", "entmtp-heads", "entmtp-no-draft", "entmtp-vllm-attention",
        "entmtp-gsm8k"]
    assert s.skipped["entmtp-humaneval"] == "runs task 'humaneval' only, which is not in --tasks"
    with pytest.raises(tp.BenchmarkError, match="'entmtp-humaneval' runs task 'humaneval' only"):
        settings(table, ["--tasks", "gsm8k", "--methods", "plain,entmtp-humaneval"])


def test_quick_leaves_out_what_is_not_shipped(checkout):
    s = settings(checkout(heads=()), ["--quick"])
    assert [m.name for m in s.methods] == ["plain"]


def test_default_out_dir(checkout):
    from datetime import datetime

    s = settings(checkout(), [], now=datetime(2025, 1, 2, 3, 4, 5))
    assert str(s.out) == "runs/compare-20250102-030405"


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "humaneval,mbpp"], "unknown task 'mbpp'; tasks: humaneval, gsm8k, sharegpt, creative"),
    (["--methods", "nope"], "unknown method 'nope'"),
    (["--methods", "hydra-tree"], "not available: no Hydra heads"),
    (["--concurrency", "1,x"], "--concurrency takes whole numbers"),
    (["--num-requests", "0"], "--num-requests must be >= 1, got 0"),
    (["--max-tokens", "-1"], "--max-tokens must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--waves", "0"], "--waves must be >= 1, got 0"),
    (["--port", "70000"], "--port must be 1..65535"),
    (["--paired", "--methods", "plain,entmtp", "--port", "65535"], "--paired serves 2 methods on ports 65535..65536"),
    (["--startup-timeout", "0"], "--startup-timeout must be > 0"),
    (["--fresh-servers"], "--fresh-servers restarts the servers of --paired every repeat; pass --paired too"),
    (["--serve-args", "'unclosed"], "--serve-args"),
    (["--add-method", "m2"], "--add-method takes NAME=SPEC"),
    (["--add-method", "entmtp={\"method\": \"entmtp\"}"], "'entmtp' is taken (a built-in method"),
    (["--add-method", "m2={\"method\": \"entmtp\"}", "--add-method", "m2={\"method\": \"ngram\"}"],
     "'m2' is taken"),
    (["--add-method", "m 2={\"method\": \"entmtp\"}"], "name 'm 2': use letters, digits"),
    (["--add-method", "m2={method: entmtp}"], "--add-method m2: SPEC is not JSON"),
    (["--add-method", "m2=[1]"], "--add-method m2: SPEC must be a JSON object with a \"method\""),
    (["--add-method", "m2={\"method\": \"entmtp\", \"compare_margin\": 2}"],
     "--add-method m2: invalid --speculative-config for method 'entmtp': compare_margin=2"),
    (["--add-method", "m2={\"method\": \"entmtp\", \"compare_margn\": 0.02}"],
     "Did you mean compare_margin"),
])
def test_bad_arguments(checkout, argv, message):
    with pytest.raises(tp.BenchmarkError, match=message.replace("(", r"\(")):
        settings(checkout(), argv)


def test_main_bad_argument_is_one_line(checkout, capsys, tmp_path):
    checkout(heads=("medusa",))
    assert cp.main(["--methods", "plain,hydra-tree", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: method 'hydra-tree' is not available: no Hydra heads are shipped for "
                           "SmolLM2-135M-Instruct")
    assert not (tmp_path / "out").exists()


def test_serve_command():
    m = cm.Method("entmtp", {"method": "entmtp"})
    cmd = srv.serve_command("vllm", "/m", m, 8123, enforce_eager=True, extra=["--max-num-seqs", "8"])
    assert cmd == ["vllm", "serve", "/m", "--served-model-name", "SmolLM2-135M-Instruct", "--host", "127.0.0.1",
                   "--port", "8123", "--gpu-memory-utilization", "0.5", "--speculative-config",
                   '{"method": "entmtp"}', "--enforce-eager", "--max-num-seqs", "8"]
    assert "--speculative-config" not in srv.serve_command("vllm", "/m", cm.Method("plain", None), 1)
    # a method's own dtype replaces the run's, in either spelling
    bf16 = cm.Method("plain-bfloat16", None, dtype="bfloat16")
    for extra in (["--dtype", "float32", "--max-num-seqs", "8"], ["--dtype=float32", "--max-num-seqs", "8"]):
        assert srv.serve_command("vllm", "/m", bf16, 1, extra=extra)[-4:] == ["--max-num-seqs", "8", "--dtype",
                                                                              "bfloat16"]
    assert srv.serve_command("vllm", "/m", m, 1, extra=["--dtype", "float32"])[-2:] == ["--dtype", "float32"]


# ------------------------------------------------------------------------------------------ aggregation
def level(conc, tput, tpot=10.0, drafts=0, accepted=0, trees=None, failed=0, errors=()):
    spec = None if drafts is None else {
        "num_drafts": drafts, "num_accepted_tokens": accepted,
        "mean_acceptance_length_incl_bonus": 1 + accepted / drafts if drafts else None}
    tc = {CHOSEN: {f'{{tree="{t}"}}': n for t, n in (trees or {}).items()}} if trees else {}
    return {"concurrency": conc, "request_rate": None, "completed": 4 - failed, "failed": failed,
            "errors": list(errors), "output_throughput": tput, "median_tpot_ms": tpot, "median_ttft_ms": 50.0,
            "spec_decode": spec, "tree_choice": tc, "tree_choice_shares": tp.tree_choice_shares(tc)}


def run(method, task, repeat, levels, spec=None):
    return {"method": method, "task": task, "repeat": repeat, "position": 0, "speculative_config": spec,
            "server_startup_s": 60.0 + repeat, "levels": levels}


ENTMTP = {"method": "entmtp"}
NGRAM = {"method": "ngram"}


def hand_runs():
    """Two repeats; plain 10 then 20 tok/s, ngram 20 then 20, entmtp 30 then 20 (ratios per repeat 3.0 and 1.0:
    mean 2.0, whereas the ratio of the means would be 1.67)."""
    return [
        run("plain", "humaneval", 0, [level(1, 10.0, drafts=None), level(4, 40.0, drafts=None)]),
        run("ngram", "humaneval", 0, [level(1, 20.0, drafts=10, accepted=5), level(4, 40.0, drafts=10)], NGRAM),
        run("entmtp", "humaneval", 0, [level(1, 30.0, tpot=5.0, drafts=10, accepted=10, trees={"mc12": 6, "none": 2}),
                                       level(4, 80.0, drafts=4, accepted=4, trees={"mc24": 4})], ENTMTP),
        run("entmtp", "humaneval", 1, [level(1, 20.0, tpot=7.0, drafts=10, accepted=20, trees={"mc12": 2}),
                                       level(4, 80.0, drafts=4, accepted=4, trees={"mc24": 4})], ENTMTP),
        run("plain", "humaneval", 1, [level(1, 20.0, drafts=None), level(4, 40.0, drafts=None)]),
        run("ngram", "humaneval", 1, [level(1, 20.0, drafts=10, accepted=5), level(4, 40.0, drafts=10)], NGRAM),
    ]


def test_aggregate_ratios_per_repeat():
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in agg.aggregate(hand_runs())}
    assert len(rows) == 8  # 3 methods and plain-best, 2 levels
    e1 = rows[("entmtp", "humaneval", 1)]
    assert e1["repeats"] == [0, 1]
    assert e1["output_throughput"] == {"mean": 25.0, "min": 20.0, "max": 30.0, "std": 5.0, "n": 2}
    assert e1["ratios"]["plain"]["mean"] == pytest.approx(2.0)  # (30/10 + 20/20) / 2
    assert (e1["ratios"]["plain"]["min"], e1["ratios"]["plain"]["max"]) == (1.0, 3.0)
    assert e1["ratios"]["ngram"]["mean"] == pytest.approx(1.25)  # (30/20 + 20/20) / 2
    assert set(e1["ratios"]) == {"plain-best", "plain", "ngram"}  # baselines that did not run get no ratio
    assert e1["mal"]["mean"] == pytest.approx(2.5)  # MAL 2.0 and 3.0
    assert e1["median_tpot_ms"]["mean"] == pytest.approx(6.0)
    assert e1["tree_choice_shares"] == {"mc12": 0.8, "none": 0.2}  # 8 + 2 pooled over the repeats
    p1 = rows[("plain", "humaneval", 1)]
    assert p1["mal"] is None and p1["tree_choice_shares"] == {}
    assert p1["ratios"]["plain"]["mean"] == 1.0
    assert rows[("ngram", "humaneval", 4)]["mal"]["mean"] == 1.0  # drafts, none accepted


def test_plain_best_is_the_fastest_plain_per_repeat():
    """plain-best takes, per repeat, the faster of the plain methods that ran; ratios against it are per repeat."""
    runs = hand_runs() + [
        run("plain-bfloat16", "humaneval", 0, [level(1, 15.0, drafts=None), level(4, 30.0, drafts=None)]),
        run("plain-bfloat16", "humaneval", 1, [level(1, 10.0, drafts=None), level(4, 50.0, drafts=None)])]
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in agg.aggregate(runs)}
    best1, best4 = rows[("plain-best", "humaneval", 1)], rows[("plain-best", "humaneval", 4)]
    assert best1["output_throughput"]["min"] == 15.0 and best1["output_throughput"]["max"] == 20.0
    assert best1["plain_methods"] == ["plain", "plain-bfloat16"]  # bfloat16 won repeat 0, plain repeat 1
    assert best4["output_throughput"]["mean"] == 45.0 and best4["plain_methods"] == ["plain", "plain-bfloat16"]
    e1 = rows[("entmtp", "humaneval", 1)]
    assert e1["ratios"]["plain-best"]["mean"] == pytest.approx((30 / 15 + 20 / 20) / 2)
    assert e1["ratios"]["plain-bfloat16"]["mean"] == pytest.approx((30 / 15 + 20 / 10) / 2)
    # with one plain method, plain-best is it
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in agg.aggregate(hand_runs())}
    assert rows[("entmtp", "humaneval", 1)]["ratios"]["plain-best"] == rows[("entmtp", "humaneval", 1)][
        "ratios"]["plain"]


def test_aggregate_missing_repeat_of_baseline():
    runs = [r for r in hand_runs() if not (r["method"] == "plain" and r["repeat"] == 1)]
    e1 = next(r for r in agg.aggregate(runs) if (r["method"], r["concurrency"]) == ("entmtp", 1))
    assert e1["ratios"]["plain"] == {"mean": 3.0, "min": 3.0, "max": 3.0, "std": 0.0, "n": 1}


def test_stat_and_formatting():
    assert agg.stat([None]) is None
    assert rep.fmt_stat(None, ".1f") == "-"
    assert rep.fmt_stat(agg.stat([2.0]), ".2f", "x") == "2.00x"
    assert rep.fmt_stat(agg.stat([1.0, 3.0]), ".2f", "x") == "2.00x [1.00–3.00]"
    assert rep.fmt_shares({"a": 0.25, "b": 0.75}) == "b 75%, a 25%"
    assert agg.pooled_mal([level(1, 1, drafts=10, accepted=5), level(4, 1, drafts=10, accepted=15)]) == 2.0
    assert agg.pooled_mal([level(1, 1, drafts=None)]) is None


# ------------------------------------------------------------------------------------------ report
def hand_doc(runs, repeats=2, methods=("plain", "ngram", "entmtp")):
    specs = {"plain": None, "ngram": NGRAM, "entmtp": ENTMTP}
    return {
        "run_id": "20250101T000000Z-1", "command": "python benchmarks/compare.py --repeats 2",
        "machine": {"cpu_model": "AMD EPYC", "cpu_count": 2, "usable_cpus": 2, "platform": "Linux"},
        "date": "2025-01-01T00:00:00+00:00",
        "settings": {"methods": {m: {"speculative_config": specs[m], "note": f"note {m}"} for m in methods},
                     "skipped": {"hydra-tree": "no Hydra heads are shipped"}, "tasks": ["humaneval"],
                     "concurrency": [1, 4], "num_requests": 4, "max_tokens": 64, "repeats": repeats,
                     "ignore_eos": False, "enforce_eager": False},
        "runs": runs}


def test_render_report():
    doc = hand_doc(hand_runs())
    doc["aggregate"] = agg.aggregate(doc["runs"])
    doc["plots"] = ["throughput.png"]
    md = rep.render_report(doc)
    assert "- command: `python benchmarks/compare.py --repeats 2`" in md
    assert "- machine: AMD EPYC, 2 CPUs (2 usable), Linux" in md
    assert "- date: 2025-01-01T00:00:00+00:00" in md
    assert "ratio measured within one run on one machine" in md
    assert "never compare these numbers with those of another run" in md
    assert "order was rotated every repeat" in md
    assert "- hydra-tree: no Hydra heads are shipped" in md
    assert '| entmtp | `{"method": "entmtp"}` | note entmtp | 60 [60–61] |' in md
    assert "| method | out tok/s | vs plain-best | vs ngram | MAL | TPOT ms | failed |" in md
    section = md.split("### humaneval, concurrency 1")[1].split("###")[0]
    assert "| plain | 15.0 [10.0–20.0] | 1.00x [1.00–1.00] | 0.75x [0.50–1.00] | - | 10.0 [10.0–10.0] | 0 |" \
        in section
    assert "| entmtp | 25.0 [20.0–30.0] | 2.00x [1.00–3.00] | 1.25x [1.00–1.50] | 2.50 [2.00–3.00] |" in section
    assert "| plain-best (plain) | 15.0 [10.0–20.0] | 1.00x [1.00–1.00] |" in section
    assert "| entmtp | mc12 80%, none 20% |" in section
    assert "| ngram |" not in section.split("tree-choice shares")[1]  # shares only for entmtp methods
    assert "| entmtp | mc24 100% |" in md.split("### humaneval, concurrency 4")[1]
    assert "![throughput](throughput.png)" in md
    assert "Incomplete" not in md and "## Errors" not in md
    assert "Prefix cache kept between levels" in md  # hand_runs' configs predate --reset-prefix-cache
    for r in doc["runs"]:
        r["config"] = {"reset_prefix_cache": True}
    md = rep.render_report(doc)
    assert "prefix cache was emptied before every level" in md and "Prefix cache kept" not in md


def test_every_level_empties_the_servers_prefix_cache(checkout):
    s = settings(checkout(), ["--tasks", "gsm8k", "--concurrency", "1,16"])
    assert crun.throughput_config(s, "http://x", "gsm8k", warmup=1).reset_prefix_cache
    assert srv.SERVER_ENV_DEFAULTS["VLLM_SERVER_DEV_MODE"] == "1"  # the endpoint that empties it



def target_runs(entmtp_c1: dict, entmtp_c16: float, mem: dict):
    """One repeat over the four tasks: plain 10 tok/s (c1) and 40 (c16); ngram 12.5, vllm-medusa 14, hydra-tree
    16 (c1); entmtp as given; peak memory per method (MiB) as given."""
    runs = []
    for task in cm.TUNED_TASKS:
        for name, c1, c16 in (("plain", 10.0, 40.0), ("ngram", 12.5, 40.0), ("vllm-medusa", 14.0, 40.0),
                              ("hydra-tree", 16.0, 40.0), ("entmtp", entmtp_c1[task], entmtp_c16)):
            r = run(name, task, 0, [level(1, c1, drafts=None), level(16, c16, drafts=None)])
            r["server_peak_rss_mib"] = mem.get(name)
            runs.append(r)
    return runs


def test_targets_read_against_a_run():
    fast = {"humaneval": 21.0, "gsm8k": 20.0, "sharegpt": 15.0, "creative": 12.0}
    doc = hand_doc(target_runs(fast, 40.0, {"plain": 1000.0, "entmtp": 1100.0}))
    doc["aggregate"] = agg.aggregate(doc["runs"])
    got = {g["target"]: g for g in agg.targets(doc)}
    assert [got[f"entmtp / plain-best, {t}, concurrency 1"]["met"] for t in cm.TUNED_TASKS] == [True, True, True, False]
    assert got["entmtp / plain-best, creative, concurrency 1"]["measured"] == "1.20x"
    ngram = got["entmtp / ngram, best task, concurrency 1"]
    assert ngram["met"] and ngram["measured"].startswith("1.68x (humaneval); ")  # 21 / 12.5
    medusa = got["entmtp / vllm-medusa, best task, concurrency 1"]
    assert medusa["met"] and medusa["measured"].startswith("1.50x (humaneval)")
    hydra = got["entmtp / hydra-tree, mean of the four tasks, concurrency 1"]
    assert hydra["measured"] == f"{(21 + 20 + 15 + 12) / 4 / 16:.2f}x" and hydra["met"] is False
    assert got["entmtp / plain-best, every task, concurrency 16"]["met"] is True  # equal to plain is not below it
    below = got["entmtp / ngram, every task and concurrency"]  # creative c1: 12 < 12.5
    assert below["met"] is False and "creative c1 0.96x" in below["measured"] and "humaneval c16 1.00x" in \
        below["measured"]
    assert got["entmtp / entmtp-heads, every task and concurrency"]["met"] is None  # did not run
    mem = got["entmtp peak server memory / plain's"]
    assert mem["met"] is True and mem["measured"] == "1.100x (1100 / 1000 MiB)"

    slow = dict(fast, gsm8k=9.0)
    doc = hand_doc(target_runs(slow, 39.0, {"plain": 1000.0, "entmtp": 1101.0}))
    doc["aggregate"] = agg.aggregate(doc["runs"])
    got = {g["target"]: g for g in agg.targets(doc)}
    assert got["entmtp / plain-best, gsm8k, concurrency 1"]["met"] is False
    assert got["entmtp / plain-best, every task, concurrency 16"]["met"] is False
    assert got["entmtp peak server memory / plain's"]["met"] is False

    # what the run lacks is not judged: no c16 level, no hydra-tree, no memory readings
    runs = [r for r in target_runs(fast, 40.0, {}) if r["method"] != "hydra-tree"]
    for r in runs:
        r["levels"] = r["levels"][:1]
    doc = hand_doc(runs)
    doc["aggregate"] = agg.aggregate(doc["runs"])
    got = {g["target"]: g for g in agg.targets(doc)}
    assert got["entmtp / hydra-tree, mean of the four tasks, concurrency 1"]["met"] is None
    assert got["entmtp / plain-best, every task, concurrency 16"]["met"] is None
    assert got["entmtp peak server memory / plain's"]["met"] is None
    assert got["entmtp / plain-best, humaneval, concurrency 1"]["met"] is True
    doc["targets"] = agg.targets(doc)
    md = rep.render_report(doc)
    assert "| entmtp / plain-best, humaneval, concurrency 1 | >= 1.60x | 2.10x | yes |" in md
    assert "| entmtp / hydra-tree, mean of the four tasks, concurrency 1 | >= 1.15x | - | - |" in md


def test_per_request_schedule_against_static_trees():
    """The per-request schedule must beat the best static tree on the mixed task by 5 %, at each concurrency > 1."""
    runs = [run("entmtp", "mixed", 0, [level(1, 30.0, drafts=None), level(4, 63.0, drafts=None),
                                       level(16, 100.0, drafts=None)]),
            run("entmtp-heads", "mixed", 0, [level(4, 50.0, drafts=None)]),
            run("static-b0n1", "mixed", 0, [level(1, 40.0, drafts=None), level(4, 60.0, drafts=None),
                                            level(16, 99.0, drafts=None)]),
            run("static-b0n2", "mixed", 0, [level(4, 55.0, drafts=None), level(16, 90.0, drafts=None)])]
    doc = hand_doc(runs)
    doc["aggregate"] = agg.aggregate(doc["runs"])
    got = {g["target"]: g for g in agg.targets(doc)}
    c4 = got["entmtp / the best static tree, mixed, concurrency 4"]
    assert c4["met"] is True and c4["measured"] == "1.05x (static-b0n1); static-b0n1 1.05x, static-b0n2 1.15x"
    c16 = got["entmtp / the best static tree, mixed, concurrency 16"]
    assert c16["met"] is False and c16["measured"].startswith("1.01x (static-b0n1)")
    assert "entmtp / the best static tree, mixed, concurrency 1" not in got  # one request: no batch to mix
    assert got["entmtp-heads / the best static tree, mixed, concurrency 4"]["met"] is False  # 50 / 60


def test_peak_rss_of_processes():
    import os

    mine = srv.peak_rss_mib([os.getpid()])
    assert mine is not None and mine > 10  # this pytest process holds torch
    assert srv.peak_rss_mib([os.getpid(), os.getpid()]) == pytest.approx(2 * mine, rel=0.01)
    assert srv.peak_rss_mib([2 ** 22 + 7]) is None  # no such process

def test_render_report_single_repeat_incomplete_and_errors():
    runs = [r for r in hand_runs() if r["repeat"] == 0]
    runs[0]["levels"][1] = level(4, 30.0, drafts=None, failed=1, errors=["HTTP 500: boom"])
    doc = hand_doc(runs, repeats=1)
    doc["incomplete"] = "the server for method x exited"
    doc["aggregate"] = agg.aggregate(runs)
    md = rep.render_report(doc)
    assert "[" not in md.split("### humaneval, concurrency 1")[1].split("Tree choice")[0].replace("[min", "")
    assert "| entmtp | 30.0 | 3.00x | 1.50x | 2.00 | 5.0 | 0 |" in md
    assert "**Incomplete run:** the server for method x exited" in md
    assert "- plain / humaneval / concurrency 4: HTTP 500: boom" in md
    assert "rotated" not in md


def test_write_outputs(tmp_path):
    doc = hand_doc(hand_runs())
    rep.write_outputs(doc, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["plots"] == ["throughput.png", "mal.png", "tree_choice.png"]
    assert len(saved["aggregate"]) == 8  # 3 methods and plain-best, 2 levels
    for name in saved["plots"]:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "report.md").read_text() == rep.render_report(saved)
    assert (tmp_path / "headline.md").read_text() == rep.render_headline(saved)
    # --render writes the same files again from results.json, running nothing
    (tmp_path / "report.md").unlink()
    (tmp_path / "headline.md").write_text("stale")
    assert cp.main(["--render", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "report.md").read_text() == rep.render_report(saved)
    assert (tmp_path / "headline.md").read_text() == rep.render_headline(saved)
    assert cp.main(["--render", str(tmp_path / "missing.json")]) == 2


def test_results_name_no_machine_paths(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    home = str(Path.home())
    text = f"LD_PRELOAD={tmp_path}/.venv/lib/libgomp.so.1 model={home}/.cache/m other=/opt/x"
    assert srv.portable(text) == "LD_PRELOAD=.venv/lib/libgomp.so.1 model=~/.cache/m other=/opt/x"
    runs = hand_runs()
    runs[0]["server_runtime"] = {"env": {"LD_PRELOAD": [f"{tmp_path}/.venv/lib/libgomp.so.1"]}, "omp_binding": []}
    runs[0]["speculative_config"] = {"method": "medusa", "model": f"{home}/.cache/vllm-entmtp/vllm-medusa/m"}
    doc = hand_doc(runs)
    (tmp_path / "out").mkdir()
    rep.write_outputs(doc, tmp_path / "out")
    for name in ("results.json", "report.md", "headline.md"):
        written = (tmp_path / "out" / name).read_text()
        assert str(tmp_path) not in written and home + "/" not in written
    assert "LD_PRELOAD=.venv/lib/libgomp.so.1" in (tmp_path / "out" / "report.md").read_text()


def test_headline_quotes_the_results():
    fast = {"humaneval": 21.0, "gsm8k": 20.0, "sharegpt": 15.0, "creative": 14.0}
    doc = hand_doc(target_runs(fast, 40.0, {"plain": 1000.0, "entmtp": 1100.0}))
    doc["settings"]["tasks"], doc["settings"]["concurrency"] = list(cm.TUNED_TASKS), [1, 16]
    doc["aggregate"] = agg.aggregate(doc["runs"])
    doc["targets"] = agg.targets(doc)
    md = rep.render_headline(doc)
    assert ("| task | vs plain-best, c1 | vs plain-best, c16 | vs ngram, c1 | vs vllm-medusa, c1 | vs hydra-tree, c1 | "
            "MAL, c1 |") in md
    assert "| humaneval | 2.10x | 1.00x | 1.68x | 1.50x | 1.31x | - |" in md  # 21/10, 40/40, 21/12.5, 21/14, 21/16
    assert "| entmtp peak server memory / plain's | <= 1.10x | 1.100x (1100 / 1000 MiB) | yes |" in md


# ------------------------------------------------------------------------------------------ server wrapper
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEALTH_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a child in the same group
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    print("listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_server_starts_waits_for_health_and_stops_its_group(tmp_path):
    port = free_port()
    script = tmp_path / "srv.py"
    script.write_text(HEALTH_SERVER)
    server = srv.Server([sys.executable, str(script), str(port)], tmp_path / "logs" / "s.log", port, 30, "fake")
    with server:
        assert srv.port_in_use(port)
        pgid = server.proc.pid
        assert len(srv.group_members(pgid)) == 2
        assert server.startup_s is not None
    assert not srv.port_in_use(port)
    assert srv.group_members(pgid) == []  # the child of the group is gone too
    assert "listening" in (tmp_path / "logs" / "s.log").read_text()


def test_sigterm_stops_the_running_server(tmp_path):
    """`kill <compare.py>` stops its server too: the server runs in a session of its own, so only compare's
    SIGTERM handler (KeyboardInterrupt, then the Server's exit) can stop it."""
    import os
    import signal
    import subprocess

    port = free_port()
    (tmp_path / "srv.py").write_text(HEALTH_SERVER)
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(cp.__file__).parent)!r})
        import compare as cp
        from compare_server import Server
        signal.signal(signal.SIGTERM, cp._interrupt)  # what compare.main installs
        try:
            cmd = [sys.executable, {str(tmp_path / "srv.py")!r}, "{port}"]
            with Server(cmd, Path({str(tmp_path / "s.log")!r}), {port}, 30, "fake") as server:
                print(server.proc.pid, flush=True)
                time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    pgid = int(proc.stdout.readline())
    try:
        assert srv.port_in_use(port) and len(srv.group_members(pgid)) == 2
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.stdout.read().strip() == "interrupted"
        assert proc.wait(timeout=90) == 0
        assert srv.group_members(pgid) == [] and not srv.port_in_use(port)
    finally:  # a failed run leaves nothing behind
        proc.kill()
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

def test_server_that_dies_reports_its_log_tail(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; print('ValueError: bad speculative config'); sys.exit(3)"]
    with pytest.raises(tp.BenchmarkError) as e:
        with srv.Server(cmd, tmp_path / "s.log", port, 30, "entmtp"):
            pass
    msg = str(e.value)
    assert msg.startswith("the server for method entmtp exited with code 3 during start-up; log ")
    assert "ValueError: bad speculative config" in msg


def test_server_refuses_a_busy_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(tp.BenchmarkError, match=f"port {port} is already in use"):
            with srv.Server([sys.executable, "-c", "pass"], tmp_path / "s.log", port, 30, "x"):
                pass


def test_servers_run_float32_where_bfloat16_gemms_are_not_native(tmp_path):
    (tmp_path / "avx2").write_text("flags : fpu sse avx2 fma\n")
    (tmp_path / "amx").write_text("flags : fpu avx512f avx512_bf16 amx_bf16\n")
    assert srv.default_dtype(str(tmp_path / "avx2")) == "float32"
    assert srv.default_dtype(str(tmp_path / "amx")) == "auto"
    assert srv.default_dtype(str(tmp_path / "missing")) == "auto"


def test_runtime_of_the_server_processes_is_recorded(tmp_path):
    """The OpenMP binding comes from the engine's start-up log, the environment from the processes themselves."""
    log = tmp_path / "server.log"
    log.write_text("x\n(EngineCore pid=7) INFO 11-30 [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
                   "(EngineCore pid=7) INFO 11-30 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto'\n"
                   "(EngineCore pid=7) INFO 11-30 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n"
                   "(EngineCore pid=7) INFO 11-30 [other.py:1] unrelated\n")
    assert srv.omp_binding(log) == ["VLLM_CPU_OMP_THREADS_BIND='auto'", "local_rank=0, core ids=[0]"]
    assert srv.omp_binding(tmp_path / "missing.log") == []
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "3"}
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"], env=env) for _ in range(2)]
    try:
        time.sleep(0.5)
        assert srv.process_env([p.pid for p in procs]) == {"OMP_NUM_THREADS": ["3"]}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    runs = [{"method": m, "server_runtime": {"env": {"LD_PRELOAD": ["/lib/a.so"]}, "omp_binding": ["core ids=[0]"]}}
            for m in ("plain", "entmtp")]
    assert rep.runtime_lines(runs) == ["- servers: LD_PRELOAD=/lib/a.so; OpenMP binding: core ids=[0]"]


def test_vllm_medusa_gets_heads_converted_for_vllm(monkeypatch, tmp_path):
    import vllm_entmtp.heads.convert as conv
    import vllm_entmtp.models as models

    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    calls = []
    monkeypatch.setattr(conv, "for_vllm_medusa", lambda src, model, dst: calls.append((src, model, dst)) or dst)
    m = cm.Method("vllm-medusa", {"method": "medusa", "model": "/heads/medusa", "num_speculative_tokens": 4})
    out = cp.for_vllm(m, "/model")
    assert out.spec == {"method": "medusa", "model": str(tmp_path / "vllm-medusa" / "medusa"),
                        "num_speculative_tokens": 4}
    assert calls == [(Path("/heads/medusa"), "/model", tmp_path / "vllm-medusa" / "medusa")]
    plain = cm.Method("plain", None)
    assert cp.for_vllm(plain, "/model") is plain
