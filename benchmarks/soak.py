"""Soak test of an OpenAI-compatible server under entmtp: bounded load with mixed options and disconnecting clients.

    python benchmarks/soak.py --serve --duration 600 --result-json benchmarks/results/soak-DATE/soak.json
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --duration 60 --reference no-draft

``--concurrency`` clients (64) stream chat requests back to back for ``--duration`` seconds, then finish what is
in flight. Each request takes a prompt of a mixed set (code, math, chat, fiction) and an option mix
(``OPTION_MIX``: greedy, logprobs, stop strings, penalties, JSON schema, sampled with top_k / top_p / min_p,
logit_bias, n = 2); every ``--disconnect-every``-th request (3) closes its stream after a few chunks, as a client
that goes away (vLLM aborts it). With ``--serve`` the script starts ``vllm serve`` itself with a KV cache small
enough to force preemption (``--num-gpu-blocks``), and later a plain server for the reference.

The report (printed, and ``--result-json``):

* ``requests``, ``completed``, ``disconnected`` (by the client, on purpose), ``errors`` (anything else: a non-200
  answer, a broken stream, an error event; must be 0) with the first few messages;
* ``greedy_checked`` / ``greedy_mismatches``: every distinct greedy (prompt, option) pair that completed is sent
  again to the reference, ``plain`` (a server without speculation: ``--serve`` starts one, or
  ``--reference-url``) or ``no-draft`` (the same server with ``entmtp_num_draft_tokens`` 0, which the lossless
  tests hold equal to plain decoding), 16 at a time (in float32 the batch does not change greedy output); its
  text must be the same;
* ``requests_with_state_after``: ``vllm:entmtp_requests_with_state`` after one probe request sent once the load
  is over and the server holds no request, read once the drafters have published (``throughput.settle_s``; the
  drafter's per-request state; only the probe's own may remain: at most 1); ``idle_after_load``: whether the
  server held no request within 60 s of the load's end (must be true: a request whose client went away is
  aborted);
* ``preemptions`` (``vllm:num_preemptions_total`` during the run), ``spec_decode`` counters;
* ``rss_mib``: resident memory of the server's processes (``--serve``, or ``--server-pid``: its process group)
  after warm-up (``--warmup`` s) and at the end, their ratio (flat: within 5 %), and every 30 s by process
  (``series``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_methods import Method  # noqa: E402
from compare_run import machine_description  # noqa: E402
from compare_server import Server, group_members, serve_command, vllm_executable  # noqa: E402
import throughput as tp  # noqa: E402  (benchmarks/throughput.py: prompts, SSE, metrics)

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
# (name, request fields): greedy entries (temperature 0) are checked against the reference
OPTION_MIX = [
    ("greedy", {"temperature": 0}),
    ("greedy-logprobs", {"temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("greedy-stop", {"temperature": 0, "stop": ["\n\n", "."]}),
    ("greedy-penalties", {"temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3}),
    ("greedy-json", {"temperature": 0, "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "answer", "schema": SCHEMA}}}),
    ("greedy-logit-bias", {"temperature": 0, "logit_bias": {"13": -100}}),
    ("top-k", {"temperature": 0.7, "top_k": 40}),
    ("top-p", {"temperature": 0.8, "top_p": 0.9}),
    ("min-p", {"temperature": 0.7, "min_p": 0.1}),
    ("n2", {"temperature": 0.7, "top_k": 20, "n": 2}),
]
TASKS = ("humaneval", "gsm8k", "sharegpt", "creative")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="a running server (else --serve)")
    ap.add_argument("--serve", action="store_true", help="start vllm serve with entmtp here, then a plain server "
                    "for the reference")
    ap.add_argument("--server-pid", type=int, help="with --base-url: the server's pid (process group) for memory")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds after which memory is first read")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect-every", type=int, default=3, help="every k-th request disconnects mid-stream")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-task", type=int, default=8)
    ap.add_argument("--reference", choices=("plain", "no-draft"), default="plain")
    ap.add_argument("--reference-url", help="a plain server for --reference plain (default with --serve: started)")
    ap.add_argument("--num-gpu-blocks", type=int, default=48, help="--serve: KV blocks (small: preemption)")
    ap.add_argument("--dtype", default="float32", help="--serve: the target's dtype (greedy equality: float32)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json", type=Path)
    return ap


def prompts(per_task: int, max_chars: int = 1500) -> list[tuple[str, list[dict]]]:
    """``per_task`` prompts of each task (the first ones of at most ``max_chars`` characters), with ids."""
    out = []
    for task in TASKS:
        msgs = [m for m in tp.load_benchmark_prompts(task, 8 * per_task) if len(m[-1]["content"]) <= max_chars]
        out += [(f"{task}-{i}", m) for i, m in enumerate(msgs[:per_task])]
    return out


def payload(model: str, messages: list[dict], fields: dict, max_tokens: int, seed: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "seed": seed,
            "stream_options": {"include_usage": True}, **fields}


async def stream(session: aiohttp.ClientSession, url: str, body: dict, disconnect_after: int | None) -> dict:
    """One streamed request: ``{"status": "completed" | "disconnected" | "error", "text", "error"}``; the text
    of choice 0 only."""
    text, chunks = [], 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return {"status": "error", "error": f"HTTP {resp.status}: {tp._one_line(await resp.text())}"}
            parser = tp.SSEParser()
            async for data in resp.content.iter_any():
                for msg in parser.feed(data):
                    if msg.strip() == "[DONE]":
                        return {"status": "completed", "text": "".join(text)}
                    chunk = json.loads(msg)
                    if chunk.get("error"):
                        return {"status": "error", "error": "stream error: " + tp._one_line(chunk["error"])}
                    for choice in chunk.get("choices") or []:
                        if choice.get("index", 0) == 0:
                            text.append((choice.get("delta") or {}).get("content") or "")
                    chunks += 1
                    if disconnect_after is not None and chunks >= disconnect_after:
                        resp.close()  # the client goes away; the server aborts the request
                        return {"status": "disconnected"}
            return {"status": "error", "error": "the stream ended without [DONE]"}
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        return {"status": "error", "error": tp._one_line(f"{type(e).__name__}: {e}")}


async def complete(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    """Non-streamed; the text of choice 0 (raises on any failure)."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    async with session.post(url, json=body) as resp:
        data = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"reference request failed: HTTP {resp.status}: {tp._one_line(data)}")
        return data["choices"][0]["message"]["content"]


