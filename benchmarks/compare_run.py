"""Running one method: serve it, run the load generator of ``benchmarks/throughput.py`` in-process for every task
and concurrency level, write one raw record per task, stop the server; and the machine the run is on."""
from __future__ import annotations

import asyncio
import json
import platform
import time
from pathlib import Path

import throughput as tp
from compare_methods import SERVED_MODEL_NAME, Method
from compare_server import Server, portable, serve_command
from compare_settings import Settings


def prompts_needed(s: Settings) -> int:
    """Prompts a task loads: ``num_requests``, or the highest concurrency if more (every level runs full once,
    each request a different prompt)."""
    return max(s.num_requests, *s.concurrency)


def throughput_config(s: Settings, base_url: str, task: str, warmup: int) -> tp.Config:
    argv = ["--base-url", base_url, "--model", SERVED_MODEL_NAME, "--dataset", task,
            "--num-prompts", str(prompts_needed(s)), "--num-requests", str(s.num_requests), "--fill-levels",
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
