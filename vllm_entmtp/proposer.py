"""Draft-token proposal from MTP heads (engine-independent: torch only).

Two drafters with one interface (``confidence`` then ``propose``):

* :class:`MTPDrafter` (Medusa heads): the target model's hidden state at each request's last accepted position
  goes through the heads (one matmul with the shared lm_head for all heads at once); each request gets the tree
  chosen for it, its nodes' tokens taken from the heads' top-k (Medusa, Cai et al. 2024, section 2.1.2: the
  node with path ``(r_0, ..., r_d)`` carries head ``d``'s rank-``r_d`` token).
* :class:`HydraDrafter` (Hydra heads): a node's children come from head ``d`` applied to the hidden state and
  the embeddings of the bonus token and the node's path, so the tree is built depth by depth, one batched head
  evaluation per depth for all expanding nodes of all requests (Ankner et al. 2024, section 3).

A chain of ``n`` draft tokens is the tree ``[[0], [0, 0], ...]``; chains may be cut where their confidence
(the product of the heads' top-1 probabilities along the chain) falls below a threshold.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_entmtp import hydra_kernel
from vllm_entmtp.fast_linear import FastLinear, time_kernel
from vllm_entmtp.heads.hydra import HydraHeads
from vllm_entmtp.heads.medusa import MedusaHeads
from vllm_entmtp.lifetimes import drop_missing
from vllm_entmtp.tree_proposal import build_tree_drafts, needed_heads, needed_topk
from vllm_entmtp.trees import Tree


def chain_stops(b: int, chain_stop: Sequence[float | None] | None, default: float) -> list[tuple[float, int]]:
    """Per request ``(threshold, min_nodes)`` of the chain cut: ``chain_stop[i]`` (a tree set schedule's
    ``chain_stop``, keeping at least the first node), else the drafter's ``confidence_threshold`` (which may cut
    a chain to nothing). ``threshold`` 0: no cut.

    Raises:
        ValueError: ``chain_stop`` does not have ``b`` entries, or an entry is outside [0, 1).
    """
    if chain_stop is None:
        return [(default, 0)] * b
    if len(chain_stop) != b:
        raise ValueError(f"chain_stop has {len(chain_stop)} entries for {b} requests")
    out = []
    for x in chain_stop:
        if x is not None and not 0.0 <= x < 1.0:
            raise ValueError(f"chain_stop entries must be in [0, 1), got {x!r}")
        out.append((default, 0) if x is None else (float(x), 1))
    return out


class MTPDrafter:
    """Proposes per-request draft trees (chains included) from Medusa heads.

    Args:
        heads: the MTP heads, in the target's dtype.
        compute_logits: the target's lm_head: ``[N, hidden] -> [N, vocab]`` (float, any dtype). Used when the
            heads share it (``original_lm_head``); per-head lm_heads in the checkpoint are used otherwise.
        confidence_threshold: a *chain* stops before the first head whose path confidence (product of the
            heads' top-1 probabilities so far) is below it; 0 keeps every head. Trees are not cut.
    """

    #: :meth:`confidence` evaluates what :meth:`propose` needs anyway (one pass of all heads).
    confidence_is_free = True

    def __init__(self, heads: MedusaHeads, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 confidence_threshold: float = 0.0):
        self.heads = heads
        self.compute_logits = compute_logits
        self.confidence_threshold = float(confidence_threshold)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads: ``hidden [B, H] -> [num_heads, B, vocab]``."""
        x = self.heads(hidden)[:num_heads]  # [k, B, H]
        k, b, h = x.shape
        if self.heads.lm_heads is not None:
            return torch.stack([self.heads.lm_heads[i](x[i]) for i in range(k)])
        return self.compute_logits(x.reshape(k * b, h)).view(k, b, -1)

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    @torch.inference_mode()
    def confidence(self, hidden: torch.Tensor, bonus: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, num_heads] float32 top-1 probability of every head, state)``; pass ``state`` to
        :meth:`propose` to draft from the same head evaluation. ``bonus`` is unused (Medusa heads read h_t only).
        """
        logits = self.head_logits(hidden, self.heads.num_heads)
        return self.head_top1_probs(logits), logits

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, trees: Sequence[Tree | None], bonus: torch.Tensor | None = None,
                state: torch.Tensor | None = None, chain_stop: Sequence[float | None] | None = None
                ) -> list[list[int]]:
        """Draft tokens per request, one per node of its tree.

        Args:
            hidden: ``[B, hidden_size]``, the target's final-norm hidden state at each request's last accepted
                position, in the target's dtype.
            trees: ``B`` entries: the request's tree (node order = canonical breadth-first order), or None for
                no draft tokens. Depth must not exceed the number of heads.

            bonus: unused (Medusa heads do not read the bonus token); ``state``: from :meth:`confidence`.
            chain_stop: None, or ``B`` entries in [0, 1) or None: request ``i``'s chain keeps its first node and
                then stops before the first node whose path confidence (product of the heads' top-1
                probabilities up to and including its head) is below ``chain_stop[i]`` (a tree set schedule's
                ``chain_stop``); a None entry, or no list, applies ``confidence_threshold`` instead.

        Returns:
            ``B`` token-id lists (``[]`` for None; a chain may come back shorter, see ``confidence_threshold``
            and ``chain_stop``).

        Raises:
            ValueError: ``len(trees) != B``, a tree deeper than the heads, or a bad ``chain_stop``.
        """
        if state is not None:
            return self.draft(state, trees, chain_stop)
        b = hidden.shape[0]
        if b != len(trees):
            raise ValueError(f"hidden has {b} rows but {len(trees)} trees were given")
        k_heads = needed_heads(trees)
        if k_heads == 0:
            return [[] for _ in range(b)]
        if k_heads > self.heads.num_heads:
            raise ValueError(f"a tree of depth {k_heads} needs {k_heads} heads; there are {self.heads.num_heads}")
        return self.draft(self.head_logits(hidden, k_heads), trees, chain_stop)

    @torch.inference_mode()
    def draft(self, logits: torch.Tensor, trees: Sequence[Tree | None],
              chain_stop: Sequence[float | None] | None = None) -> list[list[int]]:
        """Draft tokens from precomputed head logits ``[k, B, vocab]`` (``k`` >= the trees' depth);
        ``chain_stop`` as in :meth:`propose`."""
        trees = list(trees)
        if needed_heads(trees) == 0:
            return [[] for _ in trees]
        stops = chain_stops(len(trees), chain_stop, self.confidence_threshold)
        if any(th > 0.0 for th, _ in stops):
            top_p = torch.softmax(logits.float(), dim=-1).amax(dim=-1)  # [k, B]
            path_conf = torch.cumprod(top_p, dim=0).t().tolist()  # [B][k]
            for i, t in enumerate(trees):
                th, min_nodes = stops[i]
                if t is not None and th > 0.0 and t.is_chain:
                    confident = 0  # leading heads at or above the threshold
                    while confident < len(path_conf[i]) and path_conf[i][confident] >= th:
                        confident += 1
                    n = min(t.num_nodes, max(confident, min_nodes))
                    trees[i] = t.prefix(n) if n > 0 else None
        k_top = needed_topk(trees)
        if k_top == 0:
            return [[] for _ in trees]
        topk_ids = logits.topk(k_top, dim=-1).indices if k_top > 1 else logits.argmax(-1, keepdim=True)
        return build_tree_drafts(topk_ids, trees)

    @staticmethod
    def head_top1_probs(logits: torch.Tensor) -> torch.Tensor:
        """``[k, B, vocab]`` head logits -> ``[B, k]`` float32: each head's top-1 probability."""
        return torch.softmax(logits.float(), dim=-1).amax(dim=-1).t()

    def propose_chains(self, hidden: torch.Tensor, budgets: Sequence[int]) -> list[list[int]]:
        """Chains of the heads' top-1 tokens, at most ``budgets[i]`` (capped at the number of heads) each."""
        n = self.heads.num_heads
        return self.propose(hidden, [Tree.chain(min(x, n)) if x > 0 else None for x in budgets])


class HydraDrafter:
    """Proposes per-request draft trees (chains included) from Hydra heads, depth by depth.

    Args:
        heads: the Hydra heads, in the target's dtype.
        embed: the target's input embedding: ``[N] int64 token ids -> [N, hidden]``.
        lm_head_weight: the target's lm_head weight ``[vocab, hidden]`` (used when the heads share it; its
            draft-vocabulary rows are copied once here).
        confidence_threshold: as for :class:`MTPDrafter` (chains only).
        measure_kernels: run each head's block (its two linear maps fused into one) and the draft lm_head by
            the kernel measured fastest on this machine (:class:`~vllm_entmtp.fast_linear.FastLinear`; the
            server's and ``build-trees``' drafter), and levels of at most
            :data:`~vllm_entmtp.hydra_kernel.MAX_ROWS` paths by the plugin's one-call kernel
            (:mod:`~vllm_entmtp.hydra_kernel`) where it builds and times faster than that (and ``level_kernel``);
            False (default): the heads' own modules, as trained.
        level_kernel: with ``measure_kernels``, whether levels may take the one-call kernel.
    """

    #: :meth:`confidence` runs heads along the greedy chain (as many as asked), which a tree may not need: callers
    #: that do not use the confidence signal skip it.
    confidence_is_free = False
    #: Head levels the last :meth:`propose` ran (those whose paths the confidence pass had not evaluated).
    levels_run = 0

    def __init__(self, heads: HydraHeads, embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head_weight: torch.Tensor | None, confidence_threshold: float = 0.0,
                 measure_kernels: bool = False, level_kernel: bool = True):
        self.heads = heads
        self.embed = embed
        w = heads.draft_lm_weight(lm_head_weight)
        self.w_draft = w.detach().contiguous() if w is not None else None
        self.confidence_threshold = float(confidence_threshold)
        self.blocks: list[tuple[FastLinear, int]] | None = None
        self.lm: list[FastLinear] | None = None
        #: per head its fused block ``(weight [2H, in], bias [2H])`` where levels of few paths take the one-call
        #: kernel (:mod:`~vllm_entmtp.hydra_kernel`), else None
        self.level_weights: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.level_timings: dict[str, float] = {}
        self.level_kernel_off = ""  # why levels do not take the kernel, where these heads rule it out
        if measure_kernels:
            fused = _fused_blocks(heads)
            self.blocks, self.lm = _fast_hydra_layers(fused, heads, self.w_draft)
            if level_kernel:
                self.level_weights = self._measure_level_kernel(fused)
            else:
                self.level_kernel_off = "option heads_kernel 'torch'"

    def describe_kernels(self) -> str:
        """Which kernel each of the heads' linear layers runs (for the start-up log)."""
        if self.blocks is None:
            return "the heads' own modules"
        out = f"head blocks {self.blocks[0][0].describe()}; draft lm_head {self.lm[0].describe()}"
        t = {k: f"{v * 1e3:.3f} ms" for k, v in self.level_timings.items()}
        if self.level_weights is not None:
            return (f"{out}; levels of 1-{hydra_kernel.MAX_ROWS} paths: the plugin's kernel (one path: {t['kernel']}, "
                    f"torch's operators {t['torch']})")
        if t:
            return f"{out}; levels by torch's operators (one path: {t['torch']}, the plugin's kernel {t['kernel']})"
        return f"{out}; levels by torch's operators ({self.level_kernel_off or hydra_kernel.why_not()})"

    def _measure_level_kernel(self, fused) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The fused blocks' weights when the one-call kernel builds here, serves these heads (the target's lm_head
        shared, a hidden size that is a multiple of 16, on the CPU) and takes a level of one path in less time than
        torch's path, else None. Timed once, on the heads' own weights, warm (the weights in the caches); with them
        cold, as after the target's forward, the kernel's lead was larger (``benchmarks/hydra_level.py``)."""
        if self.heads.hydra_lm_head is not None or self.w_draft is None:
            self.level_kernel_off = "the heads have their own lm_heads"
        elif self.heads.config.hidden_size % 16:
            self.level_kernel_off = f"hidden size {self.heads.config.hidden_size} (a multiple of 16 only)"
        elif self.w_draft.device.type != "cpu" or any(w.dtype != self.w_draft.dtype or w.device != self.w_draft.device
                                                       for w, _, _ in fused):
            self.level_kernel_off = "the heads' weights are not all on the CPU in one dtype"
        if self.level_kernel_off or not hydra_kernel.load(self.w_draft.dtype):
            return None
        dtype = self.w_draft.dtype
        weights = [(w.contiguous(), b.contiguous()) for w, b, _ in fused]
        hidden = torch.randn(1, self.heads.config.hidden_size, dtype=dtype)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.w_draft.device)
        with torch.inference_mode():
            for name, lw in (("kernel", weights), ("torch", None)):
                self.level_weights = lw
                self.level_timings[name] = time_kernel(lambda _: self._level(0, hidden, ids, 1), None)
            self.level_weights = None
        return weights if self.level_timings["kernel"] < self.level_timings["torch"] else None

    def _hidden_states(self, k: int, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return self.heads.hidden_states(k, hidden, emb)
        fused, h = self.blocks[k]
        y = fused(torch.cat([hidden, emb[:, :k + 1].flatten(1)], dim=-1))  # [N, 2H]: R x + b_R | W x + b_W
        return y[:, :h] + torch.nn.functional.silu(y[:, h:])

    def _logits(self, k: int, x: torch.Tensor) -> torch.Tensor:
        if self.lm is None:
            return self.heads.logits(k, x, self.w_draft)
        return self.lm[k if len(self.lm) > 1 else 0](x)

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def _level(self, k: int, hidden: torch.Tensor, path_ids: torch.Tensor, topk: int, probs: bool = True
               ) -> tuple[list[list[int]], list[float] | None]:
        """Head ``k`` on ``N`` paths: ``hidden [N, H]``, ``path_ids [N, k + 1]`` (bonus token first) ->
        (``N`` lists of the top-``topk`` token ids, ``N`` top-1 probabilities, or None when not ``probs``: the
        softmax over the draft vocabulary is skipped where nothing reads it)."""
        n = path_ids.shape[0]
        emb = self.embed(path_ids.reshape(-1)).view(n, path_ids.shape[1], -1).to(hidden.dtype)
        if self.level_weights is not None and n <= hydra_kernel.MAX_ROWS and hidden.dtype == self.w_draft.dtype:
            return hydra_kernel.level(hidden.contiguous(), emb[:, :k + 1].contiguous(), *self.level_weights[k],
                                      self.w_draft, self.heads.token_map, topk, probs)
        logits = self._logits(k, self._hidden_states(k, hidden, emb))
        if not probs:
            return self.heads.to_token_ids(logits.topk(topk, dim=-1).indices).tolist(), None
        logits = logits.float()
        vals, cols = logits.topk(topk, dim=-1)
        top1_p = torch.exp(vals[:, 0] - torch.logsumexp(logits, dim=-1))
        return self.heads.to_token_ids(cols).tolist(), top1_p.tolist()

    @torch.inference_mode()
    def confidence(self, hidden: torch.Tensor, bonus: torch.Tensor, topk: int = 8, num_heads: int | None = None,
                   rows: Sequence[int] | None = None) -> tuple[torch.Tensor, dict]:
        """Top-1 probabilities along each request's greedy chain: ``[B, num_heads]`` float32 (the first
        ``num_heads`` heads; None: all), and a state (every evaluated path's top-``topk`` tokens) that
        :meth:`propose` reuses for the same paths. ``rows``: evaluate these requests (indices into the batch)
        only; the probabilities are then ``[len(rows), num_heads]`` in that order, and the state is keyed by the
        batch's indices, as :meth:`propose` reads it."""
        k_max = self.num_heads if num_heads is None else min(num_heads, self.num_heads)
        if rows is not None:
            idx = torch.tensor(list(rows), dtype=torch.long, device=hidden.device)
            hidden, bonus = hidden.index_select(0, idx), bonus.index_select(0, idx.to(bonus.device))
        b = hidden.shape[0]
        of = list(rows) if rows is not None else range(b)  # the batch's index of each evaluated row
        memo: dict[tuple[int, tuple[int, ...]], tuple[list[int], float]] = {}
        paths = [[int(t)] for t in bonus.tolist()]
        probs = torch.zeros(b, k_max, dtype=torch.float32)
        for k in range(k_max):
            if b == 0:
                break
            ids = torch.tensor(paths, dtype=torch.long, device=hidden.device)
            toks, p1 = self._level(k, hidden, ids, topk)
            probs[:, k] = torch.tensor(p1)
            for i in range(b):
                memo[(of[i], tuple(paths[i]))] = (toks[i], p1[i])
                paths[i].append(toks[i][0])
        return probs, memo

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, trees: Sequence[Tree | None], bonus: torch.Tensor | None = None,
                state: dict | None = None, chain_stop: Sequence[float | None] | None = None) -> list[list[int]]:
        """Draft tokens per request, one per node of its tree.

        Args:
            hidden: ``[B, hidden_size]``, the target's final-norm hidden state at each request's last accepted
                position, in the target's dtype.
            trees: ``B`` entries: the request's tree (canonical breadth-first order) or None for no drafts.
            bonus: ``[B]`` int64, the token the target chose after that position (the step's bonus token);
                required.
            state: from :meth:`confidence` (paths already evaluated are not evaluated again).
            chain_stop: as for :meth:`MTPDrafter.propose` (a chain's first node is kept, then it stops before
                the first node whose path confidence is below the request's entry).

        Returns:
            ``B`` token-id lists: node ``j``'s token at index ``j - 1`` (``[]`` for None; a chain may come back
            shorter, see ``confidence_threshold`` and ``chain_stop``). Node ``j``'s token is the
            rank-``ranks[j-1]`` token of head ``depth - 1`` applied to the node's parent path.

        Raises:
            ValueError: ``len(trees) != B``, no ``bonus``, a tree deeper than the heads, or a bad ``chain_stop``.
        """
        self.levels_run = 0
        b = hidden.shape[0]
        trees = list(trees)
        if b != len(trees):
            raise ValueError(f"hidden has {b} rows but {len(trees)} trees were given")
        depth = needed_heads(trees)
        if depth == 0:
            return [[] for _ in range(b)]
        if depth > self.num_heads:
            raise ValueError(f"a tree of depth {depth} needs {depth} heads; there are {self.num_heads}")
        if bonus is None:
            raise ValueError("Hydra heads need each request's bonus token (bonus=[B] token ids)")
        stops = chain_stops(b, chain_stop, self.confidence_threshold)
        memo = state if state is not None else {}
        out = [[0] * t.num_nodes if t is not None else [] for t in trees]
        path_of = {(i, 0): (int(t),) for i, t in enumerate(bonus.tolist())}
        conf = [1.0] * b  # chains: product of top-1 probabilities so far
        cut = [t.num_nodes if t is not None else 0 for t in trees]  # chains: nodes kept
        children = [t.children if t is not None else None for t in trees]
        frontier = [(i, 0) for i, t in enumerate(trees) if t is not None]  # (request, node) at depth d
        for d in range(depth):
            expand = [(i, j) for i, j in frontier if children[i][j] and cut[i] > d]
            if not expand:
                break
            k_top = max(max(trees[i].ranks[c - 1] for c in children[i][j]) + 1 for i, j in expand)
            todo = [(i, j) for i, j in expand if len(memo.get((i, path_of[(i, j)]), ((),))[0]) < k_top]
            if todo:
                rows = torch.tensor([i for i, _ in todo], device=hidden.device)
                ids = torch.tensor([path_of[x] for x in todo], dtype=torch.long, device=hidden.device)
                # top-1 probabilities are read by the chain stop only
                probs = any(stops[i][0] > 0.0 and trees[i].is_chain for i, _ in todo)
                toks, p1 = self._level(d, hidden.index_select(0, rows), ids, k_top, probs)
                self.levels_run += 1
                for x, tk, p in zip(todo, toks, p1 if p1 is not None else [None] * len(todo)):
                    memo[(x[0], path_of[x])] = (tk, p)
            frontier = []
            for i, j in expand:
                tk, p = memo[(i, path_of[(i, j)])]
                th, min_nodes = stops[i]
                if th > 0.0 and trees[i].is_chain:
                    conf[i] *= p
                    if conf[i] < th and d >= min_nodes:
                        cut[i] = d  # this head's token is not confident enough: stop before it
                        continue
                for c in children[i][j]:
                    tok = tk[trees[i].ranks[c - 1]]
                    out[i][c - 1] = tok
                    path_of[(i, c)] = path_of[(i, j)] + (tok,)
                    frontier.append((i, c))
        return [o[:cut[i]] if trees[i] is not None and trees[i].is_chain else o for i, o in enumerate(out)]

    def propose_chains(self, hidden: torch.Tensor, bonus: torch.Tensor, budgets: Sequence[int]) -> list[list[int]]:
        """Chains of the heads' top-1 tokens, at most ``budgets[i]`` (capped at the number of heads) each."""
        n = self.num_heads
        return self.propose(hidden, [Tree.chain(min(x, n)) if x > 0 else None for x in budgets], bonus)


