"""Side-by-side comparison of speculative-decoding methods on four tasks, one vLLM server per method.

    python benchmarks/compare.py --quick
    python benchmarks/compare.py --methods plain,ngram,entmtp --tasks humaneval,gsm8k --concurrency 1,4,16 \\
        --num-requests 16 --max-tokens 128 --repeats 3 --out runs/compare-full

For each method (a ``--speculative-config``, or none) the script starts ``vllm serve`` on the default target model
(SmolLM2-135M-Instruct, as ``make serve`` does), waits for ``/health``, runs the load generator of
``benchmarks/throughput.py`` in-process for every task and concurrency level, and stops the server (its whole
process group) before the next method starts. Servers run `--dtype float32` on CPUs without AVX-512 BF16, as
`make serve` does (`--serve-args "--dtype bfloat16"` overrides). The methods:

* ``plain``: no speculation;
* ``ngram``: vLLM's prompt-lookup drafting (4 tokens, n-grams of 2..4);
* ``vllm-medusa``: vLLM's own Medusa (a chain of 4) with the shipped Medusa heads, converted for it (vLLM does
  not share the target's lm_head with Medusa heads: a copy goes into the checkpoint,
  :func:`vllm_entmtp.heads.convert.for_vllm_medusa`, in ``$VLLM_ENTMTP_CACHE/vllm-medusa``);
* ``medusa-tree`` / ``hydra-tree``: entmtp with the shipped Medusa / Hydra heads and the static tree ``mc12`` of
  the tree set ``ladder``;
* ``entmtp``: ``{"method": "entmtp"}``, the plugin's defaults;
* ``entmtp-<task>``: entmtp with the tree set named after a task (``trees/<task>.json``), scheduled by the signal
  of its schedule, run on that task only.

A method whose heads or tree set is not shipped is skipped with a note (naming it in ``--methods`` is an error).

Output (``--out``, default ``runs/compare-<timestamp>``): ``raw/`` (one JSON per method, task and repeat: the
throughput result document), ``servers/`` (the server logs), ``results.json`` (settings, machine, every run and
the aggregates), ``report.md`` (tables per task and concurrency) and the plots ``throughput.png``, ``mal.png``,
``tree_choice.png``.

Speed depends on the machine and on whatever else runs on it, so the report gives ratios between methods measured
within this one run; with ``--repeats N`` the order of the methods is rotated every repeat and each figure is the
mean over the repeats, with its range.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402  (a sibling script, not a package)

BenchmarkError = tp.BenchmarkError

TASKS = ("humaneval", "gsm8k", "sharegpt", "creative")
BASELINES = ("ngram", "vllm-medusa", "medusa-tree", "hydra-tree")  # each gets a "vs" column when it ran
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PORT = 8123
HOST = "127.0.0.1"
MEM_UTIL = "0.5"  # Makefile: vLLM's CPU start-up check of free memory fails at its default 0.92
SERVER_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}  # as `make serve`
STATIC_TREE = {"tree_set": "ladder", "tree_id": "mc12"}
LOG_TAIL_LINES = 40

QUICK = {"methods": "plain,vllm-medusa,entmtp", "tasks": "humaneval,sharegpt", "concurrency": "1",
         "num_requests": 4, "max_tokens": 64}
DEFAULTS = {"methods": None, "tasks": ",".join(TASKS), "concurrency": "1,4,16", "num_requests": 16,
            "max_tokens": 128}


# ------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Method:
    name: str
    spec: dict | None  # --speculative-config; None: no speculation
    note: str = ""
    only_task: str | None = None  # runs this task only (a tree set tuned to it); None: every task



def is_entmtp(spec: dict | None) -> bool:
    return bool(spec) and spec.get("method") == "entmtp"


def method_order(tasks=TASKS) -> list[str]:
    return ["plain", "ngram", "vllm-medusa", "medusa-tree", "hydra-tree", "entmtp",
            *(f"entmtp-{t}" for t in tasks)]


def method_table(heads: dict, tree_sets: dict, preferred_kinds=("hydra", "medusa")
                 ) -> tuple[dict[str, Method], dict[str, str]]:
    """``(available, skipped)``: the methods that can run, in report order, and ``{name: why not}``.

    ``heads``: shipped heads ``{kind: dir}`` (:func:`vllm_entmtp.models.default_heads`); ``tree_sets``: ``{name:
    file}`` (:func:`vllm_entmtp.trees.available_tree_sets`); ``preferred_kinds``: which heads ``{"method":
    "entmtp"}`` takes (:data:`vllm_entmtp.models.PREFERRED_KINDS`).
    """
    available: dict[str, Method] = {}
    skipped: dict[str, str] = {}

    def add(name: str, spec: dict | None, note: str = "", missing: str | None = None,
            only_task: str | None = None) -> None:
        if missing:
            skipped[name] = missing
        else:
            available[name] = Method(name, spec, note, only_task)

    def no_heads(kind: str) -> str | None:
        return None if kind in heads else f"no {kind.capitalize()} heads are shipped for {SERVED_MODEL_NAME}"

    add("plain", None, "no speculation")
    add("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "vLLM's prompt lookup: a chain of 4")
    medusa = str(heads.get("medusa", ""))
    add("vllm-medusa", {"method": "medusa", "model": medusa, "num_speculative_tokens": 4},
        "vLLM's Medusa: a chain of 4", no_heads("medusa"))
    add("medusa-tree", {"method": "entmtp", "model": medusa, **STATIC_TREE},
        "entmtp, Medusa heads, static tree mc12", no_heads("medusa"))
    add("hydra-tree", {"method": "entmtp", "model": str(heads.get("hydra", "")), **STATIC_TREE},
        "entmtp, Hydra heads, static tree mc12", no_heads("hydra"))
    kind = next((k for k in preferred_kinds if k in heads), None)
    add("entmtp", {"method": "entmtp"}, f"entmtp defaults: {kind} heads, trees of the set 'default' scheduled "
        "by its schedule's signal", None if kind else f"no heads are shipped for {SERVED_MODEL_NAME}")
    for task in TASKS:
        missing = (None if task in tree_sets else f"no tree set named {task!r} (trees/{task}.json)") \
            or (None if kind else f"no heads are shipped for {SERVED_MODEL_NAME}")
        add(f"entmtp-{task}", {"method": "entmtp", "tree_set": task},
            f"entmtp, tree set {task}, scheduled by its signal ({task} only)", missing, only_task=task)
    return available, skipped


def shipped_method_table() -> tuple[dict[str, Method], dict[str, str]]:
    """:func:`method_table` of the heads and tree sets this checkout ships."""
    from vllm_entmtp.models import PREFERRED_KINDS, default_heads
    from vllm_entmtp.trees import available_tree_sets

    return method_table(default_heads(), available_tree_sets(), PREFERRED_KINDS)


def select_methods(text: str | None, available: dict[str, Method], skipped: dict[str, str]) -> list[Method]:
    """Methods named in ``text`` (comma-separated, None: all available), in the order given."""
    if text is None:
        return list(available.values())
    names = _split_list(text, "--methods")
    out = []
    for name in names:
        if name in skipped:
            raise BenchmarkError(f"method {name!r} is not available: {skipped[name]}")
        if name not in available:
            raise BenchmarkError(f"unknown method {name!r}; known: {', '.join(method_order())}")
        out.append(available[name])
    return out


def parse_tasks(text: str) -> list[str]:
    tasks = _split_list(text, "--tasks")
    for t in tasks:
        if t not in TASKS:
            raise BenchmarkError(f"unknown task {t!r}; tasks: {', '.join(TASKS)}")
    return tasks


def _split_list(text: str, option: str) -> list[str]:
    """``"a, b,a"`` -> ``["a", "b"]`` (first occurrence kept); an empty list is an error."""
    items = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not items:
        raise BenchmarkError(f"{option} needs at least one name, got {text!r}")
    return items


def interleaved_order(methods: list, repeat: int) -> list:
    """The order of ``methods`` in repeat ``repeat`` (0-based): rotated left by ``repeat``, so that over
    ``len(methods)`` repeats every method runs once in every position."""
    if not methods:
        return []
    k = repeat % len(methods)
    return methods[k:] + methods[:k]


# ------------------------------------------------------------------------------------------ arguments
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods (default: all available; --list shows them)")
    ap.add_argument("--tasks", default=None, help=f"comma-separated prompt sets (default {DEFAULTS['tasks']})")
    ap.add_argument("--concurrency", default=None,
                    help=f"requests in flight, levels such as 1,4,16 (default {DEFAULTS['concurrency']})")
    ap.add_argument("--num-requests", type=int, default=None,
                    help=f"requests per level, each a different prompt (default {DEFAULTS['num_requests']})")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help=f"output tokens per request at most (default {DEFAULTS['max_tokens']})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every method this many times, the methods' order rotated each time (default 1)")
    ap.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens tokens")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"server port (default {DEFAULT_PORT})")
    ap.add_argument("--out", default=None, help="output folder (default runs/compare-<timestamp>)")
    ap.add_argument("--quick", action="store_true",
                    help=f"about ten minutes: methods {QUICK['methods']}, tasks {QUICK['tasks']}, concurrency "
                         f"{QUICK['concurrency']}, {QUICK['num_requests']} requests of {QUICK['max_tokens']} "
                         f"tokens (options given explicitly win)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="pass --enforce-eager to vllm serve (faster start-up, no torch.compile: changes speed)")
    ap.add_argument("--serve-args", default="", help="extra arguments for vllm serve, e.g. \"--max-num-seqs 16\"")
    ap.add_argument("--startup-timeout", type=float, default=900.0,
                    help="seconds to wait for a server's /health (default 900)")
    ap.add_argument("--list", action="store_true", help="print the available and skipped methods, and exit")
    ap.add_argument("--render", default=None, metavar="RESULTS_JSON",
                    help="run nothing: write report.md, headline.md and the plots again from a results.json "
                         "(into its folder)")
    return ap


@dataclass
class Settings:
    methods: list[Method]
    skipped: dict[str, str]  # methods not run by default, and why
    tasks: list[str]
    concurrency: list[int]
    num_requests: int
    max_tokens: int
    repeats: int
    ignore_eos: bool
    port: int
    out: Path
    quick: bool
    enforce_eager: bool
    serve_args: list[str]
    startup_timeout: float

    def as_json(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("methods", "out")}
        out["methods"] = {m.name: {"speculative_config": m.spec, "note": m.note} for m in self.methods}
        out["out"] = str(self.out)
        return out


def make_settings(args: argparse.Namespace, available: dict[str, Method], skipped: dict[str, str],
                  now: datetime | None = None) -> Settings:
    """Checks the arguments (:class:`BenchmarkError` with a one-line message); ``--quick`` fills the options not
    given."""
    base = QUICK if args.quick else DEFAULTS
    pick = {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in DEFAULTS}
    for name, value in (("num_requests", pick["num_requests"]), ("max_tokens", pick["max_tokens"]),
                        ("repeats", args.repeats)):
        if value < 1:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 1 <= args.port <= 65535:
        raise BenchmarkError(f"--port must be 1..65535, got {args.port}")
    if not args.startup_timeout > 0:
        raise BenchmarkError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as e:
        raise BenchmarkError(f"--serve-args: {e}") from None
    if "--dtype" not in serve_args:  # as `make serve`: float32 where bfloat16 GEMMs are not native
        serve_args = ["--dtype", default_dtype()] + serve_args
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    if args.quick and args.methods is None:  # the quick set, less what this checkout cannot run
        pick["methods"] = ",".join(n for n in QUICK["methods"].split(",") if n in available)
    tasks, skipped = parse_tasks(pick["tasks"]), dict(skipped)
    methods = select_methods(pick["methods"], available, skipped)
    if pick["methods"] is not None:  # named explicitly: a method for a task not run is a mistake
        for m in methods:
            if m.only_task is not None and m.only_task not in tasks:
                raise BenchmarkError(f"method {m.name!r} runs task {m.only_task!r} only, which is not in --tasks")
    else:
        for m in methods:
            if m.only_task is not None and m.only_task not in tasks:
                skipped[m.name] = f"runs task {m.only_task!r} only, which is not in --tasks"
        methods = [m for m in methods if m.name not in skipped]
    return Settings(
        methods=methods, skipped=skipped, tasks=tasks, concurrency=tp.parse_concurrency(pick["concurrency"]),
        num_requests=pick["num_requests"], max_tokens=pick["max_tokens"], repeats=args.repeats,
        ignore_eos=args.ignore_eos, port=args.port, out=Path(args.out or f"runs/compare-{stamp}"),
        quick=args.quick, enforce_eager=args.enforce_eager, serve_args=serve_args,
        startup_timeout=args.startup_timeout)


# ------------------------------------------------------------------------------------------ server
def default_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``float32`` on a CPU without AVX-512 BF16 (bfloat16 linear layers run row by row there, so verifying
    draft tokens gets no batching benefit), else ``auto`` -- what ``make serve`` passes."""
    try:
        return "auto" if "avx512_bf16" in Path(cpuinfo).read_text() else "float32"
    except OSError:
        return "auto"


