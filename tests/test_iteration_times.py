"""benchmarks/iteration_times.py: reads the per-iteration lines vLLM's own logger writes."""
from __future__ import annotations

import logging
import types

from conftest import load_benchmark

it = load_benchmark("iteration_times")


def vllm_lines(steps: list[tuple[int, int, int, int, float, bool]]) -> list[str]:
    """Log lines as vLLM 0.32's LoggingStatLogger writes them for these iterations
    ``(ctx requests, ctx tokens, gen requests, gen tokens, ms, dummy)``."""
    from vllm.v1.metrics import loggers
    from vllm.v1.metrics.stats import SchedulerIterationDetails, SchedulerStats

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    log = logging.getLogger("test-iteration-times")
    log.handlers[:] = [Keep()]
    log.setLevel(logging.INFO)
    log.propagate = False
    me = types.SimpleNamespace(_log_prefix_for_engine=lambda idx: "Engine 000: ", kv_cache_device="CPU")
    orig = loggers.logger
    loggers.logger = log
    try:
        for i, (cr, ct, gr, gt, ms, dummy) in enumerate(steps):
            stats = SchedulerStats()
            stats.iteration_details = SchedulerIterationDetails(i, cr, ct, gr, gt, ms, is_dummy=dummy)
            loggers.LoggingStatLogger._log_iteration_details(me, stats, 0)
    finally:
        loggers.logger = orig
    return [f"(APIServer pid=1) INFO 12-03 16:37:41 [loggers.py:199] {r}" for r in records]


def test_vllms_lines_are_read_and_like_steps_compared():
    lines = vllm_lines([(1, 116, 0, 0, 97.5, False),   # a prompt
                        (0, 0, 2, 2, 20.0, False),     # two requests decode, no draft tokens
                        (0, 0, 2, 2, 22.0, False),
                        (0, 0, 2, 2, 30.0, False),
                        (0, 0, 2, 5, 25.0, False),     # three draft tokens verified
                        (0, 0, 1, 1, 9.0, False),      # one request: not a step of two
                        (1, 40, 1, 1, 50.0, False),    # a prompt chunk beside a decoding request
                        (0, 0, 0, 0, 0.0, True)])      # a data-parallel dummy iteration
    its = it.parse_iterations(["unrelated line", *lines])
    assert [(i["ctx_tokens"], i["gen_requests"], i["gen_tokens"], i["ms"]) for i in its][:2] == [
        (116, 0, 0, 97.5), (0, 2, 2, 20.0)]
    assert len(its) == 7  # the dummy iteration is left out
    s = it.summarize(its, 2)
    assert s["no_draft"] == {"steps": 3, "median_ms": 22.0, "mean_ms": 24.0}
    assert s["drafted"] == {"steps": 1, "median_ms": 25.0, "mean_ms": 25.0, "rows": 5.0}
    assert s["by_draft_tokens"] == {3: {"steps": 1, "median_ms": 25.0, "mean_ms": 25.0}}
    assert s["prefill"] == {"steps": 2, "total_ms": 147.5, "ctx_tokens": 156, "large_steps": 0,
                            "large_ms_per_1k": None}
    assert it.summarize(its, 3)["no_draft"]["steps"] == 0


def test_cli_table_and_a_log_without_iteration_lines(tmp_path, capsys):
    good, bad = tmp_path / "a.log", tmp_path / "b.log"
    good.write_text("\n".join(vllm_lines([(0, 0, 1, 1, 10.0, False), (0, 0, 1, 3, 12.0, False)])) + "\n")
    bad.write_text("INFO nothing here\n")
    assert it.main([str(good), "--requests", "1"]) == 0
    out = capsys.readouterr().out
    assert "| a.log | 2 | 1 | 10.00 | 10.00 | 1 | 12.00 | 3.00 | 0 | 0 | - |" in out
    assert it.main([str(good), str(bad)]) == 2
    assert "b.log has no iteration lines" in capsys.readouterr().err
    import gzip  # results folders keep server logs compressed

    packed = tmp_path / "a.log.gz"
    packed.write_bytes(gzip.compress(good.read_bytes()))
    assert it.main([str(packed), "--requests", "1"]) == 0
    assert "| a.log.gz | 2 | 1 | 10.00 | 10.00 | 1 | 12.00 | 3.00 | 0 | 0 | - |" in capsys.readouterr().out


def test_drafted_steps_by_draft_tokens_against_a_plain_log(tmp_path, capsys):
    plain, spec = tmp_path / "plain.log", tmp_path / "spec.log"
    plain.write_text("\n".join(vllm_lines([(0, 0, 1, 1, 10.0, False), (0, 0, 1, 1, 12.0, False)])) + "\n")
    spec.write_text("\n".join(vllm_lines([(0, 0, 1, 1, 13.0, False),   # no draft tokens
                                          (0, 0, 1, 2, 11.0, False),   # one draft token
                                          (0, 0, 1, 2, 12.0, False),
                                          (0, 0, 1, 2, 16.0, False),
                                          (0, 0, 1, 3, 13.2, False)])) + "\n")  # two
    s = it.summarize(it.parse_iterations(spec.read_text().splitlines()), 1)
    assert s["by_draft_tokens"] == {1: {"steps": 3, "median_ms": 12.0, "mean_ms": 13.0},
                                    2: {"steps": 1, "median_ms": 13.2, "mean_ms": 13.2}}
    assert it.main([str(plain), str(spec), "--by-draft-tokens", "--baseline", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "| spec.log | 1 | 3 | 12.00 | 1.091 |" in out  # 12.0 / plain's 11.0
    assert "| spec.log | 2 | 1 | 13.20 | 1.200 |" in out
    assert it.main([str(spec), "--by-draft-tokens"]) == 0  # each log against its own steps without drafts
    assert "| spec.log | 1 | 3 | 12.00 | 0.923 |" in capsys.readouterr().out
    assert it.main([str(spec), "--by-draft-tokens", "--baseline", "other.log"]) == 2
    assert "--baseline other.log is not one of the logs" in capsys.readouterr().err


def test_bad_requests(tmp_path, capsys):
    assert it.main([str(tmp_path / "x.log"), "--requests", "0"]) == 2
    assert "--requests must be >= 1" in capsys.readouterr().err


def test_prompt_steps_of_a_burst_are_read_per_1000_prompt_tokens(tmp_path, capsys):
    """Steps of LARGE_PREFILL prompt tokens or more give the prompt's cost per 1,000 tokens (their total ms over
    their total prompt tokens); smaller prompt steps count in the totals only."""
    its = it.parse_iterations(vllm_lines([(22, 2047, 1, 1, 600.0, False),   # a burst's prompts
                                          (10, 959, 22, 22, 380.0, False),   # the rest, under LARGE_PREFILL
                                          (31, 2000, 1, 1, 1000.0, False),
                                          (0, 0, 32, 32, 60.0, False)]))
    pf = it.summarize(its, 32)["prefill"]
    assert it.LARGE_PREFILL == 1024
    assert pf == {"steps": 3, "total_ms": 1980.0, "ctx_tokens": 5006, "large_steps": 2,
                  "large_ms_per_1k": round(1000 * 1600.0 / 4047, 1)}
    log = tmp_path / "burst.log"
    log.write_text("\n".join(vllm_lines([(22, 2000, 1, 1, 600.0, False), (0, 0, 32, 32, 60.0, False)])) + "\n")
    assert it.main([str(log), "--requests", "32"]) == 0
    assert "| burst.log | 2 | 1 | 60.00 | 60.00 | 0 | - | - | 1 | 600 | 300.0 |" in capsys.readouterr().out
