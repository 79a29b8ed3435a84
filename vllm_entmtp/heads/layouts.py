"""Reading and writing each checkpoint layout of MTP heads, strictly.

The registry that names these layouts, detects which one a folder holds and dispatches to the functions here
is :mod:`vllm_entmtp.heads.formats` (:data:`~vllm_entmtp.heads.formats.LAYOUTS`); use its
:func:`~vllm_entmtp.heads.formats.load_any_heads` and :func:`~vllm_entmtp.heads.formats.save_heads` rather
than these functions.

The layouts:

``vllm``
    vLLM's Medusa layout, this project's own (:mod:`vllm_entmtp.heads.medusa`): ``config.json`` with
    ``model_type: "medusa"``, ``num_heads``, ``num_hidden_layers``, ``medusa_fc_bias``, ``original_lm_head``;
    ``model.safetensors`` with ``blocks.{k}.layers.{l}.weight/bias`` and, unless ``original_lm_head``,
    ``lm_heads.{k}.weight``.
``fasterdecoding``
    FasterDecoding/Medusa's (Medusa-1) layout, as ``MedusaModel`` saves it: ``config.json`` with
    ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path`` (``hidden_size`` / ``vocab_size``
    often absent: they are read from the weights' shapes); ``medusa_lm_head.pt`` (a torch state dict, read with
    ``weights_only=True``) or ``medusa_lm_head.safetensors`` holding the state dict of ``medusa_head``, a list
    of ``nn.Sequential(ResBlock x L, Linear(hidden, vocab, bias=False))``: ``{k}.{l}.linear.weight``
    ``[hidden, hidden]`` and ``{k}.{l}.linear.bias`` ``[hidden]`` for ``l < L``, ``{k}.{L}.weight``
    ``[vocab, hidden]``. Every head has its own lm_head and every ResBlock a bias. FasterDecoding builds a head
    from ``[ResBlock(h)] * L``, one module repeated, so its ``L`` layers hold the same weights (written under
    every layer's name); this project and vLLM read the names layer by layer.

``entmtp-hydra``
    This project's Hydra layout (:mod:`vllm_entmtp.heads.hydra`): ``config.json`` with ``model_type: "hydra"``,
    ``hydra_num_heads``, ``hydra_num_layers``, ``grounded_heads``, ``original_lm_head``,
    ``truncated_vocab_size``; ``model.safetensors`` with ``hydra_mlp.{k}.{l}.linear.weight/bias``,
    ``hydra_mlp.{k}.0.res_connection.weight/bias`` (grounded heads), ``hydra_lm_head.{k}.weight/bias`` unless
    ``original_lm_head``, and ``token_map`` with a draft vocabulary.
``hydra``
    zankner/Hydra's layout (``HydraModel`` with ``hydra_head_arch: "mlp"``): ``config.json`` with
    ``hydra_num_heads``, ``hydra_num_layers``, ``hydra_head_arch``, ``grounded_heads``,
    ``base_model_name_or_path`` (sizes read from the weights); ``hydra_lm_head.pt`` (or ``.safetensors``) with
    the same weight names as ``entmtp-hydra`` and a full-vocabulary ``hydra_lm_head.{k}`` (with bias) per head.
    Hydra++'s ``prefix-mlp`` heads add ``prefix_embeding_layer.*`` (a one-layer ``LlamaModel``; its
    ``embed_tokens.weight`` is dropped, the layer reads hidden states). That layer's shape is the base model's:
    it comes from ``prefix_layer`` in ``config.json`` if present, else from the ``config.json`` of the folder
    ``base_model_name_or_path`` names. ``cross-attn`` / ``eagle-attn`` heads are refused.

Reading is strict in every layout: a missing or unexpected weight, a weight of the wrong shape, or a config
that contradicts the weights raises :class:`~vllm_entmtp.errors.HeadsCheckpointError` naming every offending
key in the layout's own names -- never a half-loaded head (FasterDecoding's own loader uses
``load_state_dict(strict=False)``, which silently keeps initial weights for mis-keyed heads).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads.hydra import (HydraHeads, HydraHeadsConfig, check_hydra_arch, describe_hydra_config,
                                     hydra_from_state,
                                     hydra_weight_shapes, load_hydra_heads)
from vllm_entmtp.heads.medusa import (CONFIG_NAME, MedusaHeads, MedusaHeadsConfig, check_fits, check_weights,
                                      load_heads, read_heads_config, weight_shapes)


def config_dict(path: Path) -> dict:
    """``config.json`` of folder ``path`` as a dict; ``{}`` when there is none.

    Raises:
        HeadsCheckpointError: the file is not a JSON object.
    """
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        return {}
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: invalid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: expected a JSON object, got "
                                   f"{type(raw).__name__}")
    return raw


def _write_config(path: Path, cfg, config: dict) -> None:
    """``config.json`` of a public layout: ``config``, then the config's other keys (e.g. the base model) and
    its ``entmtp`` provenance."""
    config = dict(config)
    config.update({k: v for k, v in (cfg.model_extra or {}).items() if k not in config})
    if cfg.entmtp:
        config["entmtp"] = cfg.entmtp
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def _require_medusa(heads: nn.Module, layout: str) -> MedusaHeads:
    if not isinstance(heads, MedusaHeads):
        raise HeadsCheckpointError(f"layout {layout!r} holds Medusa heads, not {type(heads).__name__}")
    return heads


# ----------------------------------------------------------------------------------------------------- vllm

def _refuse_truncated_vocab(cfg: MedusaHeadsConfig, path: Path) -> MedusaHeadsConfig:
    if cfg.truncated_vocab_size is not None and cfg.truncated_vocab_size != cfg.vocab_size:
        raise HeadsCheckpointError(
            f"MTP heads checkpoint {path}: truncated_vocab_size={cfg.truncated_vocab_size} < "
            f"vocab_size={cfg.vocab_size} (a draft vocabulary with a token_map) is not supported for Medusa heads")
    return cfg


def vllm_read_config(path: Path) -> MedusaHeadsConfig:
    return _refuse_truncated_vocab(read_heads_config(path), path)


def vllm_read(path: Path, *, hidden_size: int | None = None, vocab_size: int | None = None) -> MedusaHeads:
    vllm_read_config(path)
    return load_heads(path, hidden_size=hidden_size, vocab_size=vocab_size)


def vllm_write(heads: nn.Module, path: Path) -> None:
    _require_medusa(heads, "vllm").save(path)


# ------------------------------------------------------------------------------------------- fasterdecoding

FD_WEIGHTS_NAMES = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")


def _detect_foreign(path: Path, own_model_type: str, key: str, weight_names: tuple[str, ...]) -> bool:
    """A folder in a public layout: not this project's ``model_type``, and the layout's config key or one of
    its weight files."""
    raw = config_dict(path)
    if raw.get("model_type") == own_model_type:
        return False
    return key in raw or any((path / name).is_file() for name in weight_names)


def _one_weights_file(path: Path, names: tuple[str, ...], layout: str) -> Path:
    present = [path / name for name in names if (path / name).is_file()]
    if len(present) != 1:
        what = "neither" if not present else "both"
        raise HeadsCheckpointError(f"MTP heads checkpoint {path} ({layout} layout): {what} of "
                                   f"{' and '.join(names)} found; expected exactly one")
    return present[0]


def fd_detect(path: Path) -> bool:
    return _detect_foreign(path, "medusa", "medusa_num_heads", FD_WEIGHTS_NAMES)


def _fd_weights_file(path: Path) -> Path:
    return _one_weights_file(path, FD_WEIGHTS_NAMES, "fasterdecoding")


def _torch_state(wfile: Path) -> dict[str, torch.Tensor]:
    """A ``.pt`` state dict loaded with ``weights_only=True``, memory-mapped where the file allows."""
    try:
        try:
            state = torch.load(wfile, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
            state = torch.load(wfile, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        raise HeadsCheckpointError(f"MTP heads checkpoint {wfile}: cannot be read as a torch state dict with "
                                   f"weights_only=True ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise HeadsCheckpointError(f"MTP heads checkpoint {wfile}: expected a state dict (name -> tensor), got "
                                   f"{type(state).__name__}")
    return state


def _fd_shapes(wfile: Path) -> dict[str, tuple[int, ...]]:
    if wfile.suffix == ".safetensors":
        try:
            with safe_open(str(wfile), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise HeadsCheckpointError(f"MTP heads checkpoint {wfile}: unreadable safetensors file ({e})") from e
    return {k: tuple(v.shape) for k, v in _torch_state(wfile).items()}


def _fd_name(vllm_name: str, num_layers: int) -> str:
    """vLLM's Medusa weight name -> FasterDecoding's (``blocks.k.layers.l.p`` -> ``k.l.linear.p``,
    ``lm_heads.k.weight`` -> ``k.L.weight``)."""
    parts = vllm_name.split(".")
    if parts[0] == "blocks":
        return f"{parts[1]}.{parts[3]}.linear.{parts[4]}"
    return f"{parts[1]}.{num_layers}.weight"


def _int_field(raw: dict, key: str, cfg_file: Path, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: {key} must be an integer, got {value!r}")
    return value


def _fd_size(raw: dict, name: str, from_weights: int, where: str, cfg_file: Path) -> int:
    """A size from config.json, checked against the weights' shapes (``where``), else the weights'."""
    if name not in raw:
        return from_weights
    value = _int_field(raw, name, cfg_file)
    if value != from_weights:
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file} says {name}={value}, but the weights "
                                   f"({where}) have {name}={from_weights}")
    return value


def _fd_config(path: Path, target_hidden: int | None = None,
               target_vocab: int | None = None) -> tuple[MedusaHeadsConfig, Path, dict[str, str]]:
    """Config of a fasterdecoding folder, checked against the weights' names and shapes (sizes missing from
    config.json are the weights'). Returns ``(config, weights file, FasterDecoding name -> vLLM name)``."""
    cfg_file = path / CONFIG_NAME
    raw = config_dict(path)
    if not raw:
        raise HeadsCheckpointError(f"MTP heads checkpoint {path} (fasterdecoding layout): no {CONFIG_NAME}")
    if "medusa_num_heads" not in raw:
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: no medusa_num_heads")
    num_heads = _int_field(raw, "medusa_num_heads", cfg_file)
    num_layers = _int_field(raw, "medusa_num_layers", cfg_file, default=1)  # FasterDecoding's default
    extra = {k: raw[k] for k in ("base_model_name_or_path", "entmtp") if k in raw}
    wfile = _fd_weights_file(path)
    shapes = _fd_shapes(wfile)
    describe = (f"medusa_num_heads={num_heads}, medusa_num_layers={num_layers}: each head is {num_layers} "
                "ResBlock(s) with bias and its own lm_head")

    def expected(hidden: int, vocab: int) -> tuple[MedusaHeadsConfig, dict[str, str], dict[str, tuple]]:
        try:
            cfg = MedusaHeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads,
                                    num_hidden_layers=num_layers, medusa_fc_bias=True, original_lm_head=False,
                                    **extra)
        except ValidationError as e:
            raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: {e}") from e
        ours = weight_shapes(cfg)
        names = {_fd_name(k, num_layers): k for k in ours}
        return cfg, names, {fd: ours[k] for fd, k in names.items()}

    _, names, want = expected(1, 1)  # the names do not depend on the sizes: check them first
    if set(want) != set(shapes):
        check_weights(shapes, want, str(wfile), describe)  # raises, naming every missing and unexpected key
    where = f"{wfile.name}: 0.{num_layers}.weight"
    if len(shapes[f"0.{num_layers}.weight"]) != 2:
        raise HeadsCheckpointError(f"MTP heads checkpoint {where} has shape {shapes[f'0.{num_layers}.weight']}, "
                                   "expected [vocab_size, hidden_size]")
    vocab, hidden = shapes[f"0.{num_layers}.weight"]  # an lm_head {k}.{L}.weight is [vocab, hidden]
    cfg, names, want = expected(_fd_size(raw, "hidden_size", hidden, where, cfg_file),
                                _fd_size(raw, "vocab_size", vocab, where, cfg_file))
    check_fits(cfg, path, target_hidden, target_vocab)
    check_weights(shapes, want, str(wfile),
                  f"{describe}; hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}")
    return cfg, wfile, names