def port_in_use(port: int, host: str = HOST) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def vllm_executable() -> str:
    """``vllm`` beside this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / "vllm"
    found = str(here) if here.is_file() else shutil.which("vllm")
    if not found:
        raise BenchmarkError("no `vllm` command beside this Python or on PATH (run `make setup`)")
    return found


def serve_command(vllm: str, model: str, method: Method, port: int, enforce_eager: bool = False,
                  extra: list[str] = ()) -> list[str]:
    """``vllm serve`` as ``make serve`` starts it, with ``method``'s ``--speculative-config``."""
    cmd = [vllm, "serve", model, "--served-model-name", SERVED_MODEL_NAME, "--host", HOST, "--port", str(port),
           "--gpu-memory-utilization", MEM_UTIL]
    if method.spec is not None:
        cmd += ["--speculative-config", json.dumps(method.spec)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(extra)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in text[-lines:])


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``, from ``/proc``."""
    pids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat_file.parent.name))
    return pids


def portable(text: str) -> str:
    """``text`` with this checkout's folder (the working folder) left out of paths and the home folder written
    ``~``: results that get committed or shared do not name this machine's layout."""
    return text.replace(str(Path.cwd()) + os.sep, "").replace(str(Path.home()) + os.sep, "~" + os.sep)


