"""Per-prompt statistics records and their cache: prompts rendered through the chat template, the target pass
run per prompt (:mod:`vllm_entmtp.calibrate.target`), and the records saved next to ``--out`` after every prompt
under a key of the model, heads, prompts and settings, so that a second run with other budgets, bins or ranks
only redoes the cheap part and an interrupted run resumes at the next prompt. Also the identities of inputs as
the key and the tree set's metadata record them.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from vllm_entmtp.calibrate.target import (TargetView, greedy_chain_top1, greedy_continuation, head_ranks,
                                          make_drafter)

STATS_VERSION = 2


def log(msg: str) -> None:
    """One line of ``build-trees`` progress on stderr."""
    print(f"[build-trees] {msg}", file=sys.stderr, flush=True)


def render_prompt(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    """Token ids of ``messages`` through the chat template with the generation prompt (the plain contents
    joined by newlines when the tokenizer has no template), keeping the last ``max_prompt_tokens``."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids[-max_prompt_tokens:])


def file_digest(path: Path) -> str:
    """16 hex digits of the file's sha256, or ``"absent"``."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "absent"


def display_path(path: str | Path) -> str:
    """``path`` as a tree set's metadata records it, without this machine's layout: relative to the working
    folder when inside it, else with the home folder as ``~``."""
    p = Path(path).expanduser().resolve()
    for base, shown in ((Path.cwd().resolve(), None), (Path.home().resolve(), "~")):
        if p.is_relative_to(base):
            rel = p.relative_to(base)
            return str(rel) if shown is None else str(Path(shown) / rel)
    return str(p)


def dir_fingerprint(path: str | Path) -> dict:
    """Identity of a model or heads folder for the cache key: resolved path, config digest, and the size and
    modification time of its weight files."""
    p = Path(path).resolve()
    weights = sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".gguf")) \
        if p.is_dir() else []
    return {"path": str(p), "config": file_digest(p / "config.json"),
            "weights": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in weights}}


def stats_cache_path(out: Path, key: dict) -> Path:
    """``<out stem>.stats-<12 hex digits of the key>.pt`` next to ``out``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return out.with_name(f"{out.stem}.stats-{digest}.pt")


def _load_cache(path: Path, key: dict) -> list[dict]:
    if not path.is_file():
        return []
    try:
        blob = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a broken cache is rebuilt, not fatal
        log(f"ignoring unreadable statistics cache {path}: {e}")
        return []
    if blob.get("version") != STATS_VERSION or blob.get("key") != key:
        log(f"ignoring statistics cache {path}: built for other settings")
        return []
    return list(blob["records"])


def _save_cache(path: Path, key: dict, records: list[dict]) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save({"version": STATS_VERSION, "key": key, "records": records}, tmp)
    os.replace(tmp, path)


def collect_statistics(view: TargetView, heads, tokenizer, prompts: list[dict], max_tokens: int,
                       max_prompt_tokens: int, cache_path: Path, key: dict) -> list[dict]:
    """Per-prompt statistics, from the cache where present, else computed and appended to it (after every
    prompt, so an interrupted run resumes). Prompts are taken in order: a cache of more prompts serves a run
    with fewer.

    Returns:
        One record per prompt: ``id``, ``prompt_tokens`` (int), ``tokens`` (generated ids), ``entropy``
        (``float32 [T]`` nats), ``ranks`` (``int16 [T, heads]``, see
        :func:`~vllm_entmtp.calibrate.target.head_ranks`) and ``head_top1`` (``float32 [T, heads]``, see
        :func:`~vllm_entmtp.calibrate.target.greedy_chain_top1`).
    """
    from tqdm import tqdm

    drafter = make_drafter(heads, view)
    records = _load_cache(cache_path, key)
    if records:
        log(f"statistics cache {cache_path}: {len(records)} prompt(s) done")
    for p in tqdm(prompts[len(records):], desc="target + heads", unit="prompt", initial=0,
                  disable=len(records) >= len(prompts)):
        ids = render_prompt(tokenizer, p["messages"], max_prompt_tokens)
        tokens, hidden, ent = greedy_continuation(view, ids, max_tokens)
        ranks = head_ranks(heads, view, tokens, hidden)
        records.append({"id": p["id"], "prompt_tokens": len(ids), "tokens": tokens, "entropy": ent,
                        "ranks": ranks, "head_top1": greedy_chain_top1(drafter, tokens, hidden)})
        _save_cache(cache_path, key, records)
    return records[:len(prompts)]
