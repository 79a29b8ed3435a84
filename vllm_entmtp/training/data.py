"""Self-distillation data for MTP heads: one frozen-target pass over real text, cached in shards.

:func:`build_plan` picks training conversations (``vllm_entmtp.datasets.training_conversations``, train splits
only) per source until each source's share of the position budget is met, renders them through the target's
chat template and tokenizes them (truncated to ``max_len`` tokens). :func:`cache_shards` runs the frozen target
(transformers, float32) over the plan and stores, per token ``t``:

* ``hidden[t]``: the final-norm hidden state ``h_t`` (the lm_head input, what vLLM hands a Medusa proposer),
  float16;
* ``argmax[t]``: the target's own greedy prediction of token ``t + 1``; head ``k`` (0-based) at ``t`` is trained
  on ``argmax[t + k + 1]``;
* ``tokens[t]`` (the text) and ``assistant[t]`` (inside an assistant reply).

Positions before the first user message (the template's fixed system prompt) are not labelled. The plan and
each finished shard are written atomically, so an interrupted run resumes at the first missing shard.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PLAN_NAME = "plan.json"
DEFAULT_MIX = {"sharegpt": 0.70, "gsm8k": 0.15, "code": 0.15}


def stable_hash(text: str) -> int:
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:12], 16)


def is_heldout(doc_id: str, percent: float) -> bool:
    """Held-out (never trained on) sequences: a fixed hash of the document id."""
    return stable_hash("heldout:" + doc_id) % 10_000 < percent * 100


@dataclass
class PlannedSeq:
    source: str
    doc_id: str
    ids: list[int]
    start: int  # first labelled position (the first user message's first token)
    assistant: list[int]  # [begin, end) token ranges inside assistant replies, flattened pairs


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def render(tok, messages: list[dict], max_len: int) -> tuple[list[int], int, list[int]] | None:
    """Token ids of ``messages`` through the chat template (truncated), the first labelled position and the
    assistant token ranges; None if nothing is left to label."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_len], enc["offset_mapping"][:max_len]
    starts = [o[0] for o in offsets]
    # char spans of the message contents, found in order
    spans, pos = [], 0
    for m in messages:
        c = text.find(m["content"], pos)
        if c < 0:
            return None
        spans.append((c, c + len(m["content"]), m["role"]))
        pos = c + len(m["content"])
    first_char = spans[0][0]
    start = next((i for i, s in enumerate(starts) if s >= first_char), len(ids))
    ranges = []
    for c0, c1, role in spans:
        if role != "assistant":
            continue
        end_char = text.find("\n", c1) if text.find("\n", c1) >= 0 else len(text)  # include the end token
        b = next((i for i, s in enumerate(starts) if s >= c0), len(ids))
        e = next((i for i, s in enumerate(starts) if s >= end_char), len(ids))
        if e > b:
            ranges += [b, e]
    if len(ids) - start < 8:
        return None
    return ids, start, ranges


def training_docs(sources: list[str], generated: str | Path | None = None) -> dict[str, list]:
    """Documents per training source: dataset text (``sharegpt``, ``gsm8k``, ``code``:
    ``vllm_entmtp.datasets.training_conversations``) and the target's own replies (``<source>-gen``, from the
    ``vllm-entmtp self-distill`` folder ``generated``: :func:`vllm_entmtp.training.selfgen.read_generated`).

    Raises:
        ValueError: an unknown source, or a ``-gen`` source without ``generated``.
        FileNotFoundError: ``generated`` lacks a requested source's replies.
    """
    from vllm_entmtp.datasets import training_conversations
    from vllm_entmtp.training.selfgen import GEN_SUFFIX, SOURCES, read_generated

    gen = [s for s in sources if s.endswith(GEN_SUFFIX)]
    text = [s for s in sources if not s.endswith(GEN_SUFFIX)]
    bad = [s for s in gen if s[:-len(GEN_SUFFIX)] not in SOURCES]
    if bad:
        raise ValueError(f"unknown training sources {bad}; self-distilled ones are "
                         f"{', '.join(s + GEN_SUFFIX for s in SOURCES)}")
    if gen and generated is None:
        raise ValueError(f"sources {gen} are the target's own replies: pass --generated DIR (the folder of "
                         f"`vllm-entmtp self-distill --out DIR`)")
    docs = training_conversations(sources=tuple(text)) if text else {}
    for s in gen:
        docs[s] = read_generated(generated, s[:-len(GEN_SUFFIX)])
    return docs