def fd_read_config(path: Path) -> MedusaHeadsConfig:
    return _fd_config(path)[0]


def fd_read(path: Path, *, hidden_size: int | None = None, vocab_size: int | None = None) -> MedusaHeads:
    cfg, wfile, names = _fd_config(path, hidden_size, vocab_size)
    state = load_file(str(wfile)) if wfile.suffix == ".safetensors" else _torch_state(wfile)
    heads = MedusaHeads(cfg)
    heads.load_state_dict({names[k]: v for k, v in state.items()}, strict=True)
    return heads


def fd_write(heads: nn.Module, path: Path) -> None:
    heads = _require_medusa(heads, "fasterdecoding")
    cfg = heads.config
    if heads.lm_heads is None:
        raise HeadsCheckpointError(
            "the fasterdecoding layout stores an lm_head per head, but these heads share the target's lm_head "
            "(original_lm_head: true): copy the target's into every head first (`vllm-entmtp convert-heads ... "
            "--target-model DIR`, or vllm_entmtp.heads.convert.with_own_lm_heads)")
    L = cfg.num_hidden_layers
    state = {}
    for name, t in heads.state_dict().items():
        state[_fd_name(name, L)] = t.detach().float().contiguous().clone()
    for k in range(cfg.num_heads):
        for l in range(L):
            if not cfg.medusa_fc_bias:  # FasterDecoding's ResBlock always has a bias: zero is the same head
                state[f"{k}.{l}.linear.bias"] = torch.zeros(cfg.hidden_size)
        if L > 1 and any(not torch.equal(state[f"{k}.0.linear.{p}"], state[f"{k}.{l}.linear.{p}"])
                         for l in range(1, L) for p in ("weight", "bias")):
            warnings.warn(f"head {k} has {L} layers with different weights: vLLM and this project read them layer "
                          "by layer, but FasterDecoding's own MedusaModel ties a head's layers ([ResBlock] * L) and "
                          "would use one layer's weights for all", stacklevel=2)
    torch.save(state, path / FD_WEIGHTS_NAMES[0])
    _write_config(path, cfg, {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": L,
                              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size})