def peak_rss_mib(pids: list[int]) -> float | None:
    """Sum over ``pids`` of each process's peak resident set (``VmHWM`` in ``/proc/<pid>/status``), MiB; None when
    none can be read. The processes may peak at different times, so this bounds the group's peak from above."""
    total, seen = 0, False
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])  # kB
                    seen = True
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024 if seen else None


#: Environment variables of the server's processes that decide how the CPU runs the model, recorded per run.
RUNTIME_ENV = ("LD_PRELOAD", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
               "VLLM_CPU_KVCACHE_SPACE")


def process_env(pids: list[int], keys=RUNTIME_ENV) -> dict[str, list[str]]:
    """``{key: sorted distinct values}`` of the environment variables ``keys`` over processes ``pids`` (from
    ``/proc/<pid>/environ``; vLLM-CPU sets ``LD_PRELOAD`` in its own processes, so the server's children are
    where it shows). Unreadable processes are skipped."""
    seen: dict[str, set[str]] = {}
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        for item in raw.split(b"\0"):
            k, sep, v = item.decode(errors="replace").partition("=")
            if sep and k in keys:
                seen.setdefault(k, set()).add(v)
    return {k: sorted(v) for k, v in sorted(seen.items())}


def omp_binding(log: Path) -> list[str]:
    """The "OpenMP thread binding info" block vLLM-CPU's engine logs at start-up (which cores its worker's
    OpenMP threads are bound to), one string per line, without the log prefixes; [] when absent."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out: list[str] = []
    for i, line in enumerate(lines):
        if "OpenMP thread binding info" in line:
            prefix = line.split("OpenMP thread binding info")[0]
            for nxt in lines[i + 1:]:
                if not nxt.startswith(prefix):
                    break
                out.append(nxt[len(prefix):].strip())
            break
    return out


class Server:
    """One ``vllm serve`` in a process group of its own; ``with Server(...) as s:`` starts it, waits for
    ``/health`` and always stops it (the whole group) and waits for the port to be free again."""

    def __init__(self, cmd: list[str], log: Path, port: int, startup_timeout: float, name: str):
        self.cmd, self.log, self.port, self.timeout, self.name = cmd, log, port, startup_timeout, name
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> Server:
        if port_in_use(self.port):
            raise BenchmarkError(f"port {self.port} is already in use; stop what listens there or pass --port")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for k, v in SERVER_ENV_DEFAULTS.items():
            env.setdefault(k, v)
        env.pop("VLLM_ENTMTP_STATS_DIR", None)  # each server publishes its tree counters to a folder of its own
        t0 = time.monotonic()
        with open(self.log, "w") as logf:
            logf.write("$ " + shlex.join(self.cmd) + "\n")
            logf.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self, t0: float) -> None:
        while True:
            code = self.proc.poll()
            if code is not None:
                raise BenchmarkError(f"the server for method {self.name} exited with code {code} during start-up; "
                                     f"log {self.log}, last lines:\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > self.timeout:
                raise BenchmarkError(f"the server for method {self.name} was not healthy after {self.timeout:.0f} s "
                                     f"(--startup-timeout); log {self.log}, last lines:\n{log_tail(self.log)}")
            time.sleep(2)

    def runtime(self) -> dict:
        """How this server's processes run the model on the CPU: ``{"env": process_env(...), "omp_binding":
        [...]}``."""
        return {"env": process_env(group_members(self.proc.pid)), "omp_binding": omp_binding(self.log)}

    def peak_rss_mib(self) -> float | None:
        """Peak resident memory of the server so far (API server, engine core, workers: its process group), MiB;
        :func:`peak_rss_mib`."""
        return peak_rss_mib(group_members(self.proc.pid))

    def _wait_group(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for every live (not zombie) process of the server's group to exit."""
        deadline = time.monotonic() + timeout
        while group_members(self.proc.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the server's pid
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 60.0, port_wait_s: float = 60.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)  # vLLM shuts its engine core down on SIGTERM
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        if not self._wait_group(10.0):
            self._signal(signal.SIGKILL)  # stragglers of the group (engine core, workers), or a hung server
            self._wait_group(10.0)
        self.proc.wait()
        try:  # the log names this machine's folders on almost every line
            self.log.write_text(portable(self.log.read_text(errors="replace")))
        except OSError:
            pass
        deadline = time.monotonic() + port_wait_s
        while port_in_use(self.port):
            if time.monotonic() > deadline:
                raise BenchmarkError(f"port {self.port} still in use {port_wait_s:.0f} s after stopping the server "
                                     f"for method {self.name}")
            time.sleep(1)
        self.proc = None


