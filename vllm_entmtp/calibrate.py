"""Build a tree set for the scheduler (bins on the entropy signal, the default, or on confidence) from measured
statistics: ``vllm-entmtp build-trees``.

The target model decodes a prompt set greedily (transformers, float32, its chat template). Along its own
continuation ``y`` it records, at every generated position ``t``, the entropy (nats) of the distribution
``y_{t+1}`` was drawn from (what the runtime ``EntropyTracker`` sees) and, for every head ``d``, the rank of the
true token ``y_{t+d+2}`` in head ``d``'s distribution (Hydra heads are fed the true path ``y_{t+1..t+d+1}``).
Positions are split into entropy bins; per bin ``P[d][r]`` is the share of positions where head ``d``'s rank
is ``r``. Under the independence assumption of Medusa's tree search a tree's expected accepted draft tokens
are ``sum over nodes (r_0..r_d) of prod_i P[i][r_i]``; a greedy search (Medusa, Cai et al. 2024, arXiv
2401.10774, section 2.3.3 "Searching for the optimized tree construction"; ``explore_graph`` in
FasterDecoding/Medusa ``medusa/eval/gen_results.py``) gives one tree per node budget, the cost of verifying
and drafting each tree is measured on this machine (Sequoia's hardware-aware choice, Chen et al. 2024, arXiv
2402.12374), and per bin the Pareto frontier of (cost, expected tokens per step) and the tree with the best
expected speed-up are kept. The output is a tree-set JSON file with a ``schedule`` (``docs/trees.md``) that
:class:`vllm_entmtp.scheduler.TreeScheduler` reads, a PNG of the frontiers and a printed summary.

Torch and transformers only (no vLLM import). The per-position statistics are cached next to ``--out``, so a
second run with other budgets, bins or ranks only redoes the cheap part; an interrupted run resumes at the next
prompt.
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_entmtp.fast_linear import use_vllm_cpu_gemm
from vllm_entmtp.trees import NO_DRAFT_ID

STATS_VERSION = 2
RANK_STORE_CAP = 1024
"""Ranks are stored capped at this value, so ``--max-rank`` up to it can change without recomputing."""
NO_LABEL = -1
"""Stored rank of a head at a position whose true token lies past the end of the continuation."""
DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24)
SIGNALS = ("entropy", "confidence")
"""What the bins are on: the runtime tracker's entropy EMA (nats), or its path confidence (the product of the
heads' top-1 probabilities along their greedy chain; with window 1, this step's)."""


def score_sign(signal: str) -> float:
    """Score = sign x signal, increasing from the most aggressive bin to the most conservative one (as the
    scheduler orders its ladder): +1 for entropy, -1 for confidence."""
    return -1.0 if signal == "confidence" else 1.0


def _log(msg: str) -> None:
    print(f"[build-trees] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ tree statistics
Path_ = tuple[int, ...]


def _check_table(P: Sequence[Sequence[float]]) -> tuple[int, int]:
    if not P or not P[0]:
        raise ValueError("P must be a non-empty [heads][ranks] table")
    width = len(P[0])
    for d, row in enumerate(P):
        if len(row) != width:
            raise ValueError(f"P[{d}] has {len(row)} ranks, P[0] has {width}: rows must be equally long")
        for r, x in enumerate(row):
            if not (isinstance(x, (int, float)) and 0.0 <= x <= 1.0):
                raise ValueError(f"P[{d}][{r}] = {x!r} is not a probability in [0, 1]")
    return len(P), width


def node_probability(path: Sequence[int], P: Sequence[Sequence[float]]) -> float:
    """Probability that node ``path = (r_0, ..., r_d)`` is accepted: ``prod_i P[i][r_i]``.

    Args:
        path: top-k ranks, one per head (as in a tree-set file).
        P: ``[heads][ranks]`` floats; ``P[i][r]`` is the share of positions where the true token is head ``i``'s
            rank-``r`` token (given, for Hydra heads, that the path up to it is right).

    Returns:
        A float in [0, 1]; 0 for a path deeper than ``P`` or with a rank outside it (a "miss").

    A node is accepted iff its own token and every ancestor's is the target's token; taking the depths as
    independent is the assumption of Medusa's tree search (Cai et al. 2024, section 2.3.3) and Hydra's.
    """
    p = 1.0
    for d, r in enumerate(path):
        if d >= len(P) or r >= len(P[d]):
            return 0.0
        p *= P[d][r]
    return p


def expected_accepted(paths: Sequence[Sequence[int]], P: Sequence[Sequence[float]]) -> float:
    """Expected accepted draft tokens per step of the tree ``paths``: ``sum over nodes of node_probability``.

    Exactly one rank is right per depth, so siblings exclude each other and the accepted nodes form one path
    from the root; its expected length is the sum of the nodes' acceptance probabilities. The bonus token is
    not included: expected tokens per step = ``1 + expected_accepted``.
    """
    return sum(node_probability(p, P) for p in paths)


def greedy_tree(P: Sequence[Sequence[float]], max_nodes: int, max_depth: int | None = None
                ) -> list[tuple[Path_, float]]:
    """Grow a tree one node at a time, always adding the frontier node of largest acceptance probability.

    The frontier holds the children of the root and of the nodes added so far whose left sibling (rank
    ``r - 1`` under the same parent) is present, so every tree has its left siblings. Ties go to the node
    first in canonical order (shorter, then lexicographically smaller). Nodes of probability 0 are added too
    (after every positive one), so the result has ``max_nodes`` nodes unless the ``[depth][rank]`` grid runs
    out. Medusa's greedy search (``explore_graph`` in FasterDecoding/Medusa ``medusa/eval/gen_results.py``;
    Cai et al. 2024, section 2.3.3); Sequoia (Chen et al. 2024) shows it is optimal among trees with the left
    sibling property under a positional acceptance model.

    Args:
        P: ``[heads][ranks]`` acceptance table (see :func:`node_probability`).
        max_nodes: nodes to add, >= 1.
        max_depth: deepest path (default: ``len(P)``, one rank per head).

    Returns:
        ``(path, probability)`` in adding order. Every prefix is a tree (nested trees: the ``n``-node tree is
        the first ``n`` entries), and each probability is at most its parent's.
    """
    heads, width = _check_table(P)
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
    depth = heads if max_depth is None else min(max_depth, heads)
    if depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth!r}")
    value: dict[Path_, float] = {(): 1.0}
    heap: list[tuple[float, int, Path_]] = [(-float(P[0][0]), 1, (0,))]
    out: list[tuple[Path_, float]] = []
    while heap and len(out) < max_nodes:
        neg, _, path = heapq.heappop(heap)
        value[path] = -neg
        out.append((path, -neg))
        d, r = len(path) - 1, path[-1]
        if r + 1 < width:  # right sibling: its left sibling (this node) is now present
            sib = path[:-1] + (r + 1,)
            heapq.heappush(heap, (-value[path[:-1]] * P[d][r + 1], len(sib), sib))
        if len(path) < depth:  # first child
            heapq.heappush(heap, (-value[path] * P[d + 1][0], len(path) + 1, path + (0,)))
    return out


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated ``(cost, value)`` points, by increasing cost.

    A point is dominated when another has cost <= and value >= with at least one strict; of exact duplicates
    the first is kept. Used with cost = relative step time and value = expected tokens per step.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    out, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            out.append(i)
            best = points[i][1]
    return out


def best_ratio(points: Sequence[tuple[float, float]]) -> int:
    """Index of the point with the largest ``value / cost`` (expected speed-up over plain decoding); ties go to
    the cheaper point, then the earlier one. Costs must be > 0."""
    if not points:
        raise ValueError("best_ratio needs at least one point")
    for i, (c, _) in enumerate(points):
        if not c > 0:
            raise ValueError(f"point {i} has cost {c!r}; costs must be > 0")
    return min(range(len(points)), key=lambda i: (-points[i][1] / points[i][0], points[i][0], i))


# ------------------------------------------------------------------------------------------ entropy bins
def quantile_edges(entropy: torch.Tensor, num_bins: int, lower: float = 0.0) -> list[float]:
    """``num_bins - 1`` bin edges at the quantiles ``i / num_bins`` of the scores ``entropy`` (nats, or minus a
    confidence), rounded to 4 decimals; edges <= ``lower`` (the scores' least possible value: 0 nats, or -1
    for minus a confidence) and repeated edges are dropped, so fewer bins may come back when scores are tied."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
    if num_bins == 1 or entropy.numel() == 0:
        return []
    qs = torch.quantile(entropy.double(), torch.arange(1, num_bins, dtype=torch.float64) / num_bins)
    edges: list[float] = []
    for q in qs.tolist():
        q = round(q, 4)
        if q > lower and (not edges or q > edges[-1]):
            edges.append(q)
    return edges