def rss_mib(pgid: int | None) -> dict | None:
    """Resident memory (MiB) of the server's process group: ``{"total": ..., process name: ...}`` (API server,
    engine core, worker), or None without a process group."""
    if pgid is None:
        return None
    out = {"total": 0.0}
    for pid in group_members(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        name = next((ln.split()[1] for ln in status if ln.startswith("Name:")), str(pid))
        kib = next((int(ln.split()[1]) for ln in status if ln.startswith("VmRSS:")), 0)
        out[name] = round(out.get(name, 0.0) + kib / 1024, 1)
        out["total"] = round(out["total"] + kib / 1024, 1)
    return out


#: the samples the soak reads: spec-decode and entmtp (throughput.py's defaults) and vLLM's preemption counter
METRIC_PREFIXES = (tp.SPEC_PREFIX, *tp.TREE_PREFIXES, "vllm:num_preemptions")
IDLE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def metric(snap: dict | None, name: str) -> float:
    return sum((snap or {}).get(name, {}).values())


async def wait_until_idle(session: aiohttp.ClientSession, base_url: str, timeout: float = 60.0) -> bool:
    """Polls ``/metrics`` until vLLM's ``num_requests_running`` and ``num_requests_waiting`` read 0 (the
    requests whose clients went away are aborted once the server notices); False after ``timeout`` seconds or
    where the server does not export them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = await tp.fetch_metrics(session, base_url, IDLE_METRICS)
        if snap is not None and all(m in snap and metric(snap, m) == 0 for m in IDLE_METRICS):
            return True
        await asyncio.sleep(0.5)
    return False


async def soak(args, base_url: str, pgid: int | None) -> tuple[dict, list[tuple[dict, str]]]:
    """The load; returns the report and the completed greedy requests ``(body, text)``."""
    rng = random.Random(args.seed)
    ps = prompts(args.prompts_per_task)
    url = base_url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=max(600.0, args.duration))
    # a connection per request: a kept-alive one can be closed by the server (uvicorn closes one idle for 5 s)
    # while the next request is being written ("Can not write request body"): a client-side race, not the
    # server's fault, which made this check fail on a loaded machine
    conn = aiohttp.TCPConnector(limit=args.concurrency + 4, force_close=True)
    counts = {"requests": 0, "completed": 0, "disconnected": 0, "errors": 0}
    errors: list[str] = []
    greedy: dict[str, tuple[dict, str]] = {}
    mem: dict = {"after_warmup": None, "end": None, "series": []}
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        model = await tp.first_model(session, base_url)
        before = await tp.fetch_metrics(session, base_url, METRIC_PREFIXES)
        t0 = time.monotonic()

        async def client(c: int) -> None:
            while time.monotonic() - t0 < args.duration:
                n = counts["requests"]
                counts["requests"] += 1
                pid, msgs = ps[rng.randrange(len(ps))]
                name, fields = OPTION_MIX[rng.randrange(len(OPTION_MIX))]
                body = payload(model, msgs, fields, args.max_tokens, seed=n)
                cut = rng.randint(1, 6) if n % args.disconnect_every == args.disconnect_every - 1 else None
                r = await stream(session, url, body, cut)
                counts[r["status"] if r["status"] != "error" else "errors"] += 1
                if r["status"] == "error" and len(errors) < tp.MAX_ERROR_MESSAGES:
                    errors.append(f"{name}: {r['error']}")
                if r["status"] == "completed" and fields.get("temperature") == 0:
                    greedy.setdefault(f"{pid}/{name}", (body, r["text"]))

        async def memory() -> None:  # every 30 s while the load runs; the first reading past --warmup counts
            while time.monotonic() - t0 < args.duration:
                await asyncio.sleep(min(30.0, max(0.0, args.duration - (time.monotonic() - t0))))
                now = rss_mib(pgid)
                if now is None:
                    return
                elapsed = round(time.monotonic() - t0)
                mem["series"].append({"s": elapsed, **now})
                if mem["after_warmup"] is None and elapsed >= min(args.warmup, args.duration):
                    mem["after_warmup"] = now["total"]

        await asyncio.gather(memory(), *(client(c) for c in range(args.concurrency)))
        seconds = time.monotonic() - t0
        end = rss_mib(pgid)
        mem["end"] = end["total"] if end else None
        # once the server holds no request (a disconnected one is aborted when the server notices), one probe
        # request, then the drafter's per-request state (only the probe's may remain)
        idle = await wait_until_idle(session, base_url)
        await complete(session, url, payload(model, ps[0][1], {"temperature": 0}, 4, seed=0))
        # the drafters write their counters and gauge at most every PUBLISH_INTERVAL_S: the probe's steps (which
        # free the aborted requests' state) reach /metrics once that has passed
        await asyncio.sleep(tp.settle_s(before))
        after = await tp.fetch_metrics(session, base_url, METRIC_PREFIXES)
    report = {
        **counts, "error_messages": errors, "seconds": round(seconds, 1), "idle_after_load": idle,
        "requests_with_state_after": metric(after, "vllm:entmtp_requests_with_state"),
        "preemptions": metric(after, "vllm:num_preemptions_total") - metric(before, "vllm:num_preemptions_total"),
        "fallbacks": metric(after, "vllm:entmtp_fallbacks_total") - metric(before, "vllm:entmtp_fallbacks_total"),
        "spec_decode": tp.spec_decode_delta(before, after) if before and after else None,
        "rss_mib": {**mem, "ratio": round(mem["end"] / mem["after_warmup"], 4)
                    if mem["end"] and mem["after_warmup"] else None},
    }
    return report, list(greedy.values())


async def check_greedy(base_url: str, done: list[tuple[dict, str]], no_draft: bool, concurrency: int = 16
                       ) -> dict:
    """Sends each completed greedy request again to the reference (``concurrency`` at a time: in float32 the
    batch does not change greedy output, tests/test_lossless.py); counts different texts."""
    url = base_url + "/v1/chat/completions"
    mismatches = []
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        model = await tp.first_model(session, base_url)

        async def one(body: dict, text: str) -> None:
            ref = dict(body, model=model or body["model"])
            if no_draft:
                ref["vllm_xargs"] = {"entmtp_num_draft_tokens": 0}
            async with gate:
                if await complete(session, url, ref) != text:
                    mismatches.append(body["messages"][-1]["content"][:60])

        await asyncio.gather(*(one(b, t) for b, t in done))
    return {"greedy_checked": len(done), "greedy_mismatches": len(mismatches), "mismatched": mismatches[:5]}


def serve(args, spec: dict | None, name: str, out_dir: Path) -> Server:
    from vllm_entmtp.models import prepare_default_model

    model = str(prepare_default_model())
    extra = ["--dtype", args.dtype, "--max-model-len", "2048", "--max-num-seqs", str(args.concurrency),
             "--num-gpu-blocks-override", str(args.num_gpu_blocks)]
    cmd = serve_command(vllm_executable(), model, Method(name, spec), args.port, extra=extra)
    return Server(cmd, out_dir / f"{name}.log", args.port, 900, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.serve and not args.base_url:
        print("error: give --base-url of a running server, or --serve", file=sys.stderr)
        return 2
    out_dir = (args.result_json.parent if args.result_json else Path("runs/soak"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.serve:
        with serve(args, {"method": "entmtp"}, "entmtp", out_dir) as s:
            report, done = asyncio.run(soak(args, s.base_url, s.proc.pid))
            if args.reference == "no-draft":
                report |= asyncio.run(check_greedy(s.base_url, done, no_draft=True))
        if args.reference == "plain":
            with serve(args, None, "plain", out_dir) as p:
                report |= asyncio.run(check_greedy(p.base_url, done, no_draft=False))
    else:
        if args.reference == "plain" and not args.reference_url:
            print("error: --reference plain needs --reference-url (or use --serve, or --reference no-draft)",
                  file=sys.stderr)
            return 2
        report, done = asyncio.run(soak(args, args.base_url, args.server_pid))
        ref = args.reference_url or args.base_url
        report |= asyncio.run(check_greedy(ref, done, no_draft=args.reference == "no-draft"))
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["machine"] = machine_description()
    print(json.dumps({k: v for k, v in report.items() if k not in ("config", "machine")}, indent=1))
    if args.result_json:
        args.result_json.write_text(json.dumps(report, indent=1))
    ok = (report["errors"] == 0 and report["greedy_mismatches"] == 0 and report["idle_after_load"]
          and report["requests_with_state_after"] <= 1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