# ------------------------------------------------------------------------------------------ running
def throughput_config(s: Settings, base_url: str, task: str, warmup: int) -> tp.Config:
    argv = ["--base-url", base_url, "--model", SERVED_MODEL_NAME, "--dataset", task,
            "--num-prompts", str(s.num_requests), "--num-requests", str(s.num_requests),
            "--concurrency", ",".join(map(str, s.concurrency)), "--max-tokens", str(s.max_tokens),
            "--temperature", "0", "--seed", "0", "--warmup-requests", str(warmup)]
    if s.ignore_eos:
        argv.append("--ignore-eos")
    return tp.make_config(tp.build_parser().parse_args(argv))


def run_method(s: Settings, method: Method, model: str, vllm: str, repeat: int, position: int) -> list[dict]:
    """Serves ``method``, runs every task on it, stops the server; one run record per task."""
    cmd = serve_command(vllm, model, method, s.port, s.enforce_eager, s.serve_args)
    log = s.out / "servers" / f"r{repeat}-{method.name}.log"
    print(f"[compare] repeat {repeat + 1}/{s.repeats}: starting {method.name} (log {log})", flush=True)
    records = []
    with Server(cmd, log, s.port, s.startup_timeout, method.name) as server:
        print(f"[compare]   {method.name} ready after {server.startup_s:.0f} s", flush=True)
        runtime = server.runtime()
        tasks = [t for t in s.tasks if method.only_task in (None, t)]
        for i, task in enumerate(tasks):
            cfg = throughput_config(s, server.base_url, task, warmup=1 if i == 0 else 0)
            prompts = tp.load_benchmark_prompts(task, s.num_requests)
            t0 = time.monotonic()
            result = asyncio.run(tp.run_benchmark(cfg, prompts))
            rec = {"method": method.name, "speculative_config": method.spec, "task": task, "repeat": repeat,
                   "position": position, "server_startup_s": server.startup_s, "server_log": str(log),
                   "server_runtime": runtime, "server_peak_rss_mib": server.peak_rss_mib(),
                   "wall_s": time.monotonic() - t0, **result}
            raw = s.out / "raw" / f"r{repeat}-{method.name}-{task}.json"
            raw.parent.mkdir(parents=True, exist_ok=True)
            raw.write_text(portable(json.dumps(rec, indent=2)) + "\n")
            records.append(rec)
            print(f"[compare]   {method.name} / {task}: " + ", ".join(
                f"c{lv['concurrency']} {tp._fmt(lv['output_throughput'], '.1f')} tok/s" for lv in rec["levels"]),
                flush=True)
    return records


def machine_description() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return tp.machine_info() | {"cpu_model": model}


# ------------------------------------------------------------------------------------------ aggregation
def stat(values: list[float]) -> dict | None:
    """``{"mean", "min", "max", "std", "n"}`` of the values that are not None; None when there are none."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    mean = sum(vals) / len(vals)
    return {"mean": mean, "min": min(vals), "max": max(vals),
            "std": math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)), "n": len(vals)}


def merge_tree_choice(tree_choices: list[dict]) -> dict:
    """The ``vllm:entmtp_tree_chosen`` counts of several levels' ``tree_choice``, summed per label set."""
    merged: dict[str, float] = {}
    for tc in tree_choices:
        for labels, n in (tc or {}).get(tp.CHOSEN_FAMILY, {}).items():
            merged[labels] = merged.get(labels, 0) + n
    return {tp.CHOSEN_FAMILY: merged}