@dataclass
class BinStats:
    """Statistics of one signal bin.

    Attributes:
        index: bin number, 0 = lowest score (lowest entropy, or highest confidence).
        lo, hi: the bin holds scores ``lo <= s < hi`` (``hi`` is ``inf`` for the last bin). The score is the
            signal for ``"entropy"`` (nats) and minus the signal for ``"confidence"``, so that bins always go
            from the most aggressive to the most conservative, as the scheduler's ladder does.
        positions: generated positions in the bin.
        mean_signal: their mean signal value (nats, or probability).
        labels_per_depth: per head, positions whose true token exists (the last ``d + 1`` positions of a
            continuation have none for head ``d``); the denominators of ``P``.
        P: ``[heads][max_rank]`` floats: ``P[d][r]`` = share of those positions where head ``d``'s rank of the
            true token is ``r``; ``1 - sum(P[d])`` is the miss rate (rank >= max_rank).
    """

    index: int
    lo: float
    hi: float
    positions: int
    mean_signal: float
    labels_per_depth: list[int]
    P: list[list[float]]
    signal: str = "entropy"

    def signal_range(self) -> tuple[float | None, float | None]:
        """The bin's range in the signal's unit, ``(low, high)``; None: unbounded. Entropy: ``low <= H < high``;
        confidence: ``low < c <= high``."""
        if self.signal == "confidence":
            return (None if math.isinf(self.hi) else -self.hi, -self.lo)
        return (self.lo, None if math.isinf(self.hi) else self.hi)

    def range_str(self) -> str:
        lo, hi = self.signal_range()
        if self.signal == "confidence":
            return f"({'-inf' if lo is None else f'{lo:.3f}'}, {hi:.3f}]"
        return f"[{lo:.3f}, {'inf' if hi is None else f'{hi:.3f}'})"

    def to_json(self) -> dict:
        return {"bin": self.index, "signal": self.signal, f"{self.signal}_range": list(self.signal_range()),
                "positions": self.positions, "mean_signal": round(self.mean_signal, 6),
                "labels_per_depth": self.labels_per_depth,
                "P": [[round(x, 6) for x in row] for row in self.P]}


def bin_statistics(entropy: torch.Tensor, ranks: torch.Tensor, edges: Sequence[float], max_rank: int,
                   signal: str = "entropy") -> list[BinStats]:
    """Per-bin rank tables.

    Args:
        entropy: ``float32 [N]`` scores, one per generated position: the entropy signal (nats), or minus the
            confidence signal (``signal``).
        ranks: ``int [N, heads]``: the true token's rank per head (0 = top-1), ``NO_LABEL`` (-1) where there is
            no true token; ranks >= ``max_rank`` count as misses.
        edges: strictly increasing bin edges on the scores; a position goes to the bin of the number of edges <=
            its score (as the scheduler maps a value on a threshold to the more conservative bin).
        max_rank: ranks kept per head (the table width), >= 1.

    Returns:
        ``len(edges) + 1`` :class:`BinStats` (a bin may have 0 positions; its ``P`` is all zeros).
    """
    if entropy.dim() != 1 or ranks.dim() != 2 or ranks.shape[0] != entropy.shape[0]:
        raise ValueError(f"entropy [N] and ranks [N, heads] expected, got {tuple(entropy.shape)} and "
                         f"{tuple(ranks.shape)}")
    bounds = torch.tensor(list(edges), dtype=torch.float64)
    which = torch.bucketize(entropy.double(), bounds, right=True)
    lows, highs = [0.0 if signal == "entropy" else -1.0, *edges], [*edges, math.inf]
    out = []
    for b in range(len(edges) + 1):
        sel = which == b
        rk = ranks[sel].long()
        labelled = rk >= 0
        n_lab = labelled.sum(0).tolist()
        table = []
        for d in range(ranks.shape[1]):
            counts = torch.bincount(rk[labelled[:, d], d].clamp(max=max_rank), minlength=max_rank + 1)
            table.append([c / n_lab[d] if n_lab[d] else 0.0 for c in counts[:max_rank].tolist()])
        n = int(sel.sum())
        mean = score_sign(signal) * float(entropy[sel].double().mean()) if n else math.nan
        out.append(BinStats(b, float(lows[b]), float(highs[b]), n, mean, n_lab, table, signal))
    return out


# ------------------------------------------------------------------------------------------ target pass
def true_token_ranks(logits: torch.Tensor, cols: torch.Tensor, cap: int = RANK_STORE_CAP) -> torch.Tensor:
    """Rank of a chosen column per row: the number of strictly larger logits (0 = the argmax).

    Args:
        logits: ``[N, V]`` float.
        cols: ``int64 [N]`` column of the true token per row; -1 when the token is not in the head's vocabulary.
        cap: ranks are capped at this value (and -1 columns get it).

    Returns:
        ``int64 [N]`` in ``[0, cap]``.
    """
    picked = logits.gather(1, cols.clamp(min=0)[:, None])
    r = (logits > picked).sum(1)
    return torch.where(cols < 0, torch.full_like(r, cap), r.clamp(max=cap))


