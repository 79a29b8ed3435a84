"""Side-by-side comparison of speculative-decoding methods on four tasks, one vLLM server per method.

    python benchmarks/compare.py --quick
    python benchmarks/compare.py --methods plain,ngram,entmtp --tasks humaneval,gsm8k --concurrency 1,4,16 \\
        --num-requests 16 --max-tokens 128 --repeats 3 --out runs/compare-full
    python benchmarks/compare.py --paired --methods plain,entmtp --tasks sharegpt --concurrency 16,32 --repeats 3

For each method (a ``--speculative-config``, or none) the script starts ``vllm serve`` on the default target model
(SmolLM2-135M-Instruct, as ``make serve`` does), waits for ``/health``, runs the load generator of
``benchmarks/throughput.py`` in-process for every task and concurrency level, and stops the server (its whole
process group) before the next method starts. With ``--paired`` every method's server is started once, on ports
``--port``, ``--port + 1``, ... (memory for all of them at once), and the methods take turns level by level, their
order rotated from one level and repeat to the next: a method's level then runs seconds after the others' run of
it, not minutes (a server's start-up) apart, so that the machine's drift (up to 20 % over minutes on a shared
2-core machine) falls on every method alike; with ``--fresh-servers`` the servers are started anew every repeat,
so that a server process's own speed (two processes of the same server differ by up to 15 % for as long as they run)
falls on every method alike over the repeats too. A paired level during which the load generator itself stood
still for over a second (the whole machine paused: a virtual machine snapshotted stops every process, seen here as
a 27-second gap in one level) is measured again, twice at most (``report.md`` lists such levels). Servers run `--dtype float32` on CPUs without AVX-512 BF16, as
`make serve` does (`--serve-args "--dtype bfloat16"` overrides). The methods:

* ``plain``: no speculation, in the run's dtype; ``plain-float32`` and ``plain-bfloat16``: the same in that dtype
  (whatever ``--serve-args`` says). Every speed ratio and target is taken against ``plain-best``: per task,
  concurrency and repeat the fastest plain method that ran, so that speculation is measured against plain
  decoding in its fastest dtype on this machine;
* ``ngram``: vLLM's prompt-lookup drafting (4 tokens, n-grams of 2..4);
* ``vllm-medusa``: vLLM's own Medusa (a chain of 4) with the shipped Medusa heads, converted for it (vLLM does
  not share the target's lm_head with Medusa heads: a copy goes into the checkpoint,
  :func:`vllm_entmtp.heads.convert.for_vllm_medusa`, in ``$VLLM_ENTMTP_CACHE/vllm-medusa``);
* ``medusa-tree`` / ``hydra-tree``: entmtp with the shipped Medusa / Hydra heads and the static tree ``mc12`` of
  the tree set ``ladder``;
* ``entmtp``: ``{"method": "entmtp"}``, the plugin's defaults;
* ``static-<tree>``: entmtp with one static tree of the set ``default`` (chains of 1, 2, 3 tokens and the tree
  ``b2n4``) for every request and step, heads only, run on the task ``mixed`` only: the static configurations the
  per-request schedule is measured against;
* ``entmtp-<task>``: entmtp with the tree set named after a task (``trees/<task>.json``), scheduled by the signal
  of its schedule, run on that task only;
* ``--add-method NAME=SPEC``: one more method of the user's, served with ``--speculative-config SPEC`` (entmtp's
  options checked before any server starts), e.g. an option against the defaults.

A method whose heads or tree set is not shipped is skipped with a note (naming it in ``--methods`` is an error).

Output (``--out``, default ``runs/compare-<timestamp>``): ``raw/`` (one JSON per method, task and repeat: the
throughput result document), ``servers/`` (the server logs), ``results.json`` (settings, machine, every run and
the aggregates), ``report.md`` (tables per task and concurrency) and the plots ``throughput.png``, ``mal.png``,
``tree_choice.png``.

The tasks: ``humaneval``, ``gsm8k``, ``sharegpt``, ``creative`` and ``mixed`` (their prompts in turn: code, math,
chat and fiction requests in one batch); on request, ``sharegpt-long`` (chat with its earlier turns: every request's
context 700-1,800 tokens from its start; give the servers KV cache for it, ``VLLM_CPU_KVCACHE_SPACE=2`` at 32 running).

A level of as many requests as it keeps in flight is one wave and its drain: after the first request ends, fewer
run (at 16 running on the 2-core AVX2 EPYC, about 40 % of plain decoding's decode time and 53-59 % of entmtp's,
``benchmarks/results/realised-comparison-epyc-2026-12-07/``). ``--waves N`` sends at least N times as many, so that
new requests keep the batch full for all but the last wave, as under steady load (``vllm bench serve`` sends 1,000
prompts at any ``--max-concurrency``).

Speed depends on the machine and on whatever else runs on it, so the report gives ratios between methods measured
within this one run; with ``--repeats N`` the order of the methods is rotated every repeat and each figure is the
mean over the repeats, with its range.

The script is the command line (its options and ``main``); the comparison's parts are sibling modules:
``compare_methods`` (the methods and tasks), ``compare_settings`` (a run's settings), ``compare_server`` (one
``vllm serve`` and its processes), ``compare_run`` (serving and measuring one method), ``compare_aggregate``
(statistics, ratios and the targets) and ``compare_report`` (results.json, report.md, headline.md, plots).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# sibling modules (benchmarks/ is a script folder, not a package)
from compare_methods import Method, interleaved_order, method_order, shipped_method_table  # noqa: E402
from compare_report import write_outputs  # noqa: E402
from compare_run import machine_description, run_method, run_paired  # noqa: E402
from compare_server import vllm_executable  # noqa: E402
from compare_settings import DEFAULT_PORT, DEFAULTS, QUICK, make_settings  # noqa: E402
from throughput import BenchmarkError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods (default: all available; --list shows them)")
    ap.add_argument("--add-method", action="append", default=None, metavar="NAME=SPEC",
                    help="one more method: NAME, run with --speculative-config SPEC (a JSON object); repeatable. "
                         "Name it in --methods, or leave --methods out to run every method, e.g. "
                         "--add-method 'margin-0.02={\"method\": \"entmtp\", \"compare_margin\": 0.02}'")
    ap.add_argument("--tasks", default=None, help=f"comma-separated prompt sets (default {DEFAULTS['tasks']})")
    ap.add_argument("--concurrency", default=None,
                    help=f"requests in flight, levels such as 1,4,16 (default {DEFAULTS['concurrency']})")
    ap.add_argument("--num-requests", type=int, default=None,
                    help=f"requests per level, each a different prompt, and at least as many as the level keeps in "
                         f"flight (default {DEFAULTS['num_requests']})")
    ap.add_argument("--waves", type=int, default=None,
                    help=f"a level sends at least this many times as many requests as it keeps in flight: with "
                         f"1 a level of 16 requests at 16 running is one wave and its drain (after its first "
                         f"request ends fewer than 16 run); with more, new requests keep the batch full for all "
                         f"but the last wave, as under steady load (default {DEFAULTS['waves']})")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help=f"output tokens per request at most (default {DEFAULTS['max_tokens']})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every method this many times, the methods' order rotated each time (default 1)")
    ap.add_argument("--paired", action="store_true",
                    help="start every method's server once and let the methods take turns level by level (their "
                         "order rotated each level), instead of one server per method and repeat: a method's "
                         "figures then come seconds, not minutes, after the others' (ports --port, --port + 1, ...; "
                         "memory for all the servers at once)")
    ap.add_argument("--fresh-servers", action="store_true",
                    help="with --paired: start every method's server anew each repeat, so that a server process's "
                         "own speed (two processes of one server differ by up to 15 %%) falls on every method alike "
                         "over the repeats (a start-up per method and repeat)")
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
        if s.paired:
            run_paired(s, model, vllm, doc["runs"])
        else:
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