def pooled_mal(levels: list[dict]) -> float | None:
    """1 + accepted / drafts over several levels' ``spec_decode`` counters (None without drafts)."""
    drafts = accepted = 0
    for lv in levels:
        sd = lv.get("spec_decode") or {}
        drafts += sd.get("num_drafts") or 0
        accepted += sd.get("num_accepted_tokens") or 0
    return 1 + accepted / drafts if drafts else None


def _levels_by_key(runs: list[dict]) -> dict[tuple, dict[int, dict]]:
    """``{(method, task, concurrency): {repeat: level}}``."""
    out: dict[tuple, dict[int, dict]] = {}
    for run in runs:
        for lv in run["levels"]:
            out.setdefault((run["method"], run["task"], lv["concurrency"]), {})[run["repeat"]] = lv
    return out


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (method, task, concurrency), all from ``runs`` (one compare run): statistics over the repeats
    of output tokens/s, median TPOT/TTFT and MAL (incl. bonus); ratios of output tokens/s vs ``plain`` and each
    baseline that ran, taken per repeat (same repeat, so measured side by side) and then averaged; tree-choice
    shares of the counts pooled over the repeats."""
    by_key = _levels_by_key(runs)
    rows = []
    for (method, task, conc), reps in by_key.items():
        def metric(name, reps=reps):
            return stat([lv.get(name) for lv in reps.values()])

        ratios = {}
        for base in ("plain", *BASELINES):
            base_reps = by_key.get((base, task, conc), {})
            ratios[base] = stat([lv["output_throughput"] / base_reps[r]["output_throughput"]
                                 for r, lv in reps.items()
                                 if r in base_reps and lv.get("output_throughput") is not None
                                 and base_reps[r].get("output_throughput")])
        rows.append({
            "method": method, "task": task, "concurrency": conc, "repeats": sorted(reps),
            "completed": sum(lv.get("completed", 0) for lv in reps.values()),
            "failed": sum(lv.get("failed", 0) for lv in reps.values()),
            "output_throughput": metric("output_throughput"), "median_tpot_ms": metric("median_tpot_ms"),
            "median_ttft_ms": metric("median_ttft_ms"),
            "mal": stat([(lv.get("spec_decode") or {}).get("mean_acceptance_length_incl_bonus")
                         for lv in reps.values()]),
            "ratios": {k: v for k, v in ratios.items() if v is not None},
            "tree_choice_shares": tp.tree_choice_shares(merge_tree_choice([lv.get("tree_choice")
                                                                           for lv in reps.values()])),
        })
    return rows


#: The project's targets for ``{"method": "entmtp"}`` (the method ``entmtp``), read against a run as it came out
#: (never tuned for): output tokens/s over plain decoding at concurrency 1, per task.
SPEEDUP_TARGETS = {"humaneval": 1.6, "gsm8k": 1.6, "sharegpt": 1.3, "creative": 1.3}
VS_BASELINE_TARGETS = {"ngram": 1.6, "vllm-medusa": 1.36}  # on at least one task, concurrency 1
VS_HYDRA_TARGET = 1.15  # over hydra-tree, mean of the four tasks' ratios, concurrency 1
LOAD_CONCURRENCY = 16  # never below plain decoding at this concurrency
MEMORY_TARGET = 1.10  # peak server memory over plain's


def peak_memory(runs: list[dict]) -> dict[str, float]:
    """Per method, the largest ``server_peak_rss_mib`` over its runs (MiB); methods without a reading left out."""
    out: dict[str, float] = {}
    for run in runs:
        v = run.get("server_peak_rss_mib")
        if v is not None:
            out[run["method"]] = max(out.get(run["method"], 0.0), float(v))
    return out


def targets(doc: dict, method: str = "entmtp") -> list[dict]:
    """The project's targets read against this run: one ``{"target", "needed", "measured", "met"}`` per target,
    ``met`` None where the run lacks what the target needs (a method, task or concurrency level it did not run)."""
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}

    def ratio(task, conc, base):
        r = rows.get((method, task, conc))
        st = r and r["ratios"].get(base)
        return st["mean"] if st else None

    def verdict(ok, have):
        return bool(ok) if have else None

    out = []
    for task, need in SPEEDUP_TARGETS.items():
        v = ratio(task, 1, "plain")
        out.append({"target": f"{method} / plain, {task}, concurrency 1", "needed": f">= {need:.2f}x",
                    "measured": "-" if v is None else f"{v:.2f}x", "met": verdict(v is not None and v >= need,
                                                                                   v is not None)})
    for base, need in VS_BASELINE_TARGETS.items():
        got = {t: ratio(t, 1, base) for t in SPEEDUP_TARGETS}
        got = {t: v for t, v in got.items() if v is not None}
        best = max(got.items(), key=lambda kv: kv[1]) if got else None
        out.append({"target": f"{method} / {base}, best task, concurrency 1", "needed": f">= {need:.2f}x on one task",
                    "measured": "-" if best is None else f"{best[1]:.2f}x ({best[0]}); "
                    + ", ".join(f"{t} {v:.2f}x" for t, v in got.items()),
                    "met": verdict(best is not None and best[1] >= need, best is not None)})
    got = [ratio(t, 1, "hydra-tree") for t in SPEEDUP_TARGETS]
    have = all(v is not None for v in got)
    mean = sum(got) / len(got) if have else None
    out.append({"target": f"{method} / hydra-tree, mean of the four tasks, concurrency 1",
                "needed": f">= {VS_HYDRA_TARGET:.2f}x", "measured": "-" if mean is None else f"{mean:.2f}x",
                "met": verdict(have and mean >= VS_HYDRA_TARGET, have)})
    got = {t: ratio(t, LOAD_CONCURRENCY, "plain") for t in SPEEDUP_TARGETS}
    have = all(v is not None for v in got.values())
    out.append({"target": f"{method} / plain, every task, concurrency {LOAD_CONCURRENCY}", "needed": ">= 1.00x",
                "measured": "-" if not have else ", ".join(f"{t} {v:.2f}x" for t, v in got.items()),
                "met": verdict(have and min(got.values()) >= 1.0, have)})
    mem = peak_memory(doc["runs"])
    have = method in mem and "plain" in mem
    out.append({"target": f"{method} peak server memory / plain's", "needed": f"<= {MEMORY_TARGET:.2f}x",
                "measured": "-" if not have else f"{mem[method] / mem['plain']:.3f}x ({mem[method]:.0f} / "
                f"{mem['plain']:.0f} MiB)", "met": verdict(have and mem[method] <= MEMORY_TARGET * mem["plain"],
                                                           have)})
    return out


# ------------------------------------------------------------------------------------------ report
def fmt_stat(st: dict | None, spec: str, suffix: str = "") -> str:
    """``mean`` alone for one value, else ``mean [min-max]``; ``-`` for None."""
    if st is None:
        return "-"
    text = format(st["mean"], spec) + suffix
    if st["n"] > 1:
        text += f" [{format(st['min'], spec)}–{format(st['max'], spec)}]"
    return text


def fmt_shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{t} {100 * v:.0f}%" for t, v in sorted(shares.items(), key=lambda kv: -kv[1])) or "-"


def _ordered(names, order: list[str]) -> list[str]:
    known = [n for n in order if n in names]
    return known + sorted(n for n in names if n not in known)


def runtime_lines(runs: list[dict]) -> list[str]:
    """Report lines: the OpenMP binding and ``LD_PRELOAD`` the servers ran with (one line when all agree)."""
    seen: dict[str, list[str]] = {}
    for run in runs:
        rt = run.get("server_runtime")
        if rt is None:
            continue
        env = rt.get("env", {})
        key = (f"LD_PRELOAD={', '.join(env.get('LD_PRELOAD', [])) or '(unset)'}; OpenMP binding: "
               + ("; ".join(rt.get("omp_binding", [])) or "(not logged)"))
        seen.setdefault(key, [])
        if run["method"] not in seen[key]:
            seen[key].append(run["method"])
    if len(seen) == 1:
        return [f"- servers: {next(iter(seen))}"]
    return [f"- servers {', '.join(m)}: {k}" for k, m in seen.items()]


def render_report(doc: dict) -> str:
    """``report.md`` of a results document (``results.json``'s content)."""
    s, m = doc["settings"], doc["machine"]
    methods = list(s["methods"])
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}
    ran = {r["method"] for r in doc["aggregate"]}
    baselines = [b for b in ("plain", *BASELINES) if b in ran]
    multi = s["repeats"] > 1
    out = ["# Speculative decoding: side-by-side comparison", "",
           f"- command: `{doc['command']}`",
           f"- machine: {m.get('cpu_model')}, {m.get('cpu_count')} CPUs ({m.get('usable_cpus')} usable), "
           f"{m.get('platform')}",
           f"- date: {doc['date']} (run {doc['run_id']})",
           *runtime_lines(doc["runs"]),
           f"- target model: {SERVED_MODEL_NAME}; tasks: {', '.join(s['tasks'])}; concurrency: "
           f"{', '.join(map(str, s['concurrency']))}; {s['num_requests']} requests per level of at most "
           f"{s['max_tokens']} tokens, greedy (temperature 0){', ignore_eos' if s['ignore_eos'] else ''}; "
           f"repeats: {s['repeats']}", ""]
    if doc.get("incomplete"):
        out += [f"**Incomplete run:** {doc['incomplete']}", ""]
    out += ["Speed is a ratio measured within one run on one machine: every method was served in turn by this "
            "run, on the same machine, with the same prompts and settings. Compare the methods with each other "
            "(the `vs` columns); never compare these numbers with those of another run or machine."]
    if multi:
        out += ["", f"Methods ran interleaved: their order was rotated every repeat. Each figure is the mean over "
                f"the {s['repeats']} repeats, [min–max] after it; a ratio is taken within each repeat, then "
                f"averaged."]
    if s.get("enforce_eager"):
        out += ["", "The servers ran with `--enforce-eager` (no torch.compile): faster start-up, but every "
                "method's speed differs from a compiled server's."]
    out += ["", "## Methods", "", "| method | --speculative-config | what | server start-up (s) | peak memory (MiB) |",
            "|---|---|---|---|---:|"]
    mem = peak_memory(doc["runs"])
    startup: dict[str, list] = {}
    for run in doc["runs"]:
        startup.setdefault(run["method"], {})[run["repeat"]] = run.get("server_startup_s")
    for name, info in s["methods"].items():
        spec = json.dumps(info["speculative_config"]) if info["speculative_config"] else "(none)"
        up = stat(list(startup.get(name, {}).values()))
        peak = f"{mem[name]:.0f}" if name in mem else "-"
        out.append(f"| {name} | `{spec}` | {info['note']} | {fmt_stat(up, '.0f')} | {peak} |")
    if s["skipped"]:
        out += ["", "Not run:"] + [f"- {k}: {v}" for k, v in s["skipped"].items()]
    out += ["", "Peak memory: the sum of the server processes' peak resident sets (`VmHWM`: API server, engine "
            "core, workers), read after each task; the KV cache is the same size for every method "
            "(`VLLM_CPU_KVCACHE_SPACE`)."]
    goals = doc.get("targets") or []
    if goals:
        out += ["", "## Targets", "", "The project's targets for `{\"method\": \"entmtp\"}` (the method `entmtp`), "
                "read against this run; `-`: the run lacks a method, task or level the target needs.", "",
                "| target | needed | measured | met |", "|---|---|---|---|"]
        out += [f"| {g['target']} | {g['needed']} | {g['measured']} | "
                f"{'-' if g['met'] is None else ('yes' if g['met'] else 'no')} |" for g in goals]
    out += ["", "Columns: output tokens/s over the level; `vs X`: that divided by method X's (same task, "
            "concurrency and repeat); MAL: mean acceptance length including the bonus token (1 + accepted / "
            "drafts; 1.00 = no draft token accepted); TPOT: median time per output token after the first."]
    for task in s["tasks"]:
        out += ["", f"## {task}"]
        for conc in s["concurrency"]:
            present = [n for n in _ordered({k[0] for k in rows if k[1:] == (task, conc)}, methods)]
            if not present:
                continue
            out += ["", f"### {task}, concurrency {conc}", "",
                    "| method | out tok/s | " + " | ".join(f"vs {b}" for b in baselines)
                    + " | MAL | TPOT ms | failed |",
                    "|---|" + "---:|" * (len(baselines) + 4)]
            for name in present:
                r = rows[(name, task, conc)]
                cells = [fmt_stat(r["output_throughput"], ".1f")]
                cells += [fmt_stat(r["ratios"].get(b), ".2f", "x") for b in baselines]
                cells += [fmt_stat(r["mal"], ".2f"), fmt_stat(r["median_tpot_ms"], ".1f"), str(r["failed"])]
                out.append(f"| {name} | " + " | ".join(cells) + " |")
            shares = [(n, rows[(n, task, conc)]["tree_choice_shares"]) for n in present
                      if is_entmtp(s["methods"].get(n, {}).get("speculative_config"))]
            if shares:
                out += ["", "Tree choice (share of drafting request-steps per tree; none = no draft):", "",
                        "| method | tree-choice shares |", "|---|---|"]
                out += [f"| {n} | {fmt_shares(sh)} |" for n, sh in shares]
    plots = doc.get("plots") or []
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    errors = [(r["method"], r["task"], lv["concurrency"], e) for r in doc["runs"] for lv in r["levels"]
              for e in lv.get("errors", [])]
    if errors:
        out += ["", "## Errors", ""] + [f"- {mt} / {t} / concurrency {c}: {e}" for mt, t, c, e in errors]
    return "\n".join(out) + "\n"


