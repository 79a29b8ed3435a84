"""Hydra MTP heads: sequentially dependent draft heads (Ankner et al. 2024, "Hydra", arXiv 2402.05109, section 3).

A Medusa head guesses the token at ``t + k + 2`` from the target's hidden state ``h_t`` alone, blind to the
tokens in between. A Hydra ("grounded") head also reads the input embeddings of the tokens already on its
candidate path: head ``k`` (0-based) maps

    ``x_k = [h_t ; e(y_1) ; ... ; e(y_{k+1})]``  (``(k + 2) * hidden`` features)

to a hidden state, then to logits over the vocabulary, where ``y_1`` is the token the target itself chose at
``t + 1`` (the bonus token of the verification step) and ``y_2 .. y_{k+1}`` are the draft tokens of the path's
ancestors. So the children of a tree node depend on the node's token, and a tree is proposed depth by depth
(:class:`HydraDrafter` in :mod:`vllm_entmtp.proposer`).

Architecture (Hydra's ``hydra_head_arch: "mlp"`` with ``grounded_heads: true``; ``HydraMLP`` in zankner/Hydra):
head ``k`` is a :class:`CondResBlock` ``r(x) = R x + SiLU(W x + b)`` from ``(k + 2) * hidden`` to ``hidden``
features, then ``hydra_num_layers - 1`` residual blocks ``x <- x + SiLU(W x + b)``, then the vocabulary
projection. The projection is the target's own lm_head (``original_lm_head: true``, frozen, shared; what this
project trains and ships) or one ``hydra_lm_head.{k}`` per head (Hydra's own checkpoints).

Hydra++'s ``prefix-mlp`` variant (``hydra_head_arch: "prefix-mlp"``) adds one decoder layer over the target's
hidden states of the whole context (:class:`~vllm_entmtp.heads.prefix.PrefixLayer`, weights
``prefix_embeding_layer.*``, shape in ``prefix_layer``); the heads then read its output ``p_t`` where the plain
variant reads ``h_t``. At serving time the drafter keeps that layer's K/V per request.

Draft vocabulary (optional, ``truncated_vocab_size`` + ``token_map``, the convention of vLLM's Medusa model):
the heads score only ``token_map`` (``[truncated_vocab_size]`` int64 target token ids, usually the most frequent
tokens the target emits), which makes every head evaluation ``vocab_size / truncated_vocab_size`` times cheaper;
a token outside it is never proposed.

Checkpoint layout (this project's, read by :func:`load_hydra_heads`): ``config.json`` with
``model_type: "hydra"``, ``hidden_size``, ``vocab_size``, ``hydra_num_heads``, ``hydra_num_layers``,
``hydra_head_arch``, ``grounded_heads``, ``original_lm_head``, ``truncated_vocab_size``; ``model.safetensors``
with ``hydra_mlp.{k}.{l}.linear.weight/bias`` (``l = 0`` also ``res_connection.weight/bias`` when grounded),
``hydra_lm_head.{k}.weight/bias`` unless ``original_lm_head`` and ``token_map`` when truncated.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads.medusa import check_fits, check_weights, weight_shapes
from vllm_entmtp.heads.prefix import PrefixLayer, PrefixLayerConfig

#: ``hydra_head_arch`` values this project runs ("cross-attn" and "eagle-attn" are refused).
SUPPORTED_ARCHS = ("mlp", "prefix-mlp")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class HydraHeadsConfig(BaseModel):
    """``config.json`` of a Hydra heads checkpoint (field names as in zankner/Hydra's ``HydraConfig``)."""

    model_config = ConfigDict(extra="allow")

    model_type: Literal["hydra"] = "hydra"
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    hydra_num_heads: int = Field(gt=0, le=16)
    hydra_num_layers: int = Field(default=1, ge=1)
    hydra_head_arch: Literal["mlp", "prefix-mlp"] = "mlp"
    prefix_layer: PrefixLayerConfig | None = None
    grounded_heads: bool = True
    original_lm_head: bool = True
    truncated_vocab_size: int | None = Field(default=None, gt=0)
    entmtp: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        if self.truncated_vocab_size is not None and self.truncated_vocab_size > self.vocab_size:
            raise ValueError(f"truncated_vocab_size={self.truncated_vocab_size} exceeds vocab_size={self.vocab_size}")
        if (self.hydra_head_arch == "prefix-mlp") != (self.prefix_layer is not None):
            raise ValueError("hydra_head_arch 'prefix-mlp' needs prefix_layer (the decoder layer's shape), and "
                             "only it takes one")
        return self

    @property
    def has_prefix_layer(self) -> bool:
        return self.prefix_layer is not None

    @property
    def num_heads(self) -> int:
        return self.hydra_num_heads

    @property
    def draft_vocab_size(self) -> int:
        return self.truncated_vocab_size or self.vocab_size


class CondResBlock(nn.Module):
    """``r(x) = R x + SiLU(W x + b)`` from ``in_features`` to ``hidden`` (``R`` is the identity when they are
    equal). ``W`` starts at zero and ``R`` at ``[I, 0, ...]``, so an untrained block passes ``h_t`` through."""

    def __init__(self, hidden_size: int, num_condition: int = 0):
        super().__init__()
        n_in = hidden_size * (num_condition + 1)
        self.linear = nn.Linear(n_in, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.res_connection: nn.Module = nn.Identity()
        if num_condition > 0:
            self.res_connection = nn.Linear(n_in, hidden_size)
            with torch.no_grad():
                self.res_connection.weight.zero_()
                self.res_connection.weight[:, :hidden_size] = torch.eye(hidden_size)
                self.res_connection.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_connection(x) + nn.functional.silu(self.linear(x))


class HydraHeads(nn.Module):
    """``hydra_num_heads`` sequentially dependent heads.

    ``hidden_states(k, h, path_emb)`` maps ``h: [N, hidden]`` and ``path_emb: [N, k + 1, hidden]`` (input
    embeddings of ``y_1 .. y_{k+1}``; ignored for ungrounded heads) to head ``k``'s hidden state ``[N, hidden]``;
    ``logits(k, x, lm_head_weight)`` maps that to ``[N, draft_vocab_size]`` (token ids of column ``j`` are
    ``token_map[j]`` when the draft vocabulary is truncated, ``j`` otherwise).
    """

    def __init__(self, config: HydraHeadsConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(CondResBlock(h, k + 1 if config.grounded_heads else 0),
                          *[CondResBlock(h) for _ in range(config.hydra_num_layers - 1)])
            for k in range(config.hydra_num_heads))
        self.hydra_lm_head = None
        if not config.original_lm_head:
            self.hydra_lm_head = nn.ModuleList(nn.Linear(h, config.draft_vocab_size)
                                               for _ in range(config.hydra_num_heads))
        if config.truncated_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(config.truncated_vocab_size, dtype=torch.long))
        else:
            self.token_map = None
        self.prefix_embeding_layer = PrefixLayer(h, config.prefix_layer) if config.has_prefix_layer else None

    @property
    def num_heads(self) -> int:
        return self.config.hydra_num_heads

    def prefix(self, hidden: torch.Tensor, positions: torch.Tensor, past=None, valid=None):
        """The prefix layer over hidden states (:meth:`PrefixLayer.forward`: ``[B, T, hidden]`` in,
        ``(p [B, T, hidden], (k, v))`` out); the heads read ``p`` in place of ``h``.

        Raises:
            ValueError: these heads have no prefix layer.
        """
        if self.prefix_embeding_layer is None:
            raise ValueError("these Hydra heads have no prefix layer (hydra_head_arch 'mlp')")
        return self.prefix_embeding_layer(hidden, positions, past, valid)

    def hidden_states(self, k: int, hidden: torch.Tensor, path_emb: torch.Tensor | None) -> torch.Tensor:
        """Head ``k``'s hidden state ``[N, hidden]``; ``path_emb [N, >= k + 1, hidden]`` (first ``k + 1`` used).
        ``hidden`` is the target's ``h_t``, or the prefix layer's ``p_t`` for ``prefix-mlp`` heads."""
        if self.config.grounded_heads:
            if path_emb is None or path_emb.shape[1] < k + 1:
                raise ValueError(f"grounded Hydra head {k} needs the embeddings of {k + 1} path tokens")
            x = torch.cat([hidden, path_emb[:, :k + 1].flatten(1)], dim=-1)
        else:
            x = hidden
        return self.hydra_mlp[k](x)

    def draft_lm_weight(self, lm_head_weight: torch.Tensor | None) -> torch.Tensor | None:
        """The shared lm_head restricted to the draft vocabulary: ``[vocab, hidden] -> [draft_vocab, hidden]``
        (None when the heads carry their own lm_heads)."""
        if self.hydra_lm_head is not None:
            return None
        if lm_head_weight is None:
            raise ValueError("these Hydra heads share the target's lm_head: pass lm_head_weight [vocab, hidden]")
        return lm_head_weight[self.token_map] if self.token_map is not None else lm_head_weight

    def logits(self, k: int, x: torch.Tensor, draft_lm_weight: torch.Tensor | None) -> torch.Tensor:
        """``x [N, hidden]`` (head ``k``'s hidden state) -> ``[N, draft_vocab]`` logits."""
        if self.hydra_lm_head is not None:
            return self.hydra_lm_head[k](x)
        return x @ draft_lm_weight.t()

    def to_token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns (any integer shape) -> target token ids."""
        return self.token_map[columns] if self.token_map is not None else columns

    def save(self, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """Write ``config.json`` and ``model.safetensors`` (weights in ``dtype``, float32 by default; the shipped
        heads use float16 to stay small; ``token_map`` int64) into ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        (path / CONFIG_NAME).write_text(json.dumps(self.config.model_dump(), indent=2) + "\n")


def check_hydra_arch(raw: dict, where: str | Path) -> None:
    """Refuse a Hydra config whose ``hydra_head_arch`` is not in :data:`SUPPORTED_ARCHS` (absent: ``mlp``).

    Raises:
        HeadsCheckpointError
    """
    arch = raw.get("hydra_head_arch", "mlp")
    if arch not in SUPPORTED_ARCHS:
        raise HeadsCheckpointError(
            f"Hydra heads checkpoint {where}: hydra_head_arch={arch!r} is not supported (supported: "
            f"{', '.join(map(repr, SUPPORTED_ARCHS))})")


def read_hydra_config(path: str | Path) -> HydraHeadsConfig:
    """Validate ``config.json`` of this project's Hydra layout in directory ``path``.

    Raises:
        HeadsCheckpointError: missing or invalid config (field named); ``hydra_head_arch`` other than ``mlp``.
    """
    cfg_file = Path(path) / CONFIG_NAME
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HeadsCheckpointError(f"Hydra heads checkpoint {cfg_file}: unreadable config ({e})") from e
    check_hydra_arch(raw, cfg_file)
    try:
        return HydraHeadsConfig(**raw)
    except ValidationError as e:
        raise HeadsCheckpointError(f"Hydra heads checkpoint {cfg_file}: {e}") from e


def hydra_weight_shapes(cfg: HydraHeadsConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``HydraHeads(cfg)`` holds (``token_map`` included); allocates nothing."""
    return weight_shapes(cfg, HydraHeads)


def describe_hydra_config(cfg: HydraHeadsConfig) -> str:
    """The config fields that decide which weights a checkpoint must hold, for error messages."""
    return (f"hydra_head_arch={cfg.hydra_head_arch!r}, "
            f"hydra_num_heads={cfg.hydra_num_heads}, hydra_num_layers={cfg.hydra_num_layers}, "
            f"grounded_heads={cfg.grounded_heads}, original_lm_head={cfg.original_lm_head}, "
            f"truncated_vocab_size={cfg.truncated_vocab_size}, hidden_size={cfg.hidden_size}, "
            f"vocab_size={cfg.vocab_size}")


def hydra_from_state(cfg: HydraHeadsConfig, state: dict[str, torch.Tensor], where: str) -> HydraHeads:
    """``HydraHeads(cfg)`` holding ``state`` exactly (float32).

    Raises:
        HeadsCheckpointError: missing, unexpected or mis-shaped weights (all named); a ``token_map`` that is not
            integer token ids inside the vocabulary.
    """
    check_weights({k: tuple(v.shape) for k, v in state.items()}, hydra_weight_shapes(cfg), where,
                  describe_hydra_config(cfg))
    state = dict(state)
    if "token_map" in state:
        tm = state["token_map"]
        if tm.dtype.is_floating_point or int(tm.min()) < 0 or int(tm.max()) >= cfg.vocab_size:
            raise HeadsCheckpointError(f"MTP heads checkpoint {where}: token_map must hold token ids in "
                                       f"[0, {cfg.vocab_size})")
        state["token_map"] = tm.long()
    heads = HydraHeads(cfg)
    heads.load_state_dict({k: v if k == "token_map" else v.float() for k, v in state.items()}, strict=True)
    return heads


def load_hydra_heads(path: str | Path, *, hidden_size: int | None = None, vocab_size: int | None = None,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> HydraHeads:
    """Load Hydra heads (this project's layout) from directory ``path`` and check they fit the target.

    Other layouts (Hydra's own ``hydra_lm_head.pt``): :func:`vllm_entmtp.heads.formats.load_any_heads`.

    Raises:
        HeadsCheckpointError: unreadable checkpoint, missing/unexpected/mis-shaped weights (named), a
            ``token_map`` with ids outside the vocabulary, hidden or vocabulary size different from the target's.
    """
    path = Path(path)
    cfg = read_hydra_config(path)
    check_fits(cfg, path, hidden_size, vocab_size)
    wfile = path / WEIGHTS_NAME
    if not wfile.is_file():
        raise HeadsCheckpointError(f"Hydra heads checkpoint {path}: no {WEIGHTS_NAME}")
    heads = hydra_from_state(cfg, load_file(str(wfile)), str(wfile)).to(device=device, dtype=dtype)
    return heads.eval()
