"""Make the default target model (SmolLM2-135M-Instruct) and its registered heads ready, offline.

Idempotent; progress goes to stderr. ``--json`` prints only ``{"model": ..., "heads": {...}}`` on stdout.
"""
from __future__ import annotations

import argparse
import json

from vllm_entmtp import models


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the paths as one JSON object and nothing else")
    p.add_argument("--force", action="store_true", help="convert the model again even if it is ready")


def run(args: argparse.Namespace) -> int:
    model_dir = models.prepare_default_model(force=args.force)
    heads = {k: str(v) for k, v in models.default_heads().items()}
    if args.json:
        print(json.dumps({"model": str(model_dir), "heads": heads}))
    else:
        print(f"model: {model_dir}")
        for kind, path in heads.items():
            print(f"heads ({kind}): {path}")
        if not heads:
            print("heads: none registered yet")
    return 0