class PrefixKVCache:
    """Per-request K/V cache of a Hydra++ prefix layer (``prefix-mlp`` heads), engine-independent.

    Each step, :meth:`advance` feeds every request the target's hidden states of the tokens the step committed
    to its context (a prompt chunk; or the verified root and the accepted draft tokens, in path order) with
    their absolute positions, appends their K/V, and returns the layer's output at the last of them: what the
    heads read in place of ``h_t``. Tokens whose hidden states the layer never saw (a prompt prefix served
    from vLLM's prefix cache) are missing from its context; the draft tokens may be worse for it, never the
    output (verification is unchanged). A request whose new tokens start at or before a position it already
    holds (recomputed after preemption) has its cache cut there first.
    """

    def __init__(self, heads: HydraHeads):
        if heads.prefix_embeding_layer is None:
            raise ValueError("these heads have no prefix layer")
        self.heads = heads
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # k, v [Hkv, P, D]; pos [P]

    @torch.inference_mode()
    def advance(self, req_ids: Sequence[str], hidden: Sequence[torch.Tensor],
                positions: Sequence[torch.Tensor]) -> torch.Tensor:
        """Append each request's committed tokens and return ``[B, hidden_size]``: the prefix layer's output at
        each request's last new token.

        Args:
            req_ids: ``B`` request ids.
            hidden: ``B`` tensors ``[n_i, hidden_size]`` (``n_i >= 1``), the target's hidden states of the new
                tokens, in the heads' dtype.
            positions: ``B`` int64 tensors ``[n_i]``, their positions in the request (increasing).

        Raises:
            ValueError: lengths that do not match, or a request with no new token.
        """
        b = len(req_ids)
        if not (len(hidden) == len(positions) == b):
            raise ValueError(f"{b} requests but {len(hidden)} hidden-state blocks and {len(positions)} positions")
        lens = [int(h.shape[0]) for h in hidden]
        if min(lens, default=1) < 1 or any(int(p.shape[0]) != n for p, n in zip(positions, lens)):
            raise ValueError("every request needs at least one new token, with one position per hidden state")
        pasts = []
        for rid, pos in zip(req_ids, positions):
            st = self._kv.get(rid)
            if st is not None and int(st[2][-1]) >= int(pos[0]):  # recomputed: cut the cache before pos[0]
                keep = st[2] < int(pos[0])
                st = (st[0][:, keep], st[1][:, keep], st[2][keep]) if bool(keep.any()) else None
            pasts.append(st)
        layer = self.heads.prefix_embeding_layer
        c, dev, dt = layer.config, hidden[0].device, hidden[0].dtype
        t_max, p_max = max(lens), max((st[2].shape[0] for st in pasts if st is not None), default=0)
        x = torch.zeros(b, t_max, hidden[0].shape[1], dtype=dt, device=dev)
        pos = torch.zeros(b, t_max, dtype=torch.long, device=dev)
        for i, (h, p) in enumerate(zip(hidden, positions)):
            x[i, :lens[i]] = h
            pos[i, :lens[i]] = p
            pos[i, lens[i]:] = p[-1]
        past = valid = None
        if p_max:
            past = (torch.zeros(b, c.num_key_value_heads, p_max, c.head_dim, dtype=dt, device=dev),
                    torch.zeros(b, c.num_key_value_heads, p_max, c.head_dim, dtype=dt, device=dev))
            valid = torch.zeros(b, p_max, dtype=torch.bool, device=dev)
            for i, st in enumerate(pasts):
                if st is not None:
                    n = st[2].shape[0]
                    past[0][i, :, :n], past[1][i, :, :n], valid[i, :n] = st[0], st[1], True
        out, (k, v) = layer(x, pos, past, valid)
        for i, (rid, st) in enumerate(zip(req_ids, pasts)):
            nk, nv, npos = k[i, :, :lens[i]], v[i, :, :lens[i]], positions[i].to(dev)
            self._kv[rid] = (nk, nv, npos) if st is None else (
                torch.cat([st[0], nk], dim=1), torch.cat([st[1], nv], dim=1), torch.cat([st[2], npos]))
        return out[torch.arange(b, device=dev), torch.tensor(lens, device=dev) - 1]

    def free_missing(self, live) -> int:
        """Drop the caches of requests not in ``live``; return how many were dropped."""
        return drop_missing(self._kv, live)

    def tracked_ids(self) -> set[str]:
        return set(self._kv)

    def __len__(self) -> int:
        return len(self._kv)


