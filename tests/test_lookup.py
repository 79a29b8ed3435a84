"""Prompt lookup (vllm_entmtp.lookup) and how the scheduler weighs it against the heads (fit_lookup)."""
import json

import numpy as np
import pytest
import torch

from vllm_entmtp.lookup import PromptLookup, expected_chain_accepted
from vllm_entmtp.scheduler import TreeScheduler
from vllm_entmtp.step_costs import STEP_KINDS, StepCosts
from vllm_entmtp.trees import load_tree_set


def test_draft_is_what_followed_the_longest_earlier_match():
    lk = PromptLookup(min_n=2, max_n=4, max_tokens=3)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]  # the last "6 7" occurs earlier at 1 and at 6
    # the longest match, and among equally long ones the latest (vLLM's ngram: the earliest) -> after 6: 2 3 6
    assert lk.propose(np.array(toks, dtype=np.int32)) == [2, 3, 6]
    toks2 = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4]  # "2 3 4" (3 tokens) beats any 2-token match
    assert lk.propose(np.array(toks2, dtype=np.int32)) == [5, 9, 9]
    assert lk.propose(np.array(toks2, dtype=np.int32), max_tokens=1) == [5]
    assert lk.propose(np.array([1, 2, 3, 4], dtype=np.int32)) == []  # no repeat: no draft


def test_the_numpy_match_finds_what_the_reference_loop_finds():
    """The match the drafter runs (a byte search) against the plain loop that defines it, on token strings with
    many repeats (a vocabulary of 2-5 tokens), every length from 1 to 80 and n-gram bounds from (1, 1) to (2, 5),
    and on token ids whose bytes repeat across token boundaries."""
    from vllm_entmtp.lookup import _latest_longest_match, _latest_longest_match_py

    rng = np.random.default_rng(0)
    checked = 0
    for total in range(1, 81):
        for vocab in (2, 3, 5):
            toks = rng.integers(0, vocab, size=total).astype(np.int32)
            for min_n, max_n in ((1, 1), (1, 3), (2, 4), (2, 5), (3, 3)):
                assert _latest_longest_match(toks, min_n, max_n) == _latest_longest_match_py(toks, min_n, max_n), \
                    (toks.tolist(), min_n, max_n)
                checked += _latest_longest_match(toks, min_n, max_n) >= 0
    assert checked > 500  # most strings have a match: the comparison is not of -1s
    # token ids whose bytes repeat across token boundaries: a byte-level hit that does not start on a token may lie
    # right of the real match, and is skipped
    for vocab in ((1, 256, 257, 65536, 65537, 16777217), (0x01000001, 0x00010100, 1, 0x01000000)):
        for total in range(2, 60):
            toks = rng.choice(np.array(vocab, dtype=np.int64), size=total).astype(np.int32)
            for min_n, max_n in ((1, 3), (2, 4)):
                assert _latest_longest_match(toks, min_n, max_n) == _latest_longest_match_py(toks, min_n, max_n)
    # the suffix "1 2" (bytes 01 00 00 00 02 00 00 00) also appears from the second byte of 261 (05 01 00 00)
    # through 512 (00 02 00 00) into 768 (00 03 00 00): off a token boundary, right of the real match at 0
    toks = np.array([1, 2, 9, 261, 512, 768, 1, 2], dtype=np.int32)
    assert toks.tobytes().rfind(toks[-2:].tobytes(), 0, 7 * 4) == 13  # the byte search meets the false hit first
    assert _latest_longest_match(toks, 2, 2) == _latest_longest_match_py(toks, 2, 2) == 2


def test_prompt_lookup_does_not_load_numba():
    """numba (llvmlite) costs the worker 164 MiB of resident memory; plain decoding does not load it."""
    import subprocess
    import sys

    code = ("import sys, numpy as np; from vllm_entmtp.lookup import PromptLookup; "
            "lk = PromptLookup(); lk.propose(np.array([1, 2, 3, 1, 2, 3], dtype=np.int32)); "
            "print('numba' in sys.modules or 'llvmlite' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_propose_batch_reads_each_rows_own_tokens_and_budget():
    lk = PromptLookup(min_n=2, max_n=4, max_tokens=4)
    ids = np.zeros((3, 16), dtype=np.int32)
    ids[0, :8] = [1, 2, 3, 4, 5, 6, 1, 2]
    ids[1, :6] = [7, 8, 9, 7, 8, 0]  # its last two tokens do not repeat (and the row's padding is not read)
    ids[2, :8] = [1, 2, 3, 4, 5, 6, 1, 2]
    got = lk.propose_batch(ids, [8, 6, 8], rows=[0, 1, 2], budgets=[4, 4, 2])
    assert got == {0: [3, 4, 5, 6], 2: [3, 4]}


def test_expected_accepted_follows_the_requests_record():
    assert expected_chain_accepted(0.5, 4) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625)
    assert expected_chain_accepted(1.0, 3) == 3.0 and expected_chain_accepted(0.0, 3) == 0.0
    lk = PromptLookup(prior=0.5, window=4)
    assert lk.acceptance_probability("r") == 0.5
    for _ in range(6):
        lk.observe("r", 4, 4)  # everything accepted: no rejection observed
    high = lk.acceptance_probability("r")
    assert high > 0.9 and lk.expected("r", 4) > 3.0
    for _ in range(10):  # about 2.5 windows of rejections at once
        lk.observe("r", 4, 0)
    assert lk.acceptance_probability("r") < 0.3 < high
    assert lk.acceptance_probability("other") == 0.5  # per request
    lk.free_missing({"other"})
    assert lk.tracked_ids() == set()


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        PromptLookup(min_n=4, max_n=2)


