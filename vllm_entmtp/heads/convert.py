"""Convert MTP heads between checkpoint layouts (Medusa: vLLM's, FasterDecoding's; Hydra: this project's,
zankner/Hydra's; see :mod:`vllm_entmtp.heads.formats`). Heads keep their kind: Medusa heads cannot become Hydra
heads or the reverse.

``vllm-entmtp convert-heads SRC DST --to LAYOUT`` reads the heads in folder SRC (layout detected, read strictly:
see :mod:`vllm_entmtp.heads.formats`) and writes them into the new or empty folder DST. Weights are written in
float32. Heads that share the target's lm_head (``original_lm_head: true``, what this project trains) going to a
layout with one lm_head per head (``fasterdecoding``, ``hydra``) need ``--target-model DIR``: the target's lm_head is read
from DIR's safetensors (only that tensor) and copied into every head, which gives the same logits.
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads.formats import LAYOUTS, detect_layout, load_any_heads, save_heads
from vllm_entmtp.heads.hydra import HydraHeads
from vllm_entmtp.heads.medusa import MedusaHeads


def read_target_lm_head(model_dir: str | Path) -> tuple[torch.Tensor, str]:
    """The lm_head weight ``[vocab, hidden]`` (float32, CPU) of the transformers model in folder ``model_dir``,
    and the name it was read under. Reads that one tensor from ``model.safetensors`` (or the shard that
    ``model.safetensors.index.json`` names): ``lm_head.weight``, else, with tied embeddings
    (``tie_word_embeddings`` not false in ``config.json``), ``model.embed_tokens.weight``.

    Raises:
        HeadsCheckpointError: not a model folder, no safetensors weights, or no lm_head weight in them.
    """
    model_dir = Path(model_dir)
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise HeadsCheckpointError(f"--target-model {model_dir}: no config.json (expected a transformers model "
                                   "folder)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HeadsCheckpointError(f"--target-model {model_dir}: unreadable config.json ({e})") from e
    text = cfg.get("text_config") or cfg
    tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    names = ["lm_head.weight"] + (["model.embed_tokens.weight"] if tied else [])
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        where = {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    elif (model_dir / "model.safetensors").is_file():
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            where = {k: model_dir / "model.safetensors" for k in f.keys()}
    else:
        raise HeadsCheckpointError(f"--target-model {model_dir}: no model.safetensors or "
                                   "model.safetensors.index.json")
    for name in names:
        if name in where:
            with safe_open(str(where[name]), framework="pt") as f:
                return f.get_tensor(name).float(), name
    raise HeadsCheckpointError(f"--target-model {model_dir}: none of {names} in its weights "
                               f"(tie_word_embeddings={tied})")


def for_vllm_medusa(src: str | Path, target_model: str | Path, dst: str | Path) -> Path:
    """Medusa heads that share the target's lm_head, made loadable by vLLM's own ``medusa`` method: vLLM never
    shares the target's lm_head with a Medusa draft model; with ``original_lm_head: true`` it reads the one
    lm_head from the checkpoint's ``lm_heads.0.weight`` and otherwise leaves it uninitialised (every draft token
    is then rejected). ``dst`` gets ``src``'s ``config.json`` and weights plus the target's lm_head as
    ``lm_heads.0.weight`` (float32, ``[vocab, hidden]``, about 113 MB for SmolLM2-135M). Idempotent: an
    up-to-date ``dst`` is kept.

    Raises:
        HeadsCheckpointError: ``src`` is not Medusa heads in vLLM's layout that share the target's lm_head, or
            the target's lm_head does not fit them.
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    if detect_layout(src) != "vllm":
        raise HeadsCheckpointError(f"{src}: vLLM's medusa method needs Medusa heads in vLLM's layout")
    cfg = json.loads((src / "config.json").read_text())
    if not cfg.get("original_lm_head"):
        raise HeadsCheckpointError(f"{src}: these heads carry their own lm_heads; vLLM loads them as they are")
    stamp = dst / "entmtp-source.json"
    key = {"src": str(src.resolve()), "mtime": (src / "model.safetensors").stat().st_mtime_ns,
           "target": str(Path(target_model).resolve())}
    if stamp.is_file() and json.loads(stamp.read_text()) == key:
        return dst
    weight, _ = read_target_lm_head(target_model)
    if weight.shape != (cfg["vocab_size"], cfg["hidden_size"]):
        raise HeadsCheckpointError(f"the target's lm_head is {tuple(weight.shape)}, the heads need "
                                   f"({cfg['vocab_size']}, {cfg['hidden_size']})")
    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    state["lm_heads.0.weight"] = weight.contiguous()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stamp.write_text(json.dumps(key) + "\n")
    return dst


def shares_target_lm_head(heads) -> bool:
    """Whether ``heads`` (Medusa or Hydra) use the target's lm_head instead of their own."""
    if isinstance(heads, HydraHeads):
        return heads.hydra_lm_head is None
    return heads.lm_heads is None


