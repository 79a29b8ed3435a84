"""What ``train-heads`` optimises and how it measures it: the per-head loss (a sampled or full softmax over the
lm_head's columns, optionally with a teacher term), the learning-rate schedule, the batch order that keeps
sequences together for a prefix layer, and the held-out top-1/top-5 evaluation."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_entmtp.training import data as D


def sequence_order(data: D.CachedData, pos: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A permutation of ``pos``'s indices that visits whole sequences in random order (positions of a sequence
    together, in order): batches cut from it hold a few complete sequences, which the prefix layer runs once."""
    seq = data.sequence_of(pos)
    uniq = seq.unique()
    rank = torch.empty(int(uniq.max()) + 1, dtype=torch.long)
    rank[uniq] = torch.randperm(len(uniq), generator=gen)
    return torch.sort(rank[seq] * (len(pos) + 1) + torch.arange(len(pos)), stable=True).indices


def lr_at(step: int, total: int, args) -> float:
    """The learning rate at ``step`` of ``total``: linear warm-up over ``args.warmup_steps``, then cosine decay to
    10% of ``args.lr``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def head_loss(z: torch.Tensor, y: torch.Tensor, W: torch.Tensor, mode: str, negatives: int,
              gen: torch.Generator | None = None, hard: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, teacher_h: torch.Tensor | None = None,
              teacher_weight: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """Mean loss over heads: ``z [K, B, H]`` head outputs, ``y [K, B]`` label columns of ``W [V, H]`` (the
    lm_head, or its draft-vocabulary rows).

    ``mask [K, B]`` (optional) selects the positions each head learns from. ``sampled``: softmax over the union
    of the batch's labels, the columns ``hard`` (the target's own argmax at ``t``: what an untrained head
    predicts) and ``negatives`` random columns. ``teacher_h [K, B, H]`` (optional): the target's hidden state at
    each label's position; with ``teacher_weight`` w the loss is ``(1 - w) * CE(argmax) + w * CE(softmax(teacher))``
    over the same columns (distillation from the target's distribution, Hydra++).
    """
    K = z.shape[0]
    if mask is None:
        mask = torch.ones(y.shape, dtype=torch.bool)
    if mode == "sampled":
        extra = torch.randint(W.shape[0], (negatives,), generator=gen)
        parts = [y[mask], extra] + ([hard.flatten()] if hard is not None else [])
        cand = torch.unique(torch.cat(parts))  # sorted
        Wc = W[cand]
        tgt = torch.searchsorted(cand, y.clamp(max=int(cand[-1])))  # masked-out labels are never read
    else:
        Wc, tgt = W, y
    losses = []
    for k in range(K):
        m = mask[k]
        if not m.any():
            losses.append(z.sum() * 0.0)
            continue
        logits = z[k][m] @ Wc.t()
        loss = F.cross_entropy(logits, tgt[k][m])
        if teacher_h is not None and teacher_weight > 0.0:
            with torch.no_grad():
                soft = torch.softmax(teacher_h[k][m] @ Wc.t(), dim=-1)
            soft_ce = -(soft * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            loss = (1.0 - teacher_weight) * loss + teacher_weight * soft_ce
        losses.append(loss)
    return torch.stack(losses).mean(), [float(v.detach()) for v in losses]


@torch.no_grad()
def evaluate(adapter, data: D.CachedData, pos: torch.Tensor, chunk: int = 1024) -> dict:
    """Top-1/top-5 accuracy per head on positions ``pos`` (over the heads' whole output vocabulary: the full
    one, or the draft vocabulary, whose misses count as errors): all, greedy-path, assistant-only."""
    heads = adapter.heads
    K = heads.num_heads
    y = data.labels(pos, K)
    path = data.on_greedy_path(pos, K)
    asst = data.assistant[pos]
    top1 = torch.zeros(K, len(pos), dtype=torch.bool)
    top5 = torch.zeros(K, len(pos), dtype=torch.bool)
    was_training = heads.training
    heads.eval()
    for c in range(0, len(pos), chunk):
        z = adapter.outputs(data, pos[c:c + chunk])
        for k in range(K):
            t5 = adapter.to_tokens((z[k] @ adapter.w_cols.t()).topk(5, dim=-1).indices)
            yk = y[k, c:c + chunk]
            top1[k, c:c + chunk] = t5[:, 0] == yk
            top5[k, c:c + chunk] = (t5 == yk[:, None]).any(-1)
    heads.train(was_training)

    def acc(mask_k):
        return {"top1": [round(float(top1[k][mask_k(k)].float().mean()), 4) for k in range(K)],
                "top5": [round(float(top5[k][mask_k(k)].float().mean()), 4) for k in range(K)]}

    return {"positions": len(pos),
            "all": acc(lambda k: slice(None)),
            "greedy_path": {**acc(lambda k: path[k]), "positions": [int(path[k].sum()) for k in range(K)]},
            "assistant": {**acc(lambda k: asst), "positions": int(asst.sum())}}


def format_eval(ev: dict) -> str:
    """:func:`evaluate`'s accuracies, one line per group of positions, as train-heads prints them."""
    lines = [f"held-out positions: {ev['positions']}"]
    for name in ("all", "greedy_path", "assistant"):
        r = ev[name]
        lines.append(f"  {name:12s} top-1 " + " ".join(f"{v:.3f}" for v in r["top1"])
                     + " | top-5 " + " ".join(f"{v:.3f}" for v in r["top5"]))
    return "\n".join(lines)
