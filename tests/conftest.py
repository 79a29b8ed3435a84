"""Shared fixtures. Model hubs are never contacted: the default model is prepared offline."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model() -> str:
    from vllm_entmtp.models import prepare_default_model

    return str(prepare_default_model())


@pytest.fixture(scope="session")
def default_heads() -> str:
    from vllm_entmtp.models import default_heads

    heads = default_heads()
    assert "medusa" in heads, "the repository ships Medusa heads for the default model"
    return str(heads["medusa"])


@pytest.fixture(scope="session")
def target_model_config(default_model):
    """vLLM's ModelConfig of the default target model (float32)."""
    from vllm.config import ModelConfig

    return ModelConfig(model=default_model, dtype="float32", max_model_len=512)


def make_heads(path, *, hidden_size=576, vocab_size=49152, num_heads=3, num_layers=1, seed=0):
    """A small random Medusa heads checkpoint in ``path``; returns the heads module."""
    import torch

    from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig

    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                          num_hidden_layers=num_layers))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.02)
    heads.save(path)
    return heads
