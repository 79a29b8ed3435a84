"""The settings of one ``benchmarks/compare.py`` run: the defaults, those of ``--quick``, and the checked values of
the command line's options (:class:`Settings`)."""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import throughput as tp
from compare_methods import TASKS, Method, custom_method, parse_tasks, select_methods
from compare_server import default_dtype
from throughput import BenchmarkError

DEFAULT_PORT = 8123
QUICK = {"methods": "plain,vllm-medusa,entmtp", "tasks": "humaneval,sharegpt", "concurrency": "1",
         "num_requests": 4, "max_tokens": 64, "waves": 1}
DEFAULTS = {"methods": None, "tasks": ",".join(TASKS), "concurrency": "1,4,16", "num_requests": 16,
            "max_tokens": 128, "waves": 1}


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
    paired: bool = False
    fresh_servers: bool = False  # paired: every repeat starts the servers anew
    waves: int = 1  # a level sends at least this many times its concurrency in requests

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
                        ("repeats", args.repeats), ("waves", pick["waves"])):
        if value < 1:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 1 <= args.port <= 65535:
        raise BenchmarkError(f"--port must be 1..65535, got {args.port}")
    paired = bool(getattr(args, "paired", False))
    fresh = bool(getattr(args, "fresh_servers", False))
    if fresh and not paired:
        raise BenchmarkError("--fresh-servers restarts the servers of --paired every repeat; pass --paired too "
                             "(without it every repeat starts its servers anew already)")
    if not args.startup_timeout > 0:
        raise BenchmarkError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as e:
        raise BenchmarkError(f"--serve-args: {e}") from None
    if "--dtype" not in serve_args:  # as `make serve`: float32 where bfloat16 GEMMs are not native
        serve_args = ["--dtype", default_dtype()] + serve_args
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    tasks, skipped, available = parse_tasks(pick["tasks"]), dict(skipped), dict(available)
    added = []
    for text in getattr(args, "add_method", None) or []:  # each name checked against the earlier ones too
        added.append(custom_method(text, available, skipped))
        available[added[-1].name] = added[-1]
    if args.quick and args.methods is None:  # the quick set, less what this checkout cannot run, and those added
        pick["methods"] = ",".join([*(n for n in QUICK["methods"].split(",") if n in available),
                                    *(m.name for m in added)])
    methods = select_methods(pick["methods"], available, skipped)
    if pick["methods"] is not None:  # named explicitly: a method for a task not run is a mistake
        for m in methods:
            if m.only_task is not None and m.only_task not in tasks:
                raise BenchmarkError(f"method {m.name!r} runs task {m.only_task!r} only, which is not in --tasks")
    else:
        for m in methods:
            if m.only_task is not None and m.only_task not in tasks:
                skipped[m.name] = f"runs task {m.only_task!r} only, which is not in --tasks"
        dtype = serve_args[serve_args.index("--dtype") + 1] if "--dtype" in serve_args else None
        for m in methods:  # plain in the run's own dtype is `plain` already
            if m.spec is None and m.dtype is not None and m.dtype == dtype:
                skipped[m.name] = f"the run's dtype is {dtype}: the same as plain"
        methods = [m for m in methods if m.name not in skipped]
    if paired and args.port + len(methods) - 1 > 65535:
        raise BenchmarkError(f"--paired serves {len(methods)} methods on ports {args.port}.."
                             f"{args.port + len(methods) - 1}: past 65535; pass a lower --port")
    return Settings(
        methods=methods, skipped=skipped, tasks=tasks, concurrency=tp.parse_concurrency(pick["concurrency"]),
        num_requests=pick["num_requests"], max_tokens=pick["max_tokens"], repeats=args.repeats,
        ignore_eos=args.ignore_eos, port=args.port, out=Path(args.out or f"runs/compare-{stamp}"),
        quick=args.quick, enforce_eager=args.enforce_eager, serve_args=serve_args,
        startup_timeout=args.startup_timeout, paired=paired, fresh_servers=fresh, waves=pick["waves"])
