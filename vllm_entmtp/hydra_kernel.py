"""One level of the Hydra heads for a few paths in one C++ call (``kernels/hydra_level.cpp``).

At one request a level of the shipped heads (one head's block and the draft lm_head, 8,192 rows) is two memory-bound
products and about ten small torch operators; right after the target's forward, each of those operators' first
call costs tens of microseconds, its code being out of the caches. The kernel runs the level in one call: the two
products (each weight row read once for all paths, rows over torch's threads), SiLU and the residual, the top-k, the
top-1 probability. :class:`~vllm_entmtp.proposer.HydraDrafter` uses it for levels of at most :data:`MAX_ROWS` paths
where it builds, passes :func:`self_check`, and timed faster than torch's path at start-up; other levels (more
paths: oneDNN's products win there), and all with option ``heads_kernel`` ``"torch"``, run torch's path.
``benchmarks/hydra_level.py`` times both with the weights out of the caches, as after the target's forward.

Its draft tokens are those of torch's path up to rounding: float32 sums in another order, bfloat16 values widened
as read, and in bfloat16 the block's output and the logits kept in float32 where torch's path rounds them (and so
ties more logits); a draft token can differ at a near-tie, the output never (verification decides).
"""
from __future__ import annotations

import torch

from vllm_entmtp import cpp_build

NAME = "entmtp_hydra_level"
SOURCE = "hydra_level.cpp"
#: Levels of at most this many paths can take the kernel.
MAX_ROWS = 4
_ALL_COLUMNS = torch.empty(0, dtype=torch.long)  # token_ids of a draft vocabulary that is the whole vocabulary


def why_not() -> str:
    """Why the kernel is not loaded (empty when it is)."""
    return KERNEL.reason


def load(dtype: torch.dtype) -> bool:
    """Build (the first time, some 30 s) and check the kernel in ``dtype`` (once per dtype); True when it is ready.
    A failure logs why and leaves torch's path (:func:`why_not`)."""
    return KERNEL.load(dtype)


def _unavailable(dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 and bfloat16 only)"
    return cpp_build.toolchain_missing()


def level(hidden: torch.Tensor, path_emb: torch.Tensor, w_block: torch.Tensor, b_block: torch.Tensor,
          w_lm: torch.Tensor, token_ids: torch.Tensor | None, topk: int, probs: bool
          ) -> tuple[list[list[int]], list[float] | None]:
    """Head ``k`` on ``N <= MAX_ROWS`` paths: ``hidden [N, H]``, ``path_emb [N, k + 1, H]`` (input embeddings of the
    path, bonus token first), the head's block fused ``w_block [2H, (k + 2) H]`` (residual map first) and
    ``b_block [2H]``, the draft lm_head ``w_lm [DV, H]`` and its token ids ``[DV]`` (None: column = token id) ->
    (``N`` lists of the top-``topk`` token ids, best first; ``N`` top-1 probabilities, or None when not
    ``probs``). All tensors contiguous, on the CPU, in one dtype (float32 or bfloat16)."""
    ids = token_ids if token_ids is not None else _ALL_COLUMNS
    toks, p1 = KERNEL.module.hydra_level(hidden, path_emb, w_block, b_block, w_lm, ids, topk, probs)
    return toks, (p1 if probs else None)


def reference(hidden, path_emb, w_block, b_block, w_lm, token_ids, topk: int
              ) -> tuple[list[list[int]], list[float]]:
    """What :func:`level` computes, in float64 torch (tests and :func:`self_check`)."""
    n, h = hidden.shape
    x = torch.cat([hidden.double(), path_emb.double().reshape(n, -1)], dim=-1)
    y = x @ w_block.double().t() + b_block.double()
    hs = (y[:, :h] + torch.nn.functional.silu(y[:, h:])).to(hidden.dtype)  # the lm_head reads it in the dtype
    logits = hs.double() @ w_lm.double().t()
    vals, cols = logits.topk(topk, dim=-1)
    p1 = torch.exp(vals[:, 0] - torch.logsumexp(logits, dim=-1))
    ids = token_ids[cols] if token_ids is not None else cols
    return ids.tolist(), p1.tolist()


def random_level(dtype: torch.dtype, n: int, depth: int, hidden: int = 64, vocab: int = 300, draft_vocab: int = 200,
                 seed: int = 0) -> tuple:
    """Random arguments of :func:`level` (``depth`` path tokens), for checks: ``(hidden, path_emb, w_block, b_block,
    w_lm, token_ids)``."""
    g = torch.Generator().manual_seed(seed)
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).contiguous()
    token_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    return (r(n, hidden), r(n, depth, hidden), r(2 * hidden, (depth + 1) * hidden, scale=0.1), r(2 * hidden, scale=0.1),
            r(draft_vocab, hidden, scale=0.3), token_ids)


def self_check(dtype: torch.dtype) -> str | None:
    """Compare the kernel with :func:`reference` on random levels of 1 to :data:`MAX_ROWS` paths in ``dtype``
    (None: it agrees; else what differed)."""
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    for n in range(1, MAX_ROWS + 1):  # 201 draft-vocabulary rows: groups of 4 and a tail
        args = random_level(dtype, n, depth=n % 3 + 1, draft_vocab=201, seed=n)
        toks, p1 = level(*args, topk=4, probs=True)
        ref_toks, ref_p1 = reference(*args, topk=4)
        if toks != ref_toks or max(abs(a - b) for a, b in zip(p1, ref_p1)) > tol:
            return f"its start-up check in {dtype} failed ({n} paths): top-4 {toks} vs {ref_toks}, p1 {p1} vs {ref_p1}"
    return None


KERNEL = cpp_build.BuiltKernel(NAME, SOURCE, _unavailable, self_check, "Hydra heads' levels by torch's operators")
