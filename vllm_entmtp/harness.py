"""Offline generation with vLLM for tests and benchmark scripts: one engine per call, in this process.

Used by ``tests/test_lossless.py`` (through a subprocess, one engine per process) and
``benchmarks/acceptance.py``. Imports vLLM lazily; callers need an ``if __name__ == "__main__":`` guard
because vLLM's CPU engine starts its processes with ``spawn``.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SpecDecodeCounts:
    """vLLM's spec-decode counters after a run. Mean acceptance length includes the bonus token."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted draft tokens per drafting step (bonus token included; 1.0 = no gain)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def spec_decode_counts(llm) -> SpecDecodeCounts:
    """Read vLLM's spec-decode counters from ``LLM.get_metrics()``."""
    counts = SpecDecodeCounts()
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            counts.num_drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            counts.num_draft_tokens = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            counts.num_accepted_tokens = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            counts.accepted_per_position = [int(v) for v in m.values]
    return counts


def entmtp_counters(llm) -> dict:
    """entmtp's Prometheus counters (:mod:`vllm_entmtp.metrics`) as ``{"name{label}": value}`` (``name`` without
    the ``vllm:entmtp_`` prefix; ``{label}``, the tree, the stage or the source, only for labelled families)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:entmtp_"):
            label = m.labels.get("tree", m.labels.get("stage", m.labels.get("source")))
            out[m.name[len("vllm:entmtp_"):] + (f"{{{label}}}" if label is not None else "")] = int(m.value)
    return out


def tree_stats(llm) -> dict:
    """The entmtp tree-verification counters of the (first) worker, cumulative (``vllm_entmtp.stats``)."""
    from vllm_entmtp.stats import worker_stats

    return llm.collective_rpc(worker_stats)[0]


def make_llm(model: str, speculative_config: dict | None, *, dtype: str = "bfloat16", max_model_len: int = 2048,
             max_num_seqs: int = 8, seed: int = 0, gpu_memory_utilization: float = 0.3, **kwargs: Any):
    """A vLLM ``LLM`` with spec-decode stats enabled; eager (no torch.compile warm-up) unless
    ``enforce_eager=False`` is passed, as ``vllm serve`` runs by default.

    Allows pickled RPCs to the workers (``VLLM_ALLOW_INSECURE_SERIALIZATION``) so that :func:`tree_stats` can
    read the drafter's counters; this is an offline harness running only its own code.

    On CPU, ``gpu_memory_utilization`` is the share of the NUMA node's memory vLLM insists is free at start-up
    (the KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE``); 0.3 lets tests run beside other jobs.
    """
    import os

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    kwargs.setdefault("enforce_eager", True)
    return LLM(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
               speculative_config=speculative_config, disable_log_stats=False,
               gpu_memory_utilization=gpu_memory_utilization, **kwargs)


def engine_counters(llm) -> dict:
    """vLLM's scheduler counters that show the engine paths a run took: ``{"prefix_cache_hits": tokens served
    from the prefix cache, "prefix_cache_queries": tokens looked up, "num_preemptions": requests preempted}``
    (totals since the engine started)."""
    names = {"vllm:prefix_cache_hits": "prefix_cache_hits", "vllm:prefix_cache_queries": "prefix_cache_queries",
             "vllm:num_preemptions": "num_preemptions"}
    out = dict.fromkeys(names.values(), 0)
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
    return out


def _sampling_params(i: int, *, max_tokens: int, temperature: float, top_p: float, top_k: int,
                     extra_args: list[dict | None] | None, stop: list[str] | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=i,
                          stop=stop, extra_args=(extra_args[i] if extra_args else None))


def generate_with_aborts(llm, conversations: list[list[dict]], *, max_tokens: int, abort_every: int,
                         abort_after_steps: int, **sampling) -> dict:
    """All requests at once through the engine's step loop; after ``abort_after_steps`` engine steps, every
    ``abort_every``-th request (indices 0, k, 2k, ...) is aborted, as a client that goes away would be.

    Prompts are rendered with the tokenizer's chat template (not ``LLM.chat``), so compare with another run of
    this function. Returns ``generate_chat``'s keys; an aborted request has ``finish_reason`` ``"abort"`` and
    the tokens it had when it was aborted.
    """
    if abort_every < 1 or abort_after_steps < 0:
        raise ValueError("abort_every must be >= 1 and abort_after_steps >= 0")
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    ids = [f"abort-{i}" for i in range(len(conversations))]
    t0 = time.perf_counter()
    for i, conv in enumerate(conversations):
        prompt = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        engine.add_request(ids[i], prompt, _sampling_params(i, max_tokens=max_tokens, **sampling))
    outs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        steps += 1
        if steps == abort_after_steps:
            engine.abort_request([r for i, r in enumerate(ids)
                                  if i % abort_every == 0 and not (r in outs and outs[r].finished)])
    seconds = time.perf_counter() - t0
    res = [outs.get(r) for r in ids]
    return {
        "token_ids": [list(o.outputs[0].token_ids) if o else [] for o in res],
        "texts": [o.outputs[0].text if o else "" for o in res],
        "finish_reasons": [(o.outputs[0].finish_reason if o and o.finished else "abort") for o in res],
        "prompt_tokens": [len(o.prompt_token_ids or []) if o else 0 for o in res],
        "seconds": seconds,
        "spec": asdict(spec_decode_counts(llm)),
    }


def generate_chat(llm, conversations: list[list[dict]], *, max_tokens: int, concurrency: int,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                  extra_args: list[dict | None] | None = None, stop: list[str] | None = None) -> dict:
    """Greedy (by default) chat completions; request ``i`` is seeded with ``i`` when it samples.
    ``concurrency == 1`` sends one request at a time; otherwise all at once, so the engine runs up to
    ``max_num_seqs`` of them together.

    Returns ``{"token_ids": [[...]], "texts": [...], "finish_reasons": [...], "prompt_tokens": [int, ...],
    "seconds": float, "spec": SpecDecodeCounts as dict}`` (counters are totals since the engine started).
    """
    def params(i):
        return _sampling_params(i, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                extra_args=extra_args, stop=stop)

    t0 = time.perf_counter()
    if concurrency == 1:
        outs = [llm.chat([c], params(i), use_tqdm=False)[0] for i, c in enumerate(conversations)]
    else:
        outs = llm.chat(conversations, [params(i) for i in range(len(conversations))], use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in outs],
        "seconds": seconds,
        "spec": asdict(spec_decode_counts(llm)),
    }


def generate_requests(llm, conversations: list[list[dict]], requests: list[dict], *, max_tokens: int) -> dict:
    """All conversations at once, request ``i`` with its own sampling options ``requests[i]``
    (``SamplingParams`` keyword arguments; ``structured_outputs`` as a dict of ``StructuredOutputsParams``
    arguments; ``max_tokens`` defaults to ``max_tokens``, ``seed`` to ``i``).

    Returns ``{"outputs": [[{"token_ids", "text", "finish_reason", "logprobs": [the sampled token's logprob
    per token] | None, "top_logprobs": [[token ids of each position's top logprobs]] | None}, ...one per n]],
    "prompt_logprobs": [number of prompt positions with logprobs | None], "seconds", "spec"}``.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def params(i: int, opts: dict) -> SamplingParams:
        opts = {"max_tokens": max_tokens, "seed": i, **opts}
        if opts.get("logit_bias"):  # JSON keys are strings
            opts["logit_bias"] = {int(t): b for t, b in opts["logit_bias"].items()}
        if opts.get("structured_outputs") is not None:
            opts["structured_outputs"] = StructuredOutputsParams(**opts["structured_outputs"])
        return SamplingParams(**opts)

    def completion(c) -> dict:
        lp = None if c.logprobs is None else [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)]
        top = None if c.logprobs is None else [sorted(pos, key=lambda t: -pos[t].logprob) for pos in c.logprobs]
        return {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp,
                "top_logprobs": top}

    t0 = time.perf_counter()
    outs = llm.chat(conversations, [params(i, r) for i, r in enumerate(requests)], use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {
        "outputs": [[completion(c) for c in o.outputs] for o in outs],
        "prompt_logprobs": [None if o.prompt_logprobs is None else sum(x is not None for x in o.prompt_logprobs)
                            for o in outs],
        "seconds": seconds,
        "spec": asdict(spec_decode_counts(llm)),
    }


FAULTS = ("draft", "verify")


def install_faults(worker, stages: list[str] | None) -> None:
    """For ``LLM.collective_rpc`` (tests of fault containment): make the entmtp drafter of this worker fail in
    ``stages`` (of :data:`FAULTS`) for requests whose ``seed % 3`` is 1 (``"draft"``: the heads' drafting, for
    any batch holding such a request) or 2 (``"verify"``: the tree walk); None removes the faults."""
    import vllm_entmtp.step as step_mod

    drafter = worker.model_runner.drafter
    step_mod._walk = getattr(step_mod, "_walk_unfaulted", step_mod._walk)
    drafter.__dict__.pop("_draft_rows", None)
    unknown = set(stages or ()) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown fault stage(s) {sorted(unknown)}; allowed: {', '.join(FAULTS)}")

    def seed(req_id: str) -> int:
        return drafter._sampling_params(req_id).seed or 0

    if "draft" in (stages or ()):
        orig_rows = type(drafter)._draft_rows.__get__(drafter)

        def _draft_rows(req_ids, *args):
            if any(seed(r) % 3 == 1 for r in req_ids):
                raise RuntimeError("injected drafting fault")
            return orig_rows(req_ids, *args)

        drafter._draft_rows = _draft_rows
    if "verify" in (stages or ()):
        step_mod._walk_unfaulted = orig_walk = step_mod._walk

        def _walk(tr, rows, sp, generator):
            if (sp.seed or 0) % 3 == 2:
                raise RuntimeError("injected tree-walk fault")
            return orig_walk(tr, rows, sp, generator)

        step_mod._walk = _walk


def count_draft_token_calls(llm) -> dict | None:
    """Where the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): count its calls to the
    workers for draft tokens (``model_executor.take_draft_token_ids``, vLLM's ``post_step``), which entmtp's draft
    tokens riding on the step's output make unneeded (:mod:`vllm_entmtp.patches.engine_core`). Returns the counter
    (``{"calls": n}``, updated as the engine steps), or None where the engine core runs in another process."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None:
        return None
    counter, executor = {"calls": 0}, core.model_executor
    take = executor.take_draft_token_ids

    def counted(*args, **kwargs):
        counter["calls"] += 1
        return take(*args, **kwargs)

    executor.take_draft_token_ids = counted
    return counter


def run_job(job: dict, *, verbose: bool = False) -> dict:
    """Run :func:`main` on ``job`` in a fresh Python process (one engine; vLLM's CPU engine spawns its own
    processes, and one engine per process keeps runs independent) and return its output.

    Raises:
        RuntimeError: the engine process failed (the message ends with its stderr).
    """
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        p = subprocess.run([sys.executable, "-m", "vllm_entmtp.harness", str(job_file), str(out_file)],
                           stdout=None if verbose else subprocess.DEVNULL,
                           stderr=None if verbose else subprocess.PIPE, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"engine run failed:\n{(p.stderr or '')[-4000:]}")
        return json.loads(out_file.read_text())


def dump(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_entmtp.harness JOB.json OUT.json``: run one engine over the phases of a job.

    JOB: ``{"model": dir, "speculative_config": {...} | null, "dtype": "float32", "max_model_len": 1024,
    "max_num_seqs": 8, "engine_args": {more LLM(...) arguments} | null,
    "conversations": [[{"role":..., "content":...}], ...], "max_tokens": 64,
    "phases": [{"name": "bs1", "concurrency": 1, "extra_args": [...] | null, "stop": [...] | null,
    "temperature": 0.0, "top_p": 1.0, "top_k": 0, "prompts": [indices into conversations] | null,
    "abort_every": k | null, "abort_after_steps": n, "requests": [per-request SamplingParams dicts] | null,
    "faults": [stages] | null, "reset_prefix_cache": bool}, ...]}`` (a phase with ``abort_every`` runs
    :func:`generate_with_aborts`, its ``concurrency`` ignored; one with ``requests`` runs :func:`generate_requests`;
    ``faults`` are installed in the workers for that phase only, :func:`install_faults`; ``reset_prefix_cache``
    empties the engine's prefix cache before the phase, so that it computes prompts an earlier phase sent).
    OUT: ``{phase name: generate_chat(...) result + "tree_stats", "entmtp_metrics", "engine" (engine_counters,
    cumulative), "draft_token_calls" (:func:`count_draft_token_calls`, cumulative; None with the engine core in
    another process)}``; spec counters are per phase (differences).
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    job_path, out_path = args
    with open(job_path) as f:
        job = json.load(f)
    llm = make_llm(job["model"], job.get("speculative_config"), dtype=job.get("dtype", "float32"),
                   max_model_len=job.get("max_model_len", 1024), max_num_seqs=job.get("max_num_seqs", 8),
                   **(job.get("engine_args") or {}))
    results, before = {}, SpecDecodeCounts()
    draft_calls = count_draft_token_calls(llm)
    for phase in job["phases"]:
        convs = job["conversations"]
        if phase.get("prompts") is not None:  # a subset of the conversations, by index
            convs = [convs[i] for i in phase["prompts"]]
        sampling = {"temperature": phase.get("temperature", 0.0), "top_p": phase.get("top_p", 1.0),
                    "top_k": phase.get("top_k", 0), "extra_args": phase.get("extra_args"), "stop": phase.get("stop")}
        if phase.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise RuntimeError(f"phase {phase['name']}: the engine kept its prefix cache (blocks still held)")
        if phase.get("faults"):
            llm.collective_rpc(install_faults, args=(phase["faults"],))
        if phase.get("requests") is not None:
            r = generate_requests(llm, convs, phase["requests"], max_tokens=job["max_tokens"])
        elif phase.get("abort_every"):
            r = generate_with_aborts(llm, convs, max_tokens=job["max_tokens"], abort_every=phase["abort_every"],
                                     abort_after_steps=phase.get("abort_after_steps", 2), **sampling)
        else:
            r = generate_chat(llm, convs, max_tokens=job["max_tokens"], concurrency=phase["concurrency"],
                              **sampling)
        if phase.get("faults"):
            llm.collective_rpc(install_faults, args=(None,))
        total = SpecDecodeCounts(**r["spec"])
        r["spec"] = asdict(SpecDecodeCounts(
            num_drafts=total.num_drafts - before.num_drafts,
            num_draft_tokens=total.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=total.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_position=[a - b for a, b in zip(
                total.accepted_per_position,
                before.accepted_per_position or [0] * len(total.accepted_per_position))]))
        before = total
        r["tree_stats"] = tree_stats(llm)
        r["entmtp_metrics"] = entmtp_counters(llm)
        r["engine"] = engine_counters(llm)
        r["draft_token_calls"] = None if draft_calls is None else draft_calls["calls"]  # cumulative
        results[phase["name"]] = r
    dump(results, out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