@dataclass
class TargetView:
    """What the statistics need from the target model (float32).

    Attributes:
        model: a transformers causal LM (``base_model`` gives the final-norm hidden states).
        lm_head: ``[vocab, hidden]`` weight of its output embedding.
        embed: its input embedding (token ids -> ``[.., hidden]``).
        eos_ids: token ids that end a continuation.
    """

    model: Any
    lm_head: torch.Tensor
    embed: Callable[[torch.Tensor], torch.Tensor]
    eos_ids: frozenset[int]

    @classmethod
    def of(cls, model, tokenizer=None) -> TargetView:
        eos: set[int] = set()
        for src in (getattr(model, "generation_config", None), model.config, tokenizer):
            e = getattr(src, "eos_token_id", None)
            eos.update(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
        return cls(model, model.get_output_embeddings().weight.detach(), model.get_input_embeddings(),
                   frozenset(int(x) for x in eos))


@torch.inference_mode()
def greedy_continuation(view: TargetView, prompt_ids: Sequence[int], max_tokens: int
                        ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy decoding with a KV cache.

    Returns:
        ``(tokens, hidden, entropy)``: the ``T <= max_tokens`` generated token ids (ending at an EOS token, which
        is kept), ``float32 [T, hidden]`` final-norm hidden states ``h_t`` (row ``t`` is the state whose logits
        chose ``tokens[t]``) and ``float32 [T]`` entropies (nats) of those next-token distributions.
    """
    from transformers import DynamicCache

    from vllm_entmtp.entropy import entropy_nats

    lm = view.model.get_output_embeddings()
    cache = DynamicCache(config=view.model.config)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    tokens, hidden, ent = [], [], []
    for _ in range(max_tokens):
        h = view.model.base_model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
        logits = lm(h[None]).float()
        y = int(logits[0].argmax())
        tokens.append(y)
        hidden.append(h.float())
        ent.append(entropy_nats(logits)[0])
        if y in view.eos_ids:
            break
        ids = torch.tensor([[y]], dtype=torch.long)
    return tokens, torch.stack(hidden), torch.stack(ent)


@torch.inference_mode()
def head_ranks(heads, view: TargetView, tokens: Sequence[int], hidden: torch.Tensor, chunk: int = 32
               ) -> torch.Tensor:
    """Rank of the true token per position and head along a greedy continuation.

    Args:
        heads: ``MedusaHeads`` (head ``d`` reads ``h_t``) or ``HydraHeads`` (head ``d`` reads ``h_t`` and the
            embeddings of the true path ``y_{t+1} .. y_{t+d+1}``, i.e. ``tokens[t .. t+d]``).
        tokens: the ``T`` generated tokens ``y_1 .. y_T`` (``tokens[t]`` is ``y_{t+1}``).
        hidden: ``float32 [T, hidden]``: ``hidden[t]`` is ``h_t``, whose target logits chose ``y_{t+1}``.

    Returns:
        ``int16 [T, heads]``: rank of ``y_{t+d+2}`` (``tokens[t + d + 1]``) in head ``d``'s logits at ``t``,
        capped at :data:`RANK_STORE_CAP`; :data:`NO_LABEL` where ``t + d + 1 >= T``.
    """
    from vllm_entmtp.heads.hydra import HydraHeads

    T, K = len(tokens), heads.num_heads
    y = torch.tensor(list(tokens), dtype=torch.long)
    out = torch.full((T, K), NO_LABEL, dtype=torch.int16)
    if not isinstance(heads, HydraHeads):  # every head reads h_t: one pass of all heads per chunk of positions
        for s in range(0, max(T - 1, 0), chunk):
            t = torch.arange(s, min(s + chunk, T - 1))
            logits = heads.logits(hidden[t], view.lm_head).float()  # [K, n, V]
            for d in range(K):
                ok = t + d + 1 < T
                out[t[ok], d] = true_token_ranks(logits[d][ok], y[t[ok] + d + 1]).to(torch.int16)
        return out
    w = heads.draft_lm_weight(view.lm_head)
    col_of = None  # target token id -> draft-vocabulary column (-1: not in it)
    if heads.token_map is not None:
        col_of = torch.full((view.lm_head.shape[0],), -1, dtype=torch.long)
        col_of[heads.token_map] = torch.arange(len(heads.token_map))
    for d in range(K):
        n = T - d - 1  # positions t = 0 .. n - 1 have a label
        for s in range(0, max(n, 0), chunk):
            t = torch.arange(s, min(s + chunk, n))
            label = y[t + d + 1]
            path = torch.stack([y[t + j] for j in range(d + 1)], dim=1)  # y_{t+1} .. y_{t+d+1}: [n, d + 1]
            x = heads.hidden_states(d, hidden[t], view.embed(path).float())
            cols = col_of[label] if col_of is not None else label
            out[t, d] = true_token_ranks(heads.logits(d, x, w).float(), cols).to(torch.int16)
    return out


# ------------------------------------------------------------------------------------------ prompts and cache
def _messages_of(row: Any) -> list[dict] | None:
    """Chat messages of one JSONL object (``prompt`` or ``messages``), or None when it has neither."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    msgs = row.get("messages")
    ok = isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 for m in msgs)
    return msgs if ok else None


def read_jsonl_prompts(path: str | Path) -> list[dict]:
    """Prompts of a JSONL file: one object per line with ``prompt`` (a string: one user turn) or ``messages``
    (OpenAI-style chat messages); blank lines are skipped. Returns ``[{"id", "messages"}]`` (``id``: the
    object's ``id``, else ``line<N>``).

    Raises:
        ValueError: unreadable file, malformed line, or a line with neither key (the line number is named).
    """
    path = Path(path)
    try:
        numbered = [(i, ln) for i, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--jsonl {path}: cannot read: {e}") from None
    out = []
    for i, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--jsonl {path}, line {i}: malformed JSON: {e.msg}") from None
        msgs = _messages_of(row)
        if msgs is None:
            raise ValueError(f"--jsonl {path}, line {i}: expected an object with \"prompt\" (a string) or "
                             f"\"messages\" (a non-empty list of {{\"role\", \"content\"}}), got {line[:80]!r}")
        out.append({"id": str(row.get("id", f"line{i}")), "messages": msgs})
    if not out:
        raise ValueError(f"--jsonl {path}: no prompts")
    return out


def render_prompt(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    """Token ids of ``messages`` through the chat template with the generation prompt (the plain contents
    joined by newlines when the tokenizer has no template), keeping the last ``max_prompt_tokens``."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids[-max_prompt_tokens:])


def _file_digest(path: Path) -> str:
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
    return {"path": str(p), "config": _file_digest(p / "config.json"),
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
        _log(f"ignoring unreadable statistics cache {path}: {e}")
        return []
    if blob.get("version") != STATS_VERSION or blob.get("key") != key:
        _log(f"ignoring statistics cache {path}: built for other settings")
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
        (``float32 [T]`` nats), ``ranks`` (``int16 [T, heads]``, see :func:`head_ranks`) and ``head_top1``
        (``float32 [T, heads]``, see :func:`greedy_chain_top1`).
    """
    from tqdm import tqdm

    drafter = make_drafter(heads, view)
    records = _load_cache(cache_path, key)
    if records:
        _log(f"statistics cache {cache_path}: {len(records)} prompt(s) done")
    for p in tqdm(prompts[len(records):], desc="target + heads", unit="prompt", initial=0,
                  disable=len(records) >= len(prompts)):
        ids = render_prompt(tokenizer, p["messages"], max_prompt_tokens)
        tokens, hidden, ent = greedy_continuation(view, ids, max_tokens)
        ranks = head_ranks(heads, view, tokens, hidden)
        records.append({"id": p["id"], "prompt_tokens": len(ids), "tokens": tokens, "entropy": ent,
                        "ranks": ranks, "head_top1": greedy_chain_top1(drafter, tokens, hidden)})
        _save_cache(cache_path, key, records)
    return records[:len(prompts)]


@torch.inference_mode()
def greedy_chain_top1(drafter, tokens: Sequence[int], hidden: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The heads' top-1 probabilities along their own greedy chain at every position, as the runtime sees them.

    Args:
        drafter: the runtime drafter (:func:`make_drafter`); its ``confidence`` is what the engine feeds the
            tracker each step.
        tokens: the ``T`` generated tokens; ``tokens[t]`` is the bonus token at position ``t``.
        hidden: ``float32 [T, hidden]``, ``h_t``.

    Returns:
        ``float32 [T, heads]``.
    """
    y = torch.tensor(list(tokens), dtype=torch.long)
    parts = [drafter.confidence(hidden[s:s + chunk], y[s:s + chunk])[0].float()
             for s in range(0, len(tokens), chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, drafter.num_heads)


def signal_series(records: Sequence[dict], signal: str, window: int, confidence_heads: int | None = None
                  ) -> torch.Tensor:
    """Per generated position, the scheduler's score as the runtime :class:`~vllm_entmtp.entropy.EntropyTracker`
    would hold it there, updated once per token (the engine updates once per step; with accepted draft tokens a
    step covers several tokens): ``"entropy"``: the bias-corrected EMA (window ``window``) of the entropy
    (nats); ``"confidence"``: minus the path confidence (product of the per-head EMAs of the top-1
    probabilities of the first ``confidence_heads`` heads (None: all), window ``window``). One tracker per record
    (a request).

    Returns:
        ``float32 [N]``, ``N`` = all records' positions, in order.

    Raises:
        ValueError: unknown ``signal``.
    """
    from vllm_entmtp.entropy import EntropyTracker

    if signal not in SIGNALS:
        raise ValueError(f"unknown signal {signal!r}; allowed: {', '.join(SIGNALS)}")
    out: list[float] = []
    for i, r in enumerate(records):
        tr = EntropyTracker(entropy_window=window, confidence_window=window)
        rid = str(i)
        ent = r["entropy"].tolist()
        top1 = r["head_top1"][:, :confidence_heads].tolist() if signal == "confidence" else [None] * len(ent)
        for e, c in zip(ent, top1):
            tr.update(rid, e, c)
            sg = tr.signals(rid)
            out.append(sg.entropy_ema if signal == "entropy" else -sg.confidence)
    return torch.tensor(out, dtype=torch.float32)


def signal_correlations(records: Sequence[dict], entropy_window: int) -> dict[str, dict]:
    """How well each candidate signal predicts acceptance at a position, to choose ``--signal``.

    Signals: the entropy EMA (window ``entropy_window``, negated: lower entropy should mean more acceptance),
    this position's entropy (negated), and the path confidence of the first ``k`` heads (window 1) for ``k`` =
    1, 2 and all. Targets: whether head 0's top-1 is the true token (the first draft token is accepted), and the
    greedy chain's accepted length (leading heads whose top-1 is right, along the true path).

    Returns:
        ``{signal: {"r_first": Pearson r, "r_chain": Pearson r, "first_hit_top30": rate, "first_hit_bottom30":
        rate}}`` over the positions where every head has a true token; the rates are head 0's hit rate among
        the 30 % of positions with the highest / lowest signal.
    """
    ranks = torch.cat([r["ranks"] for r in records]).long()
    top1 = torch.cat([r["head_top1"] for r in records]).double()
    k = ranks.shape[1]
    sig = {"entropy_ema": -signal_series(records, "entropy", entropy_window).double(),
           "entropy_last": -signal_series(records, "entropy", 1).double()}
    for h in sorted({1, min(2, k), k}):
        sig[f"confidence_{h}_heads"] = top1[:, :h].prod(1)
    ok = (ranks >= 0).all(1)
    first = (ranks[ok, 0] == 0).double()
    chain = chain_outcomes(records)[0].double()  # the top-1 chain's accepted length at the same positions

    def r(a: torch.Tensor, b: torch.Tensor) -> float | None:
        x = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        return round(x, 4) if math.isfinite(x) else None  # NaN: a constant series

    out = {}
    for name, v in sig.items():
        v = v[ok]
        if v.numel() < 2:
            continue
        hi, lo = v >= v.quantile(0.7), v <= v.quantile(0.3)
        out[name] = {"r_first": r(v, first), "r_chain": r(v, chain),
                     "first_hit_top30": round(float(first[hi].mean()), 4),
                     "first_hit_bottom30": round(float(first[lo].mean()), 4)}
    return out


# ------------------------------------------------------------------------------------------ cost
@torch.inference_mode()
def measure_verify_times(model, sizes: Sequence[int], context_tokens: int = 256, repeats: int = 7,
                         warmup: int = 1, seed: int = 0) -> dict[int, float]:
    """Seconds of one target forward over ``n + 1`` new tokens (root + ``n`` draft nodes) after a KV cache of
    ``context_tokens`` random tokens, with logits for every new token, for each ``n`` in ``sizes`` (0 = a plain
    decode step). Median of ``repeats`` runs after ``warmup``; the sizes are interleaved in every round so that
    drift in the machine's load spreads over all of them. transformers' causal mask is used, not a tree mask
    (the same work; the model's own kernels, not vLLM's).
    """
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, vocab, (1, context_tokens), generator=g), past_key_values=cache,
          use_cache=True, logits_to_keep=1)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rnd in range(warmup + repeats):
        for n in sizes:
            x = torch.randint(0, vocab, (1, n + 1), generator=g)
            t0 = time.perf_counter()
            model(input_ids=x, past_key_values=cache, use_cache=True)
            dt = time.perf_counter() - t0
            cache.crop(-(n + 1))
            if rnd >= warmup:
                times[n].append(dt)
    return {n: statistics.median(v) for n, v in times.items()}


def monotone_times(times: dict[int, float]) -> dict[int, float]:
    """Verification times made non-decreasing in the node count (a running maximum): verifying more nodes is
    never cheaper, so a smaller median for more nodes is timing noise on a shared machine."""
    out, hi = {}, 0.0
    for n in sorted(times):
        hi = max(hi, times[n])
        out[n] = hi
    return out


def make_drafter(heads, view: TargetView):
    """The drafter the server runs (:func:`vllm_entmtp.proposer.make_drafter`, kernels measured on this machine
    included) for ``heads`` over the transformers target."""
    from vllm_entmtp.proposer import make_drafter as runtime_drafter

    w = view.lm_head
    return runtime_drafter(heads, embed=view.embed, lm_head_weight=w, compute_logits=lambda x: x @ w.t())


@torch.inference_mode()
def measure_draft_times(drafter, trees: Sequence, hidden: torch.Tensor, bonus: int, repeats: int = 7,
                        warmup: int = 1) -> list[float]:
    """Seconds the drafter needs to propose each tree for one request (Medusa: one pass of the heads and a
    top-k; Hydra: one head evaluation per depth for the nodes with children); median of ``repeats`` after
    ``warmup``, trees interleaved per round. ``hidden``: ``[1, hidden]``; ``bonus``: the root's token id."""
    bonus_t = torch.tensor([bonus], dtype=torch.long)
    times: list[list[float]] = [[] for _ in trees]
    for rnd in range(warmup + repeats):
        for i, tree in enumerate(trees):
            t0 = time.perf_counter()
            drafter.propose(hidden, [tree], bonus=bonus_t)
            if rnd >= warmup:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(v) for v in times]


# ------------------------------------------------------------------------------------------ choosing trees
@dataclass
class Candidate:
    """One bin's greedy tree at one node budget, with its measured cost and expected value.

    ``cost`` and its parts are relative to a plain decode step (one token verified, no drafting) = 1.0;
    ``tokens_per_step`` includes the bonus token; ``speedup = tokens_per_step / cost``.
    """

    bin: int
    budget: int  # the node budget asked for (num_nodes is smaller when the [depth][rank] grid ran out)
    paths: tuple[Path_, ...]  # adding order
    accepted: float
    verify_cost: float = math.nan
    draft_cost: float = math.nan

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def key(self) -> tuple[Path_, ...]:
        return tuple(sorted(self.paths, key=lambda p: (len(p), p)))

    @property
    def tokens_per_step(self) -> float:
        return 1.0 + self.accepted

    @property
    def cost(self) -> float:
        return self.verify_cost + self.draft_cost

    @property
    def speedup(self) -> float:
        return self.tokens_per_step / self.cost


@dataclass
class BinChoice:
    """The candidates of a bin, its Pareto frontier, the chosen tree (None: no drafting is best) and the best
    tree even when it is below 1 (``scheduled``; reported, and kept in the set for static use). The schedule
    gives a bin whose ``chosen`` is None the reserved entry "none" (no drafting)."""

    stats: BinStats
    candidates: list[Candidate]
    frontier: list[Candidate]
    chosen: Candidate | None
    scheduled: Candidate = field(init=False)

    def __post_init__(self):
        self.scheduled = self.chosen if self.chosen is not None else self.candidates[
            best_ratio([(c.cost, c.tokens_per_step) for c in self.candidates])]


def candidates_for_bin(stats: BinStats, budgets: Sequence[int], num_heads: int) -> list[Candidate]:
    """The greedy tree of ``stats.P`` at every budget (nested trees; a budget past the ``[depth][rank]`` grid
    gets the whole grid; a tree equal to a smaller budget's is left out)."""
    order = greedy_tree(stats.P, max(budgets), max_depth=num_heads)
    out: list[Candidate] = []
    for n in budgets:
        paths = tuple(p for p, _ in order[:n])
        if out and len(paths) == out[-1].num_nodes:
            continue
        out.append(Candidate(stats.index, n, paths, expected_accepted(paths, stats.P)))
    return out


def choose(stats: BinStats, cands: list[Candidate]) -> BinChoice:
    """Pareto frontier and best expected speed-up among ``cands`` and "no drafting" (cost 1, 1 token/step)."""
    points = [(1.0, 1.0)] + [(c.cost, c.tokens_per_step) for c in cands]
    front = [cands[i - 1] for i in pareto_frontier(points) if i > 0]
    best = best_ratio(points)
    return BinChoice(stats, cands, front, cands[best - 1] if best > 0 else None)


def expected_overall(choices: list[BinChoice]) -> dict:
    """Expected speed-up over plain decoding, over all positions (bins weighted by their positions, one step per
    position as an approximation): of the schedule (each bin drafting its chosen tree, or nothing) and of
    every candidate tree drafted in every bin; ``sum_b w_b T_b / sum_b w_b C_b`` with ``T`` the expected
    tokens per step (bonus included) and ``C`` the cost.

    Returns:
        ``{"schedule": x, "best_static": {"paths": [[rank, ...], ...], "num_nodes": n, "speedup": x}}``.
    """
    w = [b.stats.positions for b in choices]

    def overall(per_bin: list[tuple[float, float]]) -> float:
        return sum(wi * t for wi, (t, _) in zip(w, per_bin)) / sum(wi * c for wi, (_, c) in zip(w, per_bin))

    sched = overall([(b.chosen.tokens_per_step, b.chosen.cost) if b.chosen is not None else (1.0, 1.0)
                     for b in choices])
    best = None
    for c in {c.key: c for b in choices for c in b.candidates}.values():
        x = overall([(1.0 + expected_accepted(c.key, b.stats.P), c.cost) for b in choices])
        if best is None or x > best[1]:
            best = (c, x)
    out = {"schedule": round(sched, 4)}
    if best is not None:
        out["best_static"] = {"paths": [list(p) for p in best[0].key], "num_nodes": best[0].num_nodes,
                              "speedup": round(best[1], 4)}
    return out


CHAIN_STOP_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95


def chain_outcomes(records: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position with a true token for every head: ``(lead, path_conf, ranks)``. ``lead``: ``int64 [N]``,
    how many of the heads' top-1 tokens along the true path are right in a row (a chain of ``n`` draft tokens
    accepts ``min(n, lead)``); ``path_conf``: ``float32 [N, heads]``, the product of the heads' top-1
    probabilities along their own greedy chain up to each head (what the drafter cuts a chain on);
    ``ranks``: ``int64 [N, heads]``. Positions near a continuation's end (a head without a true token) are left
    out."""
    ranks = torch.cat([r["ranks"] for r in records]).long()
    top1 = torch.cat([r["head_top1"] for r in records]).float()
    full = (ranks >= 0).all(dim=1)
    ranks, top1 = ranks[full], top1[full]
    lead = torch.cumprod((ranks == 0).long(), dim=1).sum(dim=1)
    return lead, torch.cumprod(top1, dim=1), ranks


def cut_depths(path_conf: torch.Tensor, depth: int, tau: float) -> torch.Tensor:
    """``int64 [N]``: nodes a chain of ``depth`` keeps under ``chain_stop = tau``: the first, then each next while
    the path confidence up to its head is >= ``tau`` (``vllm_entmtp.proposer.MTPDrafter.propose``)."""
    ok = (path_conf[:, 1:depth] >= tau).long()
    return 1 + torch.cumprod(ok, dim=1).sum(dim=1)


def fit_chain_stop(lead: torch.Tensor, path_conf: torch.Tensor, chain_cost: Sequence[float],
                   taus: Sequence[float] = CHAIN_STOP_GRID) -> dict:
    """Speed-ups over plain decoding, position by position on the calibration's own outcomes (one step per
    position, as :func:`expected_overall`): of each chain of 1 to ``heads`` nodes, and of each chain of 2 or
    more nodes cut at each ``tau``; the best cut chain.

    Args:
        lead, path_conf: from :func:`chain_outcomes`.
        chain_cost: ``chain_cost[n]``, the step cost of a chain of ``n`` draft nodes (``[0]`` = 1.0, no
            drafting), ``n`` up to the number of heads.

    Returns:
        ``{"chains": {n: x}, "cut": {depth: {tau: x}}, "best": {"depth": d, "chain_stop": tau, "speedup": x}}``.
    """
    cost = torch.tensor(list(chain_cost), dtype=torch.float64)
    heads = path_conf.shape[1]

    def speed(nodes: torch.Tensor) -> float:
        tokens = 1 + torch.minimum(nodes, lead)
        return float(tokens.sum() / cost[nodes].sum())

    chains = {n: round(speed(torch.full_like(lead, n)), 4) for n in range(1, heads + 1)}
    cut = {d: {t: round(speed(cut_depths(path_conf, d, t)), 4) for t in taus} for d in range(2, heads + 1)}
    d, t = max(((d, t) for d in cut for t in cut[d]), key=lambda dt: (cut[dt[0]][dt[1]], -dt[0]))
    return {"chains": chains, "cut": cut, "best": {"depth": d, "chain_stop": t, "speedup": cut[d][t]}}


def schedule_speedup_on_outcomes(choices: list[BinChoice], score: torch.Tensor, full: torch.Tensor,
                                 ranks: torch.Tensor) -> float:
    """The bins' schedule (each position drafting its bin's scheduled tree, or nothing) evaluated position by
    position on the calibration's outcomes, like :func:`fit_chain_stop`: a tree accepts its deepest node whose
    path of ranks matches the true tokens' ranks. ``score``: the scheduler's score of every position, binned at
    the choices' lower edges; ``full``: the positions :func:`chain_outcomes` kept (bool mask over ``score``),
    ``ranks`` their ranks."""
    edges = torch.tensor([float(b.stats.lo) for b in choices[1:]], dtype=torch.float64)
    which = torch.bucketize(score[full].double(), edges, right=True)
    by_bin = {b.stats.index: b.chosen for b in choices}
    tokens = cost = 0.0
    for w, rk in zip(which.tolist(), ranks.tolist()):
        c = by_bin.get(w)
        if c is None:
            tokens, cost = tokens + 1.0, cost + 1.0
            continue
        nodes = set(c.key)
        d = 0
        while d < len(rk) and tuple(rk[:d + 1]) in nodes:
            d += 1
        tokens, cost = tokens + 1.0 + d, cost + c.cost
    return round(tokens / cost, 4)


def _tree_metadata(c: Candidate, key: tuple[Path_, ...], choices: list[BinChoice], verify_ms: float,
                   draft_ms: float) -> dict:
    from vllm_entmtp.trees import Tree

    t = Tree(key)
    per_depth = [t.depths.count(d) for d in range(1, t.depth + 1)]
    acc = [expected_accepted(key, b.stats.P) for b in choices]
    return {
        "num_nodes": t.num_nodes, "depth": t.depth, "nodes_per_depth": per_depth,
        "topk_per_depth": [r + 1 for r in t.max_rank_per_depth],
        "expected_accepted_per_bin": [round(a, 4) for a in acc],
        "expected_tokens_per_step_per_bin": [round(1 + a, 4) for a in acc],
        "cost": {"verify": round(c.verify_cost, 4), "draft": round(c.draft_cost, 4), "total": round(c.cost, 4)},
        "verify_ms": round(verify_ms, 3), "draft_ms": round(draft_ms, 3),
        "expected_speedup_per_bin": [round((1 + a) / c.cost, 4) for a in acc],
        "frontier_in_bins": [b.stats.index for b in choices if any(f.key == key for f in b.frontier)],
        "chosen_in_bins": [b.stats.index for b in choices if b.chosen is not None and b.chosen.key == key],
        "source": f"vllm-entmtp build-trees: greedy tree of {choices[0].stats.signal} bin {c.bin} at a budget of "
                  f"{c.num_nodes} nodes",
    }


def _fit_chain_stop_schedule(asked: str | float, records: Sequence[dict], score: torch.Tensor,
                             bins: list[BinStats], choices: list[BinChoice],
                             chains: list[tuple[Path_, ...]], step_costs: dict
                             ) -> tuple[tuple[float, list[Candidate]] | None, dict]:
    """``build-trees --chain-stop``: fit (``"auto"``) or take the cut, compare it with the bins' ladder on the
    calibration's positions; ``((tau, [D-node chain, 1-node chain]) or None, the record for
    metadata.calibration)``."""
    lead, path_conf, ranks = chain_outcomes(records)
    full = torch.cat([(r["ranks"] >= 0).all(dim=1) for r in records])
    chain_cost = [1.0] + [step_cost_of(step_costs, k) for k in chains]
    taus = CHAIN_STOP_GRID if asked == "auto" else (float(asked),)
    fit = fit_chain_stop(lead, path_conf, chain_cost, taus)
    ladder = schedule_speedup_on_outcomes(choices, score, full, ranks)
    best = fit["best"]
    use = asked != "auto" or best["speedup"] > ladder
    chosen = None
    if use:
        chosen = [Candidate(bin=0, budget=len(key), paths=key, accepted=expected_accepted(key, bins[0].P),
                            verify_cost=chain_cost[len(key)], draft_cost=0.0)
                  for key in (chains[best["depth"] - 1], chains[0])]
    info = {"fit": "position by position on the calibration's outcomes (one step per position): speed-up over "
                   "plain decoding of the bins' ladder, of each chain, and of each chain of 2+ nodes cut at each "
                   "chain_stop (step costs of chains from --step-costs)",
            "positions": int(lead.numel()), "ladder": ladder, "chains": fit["chains"],
            "cut": {str(d): {str(t): x for t, x in row.items()} for d, row in fit["cut"].items()},
            "best": best, "asked": asked,
            "chosen": {"depth": best["depth"], "chain_stop": best["chain_stop"]} if use else None}
    return ((best["chain_stop"], chosen) if use else None), info


def build_tree_set(choices: list[BinChoice], *, name: str, heads_kind: str, num_heads: int,
                   times_ms: dict[str, Any], calibration: dict, hysteresis: float | None = None,
                   chain_stop: tuple[float, list[Candidate]] | None = None) -> tuple[dict, list[str]]:
    """The tree-set JSON object (``docs/trees.md``, schema version 1) with a ``schedule``.

    Bins (``choices``, all of one signal, most aggressive first) become the schedule's ladder, with thresholds
    in the signal's unit (strictly increasing nats for entropy, strictly decreasing probabilities for confidence).
    Trees: every bin's frontier trees and the scheduled ones, identical trees once (id ``b{bin}n{nodes}`` of
    the first bin that produced it), smallest first. Schedule: bin ``i``'s scheduled tree, thresholds = the
    edges between bins; neighbouring bins with the same tree are merged (their edge dropped), and a tree
    scheduled again after another gets a copy under its own bin's id (ids in a ladder are unique).
    ``calibration`` (statistics, cost table, settings) goes into the metadata of the first tree.
    With ``chain_stop = (tau, [chain of D nodes, chain of 1 node])``, the schedule is the chain of D nodes for
    every request, cut at ``tau`` (``schedule.chain_stop``), instead of the bins' ladder; with the confidence
    signal the ladder is ``[D-chain, 1-chain]`` with the threshold ``tau`` and hysteresis 0 (unless given):
    the same drafts, since a first head below ``tau`` keeps only the first node anyway, and under load the
    scheduler steps a request down to one node before it stops drafting. The chains join the trees.

    Args:
        times_ms: ``{"verify": {n: ms}, "draft": {tree key: ms}}``.

    Returns:
        ``(tree-set object, the tree id each bin is scheduled to)`` (with ``chain_stop``: the bins' ladder it
        replaced).
    """
    entries: dict[tuple[Path_, ...], tuple[str, Candidate]] = {}
    for b in choices:
        for c in [*b.frontier, b.scheduled]:
            entries.setdefault(c.key, (f"b{c.bin}n{c.num_nodes}", c))
    ladder: list[tuple[str, tuple[Path_, ...]]] = []
    thresholds: list[float] = []  # in the signal's unit (bin edges are on scores: minus the confidence)
    signal = choices[0].stats.signal if choices else "entropy"
    sign = score_sign(signal)
    extra: dict[str, tuple[tuple[Path_, ...], Candidate]] = {}
    bin_ids: list[str] = []
    no_draft = False
    for b in choices:
        # a bin where drafting nothing is best, and every more conservative bin (higher entropy, lower
        # confidence), draft nothing (the reserved last entry "none" of a schedule)
        no_draft = no_draft or b.chosen is None
        if no_draft:
            if not ladder or ladder[-1][0] != NO_DRAFT_ID:
                if ladder:
                    thresholds.append(sign * float(b.stats.lo))
                ladder.append((NO_DRAFT_ID, ()))
            bin_ids.append(NO_DRAFT_ID)
            continue
        key = b.scheduled.key
        tid = entries[key][0]
        if ladder and ladder[-1][1] == key:
            bin_ids.append(ladder[-1][0])
            continue  # same tree as the previous bin: merge the bins
        if any(t == tid for t, _ in ladder):
            tid = f"b{b.stats.index}n{b.scheduled.num_nodes}"
            extra[tid] = (key, b.scheduled)
        if ladder:
            thresholds.append(sign * float(b.stats.lo))
        ladder.append((tid, key))
        bin_ids.append(tid)
    if chain_stop is not None:
        tau, chains = chain_stop
        if signal != "confidence" or chains[0].num_nodes == chains[-1].num_nodes:
            chains = chains[:1]
        ladder = [(entries.setdefault(c.key, (f"chain{c.num_nodes}", c))[0], c.key) for c in chains]
        thresholds = [tau] if len(ladder) == 2 else []
        if hysteresis is None and thresholds:
            hysteresis = 0.0
    trees = [(tid, key, c) for key, (tid, c) in entries.items()] + [(t, k, c) for t, (k, c) in extra.items()]
    trees.sort(key=lambda it: (len(it[1]), it[0]))
    out_trees = []
    for tid, key, c in trees:
        md = _tree_metadata(c, key, choices, times_ms["verify"][len(key)], times_ms["draft"][key])
        out_trees.append({"id": tid, "paths": [list(p) for p in key], "metadata": md})
    out_trees[0]["metadata"]["calibration"] = calibration
    sched: dict[str, Any] = {"signal": signal, "thresholds": thresholds, "tree_ids": [t for t, _ in ladder]}
    if hysteresis is not None:
        sched["hysteresis"] = float(hysteresis)
    if chain_stop is not None:
        sched["chain_stop"] = float(chain_stop[0])
    summary = "; ".join(
        f"bin {b.stats.index} {_SIGNAL_LABEL[signal]} in {b.stats.range_str()}: "
        + ("none (no tree is expected to beat plain decoding)" if tid == NO_DRAFT_ID else tid)
        for b, tid in zip(choices, bin_ids))
    if chain_stop is not None:
        summary = (f"Scheduled: the chain {ladder[0][0]} cut where the heads' path confidence falls below "
                   f"{chain_stop[0]} (schedule.chain_stop)"
                   + (f", {ladder[1][0]} below that first-head confidence" if len(ladder) == 2 else "")
                   + f"; the bins' ladder it replaced: {summary}")
    desc = (f"Built by vllm-entmtp build-trees from {calibration['prompts']} ({calibration['positions']} "
            f"positions) for {heads_kind} heads: per {signal} bin, greedy trees at each node budget, their Pareto "
            f"frontier of measured cost vs expected tokens per step, and the tree with the best expected "
            f"speed-up scheduled. {summary}. Statistics and cost table: metadata.calibration of tree "
            f"{out_trees[0]['id']!r}.")
    return {"schema_version": 1, "name": name, "heads": {"kind": heads_kind, "num_heads": num_heads},
            "description": desc, "trees": out_trees, "schedule": sched}, bin_ids


_SIGNAL_LABEL = {"entropy": "H", "confidence": "c"}
_SIGNAL_UNIT = {"entropy": "nats", "confidence": "path confidence"}


# ------------------------------------------------------------------------------------------ plot and table
def plot_frontiers(choices: list[BinChoice], path: Path, title: str = "") -> None:
    """PNG: per bin, expected tokens per step (bonus included) against measured cost for every budget's tree,
    the Pareto frontier as a line, the chosen tree starred (a hollow star: no tree beats plain decoding and this
    is the one scheduled anyway), "no drafting" at (1, 1) and the speed-up-1 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(choices), figsize=(4.6 * len(choices), 4.2), squeeze=False)
    for ax, b in zip(axes[0], choices):
        xs = [c.cost for c in b.candidates]
        ys = [c.tokens_per_step for c in b.candidates]
        ax.scatter(xs, ys, color="0.55", s=18, label="greedy tree per budget")
        for c in b.candidates:
            ax.annotate(str(c.num_nodes), (c.cost, c.tokens_per_step), fontsize=7, xytext=(3, 2),
                        textcoords="offset points")
        fx = [1.0] + [c.cost for c in b.frontier]
        fy = [1.0] + [c.tokens_per_step for c in b.frontier]
        ax.plot(fx, fy, "-o", color="tab:blue", ms=4, label="Pareto frontier")
        ax.scatter([1.0], [1.0], marker="s", color="black", zorder=3, label="no drafting")
        top = max([1.0, *xs, *ys]) * 1.05
        ax.plot([0, top], [0, top], ":", color="tab:red", lw=1, label="speed-up 1")
        c = b.scheduled
        ax.scatter([c.cost], [c.tokens_per_step], marker="*", s=180, zorder=4,
                   color="tab:orange" if b.chosen is not None else "none", edgecolors="tab:orange",
                   label=(f"chosen: {c.num_nodes} nodes, x{c.speedup:.2f}" if b.chosen is not None else
                          f"scheduled, below 1: {c.num_nodes} nodes, x{c.speedup:.2f}"))
        ax.set_xlim(0.9, max([1.0, *xs]) * 1.05)
        ax.set_ylim(0.9, max([1.0, *ys]) * 1.05 + 0.05)
        ax.set_xlabel("cost per step (plain decode step = 1)")
        ax.set_ylabel("expected tokens per step (incl. bonus)")
        ax.set_title(f"bin {b.stats.index}: {_SIGNAL_LABEL[b.stats.signal]} in {b.stats.range_str()} "
                     f"({_SIGNAL_UNIT[b.stats.signal]}), {b.stats.positions} pos.", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(choices: list[BinChoice], bin_ids: Sequence[str]) -> str:
    """The printed summary: one row per bin (``bin_ids``: the tree id each bin is scheduled to)."""
    signal = choices[0].stats.signal if choices else "entropy"
    label = "entropy (nats)" if signal == "entropy" else "path confidence"
    head = (f"{'bin':>3}  {label:<17} {'positions':>9} {'mean ' + _SIGNAL_LABEL[signal]:>7}  {'tree':<8} {'nodes':>5} "
            f"{'depth':>5} {'tok/step':>8} {'cost':>6} {'(verify+draft)':<15} {'speed-up':>8}")
    rows = [head, "-" * len(head)]
    notes = []
    for b, tid in zip(choices, bin_ids):
        c = b.scheduled
        if tid == NO_DRAFT_ID:
            rows.append(f"{b.stats.index:>3}  {b.stats.range_str():<17} {b.stats.positions:>9} "
                        f"{b.stats.mean_signal:>7.3f}  {'none':<8} {0:>5} {0:>5} {1.0:>8.3f} {1.0:>6.3f} "
                        f"{'':<15} {1.0:>8.3f}")
            notes.append(f"* bin {b.stats.index}: no tree beats plain decoding (best: {c.num_nodes} nodes, "
                         f"{c.tokens_per_step:.3f} tokens/step at cost {c.cost:.3f}, x{c.speedup:.3f}); it drafts "
                         "nothing")
            continue
        rows.append(f"{b.stats.index:>3}  {b.stats.range_str():<17} {b.stats.positions:>9} "
                    f"{b.stats.mean_signal:>7.3f}  {tid:<8} {c.num_nodes:>5} {max(map(len, c.paths)):>5} "
                    f"{c.tokens_per_step:>8.3f} {c.cost:>6.3f} ({c.verify_cost:.3f}+{c.draft_cost:.3f}){'':<2} "
                    f"{c.speedup:>8.3f}")
    rows.append("tok/step: expected tokens per step incl. the bonus token; cost: step time relative to a plain "
                "decode step; speed-up = tok/step / cost (no drafting = 1.000)")
    return "\n".join(rows + notes)


# ------------------------------------------------------------------------------------------ command line
def _int_list(text: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"node budgets must be integers >= 1, got {text!r}")
    return vals


def _edge_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not math.isfinite(v) or v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"bin edges must be finite and > 0, got {text!r}")
    return vals


