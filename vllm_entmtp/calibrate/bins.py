"""Signal bins: edges at the quantiles of the scores (or given), and per bin the table ``P[head][rank]`` of where
the true token ranked.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_entmtp.calibrate.signals import score_sign


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