def _measured_scheduler():
    return TreeScheduler(load_tree_set("default"), "confidence", load_policy="measured")


def _costs(per_row_ms: float, rows=(1, 2, 4, 8, 16, 32, 64, 128)) -> StepCosts:
    c = StepCosts()
    for r in rows:
        for _ in range(3):
            c.record_rows(r, (20.0 + per_row_ms * r) / 1e3)
    return c


def _linear_prefixes(n: int, e: float) -> list[float]:
    """Expected accepted tokens of a lookup chain's first 1 .. n tokens, ``e`` for the whole chain (linear: the
    rules without measured costs read only the whole chain's)."""
    return [e * m / n for m in range(1, n + 1)]


def _p_chain(p: float, n: int = 4) -> list[float]:
    """As ``PromptLookup.expected`` gives them: each token accepted with probability ``p`` until a rejection."""
    return [expected_chain_accepted(p, m) for m in range(1, n + 1)]


def test_lookup_wins_where_it_expects_more_than_the_heads_draft():
    s = TreeScheduler(load_tree_set("default"), "confidence", load_policy="cap")
    # request 0: heads expect 1.2, lookup 2.0 -> lookup; request 1: heads 1.5, lookup 0.4 -> heads;
    # request 2: no heads draft, lookup 0.3 -> lookup (anything beats nothing without measured costs)
    got = s.fit_lookup(3, nodes=[4, 4, 0], acc=[1.2, 1.5, 0.0],
                       cands={0: _linear_prefixes(4, 2.0), 1: _linear_prefixes(4, 0.4), 2: _linear_prefixes(2, 0.3)}, costs=None)
    assert got == {0: 4, 2: 2}  # whole chains


def test_lookup_drafts_stay_within_the_cap_of_verified_rows():
    """max_verify_tokens_per_step bounds every draft node of a step, the lookup's too: requests switch in order
    of tokens gained per row added while the step's nodes fit; with no room, none that adds a node; a switch that
    adds none always fits."""
    s = TreeScheduler(load_tree_set("default"), "confidence", load_policy="cap")
    cands = {0: _linear_prefixes(4, 2.0), 1: _linear_prefixes(4, 3.0), 2: _linear_prefixes(2, 1.5)}  # gains per row added: 0.5, 0.83, 1.0
    nodes, acc = [1, 1, 1], [0.5, 0.5, 0.5]
    assert list(s.fit_lookup(3, nodes, acc, cands, None)) == [0, 1, 2]  # no cap
    assert list(s.fit_lookup(3, nodes, acc, cands, None, budget=5)) == [2]  # 3 -> 4 nodes; request 1 would make 7
    assert list(s.fit_lookup(3, nodes, acc, cands, None, budget=7)) == [1, 2]  # 4, then 7; request 0: 10
    assert s.fit_lookup(3, [0, 0, 0], [0.0] * 3, cands, None, budget=0) == {}
    assert s.fit_lookup(2, [4, 0], [1.0, 0.0], {0: _linear_prefixes(4, 2.0)}, None, budget=0) == {0: 4}  # 4 nodes for 4