# ------------------------------------------------------------------------------------- Hydra: this project's

def _require_hydra(heads: nn.Module, layout: str) -> HydraHeads:
    if not isinstance(heads, HydraHeads):
        raise HeadsCheckpointError(f"layout {layout!r} holds Hydra heads, not {type(heads).__name__}")
    return heads


def entmtp_hydra_read(path: Path, *, hidden_size: int | None = None, vocab_size: int | None = None
                       ) -> HydraHeads:
    return load_hydra_heads(path, hidden_size=hidden_size, vocab_size=vocab_size)


def entmtp_hydra_write(heads: nn.Module, path: Path) -> None:
    _require_hydra(heads, "entmtp-hydra").save(path)


# ------------------------------------------------------------------------------ Hydra: zankner/Hydra's own

HYDRA_WEIGHTS_NAMES = ("hydra_lm_head.pt", "hydra_lm_head.safetensors")


def hydra_detect(path: Path) -> bool:
    return _detect_foreign(path, "hydra", "hydra_num_heads", HYDRA_WEIGHTS_NAMES)


def _hydra_files(path: Path) -> tuple[dict, Path]:
    raw = config_dict(path)
    wfile = _one_weights_file(path, HYDRA_WEIGHTS_NAMES, "hydra")
    check_hydra_arch(raw, path / CONFIG_NAME)
    return raw, wfile