def render_headline(doc: dict, method: str = "entmtp") -> str:
    """``headline.md``: ``method``'s speed ratios per task (against plain decoding at each concurrency level, and
    against each baseline at the lowest level), its mean acceptance length, then the targets table; every number
    from ``doc`` (``results.json``), as the README quotes it."""
    s = doc["settings"]
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}
    ran = {r["method"] for r in doc["aggregate"]}
    bases = [b for b in BASELINES if b in ran]
    low = min(s["concurrency"])
    cols = [f"vs plain, c{c}" for c in s["concurrency"]] + [f"vs {b}, c{low}" for b in bases]
    out = [f"`{method}` (`{json.dumps((s['methods'].get(method) or {}).get('speculative_config'))}`), output "
           f"tokens/s as a ratio, measured in one run ({doc['date'][:10]}, {doc['machine'].get('cpu_model')}, "
           f"{doc['machine'].get('usable_cpus')} CPUs; {s['num_requests']} requests of at most {s['max_tokens']} "
           f"tokens per level, greedy); MAL: mean acceptance length at c{low}, bonus token included.", "",
           "| task | " + " | ".join(cols) + f" | MAL, c{low} |", "|---|" + "---:|" * (len(cols) + 1)]
    for task in s["tasks"]:
        cells = []
        for c in s["concurrency"]:
            r = rows.get((method, task, c))
            cells.append(fmt_stat(r and r["ratios"].get("plain"), ".2f", "x"))
        r = rows.get((method, task, low))
        cells += [fmt_stat(r and r["ratios"].get(b), ".2f", "x") for b in bases]
        cells.append(fmt_stat(r and r["mal"], ".2f"))
        out.append(f"| {task} | " + " | ".join(cells) + " |")
    goals = doc.get("targets") or []
    if goals:
        out += ["", "| target | needed | measured | met |", "|---|---|---|---|"]
        out += [f"| {g['target']} | {g['needed']} | {g['measured']} | "
                f"{'-' if g['met'] is None else ('yes' if g['met'] else 'no')} |" for g in goals]
    return "\n".join(out) + "\n"