def test_under_measured_costs_a_lookup_draft_must_pay_for_its_rows():
    s = _measured_scheduler()
    cands = {i: _p_chain(0.24) for i in range(16)}  # weak lookup drafts (0.3 tokens of 4), no heads drafts
    cheap, dear = _costs(0.01), _costs(3.0)  # rows almost free / a row costs 0.7 of a plain token
    assert list(s.fit_lookup(16, [0] * 16, [0.0] * 16, cands, cheap)) == list(range(16))
    assert s.fit_lookup(16, [0] * 16, [0.0] * 16, cands, dear) == {}
    strong = {i: _p_chain(0.93) for i in range(16)}  # strong ones still pay
    got = s.fit_lookup(16, [0] * 16, [0.0] * 16, strong, dear)
    assert list(got) == list(range(16))
    # each switch raises the step's tokens per second, so a further token must bring more to pay for its row: the
    # chains are cut (to within a token of each other, these requests being alike), and no last token is left that
    # does not pay at the step's final rate
    assert max(got.values()) - min(got.values()) <= 1 and sum(got.values()) < 64
    curve = dear.curve(16, 64)
    tokens, total = 16 + sum(strong[i][m - 1] for i, m in got.items()), sum(got.values())
    for i, m in got.items():
        assert (tokens - strong[i][m - 1] + strong[i][m - 2]) / curve[total - 1] <= tokens / curve[total]


def test_under_measured_costs_a_lookup_chain_is_cut_where_its_further_tokens_do_not_pay():
    """A chain's m-th token is accepted only with all before it (0.7 ** m here): where a row costs half a plain
    token's time (16 requests, 1.25 ms a row, 2.5 ms a plain token), the first token pays and the later ones do
    not, so the chain is cut to one token; with rows almost free it is drafted whole, and so it is where its
    tokens are worth a step of one row (20 ms: the batch drains with this request last, StepCosts.token_value)."""
    s = _measured_scheduler()
    cands = {0: _p_chain(0.7)}
    mid = _costs(1.25)
    assert s.fit_lookup(16, [0] * 16, [0.0] * 16, cands, mid) == {0: 1}
    assert s.fit_lookup(16, [0] * 16, [0.0] * 16, cands, _costs(0.01)) == {0: 4}
    assert s.fit_lookup(16, [0] * 16, [0.0] * 16, cands, mid, token_value=0.020) == {0: 4}
    # a heads' draft expecting more than the first token keeps the request (no prefix expecting as much pays for its
    # rows)
    assert s.fit_lookup(16, [1] + [0] * 15, [0.86] + [0.0] * 15, cands, mid) == {}


def test_best_expected_bounds_the_heads_and_scales_with_the_record():
    s = _measured_scheduler()
    best = s.best_expected("r")
    assert 0 < best < float("inf")
    for _ in range(8):
        s.observe_acceptance("r", expected=2.0, accepted=0)  # the heads do badly for this request
    assert s.best_expected("r") < best
    assert TreeScheduler(load_tree_set("default"), "confidence", load_policy="cap").best_expected("r") == \
        float("inf")  # no statistics loaded under the cap: nothing to compare with before the heads run


def test_a_lookup_draft_not_drafted_is_scored_against_what_the_target_emitted():
    lk = PromptLookup(prior=0.5, window=4)
    text = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32)
    lk.remember("r", [4, 5, 9, 9], num_tokens=3)  # proposed after [1, 2, 3]; the target went on 4 5 6 ...
    lk.score_unsent("r", text)
    assert lk._record["r"] == pytest.approx([0.75 * 1.0 + 2, 0.75 * 1.0 + 1])  # 2 accepted, then a rejection
    lk.remember("s", [4, 5, 6], num_tokens=3)
    lk.score_unsent("s", text[:5])  # only 4 5 emitted since: both match, the rest unseen (no rejection)
    assert lk._record["s"] == pytest.approx([0.75 * 1.0 + 2, 0.75 * 1.0])
    lk.score_unsent("s", text)  # scored once
    assert lk._record["s"] == pytest.approx([0.75 * 1.0 + 2, 0.75 * 1.0])
    lk.remember("t", [4], num_tokens=3)
    lk.free_missing({"r"})
    assert lk.tracked_ids() == {"r"}


# ------------------------------------------------------------------------------------------ calibration
def test_lookup_statistics_score_every_position_against_the_continuation():
    from vllm_entmtp.calibrate.lookup import lookup_statistics

    # prompt "1 2 3 4 5 6", continuation "1 2 3 4 9": at t=2 the last tokens "1 2" match the prompt, the
    # draft "3 4 5 6" meets "3 4 9": 2 accepted, then a rejection; at t=3 ("1 2 3" -> "4 5 6 1") 1 accepted, a
    # rejection; at t=4 ("1 2 3 4" -> "5 6 1 2") none accepted, a rejection; at t=0 and 1 no suffix of 2-4
    # tokens occurred before
    st = lookup_statistics([([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9])], 2, 4, 4)
    assert (st["positions"], st["drafts"], st["accepted_tokens"], st["rejections"]) == (5, 3, 3, 3)
    assert st["drafted_tokens"] == 12 and st["coverage"] == 0.6 and st["mean_accepted"] == 1.0
    assert st["acceptance_probability"] == 0.5 and st["prior"] == 0.5
    # a draft that runs past the continuation's end is cut there: no rejection seen
    st = lookup_statistics([([7, 8, 9, 7, 8, 9], [7, 8])], 2, 4, 4)
    assert st["drafts"] >= 1 and st["rejections"] == 0 and st["acceptance_probability"] == 1.0
    assert st["prior"] == 0.98  # clipped into (0, 1)
    st = lookup_statistics([([1, 2], [3, 4, 5])], 2, 4, 4)
    assert st["drafts"] == 0 and st["prior"] is None and st["mean_accepted"] is None


