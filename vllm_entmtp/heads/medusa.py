"""Medusa-1 MTP heads (Cai et al. 2024, "Medusa", arXiv 2401.10774, section 2.1.1).

Head ``k`` (0-based) reads the target model's last hidden state ``h_t`` (the input of its lm_head, after the
final norm) and predicts the token at position ``t + k + 2``: head 0 guesses the token after the one the target
model itself predicts from ``h_t``. Each head is ``num_hidden_layers`` residual layers
``x <- x + SiLU(W x + b)`` followed by a vocabulary projection; the projection is the target's own lm_head
(frozen, shared) unless the checkpoint carries per-head ``lm_heads.{k}.weight``.

Checkpoint layout (vLLM's Medusa layout, ``vllm/model_executor/models/medusa.py``):
``config.json`` with ``model_type: "medusa"``, ``hidden_size``, ``vocab_size``, ``num_heads``,
``num_hidden_layers``, ``medusa_fc_bias``; ``model.safetensors`` with ``blocks.{k}.layers.{l}.weight``
(``[hidden, hidden]``), ``blocks.{k}.layers.{l}.bias`` (``[hidden]``, when ``medusa_fc_bias``) and, when
``original_lm_head`` is false, ``lm_heads.{k}.weight`` (``[vocab, hidden]``). The number of heads is a property
of the checkpoint and is independent of how many draft tokens a step proposes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_entmtp.errors import HeadsCheckpointError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class MedusaHeadsConfig(BaseModel):
    """``config.json`` of a Medusa heads checkpoint. Unknown keys are kept (other tools write more)."""

    model_config = ConfigDict(extra="allow")

    model_type: Literal["medusa"] = "medusa"
    architectures: list[str] = Field(default_factory=lambda: ["MedusaModel"])
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_heads: int = Field(gt=0, le=16)
    num_hidden_layers: int = Field(default=1, ge=1)
    medusa_fc_bias: bool = True
    # True: the heads use the target model's lm_head (no lm_heads.* weights in the checkpoint).
    original_lm_head: bool = True
    truncated_vocab_size: int | None = None
    # Free-form provenance: target model, training command, data, seed, held-out accuracy.
    entmtp: dict = Field(default_factory=dict)


class ResidualBlock(nn.Module):
    """``num_layers`` times ``x <- x + SiLU(W x + b)``, as vLLM's Medusa ``ResidualBlock``.

    ``W`` starts at zero, so an untrained block is the identity and an untrained head predicts what the
    target's lm_head predicts from ``h_t``.
    """

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if bias:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """``num_heads`` independent Medusa heads over one shared hidden state.

    ``forward(hidden)`` maps ``hidden: [N, hidden_size]`` (any float dtype) to the heads' hidden states
    ``[num_heads, N, hidden_size]``; ``logits(hidden, lm_head_weight)`` maps it to ``[num_heads, N, vocab]``.
    """

    def __init__(self, config: MedusaHeadsConfig):
        super().__init__()
        self.config = config
        h, bias = config.hidden_size, config.medusa_fc_bias
        self.blocks = nn.ModuleList(ResidualBlock(h, config.num_hidden_layers, bias)
                                    for _ in range(config.num_heads))
        self.lm_heads = None
        if not config.original_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(h, config.vocab_size, bias=False)
                                          for _ in range(config.num_heads))

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([block(hidden) for block in self.blocks])

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Head logits ``[num_heads, N, vocab]`` for ``hidden: [N, hidden_size]``.

        ``lm_head_weight: [vocab, hidden_size]`` is the target's lm_head, required when the checkpoint shares it.
        """
        x = self(hidden)
        if self.lm_heads is not None:
            return torch.stack([lm(x[k]) for k, lm in enumerate(self.lm_heads)])
        if lm_head_weight is None:
            raise ValueError("these heads share the target's lm_head: pass lm_head_weight [vocab, hidden]")
        return x @ lm_head_weight.t()

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (float32) into directory ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        (path / CONFIG_NAME).write_text(json.dumps(self.config.model_dump(), indent=2) + "\n")