def edge_scores(edges: Sequence[float], signal: str) -> list[float]:
    """``--edges`` (in the signal's unit) as increasing score edges. Entropy: nats, strictly increasing;
    confidence: probabilities in (0, 1), strictly decreasing (most aggressive bin first), negated.

    Raises:
        ValueError: edges out of order or out of range for the signal.
    """
    if signal == "confidence":
        if any(v >= 1 for v in edges) or any(b >= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"--edges {','.join(map(str, edges))}: confidence edges must be in (0, 1) and strictly "
                             "decreasing (the most aggressive bin first)")
        return [-v for v in edges]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--edges {','.join(map(str, edges))}: entropy edges (nats) must be strictly increasing")
    return list(edges)


def read_step_costs(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[int, float]]:
    """Step costs relative to a step without drafting, ``{"chain": {nodes: cost}, "tree": {nodes: cost}}``, from
    one or more JSON files with a ``step_cost_by_nodes`` object (``benchmarks/ablation.py`` writes one: costs
    measured inside the engine; keys ``"N"`` for chains, ``"Nt"`` for trees that need the tree-attention fix,
    :func:`vllm_entmtp.stats.step_key`). With several files (runs), each key's cost is the median over the files
    that measured it: on this machine one run's costs move by more than a schedule gains (a 1-node draft cost
    0.99-1.15 plain steps from run to run, ``benchmarks/results/ablation-2026-11-30b/``). Either table may be empty (:func:`step_cost_of`
    then uses the other).

    Raises:
        ValueError: unreadable file, no such object, a bad key, or a cost that is not a finite number > 0 per
            node count >= 1 (the message names the file).
    """
    from vllm_entmtp.stats import parse_step_key

    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("--step-costs: no file given")
    seen: dict[str, dict[int, list[float]]] = {"chain": {}, "tree": {}}
    for path in paths:
        out: dict[str, dict[int, float]] = {"chain": {}, "tree": {}}
        try:
            raw = json.loads(Path(path).read_text())["step_cost_by_nodes"]
            for k, c in raw.items():
                n, tree = parse_step_key(str(k))
                out["tree" if tree else "chain"][n] = float(c)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"--step-costs {path}: expected JSON with \"step_cost_by_nodes\": {{\"N\" or \"Nt\": "
                             f"cost}} ({type(e).__name__}: {e})") from None
        out["chain"].pop(0, None)
        costs = [(n, c) for t in out.values() for n, c in t.items()]
        if not costs or any(n < 1 or not math.isfinite(c) or c <= 0 for n, c in costs):
            raise ValueError(f"--step-costs {path}: costs must be finite numbers > 0 for node counts >= 1, "
                             f"got {raw}")
        for kind, t in out.items():
            for n, c in t.items():
                seen[kind].setdefault(n, []).append(c)
    return {kind: {n: statistics.median(cs) for n, cs in sorted(t.items())} for kind, t in seen.items()}