def build_plan(tok, positions: int, mix: dict[str, float], max_len: int, seed: int,
               num_label_heads: int = 5, generated: str | Path | None = None,
               exclude: set[str] | frozenset[str] = frozenset()) -> list[PlannedSeq]:
    """Pick documents per source (seeded shuffle of the train split) until each source has
    ``positions * mix[source]`` labelled positions (:func:`training_docs`); documents whose id is in ``exclude``
    are skipped (those of ``--extra-data``)."""
    docs = training_docs([s for s, f in mix.items() if f > 0], generated)
    plan: list[PlannedSeq] = []
    for source, frac in mix.items():
        if frac <= 0:
            continue
        order = list(docs[source])
        random.Random(f"{seed}:{source}").shuffle(order)
        budget, got = int(positions * frac), 0
        for d in order:
            if got >= budget:
                break
            if d.id in exclude:
                continue
            r = render(tok, d.messages, max_len)
            if r is None:
                continue
            ids, start, ranges = r
            plan.append(PlannedSeq(source, d.id, ids, start, ranges))
            got += max(0, len(ids) - start - num_label_heads - 1)
    # interleave the sources, so that any prefix of the shards is a representative mix
    random.Random(f"{seed}:plan").shuffle(plan)
    return plan


def read_plan(data_dir: Path) -> list[PlannedSeq] | None:
    """The data plan saved in ``data_dir`` (None: there is none yet)."""
    path = data_dir / PLAN_NAME
    if not path.is_file():
        return None
    return [PlannedSeq(**s) for s in json.loads(path.read_text())["seqs"]]


def shard_path(data_dir: Path, k: int) -> Path:
    """Where shard ``k`` of a data plan is cached."""
    return data_dir / f"shard-{k:05d}.pt"


def load_or_build_plan(data_dir: Path, tok, positions: int, mix: dict[str, float], max_len: int, seed: int,
                       log=print, generated: str | Path | None = None,
                       exclude: set[str] | frozenset[str] = frozenset()) -> list[PlannedSeq]:
    plan = read_plan(data_dir)
    if plan is not None:
        return plan
    path = data_dir / PLAN_NAME
    t0 = time.time()
    plan = build_plan(tok, positions, mix, max_len, seed, generated=generated, exclude=exclude)
    data_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda p: p.write_text(json.dumps({"seqs": [s.__dict__ for s in plan]})))
    log(f"data plan: {len(plan)} sequences, {sum(len(s.ids) for s in plan):,} tokens "
        f"({time.time() - t0:.0f} s)")
    return plan


def shard_ranges(plan: list[PlannedSeq], shard_tokens: int) -> list[tuple[int, int]]:
    out, b, n = [], 0, 0
    for i, s in enumerate(plan):
        n += len(s.ids)
        if n >= shard_tokens:
            out.append((b, i + 1))
            b, n = i + 1, 0
    if b < len(plan):
        out.append((b, len(plan)))
    return out