def read_heads_config(path: str | Path) -> MedusaHeadsConfig:
    """Read and validate ``config.json`` of the heads checkpoint in directory ``path``.

    Raises:
        HeadsCheckpointError: the directory or config is missing, or a field is invalid (named).
    """
    path = Path(path)
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise HeadsCheckpointError(f"MTP heads checkpoint {path}: no {CONFIG_NAME} (expected a Medusa heads "
                                   f"directory with {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: invalid JSON: {e}") from e
    if raw.get("model_type") != "medusa":
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: model_type is {raw.get('model_type')!r}, "
                                   "expected 'medusa'")
    try:
        return MedusaHeadsConfig(**raw)
    except ValidationError as e:
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: {e}") from e


def weight_shapes(cfg, cls: type[nn.Module] | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``cls(cfg)`` holds (default ``MedusaHeads``: vLLM's Medusa names);
    allocates nothing."""
    with torch.device("meta"):
        heads = (cls or MedusaHeads)(cfg)
    return {name: tuple(t.shape) for name, t in heads.state_dict().items()}


def describe_config(cfg: MedusaHeadsConfig) -> str:
    """The config fields that decide which weights a checkpoint must hold, for error messages."""
    return (f"num_heads={cfg.num_heads}, num_hidden_layers={cfg.num_hidden_layers}, "
            f"medusa_fc_bias={cfg.medusa_fc_bias}, original_lm_head={cfg.original_lm_head}, "
            f"hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}")


def check_fits(cfg: MedusaHeadsConfig, path: str | Path, hidden_size: int | None, vocab_size: int | None) -> None:
    """Refuse heads whose hidden or vocabulary size differs from the target's (``None``: not checked).

    Raises:
        HeadsCheckpointError: naming both sizes.
    """
    for name, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if want is not None and getattr(cfg, name) != want:
            raise HeadsCheckpointError(f"MTP heads {path} were built for {name}={getattr(cfg, name)}, but the "
                                       f"target model has {name}={want}")


def check_weights(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str,
                  describe: str) -> None:
    """Refuse a checkpoint whose weights (name -> shape) are not exactly ``expected``: every missing and
    unexpected name, and every weight of the wrong shape, is named (a half-loaded head proposes garbage).

    Raises:
        HeadsCheckpointError
    """
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise HeadsCheckpointError(
            f"MTP heads checkpoint {where} does not match its config ({describe}): missing weights "
            f"{missing or 'none'}; unexpected weights {unexpected or 'none'}")
    wrong = [f"weight {name} has shape {tuple(found[name])}, expected {tuple(want)}"
             for name, want in expected.items() if tuple(found[name]) != tuple(want)]
    if wrong:
        raise HeadsCheckpointError(f"MTP heads checkpoint {where}: {'; '.join(wrong)} ({describe})")


def load_heads(path: str | Path, *, hidden_size: int | None = None, vocab_size: int | None = None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> MedusaHeads:
    """Load Medusa heads (vLLM's layout) from directory ``path`` and check that they fit the target model.

    Other layouts: :func:`vllm_entmtp.heads.formats.load_any_heads`.

    Args:
        hidden_size: the target's hidden size; checked against the config when given.
        vocab_size: the target's vocabulary size; checked likewise.

    Raises:
        HeadsCheckpointError: unreadable checkpoint; missing or unexpected weights (all named); a weight of
            the wrong shape; hidden or vocabulary size different from the target's.
    """
    path = Path(path)
    cfg = read_heads_config(path)
    check_fits(cfg, path, hidden_size, vocab_size)
    wfile = path / WEIGHTS_NAME
    if not wfile.is_file():
        raise HeadsCheckpointError(f"MTP heads checkpoint {path}: no {WEIGHTS_NAME}")
    state = load_file(str(wfile))
    check_weights({k: tuple(v.shape) for k, v in state.items()}, weight_shapes(cfg), str(wfile),
                  describe_config(cfg))
    heads = MedusaHeads(cfg)
    heads.load_state_dict(state, strict=True)
    return heads.to(device=device, dtype=dtype).eval()
