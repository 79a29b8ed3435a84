"""``vllm-entmtp`` console command: one sub-command per module.

Each sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; the first paragraph of its
docstring, reST markup removed, is the sub-command's description.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys

# name -> (module, one-line help)
COMMANDS = {
    "prepare": ("vllm_entmtp.prepare", "make the default target model and its heads ready offline; print paths"),
    "self-distill": ("vllm_entmtp.training.selfgen", "generate the target's own greedy replies to train-split "
                     "prompts, for train-heads --generated"),
    "train-heads": ("vllm_entmtp.training.train", "train Medusa or Hydra MTP heads (--kind) for a target model "
                    "(self-distillation)"),
    "convert-heads": ("vllm_entmtp.heads.convert", "convert MTP heads between checkpoint layouts"),
    "build-trees": ("vllm_entmtp.calibrate.cli", "measure head accuracy per signal bin (--signal: entropy by "
                    "default, or confidence) and build a scheduled tree set"),
}


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``); a note when it is not installed."""
    try:
        return importlib.metadata.version("vllm-entmtp")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (vllm-entmtp is not installed)"


def plain_text(doc: str) -> str:
    """reST docstring text as plain help text: ``x`` and :role:`x` become x (:role:`~a.b` becomes b)."""
    doc = re.sub(r":[\w:]+:`~([^`]*\.)?([^`.]+)`", r"\2", doc)
    doc = re.sub(r":[\w:]+:`([^`]+)`", r"\1", doc)
    return re.sub(r"``([^`]+)``", r"\1", doc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="vllm-entmtp", description="EntMTP speculative decoding for vLLM")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (mod_name, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:  # import only the module of the chosen command (some pull in torch or vLLM)
            module = importlib.import_module(mod_name)
            p.description = plain_text((module.__doc__ or help_).strip().split("\n\n")[0])
            module.add_arguments(p)
    args = parser.parse_args(argv)
    assert module is not None
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