def test_calibrated_prior_only_when_the_user_gave_none_and_the_lengths_match():
    from vllm_entmtp.lookup import calibrated_prior

    cal = {"prompts": "humaneval", "lookup": {"prior": 0.8, "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
    assert calibrated_prior(0.5, False, cal, 2, 4) == (0.8, "the tree set's calibration on humaneval")
    assert calibrated_prior(0.3, True, cal, 2, 4) == (0.3, "lookup_prior")
    assert calibrated_prior(0.5, False, cal, 3, 5) == (0.5, "default")  # calibrated for other n-grams
    assert calibrated_prior(0.5, False, {}, 2, 4) == (0.5, "default")


def test_lookup_rests_after_declined_steps_and_searches_again_once_a_draft_is_taken():
    from vllm_entmtp.lookup import LookupRests

    r = LookupRests(after=3, every=4)
    for _ in range(3):  # three steps at 32 whose lookup drafts were all declined
        assert r.searches(32)
        r.record(32, found=True, taken=False)
    r.record(32, found=False, taken=False)  # found nothing: not counted either way
    # resting at 32: one search every 4 steps; other batch sizes search every step
    assert [r.searches(32) for _ in range(8)] == [False, False, False, True] * 2 and r.rested == 6
    assert r.searches(16)
    r.record(32, found=True, taken=True)  # a step took a lookup draft: every step searches again
    assert all(r.searches(32) for _ in range(5))
    with pytest.raises(ValueError):
        LookupRests(after=0)


def test_an_exploring_step_drafts_the_lookup_drafts_that_unmeasured_costs_decline():
    """Served on the 2-core EPYC (2026-12-05, chat with long histories, 16 running), prompt lookup found a draft
    for most requests every step, and where no step of more rows than the batch was measured the costs priced a
    draft row at a plain token's, so the rule declined every lookup draft; the steps meant to measure drafting
    (``StepCosts.needs_exploration``) declined them too, on the same costs, and at 16 running the server drafted in
    3 % of its request-steps while its drafted steps emitted 174 tokens/s against 141 without. An exploring step
    weighs the lookup drafts without the costs it is there to measure, under the exploring budget: here, in steps
    of lookup drafts alone (every request's lookup draft beats what the heads could expect, so the heads do not
    run), and in steps where drafting rests on a realised loss, one step in ``EXPLORE_UNMEASURED_EVERY`` drafts
    as many lookup chains as the exploring budget holds, and the rest draft nothing; a lookup draft drafted is
    not scored again as one left undrafted."""
    from conftest import lookup_drafter

    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, EXPLORE_UNMEASURED_EVERY

    n, steps = 16, 2 * EXPLORE_UNMEASURED_EVERY

    def drafter(resting: bool):
        costs = StepCosts()
        for _ in range(3):  # plain steps of 8-16 requests; no step of more than 16 rows
            for rows, seconds in ((8, 0.040), (12, 0.060), (16, 0.100)):
                costs.record_rows(rows, seconds)
        if resting:  # the realised comparison: steps that verified drafts emitted fewer tokens per second
            for _ in range(COMPARE_MIN_DRAFTING + 1):  # (a key's first observation is dropped)
                costs.record_step(n, 2 * n, 0.250, True)
                costs.record_step(n, n, 0.100, False)
            assert costs.drafting_loses(n)
        # every request repeats itself; a record of accepted lookup drafts: no heads' draft could beat them
        d, rids = lookup_drafter(costs, [0] * n, draft_sources="hybrid", accepted=4)
        assert all(d.lookup.expected(r, 4) >= d.scheduler.best_expected(r) for r in rids)
        return d, costs, rids

    for resting in (False, True):  # a step of lookup drafts alone, or one where drafting rests on a loss
        d, costs, rids = drafter(resting)
        drafted = []
        for _ in range(steps):
            chosen, drafts = d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
            assert not d.heads_ran
            drafted.append(sum(len(x) for x in drafts))
            for r, (t, _), x in zip(rids, chosen, drafts):
                assert (t, x) in (("lookup", [11, 12, 13, 14]), ("", []))
                if drafted[-1]:  # a lookup draft drafted is scored by its verification, one declined by the text after
                    assert (r in d.lookup._unsent) == (t != "lookup")
        # the exploring steps' budget: the default cap's room at 16 requests, 16 draft nodes (four lookup chains)
        budget = d.scheduler.exploring_budget(n)
        explored = [i for i, k in enumerate(drafted) if k]
        assert explored == [EXPLORE_UNMEASURED_EVERY - 1, steps - 1] and costs.explored(n) == 2, (resting, drafted)
        assert all(drafted[i] == budget == 16 for i in explored), (resting, drafted)


def _draining_drafter(n: int, draining: bool, resting: bool, others_out: int = 200):
    """conftest.lookup_drafter over ``n`` requests, ``r0`` with no output yet and the others with ``others_out`` tokens
    (of 256); step costs of 20 ms at 1 row, 48 ms at 16, 2 ms a further row; ``resting``: the full batch's steps
    that verified drafts emitted fewer tokens per second than those that verified none; ``draining``: a request
    finished and none came in its place."""
    from conftest import lookup_drafter

    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING, REFILL_WAIT

    costs = StepCosts()
    for _ in range(3):
        for rows, seconds in ((1, 0.020), (16, 0.048), (32, 0.080)):
            costs.record_rows(rows, seconds)
    if resting:
        for _ in range(COMPARE_MIN_DRAFTING + 1):
            costs.record_step(n, 2 * n, 0.150, True)
            costs.record_step(n, n, 0.048, False)
        assert costs.drafting_loses(n)
    d, rids = lookup_drafter(costs, [0] + [others_out] * (n - 1))
    d.refills.step(arrived=n, finished=0, continuing=0)
    if draining:
        for finished in [1] + [0] * REFILL_WAIT:
            d.refills.step(arrived=0, finished=finished, continuing=n)
    assert d.refills.draining == draining
    return d, costs, rids


def test_while_the_batch_drains_the_last_request_drafts_what_its_tokens_are_worth_at_the_end():
    """Served on the 2-core EPYC (2026-12-06, bfloat16, GSM8K, 32 requests at 16 running), the second half of a
    level drained in a third of its time and drafted in a third of those steps: the rules priced
    the last requests' accepted tokens as plain tokens of the batch running, and rested on the realised loss of the
    full batch's steps. Here 16 requests drain and one has 256 tokens left, the others 56: its lookup chain
    (each token accepted with probability 0.5: its first half a token for a 2-ms row, its whole chain about one
    token for 8 ms) is declined by the batch's tokens per second (3 ms a token) and
    taken at the worth of a step of one row (20 ms, ``StepCosts.token_value``), whether or not the full batch's
    steps rest on a loss; the requests ahead draft nothing. Where the others have more than half as many tokens
    left, they are as likely to finish last, and every token counts alike."""
    n = 16
    d, costs, rids = _draining_drafter(n, draining=False, resting=False)
    assert 0.5 < d.lookup.expected("r0", 4) < 1.5 and costs.token_value(n, 1) == pytest.approx(0.020)
    _, drafts = d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
    assert drafts == [[]] * n and not d._valued  # half a token for 2 ms at best: under the batch's 1 per 3 ms
    for resting in (False, True):
        d, costs, rids = _draining_drafter(n, draining=True, resting=resting)
        chosen, drafts = d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
        # its chain cut to 3 tokens: the 4th, accepted with 0.5 ** 4 = 0.06 (1.25 ms of a 20-ms token), is worth less
        # than its 2-ms row
        assert drafts == [[11, 12, 13]] + [[]] * (n - 1) and chosen[0][0] == "lookup", resting
        assert d._valued and not d.heads_ran
    # with 156 tokens left the others are as likely to finish last (LAST_SHARE): every token counts alike
    d, _, rids = _draining_drafter(n, draining=True, resting=False, others_out=100)
    _, drafts = d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
    assert drafts == [[]] * n and not d._valued


def _draft_step(d, rids, sampled: list[list[int]], spec: int, accepted: list[int] | None = None) -> list[list[int]]:
    """The drafter's ``draft_step`` after a decode step of ``len(rids)`` requests that verified ``spec`` draft tokens
    in 50 ms and sampled ``sampled`` (the runner's step state as ``patches/runner.py`` leaves it; ``accepted``: each
    request's accepted draft tokens, as the verification leaves them in ``STEP.signals``, or None)."""
    import time
    from types import SimpleNamespace

    from vllm_entmtp.step import STEP

    out = SimpleNamespace(num_spec_tokens_to_schedule=4, scheduled_new_reqs=[], finished_req_ids=set(),
                          scheduled_cached_reqs=SimpleNamespace(req_ids=rids))
    saved = STEP.decode_rows, STEP.rows_clock, STEP.signals
    STEP.decode_rows, STEP.rows_clock, STEP.signals = len(rids) + spec, time.perf_counter() - 0.05, (None, accepted)
    try:
        return d.draft_step(out, sampled, None, torch.zeros(len(rids), 8), None)
    finally:
        STEP.decode_rows, STEP.rows_clock, STEP.signals = saved


def test_a_draining_batchs_valued_steps_stay_out_of_the_realised_comparison():
    """The realised comparison (``StepCosts.record_step``: tokens per second of the steps that verified drafts and of
    those that verified none, at a batch size) takes the steps whose drafts the rule chose by the batch's tokens per
    second. While the batch drains and the last request's drafts are weighed by what its tokens are worth at the
    end (``StepCosts.token_value``), neither the step that proposes them nor the step that verifies them enters it
    (here the last request has caught up by then, so that step's own drafts are the batch's again, and the step
    after it enters); where the batch does not drain, every step does."""
    n = 16
    for draining in (True, False):
        d, costs, rids = _draining_drafter(n, draining=draining, resting=False)
        drafts = _draft_step(d, rids, [[5]] * n, spec=0)
        assert (drafts[0] == [11, 12, 13]) == draining and d._valued == draining  # a cut chain (above)
        d.runner.requests["r0"].output_token_ids = [0] * 200  # now as far as the others
        # r0's draft verified: its first token accepted, then the target's own token instead of its second
        spec = len(drafts[0])
        drafts = _draft_step(d, rids, [[11, 99]] + [[5]] * (n - 1) if draining else [[5]] * n, spec=spec)
        assert not d._valued
        _draft_step(d, rids, [[5]] * n, spec=sum(len(x) for x in drafts))
        recorded = sum(costs._seen.get((f"step-{kind}", n), 0) for kind in STEP_KINDS)  # first included
        assert recorded == (1 if draining else 3), draining


def test_a_step_whose_drafting_ran_the_heads_counts_as_theirs_in_the_realised_comparison():
    """The realised comparison's steps without drafts stand for what resting costs: no head runs there. A step that
    verified no draft but whose drafting ran the heads (their confidence pass chose no draft) holds the heads' time,
    so it counts with the steps that verified the heads' drafts; a step that verified lookup's drafts alone counts
    as lookup's only where the heads did not run. The heads' part is most of the comparison's 5 % margin: 4.2 ms
    of a 139-ms step at 16 requests (in-process, creative writing, float32, AVX2 EPYC, 2026-12-07)."""
    n = 16
    d, costs, rids = _draining_drafter(n, draining=False, resting=False)
    d.heads_seconds = d.draft_seconds = 0.0  # what the heads' yield reads after a step in which they ran
    d._heads_nodes = None

    def recorded():
        return {k: costs._seen.get((f"step-{k}", n), 0) for k in STEP_KINDS}

    for heads_ran, proposed, spec, kind in ((True, frozenset(), 0, "heads"), (False, frozenset(), 0, "none"),
                                            (True, frozenset({"lookup"}), 4, "heads"),
                                            (False, frozenset({"lookup"}), 4, "lookup")):
        before = recorded()
        d._proposed_sources = proposed

        def propose(*args, ran=heads_ran, **kwargs):
            d.heads_ran = ran
            return [[] for _ in rids]

        d.propose = propose
        _draft_step(d, rids, [[5]] * n, spec=spec)
        assert {k: v - before[k] for k, v in recorded().items()} == {k: int(k == kind) for k in STEP_KINDS}, \
            (heads_ran, proposed)


def test_a_loss_of_the_heads_drafts_leaves_prompt_lookup_to_its_own_verdict():
    """Where the steps that verified the heads' drafts lost the realised comparison, the heads do not run, but prompt
    lookup still searches and drafts (here its chains, always accepted, pay by the costs: 2 ms a draft row against
    3 ms a plain token at 16); the steps that verify its drafts alone enter the comparison as lookup's
    (``draft_step``), and once those lose too, nothing is drafted. Served at 32 running on ShareGPT (2026-12-06),
    one verdict for both had stopped lookup drafts that were mostly accepted."""
    from vllm_entmtp.step_costs import COMPARE_MIN_DRAFTING

    n = 16
    d, costs, rids = _draining_drafter(n, draining=False, resting=True, others_out=0)
    d.spec_config.entmtp.draft_sources = "hybrid"
    for r in rids:  # a record of lookup drafts accepted whole
        for _ in range(4):
            d.lookup.observe(r, 4, 4)
    assert costs.drafting_loses(n) and not costs.drafting_loses(n, source="lookup")
    chosen, drafts = d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
    assert not d.heads_ran and any(drafts)  # (cut to the rows the step's cap leaves)
    assert all(t == "lookup" and x == [11, 12, 13, 14][:len(x)] for (t, _), x in zip(chosen, drafts) if x)
    # the steps that verify them (every draft token accepted) are judged as lookup's
    drafts = _draft_step(d, rids, [[5]] * n, spec=0)
    for _ in range(COMPARE_MIN_DRAFTING + 1):
        spec = sum(len(x) for x in drafts)
        assert spec and d._proposed_sources == {"lookup"}
        drafts = _draft_step(d, rids, [[*x, 99] for x in drafts], spec=spec)
    lookup_rates = costs.step_rates(n, source="lookup")
    assert lookup_rates is not None and lookup_rates[0] > lookup_rates[1]
    assert costs.drafting_loses(n) and not costs.drafting_loses(n, source="lookup")
    # lookup's own steps now lose: nothing is drafted, neither from lookup nor from the heads
    for _ in range(2 * COMPARE_MIN_DRAFTING):
        costs.record_step(n, n, 0.150, True, source="lookup")
    assert costs.drafting_loses(n, source="lookup")
    _, drafts = d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
    assert drafts == [[]] * n and not d.heads_ran


def test_a_cut_lookup_draft_is_scored_at_the_length_it_was_drafted():
    """A lookup chain cut by ``fit_lookup`` (r0's, to 3 of its 4 tokens while the batch drains, above) and accepted
    whole enters the request's lookup record as a draft accepted whole: 3 tokens and no rejection, not a 4-token
    chain whose last token was rejected (``PromptLookup.observe`` is given the length drafted)."""
    n = 16
    d, _, rids = _draining_drafter(n, draining=True, resting=False)
    drafts = _draft_step(d, rids, [[5]] * n, spec=0)
    assert drafts[0] == [11, 12, 13]
    before, beta = list(d.lookup._record["r0"]), d.lookup._beta
    _draft_step(d, rids, [[11, 12, 13, 14]] + [[5]] * (n - 1), spec=3, accepted=[3] + [0] * (n - 1))
    accepted, rejections = d.lookup._record["r0"]
    assert accepted == pytest.approx(beta * before[0] + 3) and rejections == pytest.approx(beta * before[1])


def test_the_load_trace_records_the_rules_answers_and_the_drafts_of_each_step(tmp_path):
    """benchmarks/load_trace.py: the step hook wraps the drafter's load-rule calls on its first step and writes, per
    engine step, the step's requests and verified draft tokens with the decisions of the drafter's call before it;
    the summary splits levels at gaps and counts the drain's steps, drafted and not."""
    from types import SimpleNamespace

    from conftest import load_benchmark

    lt = load_benchmark("load_trace")
    n = 16
    d, _, rids = _draining_drafter(n, draining=True, resting=True)
    hook = lt.LoadTrace(str(tmp_path / "trace"))
    runner = SimpleNamespace(drafter=d)

    def step(t, spec):
        hook(runner, SimpleNamespace(num_scheduled_tokens={r: 1 + (4 if r in spec else 0) for r in rids},
                                     scheduled_new_reqs=[], scheduled_spec_decode_tokens=spec), t)

    step(0.0, {})
    d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
    step(0.05, {"r0": [11, 12, 13, 14]})
    d._propose_scheduled(None, None, rids, [4] * n, [True] * n)
    step(0.09, {"r0": [11, 12, 13, 14]})
    step(5.0, {})  # a new level
    step(5.03, {})
    rows = lt.read(hook.path)
    assert [r["spec"] for r in rows] == [0, 4, 4, 0, 0] and all(r["reqs"] == n for r in rows)
    import gzip  # results folders keep traces compressed
    with open(hook.path, "rb") as src, gzip.open(tmp_path / "kept.jsonl.gz", "wb") as dst:
        dst.write(src.read())
    assert lt.read(str(tmp_path / "kept.jsonl.gz")) == rows
    first = rows[1]  # the drafter's call that ended step 0
    assert first["n"] == n and first["draining"] and first["valued"] and first["drafted"] == 1
    assert first["draft_tokens"] == 3 and first["probe"] == [False] and "loses" not in first  # valued: no rest
    assert first["lookup_tokens"] == 3  # r0's draft is its lookup chain (cut to 3 tokens)
    # the heads did not run: r0 takes its lookup draft
    assert first["heads_rows"] == [] and first["heads_drafted"] == []
    # the realised comparison as the rule read it: the full batch's steps with the heads' drafts behind (resting)
    assert first["rates"]["heads"] == pytest.approx([round(x, 1) for x in d.step_costs.step_rates(n)])
    assert first["rates"]["heads"][0] < first["rates"]["heads"][1] and first["rates"]["lookup"] is None
    assert "n" not in rows[0] and "n" not in rows[3]  # no call before them
    levels = lt.levels(rows)
    assert [len(lv) for lv in levels] == [3, 2]
    s = lt.summarize(levels[0])
    assert s["steps"] == 3 and s["seconds"] == pytest.approx(0.09)
    assert s["by_batch"][n]["plain_steps"] == 1 and s["by_batch"][n]["drafted_steps"] == 1
    # step 1 drained (its drafts were proposed in a draining batch) and verified a draft; step 0 is not known to
    assert s["draining"]["steps"] == 1 and s["draining"]["drafted_steps"] == 1 and s["draining"]["probe"] == 0
    assert "level 0: 3 steps" in lt.report([hook.path], min_steps=1)
    assert "level 0: 5 steps" in lt.report([hook.path], min_steps=1, gap=10.0)  # one level where 5 s is no gap


def test_the_load_trace_report_gives_a_drafted_step_the_tokens_the_next_line_says_it_accepted(tmp_path):
    """benchmarks/load_trace.py: a line's ``accepted`` is what the step before it accepted (the drafter's
    ``draft_step`` ends that step), so the summary credits it to that step, with the step's own draft tokens."""
    from conftest import load_benchmark

    lt = load_benchmark("load_trace")
    lines = [dict(t=0.0, reqs=4, tokens=4, new=0, spec=0),
             dict(t=0.05, reqs=4, tokens=9, new=0, spec=5, n=4, drafted=2, draft_tokens=5, lookup_tokens=4,
                  accepted=0),
             dict(t=0.12, reqs=4, tokens=4, new=0, spec=0, n=4, drafted=0, draft_tokens=0, lookup_tokens=0,
                  accepted=3),
             dict(t=0.16, reqs=4, tokens=4, new=0, spec=0, accepted=0)]
    path = tmp_path / "trace-1.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = lt.summarize(lt.read(str(path)))["by_batch"][4]
    assert c["drafted_steps"] == 1 and c["plain_steps"] == 2
    assert c["draft_tokens"] == 5 and c["lookup_tokens"] == 4 and c["accepted"] == 3
    assert c["drafted_seconds"] == pytest.approx(0.07)
    assert "| 4 | 3 | 0.16 | 0 | 1 | 70.0 | 5.0 | 4.0 | 3.0 | 2 | 45.0 |" in lt.report([str(path)], min_steps=1)


def test_the_load_trace_splits_a_batch_sizes_steps_by_what_the_drafter_did_at_their_end(tmp_path):
    """benchmarks/load_trace.py --drafter-at: a step's time includes the drafter's call at its end (the next line
    holds what that call did), so the steps are grouped by it: the heads ran and drafted, ran and drafted nothing, or
    did not run; a step with prompt tokens, of another batch size, or the level's last is left out."""
    from conftest import load_benchmark

    lt = load_benchmark("load_trace")
    call = dict(n=4, drafted=0, draft_tokens=0, lookup_tokens=0, accepted=0)
    lines = [dict(t=0.0, reqs=4, tokens=4, new=0, spec=0),
             # each line: a step's start, and what the drafter did at the end of the step before
             dict(t=0.050, reqs=4, tokens=4, new=0, spec=0, **call, heads_ran=True),  # step 0: heads, nothing
             dict(t=0.100, reqs=4, tokens=4, new=0, spec=0, **call, heads_ran=False),  # step 1: no heads
             dict(t=0.146, reqs=4, tokens=6, new=0, spec=2, **(call | dict(drafted=1, draft_tokens=2)),
                  heads_ran=True),  # step 2: heads, drafted
             dict(t=0.216, reqs=4, tokens=4, new=1, spec=0, **call, heads_ran=False),  # step 3 (verified 2)
             dict(t=0.300, reqs=5, tokens=5, new=0, spec=0, **call, heads_ran=False),  # step 4: a prompt step
             dict(t=0.340, reqs=5, tokens=5, new=0, spec=0, **call, heads_ran=False)]
    path = tmp_path / "trace-2.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = {k: (n, round(ms, 6)) for k, (n, ms) in lt.by_drafter(lt.read(str(path)), 4).items()}
    assert got == {(False, "heads, nothing drafted"): (1, 50.0), (False, "no heads"): (1, 50.0),
                   (False, "heads, drafted"): (1, 46.0), (True, "no heads"): (1, 70.0)}
    assert "| no | heads, nothing drafted | 1 | 50.0 |" in lt.report([str(path)], min_steps=1, drafter_at=4)