def _hydra_shapes(wfile: Path) -> dict[str, tuple[int, ...]]:
    if wfile.suffix == ".safetensors":
        with safe_open(str(wfile), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return {k: tuple(v.shape) for k, v in _torch_state(wfile).items()}


#: Weights of Hydra++ checkpoints that the prefix layer does not use (it reads hidden states, not tokens).
HYDRA_UNUSED_WEIGHTS = ("prefix_embeding_layer.embed_tokens.weight",)


def _hydra_prefix_config(raw: dict, cfg_file: Path):
    """The prefix layer's shape for a ``prefix-mlp`` checkpoint in Hydra's layout (None for ``mlp``)."""
    from vllm_entmtp.heads.prefix import PrefixLayerConfig

    if raw.get("hydra_head_arch", "mlp") != "prefix-mlp":
        return None
    try:
        if raw.get("prefix_layer"):
            return PrefixLayerConfig(**raw["prefix_layer"])
        base = raw.get("base_model_name_or_path")
        base_cfg = Path(base) / "config.json" if base else None
        if base_cfg is None or not base_cfg.is_file():
            raise HeadsCheckpointError(
                f"MTP heads checkpoint {cfg_file}: 'prefix-mlp' heads run a decoder layer shaped like the base "
                f"model's, and base_model_name_or_path={base!r} is not a local folder with a config.json: point it "
                "at the target model's folder, or add \"prefix_layer\": {\"num_attention_heads\", "
                "\"num_key_value_heads\", \"head_dim\", \"intermediate_size\", \"rms_norm_eps\", \"rope_theta\"}")
        return PrefixLayerConfig.from_target_config(json.loads(base_cfg.read_text()))
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: prefix layer: {e}") from e


def _hydra_config(path: Path) -> tuple[HydraHeadsConfig, Path]:
    """Config of a folder in Hydra's layout: heads and layers from ``config.json``, sizes (and, when the config
    does not say, ``grounded_heads``) from the weights' shapes; then the weights' names are checked."""
    raw, wfile = _hydra_files(path)
    cfg_file = path / CONFIG_NAME
    shapes = {k: v for k, v in _hydra_shapes(wfile).items() if k not in HYDRA_UNUSED_WEIGHTS}
    lin = shapes.get("hydra_mlp.0.0.linear.weight")
    lm = shapes.get("hydra_lm_head.0.weight")
    if lin is None or lm is None:
        raise HeadsCheckpointError(f"MTP heads checkpoint {wfile} (hydra layout): no hydra_mlp.0.0.linear.weight "
                                   f"or hydra_lm_head.0.weight; weights found: {sorted(shapes)[:12]}")
    grounded = raw.get("grounded_heads", "hydra_mlp.0.0.res_connection.weight" in shapes)
    try:
        cfg = HydraHeadsConfig(
            hidden_size=_fd_size(raw, "hidden_size", lin[0], "hydra_mlp.0.0.linear.weight", cfg_file),
            vocab_size=_fd_size(raw, "vocab_size", lm[0], "hydra_lm_head.0.weight", cfg_file),
            hydra_num_heads=_int_field(raw, "hydra_num_heads", cfg_file),
            hydra_num_layers=_int_field(raw, "hydra_num_layers", cfg_file, default=1),
            grounded_heads=bool(grounded), original_lm_head=False,
            hydra_head_arch=raw.get("hydra_head_arch", "mlp"), prefix_layer=_hydra_prefix_config(raw, cfg_file),
            **{k: v for k, v in raw.items() if k in ("base_model_name_or_path", "entmtp")})
    except ValidationError as e:
        raise HeadsCheckpointError(f"MTP heads checkpoint {cfg_file}: {e}") from e
    check_weights(shapes, hydra_weight_shapes(cfg), str(wfile), describe_hydra_config(cfg))
    return cfg, wfile


def hydra_read_config(path: Path) -> HydraHeadsConfig:
    return _hydra_config(path)[0]


def hydra_read(path: Path, *, hidden_size: int | None = None, vocab_size: int | None = None) -> HydraHeads:
    cfg, wfile = _hydra_config(path)
    check_fits(cfg, path, hidden_size, vocab_size)
    state = load_file(str(wfile)) if wfile.suffix == ".safetensors" else _torch_state(wfile)
    return hydra_from_state(cfg, {k: v for k, v in state.items() if k not in HYDRA_UNUSED_WEIGHTS}, str(wfile))


def hydra_write(heads: nn.Module, path: Path) -> None:
    heads = _require_hydra(heads, "hydra")
    cfg = heads.config
    if heads.hydra_lm_head is None or heads.token_map is not None:
        raise HeadsCheckpointError(
            "the hydra layout stores a full-vocabulary lm_head per head, but these heads share the target's "
            "lm_head or score a draft vocabulary: convert with `vllm-entmtp convert-heads ... --target-model DIR` "
            "(vllm_entmtp.heads.convert.with_own_lm_heads)")
    torch.save({k: v.detach().float().contiguous().clone() for k, v in heads.state_dict().items()},
               path / HYDRA_WEIGHTS_NAMES[0])
    _write_config(path, cfg, {"hydra_num_heads": cfg.hydra_num_heads, "hydra_num_layers": cfg.hydra_num_layers,
                              "hydra_head_arch": cfg.hydra_head_arch, "grounded_heads": cfg.grounded_heads,
                              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                              **({"prefix_layer": cfg.prefix_layer.model_dump()} if cfg.prefix_layer else {})})


