"""Shared fixtures. Model hubs are never contacted: the default model is prepared offline."""
from __future__ import annotations

import math
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


def lookup_drafter(costs, outputs: list[int], draft_sources: str = "lookup", max_tokens: int = 256,
                   accepted: int = 1):
    """An ``EntMTPProposer`` for ``_propose_scheduled`` without a model (built without its ``__init__``): real
    scheduler (the default tree set, measured load rule), entropy tracker, prompt lookup (chains of 4), lookup rests,
    ``costs`` (a ``StepCosts``) and ``Refills``; one request per entry of ``outputs`` (``r0``, ``r1``, ...: that many
    output tokens so far, of ``max_tokens``), each repeating ``11 .. 18`` so that prompt lookup finds
    ``[11, 12, 13, 14]``, with a record of four lookup drafts of 4 tokens of which ``accepted`` were accepted. It
    also runs ``draft_step`` (the runner's step, ``vllm_entmtp.step.STEP``, set by the caller)."""
    from types import SimpleNamespace

    import numpy as np
    from vllm import SamplingParams

    from vllm_entmtp.drafter import EntMTPProposer
    from vllm_entmtp.entropy import EntropyTracker
    from vllm_entmtp.lookup import LookupRests, PromptLookup
    from vllm_entmtp.scheduler import TreeScheduler
    from vllm_entmtp.stats import TreeStats
    from vllm_entmtp.step_costs import Refills
    from vllm_entmtp.trees import load_tree_set

    n = len(outputs)
    rids = [f"r{i}" for i in range(n)]
    tokens = np.tile(np.array([11, 12, 13, 14, 15, 16, 17, 18], dtype=np.int32), 8)
    d = object.__new__(EntMTPProposer)
    d.spec_config = SimpleNamespace(entmtp=SimpleNamespace(draft_sources=draft_sources))
    d.scheduler = TreeScheduler(load_tree_set("default"), "confidence", load_policy="measured")
    d.tracker, d.lookup, d.lookup_rests = EntropyTracker(), PromptLookup(2, 4, max_tokens=4), LookupRests()
    d.step_costs, d.refills, d.num_speculative_tokens = costs, Refills(), 4
    d.runner = SimpleNamespace(
        input_batch=SimpleNamespace(token_ids_cpu=np.stack([tokens] * n), num_tokens_no_spec=[len(tokens)] * n),
        requests={r: SimpleNamespace(sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                     output_token_ids=[0] * out) for r, out in zip(rids, outputs)})
    d._req_options = {r: (None, None) for r in rids}
    d._drafted_at, d._heads_step = {}, None
    # what draft_step reads besides (the model's hidden states aside: lookup drafts need none)
    d.runner.input_batch.req_ids = rids
    d.recorder = d.prefix_cache = d.publisher = None
    d.pending, d.tree_stats, d._departed, d._next_costs_log = {}, TreeStats(), 0, math.inf
    d._proposed_free, d._valued, d.heads_ran = True, False, False
    for r in rids:
        for _ in range(4):
            d.lookup.observe(r, 4, accepted)
    return d, rids
