"""Statistical check that tree rejection sampling is lossless: speculative decoding with a draft tree emits
tokens distributed exactly as plain sampling from the target would.

The "target model" is a fixed random bigram table over a vocabulary of 8 tokens (the next-token distribution
depends on the previous token only), so the exact distribution of the first two generated tokens is
``P(y1, y2) = T[c, y1] * T[y1, y2]``. Speculative decoding runs step after step (draft a tree, verify it with
``tree_rejection_sample``, append the accepted tokens and the next token) until two tokens are out, many times
with fixed seeds; the empirical distribution of ``(y1, y2)`` must match ``P`` (total variation under a bound
from the sample count, and a chi-square test). Negative controls run the same harness with samplers that have
classic bugs and show that the test fails them.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from vllm_entmtp.trees import Tree, children_lists
from vllm_entmtp.verify import apply_sampling_params, tree_rejection_sample

V = 8
CONTEXT = 3  # the prompt's last token
# Siblings at depths 1 and 2, depth 3; node order: [0] [1] [2] [0,0] [0,1] [1,0] [0,0,0]
TREE = Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
TRIALS = 5_000
CONTROL_TRIALS = 2_000
DELTA = 1e-6  # allowed chance that a correct sampler fails the TV bound
CHI2_Z = 3.7190  # standard normal quantile at 1 - 1e-4: chi-square test at alpha = 1e-4


def _table(temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(V, V, generator=g) * 2.0
    return apply_sampling_params(logits, temperature, top_k, top_p)  # [V, V], row a = P(next | a)


def _drafts(ranked: list[list[int]], last: int, rng: random.Random) -> list[int]:
    """Draft tokens for TREE: often the target's likeliest token (right), else 2nd likeliest or random
    (wrong or right by chance), and often a copy of the left sibling's token (duplicate siblings).
    ``ranked[a]``: the tokens by decreasing P(. | a)."""
    tokens: list[int] = []
    children = TREE.children
    for j, parent in enumerate(TREE.parents, start=1):
        ptok = last if parent == 0 else tokens[parent - 1]
        u = rng.random()
        tok = ranked[ptok][0] if u < 0.5 else ranked[ptok][1] if u < 0.75 else rng.randrange(V)
        left = [c for c in children[parent] if c < j]
        if left and rng.random() < 0.2:
            tok = tokens[left[-1] - 1]
        tokens.append(tok)
    return tokens


Sampler = Callable[[list[int], list[int], torch.Tensor, torch.Generator], tuple[list[int], int]]


def _run(sampler: Sampler, table: torch.Tensor, trials: int, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Counts ``[V, V]`` of the first two emitted tokens over ``trials`` runs, and some statistics."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    counts = torch.zeros(V, V, dtype=torch.long)
    stats = {"accepted": 0, "steps": 0, "duplicate_sibling_steps": 0}
    parents = TREE.parents
    ranked = table.argsort(dim=1, descending=True).tolist()
    for _ in range(trials):
        out: list[int] = []
        last = CONTEXT
        while len(out) < 2:
            drafts = _drafts(ranked, last, rng)
            stats["duplicate_sibling_steps"] += any(
                len({drafts[c - 1] for c in kids}) < len(kids) for kids in TREE.children)
            probs = table[torch.tensor([last] + drafts)]  # [num_nodes + 1, V]: row i = P(next | node i)
            accepted, nxt = sampler(drafts, parents, probs, gen)
            out += [drafts[j - 1] for j in accepted] + [nxt]
            last = out[-1]
            stats["accepted"] += len(accepted)
            stats["steps"] += 1
        counts[out[0], out[1]] += 1
    return counts, stats


def _exact(table: torch.Tensor) -> torch.Tensor:
    p = table.double()
    return p[CONTEXT].unsqueeze(1) * p  # [V, V]: P(y1, y2)


def _tv_bound(p: torch.Tensor, n: int) -> float:
    """With probability >= 1 - DELTA the empirical TV is below this: E[TV] <= 1/2 sum sqrt(p(1-p)/n) (Jensen),
    and TV moves by at most 1/n per sample, so McDiarmid adds sqrt(ln(1/DELTA) / (2n))."""
    mean = 0.5 * (p * (1 - p) / n).sqrt().sum().item()
    return mean + math.sqrt(math.log(1 / DELTA) / (2 * n))


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float, int]:
    """Chi-square statistic over cells with expected count >= 5 (the rest pooled into one cell), its critical
    value at alpha = 1e-4 (Wilson-Hilferty approximation of the chi-square quantile), and the degrees of freedom.
    Cells of probability 0 are left out (checked separately)."""
    n = counts.sum().item()
    obs, exp = counts.flatten().double(), p.flatten() * n
    live = exp > 0
    obs, exp = obs[live], exp[live]
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum().unsqueeze(0)]) if (~big).any() else obs[big]
    e = torch.cat([exp[big], exp[~big].sum().unsqueeze(0)]) if (~big).any() else exp[big]
    stat = ((o - e) ** 2 / e).sum().item()
    df = len(o) - 1
    crit = df * (1 - 2 / (9 * df) + CHI2_Z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit, df


def _check(sampler: Sampler, table: torch.Tensor, trials: int = TRIALS):
    counts, stats = _run(sampler, table, trials)
    p = _exact(table)
    tv = 0.5 * (counts.double() / trials - p).abs().sum().item()
    stat, crit, df = _chi2(counts, p)
    impossible = int(counts[p == 0].sum())
    return {"tv": tv, "tv_bound": _tv_bound(p, trials), "chi2": stat, "chi2_crit": crit, "df": df,
            "impossible": impossible, **stats}


CONFIGS = {
    "T=1": (1.0, None, None),
    "T=1,top_k=6,top_p=0.95": (1.0, 6, 0.95),  # 3-5 tokens of probability 0 per row, often drafted
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tree_rejection_sampling_preserves_the_target_distribution(config):
    table = _table(*CONFIGS[config])
    r = _check(tree_rejection_sample, table)
    # The harness exercised what it should: acceptances deep in the tree, rejections, duplicate siblings.
    assert r["accepted"] / r["steps"] > 0.5 and r["steps"] > TRIALS
    assert r["duplicate_sibling_steps"] > 0.3 * r["steps"]
    assert r["impossible"] == 0, f"emitted a token of probability 0: {r}"
    assert r["tv"] < r["tv_bound"], r
    assert r["chi2"] < r["chi2_crit"], r


# -- negative controls: the same harness must fail samplers with classic bugs -----------------------------------


def _greedy_first_sibling(draft_tokens, parents, target_probs, generator):
    """Bug: accept the first child whose token is possible at all, then sample the next token normally."""
    children = children_lists(parents)
    accepted, node = [], 0
    while True:
        c = next((c for c in children[node] if target_probs[node, draft_tokens[c - 1]] > 0), None)
        if c is None:
            return accepted, int(torch.multinomial(target_probs[node], 1, generator=generator))
        accepted.append(c)
        node = c


def _no_residual(draft_tokens, parents, target_probs, generator):
    """Bug: right acceptance tests, but after rejections the next token comes from the full row, not the
    residual (rejected tokens keep their mass, so they are over-sampled)."""
    children = children_lists(parents)
    accepted, node = [], 0
    while True:
        p = target_probs[node].double().clone()
        moved = False
        for c in children[node]:
            x = draft_tokens[c - 1]
            if torch.rand((), generator=generator, dtype=torch.float64) * p.sum() < p[x]:
                accepted.append(c)
                node, moved = c, True
                break
            p[x] = 0
        if not moved:
            return accepted, int(torch.multinomial(target_probs[node], 1, generator=generator))


def _no_renormalization(draft_tokens, parents, target_probs, generator):
    """Bug: a later sibling is accepted with its probability under the full row, not under the residual left
    by the rejected siblings (later siblings are under-accepted); the next token is drawn correctly."""
    children = children_lists(parents)
    accepted, node = [], 0
    while True:
        p = target_probs[node].double().clone()
        moved = False
        for c in children[node]:
            x = draft_tokens[c - 1]
            if torch.rand((), generator=generator, dtype=torch.float64) < p[x] / target_probs[node].sum():
                accepted.append(c)
                node, moved = c, True
                break
            p[x] = 0
        if not moved:
            p = p if p.sum() > 0 else target_probs[node].double()
            return accepted, int(torch.multinomial(p, 1, generator=generator))


@pytest.mark.parametrize("sampler", [_greedy_first_sibling, _no_residual, _no_renormalization],
                         ids=lambda f: f.__name__)
def test_negative_control_biased_samplers_fail(sampler):
    """With fewer trials than the real test, each biased sampler fails its chi-square test (the subtlest one,
    no renormalization, moves the TV by about 0.08, near the bound at this count)."""
    table = _table(*CONFIGS["T=1"])
    r = _check(sampler, table, trials=CONTROL_TRIALS)
    assert r["chi2"] > 1.2 * r["chi2_crit"], r
