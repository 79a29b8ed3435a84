"""The frozen target model and the data a ``train-heads`` run learns from: the plan, the target's pass over the
shards not cached yet, the cached shards (or generations recorded from vLLM, ``--recorded``), and the shards of
other work dirs (``--extra-data``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_entmtp.training import data as D


def _load_target(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    return tok, model


def prepare_data(args, model_dir: str, log=print) -> tuple[D.CachedData, dict]:
    """Plan, run the target over the missing shards (unless ``--cached-only``), load all cached shards.

    With ``--recorded DIR``: the target's own greedy generations recorded from vLLM instead of the text cache."""
    if getattr(args, "recorded", None):
        from vllm_entmtp.training.record import load_recorded

        _, model = _load_target(model_dir)
        return load_recorded(args.recorded), _target_info(model)
    data_dir = Path(args.work_dir) / "data"
    cfg = {"model": str(model_dir), "positions": args.positions, "mix": args.mix, "max_len": args.max_len,
           "seed": args.seed}
    if getattr(args, "generated", None):  # only then: work dirs of text-only data keep their config
        cfg["generated"] = str(Path(args.generated).resolve())
    extra_paths, exclude = [], set()
    if getattr(args, "extra_data", None):
        cfg["extra_data"] = [str(Path(x).resolve()) for x in args.extra_data]
        for x in args.extra_data:
            paths, ids = extra_data(Path(x), str(model_dir), args.max_len, args.shard_tokens)
            extra_paths += paths
            exclude |= ids
    cfg_file = data_dir / "data_config.json"
    if cfg_file.is_file():
        old = json.loads(cfg_file.read_text())
        if old != cfg:
            raise SystemExit(f"{data_dir} holds data built with {old}, not {cfg}: use another --work-dir")
    data_dir.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    tok, model = _load_target(model_dir)
    plan = D.load_or_build_plan(data_dir, tok, args.positions, args.mix, args.max_len, args.seed, log=log,
                                generated=getattr(args, "generated", None), exclude=exclude)
    n_shards = len(D.shard_ranges(plan, args.shard_tokens))
    if args.shards is not None:
        plan = plan[:D.shard_ranges(plan, args.shard_tokens)[min(args.shards, n_shards) - 1][1]]
        n_shards = min(args.shards, n_shards)
    if args.cached_only:
        paths = [D.shard_path(data_dir, k) for k in range(n_shards)]
        paths = paths[:next((i for i, p in enumerate(paths) if not p.is_file()), len(paths))]
        if not paths:
            raise SystemExit(f"--cached-only: no cached shards in {data_dir}")
        log(f"--cached-only: using {len(paths)} of {n_shards} shards")
    else:
        W = model.get_output_embeddings().weight.detach()
        paths = D.cache_shards(model, W, plan, data_dir, args.shard_tokens, args.target_batch_tokens,
                               tok.pad_token_id if tok.pad_token_id is not None else 0, log=log)
    if extra_paths:
        log(f"--extra-data: {len(extra_paths)} cached shards of {', '.join(args.extra_data)} besides these {len(paths)}")
    data = D.load_shards(paths + extra_paths)
    return data, _target_info(model)


def extra_data(work_dir: Path, model_dir: str, max_len: int, shard_tokens: int) -> tuple[list[Path], set[str]]:
    """The cached shards of another work dir and the ids of the documents they hold (``--extra-data``).

    Raises:
        SystemExit: not a work dir with a complete target pass, or one of another target or ``--max-len``
            (names the folder and both values).
    """
    data_dir = work_dir / "data"
    cfg_file = data_dir / "data_config.json"
    plan = D.read_plan(data_dir) if cfg_file.is_file() else None
    if plan is None:
        raise SystemExit(f"--extra-data {work_dir}: no train-heads data there ({cfg_file} and "
                         f"{data_dir / D.PLAN_NAME})")
    cfg = json.loads(cfg_file.read_text())
    for key, want in (("model", str(model_dir)), ("max_len", max_len)):
        if cfg.get(key) != want:
            raise SystemExit(f"--extra-data {work_dir}: its data has {key}={cfg.get(key)!r}, this run {want!r}")
    paths = [D.shard_path(data_dir, k) for k in range(len(D.shard_ranges(plan, shard_tokens)))]
    missing = [p.name for p in paths if not p.is_file()]
    if D.shard_path(data_dir, len(paths)).is_file():
        raise SystemExit(f"--extra-data {work_dir}: it holds more shards than its plan makes with --shard-tokens "
                         f"{shard_tokens}: pass the --shard-tokens it was cached with")
    if missing:
        raise SystemExit(f"--extra-data {work_dir}: its target pass is incomplete ({len(missing)} of {len(paths)} "
                         f"shards missing, e.g. {missing[0]}; run train-heads --cache-only there first, with the "
                         f"same --shard-tokens)")
    return paths, {x.doc_id for x in plan}


def _target_info(model) -> dict:
    return {"hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size,
            "config": model.config.to_dict(),
            "lm_head": model.get_output_embeddings().weight.detach().float().clone(),
            "embed": model.get_input_embeddings().weight.detach().float().clone()}
