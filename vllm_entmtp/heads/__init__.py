"""MTP heads: draft-token proposers that read the target model's last hidden state.

* :mod:`~vllm_entmtp.heads.medusa`: Medusa-1 heads (each head reads ``h_t`` only).
* :mod:`~vllm_entmtp.heads.hydra`: Hydra heads (head ``k`` also reads the embeddings of its path's tokens).
"""
from __future__ import annotations

from pathlib import Path

import torch

from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig, load_hydra_heads
from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig, load_heads

__all__ = ["HydraHeads", "HydraHeadsConfig", "MedusaHeads", "MedusaHeadsConfig", "load_heads",
           "load_hydra_heads", "load_mtp_heads"]


def load_mtp_heads(path: str | Path, *, hidden_size: int | None = None, vocab_size: int | None = None,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                   ) -> MedusaHeads | HydraHeads:
    """Load Medusa or Hydra heads from directory ``path``, in any supported layout
    (:func:`vllm_entmtp.heads.formats.load_any_heads`), checked against the target's hidden and vocabulary sizes.

    Raises:
        HeadsCheckpointError: unknown layout, mis-keyed or mis-shaped weights, sizes that do not fit (named).
    """
    from vllm_entmtp.heads.formats import load_any_heads

    return load_any_heads(path, hidden_size=hidden_size, vocab_size=vocab_size, dtype=dtype, device=device)
