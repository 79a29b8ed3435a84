"""entmtp's per-tree counters in vLLM's Prometheus ``/metrics``.

The counters live in the drafter (:class:`~vllm_entmtp.stats.TreeStats`), inside the engine-core process, while
``/metrics`` is served by the API-server process from its own registry. So the drafter publishes its counters
after every step to a small JSON file (``<dir>/<pid>.json``, written atomically, with the writer's ancestor
pids) in a folder that the first process to load the plugin creates and hands to its child processes through
``$VLLM_ENTMTP_STATS_DIR``; a collector registered in every process's default Prometheus registry sums, at
scrape time, the files written by its own descendants (the engine core it started, and that engine's worker,
where the drafter runs on CPU), so that several front ends sharing one folder (e.g. test runs) never count
each other's engines.

Families (counters; Prometheus appends ``_total``), label ``tree`` = tree id (a capped tree is ``id@n``, a chain
``chainN``, ``lookup`` a prompt-lookup chain, ``none`` = the request drafted nothing):

========================================  =========================================================================
``vllm:entmtp_tree_chosen``               request-steps for which the tree was chosen (all drafting steps)
``vllm:entmtp_tree_verified``             request-steps verified by entmtp's tree walk (greedy chains are verified
                                          by vLLM and counted in its ``vllm:spec_decode_*`` metrics only)
``vllm:entmtp_tree_nodes_verified``       draft nodes in those trees
``vllm:entmtp_tree_tokens_accepted``      accepted draft tokens in those trees (bonus token excluded)
``vllm:entmtp_source_drafts``             label ``source`` (``heads``, ``lookup``): verified drafts of requests the
                                          scheduler drafts for (every verifier), by where their tokens came from
``vllm:entmtp_source_draft_tokens``       their draft tokens
``vllm:entmtp_source_accepted_tokens``    their accepted draft tokens (bonus token excluded)
``vllm:entmtp_non_first_branch_paths``    accepted paths that left the top-1 chain
``vllm:entmtp_kv_slots_moved``            accepted nodes whose K/V was moved to consecutive cache slots
``vllm:entmtp_mixed_length_steps``        drafting steps whose requests' drafts were not all of one length: the
                                          per-request choice at work inside one batch
``vllm:entmtp_fallbacks``                 label ``stage``: request-steps that went on without speculation after
                                          a fault in the plugin's own work at that stage (drafting, tree
                                          bookkeeping, verification, KV compaction, signals, metrics); the
                                          engine and the rest of the batch go on (``vllm_entmtp/step.py``)
``vllm:entmtp_requests_with_state``       gauge: requests for which the drafter holds per-request state, at its
                                          last step (a finished or aborted request's state is dropped at the
                                          next step; ``benchmarks/soak.py`` checks it after a run)
========================================  =========================================================================

With several API-server processes (``--api-server-count`` > 1, and data parallelism, which starts one per rank)
vLLM serves ``/metrics`` in Prometheus' multiprocess mode (``$PROMETHEUS_MULTIPROC_DIR``), where this collector
is not read: there the drafters also write their counters as multiprocess metrics
(:class:`MultiprocessCounters`), summed over the data-parallel ranks. With tensor parallelism rank 0 alone
publishes (every rank drafts the same).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

STATS_DIR_ENV = "VLLM_ENTMTP_STATS_DIR"
#: Set (by vLLM, with several API servers) where ``/metrics`` is served in Prometheus' multiprocess mode.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_collector = None


def ensure_stats_dir() -> Path:
    """The folder the drafters publish to; created (and removed at exit) by the first process that asks, and
    passed to child processes through ``$VLLM_ENTMTP_STATS_DIR``."""
    path = os.environ.get(STATS_DIR_ENV)
    if path:
        return Path(path)
    path = tempfile.mkdtemp(prefix="vllm-entmtp-stats-")
    os.environ[STATS_DIR_ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return Path(path)


_ancestors: list[int] | None = None


def ancestor_pids() -> list[int]:
    """This process's ancestors (parent first), computed once: the drafter runs in a worker that may be a
    child of the engine core, itself a child of the front end."""
    global _ancestors
    if _ancestors is None:
        try:
            import psutil

            _ancestors = [p.pid for p in psutil.Process().parents()]
        except Exception:  # noqa: BLE001 - no psutil, or /proc unreadable: the parent at least
            _ancestors = [os.getppid()]
    return _ancestors


def publish(stats: dict, directory: str | Path | None = None) -> None:
    """Write this process's counters (``TreeStats.as_dict()``) to ``<dir>/<pid>.json``, atomically, tagged
    with this process's ancestor pids (the front end that reads them is one of them); where
    ``$PROMETHEUS_MULTIPROC_DIR`` is set, also as multiprocess metrics (:class:`MultiprocessCounters`). Best
    effort: a failure to write is swallowed (and logged once for the multiprocess metrics)."""
    directory = Path(directory or os.environ.get(STATS_DIR_ENV) or ensure_stats_dir())
    tmp = directory / f".{os.getpid()}.json.tmp"
    try:
        tmp.write_text(json.dumps({**stats, "ancestor_pids": ancestor_pids()}))
        os.replace(tmp, directory / f"{os.getpid()}.json")
    except OSError:  # the folder went away (server shutting down): metrics are best effort
        pass
    if os.environ.get(MULTIPROC_ENV):  # several API servers read multiprocess files only (MultiprocessCounters)
        try:
            _mirror_multiprocess(stats)
        except Exception as e:  # noqa: BLE001 - metrics are best effort
            global _mirror_failed
            if not _mirror_failed:
                _mirror_failed = True
                logging.getLogger("vllm.entmtp").warning("entmtp metrics: writing multiprocess counters failed: %r", e)


#: How often, at most, :class:`Publisher` writes the drafter's counters while the engine steps (seconds). A write
#: (a snapshot of the counters with their correlations, JSON, a file and a rename) holds the GIL in the worker, whose
#: model runs on one core under ``vllm serve`` on small CPUs: at 0.1 s it took about 0.45 ms of CPU per engine step
#: at one request (py-spy, ``benchmarks/results/step-profile-2026-12-03-served/``). Prometheus scrapes every 15 s by
#: default and vLLM logs its own stats every 10 s, so a second of lag costs nothing.
PUBLISH_INTERVAL_S = 1.0


class Publisher:
    """Publishes a drafter's counters (:func:`publish`) from a background thread, off the engine step's path:
    the step only calls :meth:`mark` (the counters changed); the thread writes them at most every ``interval``
    seconds, so ``/metrics`` lags the engine by at most about that much. :meth:`flush` writes now (tests,
    ``benchmarks/``: read the counters right after a run).

    Writing every step cost 0.7 ms of a 22-36 ms step (JSON of the counters with their correlations, a file
    write and a rename; ``benchmarks/step_profile.py``, 2026-12-01).

    Args:
        snapshot: returns the dict to publish (``TreeStats.as_dict()`` and gauges); called in the thread, while
            the engine may be changing the counters: a snapshot that fails (a dict resized under it) is retried
            at the next tick.
        interval: seconds between writes, at most.
        on_error: called with the exception when publishing fails otherwise (the thread goes on).
    """

    def __init__(self, snapshot, interval: float = PUBLISH_INTERVAL_S, directory: str | Path | None = None,
                 on_error=None):
        import threading

        self._snapshot = snapshot
        self._interval = interval
        self._directory = directory
        self._on_error = on_error
        self._dirty = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="entmtp-metrics", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        """The counters changed (called every step; costs a flag)."""
        self._dirty.set()

    def flush(self) -> bool:
        """Write the counters now; False when the snapshot failed (it is retried by the thread)."""
        with self._lock:
            self._dirty.clear()
            try:
                stats = self._snapshot()
            except RuntimeError:  # a dict changed size while it was read: the next tick publishes
                self._dirty.set()
                return False
            publish(stats, self._directory)
            return True

    def _run(self) -> None:
        import time

        while True:
            self._dirty.wait()
            time.sleep(self._interval)
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - metrics are best effort; never kill the thread
                if self._on_error is not None:
                    self._on_error(e)


SOURCE_KEYS = ("drafts", "drafted", "accepted")
#: Unlabelled counters (and the one gauge) of a published snapshot, summed over the files.
SCALAR_KEYS = ("non_first_branch_paths", "kv_slots_moved", "mixed_length_steps", "requests_with_state")


def _zero_totals() -> dict:
    return {"chosen": {}, "per_tree": {}, "by_source": {}, "fallbacks": {}, **dict.fromkeys(SCALAR_KEYS, 0)}


def _add(total: dict, d: dict) -> dict:
    """Add one published snapshot ``d`` to ``total`` (:func:`_zero_totals`'s shape); returns ``total``."""
    for key in ("chosen", "fallbacks"):
        for label, n in d.get(key, {}).items():
            total[key][label] = total[key].get(label, 0) + n
    for key, zero in (("per_tree", ("steps", "nodes", "accepted")), ("by_source", SOURCE_KEYS)):
        for label, v in d.get(key, {}).items():
            acc = total[key].setdefault(label, dict.fromkeys(zero, 0))
            for k in acc:
                acc[k] += v.get(k, 0)
    for k in SCALAR_KEYS:
        total[k] += d.get(k, 0)
    return total


def read_all(directory: str | Path, parent_pid: int | None = None) -> dict:
    """Sum of the counter files in ``directory`` written by descendants of process ``parent_pid`` (None: all
    files); unreadable files are skipped."""
    total = _zero_totals()
    for f in Path(directory).glob("*.json"):
        try:
            d = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if parent_pid is not None and parent_pid not in d.get("ancestor_pids", ()):
            continue
        _add(total, d)
    return total


def families(t: dict) -> list[tuple[str, str, str, str | None, dict]]:
    """The exported families of totals ``t`` (:func:`read_all`'s shape), as ``(kind, name, help, label name or
    None, {label value (None when unlabelled): value})``, kind ``"counter"`` or ``"gauge"``; counter names
    without the ``_total`` that Prometheus appends."""
    out = [
        ("counter", "vllm:entmtp_tree_chosen", "Request-steps for which entmtp chose this tree ('none': no draft "
         "tokens).", "tree", dict(sorted(t["chosen"].items()))),
    ]
    for key, name, doc in (
            ("steps", "vllm:entmtp_tree_verified", "Request-steps verified as this tree by entmtp's tree walk."),
            ("nodes", "vllm:entmtp_tree_nodes_verified", "Draft nodes verified in this tree."),
            ("accepted", "vllm:entmtp_tree_tokens_accepted", "Accepted draft tokens in this tree (bonus token "
             "excluded).")):
        out.append(("counter", name, doc, "tree", {tree: v[key] for tree, v in sorted(t["per_tree"].items())}))
    for key, name, doc in (
            ("drafts", "drafts", "Verified drafts of scheduled requests from this source (heads, lookup)."),
            ("drafted", "draft_tokens", "Draft tokens of scheduled requests from this source, verified."),
            ("accepted", "accepted_tokens", "Accepted draft tokens from this source (bonus token excluded).")):
        out.append(("counter", f"vllm:entmtp_source_{name}", doc, "source",
                    {source: v[key] for source, v in sorted(t["by_source"].items())}))
    for key, doc in (
            ("non_first_branch_paths", "Accepted tree paths that left the top-1 chain."),
            ("kv_slots_moved", "Accepted nodes whose K/V entmtp moved to consecutive cache slots."),
            ("mixed_length_steps", "Drafting steps whose requests' drafts were not all of one length.")):
        out.append(("counter", f"vllm:entmtp_{key}", doc, None, {None: t[key]}))
    out.append(("counter", "vllm:entmtp_fallbacks", "Request-steps that went on without speculation after a fault "
                "in entmtp's own work at this stage.", "stage", dict(sorted(t["fallbacks"].items()))))
    out.append(("gauge", "vllm:entmtp_requests_with_state", "Requests for which the drafter holds state, at its "
                "last step (it is dropped at the first step after vLLM lets a request go).", None,
                {None: t["requests_with_state"]}))
    return out


class EntMTPCollector:
    """Prometheus collector of the counters published in ``directory`` (``$VLLM_ENTMTP_STATS_DIR``) by the
    descendants of process ``parent_pid`` (None: by any process)."""

    def __init__(self, directory: str | Path, parent_pid: int | None = None):
        self.directory = Path(directory)
        self.parent_pid = parent_pid

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for kind, name, doc, label, values in families(read_all(self.directory, self.parent_pid)):
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            if label is None:
                yield cls(name, doc, value=values[None])
                continue
            fam = cls(name, doc, labels=[label])
            for v, n in values.items():
                fam.add_metric([v], n)
            yield fam


class MultiprocessCounters:
    """One drafter's counters as ``prometheus_client`` multiprocess metrics (files in ``$PROMETHEUS_MULTIPROC_DIR``).

    With several API-server processes (``--api-server-count`` > 1; data parallelism starts one per rank) vLLM
    serves ``/metrics`` from a registry that holds only what processes wrote to that folder (Prometheus'
    multiprocess mode), not the collector of :func:`register_collector`. vLLM sets the folder before it starts
    the engines, so their workers inherit it; there :meth:`update` mirrors each published snapshot into
    counters of the same families (:func:`families`: same names, help and labels), and a scrape sums them over
    processes (every data-parallel rank's drafter). Counters grow by the difference to the last snapshot; the gauge
    is summed over processes (one that exits cleanly removes its own; a killed one's stays until vLLM wipes the
    folder at its next start). A family shows up once it has a sample (a labelled family with none, e.g.
    ``vllm:entmtp_fallbacks`` before any fault, is absent, where the single-server collector lists it empty).
    """

    def __init__(self):
        from prometheus_client import multiprocess, values

        # prometheus_client picks in-memory or multiprocess values once, at its import: a process forked from
        # one that imported it before vLLM set the folder (vLLM's default start method on GPUs) keeps in-memory
        # values, which no scrape reads. Metrics made after this line write the folder's files.
        if not getattr(values.ValueClass, "_multiprocess", False):
            values.ValueClass = values.MultiProcessValue()
        # this process's gauge file goes when it exits (a scrape sums the gauge over live processes)
        atexit.register(multiprocess.mark_process_dead, os.getpid())
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple[str, str | None], float] = {}

    def update(self, stats: dict) -> None:
        from prometheus_client import Counter, Gauge

        for kind, name, doc, label, values in families(_add(_zero_totals(), stats)):
            metric = self._metrics.get(name)
            if metric is None:
                labels = [label] if label else []
                metric = self._metrics[name] = (
                    Counter(name, doc, labels, registry=None) if kind == "counter"
                    else Gauge(name, doc, labels, registry=None, multiprocess_mode="livesum"))
            for v, n in values.items():
                child = metric if label is None else metric.labels(v)
                if kind == "gauge":
                    child.set(n)
                    continue
                delta = n - self._last.get((name, v), 0)
                if delta > 0:
                    child.inc(delta)
                    self._last[(name, v)] = n


_multiproc: MultiprocessCounters | None = None
_mirror_failed = False


def _mirror_multiprocess(stats: dict) -> None:
    global _multiproc
    if _multiproc is None:
        _multiproc = MultiprocessCounters()
    _multiproc.update(stats)


def register_collector() -> None:
    """Create the stats folder (if this is the first process) and add the collector to the default Prometheus
    registry of this process, once."""
    global _collector
    if _collector is not None:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # no prometheus_client: no metrics to export to
        return
    _collector = EntMTPCollector(ensure_stats_dir(), parent_pid=os.getpid())
    REGISTRY.register(_collector)
