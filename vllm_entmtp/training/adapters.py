"""The heads a ``train-heads`` run trains and its view of each kind: what a head reads at a cached position (Medusa:
``h_t``; Hydra: also the path's token embeddings; Hydra++ prefix-mlp: the prefix layer's output) and the lm_head
columns its logits are over (the whole vocabulary, or a Hydra draft vocabulary); making, loading and initialising
heads of a kind."""
from __future__ import annotations

from pathlib import Path

import torch

from vllm_entmtp.training import data as D


class MedusaAdapter:
    """Training view of Medusa heads: every head reads ``h_t``; logits over the whole vocabulary."""

    def __init__(self, heads, lm_head: torch.Tensor):
        self.heads, self.w_cols, self.col_of = heads, lm_head, None

    def outputs(self, data: D.CachedData, pos: torch.Tensor) -> torch.Tensor:
        """``[K, N, hidden]`` head hidden states at positions ``pos``."""
        return self.heads(data.hidden[pos].float())

    def to_tokens(self, cols: torch.Tensor) -> torch.Tensor:
        return cols


class HydraAdapter:
    """Training view of Hydra heads: head ``k`` at ``t`` reads ``h_t`` and the input embeddings of the text
    tokens ``t+1 .. t+k+1`` (during decoding: the bonus token and the path's draft tokens); logits over the
    draft vocabulary (``token_map``) when it is truncated."""

    def __init__(self, heads, lm_head: torch.Tensor, embed: torch.Tensor):
        self.heads, self.embed = heads, embed
        self.w_cols = heads.draft_lm_weight(lm_head)
        self.col_of = None
        if heads.token_map is not None:
            self.col_of = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
            self.col_of[heads.token_map] = torch.arange(len(heads.token_map))

    def outputs(self, data: D.CachedData, pos: torch.Tensor) -> torch.Tensor:
        K = self.heads.num_heads
        emb = self.embed[torch.stack([data.tokens[pos + j + 1] for j in range(K)], dim=1)]  # [N, K, H]
        h = data.hidden[pos].float()
        return torch.stack([self.heads.hidden_states(k, h, emb) for k in range(K)])

    def to_tokens(self, cols: torch.Tensor) -> torch.Tensor:
        return self.heads.to_token_ids(cols)


class HydraPrefixAdapter(HydraAdapter):
    """Training view of Hydra++ ``prefix-mlp`` heads: the heads read ``p_t``, the prefix layer's output at ``t``
    over the target's hidden states of the sequence from its first token to ``t`` (positions counted from the
    sequence start, as in serving, where they count from the prompt's first token)."""

    def __init__(self, heads, lm_head: torch.Tensor, embed: torch.Tensor, seqs_per_pass: int = 8):
        super().__init__(heads, lm_head, embed)
        self.seqs_per_pass = seqs_per_pass

    def prefix_at(self, data: D.CachedData, pos: torch.Tensor) -> torch.Tensor:
        """``[len(pos), hidden]``: ``p_t`` at global positions ``pos`` (differentiable)."""
        seq = data.sequence_of(pos)
        uniq = seq.unique()
        hid = data.hidden.shape[1]
        idx_parts, val_parts = [], []
        for c in range(0, len(uniq), self.seqs_per_pass):
            group = uniq[c:c + self.seqs_per_pass]
            starts = data.offsets[group]
            in_group = torch.isin(seq, group)
            row_of = {int(s): r for r, s in enumerate(group.tolist())}
            rows = torch.tensor([row_of[int(s)] for s in seq[in_group].tolist()], dtype=torch.long)
            cols = pos[in_group] - starts[rows]
            length = int(cols.max()) + 1
            x = torch.zeros(len(group), length, hid)
            for r, s0 in enumerate(starts.tolist()):
                n = min(length, int(data.offsets[group[r] + 1]) - s0)
                x[r, :n] = data.hidden[s0:s0 + n].float()
            p, _ = self.heads.prefix(x, torch.arange(length).expand(len(group), length))
            idx_parts.append(in_group.nonzero().squeeze(1))
            val_parts.append(p[rows, cols])
        return torch.zeros(len(pos), hid).index_copy(0, torch.cat(idx_parts), torch.cat(val_parts))

    def outputs(self, data: D.CachedData, pos: torch.Tensor) -> torch.Tensor:
        K = self.heads.num_heads
        emb = self.embed[torch.stack([data.tokens[pos + j + 1] for j in range(K)], dim=1)]  # [N, K, H]
        h = self.prefix_at(data, pos)
        return torch.stack([self.heads.hidden_states(k, h, emb) for k in range(K)])


def init_heads_from(heads, trained) -> None:
    """Copy every weight of ``trained`` heads into ``heads`` (the same kind and shape; ``heads`` may add a prefix
    layer, which keeps its initialisation).

    Raises:
        SystemExit: a weight missing, extra or of another shape, named.
    """
    mine, theirs = heads.state_dict(), trained.state_dict()
    extra = sorted(set(theirs) - set(mine))
    missing = sorted(k for k in set(mine) - set(theirs) if not k.startswith("prefix_embeding_layer."))
    shape = sorted(k for k in set(mine) & set(theirs) if mine[k].shape != theirs[k].shape)
    if extra or missing or shape:
        raise SystemExit(f"--init-heads: the heads do not match the ones being trained (same --num-heads, "
                         f"--num-layers, --draft-vocab): extra {extra[:5]}, missing {missing[:5]}, "
                         f"other shape {shape[:5]}")
    heads.load_state_dict({**mine, **theirs})


def draft_vocabulary(data: D.CachedData, pos: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` token ids the target emits (argmax) most often at ``pos``, sorted, and their coverage."""
    counts = torch.bincount(data.argmax[pos], minlength=int(data.argmax.max()) + 1)
    top = counts.topk(min(size, len(counts))).indices
    return top.sort().values, float(counts[top].sum() / counts.sum())


def new_heads(kind: str, cfg: dict):
    """Untrained heads of ``kind`` (``medusa`` or ``hydra``) from their config fields ``cfg``."""
    if kind == "hydra":
        from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig
        return HydraHeads(HydraHeadsConfig(**cfg))
    from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig
    return MedusaHeads(MedusaHeadsConfig(**cfg))


def load_trained(kind: str, path: Path, info: dict):
    """Trained heads of ``kind`` from the checkpoint folder ``path``, for the target described by ``info``."""
    if kind == "hydra":
        from vllm_entmtp.heads.hydra import load_hydra_heads
        return load_hydra_heads(path, hidden_size=info["hidden_size"], vocab_size=info["vocab_size"])
    from vllm_entmtp.heads.medusa import load_heads
    return load_heads(path, hidden_size=info["hidden_size"], vocab_size=info["vocab_size"])


def adapter_for(heads, info: dict):
    """The training view of ``heads`` (by their kind and whether they have a prefix layer) over the target's
    lm_head and embeddings in ``info``."""
    from vllm_entmtp.heads.hydra import HydraHeads
    if isinstance(heads, HydraHeads):
        if heads.prefix_embeding_layer is not None:
            return HydraPrefixAdapter(heads, info["lm_head"], info["embed"])
        return HydraAdapter(heads, info["lm_head"], info["embed"])
    return MedusaAdapter(heads, info["lm_head"])