def with_own_lm_heads(heads: MedusaHeads | HydraHeads, lm_head_weight: torch.Tensor) -> MedusaHeads | HydraHeads:
    """A copy of ``heads`` (which share the target's lm_head) with ``lm_head_weight: [vocab, hidden]`` copied into
    one lm_head per head (``original_lm_head: false``), giving the same top-k tokens: Medusa heads' logits are
    equal; Hydra heads with a draft vocabulary get full-vocabulary lm_heads whose bias is 0 on the draft
    vocabulary and -1e4 elsewhere (so they never propose a token outside it, as before).

    Raises:
        HeadsCheckpointError: ``heads`` have their own lm_heads already, or the weight's shape does not fit.
    """
    cfg = heads.config
    if not shares_target_lm_head(heads):
        raise HeadsCheckpointError("these heads have their own lm_heads already")
    if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise HeadsCheckpointError(f"the target's lm_head is {tuple(lm_head_weight.shape)}, the heads need "
                                   f"[vocab_size, hidden_size] = ({cfg.vocab_size}, {cfg.hidden_size})")
    state = dict(heads.state_dict())
    if isinstance(heads, HydraHeads):
        out = HydraHeads(cfg.model_copy(update={"original_lm_head": False, "truncated_vocab_size": None}))
        bias = torch.zeros(cfg.vocab_size)
        if state.pop("token_map", None) is not None:
            bias.fill_(-1e4)
            bias[heads.token_map] = 0.0
        for k in range(cfg.num_heads):
            state[f"hydra_lm_head.{k}.weight"] = lm_head_weight
            state[f"hydra_lm_head.{k}.bias"] = bias
    else:
        out = MedusaHeads(cfg.model_copy(update={"original_lm_head": False}))
        state.update({f"lm_heads.{k}.weight": lm_head_weight for k in range(cfg.num_heads)})
    out.load_state_dict(state, strict=True)
    return out


def _describe(layout: str, heads) -> str:
    cfg = heads.config
    lm = "shared target lm_head" if shares_target_lm_head(heads) else "own lm_head per head"
    if isinstance(heads, HydraHeads):
        vocab = f", draft vocabulary {cfg.truncated_vocab_size}" if cfg.truncated_vocab_size else ""
        return (f"{layout} layout: {cfg.num_heads} Hydra heads x {cfg.hydra_num_layers} layers, hidden "
                f"{cfg.hidden_size}, vocab {cfg.vocab_size}{vocab}, {lm}")
    return (f"{layout} layout: {cfg.num_heads} heads x {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"vocab {cfg.vocab_size}, {lm}")


def convert_heads(src: str | Path, dst: str | Path, to: str, *, target_model: str | Path | None = None,
                  base_model: str | None = None) -> list[str]:
    """Convert the heads checkpoint in folder ``src`` into layout ``to`` in folder ``dst`` (new or empty).

    Args:
        target_model: a transformers model folder whose lm_head is copied into every head; needed when ``src``
            shares the target's lm_head and ``to`` stores one per head.
        base_model: ``base_model_name_or_path`` to record (fasterdecoding's config); default: the source's.

    Returns:
        The lines of a report: what was read, what was written, notes.

    Raises:
        HeadsCheckpointError: unknown layout, unreadable or mis-keyed source, ``dst`` not empty, a missing
            ``target_model`` (the message says so) or one whose lm_head does not fit.
    """
    src, dst = Path(src), Path(dst)
    if to not in LAYOUTS or LAYOUTS[to].write is None:
        raise HeadsCheckpointError(f"--to {to!r}: writable layouts are "
                                   f"{[n for n, lay in LAYOUTS.items() if lay.write is not None]}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise HeadsCheckpointError(f"destination {dst} exists and is not an empty folder")
    src_layout = detect_layout(src)
    heads = load_any_heads(src)
    report = [f"read {src} ({_describe(src_layout, heads)})"]
    if LAYOUTS[to].own_lm_heads and shares_target_lm_head(heads):
        if target_model is None:
            raise HeadsCheckpointError(
                f"{src} shares the target model's lm_head (original_lm_head: true), but the {to} layout stores an "
                "lm_head per head: pass --target-model DIR (the target's transformers model folder) to copy its "
                "lm_head into every head")
        weight, name = read_target_lm_head(target_model)
        heads = with_own_lm_heads(heads, weight)
        report.append(f"copied the target's lm_head ({name} of {target_model}, {tuple(weight.shape)}) into every "
                      "head")
        base_model = base_model or str(target_model)
    elif target_model is not None:
        report.append(f"note: --target-model {target_model} not needed (the lm_heads need no change), not used")
    if base_model is not None:
        heads.config = heads.config.model_copy(update={"base_model_name_or_path": base_model})
    elif to == "fasterdecoding" and "base_model_name_or_path" not in (heads.config.model_extra or {}):
        report.append("note: no base_model_name_or_path recorded (FasterDecoding's MedusaModel then assumes "
                      "lmsys/vicuna-7b-v1.3): pass --base-model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_heads(heads, dst, to)
    report.append(f"wrote {dst} ({_describe(to, heads)}): {', '.join(sorted(p.name for p in dst.iterdir()))}")
    report.extend(f"note: {w.message}" for w in caught)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="folder of the heads checkpoint to read (layout detected)")
    p.add_argument("dst", help="folder to write (must be new or empty)")
    p.add_argument("--to", required=True, choices=[n for n, lay in LAYOUTS.items() if lay.write is not None],
                   help="layout to write")
    p.add_argument("--target-model", metavar="DIR",
                   help="the target's transformers model folder: its lm_head is copied into every head when SRC "
                        "shares the target's lm_head and --to stores one per head (fasterdecoding, hydra)")
    p.add_argument("--base-model", metavar="NAME",
                   help="base_model_name_or_path to record in DST's config (default: SRC's, else --target-model)")


def run(args: argparse.Namespace) -> int:
    try:
        report = convert_heads(args.src, args.dst, args.to, target_model=args.target_model,
                               base_model=args.base_model)
    except HeadsCheckpointError as e:
        raise SystemExit(f"convert-heads: {e}") from e
    print("\n".join(report))
    return 0
