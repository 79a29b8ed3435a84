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
def shipped_heads() -> dict:
    """``{kind: checkpoint folder}`` of the heads the repository ships for the default model."""
    from vllm_entmtp.models import default_heads

    heads = {k: str(v) for k, v in default_heads().items()}
    assert "medusa" in heads, "the repository ships Medusa heads for the default model"
    return heads


@pytest.fixture(scope="session")
def default_heads(default_model, shipped_heads) -> str:
    """The heads ``{"method": "entmtp"}`` uses for the default model (the preferred shipped kind)."""
    from vllm_entmtp.models import find_registered_heads

    return str(find_registered_heads(default_model))


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


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (a script folder, not a package) as module ``<name>_bench``."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_public_checkpoint(path, config: dict, state: dict, stem: str, fmt: str = "pt"):
    """A heads folder in a public layout: ``config.json`` and ``<stem>.pt`` (torch.save) or
    ``<stem>.safetensors``."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "pt":
        torch.save(state, path / f"{stem}.pt")
    else:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(path / f"{stem}.safetensors"))
    return path
