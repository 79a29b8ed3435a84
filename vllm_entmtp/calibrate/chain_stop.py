"""The chain-stop schedule (``build-trees --chain-stop``): every request drafts the heads' top-1 chain, cut where
its path confidence falls below ``chain_stop``; the depth and cut are fitted, and compared with the bins'
ladder, position by position on the calibration's own outcomes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_entmtp.calibrate.acceptance import Path_, expected_accepted
from vllm_entmtp.calibrate.bins import BinStats
from vllm_entmtp.calibrate.costs import step_cost_of
from vllm_entmtp.calibrate.search import BinChoice, Candidate
from vllm_entmtp.calibrate.signals import chain_outcomes

CHAIN_STOP_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95


def cut_depths(path_conf: torch.Tensor, depth: int, tau: float) -> torch.Tensor:
    """``int64 [N]``: nodes a chain of ``depth`` keeps under ``chain_stop = tau``: the first, then each next while
    the path confidence up to its head is >= ``tau`` (``vllm_entmtp.proposer.MTPDrafter.propose``)."""
    ok = (path_conf[:, 1:depth] >= tau).long()
    return 1 + torch.cumprod(ok, dim=1).sum(dim=1)


def fit_chain_stop(lead: torch.Tensor, path_conf: torch.Tensor, chain_cost: Sequence[float],
                   taus: Sequence[float] = CHAIN_STOP_GRID) -> dict:
    """Speed-ups over plain decoding, position by position on the calibration's own outcomes (one step per
    position, as :func:`~vllm_entmtp.calibrate.search.expected_overall`): of each chain of 1 to ``heads``
    nodes, and of each chain of 2 or more nodes cut at each ``tau``; the best cut chain.

    Args:
        lead, path_conf: from :func:`~vllm_entmtp.calibrate.signals.chain_outcomes`.
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
    the choices' lower edges; ``full``: the positions :func:`~vllm_entmtp.calibrate.signals.chain_outcomes`
    kept (bool mask over ``score``), ``ranks`` their ranks."""
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


def fit_chain_stop_schedule(asked: str | float, records: Sequence[dict], score: torch.Tensor,
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
