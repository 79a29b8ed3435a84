"""Checkpoint layouts of MTP heads: the registry, which layout a folder holds, and reading or writing heads
whatever their layout.

Supported layouts (the registry :data:`LAYOUTS`, name -> :class:`HeadsLayout`): ``vllm`` (vLLM's Medusa layout,
this project's own), ``fasterdecoding`` (FasterDecoding/Medusa's), ``entmtp-hydra`` (this project's Hydra
layout) and ``hydra`` (zankner/Hydra's). Their files, and the strict reading every one of them does, are
described in :mod:`vllm_entmtp.heads.layouts`, which holds each layout's functions.

Adding a layout: write its four functions in :mod:`vllm_entmtp.heads.layouts` and register it at the end of this
module::

    register_layout(HeadsLayout(
        name="my-layout",
        files="what a folder holds, in words",
        detect=lambda path: ...,                  # (path) -> bool
        read_config=...,                          # (path) -> config with hidden_size, vocab_size, num_heads
        read=...,                                 # (path, *, hidden_size=None, vocab_size=None) -> nn.Module
        write=...,                                # (heads, path) -> None, or None if read-only
    ))

``detect`` must be cheap (file names, config keys) and claim only its own folders: two layouts claiming one
folder is an error. ``read`` returns float32 CPU heads; :func:`load_any_heads` casts and moves them.
``read_config`` is what the start-up check (:mod:`vllm_entmtp.patches.config`) uses, so it should find a config
that contradicts the weights without loading them, where it can.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads import layouts
from vllm_entmtp.heads.hydra import HydraHeadsConfig, read_hydra_config
from vllm_entmtp.heads.medusa import MedusaHeadsConfig


@dataclass(frozen=True)
class HeadsLayout:
    """One checkpoint layout of MTP heads.

    Attributes:
        name: the layout's name (``convert-heads --to NAME``).
        files: what a folder in this layout holds, in words (shown when no layout matches a folder).
        detect: ``(folder) -> bool``; cheap; True only for folders in this layout. May raise
            HeadsCheckpointError for a folder it recognises but cannot read (e.g. invalid JSON).
        read_config: ``(folder) -> config`` with at least ``hidden_size``, ``vocab_size``, ``num_heads``.
        read: ``(folder, *, hidden_size=None, vocab_size=None) -> nn.Module``, float32 on CPU; checks the given
            target sizes and refuses mis-keyed or mis-shaped weights.
        write: ``(heads, folder) -> None``, or None if the layout is read-only.
        own_lm_heads: the layout stores a vocabulary projection per head, so heads that share the target's
            lm_head need a copy of it to be written (``convert-heads --target-model``).
    """

    name: str
    files: str
    detect: Callable[[Path], bool]
    read_config: Callable[[Path], Any]
    read: Callable[..., nn.Module]
    write: Callable[[nn.Module, Path], None] | None = None
    own_lm_heads: bool = False


#: The supported layouts, in detection order; add one with :func:`register_layout`.
LAYOUTS: dict[str, HeadsLayout] = {}


def register_layout(layout: HeadsLayout) -> HeadsLayout:
    """Add ``layout`` to :data:`LAYOUTS`.

    Raises:
        ValueError: a layout of that name is registered already.
    """
    if layout.name in LAYOUTS:
        raise ValueError(f"heads layout {layout.name!r} is registered already")
    LAYOUTS[layout.name] = layout
    return layout


MAX_FILES_SHOWN = 12  # an error lists at most this many of a folder's files


def detect_layout(path: str | Path) -> str:
    """Name of the layout (a key of :data:`LAYOUTS`) of the heads checkpoint in folder ``path``.

    Raises:
        HeadsCheckpointError: ``path`` is not a folder; no layout matches (the message lists the files found and
            the layouts supported); more than one matches; its ``config.json`` is not valid JSON.
    """
    path = Path(path)
    if not path.is_dir():
        raise HeadsCheckpointError(f"MTP heads checkpoint {path}: not a folder")
    matches = [name for name, layout in LAYOUTS.items() if layout.detect(path)]
    if len(matches) == 1:
        return matches[0]
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    files = names[:MAX_FILES_SHOWN] + ([f"... and {len(names) - MAX_FILES_SHOWN} more"]
                                       if len(names) > MAX_FILES_SHOWN else [])
    if matches:
        raise HeadsCheckpointError(f"MTP heads checkpoint {path} matches several layouts {matches}; files found: "
                                   f"{files}; keep the files of one layout only")
    supported = "; ".join(f"{name}: {layout.files}" for name, layout in LAYOUTS.items())
    raise HeadsCheckpointError(f"MTP heads checkpoint {path}: unknown layout; files found: {files or 'none'}; "
                               f"supported layouts: {supported}")


def read_any_heads_config(path: str | Path) -> MedusaHeadsConfig | HydraHeadsConfig:
    """Config of the heads checkpoint in folder ``path``, whatever its layout (:func:`detect_layout`).

    For the ``fasterdecoding`` layout, sizes missing from ``config.json`` are read from the weights' shapes, and
    the weights' names and shapes are checked against the config (no tensor data is loaded).

    Raises:
        HeadsCheckpointError: unknown layout, invalid config, a config that contradicts the weights.
    """
    path = Path(path)
    return LAYOUTS[detect_layout(path)].read_config(path)


def load_any_heads(path: str | Path, *, hidden_size: int | None = None, vocab_size: int | None = None,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Load the heads checkpoint in folder ``path``, whatever its layout, and check it fits the target.

    Same contract as :func:`vllm_entmtp.heads.medusa.load_heads`: ``hidden_size`` / ``vocab_size`` are the
    target's (checked when given); the heads map ``hidden: [N, hidden_size]`` to ``[num_heads, N, hidden_size]``
    and ``logits`` to ``[num_heads, N, vocab_size]``; parameters in ``dtype`` on ``device``, in eval mode.

    Raises:
        HeadsCheckpointError: unknown layout (files and supported layouts listed); unreadable files; missing,
            unexpected or mis-shaped weights (all named, in the layout's names); a config that contradicts the
            weights; hidden or vocabulary size different from the target's.
    """
    path = Path(path)
    heads = LAYOUTS[detect_layout(path)].read(path, hidden_size=hidden_size, vocab_size=vocab_size)
    return heads.to(device=device, dtype=dtype).eval()


