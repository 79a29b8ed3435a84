"""Per-request lifetimes: every piece of per-request state the plugin keeps lives until vLLM no longer holds the
request (finished, aborted, preempted and dropped), and is dropped in one place.

The drafter (:class:`~vllm_entmtp.drafter.EntMTPProposer`) registers each holder of per-request state once (its
pending trees, the tracker, the scheduler, the prompt lookup, the prefix-layer cache, the training recorder);
every step, :meth:`Lifetimes.free_missing` hands each holder the ids vLLM still holds. A holder is a ``dict`` or
``set`` keyed by request id, or an object with ``free_missing(live)`` and ``tracked_ids()``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol


class Holder(Protocol):
    def free_missing(self, live: set | dict) -> object: ...

    def tracked_ids(self) -> set[str]: ...


def drop_missing(per_request: dict | set, active_ids: Iterable[str]) -> int:
    """Delete the keys (or members) of ``per_request`` that are not in ``active_ids``; return how many."""
    active = active_ids if isinstance(active_ids, (set, frozenset, dict)) else set(active_ids)
    gone = [r for r in per_request if r not in active]
    for r in gone:
        if isinstance(per_request, set):
            per_request.discard(r)
        else:
            del per_request[r]
    return len(gone)


class Lifetimes:
    """The holders of per-request state, by name; :meth:`free_missing` drops what vLLM no longer holds."""

    def __init__(self) -> None:
        self._holders: dict[str, Callable[[], dict | set | Holder | None]] = {}

    def add(self, name: str, holder: Callable[[], dict | set | Holder | None]) -> None:
        """Register ``holder``: a function returning the container or object (None: not in use now), read at
        each call, so that a holder switched off later (the scheduler on a backend without tree attention)
        is skipped."""
        if name in self._holders:
            raise ValueError(f"a holder named {name!r} is registered already")
        self._holders[name] = holder

    def _live_holders(self):
        for name, get in self._holders.items():
            h = get()
            if h is not None:
                yield name, h

    def free_missing(self, live_req_ids: Iterable[str]) -> None:
        """Drop, in every holder, the state of each request not in ``live_req_ids``."""
        live = live_req_ids if isinstance(live_req_ids, (set, frozenset, dict)) else set(live_req_ids)
        for _, h in self._live_holders():
            if isinstance(h, (dict, set)):
                drop_missing(h, live)
            else:
                h.free_missing(live)

    def held(self) -> dict[str, set[str]]:
        """``{holder name: request ids it holds state for}``, holders holding none left out."""
        out = {}
        for name, h in self._live_holders():
            ids = set(h) if isinstance(h, (dict, set)) else set(h.tracked_ids())
            if ids:
                out[name] = ids
        return out

    def held_ids(self) -> set[str]:
        """Every request id any holder holds state for."""
        return set().union(*self.held().values())