@torch.inference_mode()
def target_pass(model, lm_head_weight: torch.Tensor, seqs: list[list[int]], batch_tokens: int,
                pad_id: int, progress=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Final-norm hidden states (float16) and greedy next-token argmax (int32) for each sequence."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out: list = [None] * len(seqs)
    i = 0
    while i < len(order):
        L = len(seqs[order[i]])
        j = i + max(1, batch_tokens // L)
        batch = order[i:j]
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for r, b in enumerate(batch):
            ids[r, :len(seqs[b])] = torch.tensor(seqs[b])
            mask[r, :len(seqs[b])] = 1
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # after the final norm
        for r, b in enumerate(batch):
            n = len(seqs[b])
            hr = h[r, :n].float()
            am = torch.cat([(hr[c:c + 1024] @ lm_head_weight.t()).argmax(-1) for c in range(0, n, 1024)])
            out[b] = (hr.to(torch.float16), am.to(torch.int32))
        if progress is not None:
            progress.update(sum(len(seqs[b]) for b in batch))
        i = j
    return out


def cache_shards(model, lm_head_weight: torch.Tensor, plan: list[PlannedSeq], data_dir: Path,
                 shard_tokens: int, batch_tokens: int, pad_id: int, log=print) -> list[Path]:
    """Run the target over every missing shard of ``plan``; return all shard paths."""
    from tqdm import tqdm

    ranges = shard_ranges(plan, shard_tokens)
    paths = [shard_path(data_dir, k) for k in range(len(ranges))]
    todo = [k for k, p in enumerate(paths) if not p.is_file()]
    if not todo:
        return paths
    total = sum(len(plan[i].ids) for k in todo for i in range(*ranges[k]))
    log(f"target pass: {len(todo)} of {len(ranges)} shards to do, {total:,} tokens")
    with tqdm(total=total, unit="tok", desc="target pass", mininterval=5, smoothing=0.05) as bar:
        for k in todo:
            b, e = ranges[k]
            seqs = plan[b:e]
            res = target_pass(model, lm_head_weight, [s.ids for s in seqs], batch_tokens, pad_id, bar)
            lens = torch.tensor([len(s.ids) for s in seqs])
            assistant = torch.zeros(int(lens.sum()), dtype=torch.bool)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
            for s, off in zip(seqs, offsets.tolist()):
                for rb, re_ in zip(s.assistant[0::2], s.assistant[1::2]):
                    assistant[off + rb: off + re_] = True
            shard = {
                "hidden": torch.cat([h for h, _ in res]),
                "argmax": torch.cat([a for _, a in res]),
                "tokens": torch.tensor([t for s in seqs for t in s.ids], dtype=torch.int32),
                "assistant": assistant,
                "offsets": offsets,
                "start": torch.tensor([s.start for s in seqs], dtype=torch.long),
                "doc_ids": [s.doc_id for s in seqs],
                "sources": [s.source for s in seqs],
            }
            _atomic_write(paths[k], lambda p: torch.save(shard, p))
    return paths


@dataclass
class CachedData:
    """All shards concatenated. ``offsets``/``start`` index sequences into the position arrays."""

    hidden: torch.Tensor  # [N, H] float16
    argmax: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64
    assistant: torch.Tensor  # [N] bool
    offsets: torch.Tensor  # [S + 1]
    start: torch.Tensor  # [S]
    doc_ids: list[str]
    sources: list[str]

    def positions(self, num_heads: int, heldout_percent: float, heldout: bool) -> torch.Tensor:
        """Global positions ``t`` with all ``num_heads`` labels inside their sequence, from the train or the
        held-out sequences."""
        chunks = []
        for s, did in enumerate(self.doc_ids):
            if is_heldout(did, heldout_percent) != heldout:
                continue
            b = int(self.offsets[s]) + int(self.start[s])
            e = int(self.offsets[s + 1]) - num_heads
            if e > b:
                chunks.append(torch.arange(b, e))
        return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)

    def sequence_of(self, pos: torch.Tensor) -> torch.Tensor:
        """Index of the sequence holding each global position in ``pos`` (int64, same shape)."""
        return torch.searchsorted(self.offsets, pos, right=True) - 1

    def labels(self, pos: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``[num_heads, len(pos)]``: the target's argmax at ``t + k + 1`` for head ``k``."""
        return torch.stack([self.argmax[pos + k + 1] for k in range(num_heads)])

    def on_greedy_path(self, pos: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``[num_heads, len(pos)]`` bool: the text follows the target's greedy choices from ``t`` up to the label
        of head ``k`` (tokens ``t+1 .. t+k+1`` equal the target's argmax), as in greedy decoding."""
        ok = torch.ones(len(pos), dtype=torch.bool)
        out = []
        for k in range(num_heads):
            ok = ok & (self.tokens[pos + k + 1] == self.argmax[pos + k])
            out.append(ok.clone())
        return torch.stack(out)


def load_shards(paths: list[Path]) -> CachedData:
    parts = [torch.load(p, weights_only=True) for p in paths]
    offsets, base = [torch.zeros(1, dtype=torch.long)], 0
    for p in parts:
        offsets.append(p["offsets"][1:] + base)
        base += int(p["offsets"][-1])
    return CachedData(
        hidden=torch.cat([p["hidden"] for p in parts]),
        argmax=torch.cat([p["argmax"] for p in parts]).long(),
        tokens=torch.cat([p["tokens"] for p in parts]).long(),
        assistant=torch.cat([p["assistant"] for p in parts]),
        offsets=torch.cat(offsets),
        start=torch.cat([p["start"] for p in parts]),
        doc_ids=[d for p in parts for d in p["doc_ids"]],
        sources=[s for p in parts for s in p["sources"]],
    )
