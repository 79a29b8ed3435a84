"""The tree-set JSON object ``build-trees`` writes (``docs/trees.md``): the bins' chosen and frontier trees with
their metadata, and the schedule (the bins' ladder, or a chain stop).
"""
from __future__ import annotations

from typing import Any

from vllm_entmtp.calibrate.acceptance import Path_, expected_accepted
from vllm_entmtp.calibrate.search import BinChoice, Candidate
from vllm_entmtp.calibrate.signals import SIGNAL_LABEL, score_sign
from vllm_entmtp.trees import NO_DRAFT_ID


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
        f"bin {b.stats.index} {SIGNAL_LABEL[signal]} in {b.stats.range_str()}: "
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