def _chain_stop_arg(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not 0.0 < x < 1.0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number in (0, 1), got {text!r}")
    return x


def step_cost_of(costs: dict[str, dict[int, float]], paths: Sequence[Sequence[int]]) -> float:
    """Measured step cost of the tree ``paths`` (:func:`read_step_costs`): from the tree table when its rows need
    the tree-attention fix (it branches before its end), else from the chain table, interpolated in the node
    count (:func:`interpolate_cost`); when that table is empty, the other one."""
    from vllm_entmtp.stats import needs_attention_fix
    from vllm_entmtp.trees import Tree

    t = Tree([list(p) for p in paths])
    kind = "tree" if needs_attention_fix(t) else "chain"
    table = costs.get(kind) or costs.get("chain" if kind == "tree" else "tree")
    return interpolate_cost(table, t.num_nodes)


def interpolate_cost(costs: dict[int, float], n: int) -> float:
    """Step cost of ``n`` draft nodes from measured ``costs`` (sorted by nodes): linear between the measured
    sizes around ``n``, from (0, 1.0) below the smallest, and along the last two points' slope past the
    largest; made non-decreasing (a running maximum)."""
    pts = [(0, 1.0), *costs.items()]
    mono, hi = [], 0.0
    for k, c in pts:
        hi = max(hi, c)
        mono.append((k, hi))
    for (a, ca), (b, cb) in zip(mono, mono[1:]):
        if a <= n <= b:
            return ca + (cb - ca) * (n - a) / (b - a)
    (a, ca), (b, cb) = mono[-2], mono[-1]
    return cb + (cb - ca) / (b - a) * (n - b)


def _positive(kind: type, minimum: float = 1):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-set", help="prompt set of vllm_entmtp.datasets (humaneval, gsm8k, sharegpt, "
                                          "creative, mtbench)")
    src.add_argument("--jsonl", help="JSONL file of prompts: {\"prompt\": str} or {\"messages\": [...]} per line")
    p.add_argument("--num-prompts", type=_positive(int), default=20, help="first N prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive(int, 2), default=128,
                   help="greedy tokens generated per prompt (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=_positive(int), default=1024,
                   help="keep the last N prompt tokens (default: %(default)s)")
    p.add_argument("--model", help="target model folder (default: the prepared default model)")
    p.add_argument("--heads", help="MTP heads folder, Medusa or Hydra, any supported layout (default: the heads "
                                   "registered for the model)")
    p.add_argument("--out", help="tree-set JSON to write (default: runs/calib/<prompt set or jsonl stem>.json)")
    p.add_argument("--plot", help="PNG of the frontiers (default: next to --out, same stem)")
    p.add_argument("--name", help="the tree set's name (default: <prompts>-<heads kind>)")
    p.add_argument("--signal", choices=SIGNALS, default="entropy",
                   help="what the bins (and the schedule's thresholds) are on: the tracker's entropy EMA, or its "
                        "path confidence; the policy that reads the set must be the same (default: %(default)s)")
    p.add_argument("--signal-window", type=_positive(int), default=None,
                   help="EMA window of the signal, as the runtime tracker keeps it: the entropy_window option "
                        "for entropy, confidence_window for confidence (default: those options' defaults, 16 and 1)")
    p.add_argument("--confidence-heads", type=_positive(int), default=None,
                   help="leading heads whose top-1 probabilities make the path confidence (the confidence_heads "
                        "option; default: its default, 1)")
    p.add_argument("--bins", "--entropy-bins", dest="bins", type=_positive(int), default=3,
                   help="signal bins, edges at the quantiles of the data (default: %(default)s)")
    p.add_argument("--edges", "--entropy-edges", dest="edges", type=_edge_list, default=None,
                   help="explicit bin edges in the signal's unit, comma-separated, most aggressive bin first: "
                        "increasing nats for entropy, decreasing probabilities for confidence (overrides --bins)")
    p.add_argument("--node-budgets", type=_int_list, default=list(DEFAULT_BUDGETS),
                   help="tree sizes tried per bin (default: %s)" % ",".join(map(str, DEFAULT_BUDGETS)))
    p.add_argument("--max-rank", type=_positive(int), default=8,
                   help="top-k ranks per head considered; rank >= this is a miss (default: %(default)s, at most "
                        f"{RANK_STORE_CAP})")
    p.add_argument("--hysteresis", type=_positive(float, 0.0), default=None,
                   help="hysteresis (the signal's unit) written into the schedule (default: none, the scheduler's "
                        "own)")
    p.add_argument("--step-costs", default=None, nargs="+", metavar="JSON",
                   help="step costs measured inside vLLM (\"step_cost_by_nodes\" of benchmarks/ablation.py "
                        "results), used instead of timing a transformers forward and the drafter here; with "
                        "several files (runs), each cost is the median over the files that measured it")
    p.add_argument("--chain-stop", type=_chain_stop_arg, default=None, metavar="auto|TAU",
                   help="also try the schedule 'every request drafts the heads' top-1 chain, cut where its path "
                        "confidence falls below TAU' (schedule.chain_stop; the first node always drafted): auto "
                        "fits the chain depth and TAU on the calibration's positions and writes that schedule "
                        "when it beats the bins' ladder there; a number in (0, 1) writes it with that TAU. Needs "
                        "--step-costs (default: not tried)")
    p.add_argument("--decode-row-cost", type=float, default=None,
                   help="what one more request's decode row adds to a step, in one-request plain steps, measured "
                        "on this hardware (e.g. the slope of plain decoding's step time over batch sizes, "
                        "benchmarks/step_profile.py); recorded as calibration.cost.decode_row_cost for the "
                        "scheduler's load cost model (default: not recorded; the scheduler's default applies)")
    p.add_argument("--cost-context", type=_positive(int), default=256,
                   help="KV-cache tokens before the timed verification forwards (default: %(default)s)")
    p.add_argument("--cost-repeats", type=_positive(int), default=7,
                   help="timed runs per size; the median is used (default: %(default)s)")
    p.add_argument("--gemm", choices=("vllm", "torch"), default="vllm",
                   help="linear layers of the timed verification forward: vllm = vLLM's CPU GEMM (oneDNN), as "
                        "served (default; falls back to torch when unavailable); torch = transformers' own")
    p.add_argument("--threads", type=_positive(int), default=None,
                   help="torch threads for everything, timings included (default: torch's, e.g. OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random cost context (default: %(default)s)")


def _load_prompts(args) -> tuple[list[dict], dict]:
    if args.jsonl:
        path = Path(args.jsonl).expanduser()
        rows = read_jsonl_prompts(path)[:args.num_prompts]
        return rows, {"jsonl": str(path.resolve()), "sha256": _file_digest(path)}
    from vllm_entmtp.datasets import load_prompts

    rows = [{"id": p.id, "messages": p.messages} for p in load_prompts(args.prompt_set, limit=args.num_prompts)]
    return rows, {"prompt_set": args.prompt_set}


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as e:  # bad input: EntMTPError, TreeSetError, HeadsCheckpointError, unknown prompt set
        raise SystemExit(f"build-trees: error: {e}") from None


def _run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_entmtp.config import EntMTPConfig
    from vllm_entmtp.heads import load_mtp_heads
    from vllm_entmtp.heads.hydra import HydraHeads
    from vllm_entmtp.models import find_registered_heads, prepare_default_model
    from vllm_entmtp.scheduler import TreeScheduler
    from vllm_entmtp.trees import Tree, load_tree_set

    if args.max_rank > RANK_STORE_CAP:
        raise ValueError(f"--max-rank {args.max_rank} exceeds {RANK_STORE_CAP}")
    if args.decode_row_cost is not None and not (0 <= args.decode_row_cost <= 1):
        raise ValueError(f"--decode-row-cost {args.decode_row_cost}: expected a number in [0, 1] (a fraction of a "
                         "one-request plain step)")
    if args.chain_stop is not None and not args.step_costs:
        raise ValueError("--chain-stop needs --step-costs (the costs of chains of every length, measured in vLLM)")
    given_edges = edge_scores(args.edges, args.signal) if args.edges else None  # bad edges fail before any work
    step_costs = read_step_costs(args.step_costs) if args.step_costs else None
    if args.threads:
        torch.set_num_threads(args.threads)
    label = args.prompt_set or Path(args.jsonl).stem
    out = Path(args.out or f"runs/calib/{label}.json")
    plot_path = Path(args.plot) if args.plot else out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)

    prompts, prompt_key = _load_prompts(args)
    if len(prompts) < args.num_prompts:
        _log(f"only {len(prompts)} prompt(s) available (asked for {args.num_prompts})")

    model_dir = Path(args.model).expanduser() if args.model else prepare_default_model()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: not a model folder (no config.json)")
    _log(f"target {model_dir} (transformers, float32, {torch.get_num_threads()} thread(s))")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().requires_grad_(False)
    heads_dir = Path(args.heads).expanduser() if args.heads else find_registered_heads(str(model_dir), model.config)
    if heads_dir is None:
        raise ValueError(f"no MTP heads are registered for {model_dir}; pass --heads DIR")
    heads = load_mtp_heads(heads_dir, hidden_size=model.config.hidden_size,
                           vocab_size=model.get_output_embeddings().weight.shape[0]).eval().requires_grad_(False)
    kind = "hydra" if isinstance(heads, HydraHeads) else "medusa"
    num_heads = heads.num_heads
    _log(f"heads {heads_dir} ({kind}, {num_heads} heads)")
    view = TargetView.of(model, tokenizer)

    # 1. per-position statistics (cached)
    key = {"version": STATS_VERSION, "model": dir_fingerprint(model_dir), "heads": dir_fingerprint(heads_dir),
           "prompts": prompt_key, "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    cache_path = stats_cache_path(out, key)
    records = collect_statistics(view, heads, tokenizer, prompts, args.max_tokens, args.max_prompt_tokens,
                                 cache_path, key)
    ranks = torch.cat([r["ranks"] for r in records])
    if ranks.numel() == 0:
        raise ValueError("no generated positions (every continuation was empty)")
    signal = args.signal
    defaults = EntMTPConfig()
    window = args.signal_window or (defaults.entropy_window if signal == "entropy" else defaults.confidence_window)
    conf_heads = min(args.confidence_heads or defaults.confidence_heads, num_heads)
    score = signal_series(records, signal, window, conf_heads)
    lower = 0.0 if signal == "entropy" else -1.0

    # 2. bins and greedy trees
    edges = given_edges if given_edges is not None else quantile_edges(score, args.bins, lower)
    bins = [b for b in bin_statistics(score, ranks, edges, args.max_rank, signal) if b.positions > 0]
    for i, b in enumerate(bins):  # empty bins dropped: renumber, ranges follow the kept bins
        b.index = i
        b.hi = bins[i + 1].lo if i + 1 < len(bins) else math.inf
    if bins:
        bins[0].lo = lower
    budgets = list(args.node_budgets)
    cands = {b.index: candidates_for_bin(b, budgets, num_heads) for b in bins}

    # 3. cost: verification by node count, drafting by tree (or both, measured in vLLM, by node count)
    chains = [tuple((0,) * k for k in range(1, n + 1)) for n in range(1, num_heads + 1)]  # chain keys
    sizes = sorted({0} | {c.num_nodes for cs in cands.values() for c in cs}
                   | (set(range(1, num_heads + 1)) if args.chain_stop is not None else set()))
    if step_costs:
        files = ", ".join(args.step_costs)
        _log(f"step costs measured in vLLM ({files}; median per key over the files): " + "; ".join(
            f"{kind} " + ", ".join(f"{n}: {c:.3f}" for n, c in t.items()) for kind, t in step_costs.items() if t))
    _log(f"timing verification of {', '.join(map(str, sizes))} draft nodes over a {args.cost_context}-token "
         f"context ({args.cost_repeats} runs each, {torch.get_num_threads()} thread(s))")
    gemm = "vllm" if args.gemm == "vllm" and use_vllm_cpu_gemm(model) else "torch"
    if args.gemm == "vllm" and gemm != "vllm":
        _log("vLLM's CPU GEMM (oneDNN) is not available here: timing with torch's")
    verify_s = monotone_times(measure_verify_times(model, sizes, args.cost_context, args.cost_repeats,
                                                   seed=args.seed))
    distinct = {c.key: Tree(c.key) for cs in cands.values() for c in cs}
    if args.chain_stop is not None:
        distinct.update({k: Tree(k) for k in chains if k not in distinct})
    distinct = list(distinct.items())
    first = records[0]
    hid = greedy_continuation(view, render_prompt(tokenizer, prompts[0]["messages"], args.max_prompt_tokens), 1)[1]
    draft_s = measure_draft_times(make_drafter(heads, view), [t for _, t in distinct], hid,
                                  first["tokens"][0], args.cost_repeats)
    base = verify_s[0]
    draft_of = {k: s for (k, _), s in zip(distinct, draft_s)}
    for cs in cands.values():
        for c in cs:
            if args.step_costs:  # drafting is inside the engine's step time
                c.verify_cost, c.draft_cost = step_cost_of(step_costs, c.key), 0.0
            else:
                c.verify_cost = verify_s[c.num_nodes] / base
                c.draft_cost = draft_of[c.key] / base
    choices = [choose(b, cands[b.index]) for b in bins]
    chain_stop = chain_info = None
    if args.chain_stop is not None:
        chain_stop, chain_info = _fit_chain_stop_schedule(args.chain_stop, records, score, bins, choices, chains,
                                                          step_costs)

    # 4. the tree set
    calibration = {
        "command": "vllm-entmtp build-trees " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["build-trees"]
        else "vllm-entmtp build-trees",
        "model": display_path(model_dir), "heads": display_path(heads_dir), "heads_kind": kind,
        "prompts": args.prompt_set or str(args.jsonl), "num_prompts": len(records),
        "max_tokens": args.max_tokens, "positions": int(score.numel()), "max_rank": args.max_rank,
        "signal": signal, "signal_window": window,
        **({"confidence_heads": conf_heads} if signal == "confidence" else {}),
        "edges": [-e for e in edges] if signal == "confidence" else list(edges), "node_budgets": budgets,
        "bins": [b.to_json() for b in bins],
        "cost": {"threads": torch.get_num_threads(), "context_tokens": args.cost_context,
                 "repeats": args.cost_repeats, "gemm": gemm, "plain_decode_ms": round(base * 1e3, 3),
                 "verify_ms": {str(n): round(s * 1e3, 3) for n, s in verify_s.items()},
                 "measured_with": "transformers float32 forward with KV cache (causal mask over the N+1 new "
                                  "tokens, logits for each) and the runtime drafter; not vLLM"},
        "assumptions": "heads independent across depths (P(node) = prod_i P[i][r_i]); the signal is the "
                       "tracker's EMA updated once per generated token (the engine updates once per step)",
    }
    if args.decode_row_cost is not None:
        calibration["cost"]["decode_row_cost"] = args.decode_row_cost
    if args.step_costs:
        calibration["cost"]["step_costs"] = {"files": [display_path(f) for f in args.step_costs],
                                             "combined": "median per key over the files that measured it",
                                             "step_cost_by_nodes": {
                                                 (f"{n}t" if kind == "tree" else str(n)): c
                                                 for kind, t in step_costs.items() for n, c in t.items()},
                                             "used": "instead of verify + draft above"}
    calibration["expected_overall"] = overall = expected_overall(choices)
    if chain_info is not None:
        calibration["chain_stop"] = chain_info
    calibration["signal_correlations"] = corr = signal_correlations(records, defaults.entropy_window)
    name = args.name or f"{label}-{kind}"
    times_ms = {"verify": {n: s * 1e3 for n, s in verify_s.items()},
                "draft": {k: s * 1e3 for k, s in draft_of.items()}}
    ts_json, bin_ids = build_tree_set(choices, name=name, heads_kind=kind, num_heads=num_heads, times_ms=times_ms,
                             calibration=calibration, hysteresis=args.hysteresis, chain_stop=chain_stop)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(ts_json, indent=1) + "\n")
    os.replace(tmp, out)

    # 5. check that the runtime accepts it
    ts = load_tree_set(str(out.resolve()), num_heads=num_heads)
    sched = TreeScheduler.from_config(EntMTPConfig(policy=signal, tree_set=str(out.resolve())), ts)

    plot_frontiers(choices, plot_path, f"{name}: {len(records)} prompts, {int(score.numel())} positions, "
                                       f"{kind} heads, {signal} (window {window})")
    print(f"tree set {out} ({len(ts)} trees; schedule {sched.ladder_ids}, thresholds "
          f"{[round(x, 4) for x in sched.thresholds]} ({_SIGNAL_UNIT[signal]}); policy {signal!r} reads it)")
    print(f"plot {plot_path}; statistics cache {cache_path}")
    print(f"cost: plain decode step {base * 1e3:.1f} ms ({torch.get_num_threads()} thread(s), transformers "
          f"float32, {args.cost_context}-token context); verifying N nodes: "
          + ", ".join(f"{n}: {verify_s[n] / base:.2f}" for n in sizes if n))
    if chain_stop is not None:
        print("the bins' ladder (not scheduled: the chain stop below replaces it):")
    print(summary_table(choices, bin_ids))
    if "best_static" in overall:
        bs = overall["best_static"]
        print(f"expected over all positions: schedule x{overall['schedule']:.3f}; best single tree "
              f"({bs['num_nodes']} nodes {bs['paths']}) x{bs['speedup']:.3f}")
    if chain_info is not None:
        best = chain_info["best"]
        print(f"chain stop, position by position on the calibration: bins' ladder x{chain_info['ladder']:.3f}; "
              "chains " + ", ".join(f"{n}: x{x:.3f}" for n, x in chain_info["chains"].items())
              + f"; best cut chain: {best['depth']} nodes, chain_stop {best['chain_stop']} x{best['speedup']:.3f}; "
              + (f"scheduled: chain{chain_info['chosen']['depth']} cut at {chain_info['chosen']['chain_stop']}"
                 if chain_info["chosen"] else "not scheduled (the ladder is expected to be faster)"))
    print("signals vs acceptance (Pearson r with head 0's hit / the chain's accepted length; head 0's hit rate "
          "in the top / bottom 30 % of the signal): " + "; ".join(
              f"{n} {v['r_first']:+.2f}/{v['r_chain']:+.2f} ({v['first_hit_top30']:.2f} vs "
              f"{v['first_hit_bottom30']:.2f})" for n, v in corr.items() if v["r_first"] is not None))
    return 0
