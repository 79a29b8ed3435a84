"""Running the methods: one at a time (:func:`run_method`: serve it, run the load generator of
``benchmarks/throughput.py`` in-process for every task and concurrency level, write one raw record per task, stop
the server), or side by side (:func:`run_paired`: every method's server started once, the methods taking turns
level by level); and the machine the run is on."""
from __future__ import annotations

import asyncio
import json
import platform
import time
from contextlib import ExitStack
from pathlib import Path

import throughput as tp
from compare_methods import SERVED_MODEL_NAME, Method, interleaved_order
from compare_server import Server, portable, serve_command
from compare_settings import Settings

#: A paired level during which the client stood still (``throughput.StallWatch``) is measured again, this many
#: times at most.
MAX_STALL_RETRIES = 2


def prompts_needed(s: Settings) -> int:
    """Prompts a task loads: ``num_requests``, or ``waves`` times the highest concurrency if more (every level
    runs full ``waves`` times over, each request a different prompt)."""
    return max(tp.level_requests(s.num_requests, s.waves, c) for c in s.concurrency)


def throughput_config(s: Settings, base_url: str, task: str, warmup: int,
                      concurrency: list[int] | None = None) -> tp.Config:
    """The load generator's settings for ``task`` on the server at ``base_url``: every level of ``s`` or those of
    ``concurrency``; the server's prefix cache emptied before every level (every level and repeat sends the same
    prompts to a server: kept, a later one found them cached and computed only their last block)."""
    argv = ["--base-url", base_url, "--model", SERVED_MODEL_NAME, "--dataset", task, "--num-prompts",
            str(prompts_needed(s)), "--num-requests", str(s.num_requests), "--fill-levels", str(s.waves),
            "--concurrency", ",".join(map(str, concurrency or s.concurrency)), "--max-tokens", str(s.max_tokens),
            "--temperature", "0", "--seed", "0", "--warmup-requests", str(warmup), "--reset-prefix-cache"]
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
            prompts = tp.load_benchmark_prompts(task, prompts_needed(s))
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


def paired_schedule(methods: list[Method], tasks: list[str], concurrency: list[int], repeats: int
                    ) -> list[tuple[int, str, int, int, Method]]:
    """The run order of :func:`run_paired`: ``(repeat, task, concurrency, position, method)``. In every repeat each
    method runs each level of each task (of those it runs: ``only_task``) once, the methods one after the other;
    their order is rotated from one level to the next and from one repeat to the next, so that over as many
    repeats as methods each method takes every position once at every level (a drift of the machine's speed
    then falls on every method alike)."""
    out = []
    for repeat in range(repeats):
        for ti, task in enumerate(tasks):
            ms = [m for m in methods if m.only_task in (None, task)]
            for li, c in enumerate(concurrency):
                out += [(repeat, task, c, pos, m) for pos, m in enumerate(interleaved_order(ms, repeat + ti + li))]
    return out


def run_paired(s: Settings, model: str, vllm: str, runs: list[dict]) -> None:
    """Serves every method at once (ports ``s.port``, ``s.port + 1``, ...; a server waits idle while another is
    measured), runs :func:`paired_schedule` level by level, stops the servers; appends to ``runs`` one run record per
    method, task and repeat as :func:`run_method` writes them (each as soon as its first level ran, so that an
    interrupted run keeps what it measured). With ``s.fresh_servers`` every repeat starts the servers anew (and
    stops them after it). A level during which the client stood still for over ``throughput.STALL_LIMIT_S`` (the
    machine paused) is measured again, up to :data:`MAX_STALL_RETRIES` times; the level keeps the discarded runs'
    stalls as ``stalled_runs_s``.

    A method's level then runs seconds, not minutes, after the other methods' run of it, where one server per
    method at a time puts minutes of start-up between them: on a shared 2-core machine the speed drifts by up to
    20 % over such spans (``benchmarks/results/compare-2026-12-02j/``). Fresh servers every repeat: two processes
    of the same server differ in speed by up to 15 % for as long as they run (``benchmarks/results/
    instance-spread-2026-12-03/``), which one server per method puts on the method."""
    records: dict[tuple[int, str, str], dict] = {}
    prompts: dict[str, list] = {}
    schedule = paired_schedule(s.methods, s.tasks, s.concurrency, s.repeats)
    groups = [[e for e in schedule if e[0] == r] for r in range(s.repeats)] if s.fresh_servers else [schedule]
    for group in groups:
        with ExitStack() as stack:
            servers, warmed = {}, set()
            tag = f"r{group[0][0]}-" if s.fresh_servers and group else ""
            for i, m in enumerate(s.methods):
                cmd = serve_command(vllm, model, m, s.port + i, s.enforce_eager, s.serve_args)
                log = s.out / "servers" / f"paired-{tag}{m.name}.log"
                print(f"[compare] starting {m.name} on port {s.port + i} (log {log})", flush=True)
                servers[m.name] = stack.enter_context(Server(cmd, log, s.port + i, s.startup_timeout, m.name))
                print(f"[compare]   {m.name} ready after {servers[m.name].startup_s:.0f} s", flush=True)
            runtimes = {name: server.runtime() for name, server in servers.items()}
            for repeat, task, c, position, m in group:
                server = servers[m.name]
                cfg = throughput_config(s, server.base_url, task, warmup=0 if m.name in warmed else 1,
                                        concurrency=[c])
                warmed.add(m.name)
                if task not in prompts:
                    prompts[task] = tp.load_benchmark_prompts(task, prompts_needed(s))
                t0 = time.monotonic()
                result = asyncio.run(tp.run_benchmark(cfg, prompts[task]))
                stalls = []
                while tp.stalled(result["levels"][0]) and len(stalls) < MAX_STALL_RETRIES:
                    stalls.append(result["levels"][0]["client_stall_s"])
                    print(f"[compare]   repeat {repeat + 1}/{s.repeats}, {task}, c{c}: {m.name}: the client stood "
                          f"still for {stalls[-1]:.1f} s (the machine paused?): measuring the level again", flush=True)
                    result = asyncio.run(tp.run_benchmark(cfg, prompts[task]))
                if stalls:
                    result["levels"][0]["stalled_runs_s"] = stalls
                rec = records.get((repeat, m.name, task))
                if rec is None:
                    rec = records[repeat, m.name, task] = {
                        "method": m.name, "speculative_config": m.spec, "task": task, "repeat": repeat,
                        "position": position, "server_startup_s": server.startup_s, "server_log": str(server.log),
                        "server_runtime": runtimes[m.name], "wall_s": 0.0, "paired": True, "positions": {},
                        "levels": []}
                    runs.append(rec)
                rec["wall_s"] += time.monotonic() - t0
                rec["positions"][str(c)] = position
                rec["server_peak_rss_mib"] = server.peak_rss_mib()
                for k, v in result.items():  # the first level's config, machine and date, as run_method's records
                    if k != "levels":
                        rec.setdefault(k, v)
                rec["levels"] += result["levels"]
                raw = s.out / "raw" / f"r{repeat}-{m.name}-{task}.json"
                raw.parent.mkdir(parents=True, exist_ok=True)
                raw.write_text(portable(json.dumps(rec, indent=2)) + "\n")
                lv = result["levels"][0]
                print(f"[compare]   repeat {repeat + 1}/{s.repeats}, {task}, c{c}: {m.name} "
                      f"{tp._fmt(lv['output_throughput'], '.1f')} tok/s", flush=True)


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
