"""Self-distillation data straight from vLLM: the target's own greedy generations and hidden states.

With ``VLLM_ENTMTP_RECORD_DIR`` set, the entmtp drafter in each worker records, per request and step, the
hidden state it is handed (the target's final-norm hidden state at the last accepted position, exactly what
the heads read at inference) and the token the target chose there; when the request ends, its sequence is
written to ``<dir>/rec-<pid>-<n>.pt`` (``hidden [T, H]`` float16, ``tokens [T]`` int32: ``tokens[i]`` is the
target's token after ``hidden[i]``). Head ``k`` learns ``tokens[i + k + 1]`` from ``hidden[i]``. Run
generations with drafting off (``entmtp_num_draft_tokens = 0``) so every step yields one position.

``python -m vllm_entmtp.training.record --out DIR`` generates greedy continuations of the train-split prompts.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

RECORD_ENV = "VLLM_ENTMTP_RECORD_DIR"


class Recorder:
    """Per-request buffers of (hidden, token); flushed to ``out_dir`` in shards of whole sequences."""

    def __init__(self, out_dir: str, shard_tokens: int = 32768):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.buf: dict[str, tuple[list[torch.Tensor], list[int]]] = {}
        self.done: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done_tokens = 0
        self.shard_tokens = shard_tokens
        self.n = 0

    def add(self, req_ids: list[str], hidden: torch.Tensor, sampled: list[list[int]]) -> None:
        """One step: ``hidden [B, H]`` at each request's last accepted position and its sampled tokens."""
        h = hidden.detach().to(torch.float16).cpu()
        for i, rid in enumerate(req_ids):
            toks = sampled[i]
            if len(toks) != 1:  # prefill chunk (no token) or accepted drafts (not recorded)
                continue
            hs, ts = self.buf.setdefault(rid, ([], []))
            hs.append(h[i])
            ts.append(int(toks[0]))

    def free_missing(self, live) -> None:
        """Requests vLLM no longer holds are finished: their steps go to the next shard."""
        for rid in [r for r in self.buf if r not in live]:
            hs, ts = self.buf.pop(rid)
            if len(ts) > 8:
                self.done.append((torch.stack(hs), torch.tensor(ts, dtype=torch.int32)))
                self.done_tokens += len(ts)
        if self.done_tokens >= self.shard_tokens:
            self.flush()

    def tracked_ids(self) -> set[str]:
        return set(self.buf)

    def flush(self) -> None:
        if not self.done:
            return
        lens = torch.tensor([len(t) for _, t in self.done])
        shard = {"hidden": torch.cat([h for h, _ in self.done]), "tokens": torch.cat([t for _, t in self.done]),
                 "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])}
        path = self.out / f"rec-{os.getpid()}-{self.n:04d}.pt"
        torch.save(shard, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        self.n += 1
        self.done, self.done_tokens = [], 0


def recorder_from_env() -> Recorder | None:
    d = os.environ.get(RECORD_ENV)
    return Recorder(d) if d else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sharegpt", type=int, default=1200)
    ap.add_argument("--gsm8k", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256, help="prompts per generate() call")
    args = ap.parse_args(argv)
    os.environ[RECORD_ENV] = str(Path(args.out).resolve())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import SamplingParams

    from vllm_entmtp.datasets import load_prompts
    from vllm_entmtp.harness import make_llm
    from vllm_entmtp.models import default_heads, prepare_default_model
    from vllm_entmtp.request_options import REQUEST_DRAFT_TOKENS_KEY

    prompts = (load_prompts("sharegpt", split="train")[: args.sharegpt]
               + load_prompts("gsm8k", split="train")[: args.gsm8k])
    prompts = [p for p in prompts if len(p.messages[-1]["content"]) < 2000]
    heads = default_heads().get("medusa") or os.environ.get("VLLM_ENTMTP_RECORD_HEADS")
    llm = make_llm(str(prepare_default_model()), {"method": "entmtp", "model": str(heads)}, dtype="bfloat16",
                   max_model_len=2048, max_num_seqs=args.max_num_seqs)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                        extra_args={REQUEST_DRAFT_TOKENS_KEY: 0})
    from tqdm import tqdm

    for i in tqdm(range(0, len(prompts), args.batch), desc="record batches"):
        llm.chat([p.messages for p in prompts[i:i + args.batch]], sp, use_tqdm=False)
    llm.collective_rpc(_flush)
    return 0


def _flush(worker) -> None:
    rec = getattr(worker.model_runner.drafter, "recorder", None)
    if rec is not None:
        rec.free_missing(set())
        rec.flush()


if __name__ == "__main__":
    raise SystemExit(main())


def load_recorded(rec_dir: str | Path):
    """The recorded shards of ``rec_dir`` as training data (:class:`vllm_entmtp.training.data.CachedData`).

    ``argmax[i]`` is the recorded token after ``hidden[i]`` (the target's greedy choice), so head ``k``'s label
    ``argmax[i + k + 1]`` is the target's own continuation; every position is on the greedy path.
    """
    from vllm_entmtp.training import data as D

    paths = sorted(Path(rec_dir).glob("rec-*.pt"))
    if not paths:
        raise SystemExit(f"no recorded shards (rec-*.pt) in {rec_dir}")
    parts = [torch.load(p, weights_only=True) for p in paths]
    offsets, base, doc_ids = [torch.zeros(1, dtype=torch.long)], 0, []
    for k, p in enumerate(parts):
        offsets.append(p["offsets"][1:] + base)
        base += int(p["offsets"][-1])
        doc_ids += [f"rec/{paths[k].stem}/{j}" for j in range(len(p["offsets"]) - 1)]
    argmax = torch.cat([p["tokens"] for p in parts]).long()
    offsets = torch.cat(offsets)
    tokens = torch.roll(argmax, 1)  # input token at i = the token chosen at i - 1 (first of a sequence: unused)
    return D.CachedData(hidden=torch.cat([p["hidden"] for p in parts]), argmax=argmax, tokens=tokens,
                        assistant=torch.ones(len(argmax), dtype=torch.bool), offsets=offsets,
                        start=torch.zeros(len(offsets) - 1, dtype=torch.long), doc_ids=doc_ids,
                        sources=["self-distilled"] * len(doc_ids))
