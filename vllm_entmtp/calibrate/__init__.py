"""Build a tree set for the scheduler (bins on the entropy signal, the default, or on confidence) from measured
statistics: ``vllm-entmtp build-trees``.

The target model decodes a prompt set greedily (transformers, float32, its chat template). Along its own
continuation ``y`` it records, at every generated position ``t``, the entropy (nats) of the distribution
``y_{t+1}`` was drawn from (what the runtime ``EntropyTracker`` sees) and, for every head ``d``, the rank of the
true token ``y_{t+d+2}`` in head ``d``'s distribution (Hydra heads are fed the true path ``y_{t+1..t+d+1}``).
Positions are split into entropy bins; per bin ``P[d][r]`` is the share of positions where head ``d``'s rank
is ``r``. Under the independence assumption of Medusa's tree search a tree's expected accepted draft tokens
are ``sum over nodes (r_0..r_d) of prod_i P[i][r_i]``; a greedy search (Medusa, Cai et al. 2024, arXiv
2401.10774, section 2.3.3 "Searching for the optimized tree construction"; ``explore_graph`` in
FasterDecoding/Medusa ``medusa/eval/gen_results.py``) gives one tree per node budget, the cost of verifying
and drafting each tree is measured on this machine (Sequoia's hardware-aware choice, Chen et al. 2024, arXiv
2402.12374), and per bin the Pareto frontier of (cost, expected tokens per step) and the tree with the best
expected speed-up are kept. The output is a tree-set JSON file with a ``schedule`` (``docs/trees.md``) that
:class:`vllm_entmtp.scheduler.TreeScheduler` reads, a PNG of the frontiers and a printed summary.

Torch and transformers only (no vLLM import). The per-position statistics are cached next to ``--out``, so a
second run with other budgets, bins or ranks only redoes the cheap part; an interrupted run resumes at the next
prompt.

Modules, in the order of the data (each imports only those above it):

==============  ===============================================================================================
``acceptance``  expected accepted tokens of a tree from ``P``; the greedy tree search
``signals``     the scheduler's signal per position, the top-1 chain's outcome there, signal correlations
``bins``        signal bins and their rank tables ``P``
``target``      the target pass: greedy continuation, head ranks, the runtime drafter's top-1 probabilities
``records``     per-prompt records, their cache, the identities of inputs
``costs``       step costs: timed verification and drafting here, or read from measurements in vLLM
``search``      per bin: candidate trees, Pareto frontier, best speed-up; the expected overall speed-up
``chain_stop``  the chain-stop schedule fitted on the calibration's outcomes
``tree_set``    the tree-set JSON object and its schedule
``report``      the frontier plot and the summary table
``cli``         the ``build-trees`` options and run
==============  ===============================================================================================
"""
