"""The scheduler's signal at every calibration position, the top-1 chain's outcome there, and how well each
candidate signal predicts acceptance.

A position's signal is what the runtime :class:`~vllm_entmtp.entropy.EntropyTracker` would hold there: the
entropy EMA (nats) or the heads' path confidence. Bins and thresholds are on a *score* that increases from the
most aggressive bin to the most conservative one, as the scheduler orders its ladder: the entropy, or minus
the confidence (:func:`score_sign`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SIGNALS = ("entropy", "confidence")
"""What the bins are on: the runtime tracker's entropy EMA (nats), or its path confidence (the product of the
heads' top-1 probabilities along their greedy chain; with window 1, this step's)."""
SIGNAL_LABEL = {"entropy": "H", "confidence": "c"}
SIGNAL_UNIT = {"entropy": "nats", "confidence": "path confidence"}


def score_sign(signal: str) -> float:
    """Score = sign x signal, increasing from the most aggressive bin to the most conservative one (as the
    scheduler orders its ladder): +1 for entropy, -1 for confidence."""
    return -1.0 if signal == "confidence" else 1.0


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