def make_plots(doc: dict, out_dir: Path) -> list[str]:
    """``throughput.png`` (output tokens/s vs concurrency per task), ``mal.png`` (MAL per task and method) and
    ``tree_choice.png`` (stacked tree-choice shares of the entmtp methods); returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["settings"]
    methods = list(s["methods"])
    rows = {(r["method"], r["task"], r["concurrency"]): r for r in doc["aggregate"]}
    tasks = s["tasks"]
    written = []

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for name in methods:
            pts = [(c, rows[(name, task, c)]["output_throughput"]) for c in s["concurrency"]
                   if (name, task, c) in rows and rows[(name, task, c)]["output_throughput"]]
            if pts:
                ax.errorbar([c for c, _ in pts], [st["mean"] for _, st in pts],
                            yerr=[[st["mean"] - st["min"] for _, st in pts], [st["max"] - st["mean"] for _, st in pts]],
                            marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["concurrency"], [str(c) for c in s["concurrency"]])
        ax.set_title(task)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("output tokens/s (this run only)")
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)
    written.append("throughput.png")

    pooled: dict[tuple, list] = {}
    for run in doc["runs"]:
        pooled.setdefault((run["method"], run["task"]), []).extend(run["levels"])
    mal = {k: pooled_mal(v) for k, v in pooled.items()}
    spec_methods = [n for n in methods if any(mal.get((n, t)) for t in tasks)]
    if spec_methods:
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(tasks) * len(spec_methods) / 2), 4))
        width = 0.8 / len(spec_methods)
        for i, name in enumerate(spec_methods):
            ax.bar([t + i * width for t in range(len(tasks))], [mal.get((name, t)) or 0 for t in tasks], width,
                   label=name)
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("MAL (incl. bonus token)")
        ax.set_title("mean acceptance length, all concurrency levels pooled", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "mal.png", dpi=110)
        plt.close(fig)
        written.append("mal.png")

    bars = []
    for name in methods:
        if not is_entmtp(s["methods"][name]["speculative_config"]):
            continue
        for task in tasks:
            tcs = [lv.get("tree_choice") for run in doc["runs"] if (run["method"], run["task"]) == (name, task)
                   for lv in run["levels"]]
            shares = tp.tree_choice_shares(merge_tree_choice(tcs))
            if shares:
                bars.append((f"{name}\n{task}", shares))
    if bars:
        trees = sorted({t for _, sh in bars for t in sh})
        fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(bars)), 4))
        bottom = [0.0] * len(bars)
        for tree in trees:
            vals = [sh.get(tree, 0.0) for _, sh in bars]
            ax.bar(range(len(bars)), vals, bottom=bottom, label=tree)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
        ax.set_ylabel("share of drafting request-steps")
        ax.set_title("tree choice, all concurrency levels pooled")
        ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
        fig.tight_layout()
        fig.savefig(out_dir / "tree_choice.png", dpi=110)
        plt.close(fig)
        written.append("tree_choice.png")
    return written


def write_outputs(doc: dict, out_dir: Path) -> None:
    doc["aggregate"] = aggregate(doc["runs"])
    doc["targets"] = targets(doc)
    try:
        doc["plots"] = make_plots(doc, out_dir) if doc["runs"] else []
    except Exception as e:  # a plot must not cost the numbers
        doc["plots"] = []
        print(f"[compare] plots failed: {type(e).__name__}: {e}", file=sys.stderr)
    (out_dir / "results.json").write_text(portable(json.dumps(doc, indent=2)) + "\n")
    (out_dir / "report.md").write_text(portable(render_report(doc)))
    (out_dir / "headline.md").write_text(portable(render_headline(doc)))


# ------------------------------------------------------------------------------------------ main
def for_vllm(method: Method, model: str) -> Method:
    """``method`` with its heads converted for vLLM's own ``medusa`` method (which does not share the target's
    lm_head; :func:`vllm_entmtp.heads.convert.for_vllm_medusa`); other methods unchanged.

    Raises:
        BenchmarkError: the heads cannot be converted.
    """
    import dataclasses

    if not method.spec or method.spec.get("method") != "medusa":
        return method
    from vllm_entmtp.errors import HeadsCheckpointError
    from vllm_entmtp.heads.convert import for_vllm_medusa
    from vllm_entmtp.models import cache_dir

    src = Path(method.spec["model"])
    try:
        dst = for_vllm_medusa(src, model, cache_dir() / "vllm-medusa" / src.name)
    except HeadsCheckpointError as e:
        raise BenchmarkError(f"method {method.name}: {e}") from None
    return dataclasses.replace(method, spec={**method.spec, "model": str(dst)})


def print_methods(available: dict[str, Method], skipped: dict[str, str]) -> None:
    for name in method_order():
        if name in available:
            m = available[name]
            print(f"{name:18} {json.dumps(m.spec) if m.spec else '(no speculation)'}")
        elif name in skipped:
            print(f"{name:18} skipped: {skipped[name]}")


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.render:
        path = Path(args.render)
        try:
            doc = json.loads(path.read_text())
            write_outputs(doc, path.parent)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --render {path}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(f"[compare] report: {path.parent / 'report.md'}")
        return 0
    try:
        available, skipped = shipped_method_table()
        if args.list:
            print_methods(available, skipped)
            return 0
        s = make_settings(args, available, skipped)
        s.out.mkdir(parents=True, exist_ok=True)
        from vllm_entmtp.models import prepare_default_model

        model, vllm = str(prepare_default_model()), vllm_executable()
        s.methods = [for_vllm(m, model) for m in s.methods]
    except (BenchmarkError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, why in s.skipped.items():
        print(f"[compare] skipping {name}: {why}", flush=True)
    doc = {"run_id": datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}",
           "command": shlex.join(["python", "benchmarks/compare.py", *argv]), "machine": machine_description(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "settings": s.as_json(), "runs": []}
    code = 0
    # `kill` (SIGTERM) stops the run like Ctrl-C does: the running server is stopped (it runs in a session of
    # its own, so no signal sent to this process reaches it) and the partial results are written
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for repeat in range(s.repeats):
            for position, method in enumerate(interleaved_order(s.methods, repeat)):
                doc["runs"] += run_method(s, method, model, vllm, repeat, position)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        doc["incomplete"] = str(e).splitlines()[0]
        code = 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        doc["incomplete"] = "interrupted"
        code = 130
    write_outputs(doc, s.out)
    print(f"[compare] report: {s.out / 'report.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
