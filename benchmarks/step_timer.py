"""In-engine step times for benchmarks: a step hook (``$VLLM_ENTMTP_STEP_HOOK=step_timer``) that times every engine
step decoding one request, by the draft nodes it verified.

The plugin calls a step hook in the worker at the start of every step (:func:`vllm_entmtp.stats.load_step_hook`:
the module named in the variable, imported in the engine's worker process, with this folder on its path);
``benchmarks/ablation.py`` sets it. ``step_ms`` comes back in ``vllm_entmtp.stats.worker_stats`` (the hook's
:meth:`StepTimes.stats`), and :func:`step_costs_from_times` makes step costs of it that ``vllm-entmtp build-trees
--step-costs`` reads.
"""
from __future__ import annotations

import statistics

from vllm_entmtp.stats import parse_step_key, step_key


class StepTimer:
    """Wall time of engine steps that decode one request, by the draft nodes verified in the step and whether they
    form a tree that needs the tree-attention fix (:func:`vllm_entmtp.stats.step_key`).

    The latest ``cap`` per key are kept. Medians of these are the in-engine step costs that
    ``benchmarks/ablation.py`` reports and ``vllm-entmtp build-trees --step-costs`` reads; they are immune to the
    noise spikes that sink a tokens-per-second ratio on a shared machine.
    """

    def __init__(self, cap: int = 4096):
        self.cap = cap
        self._times: dict[str, list[float]] = {}
        self._next: dict[str, int] = {}

    def record(self, key: str, seconds: float) -> None:
        """One step of kind ``key`` that took ``seconds``."""
        buf = self._times.setdefault(key, [])
        if len(buf) < self.cap:
            buf.append(seconds)
        else:  # ring: overwrite the oldest
            i = self._next.get(key, 0)
            buf[i] = seconds
            self._next[key] = (i + 1) % self.cap

    def summary(self) -> dict[str, dict]:
        """``{key: {"n": steps, "median_ms": ms, "p25_ms": ms, "p75_ms": ms}}``, by nodes."""
        out = {}
        for key in sorted(self._times, key=parse_step_key):
            v = sorted(self._times[key])
            q = lambda f: 1e3 * v[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
            out[key] = {"n": len(v), "median_ms": round(1e3 * statistics.median(v), 4),
                        "p25_ms": round(q(0.25), 4), "p75_ms": round(q(0.75), 4)}
        return out


class StepTimes:
    """The step hook: a step that decodes one request (no prompt tokens) is timed from its start to the start of
    the next step of the same request, i.e. the whole engine step period (forward, verification, sampling,
    drafting, vLLM's scheduler and output processing), keyed by its draft nodes and whether they need the
    tree-attention fix."""

    def __init__(self, cap: int = 4096):
        self.timer = StepTimer(cap)
        self.started: tuple | None = None  # (request id, key, start) of the step being timed

    def __call__(self, runner, scheduler_output, t0: float) -> None:
        from vllm_entmtp.step import STEP  # the step's draft trees by batch row, set before the hook runs

        ids = list(scheduler_output.num_scheduled_tokens)
        nodes = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
        key = step_key(nodes, any(tr.fix_rows for tr in STEP.rows.values()))
        decoding = len(ids) == 1 and scheduler_output.total_num_scheduled_tokens == nodes + 1
        prev = self.started
        if prev is not None and decoding and prev[0] == ids[0]:
            self.timer.record(prev[1], t0 - prev[2])
        self.started = (ids[0], key, t0) if decoding else None

    def stats(self) -> dict:
        """``{"step_ms": StepTimer.summary()}``, merged into ``vllm_entmtp.stats.worker_stats``."""
        return {"step_ms": self.timer.summary()}


def make_hook() -> StepTimes:
    """The hook the plugin builds once per worker (:func:`vllm_entmtp.stats.load_step_hook`)."""
    return StepTimes()


def step_costs_from_times(step_ms: dict[str, dict]) -> dict[str, float]:
    """``{key: median step time / median step time with 0 nodes}`` (empty without 0-node steps)."""
    base = step_ms.get("0", {}).get("median_ms")
    if not base:
        return {}
    return {n: round(v["median_ms"] / base, 4) for n, v in step_ms.items() if n != "0"}
