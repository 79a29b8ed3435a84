"""Per-tree counters: published by the drafter's process, summed and exported by a Prometheus collector, and
read back by benchmarks/throughput.py as tree-choice shares."""
import json
import os

from prometheus_client import CollectorRegistry, generate_latest

from conftest import load_benchmark
from vllm_entmtp.metrics import EntMTPCollector, publish, read_all
from vllm_entmtp.stats import TreeStats

def _stats():
    s = TreeStats()
    for tree, nodes, path, ranks in [("mc6", 6, [1, 4], [0, 1, 2, 0, 1, 0]), ("mc6", 6, [2], [0, 1, 2, 0, 1, 0]),
                                     ("chain2", 2, [1, 2], [0, 0])]:
        s.record_choice(tree)
        s.record(tree, nodes, path, ranks)
    s.record_choice(None)
    s.mixed_length_steps = 3
    return s


def test_collector_sums_every_process_file(tmp_path):
    s = _stats()
    publish(s.as_dict(), tmp_path)
    assert (tmp_path / f"{os.getpid()}.json").is_file()
    ppid = os.getppid()
    assert json.loads((tmp_path / f"{os.getpid()}.json").read_text())["ancestor_pids"][0] == ppid
    # a second engine's worker (a grandchild: its parent is the engine core), and another front end's engine
    (tmp_path / "99999.json").write_text(json.dumps({**s.as_dict(), "ancestor_pids": [99990, ppid, 1]}))
    (tmp_path / "99998.json").write_text(json.dumps({**s.as_dict(), "ancestor_pids": [ppid + 1, 1]}))
    (tmp_path / "12345.json").write_text("{half-writ")  # never read: files are replaced atomically
    assert read_all(tmp_path, ppid + 1)["per_tree"]["mc6"]["steps"] == 2
    assert read_all(tmp_path)["per_tree"]["mc6"]["steps"] == 6
    total = read_all(tmp_path, ppid)
    assert total["per_tree"]["mc6"] == {"steps": 4, "nodes": 24, "accepted": 6}
    assert total["chosen"] == {"mc6": 4, "chain2": 2, "none": 2}
    assert total["non_first_branch_paths"] == 2 * 1 and total["kv_slots_moved"] == 2 * 2
    assert total["mixed_length_steps"] == 2 * 3

    registry = CollectorRegistry()
    registry.register(EntMTPCollector(tmp_path, parent_pid=ppid))
    text = generate_latest(registry).decode()
    assert 'vllm:entmtp_tree_tokens_accepted_total{tree="mc6"} 6.0' in text
    assert 'vllm:entmtp_tree_chosen_total{tree="none"} 2.0' in text
    assert "vllm:entmtp_mixed_length_steps_total 6.0" in text


def test_throughput_benchmark_reads_the_choice_shares(tmp_path):
    tp = load_benchmark("throughput")
    registry = CollectorRegistry()
    registry.register(EntMTPCollector(tmp_path))
    publish(TreeStats().as_dict(), tmp_path)
    before = tp.parse_metrics(generate_latest(registry).decode())
    publish(_stats().as_dict(), tmp_path)
    after = tp.parse_metrics(generate_latest(registry).decode())
    delta = tp.tree_choice_delta(before, after)
    assert delta["vllm:entmtp_tree_chosen_total"] == {'{tree="chain2"}': 1, '{tree="mc6"}': 2, '{tree="none"}': 1}
    assert delta["vllm:entmtp_tree_tokens_accepted_total"] == {'{tree="chain2"}': 2, '{tree="mc6"}': 3}
    assert tp.tree_choice_shares(delta) == {"chain2": 0.25, "mc6": 0.5, "none": 0.25}


_PUBLISH_SNAPSHOTS = """
import json, os, sys
snapshots, json_dir, mp_dir, late = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "late"
if late:  # prometheus_client imported before the folder is set: a process forked from vLLM's front end on GPUs
    import prometheus_client
os.environ["PROMETHEUS_MULTIPROC_DIR"] = mp_dir
from vllm_entmtp.metrics import publish
for snapshot in snapshots:
    publish(snapshot, json_dir)
print("published", flush=True)
sys.stdin.readline()  # live until the test has scraped
"""


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text)
            if fam.name.startswith("vllm:entmtp_") for s in fam.samples if not s.name.endswith("_created")}


def test_several_api_servers_read_the_counters_as_multiprocess_metrics(tmp_path):
    """With $PROMETHEUS_MULTIPROC_DIR (vLLM with several API servers, e.g. data parallel) each drafter process
    also writes its counters as prometheus_client multiprocess metrics, also where prometheus_client was imported
    before the folder was set; a scrape of that folder (what vLLM then serves) gives the same samples as the
    single-server collector over the same processes' files: counters summed over the two processes (two
    data-parallel ranks), each grown by the last of its snapshots, the gauge summed over live processes."""
    import subprocess
    import sys

    from prometheus_client import multiprocess

    mp_dir, json_dir = tmp_path / "prom", tmp_path / "json"
    mp_dir.mkdir()
    json_dir.mkdir()
    s = _stats()
    s.record_fallback("draft")
    early = TreeStats()
    early.record_choice("mc6")
    runs = [([early.as_dict(), s.as_dict() | {"requests_with_state": 1}], "early"),
            ([s.as_dict() | {"requests_with_state": 3}], "late")]
    procs = [subprocess.Popen([sys.executable, "-c", _PUBLISH_SNAPSHOTS, json.dumps(snaps), str(json_dir),
                               str(mp_dir), when], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"})
             for snaps, when in runs]

    def scrape() -> dict:
        served = CollectorRegistry()  # what vLLM serves with several API servers (get_prometheus_registry)
        multiprocess.MultiProcessCollector(served, path=str(mp_dir))
        return _samples(generate_latest(served).decode())

    try:
        assert [p.stdout.readline().strip() for p in procs] == ["published", "published"]
        got = scrape()
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    assert [p.returncode for p in procs] == [0, 0]
    single = CollectorRegistry()
    single.register(EntMTPCollector(json_dir))
    assert got == _samples(generate_latest(single).decode())
    assert got[("vllm:entmtp_tree_chosen_total", (("tree", "mc6"),))] == 4  # 2 + 2, the early snapshot not added
    assert got[("vllm:entmtp_mixed_length_steps_total", ())] == 6
    assert got[("vllm:entmtp_requests_with_state", ())] == 4
    after = scrape()  # both exited: their counters stay, their gauges are gone
    assert after[("vllm:entmtp_tree_chosen_total", (("tree", "mc6"),))] == 4
    assert after.get(("vllm:entmtp_requests_with_state", ()), 0) == 0
