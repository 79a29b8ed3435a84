"""Step costs of drafting a tree, relative to a plain decode step: timed here (a transformers verification
forward by node count, the runtime drafter by tree; Sequoia's hardware-aware choice, Chen et al. 2024) or read
from step costs measured inside vLLM (``--step-costs``).
"""
from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch


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
