"""Load test for any OpenAI-compatible server: throughput, latency and speculative-decoding figures per load level.

    python benchmarks/throughput.py --dataset gsm8k --num-prompts 64 --concurrency 1,4,16,64 --max-tokens 128
    python benchmarks/throughput.py --dataset prompts.jsonl --request-rate 0.5,1,2 --max-seconds 120 \\
        --result-json runs/throughput.json

Requests are streamed (``stream: true`` with ``stream_options.include_usage``) to ``/v1/chat/completions``
(``--endpoint chat``, the prompt's chat messages) or ``/v1/completions`` (``--endpoint completions``, the raw
prompt text, no chat template). Prompts come from a project prompt set (``humaneval``, ``gsm8k``, ``sharegpt``,
``mtbench``, ``creative``, ``mixed``, ``sharegpt-long``: :func:`vllm_entmtp.datasets.load_prompts`, eval split)
or from a JSONL file of ``{"prompt": "..."}`` (or ``{"messages": [...]}``) lines; request ``i`` of a level uses
prompt ``i mod num_prompts``, so every level sends the same prompts in the same order.

A server's prefix cache would then hold a later level's prompts from an earlier level (or run), and compute only
their last block: ``--reset-prefix-cache`` empties it before every level (vLLM's ``POST /reset_prefix_cache``, a
development endpoint: start the server with ``VLLM_SERVER_DEV_MODE=1``), so that every level computes its prompts
as a new user's would be (``benchmarks/compare.py`` always does).

Load levels run one after another: ``--concurrency 1,4,16`` keeps that many requests in flight (closed loop);
``--request-rate 0.5,2`` sends requests at Poisson arrivals of that many per second (open loop, ``inf`` = all at
once), like ``vllm bench serve``. A level ends after ``--num-requests`` requests (default: one per prompt) or,
for requests started, after ``--max-seconds``: no request is started later, those in flight are finished.

Per level (names as in ``vllm bench serve``; times in ms, statistics over the completed requests):

* ``completed``, ``failed`` (request count), ``errors`` (the first few distinct error messages), ``duration``
  (s, from the level's first request to its last response);
* ``request_throughput`` (req/s), ``output_throughput`` (output tokens/s), ``total_token_throughput``
  ((prompt + output tokens)/s); token counts are the server's ``usage`` (``completion_tokens``,
  ``prompt_tokens``) from the stream's last chunk, never a count of chunks (one chunk may carry several
  tokens when drafts are accepted);
* ``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``: TTFT = time to the first chunk with generated text;
  TPOT = (latency - TTFT) / (output tokens - 1), for requests of 2 or more tokens; ITL = gaps between successive
  chunks that carry text (chunk arrival times, so with speculative decoding one ITL can span several tokens);
  E2EL = latency, to the last chunk with a choice. ``null`` where there is no value;
* ``spec_decode``: the difference of the server's Prometheus counters (``/metrics``) before and after the level,
  summed over engines: ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, ``draft_acceptance_rate``
  (accepted / draft tokens), ``mean_acceptance_length_incl_bonus`` (= 1 + accepted / drafts: tokens gained per
  drafting step, INCLUDING the bonus token the target model always adds; 1.0 = no draft token accepted; vLLM's
  convention), ``num_accepted_tokens_per_position`` and ``acceptance_rate_per_position`` (accepted at draft
  position i / drafts). ``null`` when the server has no spec-decode counters or no ``/metrics``. The counters
  are server-wide: other clients' traffic during a level is counted too;
* ``tree_choice_shares``: with an entmtp server, the share of drafting request-steps each tree was chosen for
  (``none``: no draft tokens), from ``vllm:entmtp_tree_chosen``;
* ``draft_sources``: with an entmtp server drafting from prompt lookup and heads (``draft_sources``), per source:
  drafts, draft tokens, accepted draft tokens, share of the drafts, MAL incl. the bonus token, from
  ``vllm:entmtp_source_*``;
* ``client_stall_s``: the longest time this client stood still during the level (a thread that wakes every
  50 ms, and how late it woke): over :data:`STALL_LIMIT_S` the whole machine stopped, not only the server (a
  virtual machine paused or snapshotted: seen on the project's build machines as a 27-second gap), and the
  level's time is not the server's (``benchmarks/compare.py`` measures such a level again);
* ``tree_choice``: deltas of any counter family named ``vllm_entmtp*``, ``vllm:entmtp*`` or ``entmtp*``, per
  sample name, summed per label set (``engine`` and ``model_name`` summed over), keyed ``{label="value",...}``.

``--result-json`` writes ``{"config", "machine" (this client's machine), "date", "levels"}``; a table of the
levels (requests/s, output tokens/s, median TTFT/TPOT/ITL, MAL = mean acceptance length incl. bonus) is printed
at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PERCENTILES = (99,)
MAX_ERROR_MESSAGES = 5
SPEC_PREFIX = "vllm:spec_decode_"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
TREE_PREFIXES = ("vllm_entmtp", "vllm:entmtp", "entmtp")
SUMMED_LABELS = frozenset({"engine", "model_name"})  # summed over (one series per engine / served model)
#: A level during which the client stood still this long (s) did not measure the server alone.
STALL_LIMIT_S = 1.0


def stalled(level: dict) -> bool:
    """Whether the client stood still for over :data:`STALL_LIMIT_S` during ``level`` (``client_stall_s``)."""
    return (level.get("client_stall_s") or 0) > STALL_LIMIT_S


def settle_s(snapshot: Snapshot | None) -> float:
    """Seconds to wait, once requests have stopped, before ``/metrics`` counts all their steps: for a server with
    spec-decode counters (entmtp's among them), the entmtp drafters' publication interval (``PUBLISH_INTERVAL_S``,
    ``vllm_entmtp/metrics.py``: they write their counters at most that often) plus a margin; else 0. A level's
    duration does not include the wait."""
    if snapshot is None or not any(name.startswith((SPEC_PREFIX, *TREE_PREFIXES)) for name in snapshot):
        return 0.0
    from vllm_entmtp.metrics import PUBLISH_INTERVAL_S

    return PUBLISH_INTERVAL_S + 0.5


LabelKey = tuple  # sorted ((label, value), ...) pairs
Snapshot = dict  # sample name -> {LabelKey: value}


class BenchmarkError(Exception):
    """Bad usage or an unusable server; ``main`` prints it as one line and exits non-zero."""


# ------------------------------------------------------------------------------------------ arguments
def parse_concurrency(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; each a whole number >= 1."""
    levels = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise BenchmarkError(f"--concurrency takes whole numbers >= 1 separated by commas, such as 1,4,16,64; "
                                 f"got {text!r}")
        levels.append(int(part))
    return levels


def parse_request_rates(text: str) -> list[float]:
    """``"0.5,2,inf"`` -> ``[0.5, 2.0, inf]``; each > 0 (requests per second)."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            rate = float("nan")
        if not rate > 0:  # also rejects nan
            raise BenchmarkError(f"--request-rate takes numbers > 0 (requests/s, or inf) separated by commas, "
                                 f"such as 0.5,1,2; got {text!r}")
        rates.append(rate)
    return rates


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"server root (default {DEFAULT_BASE_URL}); "
                    "a trailing /v1 is dropped")
    ap.add_argument("--model", default=None, help="model name to request (default: the first id of /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as a bearer token (default: $OPENAI_API_KEY; never written to --result-json)")
    ap.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat",
                    help="chat: /v1/chat/completions with messages (default); completions: /v1/completions with "
                         "the raw prompt")
    ap.add_argument("--dataset", default="gsm8k",
                    help="a prompt set (humaneval, gsm8k, sharegpt, mtbench, creative, mixed, sharegpt-long), a .jsonl "
                         "file of {\"prompt\": ...} lines, or hf:NAME[:SPLIT] for a Hugging Face dataset when the hub "
                         "is reachable (needs the datasets package; the column: --hf-column) (default gsm8k)")
    ap.add_argument("--hf-column", default=None,
                    help="the prompt column of an hf: dataset (default: the first of " + ", ".join(HF_COLUMNS)
                         + "; a list of {role, content} messages or of ShareGPT {from, value} turns is a chat)")
    ap.add_argument("--num-prompts", type=int, default=100, help="prompts to load (default 100)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="requests in flight, a sweep of levels such as 1,4,16,64 (default 1)")
    load.add_argument("--request-rate", default=None,
                      help="Poisson arrivals, requests/s, a sweep such as 0.5,1,2 (inf = all at once)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per level (default: --num-prompts; prompts are reused in turn)")
    ap.add_argument("--fill-levels", type=int, nargs="?", const=1, default=0, metavar="WAVES",
                    help="a concurrency level sends at least WAVES (default 1) times as many requests as it keeps "
                         "in flight, so that every level runs full that many times over (--num-requests 8 "
                         "--concurrency 1,16: 8 then 16; --fill-levels 3: 8 then 48)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no request later than this many seconds into a level (default: no limit)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (default 128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    ap.add_argument("--seed", type=int, default=None,
                    help="sent as the requests' sampling seed; also seeds the Poisson arrivals (default 0)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="ask the server (vLLM extension) to generate --max-tokens tokens every time")
    ap.add_argument("--warmup-requests", type=int, default=1,
                    help="unmeasured requests sent first; a failing one stops the run (default 1)")
    ap.add_argument("--reset-prefix-cache", action="store_true",
                    help="empty the server's prefix cache before every level (vLLM's POST /reset_prefix_cache: serve "
                         "with VLLM_SERVER_DEV_MODE=1), so that no level finds its prompts cached by an earlier one")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    ap.add_argument("--result-json", default=None, help="write the config, machine and per-level results here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def level_requests(num_requests: int, waves: int, concurrency: int | None) -> int:
    """Requests a level sends: ``num_requests``, or ``waves`` times its ``concurrency`` where more (the batch then
    runs full that many times over; an open-loop level, ``concurrency`` None, sends ``num_requests``)."""
    return max(num_requests, waves * (concurrency or 0))


@dataclass
class Config:
    base_url: str
    model: str | None
    api_key: str | None
    endpoint: str
    dataset: str
    num_prompts: int
    concurrency: list[int] | None
    request_rate: list[float] | None
    num_requests: int | None
    max_seconds: float | None
    max_tokens: int
    temperature: float
    seed: int | None
    ignore_eos: bool
    warmup_requests: int
    request_timeout: float
    result_json: str | None
    progress: bool
    hf_column: str | None = None
    fill_levels: int = 0  # a concurrency level sends at least this many times its concurrency
    reset_prefix_cache: bool = False  # empty the server's prefix cache before every level

    def requests_at(self, concurrency: int | None, num_prompts: int) -> int:
        """Requests a level sends: ``num_requests`` (default one per prompt), at least ``fill_levels`` times
        ``concurrency``."""
        return level_requests(self.num_requests or num_prompts, self.fill_levels, concurrency)

    @property
    def levels(self) -> list[dict]:
        if self.request_rate is not None:
            return [{"concurrency": None, "request_rate": r} for r in self.request_rate]
        return [{"concurrency": c, "request_rate": None} for c in self.concurrency or [1]]

    def as_json(self) -> dict:
        out = dict(vars(self))
        del out["api_key"]
        if out["request_rate"] is not None:
            out["request_rate"] = [r if math.isfinite(r) else "inf" for r in out["request_rate"]]
        return out


def make_config(args: argparse.Namespace) -> Config:
    """Checks the parsed arguments; raises :class:`BenchmarkError` with a one-line message."""
    for name in ("num_prompts", "max_tokens", "num_requests"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("max_seconds", "request_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.warmup_requests < 0:
        raise BenchmarkError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if getattr(args, "fill_levels", 0) < 0:
        raise BenchmarkError(f"--fill-levels must be >= 0, got {args.fill_levels}")
    if args.temperature < 0:
        raise BenchmarkError(f"--temperature must be >= 0, got {args.temperature}")
    base_url = args.base_url.rstrip("/")
    if not base_url.startswith(("http://", "https://")):
        raise BenchmarkError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    base_url = base_url.removesuffix("/v1")
    return Config(
        base_url=base_url, model=args.model, api_key=args.api_key or None, endpoint=args.endpoint,
        dataset=args.dataset, num_prompts=args.num_prompts,
        concurrency=parse_concurrency(args.concurrency) if args.concurrency is not None else None,
        request_rate=parse_request_rates(args.request_rate) if args.request_rate is not None else None,
        num_requests=args.num_requests, max_seconds=args.max_seconds, max_tokens=args.max_tokens,
        temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos,
        warmup_requests=args.warmup_requests, request_timeout=args.request_timeout,
        result_json=args.result_json, progress=not args.no_progress, hf_column=args.hf_column,
        fill_levels=getattr(args, "fill_levels", 0), reset_prefix_cache=getattr(args, "reset_prefix_cache", False))


# ------------------------------------------------------------------------------------------ prompts
HF_COLUMNS = ("prompt", "question", "instruction", "input", "text", "messages", "conversations")


def hf_rows_to_prompts(rows, column: str | None, name: str) -> list[list[dict]]:
    """Chat messages from the rows of a Hugging Face dataset (any iterable of dicts): ``column`` (default: the
    first of :data:`HF_COLUMNS` the first row has) holding a string (one user turn), a list of ``{"role",
    "content"}`` messages, or ShareGPT ``{"from", "value"}`` turns (cut before the first assistant turn, so the
    server answers the first user turn).

    Raises:
        BenchmarkError: no such column, or a value that is none of these.
    """
    out = []
    for i, row in enumerate(rows):
        col = column or next((c for c in HF_COLUMNS if c in row), None)
        if col is None or col not in row:
            raise BenchmarkError(f"--dataset {name}: row {i} has no column {column or ' / '.join(HF_COLUMNS)} "
                                 f"(columns: {', '.join(row)}); pick one with --hf-column")
        value = row[col]
        if isinstance(value, str) and value.strip():
            out.append([{"role": "user", "content": value}])
            continue
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            msgs = [{"role": {"human": "user", "gpt": "assistant"}.get(m.get("from"), m.get("from")),
                     "content": m.get("value")} if "from" in m else {"role": m.get("role"), "content": m.get("content")}
                    for m in value]
            first_reply = next((k for k, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
            msgs = msgs[:first_reply]
            if msgs and all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in msgs):
                out.append(msgs)
                continue
        raise BenchmarkError(f"--dataset {name}: row {i}, column {col!r}: expected a string or a list of chat "
                             f"messages, got {type(value).__name__}")
    return out


def load_hf_prompts(spec: str, num_prompts: int, column: str | None) -> list[list[dict]]:
    """``hf:NAME[:SPLIT]`` (split default ``train``) through ``datasets.load_dataset``, first ``num_prompts`` rows.

    Raises:
        BenchmarkError: no ``datasets`` package, or the dataset cannot be loaded (offline, unknown name, ...).
    """
    name, _, split = spec[len("hf:"):].partition(":")
    try:
        import datasets
    except ImportError:
        raise BenchmarkError(f"--dataset {spec}: Hugging Face datasets need the `datasets` package "
                             f"(pip install datasets)") from None
    try:
        ds = datasets.load_dataset(name, split=split or "train", streaming=True)
        rows = [row for _, row in zip(range(num_prompts), ds)]
    except Exception as e:  # offline hub, unknown dataset or split: one line, not a traceback
        raise BenchmarkError(f"--dataset {spec}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0]})") \
            from None
    return hf_rows_to_prompts(rows, column, spec)


def load_benchmark_prompts(dataset: str, num_prompts: int, hf_column: str | None = None) -> list[list[dict]]:
    """The first ``num_prompts`` prompts of a prompt set, JSONL file or ``hf:`` dataset, each as chat messages."""
    from vllm_entmtp.datasets import PROMPT_SETS, PromptFileError, load_prompts, read_jsonl_prompts

    if dataset.startswith("hf:"):
        prompts = load_hf_prompts(dataset, num_prompts, hf_column)
    elif dataset in PROMPT_SETS:
        try:
            prompts = [p.messages for p in load_prompts(dataset, limit=num_prompts)]
        except (FileNotFoundError, ValueError) as e:
            raise BenchmarkError(f"--dataset {dataset}: {e}") from None
    else:
        path = Path(dataset)
        if not path.is_file():
            raise BenchmarkError(f"--dataset {dataset!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) "
                                 f"nor an existing .jsonl file")
        try:
            prompts = [p.messages for p in read_jsonl_prompts(path, text_content=False)[:num_prompts]]
        except PromptFileError as e:
            raise BenchmarkError(f"{path}: {e.reason}" if e.line is None else f"{path}:{e.line}: {e.reason}") \
                from None
    if not prompts:
        raise BenchmarkError(f"no prompts in --dataset {dataset!r}")
    return prompts


def build_payload(cfg: Config, model: str, messages: list[dict]) -> dict:
    """The streaming request body for ``cfg.endpoint``; ``completions`` sends the messages' text joined."""
    if cfg.endpoint == "chat":
        payload = {"model": model, "messages": messages, "max_completion_tokens": cfg.max_tokens}
    else:
        prompt = "\n\n".join(str(m.get("content", "")) for m in messages)
        payload = {"model": model, "prompt": prompt, "max_tokens": cfg.max_tokens}
    payload.update(temperature=cfg.temperature, stream=True, stream_options={"include_usage": True})
    if cfg.seed is not None:
        payload["seed"] = cfg.seed
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def poisson_arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the level's start) of ``n`` requests at Poisson arrivals of ``rate``/s; the first at 0."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


# ------------------------------------------------------------------------------------------ statistics
@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds (``time.perf_counter``)."""

    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0  # to the first chunk with generated text
    latency: float = 0.0  # to the last chunk with a choice
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks with text
    prompt_tokens: int = 0  # usage.prompt_tokens
    output_tokens: int = 0  # usage.completion_tokens
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (latency - ttft) / (output_tokens - 1); None below 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def distribution_ms(values_s: list[float], name: str, percentiles=PERCENTILES) -> dict:
    """``mean_/median_/std_/p99_{name}_ms`` of ``values_s`` (seconds), in ms; all None when empty."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + \
        [f"p{_p_word(p)}_{name}_ms" for p in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    arr = np.asarray(values_s, dtype=float) * 1000.0
    stats = [arr.mean(), np.median(arr), arr.std()] + [np.percentile(arr, p) for p in percentiles]
    return {k: float(v) for k, v in zip(keys, stats)}


def summarize(records: list[RequestRecord], duration_s: float, percentiles=PERCENTILES) -> dict:
    """A level's results from its request records; rates per second of ``duration_s``."""
    ok = [r for r in records if r.success]
    errors: list[str] = []
    for r in records:
        if not r.success and r.error not in errors and len(errors) < MAX_ERROR_MESSAGES:
            errors.append(r.error)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    out = {"completed": len(ok), "failed": len(records) - len(ok), "errors": errors, "duration": duration_s,
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": per_s(len(ok)), "output_throughput": per_s(total_out),
           "total_token_throughput": per_s(total_in + total_out)}
    out.update(distribution_ms([r.ttft for r in ok], "ttft", percentiles))
    out.update(distribution_ms([t for r in ok if (t := r.tpot) is not None], "tpot", percentiles))
    out.update(distribution_ms([gap for r in ok for gap in r.itl], "itl", percentiles))
    out.update(distribution_ms([r.latency for r in ok], "e2el", percentiles))
    return out


# ------------------------------------------------------------------------------------------ /metrics
def parse_metrics(text: str, prefixes: tuple[str, ...] = (SPEC_PREFIX, *TREE_PREFIXES)) -> Snapshot:
    """The samples of a Prometheus text exposition whose names start with ``prefixes`` (default: spec-decode and
    entmtp): ``{sample name: {labels: value}}``.

    ``*_created`` (creation timestamps) and histogram ``*_bucket`` samples are left out.
    """
    snap: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(prefixes) or s.name.endswith(("_created", "_bucket")):
                continue
            snap.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return snap


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def sample_delta(before: Snapshot, after: Snapshot, name: str, keep_labels: tuple[str, ...] | None = None
                 ) -> dict[LabelKey, float]:
    """``after - before`` of sample ``name`` summed per label set; labels in :data:`SUMMED_LABELS` (or, with
    ``keep_labels``, all but those) are summed over. A series missing before counts from 0."""
    out: dict[LabelKey, float] = {}
    old = before.get(name, {})
    for labels, value in after.get(name, {}).items():
        kept = tuple((k, v) for k, v in labels if (k in keep_labels if keep_labels is not None
                                                   else k not in SUMMED_LABELS))
        out[kept] = out.get(kept, 0.0) + value - old.get(labels, 0.0)
    return out


def spec_decode_delta(before: Snapshot, after: Snapshot) -> dict | None:
    """Spec-decode figures of the counters' change between two snapshots; None without spec-decode counters."""
    if SPEC_DRAFTS not in after:
        return None
    drafts, draft_tokens, accepted = (sum(sample_delta(before, after, n, ()).values())
                                      for n in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED))
    per_pos = sample_delta(before, after, SPEC_ACCEPTED_PER_POS, ("position",))
    positions = sorted(int(dict(k)["position"]) for k in per_pos if dict(k).get("position", "").isdigit())
    accepted_per_pos = [per_pos[(("position", str(p)),)] for p in positions]
    return {
        "num_drafts": _num(drafts), "num_draft_tokens": _num(draft_tokens), "num_accepted_tokens": _num(accepted),
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "mean_acceptance_length_incl_bonus": 1 + accepted / drafts if drafts > 0 else None,
        "num_accepted_tokens_per_position": [_num(a) for a in accepted_per_pos],
        "acceptance_rate_per_position": [a / drafts for a in accepted_per_pos] if drafts > 0 else None,
    }