def save_heads(heads: nn.Module, path: str | Path, layout: str) -> None:
    """Write ``heads`` into folder ``path`` (created if needed) in ``layout`` (a key of :data:`LAYOUTS`).

    Raises:
        HeadsCheckpointError: unknown or read-only layout; heads this layout cannot hold (e.g. heads sharing the
            target's lm_head in a layout with per-head lm_heads: see
            :func:`vllm_entmtp.heads.convert.with_own_lm_heads`).
    """
    if layout not in LAYOUTS or LAYOUTS[layout].write is None:
        writable = [name for name, lay in LAYOUTS.items() if lay.write is not None]
        raise HeadsCheckpointError(f"cannot write MTP heads in layout {layout!r}; writable layouts: {writable}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    LAYOUTS[layout].write(heads, path)


register_layout(HeadsLayout(
    name="vllm",
    files="config.json (model_type 'medusa', num_heads, num_hidden_layers, ...) + model.safetensors "
          "(blocks.{k}.layers.{l}.weight/bias, lm_heads.{k}.weight)",
    detect=lambda path: layouts.config_dict(path).get("model_type") == "medusa",
    read_config=layouts.vllm_read_config,
    read=layouts.vllm_read,
    write=layouts.vllm_write,
))
register_layout(HeadsLayout(
    name="fasterdecoding",
    files="config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path) + medusa_lm_head.pt or "
          "medusa_lm_head.safetensors ({k}.{l}.linear.weight/bias, {k}.{L}.weight)",
    detect=layouts.fd_detect,
    read_config=layouts.fd_read_config,
    read=layouts.fd_read,
    write=layouts.fd_write,
    own_lm_heads=True,
))
register_layout(HeadsLayout(
    name="entmtp-hydra",
    files="config.json (model_type 'hydra', hydra_num_heads, hydra_num_layers, grounded_heads, original_lm_head, "
          "truncated_vocab_size) + model.safetensors (hydra_mlp.{k}.{l}.linear/res_connection.weight/bias, "
          "token_map)",
    detect=lambda path: layouts.config_dict(path).get("model_type") == "hydra",
    read_config=read_hydra_config,
    read=layouts.entmtp_hydra_read,
    write=layouts.entmtp_hydra_write,
))
register_layout(HeadsLayout(
    name="hydra",
    files="config.json (hydra_num_heads, hydra_num_layers, hydra_head_arch 'mlp' or 'prefix-mlp', grounded_heads) + "
          "hydra_lm_head.pt or hydra_lm_head.safetensors (hydra_mlp.{k}.{l}.linear.weight/bias, "
          "hydra_mlp.{k}.0.res_connection.weight/bias, hydra_lm_head.{k}.weight/bias)",
    detect=layouts.hydra_detect,
    read_config=layouts.hydra_read_config,
    read=layouts.hydra_read,
    write=layouts.hydra_write,
    own_lm_heads=True,
))
