"""``vllm-entmtp`` console command: one sub-command per module.

Each sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "prepare": ("vllm_entmtp.prepare", "make the default target model and its heads ready offline; print paths"),
    "self-distill": ("vllm_entmtp.training.selfgen", "generate the target's own greedy replies to train-split "
                     "prompts, for train-heads --generated"),
    "train-heads": ("vllm_entmtp.training.train", "train MTP heads for a target model (self-distillation)"),
    "convert-heads": ("vllm_entmtp.heads.convert", "convert MTP heads between checkpoint layouts"),
    "build-trees": ("vllm_entmtp.calibrate.cli", "measure head accuracy per entropy bin and build a scheduled tree "
                    "set"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="vllm-entmtp", description="EntMTP speculative decoding for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (mod_name, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:  # import only the module of the chosen command (some pull in torch or vLLM)
            module = importlib.import_module(mod_name)
            p.description = (module.__doc__ or help_).strip().split("\n\n")[0]
            module.add_arguments(p)
    args = parser.parse_args(argv)
    assert module is not None
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