def format_labels(labels: LabelKey) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def tree_choice_delta(before: Snapshot, after: Snapshot) -> dict:
    """Deltas of every ``vllm_entmtp*`` / ``vllm:entmtp*`` / ``entmtp*`` sample, ``{name: {labels: delta}}``."""
    return {name: {format_labels(k): _num(v) for k, v in sorted(sample_delta(before, after, name).items())}
            for name in sorted(after) if name.startswith(TREE_PREFIXES)}


CHOSEN_FAMILY = "vllm:entmtp_tree_chosen_total"  # vllm_entmtp/metrics.py


SOURCE_FAMILIES = {"drafts": "vllm:entmtp_source_drafts_total", "draft_tokens": "vllm:entmtp_source_draft_tokens_total",
                   "accepted_tokens": "vllm:entmtp_source_accepted_tokens_total"}  # vllm_entmtp/metrics.py


def _label(labels: str, key: str) -> str:
    """The value of label ``key`` in a ``{k="v",...}`` key of :func:`tree_choice_delta` (``"?"``: absent)."""
    return next((v for k, _, v in (part.partition("=") for part in labels.strip("{}").split(","))
                 if k == key), "?").strip('"')


def _counts_by(tree_choice: dict, family: str, key: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for labels, n in tree_choice.get(family, {}).items():
        label = _label(labels, key)
        counts[label] = counts.get(label, 0) + n
    return counts


def tree_choice_shares(tree_choice: dict) -> dict[str, float]:
    """Share of drafting request-steps per tree (``none``: drafted nothing), from the deltas of entmtp's
    ``vllm:entmtp_tree_chosen`` counter; ``{}`` when the server is not entmtp."""
    counts = _counts_by(tree_choice, CHOSEN_FAMILY, "tree")
    total = sum(counts.values())
    return {t: n / total for t, n in sorted(counts.items())} if total else {}


def draft_sources(tree_choice: dict) -> dict[str, dict]:
    """Per draft source of an entmtp server (``heads``, ``lookup``; its ``vllm:entmtp_source_*`` counters):
    verified drafts, draft tokens, accepted draft tokens, the share of the drafts, and the mean acceptance length
    incl. the bonus token (1 + accepted / drafts); ``{}`` for other servers."""
    fams = {k: _counts_by(tree_choice, f, "source") for k, f in SOURCE_FAMILIES.items()}
    total = sum(fams["drafts"].values())
    out = {}
    for src, n in sorted(fams["drafts"].items()):
        acc = fams["accepted_tokens"].get(src, 0)
        out[src] = {"drafts": n, "draft_tokens": fams["draft_tokens"].get(src, 0), "accepted_tokens": acc,
                    "share": n / total if total else None,
                    "mean_acceptance_length_incl_bonus": 1 + acc / n if n else None}
    return out


# ------------------------------------------------------------------------------------------ HTTP
class SSEParser:
    """Server-sent events from a byte stream: :meth:`feed` returns the ``data`` payloads completed so far."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf = (self._buf + data).replace(b"\r\n", b"\n")
        *events, self._buf = self._buf.split(b"\n\n")
        return [p for e in events if (p := self._data(e)) is not None]

    def flush(self) -> list[str]:
        """Payload of a last event not closed by a blank line."""
        rest, self._buf = self._buf, b""
        payload = self._data(rest)
        return [payload] if payload is not None else []

    @staticmethod
    def _data(event: bytes) -> str | None:
        lines = [ln[5:].removeprefix(" ") for ln in event.decode("utf-8").split("\n") if ln.startswith("data:")]
        return "\n".join(lines) if lines else None


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


class StreamTimer:
    """Fills a :class:`RequestRecord` from the stream's ``data`` payloads and their arrival times."""

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec
        self.first_text: float | None = None
        self.last_text: float | None = None
        self.last_choice: float | None = None
        self.usage: dict | None = None

    def add(self, message: str, now: float) -> bool:
        """Takes one payload that arrived at ``now``; False (and ``rec.error`` set) on an error event."""
        if message.strip() == "[DONE]":
            return True
        chunk = json.loads(message)
        if not isinstance(chunk, dict):
            raise ValueError(f"a stream chunk is not a JSON object: {_one_line(message, 80)}")
        if chunk.get("error"):
            err = chunk["error"]
            self.rec.error = "stream error: " + _one_line(err.get("message", err) if isinstance(err, dict) else err)
            return False
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            self.last_choice = now
            delta = choice.get("delta") or {}
            text = (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    or choice.get("text"))
            if text:
                if self.first_text is None:
                    self.first_text = now
                else:
                    self.rec.itl.append(now - self.last_text)
                self.last_text = now
        return True

    def finish(self) -> RequestRecord:
        """The record once the stream has ended: successful if it had a choice and a usage chunk."""
        rec = self.rec
        if self.last_choice is None:
            rec.error = "the stream had no choices"
        elif not self.usage or "completion_tokens" not in self.usage:
            rec.error = "the stream had no usage chunk (stream_options.include_usage unsupported?)"
        else:
            rec.success = True
            rec.ttft = (self.first_text if self.first_text is not None else self.last_choice) - rec.start_time
            rec.latency = self.last_choice - rec.start_time
            rec.output_tokens = int(self.usage["completion_tokens"])
            rec.prompt_tokens = int(self.usage.get("prompt_tokens") or 0)
        return rec


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict) -> RequestRecord:
    """Streams one request; never raises for a failed request (``success`` False, ``error`` set)."""
    rec = RequestRecord(start_time=time.perf_counter())
    timer = StreamTimer(rec)
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {_one_line(await resp.text())}"
                return rec
            parser = SSEParser()
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                if not all(timer.add(m, now) for m in parser.feed(data)):
                    return rec
            if not all(timer.add(m, time.perf_counter()) for m in parser.flush()):
                return rec
    except asyncio.TimeoutError:
        rec.error = "timed out (--request-timeout)"
        return rec
    except (aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: JSON, UTF-8
        rec.error = _one_line(f"{type(e).__name__}: {e}")
        return rec
    return timer.finish()


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The first model id of ``/v1/models`` (None if the server has no such list); :class:`BenchmarkError` if the
    server cannot be reached."""
    try:
        async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
        raise BenchmarkError(f"cannot reach the server at {base_url}: {_one_line(str(e) or type(e).__name__)}"
                             ) from None
    except (aiohttp.ClientError, ValueError):
        return None
    models = data.get("data") if isinstance(data, dict) else None
    return str(models[0]["id"]) if models and isinstance(models[0], dict) and "id" in models[0] else None


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str,
                        prefixes: tuple[str, ...] = (SPEC_PREFIX, *TREE_PREFIXES)) -> Snapshot | None:
    """Parsed ``/metrics`` (:func:`parse_metrics`), or None if the server has none (or it does not parse)."""
    try:
        async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text(), prefixes)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def reset_prefix_cache(session: aiohttp.ClientSession, base_url: str, tries: int = 30,
                             wait_s: float = 1.0) -> None:
    """Empties the server's prefix cache: vLLM's ``POST /reset_prefix_cache`` (a development endpoint, served with
    ``VLLM_SERVER_DEV_MODE=1``), again every ``wait_s`` while it answers ``{"success": false}`` (blocks still held
    by requests the server is finishing), at most ``tries`` times.

    Raises:
        BenchmarkError: the server has no such endpoint, answers with an error, or keeps its cache.
    """
    url = f"{base_url}/reset_prefix_cache"
    for _ in range(tries):
        try:
            async with session.post(url, timeout=aiohttp.ClientTimeout(total=60)) as resp:
                if resp.status == 404:
                    raise BenchmarkError(f"{url}: not found; --reset-prefix-cache needs vLLM's development endpoints "
                                         "(start the server with VLLM_SERVER_DEV_MODE=1), or leave the option out")
                if resp.status != 200:
                    raise BenchmarkError(f"POST {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            raise BenchmarkError(f"POST {url} failed: {type(e).__name__}: {e}") from None
        if not isinstance(body, dict) or body.get("success", True):
            return
        await asyncio.sleep(wait_s)
    raise BenchmarkError(f"POST {url}: the server kept its prefix cache (blocks still held) after {tries} tries")


# ------------------------------------------------------------------------------------------ load levels
class StallWatch:
    """The longest time this process stood still inside a ``with`` block: a thread wakes every ``interval_s``
    and keeps the most it woke late (``max_gap_s``). A busy client delays it by a few ms (the GIL's switch
    interval); a process stopped, or a virtual machine paused, by the whole pause."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.max_gap_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def _watch(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            self.max_gap_s = max(self.max_gap_s, now - last - self.interval_s)
            last = now

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def run_level(session: aiohttp.ClientSession, url: str, payloads: list[dict], num_requests: int,
                    concurrency: int | None, rate: float | None, max_seconds: float | None, seed: int,
                    progress: bool, desc: str) -> tuple[list[RequestRecord], float]:
    """Sends up to ``num_requests`` requests (request i: ``payloads[i % len]``) with ``concurrency`` in flight,
    or at Poisson ``rate``; returns the records and the level's duration (s)."""
    records: list[RequestRecord] = []
    bar = tqdm(total=num_requests, desc=desc, unit="req", disable=not progress)
    t0 = time.perf_counter()
    deadline = t0 + max_seconds if max_seconds else math.inf

    async def one(i: int) -> None:
        records.append(await send_request(session, url, payloads[i % len(payloads)]))
        bar.update(1)

    if rate is None:
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while issued < num_requests and time.perf_counter() < deadline:
                issued += 1
                await one(issued - 1)

        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
    else:
        tasks = []
        for i, offset in enumerate(poisson_arrival_offsets(num_requests, rate, seed)):
            if t0 + offset >= deadline:
                break
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return records, duration


def machine_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


async def run_benchmark(cfg: Config, prompts: list[list[dict]]) -> dict:
    """All levels of ``cfg`` against the server; the result document (see the module docstring)."""
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model = await first_model(session, cfg.base_url)  # also checks that the server answers
        model = cfg.model or model
        if model is None:
            raise BenchmarkError(f"{cfg.base_url}/v1/models lists no model; name one with --model")
        url = cfg.base_url + ENDPOINTS[cfg.endpoint]
        payloads = [build_payload(cfg, model, m) for m in prompts]
        for i in range(cfg.warmup_requests):
            rec = await send_request(session, url, payloads[i % len(payloads)])
            if not rec.success:
                raise BenchmarkError(f"warm-up request to {url} failed: {rec.error}")
        levels = []
        before = await fetch_metrics(session, cfg.base_url)
        wait = settle_s(before)
        if wait:  # the warm-up's steps are published before the first level counts from here
            await asyncio.sleep(wait)
            before = await fetch_metrics(session, cfg.base_url)
        for level in cfg.levels:
            c, rate = level["concurrency"], level["request_rate"]
            desc = f"concurrency {c}" if rate is None else f"rate {rate:g}/s"
            if cfg.reset_prefix_cache:  # after the warm-up and the level before: this level computes its prompts
                await reset_prefix_cache(session, cfg.base_url)
            with StallWatch() as watch:
                records, duration = await run_level(
                    session, url, payloads, cfg.requests_at(c, len(prompts)), c, rate, cfg.max_seconds,
                    cfg.seed if cfg.seed is not None else 0, cfg.progress, desc)
            await asyncio.sleep(wait)  # the level's last steps are published
            after = await fetch_metrics(session, cfg.base_url)
            result = {"concurrency": c, "request_rate": rate if rate is None or math.isfinite(rate) else "inf"}
            result.update(summarize(records, duration))
            result["client_stall_s"] = round(watch.max_gap_s, 3)
            have_metrics = before is not None and after is not None
            result["spec_decode"] = spec_decode_delta(before, after) if have_metrics else None
            result["tree_choice"] = tree_choice_delta(before, after) if have_metrics else {}
            result["tree_choice_shares"] = tree_choice_shares(result["tree_choice"])
            result["draft_sources"] = draft_sources(result["tree_choice"])
            levels.append(result)
            before = after  # nothing runs between levels
    config = cfg.as_json() | {"model": model, "url": url, "num_prompts": len(prompts)}
    return {"config": config, "machine": machine_info(), "date": datetime.now(timezone.utc).isoformat(),
            "levels": levels}


# ------------------------------------------------------------------------------------------ report
def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(levels: list[dict]) -> str:
    """One row per level: load, completed/failed, req/s, output tok/s, median TTFT/TPOT/ITL (ms), MAL."""
    head = (f"{'load':>14} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT ms':>8} {'TPOT ms':>8} "
            f"{'ITL ms':>8} {'MAL':>5}")
    rows = [head, "-" * len(head)]
    for r in levels:
        load = f"conc {r['concurrency']}" if r["request_rate"] is None else f"rate {r['request_rate']}/s"
        mal = (r["spec_decode"] or {}).get("mean_acceptance_length_incl_bonus")
        rows.append(f"{load:>14} {r['completed']:>5} {r['failed']:>4} {_fmt(r['request_throughput'], '7.2f')} "
                    f"{_fmt(r['output_throughput'], '9.1f')} {_fmt(r['median_ttft_ms'], '8.1f')} "
                    f"{_fmt(r['median_tpot_ms'], '8.1f')} {_fmt(r['median_itl_ms'], '8.1f')} {_fmt(mal, '5.2f')}")
    rows.append("TTFT/TPOT/ITL: medians; MAL: mean acceptance length incl. the bonus token (1 + accepted/drafts)")
    for r in levels:
        if r.get("draft_sources"):
            load = f"conc {r['concurrency']}" if r["request_rate"] is None else f"rate {r['request_rate']}/s"
            rows.append(f"draft sources at {load}: " + ", ".join(
                f"{src} {v['share']:.0%} of drafts, MAL {_fmt(v['mean_acceptance_length_incl_bonus'], '.2f')}"
                for src, v in r["draft_sources"].items()))
        load = f"concurrency {r['concurrency']}" if r["request_rate"] is None else f"rate {r['request_rate']}"
        rows += [f"error at {load}: {err}" for err in r["errors"]]
        if stalled(r):
            rows.append(f"warning at {load}: this client stood still for {r['client_stall_s']:.1f} s (the machine "
                        f"paused?): the level's figures are not the server's alone; measure it again")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = make_config(args)
        if cfg.result_json:
            try:
                Path(cfg.result_json).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BenchmarkError(f"--result-json {cfg.result_json}: {e}") from None
        prompts = load_benchmark_prompts(cfg.dataset, cfg.num_prompts, cfg.hf_column)
        result = asyncio.run(run_benchmark(cfg, prompts))
        if cfg.result_json:
            try:
                Path(cfg.result_json).write_text(json.dumps(result, indent=2) + "\n")
            except OSError as e:
                raise BenchmarkError(f"--result-json {cfg.result_json}: {e}") from None
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    c = result["config"]
    print(f"{c['model']} at {c['url']}: {c['dataset']} ({c['num_prompts']} prompts), max {c['max_tokens']} tokens")
    print(format_table(result["levels"]))
    if cfg.result_json:
        print(f"results: {cfg.result_json}")
    return 0 if any(r["completed"] for r in result["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
