"""One speculative step of the worker, as the plugin sees it: what each request drafted, which rows of the batch
are tree rows, what verification accepted, and the signals the scheduler reads next (no vLLM import at module
level; the runner patch and the attention override call in).

A step, in order (``vllm_entmtp.patches.runner`` calls each from the vLLM runner method named):

1. ``_prepare_inputs``: :func:`begin_step` drops the state of requests vLLM let go, matches each request's
   scheduled draft tokens with the :class:`Draft` it proposed last step, sets its tree rows' positions to
   root + depth and fills :data:`STEP` (:class:`SpecStep`).
2. the forward: the attention override (``patches/tree_attention.py``) reads ``STEP.rows`` in every layer.
3. ``_sample``: after vLLM's sampler, :func:`verify` walks each tree (greedy) or rejection-samples it, moves the
   accepted path's K/V to consecutive slots, and records the step's signals.
4. ``propose_draft_token_ids``: :meth:`~vllm_entmtp.drafter.EntMTPProposer.draft_step` drafts the next step from
   each request's last accepted row (:attr:`SpecStep.last_rows`).

Faults in the plugin's own per-request work are contained (:func:`fault`, :data:`FAULT_STAGES`): a request whose
drafting fails drafts nothing this step; one whose tree bookkeeping, tree walk or KV compaction fails keeps the
first token vLLM sampled for it (drawn from its root row, so exactly plain decoding's); a failure elsewhere in the
drafting step leaves the batch without draft tokens for the step. Each is logged once per stage and counted in
``vllm:entmtp_fallbacks_total{stage}``; the engine and the other requests go on.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_entmtp.trees import Tree
from vllm_entmtp.verify import SAMPLING_EPS

logger = logging.getLogger("vllm.entmtp")

#: Where the plugin's per-step work can fail without taking the engine down (``vllm:entmtp_fallbacks_total``).
FAULT_STAGES = ("propose", "draft", "bookkeeping", "verify", "kv_compaction", "signals", "metrics")


def is_greedy(sp) -> bool:
    return sp is None or sp.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class Draft:
    """One request's draft for one step, decided once when it is drafted and read by the verification and the
    metrics: the tree its tokens fill (the scheduler's choice cut to the request's budget, the chain stop and
    the tokens drafted) and the tokens, node ``j``'s at index ``j - 1``.

    ``tree_id`` is the chosen tree's id, with ``@n`` when fewer than its nodes were drafted (``chainN`` for a
    chain of the heads). ``greedy``: the request samples greedily.
    """

    tree_id: str
    tree: Tree
    tokens: list[int]
    greedy: bool

    @classmethod
    def make(cls, tree_id: str, tree: Tree, tokens: list[int], greedy: bool) -> Draft | None:
        """The draft of ``tokens`` (a prefix of ``tree``'s nodes) for the tree chosen as ``tree_id``; None for
        no tokens."""
        if not tokens:
            return None
        d = cls(tree_id, tree, list(tokens), greedy)
        return d.cut(len(tokens)) if len(tokens) < tree.num_nodes else d

    def cut(self, n: int) -> Draft:
        """The first ``n`` nodes (vLLM scheduled fewer tokens, or the chain stopped): ``id@n``."""
        if n >= self.tree.num_nodes:
            return self
        return Draft(f"{self.tree_id.split('@')[0]}@{n}", self.tree.prefix(n), self.tokens[:n], self.greedy)

    @property
    def verified_here(self) -> bool:
        """Trees, and chains of sampling requests, are verified by this project; greedy chains by vLLM."""
        return not self.tree.is_chain or not self.greedy


@dataclass
class TreeRows:
    """One request's rows in this step's flattened batch: the root (last accepted token) and its tree nodes.

    ``q0`` is the root's row among the step's query tokens; rows ``q0 .. q0 + num_nodes`` belong to it.
    ``parents[j-1]`` is the parent row (0 = root) of node row ``j``; ``mask`` is the ancestor-or-self mask
    ``[num_nodes+1, num_nodes+1]`` (bool); ``fix_rows`` are the rows whose causal attention differs from the
    tree's (the others already attend exactly to their ancestors, e.g. a leading chain).
    """

    batch_index: int
    q0: int
    draft_tokens: list[int]
    parents: list[int]
    mask: torch.Tensor
    fix_rows: list[int]
    tree_id: str = ""
    ranks: list[int] = field(default_factory=list)  # top-k rank of each node (for statistics)

    @classmethod
    def of(cls, b: int, q0: int, draft: Draft) -> TreeRows:
        t = draft.tree
        return cls(b, q0, draft.tokens, t.parents, t._mask, t.fix_rows, tree_id=draft.tree_id, ranks=t.ranks)

    @property
    def num_rows(self) -> int:
        return len(self.draft_tokens) + 1


@dataclass
class SpecStep:
    """The worker's per-step state, reset by :func:`begin_step` every step (one object per worker process,
    :data:`STEP`, because the attention override has no handle on the runner)."""

    rows: dict[int, TreeRows] = field(default_factory=dict)  # batch index -> rows verified as a tree here
    # some request's rows need the tree-attention fix (a branching tree); chains, sampled ones included, do not
    fixes: bool = False
    # layer name -> (layer, impl, kv_cache, key [n, Hkv, D], value [n, Hkv, D], slots [n]) of rows row_lo..row_hi
    kv: dict[str, tuple] = field(default_factory=dict)
    row_lo: int = 0
    row_hi: int = 0
    # batch index -> (seq_len, tree_rows_plan(...)): block ids, rows, mask, the same in every layer of the step
    plans: dict[int, tuple] = field(default_factory=dict)
    # batch indices whose bookkeeping failed: vLLM verifies their draft tokens as a chain, they keep one token
    fallback: set[int] = field(default_factory=set)
    # batch indices of the requests vLLM scheduled draft tokens for (the verification kernel takes their rows)
    verifying: set[int] = field(default_factory=set)
    # id of an attention metadata object (one per KV cache group and step, shared by its layers) -> (the object,
    # held so that its id is not reused, and the step's verify_attention.Split or None)
    splits: dict[int, tuple] = field(default_factory=dict)
    # per request, the first row of its block in the sampled rows (root, then draft tokens), from vLLM's
    # SpecDecodeMetadata once per step (set_offsets)
    offsets: np.ndarray | None = None
    last_rows: dict[int, int] = field(default_factory=dict)  # tree requests: row of the last accepted node
    paths: dict[int, list[int]] = field(default_factory=dict)  # tree requests: accepted nodes (1-based)
    # (entropy per request or None, accepted draft tokens per request) of this step, for the tracker
    signals: tuple = (None, None)
    # a decode step (no prompt tokens): its rows, and when its row-bound part (forward, logits, sampling,
    # verification) started, for the measured step costs (0: not a decode step)
    decode_rows: int = 0
    rows_clock: float = 0.0
    decode_batch: int = 0  # the decode step's requests (fewer than its rows where it verifies draft tokens)

    def reset(self, rows: dict[int, TreeRows], fallback: set[int] | None = None,
              verifying: set[int] | None = None) -> None:
        self.rows = rows
        self.verifying = verifying or set()
        self.fixes = any(r.fix_rows for r in rows.values())
        self.fallback = fallback or set()
        self.kv = {}
        self.plans = {}
        self.splits = {}
        self.offsets = None
        self.last_rows = {}
        self.paths = {}
        self.signals = (None, None)
        self.decode_rows = 0
        self.decode_batch = 0
        if rows:
            self.row_lo = min(r.q0 for r in rows.values())
            self.row_hi = max(r.q0 + r.num_rows for r in rows.values())
        else:
            self.row_lo = self.row_hi = 0

    def set_offsets(self, num_draft_tokens: list[int] | None, num_reqs: int) -> np.ndarray:
        """Each request's first sampled row: ``num_draft_tokens`` from vLLM's ``SpecDecodeMetadata`` (None: one
        row per request)."""
        if num_draft_tokens is None:
            self.offsets = np.arange(num_reqs + 1)
        else:
            self.offsets = np.concatenate([[0], np.cumsum(np.asarray(num_draft_tokens, dtype=np.int64) + 1)])
        return self.offsets


STEP = SpecStep()


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


# -- 1. after vLLM built the step's inputs -------------------------------------------------------------------


def begin_step(runner, scheduler_output) -> None:
    """After ``_prepare_inputs``: drop the state of requests vLLM let go; tree rows get positions root + depth;
    fill :data:`STEP` for the attention override and the verification."""
    drafter = runner.drafter
    drafter.free_missing(runner.requests)
    rows: dict[int, TreeRows] = {}
    fallback: set[int] = set()
    if drafter.pending:
        qsl = runner.query_start_loc.np
        sched_spec = scheduler_output.scheduled_spec_decode_tokens
        for b, req_id in enumerate(runner.input_batch.req_ids):
            draft = drafter.pending.get(req_id)
            sched = sched_spec.get(req_id) if draft is not None else None
            if not sched:
                continue
            try:
                tr = _tree_rows(runner, b, draft, sched, int(qsl[b]), drafter.tree_attention)
            except Exception as e:  # noqa: BLE001 - vLLM verifies its tokens as a chain; keep the first only
                fault(drafter, "bookkeeping", [req_id], e)
                fallback.add(b)
                continue
            if tr is not None:
                rows[b] = tr
    sched_spec = scheduler_output.scheduled_spec_decode_tokens
    verifying = {b for b, req_id in enumerate(runner.input_batch.req_ids) if sched_spec.get(req_id)} \
        if sched_spec else set()
    STEP.reset(rows, fallback, verifying)
    if drafter.step_costs is not None:
        total = scheduler_output.total_num_scheduled_tokens
        drafts = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
        if total == len(scheduler_output.num_scheduled_tokens) + drafts:
            STEP.decode_rows, STEP.rows_clock = total, time.perf_counter()
            STEP.decode_batch = len(scheduler_output.num_scheduled_tokens)


def _tree_rows(runner, b: int, draft: Draft, sched, q0: int, tree_attention: bool) -> TreeRows | None:
    """Request ``b``'s tree rows this step, its tree rows' positions set to root + depth; None when vLLM
    verifies its draft tokens itself (a greedy chain, or tokens that are not the proposed draft's).
    ``tree_attention``: whether branching trees can be verified here (the drafter's start-up check); where not,
    a branching tree raises before anything is changed (the drafter drafts chains only there, so this is a
    guard: the caller contains it to the request)."""
    n = len(sched)
    if list(sched) != draft.tokens[:n]:  # not the tokens we proposed: vLLM verifies a chain
        return None
    draft = draft.cut(n)
    if not draft.verified_here:
        return None
    tr = TreeRows.of(b, q0, draft)
    if tr.fix_rows and not tree_attention:
        raise RuntimeError(f"a branching tree ({draft.tree_id}) where tree attention is not available")
    root_pos = int(runner.positions[q0])  # last: nothing below can fail
    runner.positions[q0 + 1:q0 + 1 + n] = root_pos + torch.tensor(draft.tree.depths, dtype=runner.positions.dtype)
    return tr


# -- 3. after vLLM's sampler ------------------------------------------------------------------------------------


def verify(runner, logits: torch.Tensor, spec_decode_metadata, sampler_output, entropy: bool | None) -> None:
    """After vLLM's sampler: per-request offsets, the tree walks (:func:`_verify_trees`) and, when ``entropy``
    is not None (the drafter tracks signals), the step's signals (the entropy only when ``entropy``)."""
    n = sampler_output.sampled_token_ids.shape[0]
    STEP.set_offsets(spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None else None, n)
    if spec_decode_metadata is not None and (STEP.rows or STEP.fallback):
        _verify_trees(runner, logits, sampler_output)
    if entropy is not None:
        try:
            STEP.signals = _step_signals(logits, sampler_output, entropy)
        except Exception as e:  # noqa: BLE001 - the scheduler sees no new signals this step
            fault(runner.drafter, "signals", list(runner.input_batch.req_ids), e)
            STEP.signals = (None, None)
    if STEP.decode_rows and runner.drafter.step_costs is not None:
        runner.drafter.step_costs.record_rows(STEP.decode_rows, time.perf_counter() - STEP.rows_clock,
                                              STEP.decode_batch)


def _walk(tr: TreeRows, rows: torch.Tensor, sp, generator) -> tuple[list[int], int]:
    """One request's tree verification: the accepted nodes (1-based) and the token after them."""
    from vllm_entmtp.verify import apply_sampling_params, greedy_accept, tree_rejection_sample

    if is_greedy(sp):
        am = rows.argmax(dim=-1).tolist()
        path = greedy_accept(tr.draft_tokens, tr.parents, am)
        return path, am[path[-1] if path else 0]
    probs = apply_sampling_params(rows.float(), sp.temperature, sp.top_k, sp.top_p)
    return tree_rejection_sample(tr.draft_tokens, tr.parents, probs, generator)


def _first_token_only(sampled: torch.Tensor, b: int) -> None:
    """Request ``b`` keeps only the first token vLLM sampled for it this step: whatever vLLM made of its draft
    tokens (verified as a chain), that token is drawn from the root row's distribution (greedy: its argmax), and
    the root's row attends to the context alone, so it is what plain decoding gives."""
    sampled[b, 1:].fill_(-1)
    STEP.last_rows[b] = int(STEP.offsets[b])
    STEP.paths[b] = []


def _verify_trees(runner, logits: torch.Tensor, sampler_output) -> None:
    """Overwrite the tree requests' sampled tokens with the tree walk's, then compact their K/V. A request whose
    walk or compaction fails (and one whose bookkeeping failed, ``STEP.fallback``) keeps vLLM's first token only
    (:func:`_first_token_only`); the others are untouched."""
    offsets = STEP.offsets
    sampled = sampler_output.sampled_token_ids
    for b in STEP.fallback:
        _first_token_only(sampled, b)
    moves: list[tuple[TreeRows, list[int]]] = []
    for b, tr in STEP.rows.items():
        off, t = int(offsets[b]), int(offsets[b + 1] - offsets[b])
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
            _first_token_only(sampled, b)
            continue
        sampled[b] = row
        STEP.last_rows[b] = off + (path[-1] if path else 0)
        STEP.paths[b] = path
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
                _first_token_only(sampled, tr.batch_index)


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


def last_accepted_rows(num_tokens: list[int]) -> list[int]:
    """Per request, the sampled row of its last accepted token: a tree's last accepted node, else the last row
    of the ``num_tokens[b]`` it emitted (a request with none, a prefill chunk: its first row)."""
    offsets = STEP.offsets
    return [STEP.last_rows.get(b, int(offsets[b]) + max(k, 1) - 1) for b, k in enumerate(num_tokens)]


def _step_signals(logits: torch.Tensor, sampler_output, entropy: bool) -> tuple[list | None, list]:
    """Per request of the step: the entropy (nats) of the target's distribution at its last accepted position
    (the row its next token was drawn from; raw logits, before temperature), or None when ``entropy`` is False
    (the policy does not read it: a softmax over the vocabulary per request saved), and the accepted draft
    tokens."""
    from vllm_entmtp.entropy import entropy_nats

    if not STEP.rows and not STEP.fallback and STEP.offsets is not None and len(STEP.offsets) == len(logits) + 1:
        # no draft tokens this step (patches/runner.py: prepare_without_drafts): one row and one emitted token
        # per request, none accepted
        return (entropy_nats(logits).tolist() if entropy else None), [0] * len(logits)
    emitted = (sampler_output.sampled_token_ids >= 0).sum(dim=1)  # [B]
    accepted = (emitted - 1).clamp(min=0).tolist()
    if not entropy:
        return None, accepted
    rows = torch.tensor(last_accepted_rows(emitted.tolist()))
    return entropy_nats(logits[rows]).tolist(), accepted


# -- 4. before drafting -----------------------------------------------------------------------------------------


def prefix_layer_hidden(runner, hidden_states: torch.Tensor, sampled_token_ids, spec_decode_metadata
                        ) -> torch.Tensor:
    """Hydra++ heads: feed each request's prefix-layer cache the hidden states of the tokens this step committed
    (a prompt chunk; or the root and the accepted draft tokens, in path order) and return the layer's output at
    the last of them, ``[B, hidden]``, for the heads."""
    n = len(sampled_token_ids)
    qsl = runner.query_start_loc.np
    nd = spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None else [0] * n
    blocks, positions = [], []
    for b in range(n):
        q0, q1 = int(qsl[b]), int(qsl[b + 1])
        base = (q1 - q0) - int(nd[b])  # rows before the draft tokens: the prompt chunk, or the root
        toks = sampled_token_ids[b]
        if len(toks) == 0:  # a prompt chunk that does not finish the prompt
            rows = list(range(q0, q1))
        elif b in STEP.paths:  # a tree: the accepted nodes, by their row
            rows = list(range(q0, q0 + base)) + [q0 + base - 1 + node for node in STEP.paths[b]]
        else:  # a chain (or no drafts): the accepted ones are the first rows
            rows = list(range(q0, q0 + base + len(toks) - 1))
        idx = torch.tensor(rows, dtype=torch.long)
        blocks.append(hidden_states[idx.to(hidden_states.device)])
        positions.append(runner.positions[idx.to(runner.positions.device)].to(torch.long).cpu())
    return runner.drafter.prefix_cache.advance(list(runner.input_batch.req_ids[:n]), blocks, positions)