def _fused_blocks(heads: HydraHeads) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per head, its block's two linear maps fused into one: ``(weight [2H, in], bias [2H], H)``, the residual map
    first (the identity where the block has none)."""
    if not heads.config.grounded_heads or heads.config.hydra_num_layers != 1:
        raise ValueError("measured kernels need grounded Hydra heads of one layer (the shipped layout)")
    blocks = []
    for k in range(heads.num_heads):
        blk = heads.hydra_mlp[k][0]
        lin, res = blk.linear, blk.res_connection
        h, n_in = lin.weight.shape
        if isinstance(res, torch.nn.Linear):
            rw, rb = res.weight, res.bias
        else:  # identity residual (n_in == h)
            rw, rb = torch.eye(h, n_in, dtype=lin.weight.dtype), torch.zeros(h, dtype=lin.weight.dtype)
        blocks.append((torch.cat([rw, lin.weight]).detach(), torch.cat([rb, lin.bias]).detach(), h))
    return blocks


def _fast_hydra_layers(fused: list[tuple[torch.Tensor, torch.Tensor, int]], heads: HydraHeads,
                       w_draft: torch.Tensor | None) -> tuple[list[tuple[FastLinear, int]], list[FastLinear]]:
    """Per head, its fused block (:func:`_fused_blocks`) as a :class:`FastLinear`, and the draft lm_head(s)."""
    blocks = [(FastLinear(w, b), h) for w, b, h in fused]
    if heads.hydra_lm_head is not None:
        lm = [FastLinear(m.weight.detach(), m.bias.detach() if m.bias is not None else None)
              for m in heads.hydra_lm_head]
    else:
        lm = [FastLinear(w_draft)]
    return blocks, lm


def make_drafter(heads: MedusaHeads | HydraHeads, *, embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head_weight: torch.Tensor | None, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 confidence_threshold: float = 0.0, measure_kernels: bool = True, level_kernel: bool = True
                 ) -> MTPDrafter | HydraDrafter:
    """The drafter the server runs and ``build-trees`` times: Hydra heads with kernels measured on this machine
    (``measure_kernels``), Medusa heads over the target's ``compute_logits``.

    Args:
        embed: the target's input embedding (Hydra heads read the path's embeddings).
        lm_head_weight: the target's lm_head weight ``[vocab, hidden]``.
        compute_logits: the target's lm_head as a function (Medusa heads).
        measure_kernels: pick each layer's kernel by timing it here (else torch's ``F.linear``).
        level_kernel: with ``measure_kernels``, let levels of few paths take the one-call kernel where it times
            faster (option ``heads_kernel`` ``"auto"``).
    """
    if isinstance(heads, HydraHeads):
        return HydraDrafter(heads, embed, lm_head_weight, confidence_threshold=confidence_threshold,
                            measure_kernels=measure_kernels, level_kernel=level_kernel)
    return MTPDrafter(heads, compute_logits, confidence_threshold=confidence_threshold)
